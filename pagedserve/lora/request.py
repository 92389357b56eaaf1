"""A LoRA adapter as a request names it (vLLM's LoRARequest, at vLLM's import path)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: what clients call it (the server's `model` field); lora_int_id: a positive id,
    unique per adapter in one engine; lora_path: a PEFT directory (adapter_config.json +
    adapter_model.safetensors) or a Hub id. fingerprint: set by the engine when it checks the
    adapter (lora/registry.py): a hash of its files' content. Prefix-cache blocks are keyed by
    `cache_key` (the id and that fingerprint), never by the name: a name unloaded and loaded
    again from other files, or one name given two ids, must not share blocks."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    fingerprint: str = field(default="", compare=False, repr=False)

    @property
    def cache_key(self) -> str:
        return f"{self.lora_int_id}:{self.fingerprint}"

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string; got {self.lora_name!r}")
        if not self.lora_name.isprintable():     # a name goes into log lines: no forged lines
            raise ValueError(f"lora_name must hold printable characters only; got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1; got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_path is empty")
