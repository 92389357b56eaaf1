"""What MoE configs and checkpoints say, read into models/moe.py's MoESpec and MoEWeights.

HF checkpoints keep one tensor per expert and projection (`layers.<i>.mlp.experts.<e>.gate_proj`;
Mixtral's `block_sparse_moe.experts.<e>.w1` / w3 / w2), llama.cpp's GGUF files one 3-D tensor per
projection (`blk.<i>.ffn_gate_exps` [E, I, H] in numpy's order: the file lists dimensions
innermost first, H, I, E), which GGUFSource names `layers.<i>.mlp.experts.gate_proj.weight`. An
expert of a GGUF file is a slice of that tensor's bytes (MatrixBuilder.experts): its weight reads
them where they are, no dequantized copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.models.moe import ExpertWeights, MoESpec, MoEWeights

# llama.cpp's GGUF layer kinds of MoE tensors -> the HF-style names GGUFSource gives them (the
# `experts.<proj>` ones are stacked: [E, rows, cols]).
GGUF_MOE_TENSORS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
STACKED_KINDS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@dataclass(frozen=True)
class ExpertNames:
    """How an HF checkpoint names a layer's MoE tensors (under `layers.<i>.`)."""
    block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


MIXTRAL_NAMES = ExpertNames("block_sparse_moe", "w1", "w3", "w2")


def expert_names(architecture: str) -> ExpertNames:
    """How an HF architecture's checkpoints name MoE tensors (Qwen's and OLMoE's: the default)."""
    return MIXTRAL_NAMES if architecture == "MixtralForCausalLM" else ExpertNames()


# ---- configs -----------------------------------------------------------------------------------

def qwen_moe_config(cfg: dict) -> dict:
    """Qwen3-MoE / Qwen2-MoE config.json -> ModelArgs fields: experts of moe_intermediate_size,
    norm_topk_prob, every decoder_sparse_step-th layer sparse but mlp_only_layers."""
    return {"moe": MoESpec(
        num_experts=cfg.get("num_experts") or cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["moe_intermediate_size"], norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
        decoder_sparse_step=cfg.get("decoder_sparse_step") or 1,
        mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()))}


def mixtral_config(cfg: dict) -> dict:
    """Mixtral: every layer sparse, experts of intermediate_size; top-k then softmax over the k,
    which is softmax then top-k renormalised."""
    return {"moe": MoESpec(cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"],
                           norm_topk_prob=True)}


def olmoe_config(cfg: dict) -> dict:
    """OLMoE: every layer sparse, experts of intermediate_size, q/k norms over all of q and k,
    clip_qkv."""
    return {"moe": MoESpec(cfg["num_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"],
                           norm_topk_prob=bool(cfg.get("norm_topk_prob", False))),
            "qk_norm_full": True, "clip_qkv": float(cfg.get("clip_qkv") or 0.0)}


