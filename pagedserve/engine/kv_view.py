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
    requests = []
    for status, queue in (("running", sched.running), ("swapped", sched.swapped), ("waiting", sched.waiting)):
        for req in queue:
            p = req.params
            requests.append(RequestView(
                req.request_id, status, "beam" if isinstance(p, BeamSearchParams) else "sample",
                p.beam_width if isinstance(p, BeamSearchParams) else p.n, req.max_seqs,
                len(req.prompt_token_ids), req.max_tokens, req.num_cached_tokens, req.num_preemptions,
                tuple(SeqView(s.seq_id, s.index, s.num_tokens, s.num_prompt_tokens, s.num_computed_tokens,
                              s.finished) for s in req.seqs)))
    counters = engine.kv_cache_stats()
    counters.update(num_running=len(sched.running), num_waiting=len(sched.waiting), num_swapped=len(sched.swapped))
    if extra_counters:
        counters.update(extra_counters)
    return EngineCapture(time.time(), engine.num_steps, engine.max_model_len, sched.kv.snapshot(), requests,
                         counters)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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


# A block as the view compares it: (state, ref count, owner request ids, owner seq ids, key).
Row = tuple[str, int, tuple[str, ...], tuple[int, ...], bytes | None]


def _rows(pool: PoolSnapshot, request_of: dict[int, str]) -> list[Row]:
    seqs_of: dict[int, list[int]] = {}
    for sid, table in pool.tables.items():
        for b in table:
            seqs_of.setdefault(b, []).append(sid)
    rows = []
    for b, (ref, key) in enumerate(zip(pool.ref_cnts, pool.keys)):
        seqs = seqs_of.get(b)
        if seqs is None:
            rows.append(("free" if key is None else "cached", ref, (), (), key))
            continue
        owners = tuple(sorted({request_of.get(s, f"seq {s}") for s in seqs}))
        rows.append(("shared" if ref > 1 else "owned", ref, owners, tuple(sorted(seqs)), key))
    return rows


class KVView:
    """Renders captures as JSON; keeps the last one's blocks to send only what changed, and the
    text of cached blocks (decoded once per key)."""

    def __init__(self, decode: Callable[[list[int]], str] | None = None) -> None:
        self.decode = decode
        self._texts: dict[bytes, str] = {}
        self._rows: list[Row] = []
        self._host_rows: list[Row] = []
        self._last: dict[str, Any] | None = None

    def full(self, cap: EngineCapture) -> dict[str, Any]:
        """The whole picture (and the base of the next `update`)."""
        rows, host_rows = self._render_rows(cap)
        out = self._header(cap)
        out["blocks"] = [self._block(cap, i, row) for i, row in enumerate(rows)]
        out["host_blocks"] = [self._block(cap, i, row) for i, row in enumerate(host_rows)]
        self._remember(rows, host_rows, out)
        return out

    def update(self, cap: EngineCapture) -> dict[str, Any] | None:
        """What changed since the last `full` or `update`: the changed blocks, and the requests,
        counters and contiguous needs whole; None if nothing did."""
        if self._last is None:
            return self.full(cap)
        rows, host_rows = self._render_rows(cap)
        out = self._header(cap)
        out["blocks"] = self._changed(cap, self._rows, rows)
        out["host_blocks"] = self._changed(cap, self._host_rows, host_rows)
        last = self._last
        same = (not out["blocks"] and not out["host_blocks"] and out["requests"] == last["requests"]
                and out["counters"] == last["counters"])
        self._remember(rows, host_rows, out)
        return None if same else out

    # ---- internals -----------------------------------------------------------------------
    def _render_rows(self, cap: EngineCapture) -> tuple[list[Row], list[Row]]:
        request_of = {s.seq_id: r.request_id for r in cap.requests for s in r.seqs}
        host = cap.kv.host
        return _rows(cap.kv.device, request_of), ([] if host is None else _rows(host, request_of))

    def _remember(self, rows: list[Row], host_rows: list[Row], out: dict[str, Any]) -> None:
        self._rows, self._host_rows = rows, host_rows
        self._last = {"requests": out["requests"], "counters": out["counters"]}

    def _changed(self, cap: EngineCapture, before: list[Row], after: list[Row]) -> list[dict[str, Any]]:
        if len(before) != len(after):
            return [self._block(cap, i, row) for i, row in enumerate(after)]
        return [self._block(cap, i, row) for i, (old, row) in enumerate(zip(before, after)) if old != row]

    def _block(self, cap: EngineCapture, block_id: int, row: Row) -> dict[str, Any]:
        state, ref, owners, seqs, key = row
        out: dict[str, Any] = {"id": block_id, "state": state, "ref_cnt": ref, "owners": list(owners),
                               "seqs": list(seqs)}
        if key is not None:
            out["hash"] = key.hex()[:HASH_CHARS]
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
                             "num_preemptions": r.num_preemptions, "seqs": seqs})
        return {"time": cap.time, "step": cap.step, "kv_allocator": kv.kv_allocator, "block_size": kv.block_size,
                "num_blocks": kv.device.num_blocks, "num_host_blocks": 0 if kv.host is None else kv.host.num_blocks,
                "max_model_len": cap.max_model_len, "requests": requests, "counters": counters,
                "contiguous": contiguous_needs(cap)}


def apply_update(snapshot: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """A full snapshot with an update applied (what the page does; tests check the two agree)."""
    out = {**snapshot, **{k: v for k, v in update.items() if k not in ("blocks", "host_blocks")}}
    for name in ("blocks", "host_blocks"):
        blocks = list(snapshot[name])
        for b in update[name]:
            blocks[b["id"]] = b
        out[name] = blocks
    return out
