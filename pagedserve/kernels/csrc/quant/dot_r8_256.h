// The r8 layouts' dots on 256-bit registers (AVX2, AVX-VNNI) and in plain C++ (scalar, and the
// avx512vnni build's Q4_0R8 / Q8_0R8): 8 weight rows interleaved per block (quant.repack; see
// QType's Q4_1R8, Q4_0R8, Q8_0R8 and repack_r8.h) against NT activation rows. A unit is one
// 32-element block of 8 rows: their 8 fp16 d (q4_1: then their 8 fp16 m), then vectors of 64 bytes
// whose byte 8 l + i of vector k is row l's qs[8 k + i] (q4_0, q4_1: two vectors, elements 8 k + i
// low nibble, 16 + 8 k + i high; q8_0: four, element 8 k + i). Q5_0R8: q4_0r8 with the 8 rows'
// 32-bit qh after the d (row l's at 16 + 4 l), bit e of it element e's fifth bit, offset 16.
// A 256-bit register holds half a vector: 8 bytes of each of 4 rows, against an 8-byte broadcast of
// the activations, so a dot's lanes 2 l', 2 l' + 1 are row l' of that half; one hadd of the two
// halves' dots gives the 8 rows in lanes (0, 1, 4, 5, 2, 3, 6, 7), where the unit's scales are
// permuted once to meet them: per unit and activation row one conversion, one multiply-add by
// d * dx and (q4_0, q4_1, q5_0) one by the minimum term (q4_0: -8 d, q5_0: -16 d, with dx * sum(q)), no per-row
// reduction. Each activation row's arithmetic is the same whatever NT or the rows around it
// (batch invariance): per row l, over the blocks j in order,
//     acc = fma(float(dot_j), d_j * dx_j, acc);  mins = fma(m_j, ds_j, mins);  y = acc + mins
// which r8_group_ref spells out in plain C++ (the scalar build's kernel, and the reference the
// vector kernels equal bit for bit: the integer dots are exact).
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {

// The codes of row l, block unit u, element e (q4_0, q5_0: without their offsets 8, 16, which the
// minimum term takes).
inline int r8_code(int qt, const uint8_t *u, int l, int e) {
    const uint8_t *v = u + r8_codes_at(qt);
    if (qt == Q8_0R8) return int8_t(v[64 * (e / 8) + 8 * l + e % 8]);
    const int i = e % 16;
    const uint8_t q = v[64 * (i / 8) + 8 * l + i % 8];
    const int high = qt == Q5_0R8 ? (u[16 + 4 * l + e / 8] >> (e % 8) & 1) << 4 : 0;      // qh's bit e
    return (e < 16 ? q & 15 : q >> 4) | high;
}

// The reference: out[t * ldo + l] = row l of the group at g (nb blocks) against activation row
// t0 + t, the arithmetic above in plain C++ (std::fma: the vector kernels' fused multiply-adds).
template <int QT, int NT>
void r8_group_ref(const uint8_t *g, int64_t nb, const Act &a, int64_t t0, float *out, int64_t ldo) {
    for (int t = 0; t < NT; t++)
        for (int l = 0; l < 8; l++) {
            float acc = 0.f, mins = 0.f;
            for (int64_t j = 0; j < nb; j++) {
                const uint8_t *u = g + j * r8_unit_bytes(QT);
                const int8_t *x = a.q + (t0 + t) * a.K + 32 * j;
                int dot = 0;
                for (int e = 0; e < 32; e++) dot += r8_code(QT, u, l, e) * x[e];
                const float d = f16(u + 2 * l), dx = a.d[(t0 + t) * a.nb + j], ds = a.ds[(t0 + t) * a.nb + j];
                acc = std::fma(float(dot), d * dx, acc);
                if constexpr (QT == Q4_1R8) mins = std::fma(f16(u + 16 + 2 * l), ds, mins);
                if constexpr (QT == Q4_0R8) mins = std::fma(d * -8.f, ds, mins);
                if constexpr (QT == Q5_0R8) mins = std::fma(d * -16.f, ds, mins);
            }
            out[t * ldo + l] = acc + mins;
        }
}

#if defined(__AVX2__)
// The group's stream, fetched ahead by software at T = 1 (the dots alone keep too few misses in
// flight: without it they ran 0.85x). Each unit asks for its own bytes r8_ahead(QT) further on:
// q8_0r8 and mxfp4r8 2 KiB ahead into L1 (prefetcht0, Zen 3's best; prefetcht2 far ahead was no
// faster for q8_0r8 on Zen 4; mxfp4r8's not measured), the other layouts far ahead with prefetcht2.
// On Zen 4 (benchmarks/r8_stream.py, 2 / 1 threads) that streamed q6_kr8 1.33x / 2.1x as fast as 2
// KiB of prefetcht0 (at 16 KiB), q4_0r8 1.12x / 1.3x, q4_kr8 1.07x / 1.26x; prefetcht0 at 4 KiB,
// or prefetcht2 at 2 KiB, gained nothing.
constexpr int64_t kR8Ahead = 2048;     // bytes ahead into L1: q8_0r8's and mxfp4r8's distance
constexpr int64_t kR8Far = 8192;       // bytes ahead with prefetcht2: the other layouts' (q6_kr8: 3x, 1.04-1.09x over 2x at 2 threads)
constexpr bool r8_near(int qt) { return qt == Q8_0R8 || qt == MXFP4R8; }
constexpr int64_t r8_ahead(int qt) { return r8_near(qt) ? kR8Ahead : qt == Q6_KR8 ? 3 * kR8Far : kR8Far; }
constexpr _mm_hint r8_hint(int qt) { return r8_near(qt) ? _MM_HINT_T0 : _MM_HINT_T2; }
// (Unrolled: GCC left a q6_kr8 unit's 27 prefetches and a q4_kr8 unit's 18 as a loop, whose counting
// cost their dots 7-8% over a weight in L2 on Zen 4, 1 thread: benchmarks/r8_stream.py --ab-source.
// The 32-element layouts' few were unrolled already.)
template <int QT>
inline void r8_prefetch_unit(const uint8_t *u) {       // the lines of unit u's bytes r8_ahead(QT) on
    constexpr int64_t U = r8_unit_bytes(QT);
#pragma GCC unroll 32
    for (int64_t l = 0; l < U; l += 64) _mm_prefetch(reinterpret_cast<const char *>(u + r8_ahead(QT) + l), r8_hint(QT));
}

// acc + the 8 int32 lanes of 4 rows' 8 unsigned codes (u) times 8 signed activations (s) per row
inline __m256i dp4(__m256i acc, __m256i u, __m256i s) {
#if defined(PS_VNNI256)
    return dpbusd256(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// One half (rows 4 h .. 4 h + 3) of a q4 (or q5_0) unit: its low and high nibbles of vectors 0, 1 against
// the activations' four 8-byte broadcasts x[0..3] (elements 0-7, 8-15, 16-23, 24-31).
inline __m256i q4_half(const __m256i c[4], const __m256i x[4]) {
#if defined(PS_VNNI256)
    return dpbusd256(
        dpbusd256(
            dpbusd256(dpbusd256(_mm256_setzero_si256(), c[0], x[0]), c[1], x[1]), c[2],
            x[2]),
        c[3], x[3]);
#else
    // four products of codes <= 31 (q5_0's) and |q| <= 127 in 16 bits: |sum| <= 4 * 2 * 31 * 127 < 32768
    const __m256i s = _mm256_add_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(c[0], x[0]), _mm256_maddubs_epi16(c[1], x[1])),
                                       _mm256_add_epi16(_mm256_maddubs_epi16(c[2], x[2]), _mm256_maddubs_epi16(c[3], x[3])));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
#endif
}

template <int QT, int NT>
void r8_group_256(const uint8_t *g, int64_t nb, const Act &a, int64_t t0, float *out, int64_t ldo) {
    constexpr int64_t U = r8_unit_bytes(QT);
    constexpr int C = r8_codes_at(QT);
    const __m256i order = r8_order();
    __m256 acc[NT], mins[NT];
    for (int t = 0; t < NT; t++) acc[t] = mins[t] = _mm256_setzero_ps();
    const int8_t *xr = a.q + t0 * a.K;
    const float *dr = a.d + t0 * a.nb, *dsr = a.ds + t0 * a.nb;
    for (int64_t j = 0; j < nb; j++) {
        const uint8_t *u = g + j * U;
        r8_prefetch_unit<QT>(u);
        const __m256 A = r8_f16x8(u);
        __m256 M = _mm256_setzero_ps();
        if constexpr (QT == Q4_1R8) M = r8_f16x8(u + 16);
        if constexpr (QT == Q4_0R8) M = _mm256_mul_ps(A, _mm256_set1_ps(-8.f));
        if constexpr (QT == Q5_0R8) M = _mm256_mul_ps(A, _mm256_set1_ps(-16.f));
        if constexpr (QT == Q8_0R8) {
            // signed codes: |w| (unsigned) times q with w's sign; |w| <= 128, |q| <= 127: one pair fits 16 bits
            __m256i w[2][4], aw[2][4];
            for (int h = 0; h < 2; h++)
                for (int k = 0; k < 4; k++) {
                    w[h][k] = r8_load(u + C + 64 * k + 32 * h);
                    aw[h][k] = _mm256_sign_epi8(w[h][k], w[h][k]);
                }
            for (int t = 0; t < NT; t++) {
                const int8_t *x = xr + t * a.K + 32 * j;
                __m256i dot[2];
                for (int h = 0; h < 2; h++) {
                    dot[h] = _mm256_setzero_si256();
                    for (int k = 0; k < 4; k++) {
                        int64_t x8;
                        std::memcpy(&x8, x + 8 * k, 8);
                        dot[h] = dp4(dot[h], aw[h][k], _mm256_sign_epi8(_mm256_set1_epi64x(x8), w[h][k]));
                    }
                }
                const __m256 S = _mm256_mul_ps(A, _mm256_set1_ps(dr[t * a.nb + j]));
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_hadd_epi32(dot[0], dot[1])), S, acc[t]);
            }
        } else {
            __m256i c[2][4];       // per half: vector 0 low, vector 1 low, vector 0 high, vector 1 high
            q4_unit_codes<QT>(u, c);
            for (int t = 0; t < NT; t++) {
                const int8_t *x = xr + t * a.K + 32 * j;
                int64_t x8[4];
                std::memcpy(x8, x, 32);
                const __m256i xb[4] = {_mm256_set1_epi64x(x8[0]), _mm256_set1_epi64x(x8[1]), _mm256_set1_epi64x(x8[2]),
                                       _mm256_set1_epi64x(x8[3])};
                const __m256i dot = _mm256_hadd_epi32(q4_half(c[0], xb), q4_half(c[1], xb));
                const __m256 S = _mm256_mul_ps(A, _mm256_set1_ps(dr[t * a.nb + j]));
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), S, acc[t]);
                mins[t] = _mm256_fmadd_ps(M, _mm256_set1_ps(dsr[t * a.nb + j]), mins[t]);
            }
        }
    }
    for (int t = 0; t < NT; t++)
        _mm256_storeu_ps(out + t * ldo, _mm256_permutevar8x32_ps(_mm256_add_ps(acc[t], mins[t]), order));
}
#endif

// The kernel of this build for layout qt and NT (1..4) activation rows a pass (null: none here).
using R8GroupFn = void (*)(const uint8_t *, int64_t, const Act &, int64_t, float *, int64_t);
template <int QT>
R8GroupFn r8_group_fn(int nt) {
#if defined(__AVX2__)
    constexpr R8GroupFn fns[5] = {nullptr, r8_group_256<QT, 1>, r8_group_256<QT, 2>, r8_group_256<QT, 3>,
                                  r8_group_256<QT, 4>};
#else
    constexpr R8GroupFn fns[5] = {nullptr, r8_group_ref<QT, 1>, r8_group_ref<QT, 2>, r8_group_ref<QT, 3>,
                                  r8_group_ref<QT, 4>};
#endif
    return nt >= 1 && nt <= 4 ? fns[nt] : nullptr;
}
}  // namespace
