"""What the scheduler hands the worker for one step, and what the worker hands back: data only.

No `Request` or `Sequence` crosses this line: the worker is told, per sequence, the token
ids to compute, where they start, the block table and, if the step samples from it, a
sampling row resolved by the scheduler. Everything here is plain dataclasses of ints,
floats and lists, so a batch can be pickled and sent to workers in other processes (a
decode step of 64 sequences pickles to a few kilobytes; tests/test_batch.py checks it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class SamplingSettings:
    """A request's sampling parameters as the sampler needs them, resolved once when the
    request is added (beam search: greedy, with beam_width logprobs)."""
    temperature: float = 0.0               # 0: greedy
    top_p: float = 1.0
    top_k: int = 0                         # 0: all
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0                    # below it, stop ids and (unless ignore_eos) EOS are banned
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    num_logprobs: int = 0                  # top-k logprobs wanted per sampled token
    needs_logprob: bool = False            # the sampled token's own logprob is wanted
    allowed_token_ids: tuple[int, ...] | None = None   # None: all
    bad_words: tuple[tuple[int, ...], ...] = ()        # token sequences whose last token is banned after the rest

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5     # as SamplingParams.greedy

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def needs_output_token_ids(self) -> bool:
        """The sampler reads the sequence's output so far: penalties, or bad words of 2+ tokens."""
        return self.has_penalties or any(len(w) > 1 for w in self.bad_words)


@dataclass
class SampleRow:
    """One sequence's sampling inputs for this step."""
    settings: SamplingSettings
    seed: int | None                       # the sequence's own seed; the worker keeps its generator
    num_output_tokens: int
    output_token_ids: list[int] | None = None   # only with penalties
    prompt_token_ids: list[int] | None = None   # only with a repetition penalty


@dataclass
class PromptLogprobsRange:
    """Score prompt positions start .. start + len(target_token_ids) - 1 of this chunk: the
    logprob of each following prompt token, and the top num_logprobs."""
    num_logprobs: int
    target_token_ids: list[int]


MODEL_DRAFT = -1   # a draft slot the worker's draft model fills (method draft_model)


@dataclass
class ScheduledTokens:
    """One sequence's part of the step."""
    seq_id: int
    token_ids: list[int]                   # the tokens to compute, at positions start, start + 1, ...
    start: int
    block_ids: list[int]                   # the sequence's block table (KV group 0's)
    sample: SampleRow | None = None        # the step reaches its last token: sample from it
    prompt_logprobs: PromptLogprobsRange | None = None
    # A pooling request's chunk whose hidden states it needs: LAST (the chunk ending the prompt:
    # its last row), MEAN (every chunk: the sum of its rows), CLS (the chunk at position 0: its first row).
    pool: str | None = None
    # Speculative decoding: guessed tokens computed after token_ids (their KV slots are in
    # block_ids); the step then samples at each of the 1 + len(draft_token_ids) positions and
    # verifies the guesses (spec_decode/rejection.py).
    draft_token_ids: list[int] = field(default_factory=list)
    # Method draft_model (spec_decode/draft_model.py): draft_token_ids are MODEL_DRAFT
    # placeholders, which the worker's draft model fills with its greedy tokens before the
    # verification. First the draft model computes its own KV for the tokens it has not seen:
    # draft_input_ids at positions draft_start, ... (ending with token_ids' last token; empty:
    # the draft model skips this sequence, e.g. while drafts are off).
    draft_input_ids: list[int] = field(default_factory=list)
    draft_start: int = 0
    lora_slot: int = -1                    # the LoRA slot of its adapter (lora/); -1: the base model
    embeds: bool = False                   # a pooling request's chunk (every one, `pool` or not): never a decode row

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_query_tokens(self) -> int:
        """Tokens the forward computes for this sequence: its own and its drafts."""
        return len(self.token_ids) + len(self.draft_token_ids)

    @property
    def is_decode(self) -> bool:
        """Attended as a decode row: one query token of a generating sequence (the scheduler puts
        these first). A pooling request's chunk is prompt, whatever its length: a 1-token chunk
        takes the prefill attention, as the same token does inside a longer chunk (an embedding
        does not depend on how its prompt is split)."""
        return self.num_query_tokens == 1 and not self.embeds


@dataclass(frozen=True)
class LoRALoad:
    """Put adapter lora_int_id (a checked PEFT directory, lora/adapter.py) into a LoRA slot."""
    slot: int
    lora_int_id: int
    path: str


