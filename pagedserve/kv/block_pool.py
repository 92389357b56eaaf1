"""Physical KV blocks: reference counts, an LRU free queue, and the prefix-cache index.

This is the "physical memory" of the paging system. It knows block ids and
counts, never tensors: the worker owns the memory the ids point into.
"""
from __future__ import annotations

import hashlib
import json
import struct
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.kv.events import KVEventSink

# A full block's identity for prefix caching: SHA-256 over (parent block's key, its token ids,
# extra keys). Chaining through the parent makes a key stand for the whole prefix up to the
# block, and a cryptographic hash makes it infeasible to craft a prompt whose blocks collide
# with another request's (Python's 64-bit hash() of tuples can be collided on purpose).
BlockKey = bytes

_NO_PARENT = bytes(32)                  # the first block's parent: no SHA-256 output in practice
_LENGTHS = struct.Struct("<II")         # token count, extra-key bytes: no two inputs encode alike


def block_key(parent: BlockKey | None, token_ids: Sequence[int], extra_keys: tuple[str, ...] = ()) -> BlockKey:
    """The key of a full block. `extra_keys` hold what changes a block's content besides its
    tokens and prefix (a cache salt, a LoRA adapter's key; multimodal hashes would go here too)."""
    extra = json.dumps(extra_keys).encode() if extra_keys else b""
    tokens = array("q", token_ids).tobytes()
    return hashlib.sha256(b"".join((parent or _NO_PARENT, _LENGTHS.pack(len(token_ids), len(extra)),
                                    tokens, extra))).digest()


def partial_block_key(parent: BlockKey | None, token_ids: Sequence[int], extra_keys: tuple[str, ...] = ()) -> BlockKey:
    """The key of a block's first len(token_ids) < block_size tokens (a sequence's last block,
    partly computed): `block_key`'s chain, whose token count, hashed in, keeps it apart from any
    full block's key."""
    return block_key(parent, token_ids, extra_keys)


def group_key(key: BlockKey, group: int) -> BlockKey:
    """A block's key in KV group `group` (kv/groups.py): group 0 keeps the chain's key (so a model
    with one group keys its blocks as ever, and a router's lookup keys are group 0's); another
    group's blocks hold other layers' K and V for the same tokens, so its key hashes the group in."""
    if group == 0:
        return key
    return hashlib.sha256(b"".join((key, b"kv-group", group.to_bytes(4, "little")))).digest()


def kv_salt(cache_salt: str | None, lora_key: str | None) -> str | tuple | None:
    """A request's salt for the KV cache: its cache salt, and with a LoRA adapter the adapter's
    cache key too (its blocks hold other keys and values than the base model's for the same
    tokens): its id and a fingerprint of its files' content (lora/request.py LoRARequest.cache_key),
    never its name, which a later adapter may take. A tuple never encodes like a string salt
    (first_block_extra_keys), so no cache_salt a client picks can reach an adapter's blocks."""
    return cache_salt if lora_key is None else ("lora", lora_key, cache_salt)


def first_block_extra_keys(cache_salt: str | tuple | None, kv_cache_dtype: str = "auto") -> tuple[str, ...]:
    """The cache salt is an extra key of a sequence's first block, so it reaches every later key
    through the chain: requests with different salts never share a block. So is an 8-bit KV
    cache's format (kv_cache_dtype): its blocks hold other bytes than a 16-bit cache's for the
    same tokens, so keys compared or kept across engines never mix them ("auto" adds nothing).
    A tuple salt (kv_salt: a LoRA adapter's) adds its items."""
    salt = () if cache_salt is None else ("cache_salt", *cache_salt) if isinstance(cache_salt, tuple) \
        else ("cache_salt", cache_salt)
    return salt if kv_cache_dtype == "auto" else (*salt, "kv_cache_dtype", kv_cache_dtype)


def prefix_block_keys(token_ids: Sequence[int], block_size: int, num_blocks: int, cache_salt: str | None = None,
                      known: Sequence[BlockKey] = (), kv_cache_dtype: str = "auto") -> Iterator[BlockKey]:
    """Keys of full blocks len(known) .. num_blocks - 1 of a sequence, chained on from the keys
    of its blocks before them (`known`)."""
    parent = known[-1] if known else None
    for i in range(len(known), num_blocks):
        parent = block_key(parent, token_ids[i * block_size:(i + 1) * block_size],
                           first_block_extra_keys(cache_salt, kv_cache_dtype) if i == 0 else ())
        yield parent


