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
// A decode token (one pair an expert) instead shares each phase's items (an expert's chunk of 8
// groups) out by WorkShare: a thread's own contiguous share of the experts, then what the others
// have left, so a thread the VM runs slower holds nobody at the barrier; down's dots go to a row
// per pair, added in expert order after phase 2 (the same floats). Each thread quantizes that
// token's x itself (no barrier), and only the activations the chosen matrices read are made (the
// super-block fields alone where every part is q4_kr8 / q5_kr8 / q6_kr8, as quant_linear_small).
// Weights in an r8 layout run r8_group_fn's kernels (8 rows a pass, 1-4 activation rows), or, where
// an expert has kGemmMinRows pairs or more (a prefill: ~T k / E each) and the layout has one, the
// integer GEMM's (gemm_r8_256.h: a unit's codes unpacked once per tile of up to 64 pairs, the
// activations relaid in its tile layout per expert); other types row_fn's (each of the 8 rows in turn).
// The avx512vnni build (PS_DOTS512) runs the same 256-bit r8 kernels (vpdpbusd's EVEX form: the same
// integers, the same bits as the 256-bit builds), over experts in r8 layouts only (quant.repack's
// `experts`): its file-layout dots read more of Act than this fills, so where a chosen expert has a
// part in another layout it returns 2 and kernels/moe.py runs the experts one by one.
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

#if defined(__AVX2__)
#define MOE_GEMM 1        // gemm_r8_256.h's integer GEMM is in this build
#endif
#if defined(PS_DOTS512)
#define MOE_R8_ONLY 1     // the avx512vnni build: experts in r8 layouts only (see above)
#endif

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

// A step's activations for the experts: q8 blocks of `rows` rows of K, in buffers of its own, and
// where `super` (a matrix that reads them) the super-block fields too.
struct MoEAct {
    std::vector<int8_t, Aligned64<int8_t>> q, qk;
    std::vector<float, Aligned64<float>> d, ds, dk;
    std::vector<int16_t, Aligned64<int16_t>> bsk;
    // blocks32: whether a matrix reads the blocks of 32 (else q, d, ds stay null: every one reads qk)
    Act act(int64_t rows, int64_t K, bool super, bool blocks32) {
        Act a{nullptr, nullptr, nullptr, K, K / 32, {}};
        if (blocks32) a.q = fit(q, rows * K), a.d = fit(d, rows * (K / 32)), a.ds = fit(ds, rows * (K / 32));
        if (super && K % 256 == 0) {
            a.qk = fit(qk, rows * K);
            a.dk = fit(dk, rows * (K / 256));
            a.bsk = fit(bsk, rows * (K / 16));
        }
        a.blocks32 = blocks32;
        return a;
    }
};

// Rows `first` .. of a as an Act of their own.
inline Act act_rows(const Act &a, int64_t first) {
    Act r{nullptr, nullptr, nullptr, a.K, a.nb, {}};
    if (a.blocks32) r.q = a.q + first * a.K, r.d = a.d + first * a.nb, r.ds = a.ds + first * a.nb;
    r.blocks32 = a.blocks32;
    if (a.qk != nullptr) {
        r.qk = a.qk + first * a.K;
        r.dk = a.dk + first * (a.K / 256);
        r.bsk = a.bsk + first * (a.K / 16);
    }
    return r;
}
thread_local MoEAct t_moe_x, t_moe_a;
thread_local std::vector<float> t_moe_gated;

// out[i] = glu(g[i], u[i]) for 8 lanes: the 8 exponentials first, then the rest lane by lane in
// the compiler's vectors (one division for 8): the same float operations as one lane at a time.
inline void moe_glu8(const MoEGlu &f, const float *g, const float *u, float *out) {
    float e[8];
    if (f.kind == 0) {
        for (int i = 0; i < 8; i++) e[i] = std::exp(-g[i]);
        for (int i = 0; i < 8; i++) out[i] = g[i] / (1.f + e[i]) * u[i];
        return;
    }
    float gc[8], uc[8];
    for (int i = 0; i < 8; i++) gc[i] = std::min(g[i], f.limit), uc[i] = std::min(f.limit, std::max(-f.limit, u[i]));
    for (int i = 0; i < 8; i++) e[i] = std::exp(-f.alpha * gc[i]);
    for (int i = 0; i < 8; i++) out[i] = gc[i] / (1.f + e[i]) * (uc[i] + 1.f);
}

