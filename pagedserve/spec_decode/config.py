"""`speculative_config`: vLLM's keys, checked once (EngineConfig.__post_init__ calls `parse`)."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

# Methods vLLM has that pagedserve does not (yet): refused by name.
UNSUPPORTED_METHODS = ("eagle", "eagle3", "medusa", "mtp", "mlp_speculator", "deepseek_mtp")
METHODS = ("ngram", "suffix", "draft_model")

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
    # method "draft_model" (spec_decode/draft_model.py), vLLM's keys: the draft (a path or a Hub
    # id, models/resolve.py; a .gguf file runs in its blocks like any GGUF model), its revision
    # and its quantization (EngineConfig.quantization's values; None: the file's own).
    model: str | None = None
    revision: str | None = None
    quantization: str | None = None
    draft_tensor_parallel_size: int | None = None

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
    method = d.get("method")
    if method is None:   # as vLLM: a draft model named without a method is one
        method = "draft_model" if d.get("model") else \
            "ngram" if "prompt_lookup_max" in d or "prompt_lookup_min" in d else None
    if method is None:
        raise ValueError(f"speculative_config needs a method (supported: {', '.join(METHODS)})")
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
    _check_types(d)
    if method == "draft_model" and not d.get("model"):
        raise ValueError("speculative_config method 'draft_model' needs 'model': the draft model's path or Hub id "
                         "(a smaller model with the target's vocabulary, e.g. a quantized .gguf copy of it)")
    if method != "draft_model" and d.get("model"):
        raise ValueError(f"speculative_config key 'model' names a draft model: it needs method 'draft_model', "
                         f"not {method!r}")
    if (d.get("draft_tensor_parallel_size") or 1) != 1:
        raise ValueError(f"speculative_config draft_tensor_parallel_size={d['draft_tensor_parallel_size']}: the "
                         f"draft model runs unsharded (draft_tensor_parallel_size 1)")
    if d.get("quantization") is not None and d["quantization"] not in ("gguf", "q8_0", "q4_0"):
        raise ValueError(f"speculative_config quantization {d['quantization']!r}: supported are gguf, q8_0, q4_0")
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
    if cfg.prompt_lookup_max > MAX_PROMPT_LOOKUP:
        raise ValueError(f"prompt_lookup_max must be at most {MAX_PROMPT_LOOKUP}, got {cfg.prompt_lookup_max}")
    if cfg.disable_by_batch_size < 1:
        raise ValueError(f"disable_by_batch_size must be >= 1, got {cfg.disable_by_batch_size}")
    if cfg.min_acceptance < 0 or cfg.min_acceptance_after < 0:     # (above 1: drafts always stop)
        raise ValueError(f"need min_acceptance >= 0 (got {cfg.min_acceptance}) and min_acceptance_after "
                         f">= 0 (got {cfg.min_acceptance_after})")
    return cfg


MAX_PROMPT_LOOKUP = 1024        # an n-gram longer than this never matches usefully; bounds the search
_KINDS = {"int": ((int,), "an integer"), "float": ((int, float), "a number"), "str": ((str,), "a string")}


def _check_types(d: dict) -> None:
    """Every value given of its declared type (a bool is no number), as EngineConfig checks its
    own: 2.5 or "3" tokens would start and then fail every request."""
    for f in fields(SpeculativeConfig):
        value = d.get(f.name)
        if value is None:       # not given (or None: the default)
            continue
        types, what = _KINDS[f.type.removesuffix(" | None")]
        if isinstance(value, bool) or not isinstance(value, types) or \
                (isinstance(value, float) and not math.isfinite(value)):
            raise ValueError(f"speculative_config {f.name} must be {what}; got {value!r}")
