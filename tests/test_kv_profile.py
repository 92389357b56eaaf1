"""KV cache sizing on a GPU by a profile (worker/device.py), tested on the CPU with a fake
memory probe: the real profile forward runs (a tiny model, on the CPU); the probe makes up
the device's numbers, so the arithmetic and what was profiled can be checked exactly."""
import logging

import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.worker.device import KVMemoryPlan, MemorySnapshot, plan_kv_memory, profile_lengths
from pagedserve.worker.model_runner import ModelRunner, kv_cache_bytes_per_block
from pagedserve.worker.worker import Worker

GIB = 2**30
MIB = 2**20


def test_plan_takes_a_share_of_total_memory_less_weights_peak_graphs_and_the_rest():
    """vLLM's meaning: utilization x TOTAL memory; off it the weights, the profile's peak,
    the graphs and what left outside torch (here 0.5 GiB: the CUDA context, cuBLAS)."""
    start = MemorySnapshot(total=80 * GIB, free=79 * GIB, allocated=0, reserved=0)
    loaded = MemorySnapshot(80 * GIB, 62 * GIB, allocated=16 * GIB, reserved=16 * GIB)
    profiled = MemorySnapshot(80 * GIB, 62 * GIB, allocated=16 * GIB, reserved=16 * GIB + GIB // 2)
    plan = plan_kv_memory(0.9, start, loaded, 3 * GIB, GIB, profiled)
    assert (plan.requested, plan.weights, plan.non_torch) == (int(0.9 * 80 * GIB), 16 * GIB, GIB // 2)
    assert plan.kv_cache == int(0.9 * 80 * GIB) - 16 * GIB - 3 * GIB - GIB - GIB // 2
    plan.check()
    text = plan.describe()
    for part in ("80.00 GiB total", "weights 16.00 GiB", "activation peak 3.00 GiB", "CUDA graphs 1.00 GiB",
                 "outside torch 0.50 GiB", f"KV cache {plan.kv_cache / GIB:.2f} GiB"):
        assert part in text, text
    # Free memory at start below the share asked for (another process holds it): refused.
    with pytest.raises(ValueError, match="free at start"):
        KVMemoryPlan(80 * GIB, 0.9, 60 * GIB, 16 * GIB, 3 * GIB, 0, 0).check()
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache"):
        KVMemoryPlan(80 * GIB, 0.3, 80 * GIB, 16 * GIB, 9 * GIB, 0, 0).check()


def test_profile_lengths_fill_the_chunk_within_the_context():
    assert profile_lengths(2048, 256, 4096) == [1793] + [1] * 255
    lens = profile_lengths(2048, 4, 512)
    assert sum(lens) == 2048 and max(lens) <= 512 and len(lens) == 4
    assert profile_lengths(8, 256, 100) == [1] * 8


class FakeProbe:
    """A 256 MiB device (small: the KV cache is really allocated, on the CPU): the model
    takes `weights` once loaded (the first snapshot comes before loading), the device loses
    `context` outside torch, and a profiled step peaks at `peak_above` above what was
    allocated."""
    total, weights, context, peak_above = 256 * MIB, 16 * MIB, 4 * MIB, 32 * MIB

    def __init__(self):
        self.loaded = False
        self.resets = 0

    def snapshot(self):
        allocated = self.weights if self.loaded else 0
        used = allocated + (self.context if self.loaded else 0)
        self.loaded = True
        return MemorySnapshot(self.total, self.total - used, allocated, allocated)

    def reset_peak(self):
        self.resets += 1

    def peak(self):
        return self.weights + self.peak_above

    def empty_cache(self):
        pass


def test_worker_sizes_the_kv_cache_by_a_profile_at_the_largest_batch_and_chunk(tiny_llama, monkeypatch, caplog):
    steps = []
    execute = ModelRunner.execute

    def spy(self, batch):
        steps.append(batch)
        return execute(self, batch)

    monkeypatch.setattr(ModelRunner, "execute", spy)
    config = EngineConfig(model=tiny_llama.path, device="cpu", dtype="float32", max_num_seqs=6,
                          max_num_batched_tokens=40, max_model_len=64, gpu_memory_utilization=0.5)
    probe = FakeProbe()
    with caplog.at_level(logging.INFO, logger="pagedserve.worker.device"):
        worker = Worker.load(config, tiny_llama.path, {2}, probe=probe)
    (profile,) = steps                            # one profiled step (no CUDA graphs on the CPU)
    assert sum(len(s.token_ids) for s in profile.seqs) == 40 and len(profile.seqs) == 6
    assert all(s.sample is not None for s in profile.seqs)
    (scored,) = [s for s in profile.seqs if s.prompt_logprobs is not None]
    assert len(scored.prompt_logprobs.target_token_ids) == len(scored.token_ids) == 35
    a = worker.model_args
    block = kv_cache_bytes_per_block(a.num_layers, config.block_size, a.num_kv_heads, a.head_dim, torch.float32)
    kv = int(0.5 * FakeProbe.total) - FakeProbe.weights - FakeProbe.peak_above - FakeProbe.context
    assert worker.num_blocks == kv // block
    assert probe.resets == 1
    assert "KV cache" in caplog.text and "activation peak 0.03 GiB" in caplog.text
    # kv_cache_memory given: no profile.
    steps.clear()
    given = Worker.load(EngineConfig(model=tiny_llama.path, device="cpu", dtype="float32", kv_cache_memory=block * 7),
                        tiny_llama.path, {2}, probe=FakeProbe())
    assert given.num_blocks == 7 and not steps
