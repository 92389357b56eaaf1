"""Llama-family decoder over a flat, unpadded batch: Llama and every architecture that
models/architectures.py describes as differences from it (Mistral, Qwen2, Qwen3, ...), which
reach this code as `ModelArgs` fields (q/k norms, partial rotary, layers without RoPE,
multipliers); each defaults to Llama's behaviour.

Plain tensor math. q/k/v and gate/up projections are fused into single matrices
so each layer runs four large matmuls; the dense ops go through an ops object
(models/ops.py: CPU kernels or torch, chosen once at load) and attention through a
backend that reads and writes the paged KV cache (attention/backend.py). Where the
ops offer it (CPU kernels with the CPU attention backend), the whole layer loop runs
as one compiled call (`compiled_layers`); the Python loop below stays as its
reference and for every other case.

Under tensor parallelism (models/sharding.py) a model holds one rank's shard: its
attention heads, its part of the MLP and of the vocabulary. The residual stream stays
whole on every rank: the embedding, the attention output and the MLP's down projection
each give a partial sum that `tp.all_reduce` completes, and `compute_logits` gathers
the vocabulary parts on the driver (rank 0).
"""
from __future__ import annotations

import functools

from dataclasses import dataclass, fields

import torch

from pagedserve.attention.backend import AttentionBackend
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.models.layers import RotaryEmbedding
from pagedserve.models.moe import MoESpec, MoEWeights, moe_forward
from pagedserve.models.ops import CompiledLayers, ModelOps, TorchOps
from pagedserve.models.quantized import Weight, embedding

@dataclass
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None = None
    # Where an architecture departs from Llama (models/architectures.py); defaults: Llama.
    qk_norm: bool = False                   # RMSNorm of each q and k head before RoPE (Qwen3)
    rotary_dim: int = 0                     # leading dimensions of a head RoPE rotates (0: all)
    no_rope_layers: tuple[int, ...] = ()    # layers whose attention has no RoPE (SmolLM3)
    embedding_multiplier: float = 1.0       # the embedding's rows scaled (Granite)
    residual_multiplier: float = 1.0        # attention and MLP outputs scaled before the residual add
    attention_multiplier: float = 0.0       # softmax scale (0: head_dim ** -0.5)
    logits_scaling: float = 1.0             # logits divided by it (Granite)
    qk_norm_full: bool = False              # with qk_norm: over all of q and all of k, not per head (OLMoE)
    clip_qkv: float = 0.0                   # q, k, v clamped to [-clip, clip] after the norms (OLMoE; 0: none)
    moe: MoESpec | None = None              # mixture-of-experts layers (models/moe.py), where a config has them

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):       # from its JSON form (a GGUF file's cached args)
            from pagedserve.models.moe_weights import spec_from_dict
            self.moe = spec_from_dict(self.moe)

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def beyond_compiled_loop(self) -> list[str]:
        """What this model needs that the compiled CPU layer loop (kernels/cpu.py DecoderLayers)
        does not do: the Python layer loop runs such a model. (It does q/k norms per head, partial
        rotary, layers without RoPE and the multipliers.)"""
        return [name for name, on in (("q/k norm over all heads", self.qk_norm_full),
                                      ("clip_qkv", bool(self.clip_qkv)),
                                      ("mixture-of-experts layers", self.moe is not None)) if on]


@dataclass
class LayerWeights:
    """A layer's matmul weights are float tensors or quantized ones (models/quantized.py); a fused
    matrix whose parts have different quantized types is a tuple of them (ops.linear joins them)."""
    input_norm: torch.Tensor
    qkv: Weight                  # [(Hq + 2 Hkv) * D, hidden]
    qkv_bias: torch.Tensor | None
    o: Weight
    post_norm: torch.Tensor
    gate_up: Weight | None       # [2 * intermediate, hidden] (None in a mixture-of-experts layer)
    down: Weight | None
    moe: MoEWeights | None = None         # the MoE block in the MLP's place (models/moe.py)
    q_norm: torch.Tensor | None = None    # [D], with ModelArgs.qk_norm ([Hq D] / [Hkv D] with qk_norm_full)
    k_norm: torch.Tensor | None = None