def gpt_oss_config(cfg: dict) -> dict:
    """gpt-oss: every layer sparse; the router's top-k logits softmaxed; clamped SwiGLU with
    biases; attention with sinks, biases on q/k/v and o, sliding-window and full layers."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                       for i in range(cfg["num_hidden_layers"])]
    return {"moe": MoESpec(cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"],
                           scoring="topk_softmax", activation="clamped_swiglu",
                           swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                           swiglu_limit=float(cfg.get("swiglu_limit", 7.0))),
            "attention_sinks": True, "o_bias": True, "sliding_window": window,
            "layer_windows": tuple(window if t == "sliding_attention" else None for t in types)}


def gpt_oss_gguf_config(m) -> dict:
    """A llama.cpp `gpt-oss` file: its MoE block as gpt_oss_config's (llama.cpp's SwiGLU-OAI has
    gpt-oss's alpha 1.702 and limit 7.0 as constants), sinks, o_proj bias; layer i windowed where
    i % pattern < pattern - 1 (attention.sliding_window_pattern, 2 when absent: even layers, as
    the config's layer_types)."""
    from dataclasses import replace
    spec = replace(gguf_moe_spec(m, norm_default=False), scoring="topk_softmax", activation="clamped_swiglu")
    window = m.get("attention.sliding_window") or None
    pattern = m.get("attention.sliding_window_pattern") or 2
    windows = tuple(window if i % pattern < pattern - 1 else None for i in range(m.get("block_count")))
    return {"moe": spec, "attention_sinks": True, "o_bias": True, "sliding_window": window,
            "layer_windows": windows if window else ()}


def gguf_moe_spec(m, norm_default: bool) -> MoESpec | None:
    """The MoESpec of a GGUF file's metadata (`m`: architectures.Metadata) and tensors; None for a
    dense model. Which layers are sparse: those with an ffn_gate_inp (a router). llama.cpp's
    norm of the top-k weights is per architecture (`norm_default`) unless the file says."""
    experts = m.get("expert_count") or 0
    if not experts:
        return None
    gating = m.get("expert_gating_func")
    if gating not in (None, 0, 1):          # 1: softmax; 2: sigmoid (DeepSeek-V3's), not these models'
        raise ValueError(f"GGUF {m.prefix}expert_gating_func {gating}: only softmax routing is supported")
    layers = m.get("block_count")
    names = {t.name for t in m.reader.tensors}
    dense = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names)
    return MoESpec(num_experts=experts, top_k=m.get("expert_used_count"),
                   intermediate_size=m.get("expert_feed_forward_length") or m.get("feed_forward_length"),
                   norm_topk_prob=bool(m.get("expert_weights_norm", norm_default)),
                   shared_intermediate_size=m.get("expert_shared_feed_forward_length") or 0,
                   mlp_only_layers=dense)


def spec_from_dict(value) -> MoESpec | None:
    """A MoESpec back from its asdict form (ModelArgs saved as JSON)."""
    if value is None or isinstance(value, MoESpec):
        return value
    return MoESpec(**{**value, "mlp_only_layers": tuple(value.get("mlp_only_layers") or ())})


# ---- weights -----------------------------------------------------------------------------------

def _fuse(gate, up):
    """An expert's gate and up as one [2 I, H] float matrix, or quantized parts kept as a
    tuple (one product, no copy)."""
    if isinstance(gate, torch.Tensor) and isinstance(up, torch.Tensor):
        return torch.cat([gate, up])
    return (gate, up)


def build_moe(build, source, layer: int, spec: MoESpec, names: ExpertNames = ExpertNames(),
              inter: tuple[int, int] | None = None, shared_inter: tuple[int, int] | None = None) -> MoEWeights:
    """Layer `layer`'s MoE block from `source` (a TensorSource) through `build` (loader.py's
    MatrixBuilder). inter / shared_inter: this tensor-parallel rank's part of each expert's (and
    the shared expert's) FFN width (gate/up rows, down columns); None: all of it."""
    p = f"layers.{layer}."
    if source.has(p + "mlp.router.weight"):           # gpt-oss's checkpoint layout
        return _gpt_oss_moe(build, source, layer, spec, inter)
    stacked = p + "mlp.experts.{}.weight"
    block = names.block if source.has(p + names.block + ".gate.weight") else "mlp"
    router = build.float(p + block + ".gate.weight").float()
    if source.has(stacked.format("gate_proj")):        # a GGUF file: experts stacked per projection
        gates = build.experts(stacked.format("gate_proj"), rows=inter)
        ups = build.experts(stacked.format("up_proj"), rows=inter)
        downs = build.experts(stacked.format("down_proj"), cols=inter)
        experts = [ExpertWeights(_fuse(g, u), d) for g, u, d in zip(gates, ups, downs)]
        _add_stacked_biases(build, source, layer, experts, inter)
    else:
        q = p + block + ".experts.{}.{}.weight"
        if not source.has(q.format(0, names.gate)):
            raise ValueError(f"layer {layer}: no experts in the checkpoint (neither {stacked.format('gate_proj')} nor "
                             f"{q.format(0, names.gate)}); a GGUF file needs llama.cpp's stacked ffn_*_exps tensors "
                             f"(files converted before mid-2024 keep one tensor per expert: convert them again)")
        experts = [ExpertWeights(build.matrix([(q.format(e, names.gate), inter), (q.format(e, names.up), inter)], experts=True),
                                 build.matrix([(q.format(e, names.down), None)], cols=inter, experts=True))
                   for e in range(spec.num_experts)]
    if len(experts) != spec.num_experts:
        raise ValueError(f"layer {layer}: the checkpoint has {len(experts)} experts, the config {spec.num_experts}")
    w = MoEWeights(router, experts, layer=layer)
    if source.has(p + block + ".gate.bias"):            # gpt-oss's router bias
        w.router_bias = build.float(p + block + ".gate.bias").float()
    if spec.shared_intermediate_size:
        s = p + "mlp.shared_expert.{}.weight"
        w.shared = ExpertWeights(build.matrix([(s.format("gate_proj"), shared_inter), (s.format("up_proj"), shared_inter)]),
                                 build.matrix([(s.format("down_proj"), None)], cols=shared_inter))
        if source.has(p + "mlp.shared_expert_gate.weight"):
            w.shared_gate = build.float(p + "mlp.shared_expert_gate.weight").float().view(1, -1)
    return w


