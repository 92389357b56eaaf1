// A mixture-of-experts layer inside the compiled layer loop: the router in float32 (plus its bias:
// gpt-oss), each token's top-k experts (softmax over all, the k largest, renormalised where the
// model says; or gpt-oss's: the k largest logits, softmax over those k), then
// quant_kernels' quant_moe_experts by address (csrc/moe/experts.h: every routed expert of the
// step in one call). What models/moe.py's moe_forward does with ops.routed_experts, without
// returning to Python.
// Part of cpu_kernels (csrc/cpu_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {
struct MoEGlu {        // quant_kernels' (csrc/moe/experts.h): 0 SwiGLU, 1 clamped SwiGLU (alpha, limit)
    int64_t kind;
    float alpha, limit;
};
using QuantMoE = int (*)(const void *experts, int64_t E, const void *x, int64_t ldx, int x_bf16, int64_t T, int64_t H,
                         int64_t I, const int64_t *ids, const float *weights, int64_t k, const MoEGlu *glu,
                         float *out);

// Token t's k experts of its logits l [E] (ties: the lower expert) and their weights.
inline void moe_top_k(float *l, int64_t E, int64_t k, int64_t *chosen, float *wt, const ModelDims &m) {
    if (m.moe_scoring == 0) {               // softmax over all experts, then the k largest
        float top = l[0];
        for (int64_t e = 1; e < E; e++) top = l[e] > top ? l[e] : top;
        float sum = 0.f;
        for (int64_t e = 0; e < E; e++) sum += l[e] = std::exp(l[e] - top);
        for (int64_t e = 0; e < E; e++) l[e] /= sum;
    }
    float total = 0.f;
    for (int64_t s = 0; s < k; s++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            bool taken = false;
            for (int64_t q = 0; q < s; q++) taken |= chosen[q] == e;
            if (!taken && (best < 0 || l[e] > l[best])) best = e;
        }
        chosen[s] = best;
        total += wt[s] = l[best];
    }
    if (m.moe_scoring == 1) {               // the k largest logits, softmax over those (gpt-oss)
        const float top = wt[0];
        total = 0.f;
        for (int64_t s = 0; s < k; s++) total += wt[s] = std::exp(wt[s] - top);
        for (int64_t s = 0; s < k; s++) wt[s] /= total;
    } else if (m.norm_topk_prob) {
        for (int64_t s = 0; s < k; s++) wt[s] /= total;
    }
}

// y [T][H] (T's type) = the MoE block of router / experts over h [T][H]. 0 on success.
template <typename T>
int moe_block(const LayerPtrs &w, const ModelDims &m, const T *h, T *y, int64_t T_) {
    const int64_t H = m.hidden, E = m.experts, k = m.top_k;
    if (!m.quant_moe || k < 1 || k > E) return 1;
    thread_local std::vector<float> logits, out, weights;
    thread_local std::vector<int64_t> ids;
    if (static_cast<int64_t>(logits.size()) < T_ * E) logits.resize(T_ * E);
    if (static_cast<int64_t>(out.size()) < T_ * H) out.resize(T_ * H);
    if (static_cast<int64_t>(ids.size()) < T_ * k) ids.resize(T_ * k), weights.resize(T_ * k);
    const float *router = reinterpret_cast<const float *>(w.moe_router);
    float *lg = logits.data();
#pragma omp parallel for schedule(static) if (T_ * E * H >= 65536)
    for (int64_t i = 0; i < T_ * E; i++) {
        const T *x = h + (i / E) * H;
        const float *r = router + (i % E) * H;
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};     // 8 lanes: the compiler's vectors
        int64_t j = 0;
        for (; j + 8 <= H; j += 8)
            for (int v = 0; v < 8; v++) acc[v] += to_f32(x[j + v]) * r[j + v];
        for (; j < H; j++) acc[0] += to_f32(x[j]) * r[j];
        lg[i] = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    }
    const float *bias = reinterpret_cast<const float *>(w.moe_router_bias);
    for (int64_t t = 0; t < T_; t++) {
        if (bias)
            for (int64_t e = 0; e < E; e++) lg[t * E + e] += bias[e];
        moe_top_k(lg + t * E, E, k, ids.data() + t * k, weights.data() + t * k, m);
    }
    float *o = std::is_same_v<T, float> ? reinterpret_cast<float *>(y) : out.data();
    std::memset(o, 0, sizeof(float) * T_ * H);
    constexpr int bf16 = std::is_same_v<T, uint16_t>;
    const MoEGlu glu{m.moe_glu, m.swiglu_alpha, m.swiglu_limit};
    const int status = reinterpret_cast<QuantMoE>(m.quant_moe)(reinterpret_cast<const void *>(w.moe_experts), E, h, H,
                                                                bf16, T_, H, m.moe_intermediate, ids.data(),
                                                                weights.data(), k, &glu, o);
    if (status) return status;
    if constexpr (!std::is_same_v<T, float>)
        for (int64_t i = 0; i < T_ * H; i++) store(y + i, o[i]);
    return 0;
}
}  // namespace
