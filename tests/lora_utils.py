"""Tiny random PEFT LoRA adapters for the LoRA tests, made with peft itself (the oracle)."""
from __future__ import annotations

import copy
from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(hf, path: Path, seed: int, rank: int = 8, alpha: int = 16, targets=ALL_TARGETS,
                 use_rslora: bool = False, scale: float = 0.3):
    """A PEFT model over a copy of `hf` whose lora_A and lora_B are random (peft starts B at
    zero, which would make every adapter the base model), saved to `path`. Returns it (float32,
    eval): the oracle for this adapter."""
    from peft import LoraConfig, get_peft_model
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none",
                     use_rslora=use_rslora, task_type="CAUSAL_LM")
    model = get_peft_model(copy.deepcopy(hf), cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    model.save_pretrained(str(path))
    return model.float().eval()


def oracle_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens by a plain forward loop (no generate): the whole sequence each step."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):]
