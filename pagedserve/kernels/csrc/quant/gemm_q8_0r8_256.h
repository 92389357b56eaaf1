// q8_0r8's group in the r8 integer GEMM on 256-bit registers (AVX2, AVX-VNNI): gemm_r8_256.h's tile
// layout and loop (its gemm_group_fn dispatches here), with the arithmetic per activation row of
// the q8_0r8 dots (dot_r8_256.h's r8_group_256<Q8_0R8>), bit for bit: per row, over the blocks j in
// order, acc = fma(float(dot_j), d_j * dx_j, acc) and no minimum term (mins stays 0; the caller's
// acc - mins or acc + mins is acc: an fma chain from +0 never ends at -0). The dot is an exact
// integer: |w| (unsigned, <= 128) times x with w's sign (|x| <= 127), pairs summed in 16 bits (<=
// 2 * 128 * 127 < 32768), then 32 bits (maddubs + madd, or VEX vpdpbusd: dp4), the two halves' dots
// hadd'ed into the rows' lane order as the dots do.
// What the GEMM saves: a unit's codes, their magnitudes, and its scales are loaded once per tile of
// kGemmTile rows instead of once per pass of 1-4 rows (the weights stream once per 64 rows), and a
// tile's activations are contiguous (gemm_r8_256.h's block-major layout).
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {

#if defined(__AVX2__)
// The group at w (nb q8_0r8 units) against tile rows t0 .. t0 + n - 1 of g: acc ([n][8], the hadd's
// lane order) += the rows' products; mins and m untouched (q8_0 has no minimum term).
void gemm_q8_0r8_group(const uint8_t *w, const GemmAct &g, int64_t t0, int64_t n, float *acc, float *, float *) {
    constexpr int64_t U = r8_unit_bytes(Q8_0R8);
    constexpr int C = r8_codes_at(Q8_0R8);
    for (int64_t j = 0; j < g.nb; j++) {
        const uint8_t *u = w + j * U;
        const __m256 A = r8_f16x8(u);
        // per half h (rows 4 h .. 4 h + 3) and piece k (elements 8 k .. 8 k + 7): the codes and |codes|
        __m256i c[2][4], ac[2][4];
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 4; k++) {
                c[h][k] = r8_load(u + C + 64 * k + 32 * h);
                ac[h][k] = _mm256_sign_epi8(c[h][k], c[h][k]);
            }
        const int64_t at = g.at(t0, n, j, 0);
        const int8_t *xq = g.q + 32 * at;
        const float *dx = g.d + at;
        for (int64_t t = 0; t < n; t++) {
            const int8_t *x = xq + 32 * t;
            const __m256i xb[4] = {bcast8(x), bcast8(x + 8), bcast8(x + 16), bcast8(x + 24)};
            __m256i dot[2];
            for (int h = 0; h < 2; h++) {
                dot[h] = _mm256_setzero_si256();
                for (int k = 0; k < 4; k++) dot[h] = dp4(dot[h], ac[h][k], _mm256_sign_epi8(xb[k], c[h][k]));
            }
            const __m256 S = _mm256_mul_ps(A, _mm256_set1_ps(dx[t]));
            _mm256_store_ps(acc + 8 * t, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_hadd_epi32(dot[0], dot[1])), S,
                                                         _mm256_load_ps(acc + 8 * t)));
        }
    }
}
#endif

}  // namespace
