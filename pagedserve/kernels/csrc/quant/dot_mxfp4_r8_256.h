// MXFP4R8: MXFP4 (quant/mxfp4.h) with 8 rows interleaved per block (quant.repack on the avx2 and
// avxvnni variants; repack_r8.h's fields {0, 1, 1}, {1, 16, 8}). A unit is one 32-element block
// of 8 rows, 136 bytes: their 8 E8M0 scale bytes (row l's at l), then two vectors of 64 bytes whose
// byte 8 l + i of vector k is row l's qs[8 k + i] (elements 8 k + i low nibble, 16 + 8 k + i high).
// The dot on 256-bit registers, as dot_r8_256.h's q4_0r8 one: a register holds 8 bytes of 4 rows
// against an 8-byte broadcast of the activations; the codes become the doubled E2M1 values plus 12
// (one pshufb of the nibbles: kE2M1x2u, 0 .. 24, unsigned for maddubs; four pairs of codes <= 24
// and |q| <= 127 fit 16 bits), the 12 taken back by a minimum term (-12 times the scale, times
// dx * sum(q): Act's ds), as q4_0r8 takes its 8 (fewer operations than |w| times sign-adjusted q:
// 1.3x the rate in L3 at T = 1); one hadd of the two halves gives the 8 rows in lanes (0, 1, 4, 5,
// 2, 3, 6, 7), where the unit's scales (2^(e - 128): half the scale undoes the doubling, built from
// the exponent bits) are permuted once to meet them. Per row l, over the blocks j in order:
//     acc = fma(float(dot_j), d_j * dx_j, acc);  mins = fma(-12 d_j, ds_j, mins);  y = acc + mins
// (d_j = 2^(e_j - 128)), which mxfp4_r8_ref spells out in plain C++ (the scalar and AVX-512 builds'
// kernel, and the reference the vector kernel equals bit for bit: the integer dots are exact).
// The codes' nibbles and products are q4_0r8's (unpack_r8_256.h's r8_nibbles, dot_r8_256.h's q4_half:
// maddubs on avx2, dpbusd on avxvnni, the same integers).
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {

constexpr int64_t kMxR8Unit = 136;     // 8 rows x 17 bytes
// The doubled E2M1 values plus 12 (kE2M1x2 + 12: 0 .. 24), unsigned for maddubs; the minimum term takes the 12.
alignas(16) constexpr uint8_t kE2M1x2u[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// The reference: out[t * ldo + l] = row l of the group at g (nb blocks) against activation row t0 + t.
template <int NT>
void mxfp4_r8_ref(const uint8_t *g, int64_t nb, const Act &a, int64_t t0, float *out, int64_t ldo) {
    for (int t = 0; t < NT; t++)
        for (int l = 0; l < 8; l++) {
            float acc = 0.f, mins = 0.f;
            for (int64_t j = 0; j < nb; j++) {
                const uint8_t *u = g + j * kMxR8Unit;
                const int8_t *x = a.q + (t0 + t) * a.K + 32 * j;
                int dot = 0;
                for (int i = 0; i < 16; i++) {
                    const uint8_t q = u[8 + 64 * (i / 8) + 8 * l + i % 8];
                    dot += kE2M1x2u[q & 15] * x[i] + kE2M1x2u[q >> 4] * x[16 + i];
                }
                const float d = e8m0_pow2(u[l], -1);
                acc = std::fma(float(dot), d * a.d[(t0 + t) * a.nb + j], acc);
                mins = std::fma(d * -12.f, a.ds[(t0 + t) * a.nb + j], mins);
            }
            out[t * ldo + l] = acc + mins;
        }
}

#if defined(__AVX2__)
// The 8 rows' 2^(e - 128) as float32 from their scale bytes (e8m0_pow2(e, -1) for every e: e = 0
// is the subnormal 2^-128, 255 NaN).
inline __m256 mxfp4_r8_scales(const uint8_t *u) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(u)));
    __m256 s = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(e, 23)), _mm256_set1_ps(0.5f));   // exact: 2^(e-127) / 2
    s = _mm256_blendv_ps(s, _mm256_castsi256_ps(_mm256_set1_epi32(0x00200000)),
                         _mm256_castsi256_ps(_mm256_cmpeq_epi32(e, _mm256_setzero_si256())));
    return _mm256_blendv_ps(s, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                            _mm256_castsi256_ps(_mm256_cmpeq_epi32(e, _mm256_set1_epi32(255))));
}

template <int NT>
void mxfp4_r8_256(const uint8_t *g, int64_t nb, const Act &a, int64_t t0, float *out, int64_t ldo) {
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);    // the hadd's row order (its own inverse)
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i *>(kE2M1x2u)));
    __m256 acc[NT], mins[NT];
    for (int t = 0; t < NT; t++) acc[t] = mins[t] = _mm256_setzero_ps();
    const int8_t *xr = a.q + t0 * a.K;
    const float *dr = a.d + t0 * a.nb, *dsr = a.ds + t0 * a.nb;
    for (int64_t j = 0; j < nb; j++) {
        const uint8_t *u = g + j * kMxR8Unit;
        r8_prefetch_unit<MXFP4R8>(u);
        const __m256 A = _mm256_permutevar8x32_ps(mxfp4_r8_scales(u), order), M = _mm256_mul_ps(A, _mm256_set1_ps(-12.f));
        // per half: the unsigned codes (elements 0-7, 8-15, 16-23, 24-31 of its 4 rows)
        __m256i c[2][4];
        r8_nibbles(u + 8, c);
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 4; k++) c[h][k] = _mm256_shuffle_epi8(lut, c[h][k]);
        for (int t = 0; t < NT; t++) {
            const int8_t *x = xr + t * a.K + 32 * j;
            int64_t x8[4];
            std::memcpy(x8, x, 32);
            const __m256i xb[4] = {_mm256_set1_epi64x(x8[0]), _mm256_set1_epi64x(x8[1]), _mm256_set1_epi64x(x8[2]),
                                   _mm256_set1_epi64x(x8[3])};
            // q4_half's bound holds: codes <= 24 here (<= 31 there)
            const __m256i dot = _mm256_hadd_epi32(q4_half(c[0], xb), q4_half(c[1], xb));
            const __m256 S = _mm256_mul_ps(A, _mm256_set1_ps(dr[t * a.nb + j]));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), S, acc[t]);
            mins[t] = _mm256_fmadd_ps(M, _mm256_set1_ps(dsr[t * a.nb + j]), mins[t]);
        }
    }
    for (int t = 0; t < NT; t++)
        _mm256_storeu_ps(out + t * ldo, _mm256_permutevar8x32_ps(_mm256_add_ps(acc[t], mins[t]), order));
}
#endif

// The kernel of this build for NT (1..4) activation rows a pass (R8GroupFn: dot_r8_256.h).
R8GroupFn mxfp4_r8_group_fn(int nt) {
#if defined(__AVX2__)
    constexpr R8GroupFn fns[5] = {nullptr, mxfp4_r8_256<1>, mxfp4_r8_256<2>, mxfp4_r8_256<3>, mxfp4_r8_256<4>};
#else
    constexpr R8GroupFn fns[5] = {nullptr, mxfp4_r8_ref<1>, mxfp4_r8_ref<2>, mxfp4_r8_ref<3>, mxfp4_r8_ref<4>};
#endif
    return nt >= 1 && nt <= 4 ? fns[nt] : nullptr;
}
}  // namespace