// out[t * 8 + i] (t < nt) = row 8 g + i of m against activation rows t0 .. t0 + nt - 1 of a.
inline void moe_rows8(const QuantPart &m, int64_t g, const Act &a, int64_t t0, int nt, float *out) {
    const int qt = int(m.qtype);
    if (is_r8(qt)) {
#if defined(PS_DOTS512)
        if (qt == Q4_1R8) return kR8_512[nt](m.w + g * m.ldw, a.nb, a, t0, out, 8);
#endif
        return r8_group_fn(qt, nt)(m.w + g * m.ldw, a.nb, a, t0, out, 8);
    }
    const RowFn fn = row_fn(qt, nt);
    const int64_t ahead = prefetch_rows(m.ldw, 8), bytes = a.K / kElems[qt] * kBytes[qt];
    if (8 * g + 8 + ahead <= m.rows) prefetch_bytes(m.w + (8 * g + ahead) * m.ldw, m.ldw, 8, bytes);
    for (int i = 0; i < 8; i++) fn(m.w + (8 * g + i) * m.ldw, a, t0, out + i, 8);
}

// The first bytes of m's group g (an r8 layout's) that its dots fetch ahead (r8_ahead, with their
// hint), fetched while the groups before it run: the dots fetch ahead within a matrix's stream,
// not into the next expert's.
inline void moe_prefetch_group(const QuantPart &m, int64_t g) {
#ifdef MOE_GEMM
    const int qt = int(m.qtype);
    if (!is_r8(qt) || 8 * g >= m.rows) return;
    const char *p = reinterpret_cast<const char *>(m.w + g * m.ldw);
    // (_mm_prefetch's hint must be a constant: one loop per hint)
    if (r8_hint(qt) == _MM_HINT_T0) {
        for (int64_t l = 0; l < r8_ahead(qt); l += 64) _mm_prefetch(p + l, _MM_HINT_T0);
    } else {
        for (int64_t l = 0; l < r8_ahead(qt); l += 64) _mm_prefetch(p + l, _MM_HINT_T2);
    }
#else
    (void)m, (void)g;
#endif
}

#ifdef MOE_GEMM
// The step's activations in gemm_r8_256.h's tile layout: each expert's pairs in tiles of kGemmTile
// from its first pair (so a tile never holds two experts' rows).
thread_local GemmBuffers t_moe_gx, t_moe_ga;
thread_local std::vector<float, Aligned64<float>> t_moe_scratch;     // a thread's GEMM scratch (its minimum scales)

// Whether an expert with n pairs runs matrix m through the GEMM (gemm_r8_group): its layout has one
// and enough rows to fill a pass; else the 1-4-row dots (moe_rows8). Either gives a row the same
// floats (gemm_r8_256.h: the dots' arithmetic, bit for bit), so the batch never changes a row.
inline bool moe_gemm_takes(const QuantPart &m, int64_t n) { return n >= kGemmMinRows && gemm_has(int(m.qtype)); }

// Group g of m against the tile t0 .. t0 + n - 1 of a's pairs: out[t * 8 + i] as moe_rows8's.
inline void moe_gemm8(const QuantPart &m, int64_t g, const GemmAct &a, int64_t t0, int64_t n, float *out, float *scratch) {
    alignas(32) float acc[kGemmTile * 8], mins[kGemmTile * 8];
    std::memset(acc, 0, sizeof(float) * 8 * n);
    std::memset(mins, 0, sizeof(float) * 8 * n);
    const int qt = int(m.qtype);
    gemm_group_fn(qt)(m.w + g * m.ldw, a, t0, n, acc, mins, scratch);
    const bool minus = qt != Q4_0R8 && qt != Q4_1R8 && qt != Q5_0R8;      // K types: acc - mins
    const __m256i order = r8_order();
    for (int64_t t = 0; t < n; t++) {
        const __m256 A = _mm256_load_ps(acc + 8 * t), M = _mm256_load_ps(mins + 8 * t);
        _mm256_storeu_ps(out + 8 * t, _mm256_permutevar8x32_ps(minus ? _mm256_sub_ps(A, M) : _mm256_add_ps(A, M), order));
    }
}
#endif

