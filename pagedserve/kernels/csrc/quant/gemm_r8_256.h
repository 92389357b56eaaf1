// The r8 layouts' integer GEMM on 256-bit registers (AVX2, AVX-VNNI): many activation rows (prefill
// chunks, large decode batches) against groups of 8 interleaved weight rows (repack_r8.h), the
// same arithmetic per activation row as the one-to-four-row dots (dot_r8_256.h, dot_k_r8_256.h),
// bit for bit: per row, over the 32-element blocks j in order, acc = fma(float(dot_j), A_j * dx_j,
// acc), mins = fma(M_j, ds_j, mins), y = acc +- mins (the integers exact, whatever route sums them).
// So a row's result never depends on how many rows share the call (batch invariance). The super-block
// types read the super-block activations (Act::qk, dk, bsk) instead (dot_k_r8_256.h's arithmetic): per
// row and super-block s the integer dots with their sub-block scales summed in int32 (a tile row's
// int32 buffer), then one conversion and acc = fma(float(isum_s), D * dk_s, acc) (q4_k, q5_k: the
// minimums' integer sum too, gemm_k_rows).
// What changes is the loop order: those dots hold 1-4 rows' accumulators in registers and unpack a
// unit's codes for every pass of 4 rows; here a unit's codes and scales are unpacked into registers
// once per tile of kGemmTile activation rows, and the tile's rows stream past them, each row's
// accumulators in an L1 buffer (one load and one store a unit), the activations laid out block-major
// per tile (a unit's rows contiguous: no 4 KiB-strided loads) and, for q6_k, the offset 32 times
// each 8 activations' sums computed once per call instead of once per unit (2 loads, not 4 maddubs).
// q6_k's codes come 8 rows a register (4 bytes of each: the layout's, q6_codes_256), so a block's 16
// elements per row sum in 16 bits without a hadd (8 maddubs, 2 madd, no hadd).
// Per unit and row the work is then the dot itself (8 maddubs, 2 madd, 1 hadd; q6_k as said),
// one conversion, one multiply and one or two multiply-adds.
// (q4 codes as 8 rows a register too, no hadd: 0.98x on a quiet host in gemm_r8.py's A/B, issue 47:
// its 8 four-byte broadcasts a block cost what the hadd saves.)
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {

#if defined(__AVX2__)
constexpr int64_t kGemmTile = 64;       // activation rows per pass over a group's weights

// The activations of tiles of kGemmTile rows, block-major within each tile: tile at t0 (n rows):
// row t's block j at q + 32 * (t0 * nb + j * n + t), its dx, ds at d, ds + t0 * nb + j * n + t, and
// (q6_k) o + 4 * (t0 * nb + j * n + t): the int16 lanes 32 (the sum over k < 4 of x[4 k + 2 p] +
// x[4 k + 2 p + 1]), p < 2, then the same for x[16 ..]: q6_k's offset 32 times what a lane of
// gemm_q6_rows's 16-bit sums holds (made from qk's codes: gemm_put_super).
// The super-block activations (Act::qk, dk, bsk; null where no part reads them): the codes in q's
// layout (row t's 32 codes of block j at qk + 32 * at(t0, n, j, t)), its scale of super-block s at
// dk + sat(t0, n, s, t) and the 16 sums at bsk + 16 * sat(t0, n, s, t).
struct GemmAct {
    int8_t *q;
    float *d, *ds;
    int16_t *o;
    int64_t T, K, nb;
    int8_t *qk = nullptr;
    float *dk = nullptr;
    int16_t *bsk = nullptr;
    int64_t at(int64_t t0, int64_t n, int64_t j, int64_t t) const { return t0 * nb + j * n + t; }
    int64_t sat(int64_t t0, int64_t n, int64_t s, int64_t t) const { return t0 * (K / 256) + s * n + t; }
};

struct GemmBuffers {
    std::vector<int8_t, Aligned64<int8_t>> q, qk;
    std::vector<float, Aligned64<float>> d, ds, dk;
    std::vector<int16_t, Aligned64<int16_t>> o, bsk;
    // g's super-block arrays for rows of K (where `super`)
    void fit_super(GemmAct &g, bool super, int64_t rows, int64_t K) {
        if (!super || K % 256) return;
        g.qk = fit(qk, rows * K);
        g.dk = fit(dk, rows * (K / 256));
        g.bsk = fit(bsk, rows * (K / 16));
    }
};
thread_local GemmBuffers t_gemm;

// q6_k's offset lanes of block codes x at o + 4 * at (GemmAct's comment).
inline void gemm_put_offsets(const int8_t *x, const GemmAct &g, int64_t at) {
    for (int h = 0; h < 2; h++)
        for (int p = 0; p < 2; p++) {
            int sum = 0;
            for (int k = 4 * h; k < 4 * h + 4; k++) sum += x[4 * k + 2 * p] + x[4 * k + 2 * p + 1];
            g.o[4 * at + 2 * h + p] = int16_t(32 * sum);        // |32 * 8 * 127| < 32768
        }
}

// Row t's super-block s (codes x, scale d, 16 sums bs) into g's tile layout (tile t0 .. t0 + n - 1).
inline void gemm_put_super(const int8_t *x, float d, const int16_t *bs, const GemmAct &g, int64_t t0, int64_t n,
                           int64_t t, int64_t s) {
    for (int64_t j = 0; j < 8; j++) {
        std::memcpy(g.qk + 32 * g.at(t0, n, 8 * s + j, t - t0), x + 32 * j, 32);
        if (g.o != nullptr) gemm_put_offsets(x + 32 * j, g, g.at(t0, n, 8 * s + j, t - t0));   // q6_k's, of qk's codes
    }
    const int64_t at = g.sat(t0, n, s, t - t0);
    g.dk[at] = d;
    std::memcpy(g.bsk + 16 * at, bs, 16 * sizeof(int16_t));
}

// Super-block i (row t = i / ns, s = i % ns) of a (row-major Act) into g's tile layout.
inline void gemm_relayout_super(const Act &a, const GemmAct &g, int64_t i) {
    const int64_t ns = a.K / 256, t = i / ns, s = i % ns, t0 = t / kGemmTile * kGemmTile;
    gemm_put_super(a.qk + t * a.K + 256 * s, a.dk[i], a.bsk + 16 * i, g, t0, std::min(kGemmTile, g.T - t0), t, s);
}

// Row t's block j (codes x, scales d, ds) into g's tile layout, in the tile of rows t0 .. t0 + n - 1.
inline void gemm_put_block(const int8_t *x, float d, float ds, const GemmAct &g, int64_t t0, int64_t n, int64_t t,
                           int64_t j) {
    const int64_t at = g.at(t0, n, j, t - t0);
    std::memcpy(g.q + 32 * at, x, 32);
    g.d[at] = d;
    g.ds[at] = ds;
}

// Block i (row t = i / nb, block j) of a (row-major Act) into g's tile layout (tiles from row 0).
inline void gemm_relayout(const Act &a, const GemmAct &g, int64_t i) {
    const int64_t t = i / a.nb, j = i % a.nb, t0 = t / kGemmTile * kGemmTile;
    gemm_put_block(a.q + t * a.K + 32 * j, a.d[i], a.ds[i], g, t0, std::min(kGemmTile, g.T - t0), t, j);
}

// A 32-element block's dots of 8 rows (lanes in the hadd's order, as dot_r8_256.h's
// hadd(q4_half, q4_half)): codes c <= 15 (Q5: <= 31) against the activations' four 8-byte broadcasts xb.
template <bool Q5>
inline __m256i q4_dot8(const __m256i c[2][4], const __m256i xb[4]) {
#if !defined(PS_VNNI256)
    if constexpr (!Q5) {
    // each half's four products in 16 bits (<= 4 * 2 * 31 * 127), then adjacent lanes of the two
    // halves added in 16 bits too (q4: <= 2 * 4 * 2 * 15 * 127 < 32768; q5_k's codes <= 31 can
    // not: hadd in 32 bits), one madd per block instead of one per half
    auto half16 = [&](const __m256i *h) {
        return _mm256_add_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(h[0], xb[0]), _mm256_maddubs_epi16(h[1], xb[1])),
                                _mm256_add_epi16(_mm256_maddubs_epi16(h[2], xb[2]), _mm256_maddubs_epi16(h[3], xb[3])));
    };
    return _mm256_madd_epi16(_mm256_hadd_epi16(half16(c[0]), half16(c[1])), _mm256_set1_epi16(1));
    }
