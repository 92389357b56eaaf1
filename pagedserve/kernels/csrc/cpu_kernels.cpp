// CPU kernels of pagedserve (kernels/cpu.py builds one library per CPU family from this file and
// calls it through ctypes; no torch headers): paged decode and prefill attention over the 16-bit
// and 8-bit KV caches, K/V writes, the GEMMs over packed weights (AVX-512 / AVX2 / AMX-BF16),
// fused element-wise layers, greedy sampling's argmax, LoRA deltas, and every decoder layer in
// one call. The code lives in rooms by concern under csrc/; this file includes them in order (one
// translation unit: each room sees those before it), so every name stays internal to the library.
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include <omp.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#ifndef PAGEDSERVE_VARIANT
#define PAGEDSERVE_VARIANT "native"
#endif
// The build this is (kernels/cpu.py compiles one per CPU family and passes its name), and the
// vector paths the compiler's target flags enabled: what tests check a forced variant ran.
extern "C" const char *kernel_variant() {
    return PAGEDSERVE_VARIANT
#if defined(__AVX512BF16__)
        " (avx512bf16 paths)";
#elif defined(__AVX512F__)
        " (avx512 paths)";
#elif defined(__AVX2__)
        " (avx2 paths)";
#else
        " (scalar paths)";
#endif
}

#include "common/convert.h"
#include "common/handover.h"
#include "common/avx512_transpose.h"
#include "common/amx.h"
#include "attention/layout.h"
#include "attention/kv8_format.h"
#include "attention/decode_scalar.h"
#include "attention/decode_avx512.h"
#include "common/vec.h"
#include "attention/decode.h"
#include "attention/kv_write.h"
#include "gemm/packed_strips.h"
#include "gemm/packed_bf16_avx512bf16.h"
#include "gemm/amx_bf16.h"
#include "gemm/packed_f32_avx512.h"
#include "gemm/packed_fma.h"
#include "layers/elementwise.h"
#include "layers/argmax.h"
#include "attention/prefill.h"
#include "attention/paged_attention.h"
#include "layers/projection.h"
#include "lora/shrink_expand.h"
#include "lora/dp_bf16.h"
#include "lora/amx.h"
#include "lora/plan.h"
#include "lora/handover.h"
#include "layers/moe_block.h"
#include "layers/decoder_layers.h"