constexpr int64_t kMoEChunk = 8;           // groups of 8 rows an item (a decode token's phases: WorkShare)
thread_local std::vector<float> t_moe_res;   // a decode token's down dots, each pair's row

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
#ifdef MOE_R8_ONLY
            if (!is_r8(int(m.gate.qtype)) || !is_r8(int(m.up.qtype)) || !is_r8(int(m.down.qtype))) return 2;
#endif
            chosen.push_back(e);
        }
    const int64_t P = T * k, nbh = H / 32, nbi = I / 32;
    // What the chosen experts read: gate and up (1) x's, down (2) the gated rows' super-block fields
    // (Act::qk: a q4_kr8 / q5_kr8 / q6_kr8 part) or blocks of 32 (any other part); only those are made.
    bool super1 = false, blocks1 = false, super2 = false, blocks2 = false;
    bool single = true;                          // every chosen expert has one pair (a decode token): no gather
    for (const int64_t e : chosen) {
        (reads_super(int(experts[e].gate.qtype)) ? super1 : blocks1) = true;
        (reads_super(int(experts[e].up.qtype)) ? super1 : blocks1) = true;
        (reads_super(int(experts[e].down.qtype)) ? super2 : blocks2) = true;
        single &= start[e + 1] - start[e] == 1;
    }
    // x's T rows; unless `single`, then gathered per pair in expert order (rows T .. T + P - 1)
    const Act xt = t_moe_x.act(single ? T : T + P, H, super1, blocks1);
    const Act xg = single ? xt : act_rows(xt, T);
    const Act ag = t_moe_a.act(P, I, super2, blocks2);
    const int64_t nsh = super1 ? H / 256 : 0, nsi = super2 ? I / 256 : 0;    // super-blocks a row, where read
    const int64_t nbx = blocks1 ? nbh : 0, nba = blocks2 ? nbi : 0;          // blocks of 32 a row, where read
    // A decode token's x: every thread quantizes it itself, into its own buffers, rather than its
    // share and a barrier (linear_small's rule, kOwnBlocks).
    const bool own = single && T * nbh <= kOwnBlocks;
    float *gated = fit(t_moe_gated, P * I);
    // Which experts' matrices the GEMM takes (phase 1: gate and up; phase 2: down), and each pair's
    // tile there (its first row, its rows).
    std::vector<char> gemm1(E, 0), gemm2(E, 0);
    bool any1 = false, any2 = false, offsets1 = false, offsets2 = false;
#ifdef MOE_GEMM
    std::vector<int64_t> tile0(P), tilen(P);
    for (const int64_t e : chosen) {
        const MoEExpert &m = experts[e];
        const int64_t n = start[e + 1] - start[e];
        gemm1[e] = moe_gemm_takes(m.gate, n) && moe_gemm_takes(m.up, n);
        gemm2[e] = moe_gemm_takes(m.down, n);
        any1 |= gemm1[e], any2 |= gemm2[e];
        offsets1 |= gemm1[e] && (m.gate.qtype == Q6_KR8 || m.up.qtype == Q6_KR8);
        offsets2 |= gemm2[e] && m.down.qtype == Q6_KR8;
        for (int64_t p = start[e]; p < start[e + 1]; p++) {
            tile0[p] = start[e] + (p - start[e]) / kGemmTile * kGemmTile;
            tilen[p] = std::min(kGemmTile, start[e + 1] - tile0[p]);
        }
    }
    std::vector<char> pair_gemm1(P, 0), pair_gemm2(P, 0);
    for (const int64_t e : chosen)
        for (int64_t p = start[e]; p < start[e + 1]; p++) pair_gemm1[p] = gemm1[e], pair_gemm2[p] = gemm2[e];
    GemmBuffers &bx = t_moe_gx, &ba = t_moe_ga;
    GemmAct gx = any1 ? GemmAct{fit(bx.q, P * H), fit(bx.d, P * nbh), fit(bx.ds, P * nbh),
                                offsets1 ? fit(bx.o, 4 * P * nbh) : nullptr, P, H, nbh}
                      : GemmAct{};
    GemmAct ga = any2 ? GemmAct{fit(ba.q, P * I), fit(ba.d, P * nbi), fit(ba.ds, P * nbi),
                                offsets2 ? fit(ba.o, 4 * P * nbi) : nullptr, P, I, nbi}
                      : GemmAct{};
    bx.fit_super(gx, any1 && nsh > 0, P, H);
    ba.fit_super(ga, any2 && nsi > 0, P, I);
