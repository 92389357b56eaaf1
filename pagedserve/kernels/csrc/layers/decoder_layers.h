// Every decoder layer of a step in one call: decoder_layers_*.
// Part of cpu_kernels (csrc/cpu_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {
// A sandwich norm (Gemma 2 / 3): a sublayer's output y [T, H] RMS-normed in place by weight `w`.
template <typename T>
void out_norm(T *y, int64_t w, int64_t T_, int64_t H, float eps) {
    add_rms_norm(y, static_cast<const T *>(nullptr), reinterpret_cast<const T *>(w), y, T_, H, eps);
}

// K: the cache's element type (T, or an 8-bit format: written through write_kv_quant).
// rows, slots: one AttentionRows and one slot mapping per KV group (a hybrid model's: layer l
// writes its K/V to slots[group] and attends with rows[group]);
// cos/sin and cos_local/sin_local: the step's RoPE tables, global and the window layers' (Gemma 3).
template <typename T, typename K = T>
int decoder_layers(const LayerPtrs *layers, const T *final_norm, ModelDims m, T *x, T *h, const T *cos,
                   const T *sin, const T *cos_local, const T *sin_local, K *cache, CacheRefs c,
                   const int64_t *const *slots, const AttentionRows *rows, int64_t T_, const LoraRefs *lora) {
    const int64_t q_size = m.heads * m.head_dim, kv_size = m.kv_heads * m.head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size, I = m.intermediate, H = m.hidden;
    thread_local std::vector<T> scratch;           // qkv, attention out, o/down out, gate_up, act
    const int64_t need = T_ * (qkv_size + q_size + H + 3 * I);
    if (static_cast<int64_t>(scratch.size()) < need) scratch.resize(need);
    T *qkv = scratch.data(), *attn = qkv + T_ * qkv_size, *proj = attn + T_ * q_size, *gate_up = proj + T_ * H,
      *act = gate_up + T_ * 2 * I;
    const Layout L{c.block, c.token, c.head};
    // decode tokens only (verification rows count as decodes): quantized weights' decode threshold
    const bool decode = rows[0].query_start[rows[0].num_decodes + rows[0].num_verify] == T_;
    for (int64_t l = 0; l < m.layers; l++) {
        const LayerPtrs &w = layers[l];
        K *kc = cache + w.slot * c.layer, *vc = kc + c.kv;
        const T *next_norm = l + 1 < m.layers ? reinterpret_cast<const T *>(layers[l + 1].input_norm) : final_norm;
        if (project_lora(w.qkv, m, decode, lora, l, 0, h, reinterpret_cast<const float *>(w.qkv_bias), qkv, T_,
                         qkv_size, H))
            return 2;
        // q/k norms per head, or (qk_norm_full: OLMoE) over all of q and all of k
        const int64_t q_heads = m.qk_norm_full ? 1 : m.heads, k_heads = m.qk_norm_full ? 1 : m.kv_heads;
        if (w.q_norm)
            heads_rms_norm(qkv, qkv_size, T_, q_heads, q_size / q_heads, reinterpret_cast<const T *>(w.q_norm), m.eps);
        if (w.k_norm)
            heads_rms_norm(qkv + q_size, qkv_size, T_, k_heads, kv_size / k_heads,
                           reinterpret_cast<const T *>(w.k_norm), m.eps);
        if (m.clip_qkv > 0.f)
            for (int64_t i = 0; i < T_ * qkv_size; i++)
                store(qkv + i, std::min(m.clip_qkv, std::max(-m.clip_qkv, to_f32(qkv[i]))));
        if (w.rope)
            rope_inplace(qkv, qkv_size, T_, m.heads + m.kv_heads, m.head_dim, w.rope == 2 ? cos_local : cos,
                         w.rope == 2 ? sin_local : sin, m.rope_dim);
        if constexpr (kQuant<K>)
            write_kv_quant(qkv + q_size, qkv + q_size + kv_size, qkv_size, m.head_dim, qkv_size, m.head_dim, kc, vc,
                           slots[w.group], T_, m.kv_heads, m.head_dim, c.block_size, c.block, c.token, c.head);
        else
            write_kv(reinterpret_cast<const char *>(qkv + q_size),
                     reinterpret_cast<const char *>(qkv + q_size + kv_size), qkv_size, m.head_dim, qkv_size,
                     m.head_dim, reinterpret_cast<char *>(kc), reinterpret_cast<char *>(vc), slots[w.group], T_,
                     m.kv_heads, m.head_dim, c.block_size, c.block, c.token, c.head, sizeof(T));
        const ScoreMods mods{m.softcap, reinterpret_cast<const float *>(w.sinks)};
        if (attend(qkv, qkv_size, kc, vc, rows[w.group], T_, attn, m.heads, m.kv_heads, m.head_dim, c.block_size, L,
                   m.scale, c.partition_size, mods))
            return l ? 2 : 1;        // the first layer refuses before it attends: nothing cached yet is wrong
        if (project_lora(w.o, m, decode, lora, l, 1, attn, reinterpret_cast<const float *>(w.o_bias), proj, T_, H,
                         q_size))
            return 2;
        if (w.attn_out_norm) out_norm(proj, w.attn_out_norm, T_, H, m.eps);
        if (m.residual_scale != 1.f) scale_inplace(proj, T_ * H, m.residual_scale);
        add_rms_norm(x, proj, reinterpret_cast<const T *>(w.post_norm), h, T_, H, m.eps);
        if (w.moe_experts) {     // a mixture-of-experts layer (LoRA never targets experts)
            if (moe_block(w, m, h, proj, T_)) return 2;
        } else {
            if (project_lora(w.gate_up, m, decode, lora, l, 2, h, nullptr, gate_up, T_, 2 * I, H)) return 2;
            silu_and_mul(gate_up, act, T_, I, m.activation == 1);
            if (project_lora(w.down, m, decode, lora, l, 3, act, nullptr, proj, T_, H, I)) return 2;
        }
        if (w.mlp_out_norm) out_norm(proj, w.mlp_out_norm, T_, H, m.eps);
        if (m.residual_scale != 1.f) scale_inplace(proj, T_ * H, m.residual_scale);
        add_rms_norm(x, proj, next_norm, h, T_, H, m.eps);
    }
    return 0;
}
}  // namespace

