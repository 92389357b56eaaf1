// A mixture-of-experts layer's routed experts in one call (quant_moe_experts): the tokens of a
// step grouped by expert, each chosen expert's gate, up and down matrices read once for all of its
// tokens, experts no token chose never touched.
//
//   x [T][H] -> 8-bit activation blocks once; rows gathered per (token, slot) pair in expert order
//   phase 1: for each chosen expert e and group of 8 rows g of its gate and up (I rows each):
//            a[p][8 g + i] = glu(gate . x_p + gate_bias, up . x_p + up_bias) for e's pairs p (float32)
//   a -> 8-bit activation blocks (every pair's row)
//   phase 2: for each chosen expert e and group g of its down's H rows:
//            out[token(p)][8 g + i] += weight(p) * (down . a_p + down_bias)
// glu: SwiGLU, silu(g) * u; or gpt-oss's clamped SwiGLU, g' * sigmoid(alpha g') * (u' + 1) with
// g' = min(g, limit), u' = u clamped to [-limit, limit]. The biases (gpt-oss's) are optional.
//
// Every thread takes the same share of each chosen expert's groups (a contiguous range: one
// stream per matrix), so the work is even whatever the tokens per expert, and in phase 2 a thread
// owns its output columns for every token: the weighted sums need no reduction, and each output
// value's arithmetic (the experts added in expert order, each dot the same integers and float
// operations as quant_linear_small's) does not depend on the thread count or the batch.
// Weights in an r8 layout run r8_group_fn's kernels (8 rows a pass, 1-4 activation rows); other
// types row_fn's (each of the 8 rows in turn). The 256-bit and scalar builds only (the AVX-512
// build's dots read more of Act than this fills): elsewhere it returns 2 and kernels/moe.py runs
// the experts one by one.
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

// One routed expert: gate [I][H], up [I][H], down [H][I] (any of the block types, an r8 layout or
// the file's rows), and their float32 biases [I], [I], [H] or null.
struct MoEExpert {
    QuantPart gate, up, down;
    const float *gate_bias, *up_bias, *down_bias;
};
// The gated activation between up and down: kind 0 SwiGLU, 1 gpt-oss's clamped SwiGLU (alpha, limit).
struct MoEGlu {
    int64_t kind;
    float alpha, limit;
};

namespace {

// A step's activations for the experts: q8 blocks of `rows` rows of K, in buffers of its own.
struct MoEAct {
    std::vector<int8_t, Aligned64<int8_t>> q;
    std::vector<float, Aligned64<float>> d, ds;
    Act act(int64_t rows, int64_t K) {
        Act a{fit(q, rows * K), fit(d, rows * (K / 32)), fit(ds, rows * (K / 32)), K, K / 32, {}};
        return a;
    }
};
thread_local MoEAct t_moe_x, t_moe_a;
thread_local std::vector<float> t_moe_gated;

inline float moe_glu(const MoEGlu &f, float g, float u) {
    if (f.kind == 0) return g / (1.f + std::exp(-g)) * u;
    g = std::min(g, f.limit);
    u = std::min(f.limit, std::max(-f.limit, u));
    return g / (1.f + std::exp(-f.alpha * g)) * (u + 1.f);
}

// out[t * 8 + i] (t < nt) = row 8 g + i of m against activation rows t0 .. t0 + nt - 1 of a.
inline void moe_rows8(const QuantPart &m, int64_t g, const Act &a, int64_t t0, int nt, float *out) {
    const int qt = int(m.qtype);
    if (is_r8(qt)) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        if (qt == Q4_1R8) return kR8_512[nt](m.w + g * m.ldw, a.nb, a, t0, out, 8);
#endif
        return r8_group_fn(qt, nt)(m.w + g * m.ldw, a.nb, a, t0, out, 8);
    }
    const RowFn fn = row_fn(qt, nt);
    const int64_t ahead = prefetch_rows(m.ldw, 8), bytes = a.K / kElems[qt] * kBytes[qt];
    if (8 * g + 8 + ahead <= m.rows) prefetch_bytes(m.w + (8 * g + ahead) * m.ldw, m.ldw, 8, bytes);
    for (int i = 0; i < 8; i++) fn(m.w + (8 * g + i) * m.ldw, a, t0, out + i, 8);
}

bool moe_part_ok(const QuantPart &m, int64_t rows, int64_t K) {
    const int qt = int(m.qtype);
    return qt >= 0 && qt < kNumTypes && qt != Q4_0X && m.rows == rows && rows % 8 == 0 && K % kElems[qt] == 0 &&
           m.w != nullptr;
}
}  // namespace

// out [T][H] float32 += the routed experts' outputs: token t's slots s < k chose expert
// ids[t * k + s] with weight weights[t * k + s]; x [T][ldx] float32 or bf16 (H columns). I: each
// expert's FFN width; glu: the activation (null: SwiGLU). 0 on success; 1: bad arguments; 2: not in
// this build (see above).
extern "C" int quant_moe_experts(const MoEExpert *experts, int64_t E, const void *x, int64_t ldx, int x_bf16,
                                 int64_t T, int64_t H, int64_t I, const int64_t *ids, const float *weights,
                                 int64_t k, const MoEGlu *glu, float *out) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    (void)experts, (void)E, (void)x, (void)ldx, (void)x_bf16, (void)T, (void)H, (void)I, (void)ids, (void)weights;
    (void)k, (void)glu, (void)out;
    return 2;