#endif
    // Block j (of 32) and super-block s of pair p's gated row into ag (and the GEMM's tiles, where it takes p).
    auto put_a32 = [&](int64_t p, int64_t j) {
        const int64_t i = p * nbi + j;
        quantize_one(gated, I, false, p, j, I, const_cast<int8_t *>(ag.q), const_cast<float *>(ag.d),
                     const_cast<float *>(ag.ds));
#ifdef MOE_GEMM
        if (pair_gemm2[p]) gemm_put_block(ag.q + i * 32, ag.d[i], ag.ds[i], ga, tile0[p], tilen[p], p, j);
#else
        (void)i;
#endif
    };
    auto put_a256 = [&](int64_t p, int64_t s) {
        const int64_t i = p * nsi + s;
        quantize_super_one(gated, I, false, p, s, ag);
#ifdef MOE_GEMM
        if (pair_gemm2[p] && ga.qk != nullptr)
            gemm_put_super(ag.qk + i * 256, ag.dk[i], ag.bsk + 16 * i, ga, tile0[p], tilen[p], p, s);
#else
        (void)i;
#endif
    };
    const int64_t team = omp_get_max_threads();
    WorkShare share1(single ? int64_t(chosen.size()) * ((I / 8 + kMoEChunk - 1) / kMoEChunk) : 0, team);
    WorkShare share2(single ? int64_t(chosen.size()) * ((H / 8 + kMoEChunk - 1) / kMoEChunk) : 0, team);
    float *res = single ? fit(t_moe_res, P * H) : nullptr;
#pragma omp parallel
    {
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
        Act x1 = xg;                             // what gate and up read: xg, or this thread's own x (`own`)
        if (own) {
            if (tid != 0) x1 = t_moe_x.act(T, H, super1, blocks1);
            for (int64_t i = 0; i < T * nbx; i++)
                quantize_one(x, ldx, x_bf16 != 0, i / nbh, i % nbh, H, const_cast<int8_t *>(x1.q),
                             const_cast<float *>(x1.d), const_cast<float *>(x1.ds));
            for (int64_t i = 0; i < T * nsh; i++) quantize_super_one(x, ldx, x_bf16 != 0, i / nsh, i % nsh, x1);
        } else {
#pragma omp for schedule(static) nowait
            for (int64_t i = 0; i < T * nbx; i++)
                quantize_one(x, ldx, x_bf16 != 0, i / nbh, i % nbh, H, const_cast<int8_t *>(xt.q),
                             const_cast<float *>(xt.d), const_cast<float *>(xt.ds));
#pragma omp for schedule(static)
            for (int64_t i = 0; i < T * nsh; i++) quantize_super_one(x, ldx, x_bf16 != 0, i / nsh, i % nsh, xt);
            if (!single) {
#pragma omp for schedule(static)
                for (int64_t p = 0; p < P; p++) {
                    if (blocks1) {
                        std::memcpy(const_cast<int8_t *>(xg.q) + p * H, xt.q + token[p] * H, H);
                        std::memcpy(const_cast<float *>(xg.d) + p * nbh, xt.d + token[p] * nbh, nbh * sizeof(float));
                        std::memcpy(const_cast<float *>(xg.ds) + p * nbh, xt.ds + token[p] * nbh, nbh * sizeof(float));
                    }
                    if (nsh > 0) {
                        std::memcpy(const_cast<int8_t *>(xg.qk) + p * H, xt.qk + token[p] * H, H);
                        std::memcpy(const_cast<float *>(xg.dk) + p * nsh, xt.dk + token[p] * nsh, nsh * sizeof(float));
                        std::memcpy(const_cast<int16_t *>(xg.bsk) + p * (H / 16), xt.bsk + token[p] * (H / 16),
                                    H / 16 * sizeof(int16_t));
                    }
                }
            }
        }
#ifdef MOE_GEMM
        float *scratch = any1 || any2 ? fit(t_moe_scratch, 8 * std::max(nbh, nbi)) : nullptr;  // the GEMM's minimum scales
        alignas(32) float wg[kGemmTile * 8], wu[kGemmTile * 8];
        if (any1) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < P * nbx; i++) {
                const int64_t p = i / nbx, j = i % nbx, q = token[p] * nbh + j;
                if (pair_gemm1[p])
                    gemm_put_block(xt.q + token[p] * H + 32 * j, xt.d[q], xt.ds[q], gx, tile0[p], tilen[p], p, j);
            }
            if (gx.qk != nullptr) {
#pragma omp for schedule(static)
                for (int64_t i = 0; i < P * nsh; i++) {
                    const int64_t p = i / nsh, s = i % nsh, q = token[p] * nsh + s;
                    if (pair_gemm1[p])
                        gemm_put_super(xt.qk + token[p] * H + 256 * s, xt.dk[q], xt.bsk + 16 * q, gx, tile0[p], tilen[p], p, s);
                }
            }
        }
