"""The host-memory tier (worker/kv_host_tier.py, --kv-offload-cpu-gb): above the disk tier or
alone, tested with a CPU "device" pool (the same store a GPU's pinned tier is), and on CUDA
where there is one (the cuda-marked test: skipped without a GPU)."""
import threading

import pytest
import torch

from pagedserve import LLM
from pagedserve.config import EngineConfig
from pagedserve.worker.kv_host_tier import HostTierStore
from pagedserve.worker.kv_tier import KVTierStore
from tests.test_engine import assert_no_blocks_held
from tests.test_kv_tier import SP, model, one_by_one, prompts  # noqa: F401 - fixtures

KEYS = [bytes([i]) * 32 for i in range(16)]


def cache(blocks=8) -> torch.Tensor:
    return torch.zeros(2, 2, blocks, 16, 2, 8)          # 2 KiB a block


def fill(store, block_id: int, value: float) -> None:
    store.blocks[:, :, block_id] = value


def disk(root, kv) -> KVTierStore:
    return KVTierStore(str(root), 1 << 30, "ab" * 32, kv, dict(kv_format="auto", block_size=16))


# ---- the store, on a CPU "device" pool -------------------------------------------------------
def test_host_hits_are_copied_at_once_and_reused_least_recently_used_first():
    store = HostTierStore(cache(), slots=2, below=None)
    assert store.capacity == 2 and not store.slots.is_pinned()
    for b in range(3):
        fill(store, b, 10.0 + b)
    store.save([(0, KEYS[0]), (1, KEYS[1])])
    store.start_loads([(KEYS[0], 5)])                  # KEYS[0] now the most recently used
    store.save([(2, KEYS[2])])                         # takes KEYS[1]'s slot: lost (no disk below)
    report = store.collect()
    assert report.loaded == [KEYS[0]] and report.lost == [KEYS[1]] and report.host_loads == 1
    assert torch.all(store.blocks[:, :, 5] == 10.0) and report.host_blocks == 2
    store.start_loads([(KEYS[1], 6), (KEYS[2], 7)])
    report = store.collect()
    assert report.loaded == [KEYS[2]] and report.failed == [KEYS[1]]
    assert torch.all(store.blocks[:, :, 7] == 12.0)
    store.delete([KEYS[0], KEYS[2]])
    assert store.collect().host_blocks == 0 and len(store._free) == 2


def test_written_through_to_the_disk_and_promoted_back_after_a_restart(tmp_path):
    kv = cache()
    store = HostTierStore(kv, slots=3, below=disk(tmp_path, kv))
    for b in range(3):
        fill(store, b, 20.0 + b)
    store.save([(0, KEYS[0]), (1, KEYS[1]), (2, KEYS[2])])
    store.flush()
    report = store.collect()
    assert report.lost == [] and len(list(tmp_path.glob("*.kvb"))) == 3 and report.bytes_written > 0
    store.start_loads([(KEYS[0], 4)])
    report = store.collect()
    assert report.loaded == [KEYS[0]] and report.bytes_read == store.payload_bytes   # from host memory
    store.close()
    # A restart: the host is empty, the disk has every key; a read lands and takes a slot.
    kv = cache()
    again = HostTierStore(kv, slots=2, below=disk(tmp_path, kv))
    assert sorted(again.scan()) == sorted(KEYS[:3]) and again.capacity == again.below.capacity
    again.start_loads([(KEYS[2], 3)])
    report = again.collect(wait=[KEYS[2]])
    assert report.loaded == [KEYS[2]] and torch.all(again.blocks[:, :, 3] == 22.0)
    assert KEYS[2] in again.where and report.host_loads == 0
    again.start_loads([(KEYS[2], 5)])
    assert again.collect().host_loads == 1 and torch.all(again.blocks[:, :, 5] == 22.0)
    again.close()


def test_a_slot_is_not_reused_before_its_file_is_written(tmp_path):
    """The disk's writer is held: saving more keys than slots must not overwrite a slot whose
    bytes are still on their way to a file (its file would hold another block)."""
    kv = cache()
    below = disk(tmp_path, kv)
    gate = threading.Event()
    write = below._write_file

    def slow(path, header, payload):
        gate.wait(60)
        write(path, header, payload)

    below._write_file = slow
    store = HostTierStore(kv, slots=2, below=below)
    for i in range(4):
        fill(store, 0, 30.0 + i)
        store.save([(0, KEYS[i])])
    assert len(store.where) == 2             # the two later saves found no free slot: disk only
    gate.set()
    store.flush()
    fresh = disk(tmp_path, cache())
    fresh.start_loads([(k, i) for i, k in enumerate(KEYS[:4])])
    report = fresh.collect(wait=KEYS[:4])
    assert report.loaded == KEYS[:4]
    for i in range(4):
        assert torch.all(fresh.blocks[:, :, i] == 30.0 + i), f"block {i} filed with another block's bytes"
    # Written: the slots are free for reuse again.
    fill(store, 0, 99.0)
    store.save([(0, KEYS[9])])                 # reuses the least recently used slot (KEYS[0]'s: on disk)
    store.flush()
    assert KEYS[9] in store.where and KEYS[0] not in store.where and store._writing == {}
    store.close()


