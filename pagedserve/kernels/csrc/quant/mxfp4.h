// MXFP4 (gpt-oss's experts; llama.cpp's GGML type MXFP4): its dots (a few activation rows) and
// its dequantization. Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order;
// each sees those before it).
//
// A block is 17 bytes: an E8M0 scale byte e (2^(e - 127); 255: NaN), then 16 bytes whose low
// nibbles are elements 0-15 and high nibbles elements 16-31, each an E2M1 code (sign, 2 exponent
// bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; pagedserve/mxfp4.py).
// Every E2M1 value doubled is a small integer (0 .. 12), so the dots run on integers as the other
// types' do: the doubled codes (one pshufb of the nibbles on AVX2) times the q8 activations, one
// dot per block, scaled by 2^(e - 128) * dx (half the block's scale undoes the doubling):
//     y += (2^(e - 128) * dx) * dot(2 * code, q)
// exact in the integers; the float32 sums differ from reference_linear only by their order.
#pragma once

namespace {

alignas(16) constexpr int8_t kE2M1x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 2^(e - 127) x 2^shift as a float32 built from its bits (e + shift >= 1: normal; 0 or below: the
// subnormals down to 2^-128, which shift >= -1 reaches), NaN for e = 255.
inline float e8m0_pow2(uint8_t e, int shift) {
    if (e == 255) return std::numeric_limits<float>::quiet_NaN();
    const int biased = int(e) + shift;
    const uint32_t bits = biased >= 1 ? uint32_t(biased) << 23 : 0x00400000u >> (-biased);
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// Row w's K weights as floats: each code's value times the scale, one float32 multiply (exact
// but for the subnormals, rounded as the torch reference rounds the same product).
void mxfp4_dequantize_row(const uint8_t *w, int64_t K, float *y) {
    for (int64_t j = 0; j < K / 32; j++) {
        const uint8_t *b = w + j * 17;
        const float half = e8m0_pow2(b[0], -1);      // doubled codes: half the scale
        for (int i = 0; i < 16; i++) {
            y[32 * j + i] = float(kE2M1x2[b[1 + i] & 15]) * half;
            y[32 * j + 16 + i] = float(kE2M1x2[b[1 + i] >> 4]) * half;
        }
    }
}

// One weight row against activation rows t0 .. t0 + NT (row_dot's contract: out[t * ldo]).
template <int NT>
void mxfp4_row_dot(const uint8_t *w, const Act &a, int64_t t0, float *out, int64_t ldo) {
    const int64_t nb = a.K / 32;
    const int8_t *qa = a.q + t0 * a.K;
    const float *da = a.d + t0 * a.nb;
#if defined(__AVX2__)
    const __m128i lut = _mm_load_si128(reinterpret_cast<const __m128i *>(kE2M1x2)), m4 = _mm_set1_epi8(15);
    __m256 acc[NT], other[NT];           // two chains of sums (even and odd blocks): the adds' latency
    for (int t = 0; t < NT; t++) acc[t] = other[t] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nb; j++) {
        const uint8_t *b = w + j * 17;
        const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b + 1));
        const __m256i codes = _mm256_set_m128i(_mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(qs, 4), m4)),
                                               _mm_shuffle_epi8(lut, _mm_and_si128(qs, m4)));
        const float half = e8m0_pow2(b[0], -1);
        for (int t = 0; t < NT; t++) {
            const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qa + t * a.K + 32 * j));
            __m256 &sum = j % 2 ? other[t] : acc[t];
            sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_ss(codes, x)), _mm256_set1_ps(half * da[t * a.nb + j]), sum);
        }
    }
    for (int t = 0; t < NT; t++) out[t * ldo] = hsum(_mm256_add_ps(acc[t], other[t]));
#else
    float acc[NT] = {};
    for (int64_t j = 0; j < nb; j++) {
        const uint8_t *b = w + j * 17;
        const float half = e8m0_pow2(b[0], -1);
        for (int t = 0; t < NT; t++) {
            const int8_t *q = qa + t * a.K + 32 * j;
            int dot = 0;
            for (int i = 0; i < 16; i++) dot += kE2M1x2[b[1 + i] & 15] * q[i] + kE2M1x2[b[1 + i] >> 4] * q[16 + i];
            acc[t] += (half * da[t * a.nb + j]) * float(dot);
        }
    }
    for (int t = 0; t < NT; t++) out[t * ldo] = acc[t];
#endif
}

using MxRowFn = void (*)(const uint8_t *, const Act &, int64_t, float *, int64_t);

template <int... NT>
constexpr MxRowFn mxfp4_pick(int nt, std::integer_sequence<int, NT...>) {
    MxRowFn fn = nullptr;
    ((nt == NT + 1 ? (fn = mxfp4_row_dot<NT + 1>, 0) : 0), ...);
    return fn;
}

// Up to 8 activation rows a pass (row_dot.h's kMaxNT is 4 or 8: every count it asks for).
MxRowFn mxfp4_row_fn(int nt) { return mxfp4_pick(nt, std::make_integer_sequence<int, 8>{}); }
}  // namespace
