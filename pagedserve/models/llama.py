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
    # Sliding-window attention (kv/groups.py: a hybrid model's KV groups). layer_windows: each
    # layer's window, None for full attention (Gemma 2 / 3); empty: every layer has
    # `sliding_window` (Mistral; None: full attention everywhere).
    layer_windows: tuple[int | None, ...] = ()
    local_rope_theta: float = 0.0           # RoPE base of the window layers, unscaled (Gemma 3; 0: the global one)
    sandwich_norms: bool = False            # attention and MLP outputs RMS-normed before the residual add (Gemma 2 / 3)
    mlp_activation: str = "silu"            # the gated MLP's activation: silu, or gelu_tanh (GeGLU: Gemma)
    attn_logit_softcapping: float = 0.0     # scores -> cap * tanh(scores / cap) (Gemma 2; 0: none)
    final_logit_softcapping: float = 0.0    # the same on the logits
    attention_sinks: bool = False           # a learned logit per head in each softmax's denominator (gpt-oss)
    o_bias: bool = False                    # the attention output projection has a bias (gpt-oss)
    norm_offset: float = 0.0                # added to every RMSNorm weight at load (Gemma's HF norms store w of 1 + w)

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):       # from its JSON form (a GGUF file's cached args)
            from pagedserve.models.moe_weights import spec_from_dict
            self.moe = spec_from_dict(self.moe)

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def windows(self) -> list[int | None]:
        """Each layer's sliding window (None: full attention)."""
        return list(self.layer_windows) if self.layer_windows else [self.sliding_window] * self.num_layers

    def beyond_compiled_loop(self) -> list[str]:
        """What this model needs that the compiled CPU layer loop (kernels/cpu.py DecoderLayers)
        does not do: the Python layer loop runs such a model. (It does q/k norms per head, partial
        rotary, layers without RoPE, the multipliers, OLMoE's q/k norms over all heads and clip_qkv,
        mixture-of-experts layers whose experts its MoE block takes (DecoderLayers.supports: gpt-oss's
        router bias, top-k softmax and clamped SwiGLU with biases too), sliding windows (per layer,
        with the window layers' own RoPE), sandwich norms, GeGLU, soft-capping, sinks and the
        attention output bias.)"""
        return []


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
    attn_out_norm: torch.Tensor | None = None   # with ModelArgs.sandwich_norms: the attention output's norm ...
    mlp_out_norm: torch.Tensor | None = None    # ... and the MLP output's (post_norm is then the MLP's input norm)
    sinks: torch.Tensor | None = None           # [Hq], with ModelArgs.attention_sinks
    o_bias: torch.Tensor | None = None          # [hidden], with ModelArgs.o_bias (under TP: rank 0's only)


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
        # Gemma 3: the window layers' own RoPE base (unscaled).
        self.local_rope = RotaryEmbedding(args.rope_dim, max_positions, args.local_rope_theta, None, embed.dtype) \
            if args.local_rope_theta else None
        self.windows = args.windows()
        self.kv_groups = None     # kv/groups.py KVGroups, set by the worker (None: one group, layer i in slot i)
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
        for rope in (self.rope, self.local_rope):
            if rope is not None:
                rope.cos, rope.sin = rope.cos.to(device), rope.sin.to(device)
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
        local = self.local_rope.lookup(positions) if self.local_rope is not None else (cos, sin)
        qk_size = self.q_size + self.kv_size
        groups = self.kv_groups
        h = ops.rms_norm(x, self.layers[0].input_norm, a.rms_norm_eps)
        if (lora is None or lora.compiled) and self.compiled_layers is not None:
            extra = () if lora is None else (lora,)
            if self.local_rope is not None:
                extra = (lora, (local[0].view(num_tokens, -1), local[1].view(num_tokens, -1)))
            if self.compiled_layers.forward(x, h, cos.view(num_tokens, -1), sin.view(num_tokens, -1), kv_caches,
                                            meta, *extra):
                return h
        # Decode-only batches (verification rows count as decodes): quantized weights keep their
        # integer path up to larger batches; in a batch-invariant step, at any batch.
        decode = meta.num_decode_rows == num_tokens
        linear = functools.partial(ops.linear, decode=decode, invariant=meta.batch_invariant) \
            if decode or meta.batch_invariant else ops.linear
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
                c, s = local if self.windows[i] is not None else (cos, sin)
                q, k = ops.rotate_queries_and_keys(qkv, a.num_heads, a.num_kv_heads, a.head_dim, c, s)
            v = qkv[:, qk_size:].view(num_tokens, a.num_kv_heads, a.head_dim)
            # A hybrid model's layer reads its KV group's tables and its slot of the blocks (kv/groups.py).
            cache, m = (kv_caches[i], meta) if groups is None else \
                (kv_caches[groups.layer_slot[i]], meta.group(groups.layer_group[i]))
            attn = self.attention.forward(q, k, v, cache, m, self.scale, a.attn_logit_softcapping,
                                          w.sinks).reshape(num_tokens, self.q_size)
            o = linear(attn, w.o, w.o_bias)
            if lora is not None:
                lora.add(i, "o", attn, o)
            x, h = ops.add_rms_norm(x, self._residual(self._out_norm(reduce(o), w.attn_out_norm)), w.post_norm,
                                    a.rms_norm_eps)
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            if w.moe is not None:        # (LoRA adapters never target experts: lora/adapter.py refuses them)
                down = moe_forward(h, w.moe, a.moe, ops, linear)
            else:
                gate_up = linear(h, w.gate_up)
                if lora is not None:
                    lora.add(i, "gate_up", h, gate_up)
                act = ops.silu_and_mul(gate_up) if a.mlp_activation == "silu" else gelu_tanh_and_mul(gate_up)
                down = linear(act, w.down)
                if lora is not None:
                    lora.add(i, "down", act, down)
            x, h = ops.add_rms_norm(x, self._residual(self._out_norm(reduce(down), w.mlp_out_norm)), next_norm,
                                    a.rms_norm_eps)
        return h

    def _out_norm(self, y: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """Sandwich norms (Gemma 2 / 3): a sublayer's output RMS-normed before the residual add."""
        return y if weight is None else self.ops.rms_norm(y, weight, self.args.rms_norm_eps)

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
    def compute_logits(self, hidden: torch.Tensor, decode: bool = False, invariant: bool = False) -> torch.Tensor | None:
        """Logits in float32 for the rows that are sampled (the LM head runs only on those).
        `decode`: one row per sampled position (not prompt logprobs' every row), computed as decode
        rows (quantized: the decode thresholds, so a row's arithmetic does not depend on how many
        share the step); `invariant`: a batch-invariant step's (quantized: at any number of rows,
        as alone). Under tensor parallelism every rank must call it; the driver gets the
        whole vocabulary's logits, the other ranks None."""
        # (float32 out of the product itself where it can: quantized heads skip a bf16 rounding and a copy)
        logits = self.ops.linear(hidden, self.lm_head, decode=decode, out_dtype=torch.float32, invariant=invariant)
        if self.args.logits_scaling != 1.0:
            logits /= self.args.logits_scaling
        cap = self.args.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
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


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): gelu(gate) * up, gelu's tanh approximation, of a fused [T, 2 I] projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def _whole(x: torch.Tensor) -> torch.Tensor:
    """One process holds every head: a layer's output is already whole."""
    return x

