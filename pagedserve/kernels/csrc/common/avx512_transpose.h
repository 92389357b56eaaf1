// A 16 x 16 transpose of 32-bit lanes in AVX-512 registers: shared by cpu_kernels (attention,
// LoRA, vec.h's sums) and quant_kernels (packed tiles, AMX rescales).
#pragma once

#if defined(__AVX512F__)
namespace {
// In place: r[i] element j <- r[j] element i, for 32-bit elements (4 rounds of 16 shuffles).
inline void transpose16_epi32(__m512i *r) {
    __m512i t[16], u[16];
    for (int k = 0; k < 8; k++) {
        t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    for (int m = 0; m < 4; m++) {          // u[4m + c] lane L: column 4L + c of rows 4m..4m+3
        u[4 * m] = _mm512_unpacklo_epi64(t[4 * m], t[4 * m + 2]);
        u[4 * m + 1] = _mm512_unpackhi_epi64(t[4 * m], t[4 * m + 2]);
        u[4 * m + 2] = _mm512_unpacklo_epi64(t[4 * m + 1], t[4 * m + 3]);
        u[4 * m + 3] = _mm512_unpackhi_epi64(t[4 * m + 1], t[4 * m + 3]);
    }
    for (int c = 0; c < 4; c++) {          // column 4L + c gathers lane L of u[c], u[4+c], u[8+c], u[12+c]
        const __m512i w01 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), w23 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
        const __m512i x01 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44),
                      x23 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_i32x4(w01, x01, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(w01, x01, 0xDD);
        r[8 + c] = _mm512_shuffle_i32x4(w23, x23, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(w23, x23, 0xDD);
    }
}
}  // namespace
#endif
