"""Both KV allocators implement the scheduler's KVCache interface, and their stats keep the
keys users read from kv_cache_stats()."""
import inspect

import pytest

from pagedserve.kv.contiguous import ContiguousKVCacheManager
from pagedserve.kv.interface import KVCache
from pagedserve.kv.kv_cache_manager import KVCacheManager

PAGED_KEYS = {"num_blocks", "block_size", "num_free_blocks", "num_used_blocks", "usage", "num_cached_blocks",
              "num_evicted_blocks", "prefix_cache_queries", "prefix_cache_hits", "num_logical_blocks",
              "sharing_saving", "num_host_blocks", "num_free_host_blocks", "num_swapped_out_blocks",
              "num_swapped_in_blocks"}
CONTIGUOUS_KEYS = {"num_blocks", "block_size", "num_free_blocks", "num_used_blocks", "usage", "num_cached_blocks",
                   "prefix_cache_queries", "prefix_cache_hits", "num_logical_blocks", "sharing_saving",
                   "kv_allocator", "num_holes", "largest_hole_blocks"}

MEMBERS = [name for name in dir(KVCache) if not name.startswith("_")]


@pytest.mark.parametrize("kv", [KVCacheManager(8, 4, num_host_blocks=2), ContiguousKVCacheManager(8, 4, "max", 16)],
                         ids=["paged", "contiguous"])
def test_each_allocator_has_every_member_of_the_interface_with_its_parameters(kv):
    for name in MEMBERS + ["block_size", "swap"]:
        assert hasattr(kv, name), name
        want = getattr(KVCache, name, None)
        if inspect.isfunction(want):
            assert list(inspect.signature(want).parameters) == list(inspect.signature(getattr(type(kv), name)).parameters)


def test_stats_keep_their_keys():
    paged = KVCacheManager(8, 4, num_host_blocks=2)
    assert set(paged.stats().as_dict()) == PAGED_KEYS
    assert set(ContiguousKVCacheManager(8, 4, "max", 16).stats().as_dict()) == CONTIGUOUS_KEYS


def test_allocate_slots_is_all_or_nothing_and_counts_logical_blocks():
    kv = KVCacheManager(4, 4)
    assert kv.admit(1, list(range(9)), 20) == 0
    assert kv.allocate_slots([(1, list(range(9)), 0, 9)]) == []
    assert kv.num_used_blocks == kv.num_logical_blocks == 3
    kv.fork(1, 2)
    assert kv.num_logical_blocks == 6 and kv.num_used_blocks == 3
    # Both write position 9 of the shared partial block: two copies, one block free: refused.
    assert kv.allocate_slots([(1, list(range(10)), 9, 1), (2, list(range(10)), 9, 1)]) is None
    assert kv.block_ids(1) == kv.block_ids(2) and kv.num_free_blocks == 1
    kv.free(2)
    assert kv.num_logical_blocks == 3
    kv.check_invariants()
