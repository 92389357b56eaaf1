// The 8-bit KV cache formats (fp8 e5m2, fp8 e4m3, int8): element types, scales, encoding.
// Part of cpu_kernels (csrc/cpu_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

// 8-bit KV caches (kernels take the cache's element type K apart from the query's T): each
// (token, KV head) row holds D one-byte codes and, for the scaled formats, a bf16 scale after
// them (row = D + 2 bytes; attention/kv_format.py). Codes become float32 in registers (FP8 via
// a shift into fp16 bits and F16C's conversion, int8 by sign extension); the scales are applied
// to whole scores (K: s_t = scale_t * q . k_t) and softmax weights (V: w_t scale_t), so no
// element is scaled and no block is ever dequantized into memory.
namespace {
// ---- 8-bit KV cache element types: one byte each -------------------------------------------------
struct E5M2 { uint8_t b; };   // fp8 e5m2: the top byte of an fp16, no scale
struct E4M3 { uint8_t b; };   // fp8 e4m3fn with a bf16 scale per (token, head) row
struct I8 { int8_t b; };      // int8 (symmetric, +-127) with a bf16 scale per row
template <typename K> constexpr bool kQuant = sizeof(K) == 1;
template <typename K> constexpr bool kScaled = std::is_same_v<K, E4M3> || std::is_same_v<K, I8>;
// e4m3's 7 magnitude bits moved under an fp16's exponent and mantissa: as fp16 that reads
// value / 256 (bias 15 instead of 7; subnormals line up too); the 256 is folded into the scale.
inline uint16_t e4m3_half_bits(uint8_t b) { return static_cast<uint16_t>(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7)); }
inline float to_f32(E5M2 x) { return half_to_f32(static_cast<uint16_t>(x.b << 8)); }
inline float to_f32(E4M3 x) { return half_to_f32(e4m3_half_bits(x.b)); }    // value / 256
inline float to_f32(I8 x) { return static_cast<float>(x.b); }

// The factor of a row's codes (what to_f32 and the vector loads give times it is the value).
template <typename K>
inline float row_scale(const K *row, int64_t D) {
    if constexpr (kScaled<K>) {
        uint16_t s;
        std::memcpy(&s, reinterpret_cast<const char *>(row) + D, 2);
        return to_f32(s) * (std::is_same_v<K, E4M3> ? 256.f : 1.f);
    } else {
        return 1.f;
    }
}

// float -> a minifloat code with M mantissa bits and exponent bias `bias`, rounded to nearest
// even, saturating at max_code (the largest finite value), as torch's float8 conversion of a
// value clamped to the format's range. Branch-free, so the row loop vectorises: the normal
// range rounds the float's mantissa bits in integers; below the smallest normal, adding
// 2^(24 - bias - M) rounds |x| to a multiple of the format's subnormal step (the float add's
// own round to nearest even), whose count is the code.
template <int M, int kBias, uint32_t kMaxCode>
inline uint8_t to_minifloat(float x) {
    constexpr int kShift = 23 - M;
    constexpr float kMagic = static_cast<float>(1u << (24 - kBias - M));
    uint32_t u, magic_bits;
    std::memcpy(&u, &x, 4);
    std::memcpy(&magic_bits, &kMagic, 4);
    const uint32_t sign = (u >> 24) & 0x80u;
    u &= 0x7FFFFFFFu;
    const uint32_t normal = ((u + (1u << (kShift - 1)) - 1 + ((u >> kShift) & 1u)) >> kShift) -
                            (static_cast<uint32_t>(127 - kBias) << M);
    float a, t;
    std::memcpy(&a, &u, 4);
    t = a + kMagic;
    uint32_t tb;
    std::memcpy(&tb, &t, 4);
    const uint32_t code = u < static_cast<uint32_t>(127 - kBias + 1) << 23 ? tb - magic_bits : normal;
    return static_cast<uint8_t>(sign | std::min(code, kMaxCode));
}
inline void encode(float x, E5M2 *dst) { dst->b = to_minifloat<2, 15, 0x7B>(x); }     // max 57344
inline void encode(float x, E4M3 *dst) { dst->b = to_minifloat<3, 7, 0x7E>(x); }      // max 448
inline void encode(float x, I8 *dst) {
    dst->b = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(x))));
}

// One (token, head) row of D source values into its cache row: the scale (largest |x| over the
// format's largest code, rounded to bf16; 0 for an all-zero row) after the codes of x / scale.
template <typename S, typename K>
void quantize_row(const S *src, int64_t D, K *dst) {
    float div = 1.f;
    if constexpr (kScaled<K>) {
        float amax = 0.f;
#pragma omp simd reduction(max : amax)
        for (int64_t d = 0; d < D; d++) amax = std::max(amax, std::fabs(to_f32(src[d])));
        uint16_t s;
        store(&s, amax / (std::is_same_v<K, I8> ? 127.f : 448.f));
        std::memcpy(reinterpret_cast<char *>(dst) + D, &s, 2);
        if (to_f32(s) != 0.f) div = to_f32(s);
    }
#pragma omp simd
    for (int64_t d = 0; d < D; d++) encode(to_f32(src[d]) / div, dst + d);
}

}  // namespace
