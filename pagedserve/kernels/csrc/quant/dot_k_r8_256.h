// The super-block r8 layouts' dots (Q4_KR8, Q5_KR8, Q6_KR8: 8 weight rows interleaved per
// super-block, repack_r8.h's fields) on 256-bit registers (AVX2, AVX-VNNI) and in plain C++ (the
// scalar build's kernel and the reference the vector ones equal bit for bit), against NT activation
// rows. As dot_r8_256.h: a ymm holds 8 bytes of 4 rows; a hadd of the two halves' dots gives the 8
// rows in lanes (0, 1, 4, 5, 2, 3, 6, 7), where the unit's scales are permuted once to meet them
// (q6_k: 4 bytes of all 8 rows a ymm, each row's sums in its own dword, permuted once at the end).
// All three read the super-block activations (Act::qk, dk, bsk: one scale dx = dk_s per 256;
// reads_super). Per row l, over the super-blocks s in order:
//     q4_k, q5_k: isum = sum_j sc_j * dot_j,  msum = sum_j m_j * bs_j   (integers; bs_j: sub-block j's code sum)
//                 acc = fma(float(isum), d * dx, acc);  mins = fma(float(msum), dmin * dx, mins);  y = acc - mins
//                 (dot_j: the unsigned codes times the q8 values; |isum| <= 256 * 31 * 127 * 63 and |msum| <=
//                 256 * 127 * 63 < 2^31): the sub-block scales meet the codes' 16-bit sums in a madd
//                 (k_dot_half), each half's dwords summed over the super-block, one hadd at its end.
//     q6_k:       acc = fma(float(sum_i sc_i * (dot_i - 32 * bsk_i)), d * dx, acc);  y = acc
//                 (dot_i: the 16 unsigned codes q of sub-block i times the q8 values, bsk_i their sum)
// The integers are exact; a row's arithmetic is the same whatever NT or the rows around it.
// Unit offsets (bytes): q4_k: d 0, dmin 16, scale words 32 (word w of row l at 32 + 32 w + 4 l),
// qs 128 (vector k: 64 bytes, byte 8 l + i row l's qs[8 k + i]); q5_k: the same, qh at 128 (4
// vectors), qs at 384; q6_k: scales 0 (row l's sc[i] at 8 i + l), d 128, then 4 chunks of qh, ql, ql
// vectors of 32 bytes (byte 4 l + i: row l's byte i of a 4-byte piece) from 144 (unpack_r8_256.h).
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {

// The codes of row l's super-block b (file layout): c[256] (q6_k: q - 32), and its scales.
inline void k_codes(int file, const uint8_t *b, int c[256], int sc[16], int mn[8]) {
    if (file == Q6_K) {
        for (int e = 0; e < 256; e++) {
            const int h = e / 128, k = e % 128 / 32, l = e % 32;
            const int lo = (b[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 15;
            const int hi = (b[128 + 32 * h + l] >> (2 * k)) & 3;
            c[e] = (lo | (hi << 4)) - 32;
        }
        for (int i = 0; i < 16; i++) sc[i] = int8_t(b[192 + i]);
        return;
    }
    k_scales(b + 4, sc, mn);
    const uint8_t *qs = b + (file == Q4_K ? 16 : 48);
    for (int e = 0; e < 256; e++) {
        const int j = e / 32, l = e % 32;
        c[e] = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
        if (file == Q5_K) c[e] |= ((b[16 + l] >> j) & 1) << 4;
    }
}

// The reference: out[t * ldo + l] = row l of the group at g (nb blocks of 32) against activation
// row t0 + t, the arithmetic above in plain C++ (std::fma: the vector kernels' fused multiply-adds).
// (q4_k, q5_k: a test that applies one sub-block's scale in float instead fails, test_quant_r8_256.py)
template <int QT, int NT>
void rk8_group_ref(const uint8_t *g, int64_t nb, const Act &a, int64_t t0, float *out, int64_t ldo) {
    constexpr int file = r8_file_type(QT);
    constexpr int64_t U = r8_unit_bytes(QT);
    for (int l = 0; l < 8; l++) {
        float acc[NT] = {}, mins[NT] = {};
        for (int64_t s = 0; s < nb / 8; s++) {
            uint8_t b[256];
            r8_block(QT, g + s * U, l, b);
            int c[256], sc[16], mn[8];
            k_codes(file, b, c, sc, mn);
            const float d = f16(file == Q6_K ? b + 208 : b), dmin = file == Q6_K ? 0.f : f16(b + 2);
            for (int t = 0; t < NT; t++) {
                const int8_t *x = a.qk + (t0 + t) * a.K + 256 * s;
                const int16_t *bs = a.bsk + (t0 + t) * (a.K / 16) + 16 * s;
                const float dx = a.dk[(t0 + t) * (a.K / 256) + s];
                if constexpr (file == Q6_K) {
                    int dot = 0;        // |dot| <= 256 * 63 * 127 * 128 < 2^31 (q's part; the offset's smaller)
                    for (int i = 0; i < 16; i++) {
                        int q = 0;      // the unsigned codes c + 32 of sub-block i times x, the offset by bsk
                        for (int e = 16 * i; e < 16 * i + 16; e++) q += (c[e] + 32) * x[e];
                        dot += sc[i] * q - sc[i] * 32 * bs[i];
                    }
                    acc[t] = std::fma(float(dot), d * dx, acc[t]);
                } else {
                    int isum = 0, msum = 0;
                    for (int j = 0; j < 8; j++) {
                        int dot = 0;
                        for (int e = 0; e < 32; e++) dot += c[32 * j + e] * x[32 * j + e];
                        isum += sc[j] * dot;
                        msum += mn[j] * (bs[2 * j] + bs[2 * j + 1]);
                    }
                    acc[t] = std::fma(float(isum), d * dx, acc[t]);
                    mins[t] = std::fma(float(msum), dmin * dx, mins[t]);
                }
            }
        }
        for (int t = 0; t < NT; t++) out[t * ldo + l] = acc[t] - mins[t];
    }
}

#if defined(__AVX2__)
// Row t's 16-sums bsk_2j, bsk_2j+1 of super-block s as the int16 halves of every dword.
inline __m256i q6_bsk_pair(const Act &a, int64_t t, int64_t s, int j) {
    int32_t p;
    std::memcpy(&p, a.bsk + t * (a.K / 16) + 16 * s + 2 * j, sizeof p);
    return _mm256_set1_epi32(p);
}

// Q6_KR8 super-block s of unit u against rows t0 .. t0 + NT - 1 of the super-block activations
// (a.qk, dk, bsk), a 16-element group i of the 8 rows at a time (q6_codes_256: 4 codes of each row a
// register, row l's sums in dword l, no hadd), dot = sum_i sc_i * (dot_i - 32 * bsk_i) per row, then
// one conversion and one fma: acc = fma(float(dot), d * dk, acc) (the rows permuted into D's order).
// PS_VNNI256: the group's 4 vpdpbusd start from -32 * bsk_i (a madd of the pair's broadcast), then
// one vpmulld by the rows' int32 scales (|sc_i * (dot_i - 32 bsk_i)| <= 128 * 16 * 32 * 127).
// AVX2: two 16-bit sums of 4 products a row's dword (<= 4 * 63 * 127 = 32004), each madd by the
// scale in both halves; the offset at the end: 8 madds of the rows' scale pairs against (bsk_2j,
// bsk_2j+1). |dot| <= 256 * 63 * 127 * 128 < 2^31 (the q part; the offset part <= 256 * 32 * 127 * 128).
template <int NT>
inline void q6_super_256(const uint8_t *u, __m256 D, const Act &a, int64_t t0, int64_t s, __m256 acc[NT]) {
    __m256i sum[NT];
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) sum[t] = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int g = 0; g < 16; g++) {      // chunk by chunk (the unit's order): its 4 groups, one a qh bit pair
        const int n = g / 8, b = g / 4 % 2, r = g % 4, i = 8 * n + 2 * r + b;
        __m256i c[4];
        q6_codes_256(u, i, c);
#if defined(PS_VNNI256)
        const __m256i sc = q6_scales32(u, i);
        const __m256i neg32 = _mm256_set1_epi32(b ? int32_t(0xFFE00000u) : 0xFFE0);     // -32 in bsk_i's half
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            const int8_t *x = a.qk + (t0 + t) * a.K + 256 * s + 16 * i;
            __m256i d = _mm256_madd_epi16(q6_bsk_pair(a, t0 + t, s, i / 2), neg32);
#pragma GCC unroll 4
            for (int m = 0; m < 4; m++) d = dpbusd256(d, c[m], bcast4(x + 4 * m));
            sum[t] = _mm256_add_epi32(sum[t], _mm256_mullo_epi32(d, sc));
        }
#else
        const __m256i sc = q6_scales16(u, i);
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            const int8_t *x = a.qk + (t0 + t) * a.K + 256 * s + 16 * i;
            const __m256i lo = _mm256_add_epi16(_mm256_maddubs_epi16(c[0], bcast4(x)), _mm256_maddubs_epi16(c[1], bcast4(x + 4)));
            const __m256i hi = _mm256_add_epi16(_mm256_maddubs_epi16(c[2], bcast4(x + 8)), _mm256_maddubs_epi16(c[3], bcast4(x + 12)));
            sum[t] = _mm256_add_epi32(sum[t], _mm256_add_epi32(_mm256_madd_epi16(lo, sc), _mm256_madd_epi16(hi, sc)));
        }
#endif
    }
