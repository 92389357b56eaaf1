"""Where the KV cache's slots go: the memory-waste breakdown of the vLLM paper (Fig. 2).

Every slot of the cache (one token's keys and values) is in exactly one category at
any moment:

- token_states: holds the K/V of a token that has been computed;
- reserved: held by a sequence for a token it will still produce (a position below
  its final length that is not computed yet);
- internal_fragmentation: held by a sequence past its final length, so never used
  (the unfilled tail of a paged sequence's last block; most of a contiguous
  reservation that was sized for the maximum length);
- external_fragmentation: free, but stranded: the first waiting request needs a
  region that the total free space could hold and no single hole can, so the
  space is idle because it is not contiguous (compaction would admit the request).
  Paging has none by construction: any free block can take any token;
- free: free and usable (or nobody is waiting for it).

A sequence's final length is prompt + max_tokens: exact for requests that ignore
EOS and have no stop condition (the benchmark traces), an upper bound otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

CATEGORIES = ("token_states", "reserved", "internal_fragmentation", "external_fragmentation", "free")


@dataclass
class MemoryUsage:
    """Slot counts per category, for one moment or summed over the steps of a run."""
    token_states: int = 0
    reserved: int = 0
    internal_fragmentation: int = 0
    external_fragmentation: int = 0
    free: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def add_held(self, first_pos: int, num_slots: int, written: int, final_len: int) -> None:
        """Count slots a sequence holds for its positions [first_pos, first_pos + num_slots),
        when its first `written` positions are computed and it will end at `final_len`."""
        end = first_pos + num_slots
        written_end = min(end, max(first_pos, written))
        final_end = min(end, max(written_end, final_len))
        self.token_states += written_end - first_pos
        self.reserved += final_end - written_end
        self.internal_fragmentation += end - final_end

    def __add__(self, other: MemoryUsage) -> MemoryUsage:
        return MemoryUsage(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def shares(self) -> dict[str, float]:
        """Each category's fraction of all slots."""
        total = self.total or 1
        return {f.name: getattr(self, f.name) / total for f in fields(self)}

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
