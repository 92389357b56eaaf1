"""KV memory use and batch size of the scheduler and KV cache managers, without a model.

Which requests run and which slots they hold does not depend on the model: with
ignore_eos every request produces exactly its traced output length, and the
scheduler and KV cache manager see only token counts. So the engine's own
Scheduler runs here with the model step replaced by appending a dummy token,
which makes the memory numbers (paper Fig. 2 and Fig. 13) cheap to measure at
the paper's full scale (2048-token context, 16-token blocks, a cache of
15k slots) over many requests, on a machine that could not serve them in time.

All requests are queued at once (saturation): memory alone limits the batch, and
the averages are taken over the steps during which requests were waiting.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.batch import RunnerOutput
from pagedserve.config import EngineConfig
from pagedserve.kv.memory_usage import MemoryUsage
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Scheduler


@dataclass
class MemorySimResult:
    allocator: str
    num_requests: int
    num_steps: int
    saturated_steps: int                 # steps during which requests were waiting
    saturated_batch_size: float          # requests running per step, over those steps
    saturated_memory: dict               # MemoryUsage summed over those steps
    num_preemptions: int

    def shares(self) -> dict[str, float]:
        return MemoryUsage(**self.saturated_memory).shares()


def simulate_saturation(allocator: str, lengths: list[tuple[int, int]], block_size: int, kv_slots: int,
                        max_model_len: int, max_num_seqs: int = 256,
                        max_num_batched_tokens: int = 2048) -> MemorySimResult:
    """Queue requests of the given (prompt, output) lengths at once and run them to the end."""
    config = EngineConfig(block_size=block_size, kv_allocator=allocator, enable_prefix_caching=False,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    sched = Scheduler(config, kv_slots // block_size, max_model_len)
    for i, (prompt_len, output_len) in enumerate(lengths):
        prompt = [1] * prompt_len
        req = Request.create(str(i), None, prompt, SamplingParams(max_tokens=output_len, ignore_eos=True), output_len,
                             sched.new_seq_id())
        sched.add_request(req)
    usage = MemoryUsage()
    steps = saturated = batch_sum = 0
    while sched.num_unfinished:
        out = sched.schedule()
        if out.empty:
            raise RuntimeError("the scheduler made no progress")
        batch = len(sched.running)
        ids = [s.seq.seq_id for s in out.sampled]   # a "model" that samples token 0
        sched.update_from_output(out, RunnerOutput.of_tokens(ids, [0] * len(ids)))
        steps += 1
        if sched.waiting:
            saturated += 1
            batch_sum += batch
            usage += sched.memory_usage()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks, "KV blocks leaked"
    return MemorySimResult(allocator, len(lengths), steps, saturated,
                           batch_sum / saturated if saturated else float("nan"), usage.as_dict(),
                           sched.stats.num_preemptions)