def _add_stacked_biases(build, source, layer: int, experts: list[ExpertWeights], inter: tuple[int, int] | None) -> None:
    """A GGUF file's stacked expert biases (gpt-oss: ffn_gate_exps.bias [E, I], ffn_up_exps,
    ffn_down_exps [E, H]) onto its experts, this rank's part of I; none where the file has none."""
    name = f"layers.{layer}.mlp.experts.{{}}.bias"
    if not source.has(name.format("gate_proj")):
        return
    gate, up, down = (build.float(name.format(n)) for n in ("gate_proj", "up_proj", "down_proj"))
    r0, r1 = inter or (0, gate.shape[1])
    for e, expert in enumerate(experts):
        expert.gate_up_bias = torch.cat([gate[e, r0:r1], up[e, r0:r1]])
        expert.down_bias = down[e] if r0 == 0 else None         # (row-parallel: added once)


def _gpt_oss_moe(build, source, layer: int, spec: MoESpec, inter: tuple[int, int] | None) -> MoEWeights:
    """gpt-oss's experts: stacked gate_up [E, H, 2 I] with gate and up interleaved by column (and
    its bias [E, 2 I]), down [E, I, H] (bias [E, H]), in bf16, or in MXFP4 as `*_blocks` [E, out,
    in / 32, 16] and `*_scales` [E, out, in / 32]. Ours: gate rows then up rows [2 I, H], down
    [H, I]: MXFP4 kept in its blocks where the builder keeps them (`build.keeps_mxfp4`: the CPU's
    kernels; this rank's part of I a whole number of blocks), else float in the model's dtype
    (dequantized exactly: pagedserve/mxfp4.py)."""
    from pagedserve import mxfp4
    p = f"layers.{layer}.mlp."
    r0, r1 = inter or (0, spec.intermediate_size)
    if source.has(p + "experts.gate_up_proj_blocks") and build.keeps_mxfp4 and r0 % 32 == 0 and r1 % 32 == 0:
        return _gpt_oss_mxfp4_moe(build, source, layer, spec, (r0, r1))

    def stacked(name: str) -> torch.Tensor:            # [E, out, in]
        if source.has(p + f"experts.{name}_blocks"):
            return mxfp4.dequantize_hf(source.get(p + f"experts.{name}_blocks"), source.get(p + f"experts.{name}_scales"))
        return source.get(p + f"experts.{name}").float().transpose(1, 2)

    gate_up, down = stacked("gate_up_proj"), stacked("down_proj")
    gu_bias, d_bias = source.get(p + "experts.gate_up_proj_bias").float(), source.get(p + "experts.down_proj_bias").float()
    dtype = build.dtype
    experts = []
    for e in range(spec.num_experts):
        gate, up = gate_up[e, 0::2][r0:r1], gate_up[e, 1::2][r0:r1]
        bias = torch.cat([gu_bias[e, 0::2][r0:r1], gu_bias[e, 1::2][r0:r1]])
        experts.append(ExpertWeights(torch.cat([gate, up]).to(dtype), down[e][:, r0:r1].contiguous().to(dtype),
                                     bias.to(dtype), d_bias[e].to(dtype) if r0 == 0 else None))
    return MoEWeights(source.get(p + "router.weight").float(), experts, router_bias=source.get(p + "router.bias").float(),
                      layer=layer)