#endif
    return _mm256_hadd_epi32(q4_half(c[0], xb), q4_half(c[1], xb));
}

// acc ([n][8], the hadd's lane order) += rows t0 .. t0 + n - 1 against 32-element block j of the
// group: codes c (per half, pieces: vector 0 low, 1 low, 0 high, 1 high nibbles), scale A.
template <bool Q5 = false>
inline void gemm_q4_rows(const __m256i c[2][4], __m256 A, const GemmAct &g, int64_t t0, int64_t n, int64_t j, float *acc) {
    const int64_t at = g.at(t0, n, j, 0);
    const int8_t *xq = g.q + 32 * at;
    const float *dx = g.d + at;
    for (int64_t t = 0; t < n; t++) {
        const int8_t *x = xq + 32 * t;
        const __m256i xb[4] = {bcast8(x), bcast8(x + 8), bcast8(x + 16), bcast8(x + 24)};
        const __m256i dot = q4_dot8<Q5>(c, xb);
        const __m256 S = _mm256_mul_ps(A, _mm256_set1_ps(dx[t]));
        _mm256_store_ps(acc + 8 * t, _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), S, _mm256_load_ps(acc + 8 * t)));
    }
}

// isum ([n][16]: per row the two halves' dwords, k_dot_half's) += rows t0 .. t0 + n - 1 of the
// super-block activations against sub-block j (of the row) of a K-quant group: codes c, scale lanes l0, l1.
inline void gemm_k_rows(const __m256i c[2][4], __m256i l0, __m256i l1, const GemmAct &g, int64_t t0, int64_t n, int64_t j,
                        int32_t *isum) {
    const int8_t *xq = g.qk + 32 * g.at(t0, n, j, 0);
    for (int64_t t = 0; t < n; t++) {
        const int8_t *x = xq + 32 * t;
        const __m256i xb[4] = {bcast8(x), bcast8(x + 8), bcast8(x + 16), bcast8(x + 24)};
        __m256i *v = reinterpret_cast<__m256i *>(isum + 16 * t);
        _mm256_store_si256(v, _mm256_add_epi32(_mm256_load_si256(v), k_dot_half(c[0], xb, l0)));
        _mm256_store_si256(v + 1, _mm256_add_epi32(_mm256_load_si256(v + 1), k_dot_half(c[1], xb, l1)));
    }
}