def lookup_block_keys(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
                      kv_cache_dtype: str = "auto") -> list[BlockKey]:
    """The keys a prompt's prefix-cache lookup asks for, in order: its full blocks, except that
    the last token is always computed (its logits are sampled from), so at most len-1 tokens
    can come from the cache. The engine's lookup and the data-parallel router both use this."""
    return list(prefix_block_keys(token_ids, block_size, (len(token_ids) - 1) // block_size, cache_salt,
                                  kv_cache_dtype=kv_cache_dtype))


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    key: BlockKey | None = None      # set while the block is in the prefix cache
    # Its K and V (and those of every block before it in its sequence) were computed by
    # batch-invariant steps only (StepBatch.batch_invariant), as a greedy request computes them
    # alone: a greedy request's lookup under batch_invariant "auto" takes only such blocks. Set
    # when the block is cached (kv_cache_manager.py), cleared for a step that is not invariant.
    batch_invariant: bool = True


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    """A fixed set of blocks. Free blocks sit in an LRU queue: the front is evicted first.

    A freed block that holds a cached prefix stays findable by its key until it is
    reused for something else, so a later request with the same prefix can take it back.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, events: "KVEventSink | None" = None) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[BlockKey, KVBlock] = {}
        self.num_evictions = 0           # cached blocks reused for other content
        # Told of every key entering and leaving `cached` (kv/events.py); a new pool starts empty.
        self.events = events
        if events is not None:
            events.cleared()
        # Told of each cached block about to be reused, while it still holds its content (the
        # tier below the pool saves it: kv/tier.py); None: no tier.
        self.on_evict: Callable[[KVBlock], None] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int) -> list[KVBlock]:
        """Take n blocks off the front of the free queue (evicting their cached content)."""
        if n > len(self.free_queue):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.key is not None:
                self.num_evictions += 1
                if self.on_evict is not None:
                    self.on_evict(block)
                self._uncache(block)
            block.ref_cnt = 1
            block.batch_invariant = True
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Add a reference to each block (sharing, or a prefix-cache hit on a free block)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: list[KVBlock]) -> None:
        """Drop a reference from each block; blocks nobody holds go back to the free queue.

        Blocks with cached content go to the back (evicted last, least recently used first);
        blocks without it go to the front, since nothing is lost by reusing them.
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} released more often than held"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
                if block.key is None:
                    self.free_queue.move_to_end(block.block_id, last=False)

    def take(self, block: KVBlock) -> None:
        """Hand a free cached block to one holder as its own: out of the free queue and the prefix
        cache (a partial block whose holder writes the rest of it)."""
        assert block.ref_cnt == 0 and block.key is not None, f"block {block.block_id} is not free and cached"
        self.touch([block])
        self._uncache(block)

    def lookup(self, key: BlockKey, invariant_only: bool = False) -> KVBlock | None:
        """The cached block of the key; with invariant_only, only one that batch-invariant steps computed."""
        block = self.cached.get(key)
        return None if block is None or (invariant_only and not block.batch_invariant) else block

    def cache(self, block: KVBlock, key: BlockKey) -> None:
        """Register a full block under its key; if another block already holds the same
        tokens, that one stays the cached copy and this one stays private, unless this one was
        computed batch-invariantly and that one not: then this one replaces it (greedy requests
        can take it), and that one stays with its holders, uncached."""
        if not self.enable_caching or block.key is not None:
            return
        old = self.cached.get(key)
        if old is not None:
            if old.batch_invariant or not block.batch_invariant:
                return
            self._uncache(old)
            if old.ref_cnt == 0:          # nothing lost by reusing it first
                self.free_queue.move_to_end(old.block_id, last=False)
        block.key = key
        self.cached[key] = block
        if self.events is not None:
            self.events.stored(key)

    def _uncache(self, block: KVBlock) -> None:
        if block.key is not None:
            del self.cached[block.key]
            if self.events is not None:
                self.events.removed(block.key)
            block.key = None
