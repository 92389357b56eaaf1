// The float32 GEMM's tiles on AVX-512 FMAs.
// Part of cpu_kernels (csrc/cpu_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

// ---- float32 linear layers: the same tiles, one K step at a time ------------------------------
// w packed [Np/16][K][16] (Np a multiple of 32, zero columns past N); per K step two weight
// loads serve up to 8 rows, each row's x[k] broadcast once. (oneDNN's packed GEMM is as fast,
// but caches a primitive per row count: ~0.75 MB for every batch size a server ever sees.)
#ifdef __AVX512F__
namespace {
constexpr int64_t kPrefetchSteps = 32;   // weight K steps (64 bytes each) requested ahead of use

template <int MR>
void gemm_tile_f32(const float *x, int64_t K, const float *w0, const float *w1, const float *bias, float *y,
                   int64_t ldy, int64_t n0, int64_t N) {
    __m512 acc[MR][2];
    for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        _mm_prefetch(reinterpret_cast<const char *>(w0 + (k + kPrefetchSteps) * 16), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char *>(w1 + (k + kPrefetchSteps) * 16), _MM_HINT_T1);
        const __m512 b0 = _mm512_loadu_ps(w0 + k * 16), b1 = _mm512_loadu_ps(w1 + k * 16);
        for (int m = 0; m < MR; m++) {
            const __m512 a = _mm512_set1_ps(x[m * K + k]);
            acc[m][0] = _mm512_fmadd_ps(a, b0, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(a, b1, acc[m][1]);
        }
    }
    store_tile<MR>(acc, bias, y, ldy, n0, N);
}

using TileF32 = void (*)(const float *, int64_t, const float *, const float *, const float *, float *, int64_t,
                         int64_t, int64_t);
constexpr TileF32 kTilesF32[9] = {nullptr, gemm_tile_f32<1>, gemm_tile_f32<2>, gemm_tile_f32<3>, gemm_tile_f32<4>,
                                  gemm_tile_f32<5>, gemm_tile_f32<6>, gemm_tile_f32<7>, gemm_tile_f32<8>};
}  // namespace

extern "C" int linear_packed_ld_f32(const float *x, const float *w, const float *bias, float *y, int64_t ldy,
                                    int64_t M, int64_t N, int64_t K) {
    gemm_strips(x, w, bias, y, ldy, M, N, K, [](int64_t rows, auto... args) { kTilesF32[rows](args...); });
    return 0;
}
#endif