// q4_k: isum ([n][8], the hadd's row order) += rows t0 .. t0 + n - 1 against sub-block j: k_dot8_q4.
inline void gemm_k4_rows(const __m256i c[2][4], __m256i L, const GemmAct &g, int64_t t0, int64_t n, int64_t j, int32_t *isum) {
    const int8_t *xq = g.qk + 32 * g.at(t0, n, j, 0);
    for (int64_t t = 0; t < n; t++) {
        __m256i *v = reinterpret_cast<__m256i *>(isum + 8 * t);
        _mm256_store_si256(v, _mm256_add_epi32(_mm256_load_si256(v), k_dot8_q4(c, xq + 32 * t, L)));
    }
}

// mins ([n][8]) = rows t0 .. t0 + n - 1's minimum terms, the chain over the blocks j in order of
// fma(M_j, ds_j, mins), M_j the group's at m + 8 j (a pass of its own: 8 rows' chains in registers,
// no load and store of them per block, as the dots' accumulators have).
inline void gemm_mins(const float *m, const GemmAct &g, int64_t t0, int64_t n, float *mins) {
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; i++) r[i] = _mm256_setzero_ps();
        for (int64_t j = 0; j < g.nb; j++) {
            const __m256 M = _mm256_load_ps(m + 8 * j);
            const float *ds = g.ds + g.at(t0, n, j, t);
            for (int i = 0; i < 8; i++) r[i] = _mm256_fmadd_ps(M, _mm256_set1_ps(ds[i]), r[i]);
        }
        for (int i = 0; i < 8; i++) _mm256_store_ps(mins + 8 * (t + i), r[i]);
    }
    for (; t < n; t++) {
        __m256 r = _mm256_setzero_ps();
        for (int64_t j = 0; j < g.nb; j++) r = _mm256_fmadd_ps(_mm256_load_ps(m + 8 * j), _mm256_set1_ps(g.ds[g.at(t0, n, j, t)]), r);
        _mm256_store_ps(mins + 8 * t, r);
    }
}

