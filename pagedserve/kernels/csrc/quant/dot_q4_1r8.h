// Q4_1R8 dots: a block of 8 interleaved rows per 512-bit dot (r8_group).
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {
#if defined(PS_DOTS512)
// Q4_1R8 (see QType) at NT activation rows from t0: out[t * ldo + l] = row l of the group at g
// against activation row t0 + t. Per unit: the nibbles' two vectors masked once (low, and high in
// place: 16 times the code, taken off by a shift of the exact int32 sums), per row four dots
// against 8-byte broadcasts, one conversion and one multiply-add by the 8 rows' scales (spread to
// their lane pairs), the minimum terms 8 wide; the rows' sums out of their lane pairs at the end.
template <int NT>
void r8_group(const uint8_t *g, int64_t nb, const Act &a, int64_t t0, float *out, int64_t ldo) {
    // out[t * ldo + l] = row l's dot with activation row t0 + t
    const __m512i m4 = _mm512_set1_epi8(15), h4 = _mm512_set1_epi8(char(0xF0));
    const __m512i spread = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    __m512 acc[NT][2];
    __m256 mins[NT];
    for (int t = 0; t < NT; t++) acc[t][0] = acc[t][1] = _mm512_setzero_ps(), mins[t] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nb; j++) {
        const uint8_t *u = g + j * 160;
        _mm_prefetch(reinterpret_cast<const char *>(u + 24 * 160), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char *>(u + 24 * 160 + 64), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char *>(u + 24 * 160 + 128), _MM_HINT_T0);
        const __m512i v0 = _mm512_loadu_si512(u + 32), v1 = _mm512_loadu_si512(u + 96);
        const __m512i lo0 = _mm512_and_si512(v0, m4), lo1 = _mm512_and_si512(v1, m4);
        const __m512i hi0 = _mm512_and_si512(v0, h4), hi1 = _mm512_and_si512(v1, h4);
        const __m256 A = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(u)));
        const __m256 M = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(u + 16)));
        for (int t = 0; t < NT; t++) {
            const int8_t *x = a.q + (t0 + t) * a.K + j * 32;
            int64_t x8[4];
            std::memcpy(x8, x, 32);
            const __m512i lo = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo0, _mm512_set1_epi64(x8[0])),
                                                   lo1, _mm512_set1_epi64(x8[1]));
            const __m512i hi = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), hi0, _mm512_set1_epi64(x8[2])),
                                                   hi1, _mm512_set1_epi64(x8[3]));
            const __m512i dot = _mm512_add_epi32(lo, _mm512_srai_epi32(hi, 4));
            const float dx = a.d[(t0 + t) * a.nb + j], ds = a.ds[(t0 + t) * a.nb + j];
            const __m512 S = _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(_mm256_mul_ps(A, _mm256_set1_ps(dx))));
            __m512 &s = acc[t][j % 2];
            s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), S, s);
            mins[t] = _mm256_fmadd_ps(M, _mm256_set1_ps(ds), mins[t]);
        }
    }
    for (int t = 0; t < NT; t++) {
        const __m512 sum = _mm512_add_ps(acc[t][0], acc[t][1]);
        const __m512 pairs = _mm512_add_ps(sum, _mm512_permute_ps(sum, 0xB1));     // lane 2l: row l's
        const __m256 rows = _mm512_castps512_ps256(
            _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0), pairs));
        _mm256_storeu_ps(out + t * ldo, _mm256_add_ps(rows, mins[t]));
    }
}
// NT activation rows per pass (up to 4: registers)
using R8Fn = void (*)(const uint8_t *, int64_t, const Act &, int64_t, float *, int64_t);
constexpr R8Fn kR8_512[5] = {nullptr, r8_group<1>, r8_group<2>, r8_group<3>, r8_group<4>};
#endif
}  // namespace
