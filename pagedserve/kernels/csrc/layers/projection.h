// The compiled layer loop's tables (Proj, LayerPtrs, ModelDims, CacheRefs) and one projection.
// Part of cpu_kernels (csrc/cpu_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

// ---- every decoder layer of a step in one call ------------------------------------------------
// The loop of LlamaModel.forward over the kernels above, with no return to Python between
// them: at one token per step, the per-layer Python and dispatch work (~10 calls a layer) costs
// as much as a third of the weight streaming it surrounds. On entry x [T, H] is the residual
// stream and h [T, H] the first layer's normalised input; on return x is the final residual
// and h the final normalised hidden state.
namespace {
// One projection of a layer: a packed float weight (nparts 0: w is its PackedWeight's data) or a
// quantized one (w: an array of nparts QuantParts of quant_kernels.cpp, stacked by rows: one
// weight, or a fused projection whose parts are stored apart; tile_rows: rows per dequantized
// tile of its large-batch path).
struct Proj {
    int64_t w, nparts, tile_rows;
};
struct LayerPtrs {    // one row of the pointer table built in Python (kernels/cpu.py)
    Proj qkv;
    int64_t qkv_bias;
    Proj o, gate_up, down;
    int64_t input_norm, post_norm;
    int64_t q_norm, k_norm;       // per-head q/k RMSNorm weights [D] (Qwen3), or 0
    int64_t rope;                 // 0: no RoPE (SmolLM3's NoPE layers); 1: the step's cos/sin;
                                  // 2: the local ones (Gemma 3's window layers)
    // A mixture-of-experts layer (gate_up, down unused): its router float32 [experts][hidden] and
    // quant_kernels' MoEExpert array (layers/moe_block.h); 0 in a dense layer.
    int64_t moe_router, moe_experts;
    int64_t attn_out_norm;        // sandwich norms (Gemma 2 / 3): the attention's and the MLP's
    int64_t mlp_out_norm;         // outputs RMS-normed before their residual adds, or 0
    int64_t sinks;                // float32 [heads]: attention sinks (gpt-oss), or 0
    int64_t group, slot;          // its KV group (which AttentionRows: window, tables), its layer slot of the cache
    int64_t o_bias;               // float32 [hidden]: the attention output projection's bias (gpt-oss), or 0
    int64_t moe_router_bias;      // float32 [experts]: the router's bias (gpt-oss), or 0
};
struct ModelDims {
    int64_t layers, hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
    // Quantized projections: quant_kernels.cpp's quant_linear_small and quant_linear_tiles by
    // address (a separate library: kernels/quant.py's kernel_address; 0 where no layer is
    // quantized), and the row counts up to which the integer path runs (kernels/quant.py's
    // thresholds: any batch, and a batch of decode tokens only); more rows take the tiles.
    int64_t quant_small, quant_tiles, small_rows, decode_rows;
    int64_t quant_handover;                   // quant_handover_next (project_lora), or 0
    int64_t rope_dim;                         // leading values of a head RoPE turns (< head_dim: partial)
    float residual_scale;                     // attention / MLP outputs scaled before the residual add
    // Mixture-of-experts layers (layers/moe_block.h): quant_moe_experts by address (0: none),
    // experts, k a token, each expert's width, whether the k weights are renormalised; then
    // OLMoE's q/k norm over all of q and all of k (not per head) and its clamp of q, k, v (0: none).
    int64_t quant_moe, experts, top_k, moe_intermediate, norm_topk_prob, qk_norm_full;
    float clip_qkv;
    float softcap;                            // attention logit soft-capping (Gemma 2; 0: none)
    int64_t activation;                       // the gated MLP's: 0 SiLU, 1 GeGLU (gelu's tanh approximation)
    // MoE routing: 0 softmax then top-k, 1 top-k logits then softmax (gpt-oss); the experts' gated
    // activation: 0 SwiGLU, 1 gpt-oss's clamped SwiGLU with its alpha and limit.
    int64_t moe_scoring, moe_glu;
    float swiglu_alpha, swiglu_limit;
    int64_t quant_invariant;                  // a batch-invariant step: quant_linear_small's `invariant`
};
struct CacheRefs {    // element strides: layer and K/V of the cache tensor, then a Layout
    int64_t layer, kv, block, token, head, block_size, partition_size;
};

using QuantSmall = int (*)(const void *parts, int64_t nparts, const void *x, int64_t ldx, int x_bf16, int64_t T,
                           int64_t K, const float *bias, void *y, int64_t ldy, int y_bf16, int invariant);
using QuantTiles = int (*)(const void *parts, int64_t nparts, const void *x, int x_bf16, int64_t T, int64_t K,
                           const float *bias, void *y, int64_t ldy, void *gemm, int64_t tile_rows);

inline int linear_any(const float *x, const float *w, const float *b, float *y, int64_t M, int64_t N, int64_t K) {
    return linear_packed_f32(x, w, b, y, M, N, K);
}
inline int linear_any(const uint16_t *x, const uint16_t *w, const float *b, uint16_t *y, int64_t M, int64_t N,
                      int64_t K) {
    return linear_packed_bf16(x, w, b, y, M, N, K);
}

// y [M, N] = x [M, K] @ W.T (+ b) for either kind of projection, as kernels/quant.py's linear
// chooses its path (`decode`: the step's rows are all decode tokens).
template <typename T>
int project(const Proj &p, const ModelDims &m, bool decode, const T *x, const float *b, T *y, int64_t M, int64_t N,
            int64_t K) {
    if (p.nparts == 0) return linear_any(x, reinterpret_cast<const T *>(p.w), b, y, M, N, K);
    constexpr int bf16 = std::is_same_v<T, uint16_t>;
    const void *parts = reinterpret_cast<const void *>(p.w);
    if (M <= (decode ? m.decode_rows : m.small_rows))
        return reinterpret_cast<QuantSmall>(m.quant_small)(parts, p.nparts, x, K, bf16, M, K, b, y, N, bf16,
                                                            int(m.quant_invariant));
    // The tiles multiply by this library's packed GEMM, as quant.py passes cpu.py's.
    void *gemm = bf16 ? reinterpret_cast<void *>(&linear_packed_ld_bf16) : reinterpret_cast<void *>(&linear_packed_ld_f32);
    return reinterpret_cast<QuantTiles>(m.quant_tiles)(parts, p.nparts, x, bf16, M, K, b, y, N, gemm, p.tile_rows);
}
}  // namespace
