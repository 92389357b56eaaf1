"""Turn one step's logits into tokens, vectorised over the batch.

Order (as in vLLM): logit bias, min_tokens, allowed tokens, bad words, penalties, the grammar's
token bitmask (structured outputs: disallowed tokens to -inf, by xgrammar's kernel), then greedy
argmax or temperature -> min_p -> top_k / top_p -> sampling. Logprobs are those of the
model's raw distribution. Random rows draw exponential noise and take
argmax(p / noise), which samples from p; a seeded request draws its noise from
its own generator, so its text does not depend on the rest of the batch.

It runs where the logits are (the worker's device): on a GPU only the sampled ids and
the requested logprobs cross to the host. A seeded sequence's generator lives on that
device too (the worker creates it there from the seed), so its noise is drawn in place:
its tokens are reproducible for a seed on a device (on the CPU, the same as ever; a GPU's
generator draws other numbers than the CPU's). Unseeded rows draw from the sampler's own
generator on the device. The per-row parameters of the random rows (which rows, their
temperature, min_p, top_p, top_k) are kept on the device between steps and sent again
only when they change: a steady decode batch copies nothing from the host to sample.
(Logit bias, min_tokens, allowed tokens, bad words, penalties and grammar bitmasks send
their token ids when a row uses them.)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.batch import SamplerOutput, SamplingSettings
from pagedserve.models.ops import ModelOps, TorchOps


@dataclass
class SamplingRow:
    params: SamplingSettings
    num_output_tokens: int
    output_token_ids: list[int] | None      # needed only with penalties
    prompt_token_ids: list[int] | None      # needed only with a repetition penalty
    generator: torch.Generator | None

    @property
    def num_logprobs(self) -> int:          # top-k logprobs wanted for this row (0: none)
        return self.params.num_logprobs

    @property
    def needs_logprob(self) -> bool:        # the sampled token's logprob is wanted
        return self.params.needs_logprob


class Sampler:
    def __init__(self, eos_token_ids: set[int], seed: int = 0, ops: ModelOps | None = None,
                 device: torch.device | str = "cpu") -> None:
        """ops: the argmax for logits on `device` (a vectorised kernel on the CPU)."""
        self.eos_token_ids = sorted(eos_token_ids)
        self.device = torch.device(device)
        self.generator = torch.Generator(device).manual_seed(seed)
        self.argmax = (ops or TorchOps()).argmax
        self._params_key: tuple | None = None       # the random rows' parameters now on the device ...
        self._params: RandomRows | None = None      # ... and those tensors
        self.host_copies = 0                         # parameter uploads (a test counts them)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow], grammar_rows: list[int] = (),
                 grammar_bitmask: np.ndarray | None = None) -> SamplerOutput:
        """logits: [N, V] float32 (modified in place). grammar_bitmask: the allowed tokens of the
        rows listed in grammar_rows, packed 32 to an int32 word (StepBatch.grammar_bitmask)."""
        raw_logprobs = None
        if any(r.needs_logprob or r.num_logprobs for r in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        self._apply_bias_and_min_tokens(logits, rows, set(grammar_rows))
        self._apply_penalties(logits, rows)
        if grammar_rows:
            self._apply_grammar(logits, list(grammar_rows), grammar_bitmask)
        tokens = self._sample(logits, rows)
        return self._gather_logprobs(raw_logprobs, tokens, rows)

    # ---- logits processors ---------------------------------------------------------------
    @staticmethod
    def _apply_grammar(logits: torch.Tensor, idx: list[int], bitmask: np.ndarray) -> None:
        """Disallowed tokens of the constrained rows to -inf (xgrammar's kernel for the logits'
        device)."""
        from xgrammar import apply_token_bitmask_inplace
        mask = torch.from_numpy(bitmask).to(logits.device)
        if idx == list(range(logits.shape[0])):
            apply_token_bitmask_inplace(logits, mask)
            return
        full = torch.full((logits.shape[0], mask.shape[1]), -1, dtype=torch.int32, device=logits.device)
        full[idx] = mask
        apply_token_bitmask_inplace(logits, full, indices=idx)

    def _apply_bias_and_min_tokens(self, logits: torch.Tensor, rows: list[SamplingRow],
                                   constrained: set[int]) -> None:
        for i, r in enumerate(rows):
            p = r.params
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
                logits[i, ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device)
            # A grammar decides where its output ends: min_tokens does not ban its stop tokens.
            if r.num_output_tokens < p.min_tokens and i not in constrained:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
                logits[i, banned] = float("-inf")
            if p.allowed_token_ids is not None:
                allowed = torch.tensor(p.allowed_token_ids, dtype=torch.long)
                kept = logits[i, allowed]
                logits[i] = float("-inf")
                logits[i, allowed] = kept
            for word in p.bad_words:   # banned where the output so far ends with the word's other tokens
                if len(word) == 1 or (r.output_token_ids or [])[-(len(word) - 1):] == list(word[:-1]):
                    logits[i, word[-1]] = float("-inf")

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        idx = [i for i, r in enumerate(rows) if r.params.has_penalties]
        if not idx:
            return
        vocab, dev = logits.shape[1], logits.device
        for i in idx:   # rows with penalties are rare; each costs a few vector ops
            p, r = rows[i].params, rows[i]
            row = logits[i]
            counts = torch.bincount(torch.tensor(r.output_token_ids, dtype=torch.long, device=dev),
                                    minlength=vocab)[:vocab]
            if p.repetition_penalty != 1.0:
                seen = counts > 0
                seen[torch.tensor(r.prompt_token_ids, dtype=torch.long, device=dev)] = True
                penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                row.copy_(torch.where(seen, penalised, row))
            if p.frequency_penalty:
                row -= p.frequency_penalty * counts.float()
            if p.presence_penalty:
                row -= p.presence_penalty * (counts > 0).float()

    # ---- sampling ------------------------------------------------------------------------
    def _random_rows(self, rows: list[SamplingRow], rand: list[int]) -> "RandomRows":
        """The random rows' indices and parameters as device tensors: those of the last step
        when nothing changed, else uploaded once (from pinned memory next to a GPU)."""
        params = [rows[i].params for i in rand]
        seeded = tuple(rows[i].generator is not None for i in rand)
        key = (len(rows), tuple(rand), seeded, tuple((p.temperature, p.min_p, p.top_p, p.top_k) for p in params))
        if key == self._params_key:
            return self._params
        self._params = self._build_random_rows(rows, rand)
        self._params_key = key
        self.host_copies += 1
        return self._params

    def _build_random_rows(self, rows: list[SamplingRow], rand: list[int]) -> "RandomRows":
        """The random rows' indices and parameters, uploaded now (no step cache: speculative
        decoding's verification builds its own without displacing the step's)."""
        params = [rows[i].params for i in rand]
        seeded = tuple(rows[i].generator is not None for i in rand)
        pin = self.device.type == "cuda"
        unseeded = [j for j, s in enumerate(seeded) if not s]
        truncate = any(p.top_k for p in params) or any(p.top_p < 1.0 for p in params)

        def up(values, dtype) -> torch.Tensor:
            host = torch.tensor(values, dtype=dtype)
            return host.pin_memory().to(self.device, non_blocking=True) if pin else host.to(self.device)

        return RandomRows(
            idx=None if len(rand) == len(rows) else up(rand, torch.long),
            unseeded=None if len(unseeded) in (0, len(rand)) else up(unseeded, torch.long),
            num_unseeded=len(unseeded),
            temperature=up([p.temperature for p in params], torch.float32)[:, None],
            min_p=up([p.min_p for p in params], torch.float32)[:, None] if any(p.min_p for p in params) else None,
            # top_k and top_p are applied together, as one mask, when any row uses either.
            top_k=up([p.top_k for p in params], torch.long) if truncate else None,
            top_p=up([p.top_p for p in params], torch.float32)[:, None] if truncate else None)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        if len(rand) < len(rows):
            tokens = self.argmax(logits)        # the first maximum, as torch's argmax
        if not rand:
            return tokens
        rr = self._random_rows(rows, rand)
        x = logits if rr.idx is None else logits[rr.idx]
        x /= rr.temperature.to(x.dtype)
        x = self._truncate(x, rr)
        probs = torch.softmax(x, dim=-1)
        if rr.num_unseeded == len(rand):
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
        else:
            noise = torch.empty_like(probs)
            if rr.unseeded is not None:
                noise[rr.unseeded] = torch.empty(rr.num_unseeded, probs.shape[1], dtype=probs.dtype,
                                                 device=probs.device).exponential_(generator=self.generator)
        for j, i in enumerate(rand):
            if rows[i].generator is not None:
                seeded_noise(noise[j], rows[i].generator)
        sampled = self.argmax(probs / noise)
        if rr.idx is None:
            return sampled
        tokens[rr.idx] = sampled
        return tokens

    @staticmethod
    def _truncate(x: torch.Tensor, rr: "RandomRows") -> torch.Tensor:
        """min_p, top_k and top_p: mask the tokens each row may not sample."""
        if rr.min_p is not None:
            probs = torch.softmax(x, dim=-1)
            floor = rr.min_p.to(x.dtype) * probs.amax(dim=-1, keepdim=True)
            x = x.masked_fill(probs < floor, float("-inf"))
        if rr.top_k is None:
            return x
        vocab = x.shape[1]
        sorted_x, order = x.sort(dim=-1, descending=True)
        k = torch.where(rr.top_k > 0, rr.top_k, vocab)       # 0: every token
        drop = torch.arange(vocab, device=x.device)[None, :] >= k[:, None]
        cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
        # Drop a token when the ones before it already cover top_p (the first always stays).
        drop |= (cum - torch.softmax(sorted_x, dim=-1)) >= rr.top_p.to(x.dtype)
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        return torch.empty_like(x).scatter_(1, order, sorted_x)

    # ---- logprobs ------------------------------------------------------------------------
    @staticmethod
    def _gather_logprobs(raw: torch.Tensor | None, tokens: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        token_list = tokens.tolist()
        if raw is None:
            return SamplerOutput(token_list, None, None, None, None)
        chosen = raw.gather(1, tokens[:, None])
        ranks = ((raw > chosen).sum(dim=-1) + 1).tolist()
        k = max(r.num_logprobs for r in rows)
        top_ids = top_lps = None
        if k:
            lps, ids = raw.topk(k, dim=-1)
            top_ids = [ids[i, :r.num_logprobs].tolist() for i, r in enumerate(rows)]
            top_lps = [lps[i, :r.num_logprobs].tolist() for i, r in enumerate(rows)]
        return SamplerOutput(token_list, chosen[:, 0].tolist(), top_ids, top_lps, ranks)


@dataclass
class RandomRows:
    """The random rows of a step, on the device: which rows (None: all), which of them draw
    from the sampler's generator (None: all or none), and each one's parameters [R, 1]
    (top_k [R], 0: all; None where no row uses the setting)."""
    idx: torch.Tensor | None
    unseeded: torch.Tensor | None
    num_unseeded: int
    temperature: torch.Tensor
    min_p: torch.Tensor | None
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None


def seeded_noise(row: torch.Tensor, generator: torch.Generator) -> None:
    """Fill one row with Exp(1) noise from a sequence's generator: in place where the row
    lives on the generator's device, else drawn there (the same numbers) and copied over."""
    if row.device == generator.device:
        row.exponential_(generator=generator)
    else:
        row.copy_(torch.empty(row.shape, dtype=row.dtype).exponential_(generator=generator))
