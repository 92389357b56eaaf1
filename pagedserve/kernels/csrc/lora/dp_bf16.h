// LoRA shrink / expand on AVX512-BF16 dot products.
// Part of cpu_kernels (csrc/cpu_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {
#ifdef __AVX512BF16__
// y (bf16) += v, rounded to nearest even in one vcvtneps2bf16 (the deltas' outputs are never
// denormal, which it flushes; Vec::store's rounding by integer ops is the general one).
inline void lora_add_store(uint16_t *dst, __m512 v) {
    const __m512 sum = _mm512_add_ps(Vec::load(dst), v);
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(dst), (__m256i)_mm512_cvtneps_pbh(sum));
}
#endif

#ifdef __AVX512BF16__
// The vector path's bf16 sums on vdpbf16ps (two rank or input values per lane, no conversions;
// bf16 products are exact in float32, so only the order of the float32 sums differs).
// Shrink: u[i][k0 + k] (ldu) for k < NK, i < NR over len inputs (rows lda apart); the last
// len % 32 inputs through masked loads.
template <int NR, int NK>
void lora_shrink_tile_dp(const uint16_t *const *xr, const uint16_t *a, int64_t lda, int64_t k0, int64_t len,
                         float *u, int64_t ldu) {
    __m512 acc[NK][NR];
    for (int k = 0; k < NK; k++)
        for (int i = 0; i < NR; i++) acc[k][i] = _mm512_setzero_ps();
    const uint16_t *next = a + (k0 + NK) * lda;    // the next tile's rows: requested while these are summed
    for (int64_t c = 0; c < len; c += 32) {
        const __mmask32 m = len - c >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << (len - c)) - 1);
        __m512bh w[NK];
        for (int k = 0; k < NK; k++) __builtin_prefetch(next + k * lda + c, 0, 3);
        for (int k = 0; k < NK; k++) w[k] = (__m512bh)_mm512_maskz_loadu_epi16(m, a + (k0 + k) * lda + c);
        for (int i = 0; i < NR; i++) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, xr[i] + c);
            for (int k = 0; k < NK; k++) acc[k][i] = _mm512_dpbf16_ps(acc[k][i], xv, w[k]);
        }
    }
    for (int k = 0; k < NK; k++)
        for (int i = 0; i < NR; i++) u[i * ldu + k0 + k] = _mm512_reduce_add_ps(acc[k][i]);
}

template <int NR>
void lora_shrink_dp_rows(const uint16_t *const *xr, const uint16_t *a, int64_t lda, int64_t r, int64_t len, float *u,
                         int64_t ldu) {
    int64_t k0 = 0;
    for (; k0 + 4 <= r; k0 += 4) lora_shrink_tile_dp<NR, 4>(xr, a, lda, k0, len, u, ldu);
    for (; k0 < r; k0++) lora_shrink_tile_dp<NR, 1>(xr, a, lda, k0, len, u, ldu);
}

inline void lora_shrink_dp(const uint16_t *const *xr, int n, const uint16_t *a, int64_t lda, int64_t r, int64_t len,
                           float *u, int64_t ldu) {
    switch (n) {
        case 1: return lora_shrink_dp_rows<1>(xr, a, lda, r, len, u, ldu);
        case 2: return lora_shrink_dp_rows<2>(xr, a, lda, r, len, u, ldu);
        case 3: return lora_shrink_dp_rows<3>(xr, a, lda, r, len, u, ldu);
        default: return lora_shrink_dp_rows<4>(xr, a, lda, r, len, u, ldu);
    }
}

// Expand from BT's rank pairs (pj: the part's first pair row, [pairs][ldb][2]): y rows yr,
// columns [c0, c1) += u @ BT_j, u rounded to bf16 already (exact here), a pair of rank values
// per lane; columns past the last 16 on the float path (bj: BT's part rows, ldb apart).
template <int NR>
void lora_expand_dp_rows(const float *u, int64_t ldu, const uint16_t *pj, const uint16_t *bj, int64_t ldb,
                         int64_t r, uint16_t *const *yr, int64_t c0, int64_t c1) {
    const int64_t np = (r + 1) / 2;
    __m512i up[NR][64];     // (u_2q, u_2q+1) per row, broadcast; r <= 128
    for (int i = 0; i < NR; i++)
        for (int64_t q = 0; q < np; q++) {
            uint16_t lo, hi = 0;
            store(&lo, u[i * ldu + 2 * q]);
            if (2 * q + 1 < r) store(&hi, u[i * ldu + 2 * q + 1]);
            up[i][q] = _mm512_set1_epi32(static_cast<int32_t>(lo | static_cast<uint32_t>(hi) << 16));
        }
    int64_t c = c0;
    for (; c + 64 <= c1; c += 64) {
        __m512 acc[NR][4];
        for (int i = 0; i < NR; i++)
            for (int v = 0; v < 4; v++) acc[i][v] = _mm512_setzero_ps();
        for (int64_t q = 0; q < np; q++) {
            const uint16_t *row = pj + (q * ldb + c) * 2;
            for (int v = 0; v < 4; v++) __builtin_prefetch(row + (kAheadCols * 64 + v * 16) * 2, 0, 3);
            __m512bh w[4];
            for (int v = 0; v < 4; v++) w[v] = (__m512bh)_mm512_loadu_si512(row + v * 32);
            for (int i = 0; i < NR; i++)
                for (int v = 0; v < 4; v++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], (__m512bh)up[i][q], w[v]);
        }
        for (int i = 0; i < NR; i++)
            for (int v = 0; v < 4; v++) lora_add_store(yr[i] + c + v * 16, acc[i][v]);
    }
    for (; c + 16 <= c1; c += 16) {
        __m512 acc[NR];
        for (int i = 0; i < NR; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t q = 0; q < np; q++) {
            const __m512bh w = (__m512bh)_mm512_loadu_si512(pj + (q * ldb + c) * 2);
            for (int i = 0; i < NR; i++) acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)up[i][q], w);
        }
        for (int i = 0; i < NR; i++) lora_add_store(yr[i] + c, acc[i]);
    }
    if (c < c1) lora_expand_rows<Vec, NR>(u, ldu, bj, ldb, r, yr, c, c1);
}

inline void lora_expand_dp(const float *u, int64_t ldu, int n, const uint16_t *pj, const uint16_t *bj, int64_t ldb,
                           int64_t r, uint16_t *const *yr, int64_t c0, int64_t c1) {
    switch (n) {
        case 1: return lora_expand_dp_rows<1>(u, ldu, pj, bj, ldb, r, yr, c0, c1);
        case 2: return lora_expand_dp_rows<2>(u, ldu, pj, bj, ldb, r, yr, c0, c1);
        case 3: return lora_expand_dp_rows<3>(u, ldu, pj, bj, ldb, r, yr, c0, c1);
        default: return lora_expand_dp_rows<4>(u, ldu, pj, bj, ldb, r, yr, c0, c1);
    }
}
#endif
}  // namespace
