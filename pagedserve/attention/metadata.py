"""What attention needs to know about one flat, unpadded batch."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass
class AttentionMetadata:
    """The batch holds `num_decodes` single-token sequences first, then prefill chunks.

    Token t of the batch is written to cache slot `slot_mapping[t]` (block * block_size
    + offset). Sequence i's queries are tokens query_start_loc[i]:query_start_loc[i+1];
    it attends over its first seq_lens[i] cached tokens through block_tables[i]
    (padded with zeros past its last block).

    A hybrid model (kv/groups.py) has one such metadata per KV group: the same queries and
    lengths, the group's slots and block tables, and its sliding window (`window`: the query at
    position p reads positions p - window + 1 .. p only; the table's entries before that block
    are -1, never read). Group 0's metadata holds the others in `groups`.
    """
    slot_mapping: torch.Tensor      # [T] int64
    query_start_loc: torch.Tensor   # [S + 1] int64
    seq_lens: torch.Tensor          # [S] int64: context length after this step
    block_tables: torch.Tensor      # [S, max_blocks] int64
    num_decodes: int
    # The same numbers as Python ints, for backends that loop on the host.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_seq_len: int
    window: int | None = None       # this KV group's sliding window (None: full attention)
    # Verification chunks (a decode token and its drafts) right after the decodes: each of their
    # rows attends alone over its causal prefix, as a decode row does (the same kernel and
    # arithmetic), so greedy speculation emits plain decoding's tokens.
    num_verify: int = 0
    # A batch-invariant step (StepBatch.batch_invariant): the model computes every row as it would
    # alone (quantized products: the decode rows' arithmetic for prefill chunks too).
    batch_invariant: bool = False
    groups: list["AttentionMetadata"] = field(default_factory=list)   # on group 0's: every group's, in order

    def group(self, g: int) -> "AttentionMetadata":
        """KV group g's metadata (a model with one group: this one)."""
        return self.groups[g] if self.groups else self

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_decode_rows(self) -> int:
        """Query rows that attend as decode rows: the decodes' and the verification chunks'."""
        return self.query_start_loc_cpu[self.num_decodes + self.num_verify]

    @cached_property
    def per_token(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_tables [T, max_blocks], seq_lens [T]): every query token as a sequence of
        its own that attends over its causal prefix (token j of a chunk ending at context
        length L sees L - (chunk_len - 1 - j) tokens). Built once per step, used by all layers."""
        counts = self.query_start_loc[1:] - self.query_start_loc[:-1]
        seq_of_token = torch.repeat_interleave(torch.arange(self.num_seqs, device=counts.device), counts)
        ends = self.query_start_loc[1:][seq_of_token]               # one past each token's chunk
        token_index = torch.arange(seq_of_token.shape[0], device=counts.device)
        lens = self.seq_lens[seq_of_token] - (ends - 1 - token_index)
        return self.block_tables.index_select(0, seq_of_token), lens
