"""Which device the engine runs on, and how much KV cache memory it gets there: on a GPU,
by a profile (vLLM's way): the weights, a forward at the largest batch and chunk and the
CUDA graphs' estimate come off gpu_memory_utilization x the device's total memory."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedserve.config import DEFAULT_KV_CACHE_MEMORY
from pagedserve.utils import cdiv

logger = logging.getLogger(__name__)


def resolve_device(name: str | None) -> torch.device:
    """None: the GPU when torch sees one, else the CPU."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} was asked for, but torch sees no CUDA GPU "
                         f"(torch {torch.__version__}); use device='cpu'")
    return device


@dataclass(frozen=True)
class MemorySnapshot:
    """A device's memory at one moment: its total and free bytes (all processes), and what
    this process's torch has allocated (live tensors) and reserved (its caching allocator)."""
    total: int
    free: int
    allocated: int
    reserved: int

    @property
    def used(self) -> int:
        return self.total - self.free


class MemoryProbe(Protocol):
    """Where the KV sizing reads device memory (a fake one in tests)."""

    def snapshot(self) -> MemorySnapshot: ...

    def reset_peak(self) -> None: ...

    def peak(self) -> int:
        """The most bytes allocated at once since reset_peak."""

    def empty_cache(self) -> None: ...


class CudaMemoryProbe:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def snapshot(self) -> MemorySnapshot:
        free, total = torch.cuda.mem_get_info(self.device)
        return MemorySnapshot(total, free, torch.cuda.memory_allocated(self.device),
                              torch.cuda.memory_reserved(self.device))

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class KVMemoryPlan:
    """How a device's memory is shared out (vLLM's meaning of gpu_memory_utilization: the
    share of the device's TOTAL memory this engine may use), from a profile: the requested
    bytes, less the weights, the peak of a forward at the largest batch and chunk (with its
    logits, prompt logprobs and sampling), the CUDA graphs' memory and what the device lost
    outside torch (CUDA context, cuBLAS workspaces, compiled kernels, NCCL), go to the KV cache."""
    total: int
    utilization: float
    free_at_start: int
    weights: int
    activation_peak: int
    cuda_graphs: int
    non_torch: int

    @property
    def requested(self) -> int:
        return int(self.utilization * self.total)

    @property
    def kv_cache(self) -> int:
        return self.requested - self.weights - self.activation_peak - self.cuda_graphs - self.non_torch

    def describe(self) -> str:
        g = lambda n: f"{n / 2**30:.2f} GiB"
        return (f"GPU memory: {g(self.total)} total ({g(self.free_at_start)} free at start), "
                f"gpu_memory_utilization {self.utilization:g} -> {g(self.requested)} for this engine: "
                f"weights {g(self.weights)}, activation peak {g(self.activation_peak)} (profiled forward at the "
                f"largest batch and chunk), CUDA graphs {g(self.cuda_graphs)} (estimated), outside torch "
                f"{g(self.non_torch)}, KV cache {g(self.kv_cache)}")

    def check(self) -> None:
        if self.free_at_start < self.requested:
            raise ValueError(f"gpu_memory_utilization {self.utilization:g} asks for {self.requested / 2**30:.2f} GiB "
                             f"of the GPU's {self.total / 2**30:.2f} GiB, but only {self.free_at_start / 2**30:.2f} "
                             f"GiB were free at start (other processes hold the rest): lower gpu_memory_utilization "
                             f"or pass kv_cache_memory")
        if self.kv_cache <= 0:
            raise ValueError(f"no GPU memory left for the KV cache. {self.describe()}; raise gpu_memory_utilization, "
                             f"lower max_num_batched_tokens / max_num_seqs, or pass kv_cache_memory")


def plan_kv_memory(utilization: float, start: MemorySnapshot, loaded: MemorySnapshot, activation_peak: int,
                   cuda_graphs: int, profiled: MemorySnapshot) -> KVMemoryPlan:
    """start: before loading the weights; loaded: after; profiled: after the profile's tensors
    were freed. Device memory in use grew by the weights, what torch's allocator kept, and
    the rest, which lies outside torch."""
    torch_growth = profiled.reserved - start.reserved
    non_torch = max(0, profiled.used - start.used - torch_growth)
    return KVMemoryPlan(start.total, utilization, start.free, loaded.allocated - start.allocated, activation_peak,
                        cuda_graphs, non_torch)


