// The packed GEMMs' driver (strips of 32 columns per thread) and AVX-512 tile stores.
// Part of cpu_kernels (csrc/cpu_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

// ---- linear layers: the driver shared by the bf16 and float32 GEMMs ---------------------------
// w is packed in strips of 32 output columns (two tiles of 16, K * 16 values each). Each
// thread takes a range of strips and runs every tile of up to 8 rows of x over them, so each
// weight byte streams from memory once per call whatever M is, and stays in cache across rows.
template <typename X, typename Wt, typename Y, typename Tile>
void gemm_strips(const X *x, const Wt *w, const float *bias, Y *y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                 Tile tile) {
    const int64_t strips = (N + 31) / 32;
#pragma omp parallel for schedule(static)
    for (int64_t s = 0; s < strips; s++) {
        const Wt *w0 = w + (2 * s) * K * 16, *w1 = w0 + K * 16;
        for (int64_t m = 0; m < M; m += 8)
            tile(std::min<int64_t>(8, M - m), x + m * K, K, w0, w1, bias, y + m * ldy, ldy, 32 * s, N);
    }
}

#ifdef __AVX512F__
namespace {
// The first `left` of 16 lanes (all 16 from 16 on): a row's last, partial vector.
inline __mmask16 first_lanes(int64_t left) { return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1); }

inline void store_masked(float *dst, __mmask16 mask, __m512 v) { _mm512_mask_storeu_ps(dst, mask, v); }
#ifdef __AVX512BF16__
inline void store_masked(uint16_t *dst, __mmask16 mask, __m512 v) {
    _mm256_mask_storeu_epi16(dst, mask, (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

// A tile's float32 sums (MR rows x 32 columns from n0) plus bias, stored to columns < N of y
// (rounded to bf16 where Y is bf16).
template <int MR, typename Y>
void store_tile(const __m512 (&acc)[MR][2], const float *bias, Y *y, int64_t ldy, int64_t n0, int64_t N) {
    for (int half = 0; half < 2; half++) {
        const int64_t n = n0 + 16 * half;
        if (n >= N) break;
        const __mmask16 mask = first_lanes(N - n);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
        for (int m = 0; m < MR; m++) store_masked(y + m * ldy + n, mask, _mm512_add_ps(acc[m][half], b));
    }
}
}  // namespace
#endif
