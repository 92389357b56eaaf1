// The 32-element types' dots on AVX2 / AVX-VNNI, 8 blocks at a time (group8).
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {
#if defined(__AVX2__)

#if !(defined(PS_DOTS512))
// The codes of one 32-element block as decode<QT> gives them (signed where the type has an offset).
template <int QT>
inline __m256i codes32(const uint8_t *b) {
    if constexpr (QT == Q8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 2));
    else if constexpr (QT == Q4_0) return _mm256_sub_epi8(nibbles16(b + 2), _mm256_set1_epi8(8));
    else if constexpr (QT == Q4_1) return nibbles16(b + 4);
    else if constexpr (QT == Q5_0)
        return _mm256_sub_epi8(_mm256_or_si256(nibbles16(b + 6), bits32(b + 2)), _mm256_set1_epi8(16));
    else return _mm256_or_si256(nibbles16(b + 8), bits32(b + 4));
}

// Eight 32-element blocks (b0 and the 7 after it) against one or two activation rows (AVX2 /
// AVX-VNNI): the blocks' fp16 d (and m) in one gather, converted and multiplied by the 8 dx at
// once, the minimum terms as one 8-wide multiply-add; per block one dot, one conversion, one
// spread and one multiply-add, in two chains.
template <int QT, int NT>
inline void group8(Acc<NT> &acc, const Act &a, const int8_t *q0, const float *d0, const float *ds0,
                   const uint8_t *b0) {
    constexpr int B = int(kBytes[QT]);
    const __m256i dm = _mm256_i32gather_epi32(reinterpret_cast<const int *>(b0),
                                              _mm256_setr_epi32(0, B, 2 * B, 3 * B, 4 * B, 5 * B, 6 * B, 7 * B), 1);
    auto halves = [&](int from) {        // the 16-bit halves at byte `from` of each lane, as 8 floats
        const __m256i pick = _mm256_setr_epi8(from, from + 1, from + 4, from + 5, from + 8, from + 9, from + 12,
                                              from + 13, -1, -1, -1, -1, -1, -1, -1, -1, from, from + 1, from + 4,
                                              from + 5, from + 8, from + 9, from + 12, from + 13, -1, -1, -1, -1, -1,
                                              -1, -1, -1);
        const __m256i h = _mm256_shuffle_epi8(dm, pick);
        return _mm256_cvtph_ps(_mm_unpacklo_epi64(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
    };
    const __m256 A = halves(0);
    __m256 S[NT], other[NT];
    for (int t = 0; t < NT; t++) {
        S[t] = _mm256_mul_ps(A, _mm256_loadu_ps(d0 + t * a.nb));
        if constexpr (kMin<QT>) acc.v[t] = _mm256_fmadd_ps(halves(2), _mm256_loadu_ps(ds0 + t * a.nb), acc.v[t]);
        other[t] = _mm256_setzero_ps();
    }
    for (int i = 0; i < 8; i++) {
        const __m256i codes = codes32<QT>(b0 + i * B);
        for (int t = 0; t < NT; t++) {
            const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(q0 + t * a.K + 32 * i));
            const __m256i dot = kSigned<QT> ? dot_ss(codes, x) : dot_us(codes, x);
            __m256 &sum = i % 2 ? other[t] : acc.v[t];
            sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_permutevar8x32_ps(S[t], _mm256_set1_epi32(i)), sum);
        }
    }
    for (int t = 0; t < NT; t++) acc.v[t] = _mm256_add_ps(acc.v[t], other[t]);
}
#endif
#endif
}  // namespace