// isum ([n][8] int32, row l in dword l) += rows t0 .. t0 + n - 1 against q6_k block j of the group,
// in the super-block activations (GemmAct::qk): codes c8 (q6_codes_256 of its groups 2 j, 2 j + 1: 8
// rows a register, 4 bytes of each), the groups' scales sa, sb (q6_scales16). Per row, the 16
// elements of each group sum in the two 16-bit lanes of its dword, the offset taken off there too (o,
// from qk's codes): the adds wrap, and what they end at, (q - 32) times 8 activations per lane (<= 8 *
// 32 * 127), fits; then times the group's scale (madd), summed in int32 over the super-block's blocks
// (First: the first, stored; no float per block). At its last block (Last) acc = fma(float(isum),
// D * dk, acc) (the rows permuted into D's, the hadd's, order): one conversion a unit. Per row |isum|
// <= 256 * 32 * 127 * 128 < 2^31. The same integers as the dots' (q6_super_256), so the same floats.
template <bool First, bool Last>
inline void gemm_q6_rows(const __m256i c8[8], __m256i sa, __m256i sb, __m256 D, const GemmAct &g, int64_t t0, int64_t n,
                         int64_t j, int32_t *isum, float *acc) {
    const int64_t at = g.at(t0, n, j, 0);
    const int8_t *xq = g.qk + 32 * at;
    const int32_t *xo = reinterpret_cast<const int32_t *>(g.o + 4 * at);
    const float *dx = g.dk + g.sat(t0, n, j / 8, 0);
    auto m = [](__m256i c, const int8_t *x) { return _mm256_maddubs_epi16(c, bcast4(x)); };
    for (int64_t t = 0; t < n; t++) {
        const int8_t *x = xq + 32 * t;
        const __m256i qa = _mm256_add_epi16(_mm256_add_epi16(m(c8[0], x), m(c8[1], x + 4)),
                                            _mm256_add_epi16(m(c8[2], x + 8), m(c8[3], x + 12)));
        const __m256i qb = _mm256_add_epi16(_mm256_add_epi16(m(c8[4], x + 16), m(c8[5], x + 20)),
                                            _mm256_add_epi16(m(c8[6], x + 24), m(c8[7], x + 28)));
        __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(_mm256_sub_epi16(qa, _mm256_set1_epi32(xo[2 * t])), sa),
                                       _mm256_madd_epi16(_mm256_sub_epi16(qb, _mm256_set1_epi32(xo[2 * t + 1])), sb));
        __m256i *is = reinterpret_cast<__m256i *>(isum + 8 * t);
        if constexpr (!First) dot = _mm256_add_epi32(dot, _mm256_load_si256(is));
        if constexpr (Last) {
            const __m256 S = _mm256_mul_ps(D, _mm256_set1_ps(dx[t]));
            const __m256 rows = _mm256_cvtepi32_ps(_mm256_permutevar8x32_epi32(dot, r8_order()));
            _mm256_store_ps(acc + 8 * t, _mm256_fmadd_ps(rows, S, _mm256_load_ps(acc + 8 * t)));
        } else {
            _mm256_store_si256(is, dot);
        }
    }
}

