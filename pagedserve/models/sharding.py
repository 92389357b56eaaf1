"""Which slice of each weight a tensor-parallel rank holds (Megatron-LM style).

Query heads are split evenly; KV heads too when there are at least as many as ranks,
and otherwise each rank holds the one KV head its query heads use (replicated across
the ranks that share it, as vLLM does). The MLP's intermediate dimension is split
evenly, the vocabulary in equal padded parts (embedding and LM head are vocab-parallel),
norms are replicated. Pure arithmetic: no tensors, no processes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedserve.models.llama import ModelArgs
from pagedserve.utils import cdiv


@dataclass(frozen=True)
class Shard:
    rank: int = 0
    size: int = 1

    def check(self, args: ModelArgs) -> None:
        """ValueError naming the dimension that does not split into `size` parts."""
        n = self.size
        if args.num_heads % n:
            raise ValueError(f"tensor_parallel_size {n} must divide the model's {args.num_heads} attention heads")
        if args.num_kv_heads >= n and args.num_kv_heads % n:
            raise ValueError(f"tensor_parallel_size {n} must divide the model's {args.num_kv_heads} KV heads")
        if args.num_kv_heads < n and n % args.num_kv_heads:
            raise ValueError(f"the model's {args.num_kv_heads} KV heads must divide tensor_parallel_size {n} "
                             f"(each KV head is then replicated on {n} / {args.num_kv_heads} ranks)")
        if args.intermediate_size % n:
            raise ValueError(f"tensor_parallel_size {n} must divide the model's intermediate size "
                             f"{args.intermediate_size}")
        moe = args.moe
        if moe is not None and (moe.intermediate_size % n or moe.shared_intermediate_size % n):
            raise ValueError(f"tensor_parallel_size {n} must divide each expert's FFN width "
                             f"{moe.intermediate_size}" + (f" and the shared expert's {moe.shared_intermediate_size}"
                                                           if moe.shared_intermediate_size else ""))
        if args.qk_norm_full and n > 1:
            raise ValueError(f"tensor_parallel_size {n}: {args.architecture}'s q/k norms are over all heads at "
                             f"once, which a rank holding some heads cannot compute; it runs in one process")

    def split(self, total: int) -> tuple[int, int]:
        """This rank's [start, end) of `total` split evenly."""
        part = total // self.size
        return self.rank * part, (self.rank + 1) * part

    def q_heads(self, args: ModelArgs) -> tuple[int, int]:
        return self.split(args.num_heads)

    def kv_heads(self, args: ModelArgs) -> tuple[int, int]:
        if args.num_kv_heads >= self.size:
            return self.split(args.num_kv_heads)
        head = self.rank * args.num_kv_heads // self.size     # the KV head this rank's query heads use
        return head, head + 1

    def vocab_part(self, vocab_size: int) -> int:
        """Rows of each rank's embedding / LM-head part (the last one zero-padded)."""
        return cdiv(vocab_size, self.size)

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        """This rank's [start, end) of the real vocabulary (end - start may be < vocab_part)."""
        part = self.vocab_part(vocab_size)
        return min(self.rank * part, vocab_size), min((self.rank + 1) * part, vocab_size)

    def local_args(self, args: ModelArgs) -> ModelArgs:
        """The shapes this rank's model runs: its heads and intermediate part (vocab stays global)."""
        if self.size == 1:
            return args
        q0, q1 = self.q_heads(args)
        k0, k1 = self.kv_heads(args)
        i0, i1 = self.split(args.intermediate_size)
        moe = args.moe and dataclasses.replace(args.moe, intermediate_size=args.moe.intermediate_size // self.size,
                                               shared_intermediate_size=args.moe.shared_intermediate_size // self.size)
        return dataclasses.replace(args, num_heads=q1 - q0, num_kv_heads=k1 - k0, intermediate_size=i1 - i0, moe=moe)
