"""The worker's LoRA weights: max_loras slots of stacked tensors on the model's device, a host
cache of the last max_cpu_loras adapters read (laid out as a slot holds them, so a load is a
few copies; `prefetch` reads one ahead in a background thread, on one OpenMP thread), and the per-step delta.

Per linear module (qkv, o, gate_up, down) a slot owns K = parts * max_rank rank columns, R
per part (the adapter's r of them filled): A holds the shrink matrices of the parts the
slot's adapter targets, every slot's block after the previous one ([layers, slots * K, in]),
and BT the expand matrices transposed with the scale folded in, each part's in its own rank
rows and output columns ([layers, slots * K, out], zero elsewhere; a fused qkv or gate_up
gets each part's delta in its own columns). So the slots of a contiguous range are one
[span * K, in] matrix.

Where the model has a compiled CPU layer loop, every step with adapter rows (decodes and
prefill chunks) takes its deltas there (LoRAStep.compiled_key / compiled_weights / row_blocks;
kernels/cpu.py LoraTable, cpu_kernels.cpp lora_delta): the rows are grouped by slot and each
group multiplied by its own slot's filled rank rows only, so the work grows with the rows, not
rows x adapters, and the table is only addresses into these tensors (nothing is copied when
the range changes; for bf16 AMX tiles BT also in rank pairs, BTP, made here at load). Elsewhere (tensor parallelism, GPU) LoRAStep.add costs the same few ops
per module whatever number of adapters its rows use: with few rows (decodes, MASKED_ROWS),
u = x @ A[range].T over the rank columns of every slot from the lowest to the highest active
one, u *= mask (each row keeps its own slot's columns; base rows (-1) none), out += u @
BT[range]: 3 ops, 2 when one adapter has every row. The mask is made once per step, the
per-layer views once per slot range (sticky: _range). With many rows (prefill) the wasted
columns would cost more than the ops they save, so each adapter's rows are gathered,
multiplied by its own block, and added back. The base model's rows get nothing and a step
without adapter rows does not come here at all.

Under tensor parallelism each rank holds the slices of its shard (models/sharding.py), as the
layers they adapt: a column-parallel part (q, k, v, gate, up) its output columns of BT (A
whole), a row-parallel one (o, down) its columns of A (BT whole), so its delta is a partial
sum that the layer's all-reduce completes with the base output's.
"""
from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from pagedserve.batch import LoRALoad
from pagedserve.kernels.cpu import lora_pack_bt
from pagedserve.kernels.threads import set_thread_count
from pagedserve.lora.adapter import part_shapes, read_adapter, read_tensors

# Each linear module of a layer and its parts, in the order of its output columns.
MODULES = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}
# Steps of up to this many rows multiply every slot of the active range and mask (few ops);
# larger ones gather each adapter's rows (few wasted FLOPs).
MASKED_ROWS = 64


@dataclass
class HostPart:
    """One part of an adapter as a slot holds it, on the host: [layers, max_lora_rank, in] A
    rows, [layers, max_lora_rank, out] BT rows (rows past the adapter's rank zero), and BT's
    rank pairs ([layers, max_lora_rank / 2, out, 2]) where the slots keep them."""
    a: torch.Tensor
    bt: torch.Tensor
    btp: torch.Tensor | None


@dataclass
class HostAdapter:
    rank: int
    parts: dict[str, HostPart]


def _one_openmp_thread() -> None:
    """The reader thread's torch ops run on it alone. A second live thread with its own OpenMP
    team puts more OpenMP threads than CPUs, and libgomp then cuts its spinning at barriers
    (GOMP_SPINCOUNT's throttled count): every later step ran 2.2x slower (the compiled layer
    loop meets hundreds of times a step). The engine's thread keeps its own count: OpenMP's is
    per thread, and torch's global only seeds threads that start later."""
    set_thread_count(1)