// The tables' element types (float32 or bf16 activations; a float or 8-bit cache).
#define PAGEDSERVE_LAYER_ARGS(T, C)                                                                          \
    const LayerPtrs *layers, const T *final_norm, const ModelDims *m, T *x, T *h, const T *cos, const T *sin, \
        const T *cos_local, const T *sin_local, C *cache, const CacheRefs *c, const int64_t *const *slots,           \
        const AttentionRows *rows, const LoraRefs *lora, int64_t T_
extern "C" {
int decoder_layers_f32(PAGEDSERVE_LAYER_ARGS(float, float)) {
    return decoder_layers(layers, final_norm, *m, x, h, cos, sin, cos_local, sin_local, cache, *c, slots, rows, T_,
                          lora);
}
int decoder_layers_bf16(PAGEDSERVE_LAYER_ARGS(uint16_t, uint16_t)) {
    return decoder_layers(layers, final_norm, *m, x, h, cos, sin, cos_local, sin_local, cache, *c, slots, rows, T_,
                          lora);
}
}
namespace {
template <typename T>
int decoder_layers_kv8(PAGEDSERVE_LAYER_ARGS(T, uint8_t), int64_t code) {
    return with_kv_format(code, [&](auto tag) {
        using K = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
        return decoder_layers(layers, final_norm, *m, x, h, cos, sin, cos_local, sin_local,
                              reinterpret_cast<K *>(cache), *c, slots, rows, T_, lora);
    });
}
}  // namespace

extern "C" {
int decoder_layers_kv8_f32(PAGEDSERVE_LAYER_ARGS(float, uint8_t), int64_t code) {
    return decoder_layers_kv8(layers, final_norm, m, x, h, cos, sin, cos_local, sin_local, cache, c, slots, rows, lora,
                              T_, code);
}
int decoder_layers_kv8_bf16(PAGEDSERVE_LAYER_ARGS(uint16_t, uint8_t), int64_t code) {
    return decoder_layers_kv8(layers, final_norm, m, x, h, cos, sin, cos_local, sin_local, cache, c, slots, rows, lora,
                              T_, code);
}
}
#undef PAGEDSERVE_LAYER_ARGS
