"""PoolingParams: what an embedding request asks for (vLLM's name). A pooling request is one
prompt computed once (prefill only: no decode, no sampler); its pooled hidden state is its output."""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.errors import InvalidRequestError


@dataclass
class PoolingParams:
    dimensions: int | None = None        # keep the first N dimensions (Matryoshka models only)
    normalize: bool | None = None        # None: the engine's pooler_config (default true)
    truncate_prompt_tokens: int | None = None   # keep the last N prompt tokens

    # One sequence per request (the scheduler's and KV manager's view of a request).
    n = 1
    best_of = 1

    def __post_init__(self) -> None:
        if self.dimensions is not None and self.dimensions < 1:
            raise InvalidRequestError(f"dimensions must be >= 1, got {self.dimensions}", "dimensions")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise InvalidRequestError(f"truncate_prompt_tokens must be >= 1, got {self.truncate_prompt_tokens}",
                                      "truncate_prompt_tokens")
