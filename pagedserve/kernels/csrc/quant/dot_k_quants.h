// Q4_K / Q5_K / Q6_K (and Q4_0X) super-block dots on AVX-512 VNNI (superblock).
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {
#if defined(__AVX2__)
#if defined(PS_DOTS512)
template <int QT, int NT>
inline void superblock(Acc<NT> &acc, const Act &a, const int8_t *q0, const float *d0, const float *ds0,
                       int64_t t0, int64_t e0, const uint8_t *b) {
    if constexpr (QT == Q4_K || QT == Q5_K) {
        // k_scale_bytes in one register: the 12 bytes a, b, c (4 each) as [a c b c] and [0 a 0 b];
        // bytes [a & 63 | c & 15 | b & 63 | c >> 4 & 15] | ([0 a 0 b] >> 2 & 48): [sc (8) | mn (8)]
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b + 4));
        const __m128i acbc = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
        const __m128i high = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
        const __m128i low = _mm_and_si128(_mm_mask_srli_epi16(acbc, 0xC0, acbc, 4),
                                          _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15));
        const __m128i scmn = _mm_or_si128(low, _mm_and_si128(_mm_srli_epi16(high, 2), _mm_set1_epi8(48)));
        // [d * sc (8) | dmin * mn (8)] in one conversion and one multiply
        uint32_t dd;
        std::memcpy(&dd, b, 4);
        const __m512 dmin = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                                  _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(int(dd)))));
        const __m512 AC = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(scmn)));
        const __m256 A = _mm512_castps512_ps256(AC);
        const __m256 C = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(AC), 1));   // dmin * mn
        __m256 S[NT];                      // A * dx of the 8 sub-blocks, per activation row
        // q4_k: the high nibbles are taken in place (16 times the code: one AND, no shift), so the odd
        // sub-blocks' scales are divided by 16 (exact: a power of two), the same products
        const __m256 unit = QT == Q4_K ? _mm256_setr_ps(1.f, 1.f / 16, 1.f, 1.f / 16, 1.f, 1.f / 16, 1.f, 1.f / 16)
                                       : _mm256_set1_ps(1.f);
        for (int t = 0; t < NT; t++) {
            S[t] = _mm256_mul_ps(A, _mm256_loadu_ps(d0 + t * a.nb));
            if constexpr (QT == Q4_K) S[t] = _mm256_mul_ps(S[t], unit);
            acc.m8[t] = _mm256_fnmadd_ps(C, _mm256_loadu_ps(ds0 + t * a.nb), acc.m8[t]);
        }
        const uint8_t *qs = b + (QT == Q4_K ? 16 : 48);
        const __m512i nibbles = _mm512_inserti64x4(_mm512_set1_epi8(15), _mm256_set1_epi8(char(0xF0)), 1);
        const __m512i m4 = _mm512_set1_epi8(15);
        const __m512i qh2 = QT == Q5_K ? _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 16)))
                                       : _mm512_setzero_si512();     // q5_k's qh in both halves
        for (int c = 0; c < 4; c++) {      // sub-blocks 2c (low nibbles) and 2c+1 (high) of 32 bytes
            // the 32 bytes in both halves (a broadcast load), the upper half shifted: [low | high nibbles]
            __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(qs + 32 * c)));
            if constexpr (QT == Q4_K) raw = _mm512_and_si512(raw, nibbles);     // [low | 16 x high]
            else raw = _mm512_and_si512(_mm512_mask_srli_epi16(raw, 0xFFFF0000u, raw, 4), m4);
            if constexpr (QT == Q5_K) {    // fifth bits: bit 2c of qh (low half), 2c + 1 (high half), as a mask
                const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8(char(1 << (2 * c))),
                                                       _mm256_set1_epi8(char(1 << (2 * c + 1))), 1);
                raw = _mm512_mask_add_epi8(raw, _mm512_test_epi8_mask(qh2, bit), raw, _mm512_set1_epi8(16));
            }
            const __m512i spread = _mm512_setr_epi32(2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c,
                                                     2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1,
                                                     2 * c + 1, 2 * c + 1, 2 * c + 1);
            for (int t = 0; t < NT; t++)
                acc.w[t] = _mm512_fmadd_ps(dot64(raw, q0 + t * a.K + 64 * c),
                                           _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(S[t])), acc.w[t]);
        }
    } else if constexpr (QT == Q4_0X) {
        // Per activation row: two dots of low nibbles and two of high ones (masked in place: 16 times
        // the code, taken off by a shift of the exact int32 sums); lanes 2l, 2l + 1 are block l's, so
        // one conversion and one multiply-add by d_l * dx_l (spread) for the 8 blocks; the offset 8
        // as the minimum term -8 d_l * ds_l, 8 wide.
        const __m512i v0 = _mm512_loadu_si512(b + 16), v1 = _mm512_loadu_si512(b + 80);
        const __m512i m4 = _mm512_set1_epi8(15), h4 = _mm512_set1_epi8(char(0xF0));
        const __m512i lo0 = _mm512_and_si512(v0, m4), lo1 = _mm512_and_si512(v1, m4);
        const __m512i hi0 = _mm512_and_si512(v0, h4), hi1 = _mm512_and_si512(v1, h4);
        const __m256 A = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(b)));
        const __m256 C = _mm256_mul_ps(A, _mm256_set1_ps(-8.f));
        const __m512i spread = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        for (int t = 0; t < NT; t++) {
            const int8_t *x = a.qx + (t0 + t) * a.K + e0;
            const __m512i lo = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo0, _mm512_load_si512(x)),
                                                   lo1, _mm512_load_si512(x + 128));
            const __m512i hi = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), hi0, _mm512_load_si512(x + 64)),
                                                   hi1, _mm512_load_si512(x + 192));
            const __m512i dot = _mm512_add_epi32(lo, _mm512_srai_epi32(hi, 4));
            const __m256 S = _mm256_mul_ps(A, _mm256_loadu_ps(d0 + t * a.nb));
            acc.w[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(S)),
                                       acc.w[t]);
            acc.m8[t] = _mm256_fmadd_ps(C, _mm256_loadu_ps(ds0 + t * a.nb), acc.m8[t]);
        }
    } else if constexpr (QT == Q6_K) {
        // d * scale of the 16 groups of 16, times dx of their 32-element block, per row.
        const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b + 192));
        const __m512 dsc =
            _mm512_mul_ps(_mm512_set1_ps(f16(b + 208)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(scales)));
        const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        __m512 S[NT];
        for (int t = 0; t < NT; t++)
            S[t] = _mm512_mul_ps(
                dsc, _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_loadu_ps(d0 + t * a.nb))));
        const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
        for (int h = 0; h < 2; h++) {
            const __m512i L = _mm512_loadu_si512(b + 64 * h);   // ql: elements 128h + [0, 64) low, [64, 128) high
            const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 128 + 32 * h));
            // Q: bits 4-5 of each byte are the two high bits of half 1's elements (qh's fields 2, 3);
            // Q << 4 has those of half 0 there (fields 0, 1); low | (that & 0x30) in one ternary op.
            const __m512i Q = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
            for (int half = 0; half < 2; half++) {   // elements 128h + 64 half + [0, 64): 4 groups of 16
                const __m512i high = _mm512_and_si512(half ? Q : _mm512_slli_epi16(Q, 4), m30);
                // (low nibble of L or L >> 4) | high: imm 0xEA = (A & B) | C with A the nibbles, B = 15, C = high
                const __m512i codes =
                    _mm512_ternarylogic_epi32(half ? _mm512_srli_epi16(L, 4) : L, m4, high, 0xEA);   // unsigned; 32 via ls
                const int g = 8 * h + 4 * half;
                const __m512i spread = _mm512_setr_epi32(g, g, g, g, g + 1, g + 1, g + 1, g + 1, g + 2, g + 2, g + 2,
                                                         g + 2, g + 3, g + 3, g + 3, g + 3);
                for (int t = 0; t < NT; t++) {
                    const int64_t e = 128 * h + 64 * half;
                    const __m512i dot = _mm512_dpbusd_epi32(offset_start<QT, NT>(a, t0 + t, e0 + e), codes,
                                                            _mm512_loadu_si512(q0 + t * a.K + e));
                    acc.w[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(spread, S[t]), acc.w[t]);
                }
            }
        }
    }
}
#endif
#endif
}  // namespace
