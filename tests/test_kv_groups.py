"""KV groups (kv/groups.py): full-attention and sliding-window layers in one paged pool, a
block table per group, the blocks behind a window back in the pool."""
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedserve.config import EngineConfig
from pagedserve.kv.block_pool import group_key, lookup_block_keys
from pagedserve.kv.groups import first_needed_block, plan_kv_groups, window_bound
from pagedserve.kv.interface import SeqState
from pagedserve.kv.kv_cache_manager import KVCacheManager, held_blocks
from pagedserve.scheduler import Scheduler
from tests import test_fuzz_paging as fuzz_paging
from tests.conftest import examples


def test_plan_groups_layers_by_kind_in_groups_of_equal_size():
    full = plan_kv_groups([None] * 4)
    assert full.windows == (None,) and full.layer_slot == (0, 1, 2, 3) and full.layers_per_block == 4
    assert not full.hybrid
    gemma2 = plan_kv_groups([8, None] * 3)                  # alternating
    assert gemma2.windows == (None, 8) and gemma2.layers_per_block == 3
    assert gemma2.layer_group == (1, 0) * 3 and gemma2.layer_slot == (0, 0, 1, 1, 2, 2)
    gemma3 = plan_kv_groups(([16] * 5 + [None]) * 2 + [16])   # 11 window layers, 2 full: 1 + 6 groups of 2
    assert gemma3.windows == (None,) + (16,) * 6 and gemma3.layers_per_block == 2
    assert sorted(zip(gemma3.layer_group, gemma3.layer_slot)) == sorted(set(zip(gemma3.layer_group,
                                                                                gemma3.layer_slot)))