@dataclass
class StepBatch:
    seqs: list[ScheduledTokens] = field(default_factory=list)       # decodes (one token) first
    # Before the forward, in this order: swap out (device, host), swap in (host, device),
    # copy-on-write (src, dst).
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Sequences that ended since the last batch: the worker drops what it keeps for them.
    finished_seq_ids: list[int] = field(default_factory=list)
    # Structured outputs: for the sampling rows listed in grammar_rows (indices among the seqs
    # that sample, in order), the tokens each may sample, packed: row i of grammar_bitmask is
    # int32 words whose bit t (word t // 32, bit t % 32) is set where token t is allowed.
    grammar_rows: list[int] = field(default_factory=list)
    grammar_bitmask: np.ndarray | None = None
    # Multi-LoRA: adapters to put into slots before the forward (the rows' lora_slot name them).
    lora_loads: list[LoRALoad] = field(default_factory=list)
    # Cold adapters to read into the worker's host cache in the background (slot -1): their
    # requests are admitted in a later step (lora/slots.py request_read).
    lora_reads: list[LoRALoad] = field(default_factory=list)
    # The prefix cache's disk tier's moves, before everything else (None: none this step).
    tier: TierMoves | None = None
    # A hybrid model's KV groups 1.. (kv/groups.py): each sequence's block tables in them, by seq id
    # (its ScheduledTokens.block_ids is group 0's). -1 in any table: a block released behind a
    # sliding window, which attention never reads.
    group_block_ids: dict[int, list[list[int]]] = field(default_factory=dict)
    # Compute every row as it would be alone (the engine's batch_invariant setting; auto: a step
    # holding a greedy request), so greedy output does not depend on what shares the
    # step, on prefix-cache hits or on speculation (quantized products: prefill chunks on the
    # decode rows' arithmetic).
    batch_invariant: bool = False


@dataclass
class TierMoves:
    """A step's work for the disk tier (kv/tier.py, worker/kv_tier.py): save (block id, key)
    (evicted cached blocks, copied before this step may overwrite them); delete these keys'
    files; read (key, block id) in the background into blocks nothing else uses until they land.
    wait: the step runs nothing else, so the worker waits for these keys' reads (the first
    waiting request's; the others' read on)."""
    saves: list[tuple[int, bytes]] = field(default_factory=list)
    deletes: list[bytes] = field(default_factory=list)
    loads: list[tuple[bytes, int]] = field(default_factory=list)
    wait: list[bytes] = field(default_factory=list)


@dataclass
class TierReport:
    """The disk tier's news since the last report: reads that landed in their blocks, reads
    refused (file missing, truncated, corrupt or foreign: the block holds nothing), keys whose
    files are gone (a failed write, the directory's size bound), and the store's totals."""
    loaded: list[bytes] = field(default_factory=list)
    failed: list[bytes] = field(default_factory=list)
    lost: list[bytes] = field(default_factory=list)
    bytes_written: int = 0
    bytes_read: int = 0             # the disk's and the host tier's
    writable: bool = True
    host_blocks: int = 0            # blocks in the host-memory tier (worker/kv_host_tier.py), if any
    host_loads: int = 0             # loads it served


@dataclass
class PromptTokenLogprob:
    """One prompt position's score: the actual next token's logprob and rank, and the top k."""
    top_ids: list[int]
    top_logprobs: list[float]
    logprob: float
    rank: int


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None           # of each sampled token
    top_ids: list[list[int]] | None        # per row, the top num_logprobs token ids ...
    top_logprobs: list[list[float]] | None  # ... and their logprobs
    ranks: list[int] | None                # rank of each sampled token (1 = most likely)


@dataclass
class RunnerOutput:
    sampled_seq_ids: list[int]             # the sequences that sampled, in the sampler's row order
    sample: SamplerOutput | None
    prompt_logprobs: dict[int, list[PromptTokenLogprob]] = field(default_factory=dict)   # seq_id -> per position
    pooled: dict[int, np.ndarray] = field(default_factory=dict)   # seq_id -> the chunk's pooled hidden state (float32)
    # Sequences that had drafts: seq_id -> the tokens the step emits for it, in order (the accepted
    # drafts, then the target's own token: 1 .. k+1 rows), with their logprobs as plain decoding
    # gives them. These sequences are not in sampled_seq_ids.
    spec: dict[int, SamplerOutput] = field(default_factory=dict)
    # Method draft_model: seq_id -> the drafts the draft model proposed (verified as in `spec`).
    model_drafts: dict[int, list[int]] = field(default_factory=dict)
    tier: TierReport | None = None         # the disk tier's news (None: no tier)
    # Multi-LoRA: slot -> why its adapter could not be read in this step (its files changed on
    # disk); the scheduler fails the requests of that slot alone.
    lora_errors: dict[int, str] = field(default_factory=dict)

    @classmethod
    def of_tokens(cls, seq_ids: list[int], token_ids: list[int]) -> "RunnerOutput":
        """These tokens sampled, no logprobs: for simulations that run no model."""
        return cls(seq_ids, SamplerOutput(token_ids, None, None, None, None) if seq_ids else None)