class LlamaModel:
    def __init__(self, args: ModelArgs, embed, layers: list[LayerWeights],
                 norm: torch.Tensor, lm_head: Weight, attention: AttentionBackend, max_positions: int,
                 ops: ModelOps | None = None, tp=None, vocab: tuple[int, int] | None = None,
                 context_len: int | None = None) -> None:
        self.args = args          # this rank's shapes (heads, intermediate size) under tensor parallelism
        self.embed = embed        # a float table or a QuantizedEmbedding (models/quantized.py)
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.attention = attention
        self.ops: ModelOps = ops or TorchOps()
        # (context_len: the longest sequence the engine serves, which picks LongRoPE's factors)
        self.rope = RotaryEmbedding(args.rope_dim, max_positions, args.rope_theta, args.rope_scaling,
                                    embed.dtype, context_len)
        self.scale = args.attention_multiplier or args.head_dim ** -0.5
        self.no_rope = frozenset(args.no_rope_layers)
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.compiled_layers: CompiledLayers | None = None    # set by pack_linear_weights, where the ops offer it
        # Tensor parallelism: the process group (distributed/group.py), and where this rank's
        # vocabulary part starts and how large the whole vocabulary is.
        self.tp = tp
        self.vocab_start, self.vocab_size = vocab or (0, args.vocab_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def to(self, device: torch.device) -> "LlamaModel":
        """Move every weight and the RoPE tables to `device` (tied embeddings stay one tensor)."""
        tied = self.lm_head is self.embed
        self.embed = _to(self.embed, device)
        self.lm_head = self.embed if tied else _to(self.lm_head, device)
        self.norm = self.norm.to(device)
        for w in self.layers:
            for f in fields(w):
                t = getattr(w, f.name)
                if isinstance(t, MoEWeights):
                    t.to(device)
                elif t is not None:
                    setattr(w, f.name, _to(t, device))
        self.rope.cos, self.rope.sin = self.rope.cos.to(device), self.rope.sin.to(device)
        return self

    def pack_linear_weights(self) -> "LlamaModel":
        """Once, on the model's device: let the ops repack the matmul weights for their GEMMs
        (and set `compiled_layers` where they run the layer loop as one call)."""
        self.ops.prepare_weights(self)
        return self

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: torch.Tensor, lora=None) -> torch.Tensor:
        """input_ids, positions: [T]. kv_caches: [layers, 2, blocks, block_size, Hkv, D].
        lora: a step with adapter rows (lora/weights.py LoRAStep: the compiled loop takes its
        deltas where it is `compiled`, else lora.add adds them to each linear's output in the
        Python loop). Returns the final hidden states
        [T, hidden] (normalised)."""
        a, ops = self.args, self.ops
        num_tokens = input_ids.shape[0]
        self.attention.prepare(meta)
        x = self._embed(input_ids)                    # the residual stream
        if a.embedding_multiplier != 1.0:
            x = x * a.embedding_multiplier
        cos, sin = self.rope.lookup(positions)
        qk_size = self.q_size + self.kv_size
        h = ops.rms_norm(x, self.layers[0].input_norm, a.rms_norm_eps)
        if (lora is None or lora.compiled) and self.compiled_layers is not None and self.compiled_layers.forward(
                x, h, cos.view(num_tokens, -1), sin.view(num_tokens, -1), kv_caches, meta,
                *(() if lora is None else (lora,))):
            return h
        # Decode-only batches: quantized weights keep their integer path up to larger batches.
        linear = ops.linear if meta.num_decodes < num_tokens else functools.partial(ops.linear, decode=True)
        reduce = self.tp.all_reduce if self.tp else _whole
        for i, w in enumerate(self.layers):
            qkv = linear(h, w.qkv, w.qkv_bias)
            if lora is not None:
                lora.add(i, "qkv", h, qkv)
            if w.q_norm is not None:
                self._norm_heads(qkv, w)
            if a.clip_qkv:
                qkv.clamp_(-a.clip_qkv, a.clip_qkv)
            if i in self.no_rope:
                q = qkv[:, :self.q_size].view(num_tokens, a.num_heads, a.head_dim)
                k = qkv[:, self.q_size:qk_size].view(num_tokens, a.num_kv_heads, a.head_dim)
            else:
                q, k = ops.rotate_queries_and_keys(qkv, a.num_heads, a.num_kv_heads, a.head_dim, cos, sin)
            v = qkv[:, qk_size:].view(num_tokens, a.num_kv_heads, a.head_dim)
            attn = self.attention.forward(q, k, v, kv_caches[i], meta, self.scale).reshape(num_tokens, self.q_size)
            o = linear(attn, w.o)
            if lora is not None:
                lora.add(i, "o", attn, o)
            x, h = ops.add_rms_norm(x, self._residual(reduce(o)), w.post_norm, a.rms_norm_eps)
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            if w.moe is not None:        # (LoRA adapters never target experts: lora/adapter.py refuses them)
                down = moe_forward(h, w.moe, a.moe, ops, linear)
            else:
                gate_up = linear(h, w.gate_up)
                if lora is not None:
                    lora.add(i, "gate_up", h, gate_up)
                act = ops.silu_and_mul(gate_up)
                down = linear(act, w.down)
                if lora is not None:
                    lora.add(i, "down", act, down)
            x, h = ops.add_rms_norm(x, self._residual(reduce(down)), next_norm, a.rms_norm_eps)
        return h

    def _norm_heads(self, qkv: torch.Tensor, w: LayerWeights) -> None:
        """q/k norm: each q and k head RMS-normalised over its dimensions (with qk_norm_full: all
        of q, and all of k, at once), in place in qkv."""
        a, t = self.args, qkv.shape[0]
        for start, size, weight in ((0, self.q_size, w.q_norm), (self.q_size, self.kv_size, w.k_norm)):
            heads = qkv[:, start:start + size].reshape(-1, size if a.qk_norm_full else a.head_dim)
            qkv[:, start:start + size] = self.ops.rms_norm(heads, weight, a.rms_norm_eps).view(t, size)

    def _residual(self, y: torch.Tensor) -> torch.Tensor:
        m = self.args.residual_multiplier
        return y if m == 1.0 else y * m

    def needs_python_layers(self) -> list[str]:
        """What keeps this model off the compiled layer loop (ModelArgs.beyond_compiled_loop)."""
        return self.args.beyond_compiled_loop()

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp:
            return embedding(input_ids, self.embed, self.ops)
        # Vocab-parallel: each rank looks up the ids in its part, zeros for the others; the sum is whole.
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.embed.shape[0])
        x = embedding(local.masked_fill(outside, 0), self.embed, self.ops)
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits in float32 for the rows that are sampled (the LM head runs only on those).
        Under tensor parallelism every rank must call it; the driver gets the whole
        vocabulary's logits, the other ranks None."""
        # (float32 out of the product itself where it can: quantized heads skip a bf16 rounding and a copy)
        logits = self.ops.linear(hidden, self.lm_head, out_dtype=torch.float32)
        if self.args.logits_scaling != 1.0:
            logits /= self.args.logits_scaling
        if not self.tp:
            return logits
        whole = self.tp.gather_columns(logits)
        return None if whole is None else whole[:, :self.vocab_size]


def _to(weight, device: torch.device):
    """A weight on `device`; quantized weights live on the CPU only (config refuses others)."""
    if isinstance(weight, torch.Tensor):
        return weight.to(device)
    if torch.device(device).type != "cpu":
        raise ValueError(f"quantized weights run on the CPU only, not on {device}")
    return weight


def _whole(x: torch.Tensor) -> torch.Tensor:
    """One process holds every head: a layer's output is already whole."""
    return x