#endif
        float vg[4 * 8], vu[4 * 8], v[4 * 8];
        auto glu8 = [&](const MoEExpert &m, int64_t g, int64_t p0, int64_t n, const float *sg, const float *su) {
            const float *bg = m.gate_bias ? m.gate_bias + 8 * g : nullptr;
            const float *bu = m.up_bias ? m.up_bias + 8 * g : nullptr;
            for (int64_t t = 0; t < n; t++) {
                float gb[8], ub[8];
                for (int i = 0; i < 8; i++) gb[i] = sg[t * 8 + i] + (bg ? bg[i] : 0.f), ub[i] = su[t * 8 + i] + (bu ? bu[i] : 0.f);
                moe_glu8(act, gb, ub, gated + (p0 + t) * I + 8 * g);
            }
        };
        auto add8 = [&](const MoEExpert &m, int64_t g, int64_t p0, int64_t n, const float *s) {
            const float *b = m.down_bias ? m.down_bias + 8 * g : nullptr;
            for (int64_t t = 0; t < n; t++) {
                float *o = out + token[p0 + t] * H + 8 * g;
                for (int i = 0; i < 8; i++) o[i] += weight[p0 + t] * (s[t * 8 + i] + (b ? b[i] : 0.f));
            }
        };
        if (single) {
            // A decode token (one pair an expert): each phase's items, an expert's chunk of groups,
            // shared out by WorkShare (a thread's own contiguous share first, then what is left of
            // the others'), so a thread the VM runs slower never holds the other at the barrier.
            // Down's dots go to res (each pair's row), added in expert order after: the same floats.
            const int64_t n1 = (I / 8 + kMoEChunk - 1) / kMoEChunk, n2 = (H / 8 + kMoEChunk - 1) / kMoEChunk;
            for (int64_t item; (item = share1.next(tid)) >= 0;) {
                const int64_t c = item / n1, g0 = item % n1 * kMoEChunk, g1 = std::min(I / 8, g0 + kMoEChunk);
                const int64_t e = chosen[c], p = start[e];
                const MoEExpert &m = experts[e];
                for (int64_t g = g0; g < g1; g++) {
                    if (g == std::max(g0, g1 - 2) && g1 == I / 8 && c + 1 < int64_t(chosen.size())) {
                        moe_prefetch_group(experts[chosen[c + 1]].gate, 0);     // the next expert's streams
                        moe_prefetch_group(experts[chosen[c + 1]].up, 0);
                    }
                    moe_rows8(m.gate, g, x1, token[p], 1, vg);
                    moe_rows8(m.up, g, x1, token[p], 1, vu);
                    glu8(m, g, p, 1, vg, vu);
                }
            }
#pragma omp barrier
#pragma omp for schedule(static) nowait
            for (int64_t i = 0; i < P * nba; i++) put_a32(i / nba, i % nba);
#pragma omp for schedule(static)
            for (int64_t i = 0; i < P * nsi; i++) put_a256(i / nsi, i % nsi);
            for (int64_t item; (item = share2.next(tid)) >= 0;) {
                const int64_t c = item / n2, g0 = item % n2 * kMoEChunk, g1 = std::min(H / 8, g0 + kMoEChunk);
                const int64_t e = chosen[c], p = start[e];
                for (int64_t g = g0; g < g1; g++) {
                    if (g == std::max(g0, g1 - 2) && g1 == H / 8 && c + 1 < int64_t(chosen.size()))
                        moe_prefetch_group(experts[chosen[c + 1]].down, 0);
                    moe_rows8(experts[e].down, g, ag, p, 1, res + p * H + 8 * g);
                }
            }
#pragma omp barrier
#pragma omp for schedule(static)
            for (int64_t g = 0; g < H / 8; g++)
                for (int64_t p = 0; p < P; p++) add8(experts[chosen[p]], g, p, 1, res + p * H + 8 * g);
        } else {
            // phase 1: gate and up, this thread's groups of every chosen expert: whole blocks of what
            // down reads (`aligned`, where that splits the groups evenly enough), so the thread then
            // quantizes the gated values it wrote and one barrier precedes phase 2
            const int64_t unit = (super2 ? 256 : 32) / 8, nu = I / 8 / unit;
            const bool aligned = nu % nt == 0 || nu >= 4 * nt;
            const int64_t gi0 = aligned ? unit * (nu * tid / nt) : I / 8 * tid / nt;
            const int64_t gi1 = aligned ? unit * (nu * (tid + 1) / nt) : I / 8 * (tid + 1) / nt;
            const int64_t gh0 = H / 8 * tid / nt, gh1 = H / 8 * (tid + 1) / nt;     // phase 2's (output columns)
            for (size_t c = 0; c < chosen.size(); c++) {
                const MoEExpert &m = experts[chosen[c]];
                const int64_t e = chosen[c];
    #ifdef MOE_GEMM
                if (gemm1[e]) {
                    for (int64_t g = gi0; g < gi1; g++)
                        for (int64_t p0 = start[e]; p0 < start[e + 1]; p0 += kGemmTile) {
                            const int64_t n = std::min(kGemmTile, start[e + 1] - p0);
                            moe_gemm8(m.gate, g, gx, p0, n, wg, scratch);
                            moe_gemm8(m.up, g, gx, p0, n, wu, scratch);
                            glu8(m, g, p0, n, wg, wu);
                        }
                    continue;
                }
    #endif
                for (int64_t g = gi0; g < gi1; g++) {
                    if (g == std::max(gi0, gi1 - 2)) {      // the next expert's streams (or phase 2's first)
                        if (c + 1 < chosen.size()) {
                            moe_prefetch_group(experts[chosen[c + 1]].gate, gi0);
                            moe_prefetch_group(experts[chosen[c + 1]].up, gi0);
                        } else {
                            moe_prefetch_group(experts[chosen[0]].down, gh0);
                        }
                    }
                    for (int64_t p0 = start[e]; p0 < start[e + 1]; p0 += 4) {
                        const int n = int(std::min<int64_t>(4, start[e + 1] - p0));
                        moe_rows8(m.gate, g, xg, p0, n, vg);
                        moe_rows8(m.up, g, xg, p0, n, vu);
                        glu8(m, g, p0, n, vg, vu);
                    }
                }
            }
            if (aligned) {
                for (int64_t p = 0; p < P; p++) {
                    for (int64_t j = gi0 * 8 / 32; j < (blocks2 ? gi1 * 8 / 32 : 0); j++) put_a32(p, j);
                    for (int64_t s = gi0 * 8 / 256; s < (super2 ? gi1 * 8 / 256 : 0); s++) put_a256(p, s);
                }
    #pragma omp barrier
            } else {
    #pragma omp barrier
    #pragma omp for schedule(static) nowait
                for (int64_t i = 0; i < P * nba; i++) put_a32(i / nba, i % nba);
    #pragma omp for schedule(static)
                for (int64_t i = 0; i < P * nsi; i++) put_a256(i / nsi, i % nsi);
            }
            // phase 2: down, this thread's groups (its output columns) of every chosen expert
            for (size_t c = 0; c < chosen.size(); c++) {
                const MoEExpert &m = experts[chosen[c]];
                const int64_t e = chosen[c];
    #ifdef MOE_GEMM
                if (gemm2[e]) {
                    for (int64_t g = gh0; g < gh1; g++)
                        for (int64_t p0 = start[e]; p0 < start[e + 1]; p0 += kGemmTile) {
                            const int64_t n = std::min(kGemmTile, start[e + 1] - p0);
                            moe_gemm8(m.down, g, ga, p0, n, wg, scratch);
                            add8(m, g, p0, n, wg);
                        }
                    continue;
                }
    #endif
                for (int64_t g = gh0; g < gh1; g++) {
                    if (g == std::max(gh0, gh1 - 2) && c + 1 < chosen.size()) moe_prefetch_group(experts[chosen[c + 1]].down, gh0);
                    for (int64_t p0 = start[e]; p0 < start[e + 1]; p0 += 4) {
                        const int n = int(std::min<int64_t>(4, start[e + 1] - p0));
                        moe_rows8(m.down, g, ag, p0, n, v);
                        add8(m, g, p0, n, v);
                    }
                }
            }
        }
    }
    return 0;
}