// The group at w (nb blocks of 32) against tile rows t0 .. t0 + n - 1: acc, mins as above (q6_k:
// mins untouched); m: the group's M_j (nb * 8 floats, 32-byte aligned) as scratch.
template <int QT>
void gemm_r8_group(const uint8_t *w, const GemmAct &g, int64_t t0, int64_t n, float *acc, float *mins, float *m) {
    constexpr int64_t U = r8_unit_bytes(QT);
    if constexpr (QT == Q4_0R8 || QT == Q4_1R8 || QT == Q5_0R8) {
        for (int64_t j = 0; j < g.nb; j++) {
            const uint8_t *u = w + j * U;
            const __m256 A = r8_f16x8(u);
            const __m256 M = QT == Q4_1R8 ? r8_f16x8(u + 16) : _mm256_mul_ps(A, _mm256_set1_ps(QT == Q5_0R8 ? -16.f : -8.f));
            __m256i c[2][4];
            q4_unit_codes<QT>(u, c);
            _mm256_store_ps(m + 8 * j, M);
            gemm_q4_rows<QT == Q5_0R8>(c, A, g, t0, n, j, acc);
        }
        gemm_mins(m, g, t0, n, mins);
    } else if constexpr (QT == Q4_KR8 || QT == Q5_KR8) {
        // per super-block: each row's two int32 dwords per half (k_dot_half) summed in an L1 buffer over
        // its 8 sub-blocks, then one hadd, conversion and fma (and the minimums' integer sum and fma)
        alignas(32) int32_t isum[kGemmTile * 16];
        for (int64_t s = 0; s < g.nb / 8; s++) {
            const uint8_t *u = w + s * U;
            const __m256 D = r8_f16x8(u), Dm = r8_f16x8(u + 16);
            KSuper ks;
            k_super_scales(u, ks);
            constexpr int W = QT == Q4_KR8 ? 8 : 16;       // a row's int32s (q4_k: one register, k_dot8_q4)
            std::memset(isum, 0, sizeof(int32_t) * W * n);
            for (int j = 0; j < 8; j++) {
                __m256i c[2][4];
                k_codes_256<QT>(u, j, c);
                if constexpr (QT == Q4_KR8) gemm_k4_rows(c, k_pair_lanes(ks, j), g, t0, n, 8 * s + j, isum);
                else gemm_k_rows(c, k_lanes(ks, j, 0), k_lanes(ks, j, 1), g, t0, n, 8 * s + j, isum);
            }
            for (int64_t t = 0; t < n; t++) {
                const int64_t at = g.sat(t0, n, s, t);
                const __m256 dx = _mm256_set1_ps(g.dk[at]);
                const __m256i i0 = _mm256_load_si256(reinterpret_cast<const __m256i *>(isum + W * t));
                const __m256i rows = QT == Q4_KR8 ? i0 : _mm256_hadd_epi32(i0, _mm256_load_si256(reinterpret_cast<const __m256i *>(isum + W * t + 8)));
                _mm256_store_ps(acc + 8 * t, _mm256_fmadd_ps(_mm256_cvtepi32_ps(rows), _mm256_mul_ps(D, dx),
                                                             _mm256_load_ps(acc + 8 * t)));
                _mm256_store_ps(mins + 8 * t, _mm256_fmadd_ps(_mm256_cvtepi32_ps(k_min_sum(ks, g.bsk + 16 * at)),
                                                              _mm256_mul_ps(Dm, dx), _mm256_load_ps(mins + 8 * t)));
            }
        }
    } else {        // Q6_KR8 (no minimum terms: mins stays 0)
        static_assert(QT == Q6_KR8, "gemm_r8_group: an r8 layout");
        alignas(32) int32_t isum[kGemmTile * 8];       // a unit's int32 sums per row (GemmAct::qk: reads_super)
        for (int64_t s = 0; s < g.nb / 8; s++) {
            const uint8_t *u = w + s * U;
            const __m256 D = r8_f16x8(u + kQ6D);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                __m256i c8[8];
                q6_codes_256(u, 2 * j, c8);
                q6_codes_256(u, 2 * j + 1, c8 + 4);
                const __m256i sa = q6_scales16(u, 2 * j), sb = q6_scales16(u, 2 * j + 1);
                if (j == 0) gemm_q6_rows<true, false>(c8, sa, sb, D, g, t0, n, 8 * s + j, isum, acc);
                else if (j < 7) gemm_q6_rows<false, false>(c8, sa, sb, D, g, t0, n, 8 * s + j, isum, acc);
                else gemm_q6_rows<false, true>(c8, sa, sb, D, g, t0, n, 8 * s + j, isum, acc);
            }
        }
    }
}

