// Linear layers over weights in GGUF block formats (kernels/quant.py builds one library per CPU
// family from this file and calls it through ctypes; no torch headers). The code lives in rooms
// by concern under csrc/ (quant/: types, dots, tiles, AMX paths, the linear entry points); this
// file includes them in order (one translation unit: each room sees those before it).
//
// MXFP4 (quant/mxfp4.h): its integer dots and dequantization, beside the GGUF types' paths.
// quant_dequantize: blocks -> float32 rows, the same float operations as gguf.quants (exact).
// quant_quantize: float32 / bf16 rows -> q8_0 or q4_0 blocks, the bytes of gguf.quants.
// quant_linear_small: y = x @ W.T for a few rows of x: x is quantized once per call into 8-bit
// blocks of 32 (int8 q, float scale dx = max|x|/127, and dx * sum(q) for the minimum terms),
// then each 32 weights of a row give one integer dot product (unsigned or signed codes times
// the int8 activations) and one float32 multiply-add by its scale:
//     y += (A * dx) * dot(code, q)   [+ C * dx * sum(q)   where the type has a minimum]
// Offsets (q4_0: 8, q5_0: 16, q6_k: 32, q8_0 none) are subtracted from the codes (signed x
// signed dot) or, on AVX-512 for q4_0 / q5_0, made minimum terms C = -8 A / -16 A; q6_k's
// per-16 scales multiply the dot's lanes. The integers are exact everywhere: variants and the
// scalar loop differ only in the order of the float sums. The super-block r8 layouts (q4_kr8,
// q5_kr8 on the 256-bit and scalar builds) read x with one scale per 256 instead (Act::qk) and
// apply their sub-block scales in the integers: one multiply-add per super-block (dot_k_r8_256.h).
// In the avx512vnni build, where the CPU has AMX-INT8, from g_amx8.min_rows rows the same dots
// run on AMX tiles (amx8_group: tdpbssd over pieces of 32, q6_k 16; quant_amx_config switches it).
// quant_linear_tiles: y = x @ W.T for many rows of x: tiles of W dequantized into the packed
// layout of cpu_kernels.cpp's GEMM, which then runs on them (its address is passed in); for bf16
// x where AMX-BF16 is on (quant_amxw_config), amxw_linear (weights as A tiles, 8..384 rows) or
// fused_tiles (each thread packs and multiplies its own blocks) instead: the same values.
//
// Builds: `avx512vnni` runs 64 weights per 512-bit vpdpbusd (two blocks, or two sub-blocks of
// a super-block) with scales converted sixteen (groups of 16 blocks: one gather), two or eight at
// a time, and at T = 1 two weight rows per call (all types but q5_0 / q5_1); `avxvnni` and
// `avx2` run 32 per 256-bit dot (scales of groups of 8 blocks in one gather) (VEX vpdpbusd, or maddubs + madd: no pair can saturate, unsigned codes <= 63,
// signed ones as |w| <= 128 times sign-adjusted q); `scalar` plain loops over the same integers.
// A row's weights are read where they lie (the file's layout, or for q4_0 of whole 256-element units
// the loader's Q4_0X: the same bytes rearranged within each 8 blocks, see QType): each thread
// streams its rows, software-prefetched ahead (see prefetch_rows, row_dot2).
#include <algorithm>
#include <atomic>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>
#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#ifndef PAGEDSERVE_VARIANT
#define PAGEDSERVE_VARIANT "unknown"
#endif

// The dots this build runs: PS_DOTS512, the 512-bit ones (dot_avx512vnni.h, dot_k_quants.h, the AMX
// paths: the avx512vnni build); else the 256-bit ones over the r8 layouts (avx2, avxvnni, vnni256) or plain
// loops (scalar). PS_VNNI256: the 256-bit vpdpbusd, in its VEX form (avxvnni: AVX-VNNI) or its EVEX form
// (vnni256, built with PAGEDSERVE_DOTS256: the avxvnni kernels on an AVX-512 VNNI CPU): the same integers.
// The avx512vnni build has the 256-bit r8 kernels too (EVEX form), for its MoE experts (moe/experts.h).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && !defined(PAGEDSERVE_DOTS256)
#define PS_DOTS512 1
#endif
#if defined(__AVXVNNI__)
#define PS_VNNI256 1
inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define PS_VNNI256 1
inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#endif

extern "C" const char *quant_kernel_variant() { return PAGEDSERVE_VARIANT; }

#include "quant/qtypes.h"
#include "common/convert.h"
#include "common/avx512_transpose.h"
#include "common/amx.h"
#include "quant/dequantize_block.h"
#include "quant/activations.h"
#include "quant/prefetch.h"
#include "quant/pieces.h"
#include "quant/dot_avx2.h"
#include "quant/dot_avx512vnni.h"
#include "quant/dot_k_quants.h"
#include "quant/mxfp4.h"
#include "quant/row_dot.h"
#include "quant/dequantize.h"
#include "quant/tiles_pack.h"
#include "quant/parts.h"
#include "quant/share.h"
#include "common/handover.h"
#include "quant/handover.h"
#include "quant/repack_r8.h"
#include "quant/linear_tiles.h"
#include "quant/amx_int8.h"
#include "quant/amxw_units.h"
#include "quant/amxw_linear.h"
#include "quant/dot_q4_1r8.h"
#include "quant/unpack_r8_256.h"
#include "quant/dot_r8_256.h"
#include "quant/dot_mxfp4_r8_256.h"
#include "quant/dot_k_r8_256.h"
#include "quant/linear_small.h"
#include "quant/gemm_r8_256.h"
#include "quant/gemm_q8_0r8_256.h"
#include "moe/experts.h"
#include "quant/quantize.h"
