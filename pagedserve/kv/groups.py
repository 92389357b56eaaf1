"""KV cache groups: a model's layers grouped by attention kind, one block table per group.

A hybrid model mixes layers that attend over every earlier token (full attention) with
layers that attend over the last W only (sliding window: Gemma 2 alternates them, Gemma 3
has five window layers for each full one, Mistral v0.1 windows every layer). A window
layer never reads a token W positions behind the newest query, so the blocks holding
only such tokens can go back to the pool while the sequence runs.

As in vLLM's hybrid KV cache manager, the layers are cut into groups of one kind and of
equal size (`layers_per_block` layers each, the smallest kind's count; a kind's last group
may be short and pads its missing layers), so that every block of the one pool has the same
bytes: a block of a group holds `block_size` tokens' K and V for that group's layers. A
sequence has one block table per group; the worker's cache tensor has `layers_per_block`
layer slots, and layer l reads and writes slot `layer_slot[l]` of the blocks its group's
table names. A model with full attention only has one group of all its layers: the cache,
its tables and its keys are exactly those of a model without groups.

Window semantics (as transformers and llama.cpp): the query at position p attends over
keys at positions p - W + 1 .. p (W tokens, itself included).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.utils import cdiv


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]     # per group: its sliding window in tokens; None: full attention
    layer_group: tuple[int, ...]        # per layer: its group
    layer_slot: tuple[int, ...]         # per layer: its layer slot in a block
    layers_per_block: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def hybrid(self) -> bool:
        """Some group has a sliding window (a model with full attention only has one plain group)."""
        return any(w is not None for w in self.windows)

    def describe(self) -> list[str]:
        return [window_name(w) for w in self.windows]


def window_name(window: int | None) -> str:
    return "full" if window is None else f"sliding_window={window}"


def plan_kv_groups(layer_windows: Sequence[int | None]) -> KVGroups:
    """Group the layers (each one's window, None for full attention): full attention first,
    then windows from the smallest; within a kind, layers in order, `layers_per_block` a group."""
    assert layer_windows, "a model has layers"
    kinds = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))
    by_kind = {w: [i for i, lw in enumerate(layer_windows) if lw == w] for w in kinds}
    size = min(len(layers) for layers in by_kind.values())
    windows: list[int | None] = []
    layer_group = [0] * len(layer_windows)
    layer_slot = [0] * len(layer_windows)
    for w in kinds:
        layers = by_kind[w]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start:start + size]):
                layer_group[layer], layer_slot[layer] = len(windows), slot
            windows.append(w)
    return KVGroups(tuple(windows), tuple(layer_group), tuple(layer_slot), size)


def first_needed_block(window: int | None, num_computed: int, block_size: int) -> int:
    """The first logical block a group's table must still hold when the sequence's next query
    is at position `num_computed` (every later query sees no earlier token): 0 for full
    attention, the block of position num_computed - W + 1 for a window of W."""
    if window is None:
        return 0
    return max(0, num_computed - window + 1) // block_size


def window_bound(window: int, block_size: int, num_query_tokens: int = 1) -> int:
    """The most live blocks a window group's table holds in a step whose sequence computes
    `num_query_tokens` positions (its new tokens and drafts): ceil(W / B) + 1 for a decode,
    plus the blocks of a longer chunk's or the drafts' extra positions."""
    return cdiv(window + num_query_tokens - 1, block_size) + 1