def test_window_group_holds_its_bound_while_the_full_group_grows():
    B, W = 4, 16
    kv = KVCacheManager(64, B, windows=(None, W))
    tokens = list(range(5))
    kv.allocate(1, tokens, 0, 5)
    for n in range(5, 100):
        tokens.append(n)
        kv.allocate_slots([(1, tokens, n, 1)])
        full, window = kv.tables[1], kv.group_tables[1][1]
        assert len(held_blocks(full)) == len(full) == -(-(n + 1) // B)
        assert len(window) == len(full)
        assert len(held_blocks(window)) <= window_bound(W, B) == W // B + 1
        assert all(b is not None for b in window[first_needed_block(W, n, B):])
        kv.check_invariants({1: SeqState(tokens, n, None, 0, 1)})
    assert kv.stats().num_blocks_per_group == [25, 4]            # positions 84..99: blocks 21..24
    assert kv.block_ids(1) == [b.block_id for b in kv.tables[1]]
    assert kv.group_block_ids(1)[0][:20] == [-1] * 20          # the worker's holes
    kv.free(1)
    assert kv.num_free_blocks == 64 and kv.num_logical_blocks == 0


def test_a_block_behind_the_window_that_a_fork_shares_goes_back_with_its_last_owner():
    B, W = 2, 4
    kv = KVCacheManager(32, B, enable_caching=False, windows=(W,))
    tokens = list(range(8))
    kv.allocate(1, tokens, 0, 8)
    kv.fork(1, 2)
    first = kv.tables[1][0]
    kv.allocate_slots([(1, tokens + [8], 8, 1)])     # seq 1's window moves past block 0
    assert kv.tables[1][0] is None and first.ref_cnt == 1 and kv.tables[2][0] is first
    kv.allocate_slots([(2, tokens + [9], 8, 1)])     # its last owner lets go: back in the pool (and reused)
    assert kv.tables[2][0] is None and kv.num_used_blocks == len({b.block_id for s in (1, 2) for b in
                                                                  held_blocks(kv.tables[s])}) == 4
    kv.check_invariants()


def test_prefix_hit_is_the_longest_prefix_every_group_serves():
    B, W = 4, 8
    kv = KVCacheManager(64, B, windows=(None, W))
    prompt = list(range(40))
    kv.allocate(1, prompt, 0, 40)                   # ten full blocks cached in both groups
    kv.allocate_slots([(1, prompt + [40], 40, 1)])  # the window group releases all but its last blocks
    kv.free(1)
    hit = kv.lookup_prefix_hit(prompt + [99])
    assert hit.num_blocks == 10
    first = first_needed_block(W, 40, B)
    assert hit.groups[1][:first] == [None] * first and None not in hit.groups[1][first:]
    assert None not in hit.groups[0]
    keys = lookup_block_keys(prompt + [99], B)
    assert [b.key for b in hit.groups[0]] == keys and [b.key for b in hit.groups[1][first:]] == \
        [group_key(k, 1) for k in keys[first:]]
    # Evict the window group's block 8: prefixes whose window covers it are out, and the longest
    # prefix left is 8 blocks (its window reads blocks 6 and 7).
    victim = hit.groups[1][8]
    kv.pool.free_queue.move_to_end(victim.block_id, last=False)
    kv.pool.allocate(1)
    assert kv.lookup_prefix_hit(prompt + [99]).num_blocks == 8
    # A full group's miss cuts the hit there, whatever the window group holds.
    kv.pool.free_queue.move_to_end(hit.groups[0][3].block_id, last=False)
    kv.pool.allocate(1)
    assert kv.lookup_prefix_hit(prompt + [99]).num_blocks == 3


def test_admit_takes_a_hybrid_hit_with_holes_and_computes_on():
    B, W = 4, 8
    kv = KVCacheManager(64, B, windows=(None, W))
    prompt = list(range(30))
    kv.allocate(1, prompt, 0, 30)
    kv.free(1)
    assert kv.admit(2, prompt, 40) == 28
    assert kv.group_block_ids(2)[0][:first_needed_block(W, 28, B)] == [-1] * first_needed_block(W, 28, B)
    assert kv.allocate_slots([(2, prompt, 28, 2)]) == []
    kv.check_invariants({2: SeqState(prompt, 28, None, 0, 2)})
    with pytest.raises(ValueError, match="paged"):
        from pagedserve.kv.factory import make_kv_cache_manager
        make_kv_cache_manager("oracle", 8, B, False, 64, kv_windows=(None, W))


# ---- property-based: two groups under random appends, drafts, forks, frees and preemptions ----

class TwoGroupMachine(RuleBasedStateMachine):
    """A full group and a window group over one tiny pool. A shadow of the KV memory (which
    token each slot holds) proves every sequence reads back, in every group, each token its
    next query needs; the checker proves no block leaks and the window bound holds."""

    @initialize(num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4]), window=st.integers(1, 9),
                caching=st.booleans(), num_host_blocks=st.integers(0, 12), window_first=st.booleans())
    def setup(self, num_blocks, block_size, window, caching, num_host_blocks, window_first):
        self.windows = (window, None) if window_first else (None, window)
        self.kv = KVCacheManager(num_blocks, block_size, caching, num_host_blocks, windows=self.windows)
        self.seqs: dict[int, list[int]] = {}        # on the device, all tokens computed
        self.swapped: dict[int, list[int]] = {}
        self.content = {i: [None] * block_size for i in range(num_blocks)}
        self.host_content = {i: [None] * block_size for i in range(num_host_blocks)}
        self.next_id = 0

    def _write(self, sid, tokens, start, end, copies):
        for src, dst in copies:
            self.content[dst] = list(self.content[src])
        B = self.kv.block_size
        for g in range(self.kv.num_groups):
            table = self.kv.group_tables[g][sid]
            for pos in range(start, end):
                block = table[pos // B]
                assert block is not None and block.ref_cnt == 1, "a hole or a shared block is written"
                self.content[block.block_id][pos % B] = tokens[pos]

    def _step(self, sid, tokens, computed, num_new, drafts=()):
        """allocate_slots as the scheduler calls it, the writes, and the checker with the step's
        sizes (the bound). False when blocks are short."""
        slots = tokens + list(drafts)
        copies = self.kv.allocate_slots([(sid, tokens, computed, num_new + len(drafts))])
        if copies is None:
            return False
        self._write(sid, slots, computed, computed + num_new + len(drafts), copies)
        live = {s: SeqState(t, len(t), None) for s, t in self.seqs.items()}
        live[sid] = SeqState(tokens, computed, None, len(drafts), num_new)
        self.kv.check_invariants(live, set(self.swapped))
        return True

    @rule(n=st.integers(1, 12), vocab=st.integers(1, 3), data=st.data())
    def add(self, n, vocab, data):
        """Admission: the prefix cache's hit, then the rest of the prompt in one chunk."""
        tokens = data.draw(st.lists(st.integers(0, vocab), min_size=n, max_size=n))
        self.next_id += 1
        sid = self.next_id
        computed = self.kv.admit(sid, tokens, n)
        self.seqs[sid] = tokens
        if not self._step(sid, tokens, computed, n - computed):
            self.kv.free(sid)
            del self.seqs[sid]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), new=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def append(self, data, new):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        old = self.seqs[sid]
        if not self._step(sid, old + new, len(old), len(new)):
            return
        self.seqs[sid] = old + new

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(0, 3), drafts=st.lists(st.integers(0, 3), min_size=1, max_size=3),
          accepted=st.integers(0, 3))
    def speculate(self, data, token, drafts, accepted):
        """A decode with drafts: slots for all, then the rejected ones' blocks trimmed."""
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        tokens = self.seqs[sid] + [token]
        if not self._step(sid, tokens, len(tokens) - 1, 1, drafts):
            return
        tokens += drafts[:accepted]
        self.kv.trim(sid, len(tokens))
        self.seqs[sid] = tokens

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        self.next_id += 1
        self.kv.fork(parent, self.next_id)
        self.seqs[self.next_id] = list(self.seqs[parent])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.kv.free(sid)
        del self.seqs[sid]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def preempt_by_recompute(self, data):
        """Free, then readmit from the prefix cache and recompute the rest (or wait, if short)."""
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        tokens = self.seqs[sid]
        self.kv.free(sid)
        computed = self.kv.admit(sid, tokens, len(tokens))
        if not self._step(sid, tokens, computed, len(tokens) - computed):
            self.kv.free(sid)
            del self.seqs[sid]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def swap_out(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        if not self.kv.swap.can_swap_out([sid]):
            return
        for dev, host in self.kv.swap.swap_out([sid]):
            self.host_content[host] = list(self.content[dev])
        self.swapped[sid] = self.seqs.pop(sid)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        sid = data.draw(st.sampled_from(sorted(self.swapped)))
        if self.kv.swap.num_blocks_to_swap([sid]) > self.kv.num_free_blocks:
            return
        for host, dev in self.kv.swap.swap_in([sid]):
            self.content[dev] = list(self.host_content[host])
        self.seqs[sid] = self.swapped.pop(sid)

    @invariant()
    def reads_back_what_its_next_query_needs(self):
        if not hasattr(self, "kv"):
            return
        kv, B = self.kv, self.kv.block_size
        kv.check_invariants({s: SeqState(t, len(t), None) for s, t in self.seqs.items()}, set(self.swapped))
        for pool_content, seqs, groups in ((self.content, self.seqs, kv.group_tables),
                                           (self.host_content, self.swapped, kv.swap.group_tables)):
            for sid, tokens in seqs.items():
                for g, window in enumerate(self.windows):
                    table = groups[g][sid]
                    for pos in range(first_needed_block(window, len(tokens), B) * B, len(tokens)):
                        block = table[pos // B]
                        assert block is not None and pool_content[block.block_id][pos % B] == tokens[pos], (
                            f"seq {sid} group {g} position {pos}")
                    if window is not None:
                        assert len(held_blocks(table)) <= window_bound(window, B, 12 + 3)
        if not self.seqs and not self.swapped:
            assert kv.num_free_blocks == kv.num_blocks and kv.swap.num_free_blocks == kv.swap.num_blocks

    def teardown(self):
        if hasattr(self, "kv"):
            for sid in [*self.seqs, *self.swapped]:
                self.kv.free(sid)
            assert self.kv.num_free_blocks == self.kv.num_blocks, "blocks leaked"
            assert self.kv.swap.num_free_blocks == self.kv.swap.num_blocks
            self.kv.check_invariants()


TwoGroupMachine.TestCase.settings = settings(max_examples=examples(60), stateful_step_count=40, deadline=None)
test_two_group_state_machine = pytest.mark.fuzz(TwoGroupMachine.TestCase)


# ---- the scheduler's fuzzer (tests/test_fuzz_paging.py) over a hybrid model's groups -----------

class HybridPagingMachine(fuzz_paging.PagingMachine):
    """The scheduler fuzzer's engine, with a full and a window group (or a window only): every
    step's writes go to every group's table, and each sequence reads back, per group, all its
    first query's window holds. (No draft model: the worker refuses one for a hybrid model.)"""

    @initialize(num_blocks=st.integers(4, 40), block_size=st.sampled_from([1, 2, 4]), budget=st.integers(1, 24),
                max_seqs=st.sampled_from([1, 2, 3, 6]), caching=st.booleans(), spec_k=st.sampled_from([0, 0, 2]),
                num_host_blocks=st.sampled_from([0, 0, 8, 24]),
                windows=st.sampled_from([(None, 3), (None, 6), (5,), (None, 2, 4)]))
    def setup(self, num_blocks, block_size, budget, max_seqs, caching, spec_k, num_host_blocks, windows):
        spec = {"method": "ngram", "num_speculative_tokens": spec_k, "prompt_lookup_min": 1,
                "prompt_lookup_max": 2} if spec_k else None
        config = EngineConfig(block_size=block_size, max_num_batched_tokens=max(budget, max_seqs),
                              max_num_seqs=max_seqs, enable_prefix_caching=caching, speculative_config=spec,
                              preemption_mode="swap" if num_host_blocks else "recompute")
        self.sched = Scheduler(config, num_blocks, num_host_blocks=num_host_blocks,
                               eos_token_ids={fuzz_paging.EOS}, kv_windows=windows)
        self.windows = windows
        self.host = {i: [None] * block_size for i in range(num_host_blocks)}
        self.requests, self.done, self.aborted = {}, [], set()
        self.content = {i: [None] * block_size for i in range(num_blocks)}
        self.draft_host, self.draft_content, self.proposals = {}, {}, {}
        self.counter = 0
        self.stats = dict.fromkeys(fuzz_paging._TOTALS, 0)

    def _run_on_shadow_memory(self, out) -> None:
        B = self.sched.block_size
        for dev, h in out.swap_out:
            self.host[h] = list(self.content[dev])
        for h, dev in out.swap_in:
            self.content[dev] = list(self.host[h])
        self.content.update({dst: list(self.content[src]) for src, dst in out.block_copies})
        for s in out.scheduled:
            tables = [s.block_ids, *s.group_block_ids]
            tokens = s.seq.token_ids[:s.start + s.num_new_tokens] + s.draft_token_ids
            for table in tables:
                for pos in range(s.start, len(tokens)):
                    self.content[table[pos // B]][pos % B] = tokens[pos]
        for s in out.scheduled:
            end = s.start + s.num_new_tokens
            for window, table in zip(self.windows, [s.block_ids, *s.group_block_ids]):
                first = first_needed_block(window, s.start, B) * B
                seen = [self.content[table[p // B]][p % B] for p in range(first, end)]
                assert seen == s.seq.token_ids[first:end], f"sequence {s.seq.seq_id} reads wrong KV (window {window})"


HybridPagingMachine.TestCase.settings = settings(max_examples=examples(60), stateful_step_count=30, deadline=None,
                                                 suppress_health_check=[HealthCheck.too_slow])
test_hybrid_scheduler_fuzz = pytest.mark.fuzz(HybridPagingMachine.TestCase)