def _gpt_oss_mxfp4_moe(build, source, layer: int, spec: MoESpec, inter: tuple[int, int]) -> MoEWeights:
    """_gpt_oss_moe's experts kept in MXFP4: each expert's blocks regrouped into the GGUF layout
    (quant_format's `mxfp4`, one expert at a time: little scratch), gate rows then up rows in one
    matrix, down's columns of this rank's part by whole blocks."""
    from pagedserve import mxfp4
    from pagedserve.quant_format import QuantizedWeight, slice_cols
    p = f"layers.{layer}.mlp."
    r0, r1 = inter
    hidden = source.shape(p + "experts.gate_up_proj_scales")[2] * 32
    gu_blocks, gu_scales = source.get(p + "experts.gate_up_proj_blocks"), source.get(p + "experts.gate_up_proj_scales")
    d_blocks, d_scales = source.get(p + "experts.down_proj_blocks"), source.get(p + "experts.down_proj_scales")
    gu_bias, d_bias = source.get(p + "experts.gate_up_proj_bias").float(), source.get(p + "experts.down_proj_bias").float()
    dtype = build.dtype
    experts = []
    for e in range(spec.num_experts):
        rows = torch.cat([gu_blocks[e, 0::2][r0:r1], gu_blocks[e, 1::2][r0:r1]])       # gate rows, then up rows
        scales = torch.cat([gu_scales[e, 0::2][r0:r1], gu_scales[e, 1::2][r0:r1]])
        gate_up = QuantizedWeight("mxfp4", (rows.shape[0], hidden), mxfp4.hf_to_gguf(rows, scales))
        down = QuantizedWeight("mxfp4", (d_blocks.shape[1], d_blocks.shape[2] * 32), mxfp4.hf_to_gguf(d_blocks[e], d_scales[e]))
        if (r0, r1) != (0, spec.intermediate_size):
            down = QuantizedWeight("mxfp4", (down.shape[0], r1 - r0), slice_cols(down, r0, r1).data.contiguous())
        bias = torch.cat([gu_bias[e, 0::2][r0:r1], gu_bias[e, 1::2][r0:r1]])
        # (their own bytes: the layout the decode kernels read fastest, in place, where there is one)
        gate_up, down = (build.ops.repack(w, in_place=True, experts=True) for w in (gate_up, down))
        experts.append(ExpertWeights(gate_up, down, bias.to(dtype), d_bias[e].to(dtype) if r0 == 0 else None))
    build.made["mxfp4"] += 2 * spec.num_experts
    return MoEWeights(source.get(p + "router.weight").float(), experts, router_bias=source.get(p + "router.bias").float(),
                      layer=layer)


def hf_moe_shapes(prefix: str, spec: MoESpec, hidden: int, names: ExpertNames = ExpertNames()) -> dict:
    """A sparse layer's HF tensors and shapes (dummy weights)."""
    i, q = spec.intermediate_size, prefix + names.block
    shapes = {q + ".gate.weight": (spec.num_experts, hidden)}
    for e in range(spec.num_experts):
        shapes |= {f"{q}.experts.{e}.{names.gate}.weight": (i, hidden), f"{q}.experts.{e}.{names.up}.weight": (i, hidden),
                   f"{q}.experts.{e}.{names.down}.weight": (hidden, i)}
    if spec.shared_intermediate_size:
        s = spec.shared_intermediate_size
        shapes |= {prefix + "mlp.shared_expert.gate_proj.weight": (s, hidden),
                   prefix + "mlp.shared_expert.up_proj.weight": (s, hidden),
                   prefix + "mlp.shared_expert.down_proj.weight": (hidden, s),
                   prefix + "mlp.shared_expert_gate.weight": (1, hidden)}
    return shapes