class LoRAWeights:
    def __init__(self, args, max_loras: int, max_lora_rank: int, max_cpu_loras: int, dtype: torch.dtype,
                 device: torch.device, shard=None) -> None:
        """args: the whole model's shapes; shard: this rank's (models/sharding.py Shard; None: one process)."""
        self.args, self.max_rank, self.dtype, self.device = args, max_lora_rank, dtype, torch.device(device)
        self.max_loras, self.max_cpu_loras = max_loras, max_cpu_loras
        self.slices = _shard_slices(args, shard)
        self.shapes = part_shapes(shard.local_args(args) if shard is not None else args)
        offsets = {}
        for module, parts in MODULES.items():
            start = 0
            for p in parts:
                offsets[p] = (start, start + self.shapes[p][1])
                start += self.shapes[p][1]
        self.part_cols = {p: slice(*c) for p, c in offsets.items()}
        self.A: dict[str, torch.Tensor] = {}    # module -> [layers, slots * K, in], made when first needed
        self.BT: dict[str, torch.Tensor] = {}   # module -> [layers, slots * K, out]
        # module -> BT in rank pairs, [layers, slots * K / 2, out, 2] (kernels/cpu.py lora_pack_bt): the compiled
        # loop's bf16 AMX tiles read it (kernels/cpu.py LoraTable); bf16 on the CPU only.
        self.BTP: dict[str, torch.Tensor] = {}
        self.pack = dtype == torch.bfloat16 and torch.device(device).type == "cpu" and max_lora_rank % 2 == 0
        self.K = {m: len(parts) * max_lora_rank for m, parts in MODULES.items()}   # rank columns per slot
        self.held: list[tuple[int, str] | None] = [None] * max_loras   # slot -> (lora_int_id, path)
        # Per slot, the modules its adapter targets and how many of its K columns they reach.
        self.plan: list[dict[str, int]] = [{} for _ in range(max_loras)]
        # Per slot and module its adapter targets: rank | (the parts it targets, a bit each) << 16.
        self.info: list[dict[str, int]] = [{} for _ in range(max_loras)]
        self.reading: dict[tuple[int, str], Future] = {}     # prefetch: reads under way in the background
        self._reader: ThreadPoolExecutor | None = None       # one thread, made at the first prefetch
        self.host: OrderedDict[tuple[int, str], HostAdapter] = OrderedDict()   # (id, path) -> slot-ready copy, LRU first
        # (module, first slot, last slot) -> per layer (A[range].T, BT[range]): views, valid while the tensors live
        self.views: dict[tuple[str, int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.last_range = (-1, -1)      # the slots the last step multiplied (_range)
        self.generation = 0             # loads so far

    # ---- slots ---------------------------------------------------------------------------
    def load(self, load: LoRALoad) -> None:
        """Put an adapter into its slot: per part a copy of the host cache's slot-ready rows
        (_prepare), zeros for the parts it does not target."""
        key = (load.lora_int_id, load.path)
        if self.held[load.slot] == key:
            return
        entry = self._host(key)
        s, R = load.slot, self.max_rank
        self.held[s], self.plan[s], self.info[s] = None, {}, {}     # until the copy below is complete
        self.views.clear()           # a single slot's views are trimmed to its adapter's rank
        self.generation += 1         # and a compiled loop's tables are stale
        plan, info = {}, {}
        for module, parts in MODULES.items():
            targeted = [p for p in parts if p in entry.parts]
            if not targeted and module not in self.A:
                continue
            K = self.K[module]
            if module not in self.A:
                self.A[module] = self._zeros(K, self.shapes[parts[0]][0])
                self.BT[module] = self._zeros(K, sum(self.shapes[p][1] for p in parts))
                if self.pack:
                    self.BTP[module] = lora_pack_bt(self.BT[module])
            for j, p in enumerate(parts):
                rows = slice(s * K + j * R, s * K + (j + 1) * R)     # each part in its own R rows
                pairs = slice(rows.start // 2, rows.stop // 2)
                cols = self.part_cols[p]
                ready = entry.parts.get(p)
                if ready is None:       # the part's rows of BT are zero outside its columns anyway
                    self.A[module][:, rows].zero_()
                    self.BT[module][:, rows, cols].zero_()
                    if module in self.BTP:
                        self.BTP[module][:, pairs, cols].zero_()
                    continue
                self.A[module][:, rows].copy_(ready.a)
                self.BT[module][:, rows, cols].copy_(ready.bt)
                if module in self.BTP:
                    self.BTP[module][:, pairs, cols].copy_(ready.btp)
            if targeted:
                r = entry.rank
                plan[module] = parts.index(targeted[-1]) * R + r
                info[module] = r | sum(1 << parts.index(p) for p in targeted) << 16
        self.held[s], self.plan[s], self.info[s] = key, plan, info

    def prefetch(self, lora_int_id: int, path: str) -> None:
        """Start reading an adapter into the host cache in the background (a request that will
        need it has arrived), so the step that puts it into a slot only copies. Errors are
        left for load, which reads it again and raises them there."""
        key = (lora_int_id, path)
        self._collect()
        if key in self.host or key in self.reading:
            return
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-read",
                                              initializer=_one_openmp_thread)
        self.reading[key] = self._reader.submit(self._prepare, key)

    def _collect(self) -> None:
        """Reads finished in the background go into the host cache (only this thread changes it)."""
        for key, future in list(self.reading.items()):
            if future.done():
                del self.reading[key]
                if future.exception() is None:
                    self._cache(key, future.result())

    def _cache(self, key: tuple[int, str], entry: "HostAdapter") -> "HostAdapter":
        self.host[key] = entry
        self.host.move_to_end(key)
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return entry

    def _prepare(self, key: tuple[int, str]) -> "HostAdapter":
        """An adapter read, checked and laid out as a slot holds it: per part its A rows and BT
        rows (this rank's slices, the scale folded in) zero-padded to max_lora_rank, for every
        layer, and BT's rank pairs where the slots keep them (BTP)."""
        spec = read_adapter(key[1], str(key[0]), self.args, self.max_rank)
        L, R, r = self.args.num_layers, self.max_rank, spec.rank
        parts = {p: HostPart(torch.zeros(L, R, self.shapes[p][0], dtype=self.dtype),
                             torch.zeros(L, R, self.shapes[p][1], dtype=self.dtype), None) for p in spec.parts}
        # Each tensor in one pass from the mapped file into its place (converted there; B scaled
        # in float32 and rounded once, as before): no whole-file copy and no per-tensor
        # temporaries (a rank-16 adapter of the default model: 22 -> 16-18 ms).
        for layer, p, a, b in read_tensors(spec):
            a, b = self._slice(p, a, b)
            parts[p].a[layer, :r].copy_(a)
            torch.mul(b.float().T, spec.scaling, out=parts[p].bt[layer, :r])
        if self.pack:
            for part in parts.values():
                part.btp = lora_pack_bt(part.bt)
        return HostAdapter(r, parts)

    def _slice(self, part: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's A and B of a part: B's rows of a column-parallel one, A's columns of a row-parallel one."""
        rows = self.slices.get(part)
        if rows is None:
            return a, b
        if part in ("o", "down"):
            return a[:, rows[0]:rows[1]], b
        return a, b[rows[0]:rows[1]]

    def _zeros(self, per_slot: int, cols: int) -> torch.Tensor:
        return torch.zeros(self.args.num_layers, self.max_loras * per_slot, cols, dtype=self.dtype,
                           device=self.device)

    def _host(self, key: tuple[int, str]) -> "HostAdapter":
        """An adapter's slot-ready host copy (_prepare), read at most once while it stays in the
        host cache (max_cpu_loras adapters, least recently used out first); a read started by
        prefetch is waited for."""
        self._collect()
        hit = self.host.get(key)
        if hit is not None:
            self.host.move_to_end(key)
            return hit
        future = self.reading.pop(key, None)
        if future is not None and future.exception() is None:
            return self._cache(key, future.result())
        return self._cache(key, self._prepare(key))     # (a failed prefetch: read again, raising here)

    # ---- a step ----------------------------------------------------------------------------
    def step(self, slots: list[int], row_counts: list[int]) -> "LoRAStep | None":
        """The step's delta: `slots[i]` is sequence i's slot (-1: base), `row_counts[i]` its
        query rows (in the flat batch's order). None when no row has an adapter."""
        active = sorted({s for s in slots if s >= 0})
        if not active:
            return None
        row_slot = [s for s, n in zip(slots, row_counts) for _ in range(n)]
        lo, hi = self._range(active)
        return LoRAStep(self, lo, hi, row_slot, lo == hi and all(s >= 0 for s in slots))

    def _range(self, active: list[int]) -> tuple[int, int]:
        """The slots a step multiplies: the last step's range while it holds the active slots
        and is at most twice as wide as they need (as requests finish, the same views and
        packed weights serve on), else active[0] .. active[-1]."""
        lo, hi = self.last_range
        if not (0 <= lo <= active[0] and active[-1] <= hi and hi - lo + 1 <= 2 * (active[-1] - active[0] + 1)):
            lo, hi = self.last_range = active[0], active[-1]
        return lo, hi

    def layer_views(self, module: str, lo: int, hi: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per layer, A's and BT's rank rows of slots lo..hi ([in, span * K] transposed, [span * K, out];
        one slot: only the columns its adapter fills)."""
        key = (module, lo, hi)
        views = self.views.get(key)
        if views is None and module in self.A:
            K = self.K[module]
            rows = slice(lo * K, lo * K + self.plan[lo].get(module, 0) if lo == hi else (hi + 1) * K)
            views = self.views[key] = [(a.t(), bt) for a, bt in zip(self.A[module][:, rows], self.BT[module][:, rows])]
        return views


def _shard_slices(args, shard) -> dict[str, tuple[int, int]]:
    """Per part, the range of the whole model's features this rank holds: output rows of the
    column-parallel parts, input columns of the row-parallel ones (none: one process)."""
    if shard is None or shard.size == 1:
        return {}
    D = args.head_dim
    q0, q1 = shard.q_heads(args)
    k0, k1 = shard.kv_heads(args)
    inter = shard.split(args.intermediate_size)
    return {"q": (q0 * D, q1 * D), "k": (k0 * D, k1 * D), "v": (k0 * D, k1 * D), "o": (q0 * D, q1 * D),
            "gate": inter, "up": inter, "down": inter}


@dataclass
class LoRAStep:
    weights: LoRAWeights
    lo: int                                  # the range of slots multiplied (LoRAWeights._range)
    hi: int
    row_slot: list[int]                      # each row's slot (-1: base)
    whole: bool                              # one adapter has every row

    # A compiled layer loop takes any step's deltas (kernels/cpu.py LoraTable: each slot's
    # rows multiplied by its own weights, whatever the rows); the Python loop's are below (add).
    compiled = True

    def __post_init__(self) -> None:
        w = self.weights
        self.num_rows = len(self.row_slot)
        # Per module: whether an adapter of the range targets it.
        self.targeted = {m: any(m in w.plan[s] for s in range(self.lo, self.hi + 1)) for m in MODULES}
        self.views: dict[str, list | None] = {}    # module -> layer_views, as the Python loop needs them
        self.masks: dict[int, torch.Tensor] = {}   # K -> _mask's
        self._groups: dict[int, torch.Tensor] | None = None
        self._row_tensor: torch.Tensor | None = None

    def compiled_key(self) -> tuple:
        """For a compiled loop: a key that changes when compiled_weights would (the range, the
        loads so far, the modules with a delta), so a table of them is made once per key."""
        return self.lo, self.hi, self.weights.generation, tuple(m for m in MODULES if self.targeted[m])

    def compiled_weights(self) -> tuple[dict, int, list[int]]:
        """For a compiled loop (kernels/cpu.py LoraTable): per module (None: no delta) A and BT
        over the range's rank rows ([layers, span * K, in], [layers, span * K, out]: views of
        the slot tensors) and its parts' output sizes; R; per slot of the range and module, the
        adapter's rank | the parts it targets (a bit each) << 16 (0: none)."""
        w = self.weights
        modules = {}
        for m, parts in MODULES.items():
            rows = slice(self.lo * w.K[m], (self.hi + 1) * w.K[m])
            pairs = w.BTP[m][:, rows.start // 2:rows.stop // 2] if m in w.BTP else None
            modules[m] = (w.A[m][:, rows], w.BT[m][:, rows], [w.shapes[p][1] for p in parts], pairs) \
                if self.targeted[m] else None
        info = [w.info[s].get(m, 0) for s in range(self.lo, self.hi + 1) for m in MODULES]
        return modules, w.max_rank, info

    def row_blocks(self) -> torch.Tensor:
        """Each row's slot less lo (-1: a base row), int64 on the CPU: the compiled loop's row_block."""
        lo = self.lo
        return torch.tensor([s - lo if s >= 0 else -1 for s in self.row_slot], dtype=torch.long)

    def add(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """The Python loop's delta: out[rows] += (x[rows] @ A.T) @ BT for each adapter's rows
        (in place). Up to MASKED_ROWS rows (or one adapter with every row): every slot of the
        range multiplied, each row's other slots' columns masked off; more: each adapter's
        rows gathered."""
        if module not in self.views:
            self.views[module] = self.weights.layer_views(module, self.lo, self.hi) if self.targeted[module] else None
        views = self.views[module]
        if views is None:
            return
        a_t, bt = views[layer]
        if self.whole or self.num_rows <= MASKED_ROWS:
            u = x @ a_t
            if not self.whole:
                u.mul_(self._mask(module))
            out.addmm_(u, bt)
            return
        w = self.weights
        for slot, rows in self._slot_rows().items():
            k = w.plan[slot].get(module)
            if k is not None:
                start = (slot - self.lo) * w.K[module]
                cols = slice(start, start + k)
                out.index_add_(0, rows, (x.index_select(0, rows) @ a_t[:, cols]) @ bt[cols])

    def _slot_rows(self) -> dict[int, torch.Tensor]:
        if self._groups is None:
            device = self.weights.device
            self._groups = {s: torch.tensor([i for i, r in enumerate(self.row_slot) if r == s], dtype=torch.long,
                                            device=device) for s in sorted({s for s in self.row_slot if s >= 0})}
        return self._groups

    def _mask(self, module: str) -> torch.Tensor:
        """[rows, span * K] (one slot: [rows, 1]): 1 where the column is the row's slot's, else 0."""
        K = 1 if self.lo == self.hi else self.weights.K[module]
        mask = self.masks.get(K)
        if mask is None:
            device = self.weights.device
            if self._row_tensor is None:
                self._row_tensor = torch.tensor(self.row_slot, dtype=torch.long, device=device)
            col_slot = torch.arange(self.lo, self.hi + 1, device=device).repeat_interleave(K)
            mask = self.masks[K] = (self._row_tensor[:, None] == col_slot[None, :]).to(self.weights.dtype)
        return mask
