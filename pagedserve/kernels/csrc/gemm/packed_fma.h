// The GEMMs over Vec for the other builds, and the exported linear_packed_* entry points.
// Part of cpu_kernels (csrc/cpu_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

// ---- linear layers in float32 arithmetic, for builds without the tiles above -----------------
// bf16 weights (without AVX512-BF16) are converted in registers, two bit operations per 2 W
// values, and multiplied in float32 as llama.cpp does on AVX2; float32 weights as they are.
// Same packing as above. A tile is one 16-column weight tile (16 / W vectors of sums per row)
// for up to 4 rows (8 with AVX-512's 32 registers); x is float32, converted once per call.
namespace {
template <class V, int MR, typename Wt, typename Y>
void fma_tile(const float *x, int64_t K, const Wt *w, const float *bias, Y *y, int64_t ldy, int64_t n0, int64_t N) {
    constexpr int G = 16 / V::W;
    constexpr bool kBf16 = std::is_same_v<Wt, uint16_t>;
    constexpr int S = kBf16 && MR * G <= 4 ? 2 : 1;   // even and odd k summed apart: more chains for few rows
    typename V::reg acc[MR][G][S];
    for (auto &row : acc)
        for (auto &sums : row)
            for (auto &a : sums) a = V::zero();
    if constexpr (kBf16) {
        for (int64_t kp = 0; kp < K / 2; kp++) {       // 64 bytes of the tile per K pair
            V::prefetch(w + (kp + 32) * 32);
            for (int g = 0; g < G; g++) {
                typename V::reg even, odd;
                V::load_pairs(w + kp * 32 + g * 2 * V::W, even, odd);
                for (int m = 0; m < MR; m++) {
                    acc[m][g][0] = V::fmadd(V::set1(x[m * K + 2 * kp]), even, acc[m][g][0]);
                    acc[m][g][S - 1] = V::fmadd(V::set1(x[m * K + 2 * kp + 1]), odd, acc[m][g][S - 1]);
                }
            }
        }
    } else {
        for (int64_t k = 0; k < K; k++) {               // 64 bytes of the tile per K step
            V::prefetch(w + (k + 32) * 16);
            for (int g = 0; g < G; g++) {
                const typename V::reg b = V::load(w + k * 16 + g * V::W);
                for (int m = 0; m < MR; m++) acc[m][g][0] = V::fmadd(V::set1(x[m * K + k]), b, acc[m][g][0]);
            }
        }
    }
    for (int m = 0; m < MR; m++)
        for (int g = 0; g < G; g++) {
            const int64_t n = n0 + g * V::W;
            if (n >= N) break;
            typename V::reg sum = acc[m][g][0];
            if constexpr (S == 2) sum = V::add(sum, acc[m][g][1]);
            if (N - n >= V::W) {
                V::store(y + m * ldy + n, bias ? V::add(sum, V::load(bias + n)) : sum);
            } else {
                float part[V::W];
                V::store(part, sum);
                for (int64_t i = 0; i < N - n; i++) store(y + m * ldy + n + i, part[i] + (bias ? bias[n + i] : 0.f));
            }
        }
}

// Rows 1..MR through the tile of that many rows.
template <class V, int MR, typename Wt, typename Y>
void fma_tile_rows(int64_t rows, const float *x, int64_t K, const Wt *w, const float *bias, Y *y, int64_t ldy,
                   int64_t n0, int64_t N) {
    if (rows == MR) return fma_tile<V, MR>(x, K, w, bias, y, ldy, n0, N);
    if constexpr (MR > 1) fma_tile_rows<V, MR - 1>(rows, x, K, w, bias, y, ldy, n0, N);
}

template <class V, typename T>
void linear_fma(const T *x, const T *w, const float *bias, T *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    constexpr int kRows = V::W == 16 ? 8 : 4;
    std::vector<float> converted;
    const float *xf;
    if constexpr (std::is_same_v<T, float>) {
        xf = x;
    } else {
        converted.resize(M * K);
        for (int64_t i = 0; i < M * K; i++) converted[i] = to_f32(x[i]);
        xf = converted.data();
    }
    gemm_strips(xf, w, bias, y, ldy, M, N, K, [](int64_t rows, const float *xm, int64_t K, const T *w0, const T *w1,
                                            const float *b, T *ym, int64_t ldy, int64_t n0, int64_t N) {
        for (int64_t m = 0; m < rows; m += kRows) {
            const int64_t r = std::min<int64_t>(kRows, rows - m);
            fma_tile_rows<V, kRows>(r, xm + m * K, K, w0, b, ym + m * ldy, ldy, n0, N);
            if (n0 + 16 < N) fma_tile_rows<V, kRows>(r, xm + m * K, K, w1, b, ym + m * ldy, ldy, n0 + 16, N);
        }
    });
}
}  // namespace

#ifndef __AVX512BF16__
extern "C" int linear_packed_ld_bf16(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y,
                                     int64_t ldy, int64_t M, int64_t N, int64_t K) {
    linear_fma<Vec>(x, w, bias, y, ldy, M, N, K);
    return 0;
}
#endif
#ifndef __AVX512F__
extern "C" int linear_packed_ld_f32(const float *x, const float *w, const float *bias, float *y, int64_t ldy,
                                    int64_t M, int64_t N, int64_t K) {
    linear_fma<Vec>(x, w, bias, y, ldy, M, N, K);
    return 0;
}
#endif
// y [M, N] (rows N apart) = x [M, K] @ W.T (+ bias), W packed (kernels/cpu.py pack_weight).
extern "C" int linear_packed_bf16(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y, int64_t M,
                                  int64_t N, int64_t K) {
    return linear_packed_ld_bf16(x, w, bias, y, N, M, N, K);
}
extern "C" int linear_packed_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N,
                                 int64_t K) {
    return linear_packed_ld_f32(x, w, bias, y, N, M, N, K);
}
#ifndef __AVX512BF16__
extern "C" int gemm_amx_config(int64_t, int64_t) { return 0; }    // AMX only in the avx512bf16 build
#endif