using GemmGroupFn = void (*)(const uint8_t *, const GemmAct &, int64_t, int64_t, float *, float *, float *);
void gemm_q8_0r8_group(const uint8_t *, const GemmAct &, int64_t, int64_t, float *, float *, float *);    // gemm_q8_0r8_256.h
inline GemmGroupFn gemm_group_fn(int qt) {
    switch (qt) {
    case Q8_0R8: return gemm_q8_0r8_group;
    case Q4_0R8: return gemm_r8_group<Q4_0R8>;
    case Q4_1R8: return gemm_r8_group<Q4_1R8>;
    case Q5_0R8: return gemm_r8_group<Q5_0R8>;
    case Q4_KR8: return gemm_r8_group<Q4_KR8>;
    case Q5_KR8: return gemm_r8_group<Q5_KR8>;
    case Q6_KR8: return gemm_r8_group<Q6_KR8>;
    }
    return nullptr;
}
inline bool gemm_has(int qt) { return gemm_group_fn(qt) != nullptr; }
#else
inline bool gemm_has(int) { return false; }
#endif

// Whether the GEMM takes this product: every part in an r8 layout it has (all_r8_groups), on a
// 256-bit build, from g_gemm_min_rows activation rows (fewer: the dots' 1-4-row passes; the same
// bits per row either way, so where the crossover sits never changes a row's result).
// Where it starts is measured per build (benchmarks/gemm_r8.py --crossover, one 1.7B-shaped layer, 2
// threads): avx2 on Zen 3, the GEMM 0.54-0.79x the dots' time from 8 rows; vnni256 on Zen 4, the dots
// faster up to 16 rows (GEMM / dots at 16: q4_0 1.14, q4_k 1.14, q8_0 1.05, q6_k 0.98), so there the
// GEMM takes 17 rows on. avxvnni (not measured on its CPUs) keeps 8. kGemmMinRows: the experts' pairs
// (moe/experts.h), 8 on every build.
constexpr int64_t kGemmMinRows = 8;
#if defined(PAGEDSERVE_DOTS256)                // vnni256
constexpr int64_t kDenseGemmMinRows = 17;
#else
constexpr int64_t kDenseGemmMinRows = kGemmMinRows;
#endif
int64_t g_gemm_min_rows = kDenseGemmMinRows;      // quant_gemm_r8_config (kernels/quant.py, benchmarks)
// (Never in the avx512vnni build: its one dense r8 layout, q4_1r8, has 512-bit dots of its own
// (dot_q4_1r8.h); only its mixture-of-experts layers run the GEMM, through moe/experts.h.)
bool gemm_r8_takes(const QuantPart *parts, int64_t nparts, int64_t T) {
#if defined(PS_DOTS512)
    (void)parts, (void)nparts, (void)T;
    return false;
#else
    if (T < g_gemm_min_rows) return false;
    for (int64_t p = 0; p < nparts; p++)
        if (!gemm_has(int(parts[p].qtype)) || parts[p].rows % 8) return false;
    return true;
#endif
}