#if !defined(PS_VNNI256)
    __m256i off[NT];
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) off[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        const __m256i pairs = q6_scale_pairs(u, j);
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) off[t] = _mm256_add_epi32(off[t], _mm256_madd_epi16(pairs, q6_bsk_pair(a, t0 + t, s, j)));
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) sum[t] = _mm256_sub_epi32(sum[t], _mm256_slli_epi32(off[t], 5));
#endif
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) {
        const __m256i dot = _mm256_permutevar8x32_epi32(sum[t], r8_order());     // rows into D's (the hadd's) order
        const __m256 S = _mm256_mul_ps(D, _mm256_set1_ps(a.dk[(t0 + t) * (a.K / 256) + s]));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), S, acc[t]);
    }
}

template <int QT, int NT>
void rk8_group_256(const uint8_t *g, int64_t nb, const Act &a, int64_t t0, float *out, int64_t ldo) {
    constexpr int64_t U = r8_unit_bytes(QT);
    __m256 acc[NT], mins[NT];
    #pragma GCC unroll 8
    for (int t = 0; t < NT; t++) acc[t] = mins[t] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nb / 8; s++) {
        const uint8_t *u = g + s * U;
        r8_prefetch_unit<QT>(u);
        if constexpr (QT == Q6_KR8) {
            q6_super_256<NT>(u, r8_f16x8(u + kQ6D), a, t0, s, acc);      // (Act::qk: reads_super)
        } else {
            const __m256 D = r8_f16x8(u), Dm = r8_f16x8(u + 16);
            KSuper ks;
            k_super_scales(u, ks);
            __m256i isum[NT][2];             // per half: two dwords a row, summed over the super-block
            #pragma GCC unroll 8
            for (int t = 0; t < NT; t++) isum[t][0] = isum[t][1] = _mm256_setzero_si256();
            #pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {    // sub-blocks 2 p (low nibbles) and 2 p + 1 (high: the vectors again, from L1)
                __m256i c[2][4];             // [half][piece]
                if constexpr (QT == Q4_KR8) {        // one register a row set (k_dot8_q4), the hadd's order
                    const __m256i L = k_pair_lanes(ks, j);
                    // vpdpbusd: sub-block 2 p + 1's high nibbles in place (16 q: no shift a vector)
                    const bool high16 = kHigh16 && j % 2 == 1;
                    if (high16) k4_high16_256(u, j / 2, c);
                    else k_codes_256<QT>(u, j, c);
                    #pragma GCC unroll 8
                    for (int t = 0; t < NT; t++) {
                        const int8_t *x = a.qk + (t0 + t) * a.K + 256 * s + 32 * j;
                        isum[t][0] = _mm256_add_epi32(isum[t][0], high16 ? k_dot8_q4<true>(c, x, L) : k_dot8_q4(c, x, L));
                    }
                } else {
                    k_codes_256<QT>(u, j, c);
                    const __m256i l0 = k_lanes(ks, j, 0), l1 = k_lanes(ks, j, 1);
                    #pragma GCC unroll 8
                    for (int t = 0; t < NT; t++) {
                        const int8_t *x = a.qk + (t0 + t) * a.K + 256 * s + 32 * j;
                        const __m256i xb[4] = {bcast8(x), bcast8(x + 8), bcast8(x + 16), bcast8(x + 24)};
                        isum[t][0] = _mm256_add_epi32(isum[t][0], k_dot_half(c[0], xb, l0));
                        isum[t][1] = _mm256_add_epi32(isum[t][1], k_dot_half(c[1], xb, l1));
                    }
                }
            }
            #pragma GCC unroll 8
            for (int t = 0; t < NT; t++) {
                const __m256 dx = _mm256_set1_ps(a.dk[(t0 + t) * (a.K / 256) + s]);
                const __m256i msum = k_min_sum(ks, a.bsk + (t0 + t) * (a.K / 16) + 16 * s);
                const __m256i rows = QT == Q4_KR8 ? isum[t][0] : _mm256_hadd_epi32(isum[t][0], isum[t][1]);
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(rows), _mm256_mul_ps(D, dx), acc[t]);
                mins[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(Dm, dx), mins[t]);
            }
        }
    }
    #pragma GCC unroll 8
    for (int t = 0; t < NT; t++)
        _mm256_storeu_ps(out + t * ldo, _mm256_permutevar8x32_ps(_mm256_sub_ps(acc[t], mins[t]), r8_order()));
}
#endif

