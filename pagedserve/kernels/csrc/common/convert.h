// Scalar conversions between float32 and the 16-bit storage types (bf16, fp16).
// Shared by cpu_kernels and quant_kernels (each entry file includes it after the system headers).
#pragma once

namespace {
// bf16 bits -> float32 (exact).
inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = uint32_t(h) << 16;
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
}

// ---- cpu_kernels: a storage element (float32 or bf16) as float32, and back -----------------------

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) { return bf16_to_f32(x); }
inline void store(float *dst, float x) { *dst = x; }
inline void store(uint16_t *dst, float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    *dst = static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);   // round to nearest even
}


inline float half_to_f32(uint16_t h) {     // IEEE fp16 -> float32 (exact), for builds without F16C
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 0x1F, mant = h & 0x3FF;
    uint32_t u;
    if (e == 0) {
        const float f = static_cast<float>(mant) * 5.9604644775390625e-08f;   // mant * 2^-24
        std::memcpy(&u, &f, 4);
        u |= sign;
    } else {
        u = sign | (e == 31 ? 0x7F800000u : (e + 112) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// ---- quant_kernels: fp16 bytes of a block, bf16 and fp16 bits ---------------------------------------
float f16(const uint8_t *p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = uint32_t(h >> 15) << 31, exp = (h >> 10) & 31, mant = h & 1023;
    uint32_t bits;
    if (exp == 0) {                         // zero or subnormal: mant * 2^-24
        const float v = std::ldexp(float(mant), -24);
        std::memcpy(&bits, &v, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
#endif
}


uint16_t f32_to_bf16(float f) {          // round to nearest even, NaN kept quiet (as torch)
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);
    return uint16_t((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);
}

// float32 -> fp16 bits, rounded to nearest even as numpy's astype(float16) (subnormals, inf, NaN).
uint16_t f32_to_f16(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint16_t sign = uint16_t((x >> 16) & 0x8000);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0);
    if (ax >= 0x477ff000u) return sign | 0x7c00;                // rounds past 65504
    if (ax < 0x38800000u) {                                     // below 2^-14: a multiple of 2^-24
        float a;
        std::memcpy(&a, &ax, 4);
        return sign | uint16_t(std::nearbyint(a * 16777216.0f));
    }
    uint32_t r = ax - 0x38000000u;                              // exponent rebiased 127 -> 15
    r += 0xfffu + ((r >> 13) & 1);
    return sign | uint16_t(r >> 13);
}

}  // namespace