#if defined(__AVX2__)
// put_out of 8 outputs at once (v: bias added), at element i of y: float32, or bf16 rounded as
// f32_to_bf16 (to nearest even, NaN kept quiet).
inline void put_out8(void *y, bool y_bf16, int64_t i, __m256 v) {
    if (!y_bf16) {
        _mm256_storeu_ps(static_cast<float *>(y) + i, v);
        return;
    }
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i even = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    const __m256i bits = _mm256_blendv_epi8(even, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    _mm_storeu_si128(reinterpret_cast<__m128i *>(static_cast<uint16_t *>(y) + i),
                     _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
}

// y = x @ W.T + bias through gemm_r8_group (gemm_r8_takes(parts) holds); `plan`: a LoRA handover.
int gemm_r8_linear(const QuantPart *parts, int64_t nparts, const void *x, int64_t ldx, bool x_bf16, int64_t T, int64_t K,
                   const float *bias, void *y, int64_t ldy, bool y_bf16, const Handover *plan) {
    const int64_t nb = K / 32;
    std::vector<GemmGroupFn> fn(nparts);
    std::vector<int64_t> first(nparts + 1, 0), row0(nparts, 0);     // each part's first group, first row
    bool offsets = false;
    for (int64_t p = 0; p < nparts; p++) {
        fn[p] = gemm_group_fn(int(parts[p].qtype));
        offsets |= parts[p].qtype == Q6_KR8;
        first[p + 1] = first[p] + parts[p].rows / 8;
        if (p + 1 < nparts) row0[p + 1] = row0[p] + parts[p].rows;
    }
    const Act act = thread_act(parts, nparts, T, K, false);
    GemmBuffers &b = t_gemm;
    GemmAct ga{fit(b.q, T * K), fit(b.d, T * nb), fit(b.ds, T * nb), offsets ? fit(b.o, 4 * T * nb) : nullptr, T, K, nb};
    b.fit_super(ga, act.qk != nullptr, T, K);
    const int64_t groups = first[nparts], ns = ga.qk != nullptr ? K / 256 : 0;
    const int64_t chunk = std::max<int64_t>(1, 256 / T);
#pragma omp parallel
    {
        const Act a = quantize_in_region(act, false, parts, nparts, T, false, x, ldx, x_bf16);
#pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < (a.blocks32 ? T * nb : 0); i++) gemm_relayout(a, ga, i);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < T * ns; i++) gemm_relayout_super(a, ga, i);
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
        PrefetchCursor ahead(plan, tid, nt);          // a LoRA delta's adapter weights (Handover)
        const int64_t share = (groups + nt - 1) / nt;       // a thread's groups, were they even
        const int64_t per_group = share > 0 ? (ahead.lines() + share - 1) / share : 0;
        alignas(64) float acc[kGemmTile * 8], mins[kGemmTile * 8];
        std::vector<float, Aligned64<float>> m(8 * nb);         // the group's minimum scales
        const __m256i order = r8_order();
        // Groups handed out as threads come free (a claim of `chunk` groups, ~256 row-groups of
        // work): the GEMM is compute-bound, and a static split left a thread waiting whenever the
        // other was slowed (the host's load) or its groups cost more (q6_k against q4_k a byte).
        // A group's rows are one thread's whoever takes it: the same bits.
#pragma omp for schedule(dynamic, chunk) nowait
        for (int64_t g = 0; g < groups; g++) {
            int64_t p = 0;
            while (g >= first[p + 1]) p++;
            const uint8_t *w = parts[p].w + (g - first[p]) * parts[p].ldw;
            const int64_t r = row0[p] + 8 * (g - first[p]);
            const int64_t qt = parts[p].qtype;
            const bool minus = qt != Q4_0R8 && qt != Q4_1R8 && qt != Q5_0R8;     // K types: acc - mins
            ahead.step(per_group);
            for (int64_t t0 = 0; t0 < T; t0 += kGemmTile) {
                const int64_t n = std::min(kGemmTile, T - t0);
                std::memset(acc, 0, sizeof(float) * 8 * n);
                std::memset(mins, 0, sizeof(float) * 8 * n);
                fn[p](w, ga, t0, n, acc, mins, m.data());
                const __m256 B = bias ? _mm256_loadu_ps(bias + r) : _mm256_setzero_ps();
                for (int64_t t = 0; t < n; t++) {
                    const __m256 A = _mm256_load_ps(acc + 8 * t), M = _mm256_load_ps(mins + 8 * t);
                    const __m256 v = _mm256_add_ps(_mm256_permutevar8x32_ps(minus ? _mm256_sub_ps(A, M) : _mm256_add_ps(A, M), order), B);
                    put_out8(y, y_bf16, (t0 + t) * ldy + r, v);
                }
            }
        }
        run_after(plan);
    }
    return 0;
}
#else
int gemm_r8_linear(const QuantPart *, int64_t, const void *, int64_t, bool, int64_t, int64_t, const float *, void *, int64_t,
                   bool, const Handover *) {
    return 1;
}
#endif
}  // namespace

// The fewest activation rows the r8 GEMM takes (fewer: the dots); returns the previous value.
// min_rows <= 0: only returns it.
extern "C" int64_t quant_gemm_r8_config(int64_t min_rows) {
    const int64_t previous = g_gemm_min_rows;
    if (min_rows > 0) g_gemm_min_rows = min_rows;
    return previous;
}