def test_settings(tmp_path):
    assert EngineConfig(kv_offload_cpu_gb=1).kv_offload and not EngineConfig().kv_offload
    for kw, field in [(dict(kv_offload_cpu_gb=0), "kv_offload_cpu_gb must"),
                      (dict(kv_offload_cpu_gb=1, enable_prefix_caching=False), "prefix"),
                      (dict(kv_offload_cpu_gb=1, tensor_parallel_size=2), "tensor_parallel")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(**kw)


# ---- end to end --------------------------------------------------------------------------------
def block_gb(llm: LLM, blocks: int) -> float:
    kv = llm.engine.runner.kv_cache
    return blocks * kv[:, :, 0].numel() * kv.element_size() / 1024**3


def test_evicted_prefixes_come_back_from_host_memory_alone_with_the_same_tokens(model, prompts):  # noqa: F811
    """Host memory alone, 12 slots (of the 25 blocks the prompts fill): the index keeps within
    them, every read is a host hit, the tokens are those of an ample pool."""
    ref_llm = LLM(model.path, dtype="float32", num_gpu_blocks_override=256)
    ref = one_by_one(ref_llm, prompts * 2)
    llm = LLM(model.path, dtype="float32", num_gpu_blocks_override=14, kv_offload_cpu_gb=block_gb(ref_llm, 12))
    assert one_by_one(llm, prompts * 2) == ref
    stats = llm.kv_cache_stats()
    assert stats["kv_offload_load_failures"] == 0 and stats["kv_offload_host_blocks"] <= 12
    assert stats["kv_offload_blocks"] <= 12 and stats["kv_offload_bytes_written"] == 0
    assert stats["kv_offload_host_loads"] == stats["kv_offload_blocks_loaded"] >= 5
    assert_no_blocks_held(llm)


def test_host_memory_above_the_disk_then_the_disk_after_a_restart(model, prompts, tmp_path):  # noqa: F811
    """Room for every block in host memory: each read is a host hit, each block also written to
    disk; a restarted engine (empty host memory) reads the disk, with the same tokens."""
    ref_llm = LLM(model.path, dtype="float32", num_gpu_blocks_override=256)
    ref = one_by_one(ref_llm, prompts * 2)
    kw = dict(dtype="float32", num_gpu_blocks_override=14, kv_offload_cpu_gb=block_gb(ref_llm, 40),
              kv_offload_path=str(tmp_path))
    llm = LLM(model.path, **kw)
    assert one_by_one(llm, prompts * 2) == ref
    llm.engine.runner.tier.flush()
    stats = llm.kv_cache_stats()
    assert stats["kv_offload_host_loads"] == stats["kv_offload_blocks_loaded"] >= 3 * 5
    assert stats["kv_offload_blocks_saved"] == len(list(tmp_path.glob("*.kvb"))) and stats["kv_offload_load_failures"] == 0
    llm.shutdown()
    again = LLM(model.path, **kw)
    assert one_by_one(again, prompts[:1]) == ref[:1]
    stats = again.kv_cache_stats()
    assert stats["kv_offload_blocks_loaded"] == 5 and stats["kv_offload_host_loads"] == 0
    assert stats["kv_offload_host_blocks"] >= 5                  # the disk's reads kept in host memory
    assert_no_blocks_held(again)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_host_tier_on_cuda(model, prompts, tmp_path):  # noqa: F811
    """On a GPU: the slots are pinned, copies run on the stream, the tokens are the reference's."""
    ref_llm = LLM(model.path, dtype="float32", device="cuda", num_gpu_blocks_override=256)
    ref = one_by_one(ref_llm, prompts * 2)
    llm = LLM(model.path, dtype="float32", device="cuda", num_gpu_blocks_override=14,
              kv_offload_cpu_gb=block_gb(ref_llm, 12), kv_offload_path=str(tmp_path))
    assert llm.engine.runner.tier.slots.is_pinned()
    assert one_by_one(llm, prompts * 2) == ref
    stats = llm.kv_cache_stats()
    assert stats["kv_offload_host_loads"] >= 5 and stats["kv_offload_load_failures"] == 0
    llm.shutdown()
    again = LLM(model.path, dtype="float32", device="cuda", num_gpu_blocks_override=14,
                kv_offload_cpu_gb=block_gb(ref_llm, 12), kv_offload_path=str(tmp_path))
    assert one_by_one(again, prompts[:2]) == ref[:2]
    assert again.kv_cache_stats()["kv_offload_blocks_loaded"] >= 5
    again.shutdown()
