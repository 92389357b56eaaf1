"""`speculative_config`: vLLM's keys, checked once (EngineConfig.__post_init__ calls `parse`)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

# Methods vLLM has that pagedserve does not (yet): refused by name.
UNSUPPORTED_METHODS = ("draft_model", "eagle", "eagle3", "medusa", "mtp", "mlp_speculator", "deepseek_mtp")
# Why draft_model is not built: a draft model runs k one-token steps of its own (with its own
# paged KV) before each verification, and the only same-tokenizer draft the project ships is a
# quantized copy of the default model itself, whose step costs about the target's (native Q4_1
# 83.9 tok/s against bf16 89.2 on the 2-core machine), so k + 1 steps' cost would buy at most
# k + 1 tokens: a loss by construction until a smaller draft model exists.
DRAFT_MODEL_REFUSAL = ("speculative_config method 'draft_model' is not yet supported by pagedserve: its draft "
                       "would be a quantized copy of the target (the only model sharing its tokenizer), whose "
                       "decode step costs about as much as the target's, so k draft steps plus a verification "
                       "cost more than the at most k + 1 tokens they give; use 'ngram' or 'suffix'")
METHODS = ("ngram", "suffix")

# Drafts are off while more requests than this run: verifying 1+k tokens per sequence costs
# about one decode only while a step is bound by weight reads, i.e. at small batches. 4 is a
# conservative guess for this CPU; `benchmarks/spec_decode.py --crossover` measures where the
# cost of a 1+k-token step exceeds the tokens it gains.
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    # A request stops getting drafts once it has had this many proposals with an acceptance
    # rate (accepted / proposed draft tokens) below min_acceptance: guessing costs slots.
    min_acceptance: float = 0.1
    min_acceptance_after: int = 16
    # method "suffix" (spec_decode/suffix.py), vLLM's keys. max_cached_requests is small here:
    # the search's cost grows with the cached tokens (vLLM's suffix tree allows 10000).
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 64
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def as_dict(self) -> dict:
        return asdict(self)


def parse(value: Any) -> SpeculativeConfig | None:
    """A SpeculativeConfig from a dict, a JSON string (the --speculative-config flag), one
    already made, or None (off). ValueError names what is wrong."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config must be JSON, e.g. "
                             f"'{{\"method\": \"ngram\", \"num_speculative_tokens\": 3}}': {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a dict or a JSON object; got {type(value).__name__}")
    d = dict(value)
    method = d.get("method") or ("ngram" if "prompt_lookup_max" in d or "prompt_lookup_min" in d else None)
    if method is None:
        raise ValueError("speculative_config needs a method (supported: ngram)")
    if method == "draft_model":
        raise ValueError(DRAFT_MODEL_REFUSAL)
    if method in UNSUPPORTED_METHODS:
        raise ValueError(f"speculative_config method {method!r} is not yet supported by pagedserve "
                         f"(supported: {', '.join(METHODS)})")
    if method not in METHODS:
        raise ValueError(f"unknown speculative_config method {method!r} (supported: {', '.join(METHODS)})")
    d["method"] = method
    known = set(SpeculativeConfig.__dataclass_fields__)
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"speculative_config has unknown keys {unknown} (known: {', '.join(sorted(known))})")
    if d.get("disable_by_batch_size") is None:
        d.pop("disable_by_batch_size", None)
    if method == "suffix":   # as vLLM: the draft length defaults to the tree depth
        d.setdefault("num_speculative_tokens", d.get("suffix_decoding_max_tree_depth", 24))
    if "num_speculative_tokens" not in d:
        raise ValueError("speculative_config needs num_speculative_tokens (the draft length k)")
    # As vLLM: one of the two lookup bounds given sets the other.
    if d.get("prompt_lookup_min") is None and d.get("prompt_lookup_max") is not None:
        d["prompt_lookup_min"] = d["prompt_lookup_max"]
    elif d.get("prompt_lookup_max") is None and d.get("prompt_lookup_min") is not None:
        d["prompt_lookup_max"] = d["prompt_lookup_min"]
    d = {key: v for key, v in d.items() if v is not None}
    cfg = SpeculativeConfig(**d)
    if not 1 <= cfg.num_speculative_tokens <= 32:
        raise ValueError(f"num_speculative_tokens must be in [1, 32], got {cfg.num_speculative_tokens}")
    if cfg.suffix_decoding_max_tree_depth < 1 or cfg.suffix_decoding_max_cached_requests < 0 or \
            cfg.suffix_decoding_max_spec_factor <= 0 or not 0 <= cfg.suffix_decoding_min_token_prob <= 1:
        raise ValueError("suffix decoding needs max_tree_depth >= 1, max_cached_requests >= 0, "
                         "max_spec_factor > 0 and min_token_prob in [0, 1]")
    if not 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max:
        raise ValueError(f"need 1 <= prompt_lookup_min ({cfg.prompt_lookup_min}) <= prompt_lookup_max "
                         f"({cfg.prompt_lookup_max})")
    if cfg.disable_by_batch_size < 1:
        raise ValueError(f"disable_by_batch_size must be >= 1, got {cfg.disable_by_batch_size}")
    return cfg
