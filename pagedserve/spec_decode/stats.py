"""Speculative decoding's counters: the engine's (vLLM's spec_decode metrics) and each request's
(its acceptance decides whether it keeps getting drafts)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeCounters:
    num_drafts: int = 0                 # steps in which a sequence had drafts verified
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)   # [i]: drafts accepted at position i

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos += [0] * (num_draft_tokens - len(self.accepted_per_pos))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a drafted step emits on average: the accepted drafts plus the target's own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return dict(spec_decode_num_drafts=self.num_drafts, spec_decode_num_draft_tokens=self.num_draft_tokens,
                    spec_decode_num_accepted_tokens=self.num_accepted_tokens,
                    spec_decode_num_accepted_tokens_per_pos=list(self.accepted_per_pos),
                    spec_decode_acceptance_rate=self.acceptance_rate,
                    spec_decode_mean_accepted_length=self.mean_accepted_length)
