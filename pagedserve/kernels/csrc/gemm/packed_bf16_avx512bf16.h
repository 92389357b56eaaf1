// The bf16 GEMM's tiles on AVX512-BF16 dot products.
// Part of cpu_kernels (csrc/cpu_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

// ---- bf16 linear layers: y[M, N] = x[M, K] w[N, K]^T (+ bias) ---------------------------------
// The weight is packed once at load into tiles of 16 output columns with K in pairs,
// [N/16][K/2][16][2], the operand layout of the AVX512-BF16 dot-product instruction (bf16
// pairs multiplied exactly, summed in float32). A tile of up to 8 rows x 32 columns keeps 16
// sums in registers; per pair of K, two weight loads serve all rows.
#ifdef __AVX512BF16__
namespace {

constexpr int64_t kPrefetchPairs = 32;   // weight K-pairs (64 bytes each) requested ahead of use
template <int MR, typename Y>     // Y: the output type, bf16 or (attention scores) float32
void gemm_tile(const uint16_t *x, int64_t K, const uint16_t *w0, const uint16_t *w1, const float *bias,
               Y *y, int64_t ldy, int64_t n0, int64_t N) {
    __m512 acc[MR][2];
    for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < K / 2; kp++) {
        _mm_prefetch(reinterpret_cast<const char *>(w0 + (kp + kPrefetchPairs) * 32), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char *>(w1 + (kp + kPrefetchPairs) * 32), _MM_HINT_T1);
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w0 + kp * 32);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(w1 + kp * 32);
        for (int m = 0; m < MR; m++) {
            int32_t pair;
            std::memcpy(&pair, x + m * K + 2 * kp, 4);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, b0);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, b1);
        }
    }
    store_tile<MR>(acc, bias, y, ldy, n0, N);
}

// The tile for each row count 1..8; Y: bf16 output (linear layers) or float32 (attention scores).
template <typename Y>
constexpr void (*kTiles[9])(const uint16_t *, int64_t, const uint16_t *, const uint16_t *, const float *, Y *,
                            int64_t, int64_t, int64_t) = {
    nullptr, gemm_tile<1, Y>, gemm_tile<2, Y>, gemm_tile<3, Y>, gemm_tile<4, Y>,
    gemm_tile<5, Y>, gemm_tile<6, Y>, gemm_tile<7, Y>, gemm_tile<8, Y>};
}  // namespace
#endif