// The kernel of this build for super-block r8 layout QT and NT (1..4) activation rows a pass.
template <int QT>
R8GroupFn rk8_group_fn(int nt) {
#if defined(__AVX2__)
    constexpr R8GroupFn fns[5] = {nullptr, rk8_group_256<QT, 1>, rk8_group_256<QT, 2>, rk8_group_256<QT, 3>,
                                  rk8_group_256<QT, 4>};
#else
    constexpr R8GroupFn fns[5] = {nullptr, rk8_group_ref<QT, 1>, rk8_group_ref<QT, 2>, rk8_group_ref<QT, 3>,
                                  rk8_group_ref<QT, 4>};
#endif
    return nt >= 1 && nt <= 4 ? fns[nt] : nullptr;
}

// The kernel of this build for r8 layout qt (any) and NT (1..4) activation rows a pass (null: none here).
inline R8GroupFn r8_group_fn(int qt, int nt) {
    switch (qt) {
    case Q4_0R8: return r8_group_fn<Q4_0R8>(nt);
    case Q4_1R8: return r8_group_fn<Q4_1R8>(nt);
    case Q8_0R8: return r8_group_fn<Q8_0R8>(nt);
    case Q5_0R8: return r8_group_fn<Q5_0R8>(nt);
    case Q4_KR8: return rk8_group_fn<Q4_KR8>(nt);
    case Q5_KR8: return rk8_group_fn<Q5_KR8>(nt);
    case Q6_KR8: return rk8_group_fn<Q6_KR8>(nt);
    case MXFP4R8: return mxfp4_r8_group_fn(nt);       // (dot_mxfp4_r8_256.h)
    }
    return nullptr;
}

}  // namespace
