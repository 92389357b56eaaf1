"""The KV cache as the dashboard shows it: JSON built from a snapshot, and what changed since the last one.

Two halves, on two threads:
- `capture(engine)` runs on the engine's own thread, between steps: it copies the KV
  cache's flat state (`KVCache.snapshot()`, kv/snapshot.py) and a small record of each
  request (ids, queue, sequences, lengths). Nothing is derived here, so the engine pays
  only for list copies.
- `KVView` turns captures into JSON anywhere else (the server's event loop hands it to a
  worker thread): each block's state, owners, hash prefix and text; the requests with
  their block tables; the counters; and what a contiguous allocator would need. `full()`
  gives the whole picture; `update()` only the blocks that changed since the last call.

Block states: `free` (no owner, nothing cached), `owned` (one block table holds it),
`shared` (several tables: n > 1, beams, a common prefix), `cached` (no owner but in the
prefix cache: evictable, findable until reused). Owned and shared blocks that are also in
the prefix cache carry their `hash` too.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedserve.kv.snapshot import KVSnapshot, PoolSnapshot
from pagedserve.sampling_params import BeamSearchParams
from pagedserve.utils import cdiv

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine

HASH_CHARS = 16          # hex digits of a block's prefix-cache key shown


@dataclass(frozen=True)
class SeqView:
    seq_id: int
    index: int
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int
    finished: bool


@dataclass(frozen=True)
class RequestView:
    request_id: str
    status: str                   # running | waiting | swapped
    kind: str                     # sample | beam
    n: int                        # outputs asked for (beam search: beam width)
    max_seqs: int                 # sequences at once (best_of, beam width)
    num_prompt_tokens: int
    max_tokens: int
    num_cached_tokens: int        # prompt tokens found in the prefix cache
    num_preemptions: int
    seqs: tuple[SeqView, ...]
    lora: str | None = None       # its LoRA adapter's name (None: the base model)


@dataclass(frozen=True)
class EngineCapture:
    """What `capture` copied on the engine thread."""
    time: float                   # wall clock (time.time())
    step: int                     # engine steps so far
    max_model_len: int
    kv: KVSnapshot
    requests: list[RequestView]
    counters: dict[str, Any]


def capture(engine: LLMEngine, extra_counters: dict[str, Any] | None = None) -> EngineCapture:
    """Copy the KV cache and the requests' records. Call on the engine's thread, between steps."""
    sched = engine.scheduler
    queues = sched.queues
    requests = []
    for status, req in queues.by_status():
        p = req.params
        requests.append(RequestView(
            req.request_id, status, "beam" if isinstance(p, BeamSearchParams) else "sample",
            p.beam_width if isinstance(p, BeamSearchParams) else p.n, req.max_seqs,
            len(req.prompt_token_ids), req.max_tokens, req.num_cached_tokens, req.num_preemptions,
            tuple(SeqView(s.seq_id, s.index, s.num_tokens, s.num_prompt_tokens, s.num_computed_tokens,
                          s.finished) for s in req.seqs), req.lora_name))
    counters = engine.kv_cache_stats()
    counters.update(num_running=queues.num_running, num_waiting=queues.num_waiting, num_swapped=queues.num_swapped)
    if extra_counters:
        counters.update(extra_counters)
    return EngineCapture(time.time(), engine.num_steps, engine.max_model_len, sched.kv.snapshot(), requests,
                         counters)


def contiguous_needs(cap: EngineCapture) -> dict[str, int]:
    """Blocks that a contiguous-reservation allocator would hold for the running requests right
    now, beside what paging holds: Orca-Max reserves max_model_len slots per live sequence,
    Orca-Oracle prompt + max_tokens (the request's final length when nothing stops it early);
    neither shares blocks."""
    B = cap.kv.block_size
    orca_max = orca_oracle = 0
    for r in cap.requests:
        if r.status != "running":
            continue
        live = sum(not s.finished for s in r.seqs)
        orca_max += live * cdiv(cap.max_model_len, B)
        orca_oracle += live * cdiv(r.num_prompt_tokens + r.max_tokens, B)
    return {"paged_blocks": cap.counters.get("num_used_blocks", 0), "orca_max_blocks": orca_max,
            "orca_oracle_blocks": orca_oracle}


def _holders(tables: dict[int, list[int]], only: set[int] | None = None) -> dict[int, list[int]]:
    """Block id -> the sequences whose tables hold it (for the blocks in `only`, default all)."""
    seqs_of: dict[int, list[int]] = {}
    for sid, table in tables.items():
        for b in table:
            if only is None or b in only:
                seqs_of.setdefault(b, []).append(sid)
    return seqs_of


def _changed_blocks(before: PoolSnapshot, after: PoolSnapshot, moved_seqs: set[int]) -> set[int]:
    """Blocks whose reference count, key or holders may differ (whole-list compares first, at C speed)."""
    out: set[int] = set()
    for old, new in ((before.ref_cnts, after.ref_cnts), (before.keys, after.keys)):
        if old != new:
            out.update(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
    for sid in before.tables.keys() | after.tables.keys():
        old, new = before.tables.get(sid, ()), after.tables.get(sid, ())
        if sid in moved_seqs:
            out.update(old, new)
        elif old != new:
            out.update(set(old).symmetric_difference(new))
    return out


class KVView:
    """Renders captures as JSON; remembers the last picture's blocks to send only what changed,
    and the text of cached blocks (decoded once per key)."""

    def __init__(self, decode: Callable[[list[int]], str] | None = None) -> None:
        self.decode = decode
        self._texts: dict[bytes, str] = {}
        self._cap: EngineCapture | None = None
        self._request_of: dict[int, str] = {}
        self._blocks: dict[str, list[dict[str, Any]]] = {}
        self._last: dict[str, Any] = {}

    def full(self, cap: EngineCapture) -> dict[str, Any]:
        """The whole picture (and the base of the next `update`)."""
        out = self._header(cap)
        request_of = self._requests_of(cap)
        for name, pool in self._pools(cap):
            seqs_of = _holders(pool.tables)
            out[name] = [self._block(cap, pool, i, seqs_of.get(i), request_of) for i in range(pool.num_blocks)]
        self._remember(cap, request_of, out)
        return out

    def update(self, cap: EngineCapture) -> dict[str, Any] | None:
        """What changed since the last `full` or `update`: the changed blocks, and the requests,
        counters and contiguous needs whole; None if nothing did."""
        if self._cap is None:
            return self.full(cap)
        out = self._header(cap)
        request_of = self._requests_of(cap)
        moved = {sid for sid, rid in request_of.items() if self._request_of.get(sid, rid) != rid}
        before = dict(self._pools(self._cap))
        for name, pool in self._pools(cap):
            old = before.get(name)
            rows = self._blocks.get(name, [])
            if old is None or old.num_blocks != pool.num_blocks:
                seqs_of = _holders(pool.tables)
                out[name] = [self._block(cap, pool, i, seqs_of.get(i), request_of) for i in range(pool.num_blocks)]
                continue
            candidates = _changed_blocks(old, pool, moved)
            seqs_of = _holders(pool.tables, candidates)
            changed = []
            for i in sorted(candidates):
                block = self._block(cap, pool, i, seqs_of.get(i), request_of)
                if block != rows[i]:
                    changed.append(block)
            out[name] = changed
        same = (not out["blocks"] and not out["host_blocks"] and out["requests"] == self._last["requests"]
                and out["counters"] == self._last["counters"])
        self._remember(cap, request_of, out, update=True)
        return None if same else out

    # ---- internals -----------------------------------------------------------------------
    @staticmethod
    def _pools(cap: EngineCapture) -> list[tuple[str, PoolSnapshot]]:
        host = cap.kv.host
        return [("blocks", cap.kv.device)] + ([] if host is None else [("host_blocks", host)])

    @staticmethod
    def _requests_of(cap: EngineCapture) -> dict[int, str]:
        return {s.seq_id: r.request_id for r in cap.requests for s in r.seqs}

    def _remember(self, cap: EngineCapture, request_of: dict[int, str], out: dict[str, Any],
                  update: bool = False) -> None:
        """Keep the picture's blocks (a list per pool, each block's latest dict) for the next update."""
        for name, pool in self._pools(cap):
            rows = self._blocks.get(name)
            if not update or rows is None or len(rows) != pool.num_blocks:
                self._blocks[name] = list(out[name])
            else:
                for b in out[name]:
                    rows[b["id"]] = b
        self._cap, self._request_of = cap, request_of
        self._last = {"requests": out["requests"], "counters": out["counters"]}

    def _block(self, cap: EngineCapture, pool: PoolSnapshot, block_id: int, seqs: list[int] | None,
               request_of: dict[int, str]) -> dict[str, Any]:
        ref, key = pool.ref_cnts[block_id], pool.keys[block_id]
        if seqs:
            state = "shared" if ref > 1 else "owned"
            owners = sorted({request_of.get(s, f"seq {s}") for s in seqs})
            seqs = sorted(seqs)
        else:
            state, owners, seqs = ("free" if key is None else "cached"), [], []
        out: dict[str, Any] = {"id": block_id, "state": state, "ref_cnt": ref, "owners": owners, "seqs": seqs}
        if seqs and pool is cap.kv.device and cap.kv.group_of_block:   # a hybrid model's KV group (kv/groups.py)
            out["group"] = cap.kv.group_of_block.get(block_id)
        if key is not None:
            out["hash"] = key.hex()[:HASH_CHARS]
            if key in cap.kv.cached_tokens and cap.kv.cached_tokens[key] is None:
                out["hidden"] = True   # a salted request's block: its text stays its tenant's
            else:
                text = self._text(cap, key)
                if text is not None:
                    out["text"] = text
        return out

    def _text(self, cap: EngineCapture, key: bytes) -> str | None:
        text = self._texts.get(key)
        if text is None and self.decode is not None:
            tokens = cap.kv.cached_tokens.get(key)
            if tokens is None:
                return None
            if len(self._texts) > 4 * max(1, cap.kv.device.num_blocks):
                self._texts.clear()   # keys of long-evicted blocks: start again
            text = self._texts[key] = self.decode(list(tokens))
        return text

    def _header(self, cap: EngineCapture) -> dict[str, Any]:
        kv = cap.kv
        counters = dict(cap.counters)
        queries = counters.get("prefix_cache_queries", 0)
        counters["prefix_cache_hit_rate"] = counters.get("prefix_cache_hits", 0) / queries if queries else 0.0
        tables = dict(kv.device.tables)
        host_tables = kv.host.tables if kv.host is not None else {}
        requests = []
        for r in cap.requests:
            seqs = []
            for s in r.seqs:
                on_host = s.seq_id in host_tables
                seqs.append({"seq_id": s.seq_id, "index": s.index, "num_tokens": s.num_tokens,
                             "num_prompt_tokens": s.num_prompt_tokens, "num_computed_tokens": s.num_computed_tokens,
                             "finished": s.finished, "pool": "host" if on_host else "device",
                             "block_table": list(host_tables[s.seq_id] if on_host else tables.get(s.seq_id, []))})
            requests.append({"id": r.request_id, "status": r.status, "kind": r.kind, "n": r.n,
                             "max_seqs": r.max_seqs, "num_prompt_tokens": r.num_prompt_tokens,
                             "max_tokens": r.max_tokens, "num_cached_tokens": r.num_cached_tokens,
                             "num_preemptions": r.num_preemptions, "lora": r.lora, "seqs": seqs})
        return {"time": cap.time, "step": cap.step, "kv_allocator": kv.kv_allocator, "block_size": kv.block_size,
                "num_blocks": kv.device.num_blocks, "num_host_blocks": 0 if kv.host is None else kv.host.num_blocks,
                "max_model_len": cap.max_model_len, "requests": requests, "counters": counters,
                "contiguous": contiguous_needs(cap), "blocks": [], "host_blocks": []}


def apply_update(snapshot: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """A full snapshot with an update applied (what the page does; tests check the two agree)."""
    out = {**snapshot, **{k: v for k, v in update.items() if k not in ("blocks", "host_blocks")}}
    for name in ("blocks", "host_blocks"):
        blocks = list(snapshot[name])
        for b in update[name]:
            blocks[b["id"]] = b
        out[name] = blocks
    return out
