"""The worker's LoRA weights: max_loras slots of stacked tensors on the model's device, a host
cache of the last max_cpu_loras adapters read, and the per-step delta.

Per linear module (qkv, o, gate_up, down) and slot, A holds the shrink matrices of the parts
the slot's adapter targets, packed along the rank axis ([slots, layers, parts * max_rank, in]),
and B the expand matrices with the scale folded in, each part's in its own output rows and
rank columns ([slots, layers, out, parts * max_rank], zero elsewhere), so a module's delta is
one shrink and one expand GEMM whatever parts the adapter targets (a fused qkv or gate_up
gets each part's delta in its own columns). A step adds, for the rows of each adapter,
B[slot] @ (A[slot] @ x) to the module's output. The base
model's rows (-1) get nothing and a step without adapter rows does not come here at all.

Under tensor parallelism each rank holds the slices of its shard (models/sharding.py), as the
layers they adapt: a column-parallel part (q, k, v, gate, up) its rows of B (A whole), a
row-parallel one (o, down) its columns of A (B whole), so its delta is a partial sum that the
layer's all-reduce completes with the base output's.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from pagedserve.batch import LoRALoad
from pagedserve.lora.adapter import load_tensors, part_shapes, read_adapter

# Each linear module of a layer and its parts, in the order of its output columns.
MODULES = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}


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
        self.A: dict[str, torch.Tensor] = {}   # module -> [slots, layers, parts * R, in], made when first needed
        self.B: dict[str, torch.Tensor] = {}   # module -> [slots, layers, out, parts * R]
        self.held: list[tuple[int, str] | None] = [None] * max_loras   # slot -> (lora_int_id, path)
        # Per slot, the modules its adapter targets and the rank columns its parts fill (parts * r).
        self.plan: list[dict[str, int]] = [{} for _ in range(max_loras)]
        self.host: OrderedDict[tuple[int, str], tuple] = OrderedDict()   # (id, path) -> (spec, tensors), LRU first

    # ---- slots ---------------------------------------------------------------------------
    def load(self, load: LoRALoad) -> None:
        key = (load.lora_int_id, load.path)
        if self.held[load.slot] == key:
            return
        spec, tensors = self._host(key)
        s, L, R = load.slot, self.args.num_layers, self.max_rank
        self.held[s] = None          # until the copy below is complete
        for t in (*self.A.values(), *self.B.values()):
            t[s].zero_()
        plan = {}
        for module, parts in MODULES.items():
            targeted = [p for p in parts if p in spec.parts]
            if not targeted:
                continue
            if module not in self.A:
                self.A[module] = self._zeros(len(parts) * R, self.shapes[parts[0]][0])
                self.B[module] = self._zeros(sum(self.shapes[p][1] for p in parts), len(parts) * R)
            r = spec.rank
            plan[module] = len(targeted) * r
            for layer in range(L):
                for j, p in enumerate(targeted):
                    a_b = tensors.get((layer, p))
                    if a_b is not None:
                        a, b = self._slice(p, *a_b)
                        self.A[module][s, layer, j * r:(j + 1) * r].copy_(a)
                        self.B[module][s, layer, self.part_cols[p], j * r:(j + 1) * r].copy_(b)
        self.held[s], self.plan[s] = key, plan

    def _slice(self, part: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's A and B of a part: B's rows of a column-parallel one, A's columns of a row-parallel one."""
        rows = self.slices.get(part)
        if rows is None:
            return a, b
        if part in ("o", "down"):
            return a[:, rows[0]:rows[1]], b
        return a, b[rows[0]:rows[1]]

    def _zeros(self, rows: int, cols: int) -> torch.Tensor:
        return torch.zeros(self.max_loras, self.args.num_layers, rows, cols, dtype=self.dtype, device=self.device)

    def _host(self, key: tuple[int, str]):
        """An adapter's checked spec and host tensors, read at most once while it stays in the
        host cache (max_cpu_loras adapters, least recently used out first)."""
        hit = self.host.get(key)
        if hit is None:
            spec = read_adapter(key[1], str(key[0]), self.args, self.max_rank)
            hit = self.host[key] = (spec, load_tensors(spec, self.dtype))
            while len(self.host) > self.max_cpu_loras:
                self.host.popitem(last=False)
        self.host.move_to_end(key)
        return hit

    # ---- a step ----------------------------------------------------------------------------
    def step(self, slots: list[int], row_counts: list[int]) -> "LoRAStep | None":
        """The step's delta: `slots[i]` is sequence i's slot (-1: base), `row_counts[i]` its
        query rows (in the flat batch's order). None when no row has an adapter."""
        if all(s < 0 for s in slots):
            return None
        rows: dict[int, list[int]] = {}
        start = 0
        for s, n in zip(slots, row_counts):
            if s >= 0:
                rows.setdefault(s, []).extend(range(start, start + n))
            start += n
        groups = []
        for s, idx in rows.items():
            whole = len(idx) == start          # one adapter for the whole step: no gather/scatter
            groups.append((s, None if whole else torch.tensor(idx, dtype=torch.long, device=self.device)))
        return LoRAStep(self, groups)


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
    groups: list[tuple[int, torch.Tensor | None]]    # slot, its rows (None: every row)

    def add(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[rows] += (x[rows] @ A.T) @ B.T for each adapter's rows (in place)."""
        w = self.weights
        for slot, rows in self.groups:
            k = w.plan[slot].get(module)
            if k is None:
                continue
            a, b = w.A[module][slot, layer, :k], w.B[module][slot, layer, :, :k]
            if rows is None:
                out.addmm_(x @ a.T, b.T)
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)