#else
    if (T <= 0 || k <= 0 || E <= 0 || H % 32 || I % 32) return T == 0 ? 0 : 1;
    const MoEGlu act = glu ? *glu : MoEGlu{0, 1.f, 0.f};
    if (act.kind != 0 && act.kind != 1) return 1;
    // Group the (token, slot) pairs by expert, tokens in order within each (a counting sort).
    std::vector<int64_t> start(E + 1, 0);
    for (int64_t p = 0; p < T * k; p++) {
        if (ids[p] < 0 || ids[p] >= E) return 1;
        start[ids[p] + 1]++;
    }
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    std::vector<int64_t> token(T * k), fill(start.begin(), start.end() - 1);
    std::vector<float> weight(T * k);
    for (int64_t p = 0; p < T * k; p++) {
        const int64_t at = fill[ids[p]]++;
        token[at] = p / k;
        weight[at] = weights[p];
    }
    std::vector<int64_t> chosen;
    for (int64_t e = 0; e < E; e++)
        if (start[e + 1] > start[e]) {
            const MoEExpert &m = experts[e];
            if (!moe_part_ok(m.gate, I, H) || !moe_part_ok(m.up, I, H) || !moe_part_ok(m.down, H, I)) return 1;
            chosen.push_back(e);
        }
    const int64_t P = T * k, nbh = H / 32, nbi = I / 32;
    const Act xt = t_moe_x.act(T + P, H);        // rows 0 .. T - 1: x; T .. T + P - 1: gathered per pair
    const Act xg{xt.q + T * H, xt.d + T * nbh, xt.ds + T * nbh, H, nbh, {}};
    const Act ag = t_moe_a.act(P, I);
    float *gated = fit(t_moe_gated, P * I);
#pragma omp parallel
    {
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
#pragma omp for schedule(static)
        for (int64_t i = 0; i < T * nbh; i++)
            quantize_one(x, ldx, x_bf16 != 0, i / nbh, i % nbh, H, const_cast<int8_t *>(xt.q),
                         const_cast<float *>(xt.d), const_cast<float *>(xt.ds));
#pragma omp for schedule(static)
        for (int64_t p = 0; p < P; p++) {
            std::memcpy(const_cast<int8_t *>(xg.q) + p * H, xt.q + token[p] * H, H);
            std::memcpy(const_cast<float *>(xg.d) + p * nbh, xt.d + token[p] * nbh, nbh * sizeof(float));
            std::memcpy(const_cast<float *>(xg.ds) + p * nbh, xt.ds + token[p] * nbh, nbh * sizeof(float));
        }
        // phase 1: gate and up, this thread's groups of every chosen expert
        const int64_t gi0 = I / 8 * tid / nt, gi1 = I / 8 * (tid + 1) / nt;
        float vg[4 * 8], vu[4 * 8];
        for (const int64_t e : chosen) {
            const MoEExpert &m = experts[e];
            for (int64_t g = gi0; g < gi1; g++)
                for (int64_t p0 = start[e]; p0 < start[e + 1]; p0 += 4) {
                    const int n = int(std::min<int64_t>(4, start[e + 1] - p0));
                    moe_rows8(m.gate, g, xg, p0, n, vg);
                    moe_rows8(m.up, g, xg, p0, n, vu);
                    const float *bg = m.gate_bias ? m.gate_bias + 8 * g : nullptr;
                    const float *bu = m.up_bias ? m.up_bias + 8 * g : nullptr;
                    for (int t = 0; t < n; t++)
                        for (int i = 0; i < 8; i++)
                            gated[(p0 + t) * I + 8 * g + i] = moe_glu(act, vg[t * 8 + i] + (bg ? bg[i] : 0.f),
                                                                      vu[t * 8 + i] + (bu ? bu[i] : 0.f));
                }
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t i = 0; i < P * nbi; i++)
            quantize_one(gated, I, false, i / nbi, i % nbi, I, const_cast<int8_t *>(ag.q), const_cast<float *>(ag.d),
                         const_cast<float *>(ag.ds));
        // phase 2: down, this thread's groups (its output columns) of every chosen expert
        const int64_t gh0 = H / 8 * tid / nt, gh1 = H / 8 * (tid + 1) / nt;
        float v[4 * 8];
        for (const int64_t e : chosen) {
            const MoEExpert &m = experts[e];
            for (int64_t g = gh0; g < gh1; g++)
                for (int64_t p0 = start[e]; p0 < start[e + 1]; p0 += 4) {
                    const int n = int(std::min<int64_t>(4, start[e + 1] - p0));
                    moe_rows8(m.down, g, ag, p0, n, v);
                    const float *b = m.down_bias ? m.down_bias + 8 * g : nullptr;
                    for (int t = 0; t < n; t++) {
                        float *o = out + token[p0 + t] * H + 8 * g;
                        for (int i = 0; i < 8; i++) o[i] += weight[p0 + t] * (v[t * 8 + i] + (b ? b[i] : 0.f));
                    }
                }
        }
    }
    return 0;
#endif
}
