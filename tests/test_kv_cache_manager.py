"""The paging "operating system" on its own: block pool, block tables, CoW, prefix cache."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedserve.kv.block_pool import BlockPool, NoFreeBlocksError, block_key, prefix_block_keys
from pagedserve.kv.kv_cache_manager import KVCacheManager, cdiv
from tests.conftest import examples


def test_blocks_are_allocated_on_demand():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    assert kv.allocate(1, tokens, 0, 3) == []
    assert kv.num_held_blocks(1) == 1               # 3 tokens: one block
    kv.allocate(1, tokens, 3, 1)
    assert kv.num_held_blocks(1) == 1               # 4 tokens still fit in one block
    kv.allocate(1, tokens, 4, 1)
    assert kv.num_held_blocks(1) == 2               # the 5th token opens a second block
    assert kv.num_free_blocks == 6
    kv.free(1)
    assert kv.num_free_blocks == 8
    kv.check_invariants()


def test_fork_shares_blocks_and_copy_on_write_copies_the_partial_block():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    prompt = list(range(6))                          # blocks: [0..3] full, [4,5] partial
    kv.allocate(1, prompt, 0, 6)
    kv.fork(1, 2)
    assert kv.block_ids(1) == kv.block_ids(2)
    assert [b.ref_cnt for b in kv.tables[1]] == [2, 2]
    assert kv.num_free_blocks == 6                   # sharing costs nothing
    # Sequence 2 writes position 6, inside the shared partial block: it gets a copy.
    copies = kv.allocate(2, prompt + [7], 6, 1)
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == kv.block_ids(1)[1] and dst == kv.block_ids(2)[1] and src != dst
    assert kv.block_ids(1)[0] == kv.block_ids(2)[0]  # the full block stays shared
    # Sequence 1 is now the only holder of its block: it writes in place.
    assert kv.allocate(1, prompt + [9], 6, 1) == []
    kv.check_invariants()
    kv.free(1)
    kv.free(2)
    assert kv.num_free_blocks == 8
    kv.check_invariants()


def test_fork_at_a_block_boundary_needs_no_copy():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    kv.allocate(1, list(range(4)), 0, 4)
    kv.fork(1, 2)
    assert kv.allocate(2, list(range(5)), 4, 1) == []
    assert kv.allocate(1, list(range(5)), 4, 1) == []
    assert kv.block_ids(1)[1] != kv.block_ids(2)[1]
    kv.check_invariants()


def test_num_blocks_needed_matches_allocate():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=False)
    kv.allocate(1, list(range(6)), 0, 6)
    kv.fork(1, 2)
    before = kv.num_free_blocks
    need = kv.num_blocks_needed(2, 6, 5)              # CoW of the partial block + 1 new block
    assert need == 2
    kv.allocate(2, list(range(11)), 6, 5)
    assert before - kv.num_free_blocks == need


def test_prefix_cache_hit_reuses_full_blocks_only():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(10))                         # two full blocks, one partial
    kv.allocate(1, prompt, 0, 10)
    hits = kv.lookup_prefix(prompt)
    assert [b.block_id for b in hits] == kv.block_ids(1)[:2]
    # The last token is never a hit: a prompt of exactly 8 tokens matches one block.
    assert len(kv.lookup_prefix(prompt[:8])) == 1
    assert kv.lookup_prefix([99] + prompt[1:]) == []
    kv.free(1)
    # Freed cached blocks stay findable until they are reused.
    hits = kv.lookup_prefix(prompt)
    assert len(hits) == 2
    kv.allocate(2, prompt, 0, 0, prefix_blocks=hits)
    kv.allocate(2, prompt, 8, 2)
    assert kv.block_ids(2)[:2] == [b.block_id for b in hits]
    kv.check_invariants()


def test_block_keys_are_equal_for_equal_prefixes_and_depend_on_every_earlier_token():
    B, tokens = 4, list(range(100, 120))                 # five full blocks
    keys = list(prefix_block_keys(tokens, B, 5))
    assert keys == list(prefix_block_keys(tuple(tokens), B, 5))   # the same tokens: the same keys
    assert len(set(keys)) == 5 and all(isinstance(k, bytes) and len(k) == 32 for k in keys)
    for pos in range(len(tokens)):                       # change any one token: every block from its on differs
        changed = list(prefix_block_keys(tokens[:pos] + [tokens[pos] + 1] + tokens[pos + 1:], B, 5))
        first = pos // B
        assert changed[:first] == keys[:first]
        assert all(c != k for c, k in zip(changed[first:], keys[first:])), pos
    # The salt is part of the first key, so it reaches every later one.
    salted = {salt: list(prefix_block_keys(tokens, B, 5, salt)) for salt in ("a", "b")}
    assert salted["a"] == list(prefix_block_keys(tokens, B, 5, "a"))
    assert all(len({keys[i], salted["a"][i], salted["b"][i]}) == 3 for i in range(5))
    # The encoding is unambiguous: token count, parent and extra keys cannot trade places.
    assert block_key(None, [1, 2]) != block_key(None, [1, 2, 0]) != block_key(None, [1, 2], ("x",))
    assert block_key(keys[0], [1]) != block_key(None, [1])


def test_colliding_python_hashes_do_not_let_a_prefix_take_another_prefixes_blocks():
    """Keys used to chain Python's hash() of the parent key: hash(5) == hash(5 + 2**61 - 1), so
    two different first blocks had the same child keys, and a request whose own first block was
    cached took another prefix's second block as a hit. (Ids of a real vocabulary are smaller,
    but 64-bit collisions of in-vocabulary blocks can be searched for the same way.)"""
    kv = KVCacheManager(num_blocks=8, block_size=2)
    kv.allocate(1, [5, 6, 7, 8, 9], 0, 5)                # the victim's blocks [5, 6], [7, 8] are cached
    twin = 5 + 2**61 - 1
    kv.allocate(2, [twin, 6, 0], 0, 3)                   # the attacker's own first block is cached
    hits = kv.lookup_prefix([twin, 6, 7, 8, 9])
    assert hits == kv.tables[2][:1], "a block computed after another prefix was taken as a hit"


def test_salted_sequences_share_blocks_only_with_the_same_salt():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(10))                             # two full blocks
    kv.allocate(1, prompt, 0, 0, cache_salt="tenant-a")
    kv.allocate(1, prompt, 0, 10)
    assert kv.lookup_prefix(prompt) == [] and kv.lookup_prefix(prompt, "tenant-b") == []
    assert kv.lookup_prefix(prompt, "tenant-a") == kv.tables[1][:2]
    kv.fork(1, 2)                                        # a fork keeps the salt: its next full block is salted too
    kv.allocate(2, prompt + [10, 11, 12], 10, 3)
    assert kv.lookup_prefix(prompt + [10, 11, 12, 13], "tenant-a") == kv.tables[2][:3]
    assert kv.lookup_prefix(prompt + [10, 11, 12, 13]) == []
    kv.allocate(3, prompt, 0, 10)                        # unsalted: computes and caches its own copy
    assert kv.lookup_prefix(prompt) == kv.tables[3][:2]
    assert not {b.block_id for b in kv.tables[3]} & {b.block_id for b in kv.tables[1]}
    kv.check_invariants()
    for sid in (1, 2, 3):
        kv.free(sid)
    assert kv.num_free_blocks == 16 and not kv.salts


def test_eviction_is_lru_and_uncached_blocks_go_first():
    pool = BlockPool(4, enable_caching=True)
    a, b, c, d = pool.allocate(4)
    pool.cache(a, (None, (1,)))
    pool.cache(b, (None, (2,)))
    pool.release([a])   # cached, freed first: least recently used
    pool.release([b])
    pool.release([c])   # not cached: reused before any cached block
    assert [blk.block_id for blk in pool.allocate(1)] == [c.block_id]
    assert [blk.block_id for blk in pool.allocate(1)] == [a.block_id]
    assert pool.lookup((None, (1,))) is None      # evicted
    assert pool.lookup((None, (2,))) is b
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)


def test_free_releases_tail_first_so_prefix_blocks_survive_longer():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    tokens = list(range(7))
    kv.allocate(1, tokens, 0, 6)
    ids = kv.block_ids(1)
    kv.free(1)
    (first_reused,) = kv.pool.allocate(1)
    assert first_reused.block_id == ids[-1]


# ---- property-based: random appends, forks and frees -----------------------------------------

class KVMachine(RuleBasedStateMachine):
    """Sequences grow, fork and end at random over a tiny pool; invariants hold throughout."""

    @initialize(num_blocks=st.integers(2, 12), block_size=st.sampled_from([1, 2, 4]),
                caching=st.booleans(), num_host_blocks=st.integers(0, 10))
    def setup(self, num_blocks, block_size, caching, num_host_blocks):
        self.kv = KVCacheManager(num_blocks, block_size, caching, num_host_blocks)
        self.seqs: dict[int, list[int]] = {}       # seq id -> tokens (all computed), on the device
        self.swapped: list[dict[int, list[int]]] = []   # groups swapped out together
        self.next_id = 0
        self.salts: dict[int, str | None] = {}     # seq id -> cache salt (forks inherit it)
        self.key_owner: dict[bytes, tuple] = {}    # prefix key -> (salt, the block's tokens) it stands for
        # A shadow of the KV memory: what token each slot of each block holds, on the
        # device and in swap space.
        self.content: dict[int, list] = {i: [None] * block_size for i in range(num_blocks)}
        self.host_content: dict[int, list] = {i: [None] * block_size for i in range(num_host_blocks)}

    def _write(self, sid, tokens, start, copies):
        """Do what the worker does: block copies first, then write the step's tokens."""
        for src, dst in copies:
            self.content[dst] = list(self.content[src])
        B = self.kv.block_size
        table = self.kv.tables[sid]
        for pos in range(start, len(tokens)):
            block = table[pos // B]
            assert block.ref_cnt == 1, "a shared block is written"
            self.content[block.block_id][pos % B] = tokens[pos]

    def _new_id(self):
        self.next_id += 1
        return self.next_id

    @rule(n=st.integers(1, 9), vocab=st.integers(1, 3), salt=st.sampled_from([None, "a", "b"]), data=st.data())
    def add(self, n, vocab, salt, data):
        tokens = data.draw(st.lists(st.integers(0, vocab), min_size=n, max_size=n))
        sid = self._new_id()
        hits = self.kv.lookup_prefix(tokens, salt)
        computed = len(hits) * self.kv.block_size
        need = self.kv.num_blocks_needed(sid, computed, n - computed, hits)
        if need > self.kv.num_free_blocks:
            return
        free_before = self.kv.num_free_blocks
        self.kv.allocate(sid, tokens, 0, 0, prefix_blocks=hits, cache_salt=salt)
        copies = self.kv.allocate(sid, tokens, computed, n - computed)
        self._write(sid, tokens, computed, copies)
        assert free_before - self.kv.num_free_blocks <= need
        self.seqs[sid] = tokens
        self.salts[sid] = salt

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(0, 3))
    def append(self, data, token):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        tokens = self.seqs[sid] + [token]
        need = self.kv.num_blocks_needed(sid, len(tokens) - 1, 1)
        if need > self.kv.num_free_blocks:
            return
        table_before = list(self.kv.tables[sid])
        copies = self.kv.allocate(sid, tokens, len(tokens) - 1, 1)
        # The block written is private after the call (invariant 2).
        written = self.kv.tables[sid][(len(tokens) - 1) // self.kv.block_size]
        assert written.ref_cnt == 1
        for src, dst in copies:
            assert src in {b.block_id for b in table_before} and dst == written.block_id
        self._write(sid, tokens, len(tokens) - 1, copies)
        self.seqs[sid] = tokens

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), new=st.lists(st.integers(0, 3), min_size=2, max_size=7))
    def extend(self, data, new):
        """Several tokens in one step (a chunk, or a recompute), possibly starting inside a
        shared block."""
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        old = self.seqs[sid]
        tokens = old + new
        need = self.kv.num_blocks_needed(sid, len(old), len(new))
        if need > self.kv.num_free_blocks:
            return
        free_before = self.kv.num_free_blocks
        copies = self.kv.allocate(sid, tokens, len(old), len(new))
        assert free_before - self.kv.num_free_blocks <= need
        self._write(sid, tokens, len(old), copies)
        self.seqs[sid] = tokens

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        child = self._new_id()
        free_before = self.kv.num_free_blocks
        self.kv.fork(parent, child)
        assert self.kv.num_free_blocks == free_before
        self.seqs[child] = list(self.seqs[parent])
        self.salts[child] = self.salts[parent]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.kv.free(sid)
        del self.seqs[sid]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def swap_out(self, data):
        """A group of sequences (which may share blocks) goes to swap space, or, if it does
        not fit there, nothing changes."""
        group = data.draw(st.lists(st.sampled_from(sorted(self.seqs)), min_size=1, unique=True))
        distinct = {b.block_id for sid in group for b in self.kv.tables[sid]}
        assert self.kv.swap.num_blocks_to_swap(group) == len(distinct)
        if not self.kv.swap.can_swap_out(group):
            with pytest.raises(NoFreeBlocksError):
                self.kv.swap.swap_out(group)
            return
        free, host_free = self.kv.num_free_blocks, self.kv.swap.num_free_blocks
        still_held = {b.block_id for sid in set(self.seqs) - set(group) for b in self.kv.tables[sid]}
        moved = self.kv.swap.swap_out(group)
        assert sorted(d for d, _ in moved) == sorted(distinct)          # each block once
        assert self.kv.swap.num_free_blocks == host_free - len(distinct)
        assert self.kv.num_free_blocks == free + len(distinct - still_held)
        for dev, host in moved:
            self.host_content[host] = list(self.content[dev])
        self.swapped.append({sid: self.seqs.pop(sid) for sid in group})

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        i = data.draw(st.integers(0, len(self.swapped) - 1))
        group = sorted(self.swapped[i])
        if self.kv.swap.num_blocks_to_swap(group) > self.kv.num_free_blocks:
            return
        for host, dev in self.kv.swap.swap_in(group):
            self.content[dev] = list(self.host_content[host])
        self.seqs.update(self.swapped.pop(i))

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def free_swapped(self, data):
        """A swapped-out sequence is aborted: its host blocks go back."""
        i = data.draw(st.integers(0, len(self.swapped) - 1))
        sid = data.draw(st.sampled_from(sorted(self.swapped[i])))
        self.kv.free(sid)
        del self.swapped[i][sid]
        if not self.swapped[i]:
            del self.swapped[i]

    @invariant()
    def paging_invariants(self):
        if not hasattr(self, "kv"):
            return
        self.kv.check_invariants()
        B = self.kv.block_size
        for sid, tokens in self.seqs.items():
            assert self.kv.num_held_blocks(sid) == cdiv(len(tokens), B)
            # Every sequence reads back exactly its own tokens through its block table,
            # whatever was shared, copied on write or reused from the prefix cache.
            held = [self.content[b.block_id][pos % B]
                    for pos, b in ((p, self.kv.tables[sid][p // B]) for p in range(len(tokens)))]
            assert held == tokens
        # ... and a swapped-out sequence's tokens are all in its host blocks.
        for group in self.swapped:
            for sid, tokens in group.items():
                assert self.kv.num_held_blocks(sid) == 0
                table = self.kv.swap.tables[sid]
                assert len(table) == cdiv(len(tokens), B)
                assert [self.host_content[table[p // B].block_id][p % B] for p in range(len(tokens))] == tokens
        if not self.seqs:
            assert self.kv.num_free_blocks == self.kv.pool.num_blocks
        if not self.swapped:
            assert self.kv.swap.num_free_blocks == self.kv.swap.num_blocks
        # A key stands for one salt and one block of tokens (after the same prefix), whichever
        # sequence computed it: sequences with different salts never share a key ...
        everyone = {**self.seqs, **{sid: t for group in self.swapped for sid, t in group.items()}}
        for sid, keys in self.kv.keys.items():
            for i, key in enumerate(keys):
                owner = (self.salts[sid], everyone[sid][i * B:(i + 1) * B])
                assert self.key_owner.setdefault(key, owner) == owner
        # ... and the prefix-cache index only points at blocks holding exactly the key's tokens,
        # held or free: a cached block is never written, and it is uncached before reuse.
        for key, block in self.kv.pool.cached.items():
            assert self.content[block.block_id] == self.key_owner[key][1]
        # The accounting: sharing saving = blocks saved / blocks needed without sharing.
        stats = self.kv.stats().as_dict()
        held = {b.block_id for t in self.kv.tables.values() for b in t}
        logical = sum(len(t) for t in self.kv.tables.values())
        assert stats["num_used_blocks"] == len(held) and stats["num_logical_blocks"] == logical
        assert stats["sharing_saving"] == ((logical - len(held)) / logical if logical else 0.0)

    def teardown(self):
        if hasattr(self, "kv"):
            for sid in [*self.seqs, *(sid for group in self.swapped for sid in group)]:
                self.kv.free(sid)
            assert self.kv.num_free_blocks == self.kv.pool.num_blocks
            assert self.kv.swap.num_free_blocks == self.kv.swap.num_blocks
            self.kv.check_invariants()


KVMachine.TestCase.settings = settings(max_examples=examples(150), stateful_step_count=40, deadline=None)
test_kv_state_machine = pytest.mark.fuzz(KVMachine.TestCase)


@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), st.sampled_from([1, 2, 3, 16]))
def test_prefix_lookup_never_covers_the_last_token(tokens, block_size):
    kv = KVCacheManager(64, block_size)
    kv.allocate(1, tokens, 0, len(tokens))
    hits = kv.lookup_prefix(tokens)
    assert len(hits) * block_size <= len(tokens) - 1
    assert len(hits) == (len(tokens) - 1) // block_size


# ---- blocks of batch-dependent steps (batch_invariant "auto": a greedy request's lookup) -------
def test_a_greedy_lookup_stops_at_the_first_block_a_batch_dependent_step_computed():
    """Under auto, steps of sampled requests only compute with other arithmetic (prefill chunks
    on dequantized tiles): their blocks hold other K and V than a greedy request computes alone,
    so its lookup (invariant_only) stops at the first such block; a later block, though a
    batch-invariant step computed it, attends over that one and is not taken either."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(17))                             # four full blocks looked up
    kv.allocate(1, prompt, 0, 8)                          # blocks 0-1: a batch-invariant step
    kv.allocate(1, prompt, 8, 4)                          # block 2: a step of sampled requests only
    kv.mark_batch_dependent([(1, 8)])
    kv.allocate(1, prompt, 12, 5)                         # block 3: batch-invariant again
    kv.check_invariants()
    assert kv.lookup_prefix(prompt) == kv.tables[1][:4]   # a sampled request takes them all
    assert kv.lookup_prefix(prompt, invariant_only=True) == kv.tables[1][:2]
    assert [b.batch_invariant for b in kv.tables[1][:4]] == [True, True, False, False]
    # A greedy request takes blocks 0-1 and computes 2-3 itself: its copies replace the others
    # in the cache (greedy requests take them from now on), which stay with their holder.
    old = kv.tables[1][2:4]
    assert kv.admit(2, prompt, 32, invariant_only=True) == 8
    kv.allocate_slots([(2, prompt, 8, 9)])
    kv.check_invariants()
    assert kv.lookup_prefix(prompt, invariant_only=True) == kv.tables[2][:4] == kv.lookup_prefix(prompt)
    assert all(b.key is None and b.ref_cnt == 1 for b in old)
    kv.free(1)                                            # uncached: reused first, nothing lost
    assert {b.block_id for b in old} <= set(list(kv.pool.free_queue)[:3])   # with its partial block 4
    kv.check_invariants()


def test_a_batch_dependent_prefix_makes_the_blocks_after_it_batch_dependent():
    """A sampled request that takes a batch-dependent prefix computes its next blocks over it:
    even in a batch-invariant step they are not invariant (no greedy request takes them), and
    a fork, swap space and a batch-invariant copy computed meanwhile keep the flags true."""
    kv = KVCacheManager(num_blocks=16, block_size=4, num_host_blocks=16)
    prompt = list(range(9))
    kv.allocate(1, prompt, 0, 9)
    kv.mark_batch_dependent([(1, 0)])                     # all of sequence 1 batch-dependent
    longer = prompt + list(range(100, 108))
    assert kv.admit(2, longer, 32) == 8                   # a sampled request takes both blocks
    kv.allocate_slots([(2, longer, 8, 9)])                # a batch-invariant step
    kv.fork(2, 3)
    assert kv.lookup_prefix(longer) == kv.tables[2][:4]
    assert kv.lookup_prefix(longer, invariant_only=True) == []
    assert not any(b.batch_invariant for b in kv.tables[2][:4])    # (its partial block: set once full)
    kv.swap.swap_out([2, 3])
    kv.swap.swap_in([2, 3])
    kv.check_invariants()
    assert not any(b.batch_invariant for b in kv.tables[2][:4]) and kv.lookup_prefix(longer, invariant_only=True) == []
    # A step that is not invariant from a later position leaves the blocks before it as they were.
    kv.allocate(4, longer, 0, 12)
    kv.mark_batch_dependent([(4, 8)])
    assert [b.batch_invariant for b in kv.tables[4]] == [True, True, False]
    assert kv.lookup_prefix(longer, invariant_only=True) == kv.tables[4][:2]
    kv.check_invariants()