def profile_lengths(tokens: int, seqs: int, max_model_len: int) -> list[int]:
    """Sequence lengths of the profile step: `tokens` over `seqs` sequences, none longer
    than max_model_len, the first as long as it can be (it scores its prompt logprobs)."""
    seqs = max(1, min(seqs, tokens))
    first = min(max_model_len, tokens - (seqs - 1))
    rest, lengths = tokens - first, [first]
    for i in range(seqs - 1):
        n = min(max_model_len, max(1, rest // (seqs - 1 - i)))
        lengths.append(n)
        rest -= n
    return lengths


def profile_peaks(model, config, device: torch.device, sampler, probe: MemoryProbe, max_model_len: int,
                  graph_batch: int | None) -> tuple[int, int]:
    """Peak bytes above what was allocated, of (a) one step at the largest batch and chunk:
    max_num_batched_tokens tokens over max_num_seqs sequences (profile_lengths), every
    sequence sampling (top-k/p, logprobs) and the longest scoring prompt logprobs over all
    its tokens;
    (b) with graph_batch, a decode step of that many sequences (what a captured graph's
    memory pool holds), plus the graphs' static logits buffer; else 0. Both run in a small
    KV cache of their own, freed after."""
    from pagedserve.batch import PromptLogprobsRange, SampleRow, SamplingSettings, ScheduledTokens, StepBatch
    from pagedserve.worker.model_runner import ModelRunner
    bs = config.block_size
    lengths = profile_lengths(config.max_num_batched_tokens, config.max_num_seqs, max_model_len)
    settings = SamplingSettings(temperature=1.0, top_p=0.9, top_k=50, num_logprobs=20, needs_logprob=True)
    blocks = [cdiv(n, bs) for n in lengths]
    runner = ModelRunner(model, max(sum(blocks), graph_batch or 0), bs, sampler, device)
    vocab = model.args.vocab_size

    def batch(lens: list[int], logprobs_for_first: bool) -> StepBatch:
        out, at = [], 0
        for i, n in enumerate(lens):
            nb = cdiv(n, bs)
            ids = [t % vocab for t in range(1, n + 1)]
            out.append(ScheduledTokens(
                seq_id=-1 - i, token_ids=ids, start=0, block_ids=list(range(at, at + nb)),
                sample=SampleRow(settings, None, 0),
                prompt_logprobs=PromptLogprobsRange(20, ids[1:] + [0]) if logprobs_for_first and i == 0 else None))
            at += nb
        return StepBatch(seqs=sorted(out, key=lambda s: len(s.token_ids) != 1))    # decodes first

    try:
        probe.reset_peak()
        base = probe.snapshot().allocated
        runner.execute(batch(lengths, True))
        step_peak = probe.peak() - base
        graph_peak = 0
        if graph_batch:
            probe.reset_peak()
            base = probe.snapshot().allocated
            runner.execute(batch([1] * graph_batch, False))
            graph_peak = probe.peak() - base + graph_batch * vocab * 4     # + the static float32 logits
    finally:
        runner.forget_sequences()
        del runner
        probe.empty_cache()
    return max(0, step_peak), max(0, graph_peak)


def memory_probe(device: torch.device) -> MemoryProbe | None:
    """The device's memory probe (None on the CPU: the KV cache is kv_cache_memory or DEFAULT_KV_CACHE_MEMORY)."""
    return CudaMemoryProbe(device) if device.type == "cuda" else None


def profile_kv_memory(model, config, device: torch.device, sampler, probe: MemoryProbe, start: MemorySnapshot,
                      max_model_len: int, graph_batch: int | None) -> KVMemoryPlan:
    """Profile the loaded model (see profile_peaks) and share the memory out; refused when
    the request does not fit (KVMemoryPlan.check). The plan's describe() goes to the log."""
    loaded = probe.snapshot()
    step, graphs = profile_peaks(model, config, device, sampler, probe, max_model_len, graph_batch)
    plan = plan_kv_memory(config.gpu_memory_utilization, start, loaded, step, graphs, probe.snapshot())
    logger.info("%s", plan.describe())
    plan.check()
    return plan


def default_kv_cache_memory(plan: KVMemoryPlan | None) -> int:
    """Bytes of KV cache when kv_cache_memory is not given: the profile's share on a GPU,
    DEFAULT_KV_CACHE_MEMORY on the CPU."""
    return DEFAULT_KV_CACHE_MEMORY if plan is None else plan.kv_cache
