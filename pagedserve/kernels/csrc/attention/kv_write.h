// Writing a step's keys and values into their cache slots (write_kv, write_kv8).
// Part of cpu_kernels (csrc/cpu_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

// ---- writing the step's keys and values into their cache slots ---------------------------------
// k, v: [T, Hkv, D] with row strides (in elements; D contiguous); slot s = block * B + offset.
// Byte copies, so one function serves every dtype.
extern "C" int write_kv(const char *k, const char *v, int64_t k_stride_t, int64_t k_stride_h, int64_t v_stride_t,
                        int64_t v_stride_h, char *kc, char *vc, const int64_t *slots, int64_t T, int64_t Hkv,
                        int64_t D, int64_t B, int64_t block_stride, int64_t token_stride, int64_t head_stride,
                        int64_t elem_size) {
#pragma omp parallel for schedule(static) if (T >= 256)
    for (int64_t t = 0; t < T; t++) {
        const int64_t base = slots[t] / B * block_stride + slots[t] % B * token_stride;
        for (int64_t h = 0; h < Hkv; h++) {
            std::memcpy(kc + (base + h * head_stride) * elem_size, k + (t * k_stride_t + h * k_stride_h) * elem_size,
                        D * elem_size);
            std::memcpy(vc + (base + h * head_stride) * elem_size, v + (t * v_stride_t + h * v_stride_h) * elem_size,
                        D * elem_size);
        }
    }
    return 0;
}

// The same into an 8-bit cache: each (token, head) row quantized into its slot (quantize_row);
// S: the source's type (float or bf16), K: the cache's format; cache strides in bytes.
namespace {
template <typename S, typename K>
void write_kv_quant(const S *k, const S *v, int64_t k_stride_t, int64_t k_stride_h, int64_t v_stride_t,
                    int64_t v_stride_h, K *kc, K *vc, const int64_t *slots, int64_t T, int64_t Hkv, int64_t D,
                    int64_t B, int64_t block_stride, int64_t token_stride, int64_t head_stride) {
#pragma omp parallel for schedule(static) if (T >= 64)
    for (int64_t t = 0; t < T; t++) {
        const int64_t base = slots[t] / B * block_stride + slots[t] % B * token_stride;
        for (int64_t h = 0; h < Hkv; h++) {
            quantize_row(k + t * k_stride_t + h * k_stride_h, D, kc + base + h * head_stride);
            quantize_row(v + t * v_stride_t + h * v_stride_h, D, vc + base + h * head_stride);
        }
    }
}

// The 8-bit formats by the number kernels/cpu.py passes (attention/kv_format.py's `code`).
enum KVCode : int64_t { kE5M2 = 1, kE4M3 = 2, kInt8 = 3 };

template <typename S>
int write_kv8_from(const S *k, const S *v, int64_t kst, int64_t ksh, int64_t vst, int64_t vsh, uint8_t *kc,
                   uint8_t *vc, const int64_t *slots, int64_t T, int64_t Hkv, int64_t D, int64_t B, int64_t bs,
                   int64_t ts, int64_t hs, int64_t code) {
    const auto run = [&](auto *tag) {
        using K = std::remove_pointer_t<decltype(tag)>;
        write_kv_quant(k, v, kst, ksh, vst, vsh, reinterpret_cast<K *>(kc), reinterpret_cast<K *>(vc), slots, T, Hkv,
                       D, B, bs, ts, hs);
        return 0;
    };
    switch (code) {
        case kE5M2: return run(static_cast<E5M2 *>(nullptr));
        case kE4M3: return run(static_cast<E4M3 *>(nullptr));
        case kInt8: return run(static_cast<I8 *>(nullptr));
    }
    return 1;
}
}  // namespace

extern "C" int write_kv8(const void *k, const void *v, int64_t k_stride_t, int64_t k_stride_h, int64_t v_stride_t,
                         int64_t v_stride_h, uint8_t *kc, uint8_t *vc, const int64_t *slots, int64_t T, int64_t Hkv,
                         int64_t D, int64_t B, int64_t block_stride, int64_t token_stride, int64_t head_stride,
                         int64_t src_bf16, int64_t code) {
    if (src_bf16)
        return write_kv8_from(static_cast<const uint16_t *>(k), static_cast<const uint16_t *>(v), k_stride_t,
                              k_stride_h, v_stride_t, v_stride_h, kc, vc, slots, T, Hkv, D, B, block_stride,
                              token_stride, head_stride, code);
    return write_kv8_from(static_cast<const float *>(k), static_cast<const float *>(v), k_stride_t, k_stride_h,
                          v_stride_t, v_stride_h, kc, vc, slots, T, Hkv, D, B, block_stride, token_stride, head_stride,
                          code);
}
