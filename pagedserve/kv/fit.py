"""Whether a request could ever fit a KV cache: arithmetic on the cache's sizes, no state.

Each cache (kv/interface.py) has one of these as its `fit`, a frozen value: the engine hands
it out as data (engine/request_checks.RequestLimits), so the event loop can refuse a request
that could never run while the queue looks full, without asking the engine's thread.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.errors import InvalidRequestError
from pagedserve.kv.groups import window_bound
from pagedserve.utils import cdiv


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class PagedFit:
    """The paged cache (kv_cache_manager.py): blocks as tokens need them, prompts shared."""
    num_blocks: int
    block_size: int
    windows: tuple[int | None, ...] = (None,)   # each KV group's sliding window (None: full attention)
    max_step_tokens: int | None = None          # the most tokens a sequence computes in one step

    def blocks_needed(self, prompt_len: int, max_tokens: int, max_seqs: int) -> int:
        """Blocks a request needs at its largest (its sequences share the prompt's blocks). A
        window group never holds more than its window (with a prompt's chunk) per sequence."""
        B = self.block_size
        if max_seqs == 1:
            full = cdiv(prompt_len + max_tokens, B)
        else:
            full = cdiv(prompt_len, B) + max_seqs * (cdiv(max_tokens, B) + 1)
        chunk = min(prompt_len, self.max_step_tokens or prompt_len)
        return sum(full if w is None else min(full, window_bound(w, B, chunk) + max_seqs * window_bound(w, B))
                   for w in self.windows)

    def check(self, prompt_len: int, max_tokens: int, max_seqs: int = 1, shares_blocks: bool = False) -> None:
        """InvalidRequestError for a request this cache could never hold, even alone."""
        needed = self.blocks_needed(prompt_len, max_tokens, max_seqs)
        if needed > self.num_blocks:
            raise InvalidRequestError(
                f"request can never fit in the KV cache: its prompt ({prompt_len} tokens) plus max_tokens "
                f"({max_tokens}) {'over ' + str(max_seqs) + ' sequences ' if max_seqs > 1 else ''}"
                f"needs {needed} blocks of {self.block_size} tokens, and the cache has "
                f"{self.num_blocks}; raise kv_cache_memory or lower max_tokens")


@dataclass(frozen=True)
class ContiguousFit:
    """The contiguous baselines (contiguous.py): one private region per sequence, reserved whole."""
    num_blocks: int
    block_size: int
    policy: str                  # max | pow2 | oracle (contiguous.py says what each reserves)
    max_model_len: int | None

    def reservation_slots(self, max_len: int) -> int:
        """Slots reserved for a sequence that can reach `max_len` tokens."""
        if self.policy == "max":
            return self.max_model_len
        if self.policy == "pow2":   # a sequence never grows past max_model_len: no need to round beyond
            slots = next_pow2(max_len)
            return slots if self.max_model_len is None else max(max_len, min(slots, self.max_model_len))
        return max_len

    def reservation_blocks(self, max_len: int) -> int:
        return cdiv(self.reservation_slots(max_len), self.block_size)

    def check(self, prompt_len: int, max_tokens: int, max_seqs: int = 1, shares_blocks: bool = False) -> None:
        """InvalidRequestError for a request these regions could never hold, even alone."""
        if shares_blocks:
            raise InvalidRequestError(
                f"kv_allocator={self.policy!r} reserves one private contiguous region per sequence and "
                "cannot share blocks: n > 1, best_of > 1 and beam search need kv_allocator='paged'")
        need = self.reservation_blocks(prompt_len + max_tokens)
        if need > self.num_blocks:
            raise InvalidRequestError(
                f"request can never fit in the KV cache: kv_allocator={self.policy!r} reserves "
                f"{self.reservation_slots(prompt_len + max_tokens)} slots ({need} blocks of {self.block_size}) "
                f"for a {prompt_len}-token prompt with max_tokens={max_tokens}, and the cache has "
                f"{self.num_blocks} blocks; raise kv_cache_memory or lower max_tokens")


RequestFit = PagedFit | ContiguousFit
