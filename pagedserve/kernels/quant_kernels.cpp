// Linear layers over weights in GGUF block formats (kernels/quant.py builds one library per CPU
// family from this file and calls it through ctypes; no torch headers).
//
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
// scalar loop differ only in the order of the float sums.
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
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>
#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#ifndef PAGEDSERVE_VARIANT
#define PAGEDSERVE_VARIANT "unknown"
#endif

extern "C" const char *quant_kernel_variant() { return PAGEDSERVE_VARIANT; }

namespace {

// kernels/quant.py's QTYPES order, then Q4_0X: q4_0 repacked at load (quant.repack) in units of 8
// blocks (256 elements, 144 bytes, the blocks' bytes rearranged): their 8 fp16 d, then two 64-byte
// vectors of nibbles whose byte 8 l + j of vector k is the block l's qs[8 k + j] (elements 8 k + j
// low, 16 + 8 k + j high). A 512-bit dot then has each 32-bit lane in one block (lanes 2l, 2l + 1:
// block l), so the unit's 16 int32 lanes take one conversion and one multiply-add by the 8 scales,
// where the file's layout costs that per two blocks (and a gather per 16): about 2x the T = 1 dot's
// compute rate (1.7B shape, in L2). The activations come permuted to match (Act::qx).
// Then Q4_1R8: q4_1 with 8 rows interleaved per block (quant.repack, rows a multiple of 8): the
// data is [rows / 8][blocks * 160], a unit one block of 8 rows: their 8 fp16 d, their 8 fp16 m,
// then two 64-byte vectors whose byte 8 l + i of vector k is row l's qs[8 k + i]. One 512-bit dot
// covers a block of 8 rows (lanes 2l, 2l + 1: row l) against 8-byte broadcasts of the activations;
// kElems / kBytes count its bytes per row and block as q4_1's (the same bytes). r8_group computes
// it; amxw_rows dequantizes it; every other path reads its rows unpacked (PlainParts).
enum QType { Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, Q4_0X, Q4_1R8, kNumTypes };
constexpr int64_t kElems[kNumTypes] = {32, 32, 32, 32, 32, 256, 256, 256, 256, 32};
constexpr int64_t kBytes[kNumTypes] = {18, 20, 22, 24, 34, 144, 176, 210, 144, 20};

// f(std::integral_constant<int, QT>{}) for the run-time type qt: the one switch behind every
// per-type table of template instances (a default result, null for a pointer, for none).
template <typename F> auto with_qtype(int qt, F &&f) {
    switch (qt) {
    case Q4_0: return f(std::integral_constant<int, Q4_0>{});
    case Q4_1: return f(std::integral_constant<int, Q4_1>{});
    case Q5_0: return f(std::integral_constant<int, Q5_0>{});
    case Q5_1: return f(std::integral_constant<int, Q5_1>{});
    case Q8_0: return f(std::integral_constant<int, Q8_0>{});
    case Q4_K: return f(std::integral_constant<int, Q4_K>{});
    case Q5_K: return f(std::integral_constant<int, Q5_K>{});
    case Q6_K: return f(std::integral_constant<int, Q6_K>{});
    case Q4_0X: return f(std::integral_constant<int, Q4_0X>{});
    }
    return decltype(f(std::integral_constant<int, Q4_0>{}))();
}

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

float bf16_to_f32(uint16_t h) {
    const uint32_t bits = uint32_t(h) << 16;
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
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

// q4_k / q5_k: 12 bytes -> 8 six-bit scales and mins.
void k_scales(const uint8_t *s, int sc[8], int mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 2) & 48);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 48);
    }
}

// k_scales four bytes at a time: the 8 scales' bytes and the 8 mins' bytes (byte j: sub-block j).
void k_scale_bytes(const uint8_t *s, uint64_t &sc, uint64_t &mn) {
    uint32_t s0, s1, s2;
    std::memcpy(&s0, s, 4);
    std::memcpy(&s1, s + 4, 4);
    std::memcpy(&s2, s + 8, 4);
    sc = uint64_t(s0 & 0x3f3f3f3fu) | uint64_t((s2 & 0x0f0f0f0fu) | ((s0 >> 2) & 0x30303030u)) << 32;
    mn = uint64_t(s1 & 0x3f3f3f3fu) | uint64_t(((s2 >> 4) & 0x0f0f0f0fu) | ((s1 >> 2) & 0x30303030u)) << 32;
}

// ---- dequantize: one block into kElems floats -------------------------------------------------
// Q4_0X (see QType): byte i (elements i, low nibble, and i + 16, high) of block l of the unit at b.
inline uint8_t q4_0x_byte(const uint8_t *b, int l, int i) { return b[16 + 64 * (i / 8) + 8 * l + i % 8]; }

void dequantize_block(int qt, const uint8_t *b, float *y) {
    switch (qt) {
    case Q8_0: {
        const float d = f16(b);
        for (int i = 0; i < 32; i++) y[i] = float(int8_t(b[2 + i])) * d;
        return;
    }
    case Q4_0X: {       // block l: d at 2 l, qs[i] at q4_0x_byte(b, l, i)
        for (int l = 0; l < 8; l++) {
            const float d = f16(b + 2 * l);
            for (int i = 0; i < 16; i++) {
                const uint8_t q = q4_0x_byte(b, l, i);
                y[32 * l + i] = d * float((q & 15) - 8);
                y[32 * l + i + 16] = d * float((q >> 4) - 8);
            }
        }
        return;
    }
    case Q4_0: case Q4_1: {
        const float d = f16(b);
        const uint8_t *qs = b + (qt == Q4_0 ? 2 : 4);
        if (qt == Q4_0) {
            for (int i = 0; i < 16; i++) {
                y[i] = d * float((qs[i] & 15) - 8);
                y[i + 16] = d * float((qs[i] >> 4) - 8);
            }
        } else {
            const float m = f16(b + 2);
            for (int i = 0; i < 16; i++) {
                y[i] = d * float(qs[i] & 15) + m;
                y[i + 16] = d * float(qs[i] >> 4) + m;
            }
        }
        return;
    }
    case Q5_0: case Q5_1: {
        const float d = f16(b);
        const int off = qt == Q5_0 ? 2 : 4;
        uint32_t qh;
        std::memcpy(&qh, b + off, 4);
        const uint8_t *qs = b + off + 4;
        for (int i = 0; i < 16; i++) {
            const int q0 = (qs[i] & 15) | (((qh >> i) & 1) << 4), q1 = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
            if (qt == Q5_0) {
                y[i] = d * float(q0 - 16);
                y[i + 16] = d * float(q1 - 16);
            } else {
                const float m = f16(b + 2);
                y[i] = d * float(q0) + m;
                y[i + 16] = d * float(q1) + m;
            }
        }
        return;
    }
    case Q4_K: case Q5_K: {
        const float d = f16(b), dmin = f16(b + 2);
        int sc[8], mn[8];
        k_scales(b + 4, sc, mn);
        const uint8_t *qh = b + 16, *qs = b + (qt == Q4_K ? 16 : 48);
        for (int j = 0; j < 8; j++) {
            const float dj = d * float(sc[j]), mj = dmin * float(mn[j]);
            const uint8_t *q = qs + (j / 2) * 32;
            const int shift = (j % 2) * 4;
            for (int l = 0; l < 32; l++) {
                int v = (q[l] >> shift) & 15;
                if (qt == Q5_K) v |= ((qh[l] >> j) & 1) << 4;
                y[j * 32 + l] = dj * float(v) - mj;
            }
        }
        return;
    }
    case Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = reinterpret_cast<const int8_t *>(b + 192);
        const float d = f16(b + 208);
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < 32; l++) {
                    const int e = 128 * h + 32 * k + l;
                    const int lo = (ql[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 15;
                    const int hi = (qh[32 * h + l] >> (2 * k)) & 3;
                    y[e] = (d * float(sc[e / 16])) * float((lo | (hi << 4)) - 32);
                }
        return;
    }
    }
}

// ---- activations: 8-bit blocks of 32 ------------------------------------------------------------
// Storage of the quantized activations, 64-byte aligned (malloc's 16 split a 512-bit load's
// line three times in four: measured 13% slower at T = 1 over weights in L2).
template <class T>
struct Aligned64 {
    using value_type = T;
    Aligned64() = default;
    template <class U>
    Aligned64(const Aligned64<U> &) {}
    T *allocate(size_t n) { return static_cast<T *>(::operator new(n * sizeof(T), std::align_val_t(64))); }
    void deallocate(T *p, size_t) { ::operator delete(p, std::align_val_t(64)); }
    template <class U>
    bool operator==(const Aligned64<U> &) const { return true; }
    template <class U>
    bool operator!=(const Aligned64<U> &) const { return false; }
};

struct Act {
    const int8_t *q;     // [T][K]
    const float *d;      // [T][K/32]
    const float *ds;     // [T][K/32]: d * sum(q)
    int64_t K, nb;
    // AVX-512 only (else null). start[type], for the types whose codes carry an offset (q4_0: 8,
    // q5_0: 16, q8_0: 128 (its codes made unsigned), q6_k: 32) and that the call multiplies:
    // -offset * (the sums of each 4 consecutive q) [T][K/4], vpdpbusd's lanes, so that a dot of
    // the unsigned codes started from them has the offset subtracted, in the integers.
    const int32_t *start[kNumTypes];
    // AVX-512 only, where a part is Q4_0X (else null): q [T][K] with each 256 elements in Q4_0X's
    // order: vector m (64 bytes) of a unit holds at bytes 8 l .. 8 l + 7 block l's elements
    // 8 c .. 8 c + 7, c = {0, 2, 1, 3}[m] (what low, then high nibbles of the weights' vector m / 2 meet).
    const int8_t *qx = nullptr;
};

constexpr int kOffset[kNumTypes] = {8, 0, 16, 0, 128, 0, 0, 32, 0, 0};     // what start[type] subtracts

// One block: as quant.py's quantize_activations (d = amax / 127; q = x * (1/d), half to even).
void quantize_block(const float *x, int8_t *q, float *d_out, float *ds_out) {
    float amax = 0.f;
    for (int i = 0; i < 32; i++) amax = std::max(amax, std::fabs(x[i]));
    const float d = amax / 127.f, inv = d != 0.f ? 1.f / d : 0.f;
    int sum = 0;
#if defined(__AVX2__)
    for (int i = 0; i < 32; i += 8) {
        const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(inv)));
        alignas(32) int32_t tmp[8];
        _mm256_store_si256(reinterpret_cast<__m256i *>(tmp), v);
        for (int k = 0; k < 8; k++) {
            q[i + k] = int8_t(tmp[k]);
            sum += tmp[k];
        }
    }
#else
    for (int i = 0; i < 32; i++) {
        const int v = int(std::nearbyint(x[i] * inv));
        q[i] = int8_t(v);
        sum += v;
    }
#endif
    *d_out = d;
    *ds_out = d * float(sum);
}

// Block j of activation row t.
void quantize_one(const void *x, int64_t ldx, bool bf16, int64_t t, int64_t j, int64_t K, int8_t *q, float *d,
                  float *ds) {
    const int64_t nb = K / 32;
    float buf[32];
    const float *src;
    if (bf16) {
        const uint16_t *xr = static_cast<const uint16_t *>(x) + t * ldx + j * 32;
        for (int i = 0; i < 32; i++) buf[i] = bf16_to_f32(xr[i]);
        src = buf;
    } else {
        src = static_cast<const float *>(x) + t * ldx + j * 32;
    }
    quantize_block(src, q + t * K + j * 32, d + t * nb + j, ds + t * nb + j);
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
// quantize_one for one block in AVX-512 registers, and its Act::start lanes: the same values (the maximum
// is exact in any order, the rest the same float operations per element; the sums integers):
// about 5 us less per call at K = 2048 than the scalar loops (measured).
inline void quantize_start_one(const void *x, int64_t ldx, bool bf16, int64_t t, int64_t j, const Act &a) {
    __m512 v0, v1;
    if (bf16) {
        const uint16_t *xr = static_cast<const uint16_t *>(x) + t * ldx + j * 32;
        const __m512i h = _mm512_loadu_si512(xr);
        v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
        v1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
    } else {
        const float *xr = static_cast<const float *>(x) + t * ldx + j * 32;
        v0 = _mm512_loadu_ps(xr);
        v1 = _mm512_loadu_ps(xr + 16);
    }
    const __m512 mag = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1));
    const float amax = _mm512_reduce_max_ps(mag);
    const float d = amax / 127.f, inv = d != 0.f ? 1.f / d : 0.f;
    const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
    const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
    const __m256i q = _mm256_set_m128i(_mm512_cvtepi32_epi8(i1), _mm512_cvtepi32_epi8(i0));
    int8_t *qo = const_cast<int8_t *>(a.q) + t * a.K + j * 32;
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(qo), q);
    const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
    const_cast<float *>(a.d)[t * a.nb + j] = d;
    const_cast<float *>(a.ds)[t * a.nb + j] = d * float(sum);
    if (a.qx != nullptr) {          // block j's 8-byte chunks c into vectors m = {0, 2, 1, 3}[c] of its unit
        int8_t *ux = const_cast<int8_t *>(a.qx) + t * a.K + j / 8 * 256 + 8 * (j % 8);
        const __m256i order = _mm256_setr_epi64x(0, 2, 1, 3);
        alignas(32) int64_t chunks[4];
        _mm256_store_si256(reinterpret_cast<__m256i *>(chunks), _mm256_permutexvar_epi64(order, q));
        for (int m = 0; m < 4; m++) std::memcpy(ux + 64 * m, &chunks[m], 8);
    }
    const __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), q);   // each 4 q's sum
    for (int qt = 0; qt < kNumTypes; qt++)
        if (a.start[qt] != nullptr)
            _mm256_storeu_si256(reinterpret_cast<__m256i *>(const_cast<int32_t *>(a.start[qt]) + t * (a.K / 4) + j * 8),
                                _mm256_mullo_epi32(sums, _mm256_set1_epi32(-kOffset[qt])));
}
#endif

// ---- software prefetch of the weight stream (decode) --------------------------------------------
// A thread's rows are one forward stream, but the hardware prefetchers stop at each 4 KiB page and
// are trained again; a dot kernel at T = 1 keeps too few loads in flight to hide the miss latency
// itself (measured: 1.5-1.9x slower over weights in L3 / DRAM than in L2). So each pass asks for
// the same bytes of the rows about kPrefetchBytes ahead while it multiplies the current ones
// (row_dot2: the next pass's rows).
constexpr int64_t kPrefetchBytes = 4096;
inline int64_t prefetch_rows(int64_t ldw, int64_t pass_rows) {    // rows ahead: at least the next pass
    return std::max<int64_t>(pass_rows, (kPrefetchBytes + ldw - 1) / std::max<int64_t>(ldw, 1));
}
// bytes [0, n) of `rows` rows at p, ldw apart (the lines they touch, give or take the last one,
// which the next call's first prefetch covers).
inline void prefetch_bytes(const uint8_t *p, int64_t ldw, int rows, int64_t n) {
    for (int r = 0; r < rows; r++)
        for (int64_t l = 0; l < n; l += 64) __builtin_prefetch(p + r * ldw + l, 0, 3);
}

// ---- the dot products of one weight row with NT activation rows ---------------------------------
// Each type's decoder yields, per 32 elements j of the row: the codes, the float A (scale) and
// C (minimum term, or 0), and for q6_k two integer scales of 16 elements each.
#if defined(__AVX2__)
__m256i dot_us(__m256i u, __m256i s) {       // 8 int32 lanes, each the sum of 4 adjacent u * s
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
__m256i dot_ss(__m256i w, __m256i s) { return dot_us(_mm256_sign_epi8(w, w), _mm256_sign_epi8(s, w)); }

float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

__m256i nibbles16(const uint8_t *p) {       // 16 bytes -> [16 low nibbles | 16 high nibbles]
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p)), m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

__m256i bits32(const uint8_t *p) {          // 32 bits (little-endian) -> 32 bytes of 0x10 or 0
    uint32_t qh;
    std::memcpy(&qh, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(int(qh)), _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                      0x0101010101010101, 0x0000000000000000));
    const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// One 32-element piece of a weight row, decoded: its codes (signed where the type has an
// offset, already subtracted), its scale A and minimum term C, q6_k's two integer scales of 16.
struct Piece {
    __m256i codes;
    float A, C;
    int sc0, sc1;
};

template <int QT>
constexpr bool kSigned = QT == Q4_0 || QT == Q5_0 || QT == Q8_0 || QT == Q6_K || QT == Q4_0X;
template <int QT>
constexpr bool kMin = QT == Q4_1 || QT == Q5_1 || QT == Q4_K || QT == Q5_K;
template <int QT>
constexpr int kPieces = QT == Q4_K || QT == Q5_K || QT == Q6_K || QT == Q4_0X ? 8 : 1;

// The pieces of one block (super-block) at b.
template <int QT>
inline void decode(const uint8_t *b, Piece *p) {
    if constexpr (QT == Q8_0) {
        p[0] = {_mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 2)), f16(b), 0.f, 1, 1};
    } else if constexpr (QT == Q4_0) {
        p[0] = {_mm256_sub_epi8(nibbles16(b + 2), _mm256_set1_epi8(8)), f16(b), 0.f, 1, 1};
    } else if constexpr (QT == Q4_1) {
        p[0] = {nibbles16(b + 4), f16(b), f16(b + 2), 1, 1};
    } else if constexpr (QT == Q5_0) {
        p[0] = {_mm256_sub_epi8(_mm256_or_si256(nibbles16(b + 6), bits32(b + 2)), _mm256_set1_epi8(16)), f16(b), 0.f,
                1, 1};
    } else if constexpr (QT == Q5_1) {
        p[0] = {_mm256_or_si256(nibbles16(b + 8), bits32(b + 4)), f16(b), f16(b + 2), 1, 1};
    } else if constexpr (QT == Q4_K || QT == Q5_K) {
        const float d = f16(b), dmin = f16(b + 2);
        uint64_t scb, mnb;
        k_scale_bytes(b + 4, scb, mnb);
        uint8_t sc[8], mn[8];
        std::memcpy(sc, &scb, 8);
        std::memcpy(mn, &mnb, 8);
        const uint8_t *qs = b + (QT == Q4_K ? 16 : 48);
        const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
        __m256i qh = QT == Q5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 16)) : __m256i();
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qs + 32 * c));
            __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            if constexpr (QT == Q5_K) {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(qh, one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 1), one), 4));
                qh = _mm256_srli_epi16(qh, 2);
            }
            p[2 * c] = {lo, d * float(sc[2 * c]), -(dmin * float(mn[2 * c])), 1, 1};
            p[2 * c + 1] = {hi, d * float(sc[2 * c + 1]), -(dmin * float(mn[2 * c + 1])), 1, 1};
        }
    } else if constexpr (QT == Q4_0X) {     // block l's qs: 8 bytes at 16 + 8 l of each vector
        for (int l = 0; l < 8; l++) {
            uint64_t q0, q1;
            std::memcpy(&q0, b + 16 + 8 * l, 8);
            std::memcpy(&q1, b + 80 + 8 * l, 8);
            const __m128i v = _mm_set_epi64x(int64_t(q1), int64_t(q0)), m = _mm_set1_epi8(15);
            const __m256i n = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
            p[l] = {_mm256_sub_epi8(n, _mm256_set1_epi8(8)), f16(b + 2 * l), 0.f, 1, 1};
        }
    } else if constexpr (QT == Q6_K) {
        const int8_t *sc = reinterpret_cast<const int8_t *>(b + 192);
        const float d = f16(b + 208);
        const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
        for (int h = 0; h < 2; h++) {
            const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 64 * h));
            const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 128 + 32 * h));
            const __m256i low[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                                    _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                    _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
            for (int k = 0; k < 4; k++) {
                const __m256i high = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), m2);
                const int g = 8 * h + 2 * k;       // the 16-element groups of these 32
                p[4 * h + k] = {_mm256_sub_epi8(_mm256_or_si256(low[k], _mm256_slli_epi16(high, 4)), off), d, 0.f,
                                sc[g], sc[g + 1]};
            }
        }
    }
}

// A row's weights as floats from the decoded pieces: A * code (+ C), the float operations of
// gguf.quants (q6_k: (d * scale) * code per 16), so the values are the same bit for bit.
template <int QT>
void dequantize_row_vec(const uint8_t *w, int64_t K, float *y) {
    constexpr int P = kPieces<QT>;
    for (int64_t u = 0; u < K / kElems[QT]; u++) {
        Piece p[P];
        decode<QT>(w + u * kBytes[QT], p);
        for (int i = 0; i < P; i++) {
            float *dst = y + (u * P + i) * 32;
            const __m128i lo = _mm256_castsi256_si128(p[i].codes), hi = _mm256_extracti128_si256(p[i].codes, 1);
            const __m256 q[4] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)),
                                 _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))),
                                 _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)),
                                 _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)))};
            for (int k = 0; k < 4; k++) {
                float a = p[i].A;
                if constexpr (QT == Q6_K) a = p[i].A * float(k < 2 ? p[i].sc0 : p[i].sc1);
                __m256 v = _mm256_mul_ps(_mm256_set1_ps(a), q[k]);
                if constexpr (kMin<QT>) v = _mm256_add_ps(v, _mm256_set1_ps(p[i].C));
                _mm256_storeu_ps(dst + 8 * k, v);
            }
        }
    }
}

template <int NT>
struct Acc {
    __m256 v[NT];        // sums of the 256-bit pieces
    float s[NT];         // their minimum terms
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    __m512 w[NT];        // sums of the 512-bit pairs
    __m128 m2[NT];       // minimum terms of pairs of 32-element blocks
    __m256 m8[NT];       // minimum terms of super-blocks' 8 sub-blocks
#endif
    Acc() {
        for (int t = 0; t < NT; t++) {
            v[t] = _mm256_setzero_ps();
            s[t] = 0.f;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
            w[t] = _mm512_setzero_ps();
            m2[t] = _mm_setzero_ps();
            m8[t] = _mm256_setzero_ps();
#endif
        }
    }
    float total(int t) const {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        const __m256 wide = _mm256_add_ps(_mm512_castps512_ps256(w[t]),
                                          _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w[t]), 1)));
        const __m256 mins = _mm256_add_ps(m8[t], _mm256_zextps128_ps256(m2[t]));
        return hsum(_mm256_add_ps(_mm256_add_ps(v[t], wide), mins)) + s[t];
#else
        return hsum(v[t]) + s[t];
#endif
    }
};

// acc[t] += (A * dx) * dot(codes, q[t]) (+ C * dx * sum q[t]) for one piece: q0, d0, ds0 point
// at activation row t0's block of this piece.
template <int QT, int NT>
inline void accumulate(Acc<NT> &acc, const Act &a, const int8_t *q0, const float *d0, const float *ds0,
                       const Piece &p) {
    __m256i lanes = _mm256_setzero_si256();
    if constexpr (QT == Q6_K) lanes = _mm256_set_epi32(p.sc1, p.sc1, p.sc1, p.sc1, p.sc0, p.sc0, p.sc0, p.sc0);
    for (int t = 0; t < NT; t++) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(q0 + t * a.K));
        __m256i dot = kSigned<QT> ? dot_ss(p.codes, x) : dot_us(p.codes, x);
        if constexpr (QT == Q6_K) dot = _mm256_mullo_epi32(dot, lanes);
        acc.v[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(p.A * d0[t * a.nb]), acc.v[t]);
        if constexpr (kMin<QT>) acc.s[t] += p.C * ds0[t * a.nb];
    }
}

#if !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
// The codes of one 32-element block as decode<QT> gives them (signed where the type has an offset).
template <int QT>
inline __m256i codes32(const uint8_t *b) {
    if constexpr (QT == Q8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 2));
    else if constexpr (QT == Q4_0) return _mm256_sub_epi8(nibbles16(b + 2), _mm256_set1_epi8(8));
    else if constexpr (QT == Q4_1) return nibbles16(b + 4);
    else if constexpr (QT == Q5_0)
        return _mm256_sub_epi8(_mm256_or_si256(nibbles16(b + 6), bits32(b + 2)), _mm256_set1_epi8(16));
    else return _mm256_or_si256(nibbles16(b + 8), bits32(b + 4));
}

// Eight 32-element blocks (b0 and the 7 after it) against one or two activation rows (AVX2 /
// AVX-VNNI): the blocks' fp16 d (and m) in one gather, converted and multiplied by the 8 dx at
// once, the minimum terms as one 8-wide multiply-add; per block one dot, one conversion, one
// spread and one multiply-add, in two chains.
template <int QT, int NT>
inline void group8(Acc<NT> &acc, const Act &a, const int8_t *q0, const float *d0, const float *ds0,
                   const uint8_t *b0) {
    constexpr int B = int(kBytes[QT]);
    const __m256i dm = _mm256_i32gather_epi32(reinterpret_cast<const int *>(b0),
                                              _mm256_setr_epi32(0, B, 2 * B, 3 * B, 4 * B, 5 * B, 6 * B, 7 * B), 1);
    auto halves = [&](int from) {        // the 16-bit halves at byte `from` of each lane, as 8 floats
        const __m256i pick = _mm256_setr_epi8(from, from + 1, from + 4, from + 5, from + 8, from + 9, from + 12,
                                              from + 13, -1, -1, -1, -1, -1, -1, -1, -1, from, from + 1, from + 4,
                                              from + 5, from + 8, from + 9, from + 12, from + 13, -1, -1, -1, -1, -1,
                                              -1, -1, -1);
        const __m256i h = _mm256_shuffle_epi8(dm, pick);
        return _mm256_cvtph_ps(_mm_unpacklo_epi64(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
    };
    const __m256 A = halves(0);
    __m256 S[NT], other[NT];
    for (int t = 0; t < NT; t++) {
        S[t] = _mm256_mul_ps(A, _mm256_loadu_ps(d0 + t * a.nb));
        if constexpr (kMin<QT>) acc.v[t] = _mm256_fmadd_ps(halves(2), _mm256_loadu_ps(ds0 + t * a.nb), acc.v[t]);
        other[t] = _mm256_setzero_ps();
    }
    for (int i = 0; i < 8; i++) {
        const __m256i codes = codes32<QT>(b0 + i * B);
        for (int t = 0; t < NT; t++) {
            const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(q0 + t * a.K + 32 * i));
            const __m256i dot = kSigned<QT> ? dot_ss(codes, x) : dot_us(codes, x);
            __m256 &sum = i % 2 ? other[t] : acc.v[t];
            sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_permutevar8x32_ps(S[t], _mm256_set1_epi32(i)), sum);
        }
    }
    for (int t = 0; t < NT; t++) acc.v[t] = _mm256_add_ps(acc.v[t], other[t]);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
// ---- AVX-512 VNNI: 64 elements (two pieces) per dot product, scales two or eight at a time ----
// The integer dot of 64 unsigned codes with 64 activations, as floats (16 lanes of 4).
inline __m512 dot64(__m512i codes, const int8_t *q) {
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, _mm512_loadu_si512(q)));
}

// Two 32-element blocks (blocks u, u + 1 of the row, at b0) against activation rows t0 ..:
// codes in the activations' order [0, 64), unsigned; for one or two rows (decode) their
// offsets (q4_0, q5_0, q8_0) are taken off in the integers by a dot started from Act::start,
// for more (where Act::start's loads would cost more than they save) as C * ds (q4_0, q5_0:
// C = -offset * A) or, q8_0, by signed codes (|w| times q with w's sign); q6_k always from
// Act::start. The two scales A times the two dx in one 128-bit multiply, spread to the dot's
// lanes; the minimums (q4_1, q5_1) as C * ds.
template <int QT, int NT>
constexpr bool kStarts = kOffset[QT] != 0 && (QT == Q6_K || NT <= 2);

template <int QT, int NT>
inline __m512i offset_start(const Act &a, int64_t row, int64_t e) {   // Act::start at row's element e
    if constexpr (!kStarts<QT, NT>) return _mm512_setzero_si512();
    else return _mm512_loadu_si512(a.start[QT] + row * (a.K / 4) + e / 4);
}

inline __m512i nibbles64(const uint8_t *q0, const uint8_t *q1) {   // two blocks' 16 bytes -> [lo0 hi0 lo1 hi1]
    __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i *>(q0)));
    v = _mm512_mask_broadcast_i32x4(v, 0xFF00, _mm_loadu_si128(reinterpret_cast<const __m128i *>(q1)));
    v = _mm512_mask_srli_epi16(v, 0xFF00FF00u, v, 4);
    return _mm512_and_si512(v, _mm512_set1_epi8(15));
}

inline __m128 f16x2(const uint8_t *p0, const uint8_t *p1) {     // [f16 at p0, f16 at p1, 0, 0]
    uint16_t h0, h1;
    std::memcpy(&h0, p0, 2);
    std::memcpy(&h1, p1, 2);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(int(uint32_t(h0) | (uint32_t(h1) << 16))));
}

inline __m128 load2(const float *p) { return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double *>(p))); }

// The 64 codes of blocks b0, b0 + 1 as vpdpbusd's unsigned operand (see pair32); `negative`:
// q8_0's signs where Act::start does not take its offset.
template <int QT, int NT>
inline __m512i codes64(const uint8_t *b0, __mmask64 &negative) {
    const uint8_t *b1 = b0 + kBytes[QT];
    __m512i codes;
    if constexpr (QT == Q8_0) {
        codes = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(b0 + 2))),
                                   _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b1 + 2)), 1);
        if constexpr (kStarts<QT, NT>) {
            codes = _mm512_xor_si512(codes, _mm512_set1_epi8(char(0x80)));   // w + 128; the 128 through Act::start
        } else {
            negative = _mm512_movepi8_mask(codes);
            codes = _mm512_abs_epi8(codes);
        }
    } else if constexpr (QT == Q4_0 || QT == Q4_1) {
        constexpr int o = QT == Q4_0 ? 2 : 4;       // the nibbles
        codes = nibbles64(b0 + o, b1 + o);
    } else {                                        // q5_0, q5_1: the fifth bits as a byte mask
        constexpr int h = QT == Q5_0 ? 2 : 4;       // qh
        uint32_t h0, h1;
        std::memcpy(&h0, b0 + h, 4);
        std::memcpy(&h1, b1 + h, 4);
        const __mmask64 fifth = __mmask64(h0) | (__mmask64(h1) << 32);
        codes = _mm512_or_si512(nibbles64(b0 + h + 4, b1 + h + 4), _mm512_maskz_mov_epi8(fifth, _mm512_set1_epi8(0x10)));
    }
    return codes;
}

template <int QT, int NT>
inline void pair32(Acc<NT> &acc, const Act &a, const int8_t *q0, const float *d0, const float *ds0, const int32_t *st0,
                   const uint8_t *b0) {
    const uint8_t *b1 = b0 + kBytes[QT];
    __mmask64 negative = 0;                         // q8_0 without Act::start: w's signs
    const __m512i codes = codes64<QT, NT>(b0, negative);
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    if constexpr ((QT == Q4_1 || QT == Q5_1) && NT <= 2) {
        // One or two rows: d, m of both blocks in one conversion: [d0 m0 d1 m1] times [dx0 ds0 dx1 ds1]: the two
        // scales (spread to the dot's lanes) and the two minimum terms (lanes 1, 3 of m2).
        uint32_t w0, w1;
        std::memcpy(&w0, b0, 4);
        std::memcpy(&w1, b1, 4);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi64_si128(int64_t(uint64_t(w0) | (uint64_t(w1) << 32))));
        const __m512i spread02 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
        for (int t = 0; t < NT; t++) {
            const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, _mm512_loadu_si512(q0 + t * a.K));
            const __m128 P = _mm_mul_ps(dm, _mm_unpacklo_ps(load2(d0 + t * a.nb), load2(ds0 + t * a.nb)));
            acc.w[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(spread02, _mm512_castps128_ps512(P)),
                                       acc.w[t]);
            acc.m2[t] = _mm_mask_add_ps(acc.m2[t], 0xA, acc.m2[t], P);
        }
        return;
    }
    const __m128 A = f16x2(b0, b1);
    constexpr bool kOffsetTerm = (QT == Q4_0 || QT == Q5_0) && !kStarts<QT, NT>;
    const __m128 C = QT == Q4_1 || QT == Q5_1 ? f16x2(b0 + 2, b1 + 2)
                     : kOffsetTerm ? _mm_mul_ps(A, _mm_set1_ps(-float(kOffset[QT]))) : _mm_setzero_ps();
    for (int t = 0; t < NT; t++) {
        __m512i x = _mm512_loadu_si512(q0 + t * a.K);
        if constexpr (QT == Q8_0 && !kStarts<QT, NT>) x = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
        const __m512i dot = _mm512_dpbusd_epi32(
            kStarts<QT, NT> ? _mm512_loadu_si512(st0 + t * (a.K / 4)) : _mm512_setzero_si512(), codes, x);
        const __m512 scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(A, load2(d0 + t * a.nb))));
        acc.w[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc.w[t]);
        if constexpr (QT == Q4_1 || QT == Q5_1 || kOffsetTerm)
            acc.m2[t] = _mm_fmadd_ps(C, load2(ds0 + t * a.nb), acc.m2[t]);
    }
}

// Sixteen 32-element blocks (b0 and the 15 after it) against activation rows t0 ..: the blocks'
// fp16 d (and m: q4_1, q5_1) in one gather, converted and multiplied by the 16 dx of each row at
// once, the minimum terms as one 16-wide multiply-add; then per pair of blocks one dot, one
// conversion, one spread of two scales and one multiply-add (pair32 spends about as much again
// per pair on its two scales). Up to four chains of sums (one or two rows), so the adds'
// latency does not bound. R weight rows (b0, b0 + ldw, ..: acc[r]) share each activation load.
template <int QT, int NT, int R = 1>
inline void group16(Acc<NT> *acc, const Act &a, const int8_t *q0, const float *d0, const float *ds0, const int32_t *st0,
                    const uint8_t *b0, int64_t ldw = 0) {
    constexpr int B = int(kBytes[QT]);
    const __m512i at = _mm512_setr_epi32(0, B, 2 * B, 3 * B, 4 * B, 5 * B, 6 * B, 7 * B, 8 * B, 9 * B, 10 * B, 11 * B,
                                         12 * B, 13 * B, 14 * B, 15 * B);
    constexpr bool kOffsetTerm = (QT == Q4_0 || QT == Q5_0) && !kStarts<QT, NT>;
    constexpr bool kMinTerm = QT == Q4_1 || QT == Q5_1 || kOffsetTerm;
    constexpr int CH = NT * R == 1 ? 4 : NT * R == 2 ? 2 : 1;  // chains of sums per row
    // q4_1: each block's high nibbles taken in place (16 times the code: one AND, no masked shift),
    // their lanes scaled by S / 16 (exact: a power of two), the same products
    constexpr bool kHigh16 = QT == Q4_1;
    __m512 S[R][NT], S16[R][NT], sum[CH][R][NT];
    for (int r = 0; r < R; r++) {
        const __m512i dm = _mm512_i32gather_epi32(at, b0 + r * ldw, 1);   // each block's first 4 bytes: d (and m)
        const __m512 A = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
        __m512 C = _mm512_setzero_ps();
        if constexpr (QT == Q4_1 || QT == Q5_1) C = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
        if constexpr (kOffsetTerm) C = _mm512_mul_ps(A, _mm512_set1_ps(-float(kOffset[QT])));
        for (int t = 0; t < NT; t++) {
            S[r][t] = _mm512_mul_ps(A, _mm512_loadu_ps(d0 + t * a.nb));
            if constexpr (kHigh16) S16[r][t] = _mm512_mul_ps(S[r][t], _mm512_set1_ps(1.f / 16));
            sum[0][r][t] = kMinTerm ? _mm512_fmadd_ps(C, _mm512_loadu_ps(ds0 + t * a.nb), acc[r].w[t]) : acc[r].w[t];
            for (int c = 1; c < CH; c++) sum[c][r][t] = _mm512_setzero_ps();
        }
    }
    for (int i = 0; i < 8; i++) {                              // blocks 2i, 2i + 1
        __mmask64 negative[R] = {};
        __m512i codes[R];
        for (int r = 0; r < R; r++) {
            const uint8_t *b = b0 + r * ldw + 2 * i * B;
            if constexpr (kHigh16) {      // [qs0 qs0 qs1 qs1] & [15 | 0xF0 | 15 | 0xF0]
                __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i *>(b + 4)));
                v = _mm512_mask_broadcast_i32x4(v, 0xFF00, _mm_loadu_si128(reinterpret_cast<const __m128i *>(b + B + 4)));
                codes[r] = _mm512_and_si512(v, _mm512_mask_blend_epi32(0xF0F0, _mm512_set1_epi8(15),
                                                                                _mm512_set1_epi8(char(0xF0))));
            } else {
                codes[r] = codes64<QT, NT>(b, negative[r]);
            }
        }
        // the two blocks' scales to the dot's lanes (kHigh16: S / 16, index + 16, on the high nibbles' lanes)
        const int h = kHigh16 ? 16 : 0;
        const __m512i spread = _mm512_setr_epi32(2 * i, 2 * i, 2 * i, 2 * i, 2 * i + h, 2 * i + h, 2 * i + h, 2 * i + h,
                                                 2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1 + h, 2 * i + 1 + h,
                                                 2 * i + 1 + h, 2 * i + 1 + h);
        for (int t = 0; t < NT; t++) {
            const __m512i x0 = _mm512_loadu_si512(q0 + t * a.K + 64 * i);
            const __m512i start =
                kStarts<QT, NT> ? _mm512_loadu_si512(st0 + t * (a.K / 4) + 16 * i) : _mm512_setzero_si512();
            for (int r = 0; r < R; r++) {
                __m512i x = x0;
                if constexpr (QT == Q8_0 && !kStarts<QT, NT>)
                    x = _mm512_mask_sub_epi8(x, negative[r], _mm512_setzero_si512(), x);
                const __m512i dot = _mm512_dpbusd_epi32(start, codes[r], x);
                const __m512 scale = kHigh16 ? _mm512_permutex2var_ps(S[r][t], spread, S16[r][t])
                                             : _mm512_permutexvar_ps(spread, S[r][t]);
                sum[i % CH][r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, sum[i % CH][r][t]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++) {
            if constexpr (CH == 4)
                acc[r].w[t] = _mm512_add_ps(_mm512_add_ps(sum[0][r][t], sum[1][r][t]),
                                            _mm512_add_ps(sum[2][r][t], sum[3][r][t]));
            else if constexpr (CH == 2) acc[r].w[t] = _mm512_add_ps(sum[0][r][t], sum[1][r][t]);
            else acc[r].w[t] = sum[0][r][t];
        }
}

// One super-block: q0, d0, ds0 point at its first 32 activations of row t0.
template <int QT, int NT>
inline void superblock(Acc<NT> &acc, const Act &a, const int8_t *q0, const float *d0, const float *ds0,
                       int64_t t0, int64_t e0, const uint8_t *b) {
    if constexpr (QT == Q4_K || QT == Q5_K) {
        // k_scale_bytes in one register: the 12 bytes a, b, c (4 each) as [a c b c] and [0 a 0 b];
        // bytes [a & 63 | c & 15 | b & 63 | c >> 4 & 15] | ([0 a 0 b] >> 2 & 48): [sc (8) | mn (8)]
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b + 4));
        const __m128i acbc = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
        const __m128i high = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
        const __m128i low = _mm_and_si128(_mm_mask_srli_epi16(acbc, 0xC0, acbc, 4),
                                          _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15));
        const __m128i scmn = _mm_or_si128(low, _mm_and_si128(_mm_srli_epi16(high, 2), _mm_set1_epi8(48)));
        // [d * sc (8) | dmin * mn (8)] in one conversion and one multiply
        uint32_t dd;
        std::memcpy(&dd, b, 4);
        const __m512 dmin = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                                  _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(int(dd)))));
        const __m512 AC = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(scmn)));
        const __m256 A = _mm512_castps512_ps256(AC);
        const __m256 C = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(AC), 1));   // dmin * mn
        __m256 S[NT];                      // A * dx of the 8 sub-blocks, per activation row
        // q4_k: the high nibbles are taken in place (16 times the code: one AND, no shift), so the odd
        // sub-blocks' scales are divided by 16 (exact: a power of two), the same products
        const __m256 unit = QT == Q4_K ? _mm256_setr_ps(1.f, 1.f / 16, 1.f, 1.f / 16, 1.f, 1.f / 16, 1.f, 1.f / 16)
                                       : _mm256_set1_ps(1.f);
        for (int t = 0; t < NT; t++) {
            S[t] = _mm256_mul_ps(A, _mm256_loadu_ps(d0 + t * a.nb));
            if constexpr (QT == Q4_K) S[t] = _mm256_mul_ps(S[t], unit);
            acc.m8[t] = _mm256_fnmadd_ps(C, _mm256_loadu_ps(ds0 + t * a.nb), acc.m8[t]);
        }
        const uint8_t *qs = b + (QT == Q4_K ? 16 : 48);
        const __m512i nibbles = _mm512_inserti64x4(_mm512_set1_epi8(15), _mm256_set1_epi8(char(0xF0)), 1);
        const __m512i m4 = _mm512_set1_epi8(15);
        const __m512i qh2 = QT == Q5_K ? _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 16)))
                                       : _mm512_setzero_si512();     // q5_k's qh in both halves
        for (int c = 0; c < 4; c++) {      // sub-blocks 2c (low nibbles) and 2c+1 (high) of 32 bytes
            // the 32 bytes in both halves (a broadcast load), the upper half shifted: [low | high nibbles]
            __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(qs + 32 * c)));
            if constexpr (QT == Q4_K) raw = _mm512_and_si512(raw, nibbles);     // [low | 16 x high]
            else raw = _mm512_and_si512(_mm512_mask_srli_epi16(raw, 0xFFFF0000u, raw, 4), m4);
            if constexpr (QT == Q5_K) {    // fifth bits: bit 2c of qh (low half), 2c + 1 (high half), as a mask
                const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8(char(1 << (2 * c))),
                                                       _mm256_set1_epi8(char(1 << (2 * c + 1))), 1);
                raw = _mm512_mask_add_epi8(raw, _mm512_test_epi8_mask(qh2, bit), raw, _mm512_set1_epi8(16));
            }
            const __m512i spread = _mm512_setr_epi32(2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c,
                                                     2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1,
                                                     2 * c + 1, 2 * c + 1, 2 * c + 1);
            for (int t = 0; t < NT; t++)
                acc.w[t] = _mm512_fmadd_ps(dot64(raw, q0 + t * a.K + 64 * c),
                                           _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(S[t])), acc.w[t]);
        }
    } else if constexpr (QT == Q4_0X) {
        // Per activation row: two dots of low nibbles and two of high ones (masked in place: 16 times
        // the code, taken off by a shift of the exact int32 sums); lanes 2l, 2l + 1 are block l's, so
        // one conversion and one multiply-add by d_l * dx_l (spread) for the 8 blocks; the offset 8
        // as the minimum term -8 d_l * ds_l, 8 wide.
        const __m512i v0 = _mm512_loadu_si512(b + 16), v1 = _mm512_loadu_si512(b + 80);
        const __m512i m4 = _mm512_set1_epi8(15), h4 = _mm512_set1_epi8(char(0xF0));
        const __m512i lo0 = _mm512_and_si512(v0, m4), lo1 = _mm512_and_si512(v1, m4);
        const __m512i hi0 = _mm512_and_si512(v0, h4), hi1 = _mm512_and_si512(v1, h4);
        const __m256 A = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(b)));
        const __m256 C = _mm256_mul_ps(A, _mm256_set1_ps(-8.f));
        const __m512i spread = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        for (int t = 0; t < NT; t++) {
            const int8_t *x = a.qx + (t0 + t) * a.K + e0;
            const __m512i lo = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo0, _mm512_load_si512(x)),
                                                   lo1, _mm512_load_si512(x + 128));
            const __m512i hi = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), hi0, _mm512_load_si512(x + 64)),
                                                   hi1, _mm512_load_si512(x + 192));
            const __m512i dot = _mm512_add_epi32(lo, _mm512_srai_epi32(hi, 4));
            const __m256 S = _mm256_mul_ps(A, _mm256_loadu_ps(d0 + t * a.nb));
            acc.w[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(S)),
                                       acc.w[t]);
            acc.m8[t] = _mm256_fmadd_ps(C, _mm256_loadu_ps(ds0 + t * a.nb), acc.m8[t]);
        }
    } else if constexpr (QT == Q6_K) {
        // d * scale of the 16 groups of 16, times dx of their 32-element block, per row.
        const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b + 192));
        const __m512 dsc =
            _mm512_mul_ps(_mm512_set1_ps(f16(b + 208)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(scales)));
        const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        __m512 S[NT];
        for (int t = 0; t < NT; t++)
            S[t] = _mm512_mul_ps(
                dsc, _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_loadu_ps(d0 + t * a.nb))));
        const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
        for (int h = 0; h < 2; h++) {
            const __m512i L = _mm512_loadu_si512(b + 64 * h);   // ql: elements 128h + [0, 64) low, [64, 128) high
            const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 128 + 32 * h));
            // Q: bits 4-5 of each byte are the two high bits of half 1's elements (qh's fields 2, 3);
            // Q << 4 has those of half 0 there (fields 0, 1); low | (that & 0x30) in one ternary op.
            const __m512i Q = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
            for (int half = 0; half < 2; half++) {   // elements 128h + 64 half + [0, 64): 4 groups of 16
                const __m512i high = _mm512_and_si512(half ? Q : _mm512_slli_epi16(Q, 4), m30);
                // (low nibble of L or L >> 4) | high: imm 0xEA = (A & B) | C with A the nibbles, B = 15, C = high
                const __m512i codes =
                    _mm512_ternarylogic_epi32(half ? _mm512_srli_epi16(L, 4) : L, m4, high, 0xEA);   // unsigned; 32 via ls
                const int g = 8 * h + 4 * half;
                const __m512i spread = _mm512_setr_epi32(g, g, g, g, g + 1, g + 1, g + 1, g + 1, g + 2, g + 2, g + 2,
                                                         g + 2, g + 3, g + 3, g + 3, g + 3);
                for (int t = 0; t < NT; t++) {
                    const int64_t e = 128 * h + 64 * half;
                    const __m512i dot = _mm512_dpbusd_epi32(offset_start<QT, NT>(a, t0 + t, e0 + e), codes,
                                                            _mm512_loadu_si512(q0 + t * a.K + e));
                    acc.w[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(spread, S[t]), acc.w[t]);
                }
            }
        }
    }
}
#endif

// acc += row w's dots with activation rows t0 .. t0 + NT, from unit (block, super-block) u on.
template <int QT, int NT>
inline void row_acc(Acc<NT> &acc, const uint8_t *w, const Act &a, int64_t t0, int64_t u) {
    const int64_t units = a.K / kElems[QT];
    const int8_t *qa = a.q + t0 * a.K;
    const float *da = a.d + t0 * a.nb, *dsa = a.ds + t0 * a.nb;
    constexpr int P = kPieces<QT>;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    const int32_t *sta = a.start[QT] == nullptr ? nullptr : a.start[QT] + t0 * (a.K / 4);   // Act::start of row t0
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    if constexpr (P == 1) {
        for (; u + 16 <= units; u += 16)
            group16<QT, NT>(&acc, a, qa + u * 32, da + u, dsa + u, sta + u * 8, w + u * kBytes[QT]);
        if constexpr (NT <= 2) {      // few rows: two chains of sums, so the adds' latency does not bound
            Acc<NT> other;
            for (; u + 4 <= units; u += 4) {
                pair32<QT, NT>(acc, a, qa + u * 32, da + u, dsa + u, sta + u * 8, w + u * kBytes[QT]);
                pair32<QT, NT>(other, a, qa + (u + 2) * 32, da + u + 2, dsa + u + 2, sta + (u + 2) * 8,
                               w + (u + 2) * kBytes[QT]);
            }
            for (int t = 0; t < NT; t++) {
                acc.w[t] = _mm512_add_ps(acc.w[t], other.w[t]);
                acc.m2[t] = _mm_add_ps(acc.m2[t], other.m2[t]);
            }
        }
        for (; u + 2 <= units; u += 2) pair32<QT, NT>(acc, a, qa + u * 32, da + u, dsa + u, sta + u * 8, w + u * kBytes[QT]);
    } else {
        for (; u < units; u++)
            superblock<QT, NT>(acc, a, qa + u * 256, da + u * 8, dsa + u * 8, t0, u * 256,
                               w + u * kBytes[QT]);
    }
#endif
    if constexpr (P == 1 && NT <= 2) {   // few rows: two chains of sums (AVX2 / AVX-VNNI)
#if !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
        for (; u + 8 <= units; u += 8) group8<QT, NT>(acc, a, qa + u * 32, da + u, dsa + u, w + u * kBytes[QT]);
#endif
        Acc<NT> other;
        for (; u + 2 <= units; u += 2) {
            Piece p0, p1;
            decode<QT>(w + u * kBytes[QT], &p0);
            decode<QT>(w + (u + 1) * kBytes[QT], &p1);
            accumulate<QT, NT>(acc, a, qa + u * 32, da + u, dsa + u, p0);
            accumulate<QT, NT>(other, a, qa + (u + 1) * 32, da + u + 1, dsa + u + 1, p1);
        }
        for (int t = 0; t < NT; t++) {
            acc.v[t] = _mm256_add_ps(acc.v[t], other.v[t]);
            acc.s[t] += other.s[t];
        }
    }
    for (; u < units; u++) {          // 256-bit pieces (every unit on AVX2 / AVX-VNNI; an odd last block here)
        Piece p[P];
        decode<QT>(w + u * kBytes[QT], p);
        for (int i = 0; i < P; i++) {
            const int64_t j = u * P + i;
            accumulate<QT, NT>(acc, a, qa + j * 32, da + j, dsa + j, p[i]);
        }
    }
}

template <int QT, int NT>
void row_dot(const uint8_t *w, const Act &a, int64_t t0, float *out, int64_t ldo) {
    Acc<NT> acc;
    row_acc<QT, NT>(acc, w, a, t0, 0);
    for (int t = 0; t < NT; t++) out[t * ldo] = acc.total(t);
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
// kPassRows weight rows (w, w + ldw, ..) against one activation row (T = 1; all types but q5_0 /
// q5_1): each group's activations (and Act::start) loaded once for them all, and fewer calls per row.
constexpr int kPassRows = 2;
template <int QT>
void row_dot2(const uint8_t *w, int64_t ldw, const Act &a, float *out) {
    constexpr int R = kPassRows;
    Acc<1> acc[R];
    const int64_t units = a.K / kElems[QT];
    const int32_t *sta = a.start[QT];
    // The same bytes of rows further on: rows of 1 KiB or more, the next pass's (measured at the 1.7B
    // shape from memory, 24 layers in huge pages: 1.06x on q4_0 and the Q4_K_M mix over about 4 KiB
    // ahead; farther slower still); shorter rows, about 4 KiB ahead (the 135M shape's q4_1, K = 576,
    // from L3: 1.08x over the next pass).
    const int64_t ahead = (ldw >= 1024 ? R : prefetch_rows(ldw, R)) * ldw;
    int64_t u = 0;
    if constexpr (kPieces<QT> == 1) {
        for (; u + 16 <= units; u += 16) {
            prefetch_bytes(w + ahead + u * kBytes[QT], ldw, R, 16 * kBytes[QT]);
            group16<QT, 1, R>(acc, a, a.q + u * 32, a.d + u, a.ds + u, sta + u * 8, w + u * kBytes[QT], ldw);
        }
        for (; u + 2 <= units; u += 2)     // the rows' tails in pairs of blocks here (no row_acc call per row)
            for (int r = 0; r < R; r++)
                pair32<QT, 1>(acc[r], a, a.q + u * 32, a.d + u, a.ds + u, sta + u * 8, w + r * ldw + u * kBytes[QT]);
    } else {                     // super-blocks: the rows' streams interleaved (independent chains)
        for (; u < units; u++) {
            prefetch_bytes(w + ahead + u * kBytes[QT], ldw, R, kBytes[QT]);
            for (int r = 0; r < R; r++)
                superblock<QT, 1>(acc[r], a, a.q + u * 256, a.d + u * 8, a.ds + u * 8, 0, u * 256,
                                  w + r * ldw + u * kBytes[QT]);
        }
    }
    for (int r = 0; r < R; r++) {
        if (u < units) row_acc<QT, 1>(acc[r], w + r * ldw, a, 0, u);
        out[r] = acc[r].total(0);
    }
}
#endif
#else
// Plain loops over the same integers.
template <int QT, int NT>
void row_dot(const uint8_t *w, const Act &a, int64_t t0, float *out, int64_t ldo) {
    float acc[NT] = {};
    const int64_t units = a.K / kElems[QT];
    for (int64_t u = 0; u < units; u++) {
        const uint8_t *b = w + u * kBytes[QT];
        const int subs = int(kElems[QT] / 32);
        int codes[256], scale16[16];
        float A[8], C[8];
        for (int i = 0; i < 16; i++) scale16[i] = 1;
        for (int j = 0; j < 8; j++) C[j] = 0.f;
        if constexpr (QT == Q8_0) {
            for (int i = 0; i < 32; i++) codes[i] = int8_t(b[2 + i]);
            A[0] = f16(b);
        } else if constexpr (QT == Q4_0 || QT == Q4_1) {
            const uint8_t *qs = b + (QT == Q4_0 ? 2 : 4);
            const int off = QT == Q4_0 ? 8 : 0;
            for (int i = 0; i < 16; i++) codes[i] = (qs[i] & 15) - off, codes[i + 16] = (qs[i] >> 4) - off;
            A[0] = f16(b);
            if (QT == Q4_1) C[0] = f16(b + 2);
        } else if constexpr (QT == Q5_0 || QT == Q5_1) {
            const int o = QT == Q5_0 ? 2 : 4, off = QT == Q5_0 ? 16 : 0;
            uint32_t qh;
            std::memcpy(&qh, b + o, 4);
            for (int i = 0; i < 16; i++) {
                codes[i] = ((b[o + 4 + i] & 15) | (((qh >> i) & 1) << 4)) - off;
                codes[i + 16] = ((b[o + 4 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - off;
            }
            A[0] = f16(b);
            if (QT == Q5_1) C[0] = f16(b + 2);
        } else if constexpr (QT == Q4_K || QT == Q5_K) {
            const float d = f16(b), dmin = f16(b + 2);
            int sc[8], mn[8];
            k_scales(b + 4, sc, mn);
            const uint8_t *qh = b + 16, *qs = b + (QT == Q4_K ? 16 : 48);
            for (int j = 0; j < 8; j++) {
                for (int l = 0; l < 32; l++) {
                    int v = (qs[(j / 2) * 32 + l] >> ((j % 2) * 4)) & 15;
                    if (QT == Q5_K) v |= ((qh[l] >> j) & 1) << 4;
                    codes[j * 32 + l] = v;
                }
                A[j] = d * float(sc[j]);
                C[j] = -(dmin * float(mn[j]));
            }
        } else if constexpr (QT == Q4_0X) {
            for (int l = 0; l < 8; l++) {
                for (int i = 0; i < 16; i++) {
                    const uint8_t q = q4_0x_byte(b, l, i);
                    codes[32 * l + i] = (q & 15) - 8, codes[32 * l + i + 16] = (q >> 4) - 8;
                }
                A[l] = f16(b + 2 * l);
            }
        } else if constexpr (QT == Q6_K) {
            const int8_t *sc = reinterpret_cast<const int8_t *>(b + 192);
            const float d = f16(b + 208);
            for (int h = 0; h < 2; h++)
                for (int k = 0; k < 4; k++)
                    for (int l = 0; l < 32; l++) {
                        const int lo = (b[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 15;
                        const int hi = (b[128 + 32 * h + l] >> (2 * k)) & 3;
                        codes[128 * h + 32 * k + l] = (lo | (hi << 4)) - 32;
                    }
            for (int g = 0; g < 16; g++) scale16[g] = sc[g];
            for (int j = 0; j < 8; j++) A[j] = d;
        }
        for (int s = 0; s < subs; s++) {
            const int64_t j = u * subs + s;
            for (int t = 0; t < NT; t++) {
                const int8_t *q = a.q + (t0 + t) * a.K + j * 32;
                int dot0 = 0, dot1 = 0;
                for (int i = 0; i < 16; i++) {
                    dot0 += codes[s * 32 + i] * q[i];
                    dot1 += codes[s * 32 + 16 + i] * q[16 + i];
                }
                const int dot = dot0 * scale16[2 * s] + dot1 * scale16[2 * s + 1];
                acc[t] += (A[s] * a.d[(t0 + t) * a.nb + j]) * float(dot);
                acc[t] += C[s] * a.ds[(t0 + t) * a.nb + j];
            }
        }
    }
    for (int t = 0; t < NT; t++) out[t * ldo] = acc[t];
}
#endif

#if defined(__AVX512VL__)
constexpr int kMaxNT = 8;       // activation rows per pass over a weight row (32 vector registers)
#else
constexpr int kMaxNT = 4;
#endif

using RowFn = void (*)(const uint8_t *, const Act &, int64_t, float *, int64_t);

template <int QT, int... NT>
constexpr RowFn pick(int nt, std::integer_sequence<int, NT...>) {
    RowFn fn = nullptr;
    ((nt == NT + 1 ? (fn = row_dot<QT, NT + 1>, 0) : 0), ...);
    return fn;
}

template <int QT>
RowFn row_fn(int nt) { return pick<QT>(nt, std::make_integer_sequence<int, kMaxNT>{}); }

RowFn row_fn(int qt, int nt) {
    return with_qtype(qt, [nt](auto q) { return row_fn<decltype(q)::value>(nt); });
}

using Row2Fn = void (*)(const uint8_t *, int64_t, const Act &, float *);
Row2Fn row2_fn(int qt) {         // two rows at T = 1 (null: none for this type / variant)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    switch (qt) {
    case Q4_0: return row_dot2<Q4_0>;
    case Q4_1: return row_dot2<Q4_1>;
    case Q8_0: return row_dot2<Q8_0>;
    case Q4_K: return row_dot2<Q4_K>;
    case Q5_K: return row_dot2<Q5_K>;
    case Q6_K: return row_dot2<Q6_K>;
    case Q4_0X: return row_dot2<Q4_0X>;
    }                            // (q5_0, q5_1: slower in pairs, measured: their fifth bits' masks)
#endif
    (void)qt;
    return nullptr;
}

// Row w's K weights as floats (exactly gguf.quants' values).
void dequantize_row(int qt, const uint8_t *w, int64_t K, float *y) {
#if defined(__AVX2__)
    with_qtype(qt, [&](auto q) { dequantize_row_vec<decltype(q)::value>(w, K, y); });
#else
    for (int64_t u = 0; u < K / kElems[qt]; u++) dequantize_block(qt, w + u * kBytes[qt], y + u * kElems[qt]);
#endif
}
}  // namespace

// w: rows of blocks, ldw bytes apart; out float32 [rows][ldo]. 0 on success.
extern "C" int quant_dequantize(int qt, const uint8_t *w, int64_t ldw, int64_t rows, int64_t cols, float *out,
                                int64_t ldo) {
    if (qt < 0 || qt >= kNumTypes || qt == Q4_1R8 || cols % kElems[qt]) return 1;
#pragma omp parallel for schedule(static) if (rows * cols >= 65536)
    for (int64_t r = 0; r < rows; r++) dequantize_row(qt, w + r * ldw, cols, out + r * ldo);
    return 0;
}

// out float32 [n][cols] = rows ids[0..n) of W (an embedding lookup); ids checked by the caller.
extern "C" int quant_dequantize_rows(int qt, const uint8_t *w, int64_t ldw, const int64_t *ids, int64_t n,
                                     int64_t cols, float *out) {
    if (qt < 0 || qt >= kNumTypes || qt == Q4_1R8 || cols % kElems[qt]) return 1;
#pragma omp parallel for schedule(static) if (n * cols >= 65536)
    for (int64_t i = 0; i < n; i++) dequantize_row(qt, w + ids[i] * ldw, cols, out + i * cols);
    return 0;
}

namespace {
#if defined(__AVX512F__)
// 16 floats -> their bf16 bits in the low halves of 32-bit lanes (to_bf16's rounding).
inline __m512i bf16_bits(__m512 x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)))),
        16);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
}

// In place: r[i] lane j <- r[j] lane i (32-bit lanes).
inline void transpose16x16(__m512i *r) {
    __m512i t[16], u[16];
    for (int k = 0; k < 8; k++) {
        t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    for (int m = 0; m < 4; m++) {
        u[4 * m] = _mm512_unpacklo_epi64(t[4 * m], t[4 * m + 2]);
        u[4 * m + 1] = _mm512_unpackhi_epi64(t[4 * m], t[4 * m + 2]);
        u[4 * m + 2] = _mm512_unpacklo_epi64(t[4 * m + 1], t[4 * m + 3]);
        u[4 * m + 3] = _mm512_unpackhi_epi64(t[4 * m + 1], t[4 * m + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i w01 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), w23 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
        const __m512i x01 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44),
                      x23 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_i32x4(w01, x01, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(w01, x01, 0xDD);
        r[8 + c] = _mm512_shuffle_i32x4(w23, x23, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(w23, x23, 0xDD);
    }
}
#endif

// 16 rows' floats (f: [16][ld], columns [0, c)) into packed columns from k0 of one tile of 16
// output rows (tile: [K/2][16][2] bf16, or [K][16] float32).
void pack16(const float *f, int64_t ld, int64_t c, int64_t k0, void *tile, bool bf16) {
#if defined(__AVX512F__)
    __m512i r[16];
    if (bf16) {     // 32 columns: each row's 16 bf16 pairs, transposed to 16 pair-rows of 16 output rows
        for (int64_t j = 0; j < c; j += 32) {
            for (int i = 0; i < 16; i++) {
                const __m256i lo = _mm512_cvtepi32_epi16(bf16_bits(_mm512_loadu_ps(f + i * ld + j)));
                const __m256i hi = _mm512_cvtepi32_epi16(bf16_bits(_mm512_loadu_ps(f + i * ld + j + 16)));
                r[i] = _mm512_inserti64x4(_mm512_zextsi256_si512(lo), hi, 1);
            }
            transpose16x16(r);
            uint16_t *dst = static_cast<uint16_t *>(tile) + (k0 + j) * 16;
            for (int p = 0; p < 16; p++) _mm512_storeu_si512(dst + p * 32, r[p]);
        }
    } else {
        for (int64_t j = 0; j < c; j += 16) {
            for (int i = 0; i < 16; i++) r[i] = _mm512_castps_si512(_mm512_loadu_ps(f + i * ld + j));
            transpose16x16(r);
            float *dst = static_cast<float *>(tile) + (k0 + j) * 16;
            for (int p = 0; p < 16; p++) _mm512_storeu_si512(dst + p * 16, r[p]);
        }
    }
#else
    if (bf16) {
        uint16_t *dst = static_cast<uint16_t *>(tile) + k0 * 16;
        for (int64_t k = 0; k < c; k++)
            for (int i = 0; i < 16; i++) dst[(k / 2) * 32 + 2 * i + k % 2] = f32_to_bf16(f[i * ld + k]);
    } else {
        float *dst = static_cast<float *>(tile) + k0 * 16;
        for (int64_t k = 0; k < c; k++)
            for (int i = 0; i < 16; i++) dst[k * 16 + i] = f[i * ld + k];
    }
#endif
}

#if defined(__AVX512F__)
// 32 floats (lo: elements 0..15, hi: 16..31) -> 32 bf16 in order, rounded to nearest even:
// vcvtne2ps2bf16 where the CPU has AVX512-BF16 (asm: this build's flags do not include it;
// weights are never float32 denormals, where it would differ), else bf16_bits.
inline __m512i bf16_pairs(__m512 lo, __m512 hi, bool native) {
    if (native) {
        __m512i r;
        __asm__("vcvtne2ps2bf16 %2, %1, %0" : "=v"(r) : "v"(hi), "v"(lo));
        return r;
    }
    return _mm512_inserti64x4(_mm512_zextsi256_si512(_mm512_cvtepi32_epi16(bf16_bits(lo))),
                              _mm512_cvtepi32_epi16(bf16_bits(hi)), 1);
}

bool native_bf16() {
    static const bool ok = __builtin_cpu_supports("avx512bf16");
    return ok;
}

// One group of 16 weight rows (n of them real, the rest zero) dequantized into a bf16 packed
// tile [K/2][16][2]: per 256 columns, each row's pieces (decode<QT>) become floats in registers
// (dequantize_row_vec's operations, so the same values) and bf16 pairs in an L1 buffer, whose 32-
// column slices are transposed in registers into the tile.
// Types whose codes (offset taken off) fit 5 bits: a piece's weights take 32 values at most,
// A * code (+ C), computed (with the same float operations) for every code and looked up by
// vpermw with the codes' low 5 bits as indices: code c at index c & 31.
template <int QT>
constexpr bool kLut = QT == Q4_0 || QT == Q4_1 || QT == Q5_0 || QT == Q5_1 || QT == Q4_K || QT == Q5_K ||
                      QT == Q4_0X;

template <int QT>
__m512 lut_codes(int half) {     // the code at indices 16 half .. 16 half + 15, as floats
    alignas(64) float c[16];
    for (int i = 0; i < 16; i++) {
        const int index = 16 * half + i;
        c[i] = float(kSigned<QT> && index >= 16 ? index - 32 : index);
    }
    return _mm512_load_ps(c);
}

template <int QT>
inline __m512 lut_values(float A, float C, __m512 codes) {
    __m512 v = _mm512_mul_ps(_mm512_set1_ps(A), codes);
    if constexpr (kMin<QT>) v = _mm512_add_ps(v, _mm512_set1_ps(C));
    return v;
}

// One decoded piece's 32 weights as bf16 (elements in order): looked up (kLut) or converted,
// dequantize_row_vec's float operations either way, then rounded to nearest even.
template <int QT>
inline __m512i piece_bf16(const Piece &p, __m512 lut0, __m512 lut1, bool native) {
    if constexpr (kLut<QT>) {     // codes of 5 bits or fewer: the piece's 32 values, looked up
        const __m512 v0 = lut_values<QT>(p.A, p.C, lut0), v1 = lut_values<QT>(p.A, p.C, lut1);
        const __m512i idx = _mm512_cvtepi8_epi16(p.codes);     // vpermw reads 5 bits
        return _mm512_permutexvar_epi16(idx, bf16_pairs(v0, v1, native));
    }
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(p.codes)));
    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(p.codes, 1)));
    float a0 = p.A, a1 = p.A;
    if constexpr (QT == Q6_K) a0 = p.A * float(p.sc0), a1 = p.A * float(p.sc1);
    __m512 v0 = _mm512_mul_ps(_mm512_set1_ps(a0), q0), v1 = _mm512_mul_ps(_mm512_set1_ps(a1), q1);
    if constexpr (kMin<QT>) {
        v0 = _mm512_add_ps(v0, _mm512_set1_ps(p.C));
        v1 = _mm512_add_ps(v1, _mm512_set1_ps(p.C));
    }
    return bf16_pairs(v0, v1, native);
}

template <int QT>
void pack_group_bf16(const uint8_t *w, int64_t ldw, int64_t n, int64_t K, uint16_t *tile, bool native) {
    constexpr int P = kPieces<QT>;
    const __m512 lut0 = lut_codes<QT>(0), lut1 = lut_codes<QT>(1);
    constexpr int64_t kCols = 256;
    alignas(64) uint16_t buf[16 * kCols];
    if (n < 16) std::fill(buf, buf + 16 * kCols, uint16_t(0));
    for (int64_t k0 = 0; k0 < K; k0 += kCols) {
        const int64_t c = std::min(kCols, K - k0);          // a multiple of the block
        for (int64_t i = 0; i < n; i++) {
            const uint8_t *row = w + i * ldw + k0 / kElems[QT] * kBytes[QT];
            for (int64_t u = 0; u < c / kElems[QT]; u++) {
                Piece p[P];
                decode<QT>(row + u * kBytes[QT], p);
                for (int j = 0; j < P; j++)
                    _mm512_store_si512(buf + i * kCols + (u * P + j) * 32, piece_bf16<QT>(p[j], lut0, lut1, native));
            }
        }
        for (int64_t j = 0; j < c; j += 32) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512(buf + i * kCols + j);
            transpose16x16(r);
            uint16_t *dst = tile + (k0 + j) * 16;
            for (int q = 0; q < 16; q++) _mm512_storeu_si512(dst + q * 32, r[q]);
        }
    }
}

void pack_group_bf16(int qt, const uint8_t *w, int64_t ldw, int64_t n, int64_t K, uint16_t *tile, bool native) {
    with_qtype(qt, [&](auto q) { pack_group_bf16<decltype(q)::value>(w, ldw, n, K, tile, native); });
}
#endif

// Rows [0, rows) of W dequantized into kernels/cpu.py's packed GEMM layout (PackedWeight):
// float32 [Np/16][K][16] or bf16 [Np/16][K/2][16][2] (rounded to nearest even), Np = rows
// rounded up to 32, zero rows past `rows`. Threads take whole groups of 16 rows (no two write
// one cache line); a group goes kChunk columns at a time through a float buffer that stays in
// L1 (16 x kChunk floats), then is rounded and transposed in registers.
constexpr int64_t kChunk = 256;
void dequantize_packed(int qt, const uint8_t *w, int64_t ldw, int64_t rows, int64_t K, void *out, bool bf16) {
    const int64_t groups = (rows + 31) / 32 * 2;
#if defined(__AVX512F__)
    const bool native = native_bf16();
#endif
#pragma omp parallel
    {
        alignas(64) float buf[16 * kChunk];
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t n = std::min<int64_t>(16, std::max<int64_t>(0, rows - 16 * g));
            void *tile = bf16 ? static_cast<void *>(static_cast<uint16_t *>(out) + g * K * 16)
                              : static_cast<void *>(static_cast<float *>(out) + g * K * 16);
#if defined(__AVX512F__)
            if (bf16) {
                pack_group_bf16(qt, w + 16 * g * ldw, ldw, n, K, static_cast<uint16_t *>(tile), native);
                continue;
            }
#endif
            if (n < 16) std::fill(buf, buf + 16 * kChunk, 0.f);
            for (int64_t k0 = 0; k0 < K; k0 += kChunk) {   // K and kChunk are multiples of the block
                const int64_t c = std::min(kChunk, K - k0), offset = k0 / kElems[qt] * kBytes[qt];
                for (int64_t i = 0; i < n; i++) dequantize_row(qt, w + (16 * g + i) * ldw + offset, c, buf + i * kChunk);
                pack16(buf, kChunk, c, k0, tile, bf16);
            }
        }
    }
}
}  // namespace

// A weight, or one part of weights stacked by rows (a fused projection stored apart, each part
// in its own type): `rows` rows of blocks of type qtype, ldw bytes apart.
struct QuantPart {
    int64_t qtype;
    const uint8_t *w;
    int64_t ldw, rows;
};

namespace {
bool valid(const QuantPart *parts, int64_t nparts, int64_t K) {
    for (int64_t p = 0; p < nparts; p++)
        if (parts[p].qtype < 0 || parts[p].qtype >= kNumTypes || K % kElems[parts[p].qtype] || parts[p].rows < 0)
            return false;
    return nparts > 0;
}
}  // namespace

// Work handed to the next call (cpu_kernels.cpp project_lora: a LoRA delta): per thread, bytes
// to fetch into its L2 while its share of the weights streams (the delta's adapter weights, which
// the same thread reads right after: the weights' dots and tiles leave memory bandwidth unused,
// the delta alone would wait on it), and work for every thread to run at the end of the
// product, inside its parallel region (the delta: one OpenMP meeting, not two). The same layout
// as cpu_kernels.cpp's.
constexpr int kPrefetchThreads = 8, kPrefetchRanges = 128;
struct PrefetchRange {
    const char *at;
    int64_t bytes, count, stride;      // count runs of `bytes`, `stride` bytes apart
};
struct ThreadPrefetch {
    int64_t n;
    PrefetchRange r[kPrefetchRanges];
};
struct Handover {
    int64_t threads;     // the team's size the plan was made for (threads past kPrefetchThreads: none)
    ThreadPrefetch t[kPrefetchThreads];
    void (*after)(const void *ctx);     // or null: every thread calls it when its share of the product is
    const void *ctx;                    // done, inside the region (the delta: one meeting, not two)
    int64_t ran;                        // set (by thread 0) where `after` ran
};
namespace {
thread_local const Handover *t_handover = nullptr;    // the calling thread's, for its next call

// A thread's walk over its ranges, a few lines at a time between its own work.
struct PrefetchCursor {
    const ThreadPrefetch *tp = nullptr;
    int64_t r = 0, run = 0, off = 0;       // range, run in it, byte in the run
    PrefetchCursor(const Handover *plan, int64_t tid, int64_t team) {
        if (plan != nullptr && plan->threads == team && tid < kPrefetchThreads) tp = &plan->t[tid];
    }
    int64_t lines() const {
        int64_t total = 0;
        for (int64_t i = 0; tp && i < tp->n; i++) total += (tp->r[i].bytes + 63) / 64 * tp->r[i].count;
        return total;
    }
    void step(int64_t count) {
        for (; tp && count > 0 && r < tp->n; count--) {
            const PrefetchRange &g = tp->r[r];
            __builtin_prefetch(g.at + run * g.stride + off, 0, 2);
            if ((off += 64) < g.bytes) continue;
            off = 0;
            if (++run == g.count) r++, run = 0;
        }
    }
};
// At the end of a product's parallel region, in every thread.
inline void run_after(const Handover *plan) {
    if (plan == nullptr || plan->after == nullptr) return;
    plan->after(plan->ctx);
    if (omp_get_thread_num() == 0) const_cast<Handover *>(plan)->ran = 1;
}
}  // namespace

namespace {
// Q4_1R8 (see QType): row l's block of the unit at u, in q4_1's file layout (20 bytes at b).
inline void r8_block(const uint8_t *u, int l, uint8_t *b) {
    std::memcpy(b, u + 2 * l, 2);
    std::memcpy(b + 2, u + 16 + 2 * l, 2);
    std::memcpy(b + 4, u + 32 + 8 * l, 8);
    std::memcpy(b + 12, u + 96 + 8 * l, 8);
}

// Group g's 8 rows in q4_1's file layout into rows (row_bytes apart).
void unpack_r8(const uint8_t *g, int64_t nb, uint8_t *rows, int64_t row_bytes) {
    for (int64_t j = 0; j < nb; j++)
        for (int l = 0; l < 8; l++) r8_block(g + j * 160, l, rows + l * row_bytes + j * 20);
}

// The parts with each Q4_1R8 part unpacked into the file's layout (a buffer of the calling
// thread's, kept between calls; both threads unpack): for the paths that read rows (the tiles,
// the other ISA variants).
struct PlainParts {
    std::vector<QuantPart> parts;
    PlainParts(const QuantPart *in, int64_t nparts, int64_t K) : parts(in, in + nparts) {
        static thread_local std::vector<uint8_t> buf;
        const int64_t row_bytes = K / kElems[Q4_1] * kBytes[Q4_1];
        int64_t need = 0;
        for (int64_t p = 0; p < nparts; p++)
            if (in[p].qtype == Q4_1R8) need += in[p].rows * row_bytes;
        if (static_cast<int64_t>(buf.size()) < need) buf.resize(need);
        int64_t at = 0;
        for (int64_t p = 0; p < nparts; p++) {
            if (in[p].qtype != Q4_1R8) continue;
            uint8_t *dst = buf.data() + at;
            const QuantPart q = in[p];
#pragma omp parallel for schedule(static) if (q.rows * K >= 65536)
            for (int64_t g = 0; g < q.rows / 8; g++)
                unpack_r8(q.w + g * q.ldw, K / kElems[Q4_1], dst + 8 * g * row_bytes, row_bytes);
            parts[p] = {Q4_1, dst, row_bytes, q.rows};
            at += q.rows * row_bytes;
        }
    }
};
bool any_r8(const QuantPart *parts, int64_t nparts) {
    for (int64_t p = 0; p < nparts; p++)
        if (parts[p].qtype == Q4_1R8) return true;
    return false;
}
}  // namespace

// The calling thread's next quant_linear_small or quant_linear_tiles call (its AMX-BF16 path;
// the others ignore it) fetches plan's ranges and runs plan->after (null: nothing), then forgets it.
extern "C" int quant_handover_next(const Handover *plan) {
    t_handover = plan;
    return 0;
}

// y [T][ldy] = x [T][K] @ W.T + bias for many rows of x, W the parts stacked by rows (x
// contiguous; x and y both float32 or both bf16; bias float32 over all rows or null): tiles of
// tile_rows rows (a multiple of 32) dequantized into the packed layout of kernels/cpu.py's GEMM
// and multiplied by it straight into their columns of y (`gemm`: cpu_kernels.cpp's
// linear_packed_ld_f32 or _bf16, passed by address); the whole matrix never exists in float.
// The tile's buffer is the calling thread's, kept between calls (no page faults per call). 0 on success.
using PackedGemm = int (*)(const void *, const void *, const float *, void *, int64_t, int64_t, int64_t, int64_t);
namespace {
bool amxw_takes(int64_t T);     // the AMX-BF16 path with weights as A tiles (below) takes T rows of bf16 x
int amxw_linear(const QuantPart *parts, int64_t nparts, const uint16_t *x, int64_t T, int64_t K, const float *bias,
                uint16_t *y, int64_t ldy, const Handover *plan);
bool amxw_enabled();

// Rows of one part, consecutive: [r0, r0 + n) of part q, whose first row is row `first` of y.
struct RowBlock {
    const QuantPart *q;
    int64_t r0, n, first, row_bytes;
};

// The calling thread's share of a product's weight rows (in its team: a range of equal weight
// bytes of `total`, in groups of 32 rows) as blocks of up to max_rows consecutive rows of a part.
void share_blocks(const QuantPart *parts, int64_t nparts, int64_t K, int64_t total, int64_t max_rows,
                  std::vector<RowBlock> &out) {
    const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t lo = total * tid / nt, hi = total * (tid + 1) / nt;
    out.clear();
    int64_t at = 0, first = 0;         // bytes before this group, its part's first row in y
    for (int64_t p = 0; p < nparts; first += parts[p].rows, p++) {
        const int64_t row_bytes = K / kElems[parts[p].qtype] * kBytes[parts[p].qtype];
        for (int64_t r0 = 0; r0 < parts[p].rows; r0 += 32) {
            const int64_t n = std::min<int64_t>(32, parts[p].rows - r0), start = at;
            at += n * row_bytes;
            if (start < lo || start >= hi) continue;
            RowBlock *last = out.empty() ? nullptr : &out.back();
            if (last && last->q == &parts[p] && last->r0 + last->n == r0 && last->n + n <= max_rows) last->n += n;
            else out.push_back({&parts[p], r0, n, first, row_bytes});
        }
    }
}

#if defined(__AVX512F__)
// quant_linear_tiles for bf16 x where AMX is on and T is past amxw_takes: each thread packs
// blocks of its own rows (about kFusedBytes of bf16, a range of equal weight bytes) into its own
// buffer and runs the GEMM on them alone (a nested parallel region of one thread), so a block is
// multiplied by the core that wrote it, from its L2, with no barrier between packing and GEMM.
constexpr int64_t kFusedBytes = 512 * 1024;
int fused_tiles(const QuantPart *parts, int64_t nparts, const void *x, int64_t T, int64_t K, const float *bias,
                void *y, int64_t ldy, void *gemm) {
    int64_t total = 0;
    for (int64_t p = 0; p < nparts; p++) total += parts[p].rows * (K / kElems[parts[p].qtype] * kBytes[parts[p].qtype]);
    const int64_t chunk = std::max<int64_t>(32, kFusedBytes / (2 * K) / 32 * 32);      // rows per block
    const bool native = native_bf16();
    int status = 0;
#pragma omp parallel reduction(| : status)
    {
        static thread_local std::vector<uint16_t> buf;
        static thread_local std::vector<RowBlock> mine;
        if (buf.size() < size_t(chunk * K)) buf.resize(chunk * K);
        share_blocks(parts, nparts, K, total, chunk, mine);
        omp_set_num_threads(1);                      // the GEMM's own parallel region: this thread alone
        for (const RowBlock &b : mine) {
            for (int64_t g = 0; g < (b.n + 31) / 32 * 2; g++)
                pack_group_bf16(int(b.q->qtype), b.q->w + (b.r0 + 16 * g) * b.q->ldw, b.q->ldw,
                                std::min<int64_t>(16, std::max<int64_t>(0, b.n - 16 * g)), K, buf.data() + g * K * 16,
                                native);
            status |= reinterpret_cast<PackedGemm>(gemm)(x, buf.data(), bias ? bias + b.first + b.r0 : nullptr,
                                                         static_cast<uint16_t *>(y) + b.first + b.r0, ldy, T, b.n, K);
        }
    }
    return status;
}
#endif
}  // namespace
extern "C" int quant_linear_tiles(const QuantPart *parts, int64_t nparts, const void *x, int x_bf16, int64_t T,
                                  int64_t K, const float *bias, void *y, int64_t ldy, void *gemm, int64_t tile_rows) {
    const Handover *plan = t_handover;
    t_handover = nullptr;
    if (!valid(parts, nparts, K) || T <= 0 || tile_rows <= 0 || tile_rows % 32 || (x_bf16 && K % 2) || gemm == nullptr)
        return 1;
    if (any_r8(parts, nparts) && !(x_bf16 && amxw_takes(T))) {     // (amxw_rows reads Q4_1R8 itself)
        t_handover = plan;            // (for the call below)
        const PlainParts plain(parts, nparts, K);
        return quant_linear_tiles(plain.parts.data(), nparts, x, x_bf16, T, K, bias, y, ldy, gemm, tile_rows);
    }
    if (x_bf16 && amxw_takes(T))
        return amxw_linear(parts, nparts, static_cast<const uint16_t *>(x), T, K, bias, static_cast<uint16_t *>(y), ldy,
                           plan);
#if defined(__AVX512F__)
    if (x_bf16 && amxw_enabled()) return fused_tiles(parts, nparts, x, T, K, bias, y, ldy, gemm);
#endif
    const int64_t elem = x_bf16 ? 2 : 4;
    static thread_local std::vector<uint8_t> packed;
    if (packed.size() < size_t(tile_rows * K * elem)) packed.resize(tile_rows * K * elem);
    auto *y8 = static_cast<uint8_t *>(y);
    int64_t first = 0;            // the parts' first row in y
    for (int64_t p = 0; p < nparts; first += parts[p].rows, p++) {
        const QuantPart &q = parts[p];
        for (int64_t r0 = 0; r0 < q.rows; r0 += tile_rows) {
            const int64_t n = std::min(tile_rows, q.rows - r0);
            dequantize_packed(int(q.qtype), q.w + r0 * q.ldw, q.ldw, n, K, packed.data(), x_bf16 != 0);
            const int status = reinterpret_cast<PackedGemm>(gemm)(x, packed.data(), bias ? bias + first + r0 : nullptr,
                                                                  y8 + (first + r0) * elem, ldy, T, n, K);
            if (status != 0) return status;
        }
    }
    return 0;
}

namespace {
// The first row (of the parts stacked) whose bytes start at or after byte `at` of their bytes.
int64_t row_at_byte(const QuantPart *parts, int64_t nparts, int64_t K, int64_t at) {
    int64_t first = 0;
    for (int64_t p = 0; p < nparts; p++) {
        const int64_t row_bytes = K / kElems[parts[p].qtype] * kBytes[parts[p].qtype];
        const int64_t bytes = parts[p].rows * row_bytes;
        if (at < bytes) return first + (at + row_bytes - 1) / row_bytes;
        at -= bytes;
        first += parts[p].rows;
    }
    return first;
}

// ---- AMX-INT8: the integer dots of many activation rows at once (Sapphire Rapids and later) ----
// The same arithmetic as the dots above (y += (A * dx) * dot(code, q) + C * dx * sum(q)), the
// integer dots on AMX tiles: an A tile is 16 weight rows x one piece (32 elements, q6_k: 16) of
// their codes as signed int8 (offsets taken off; unsigned codes <= 31 fit), a B tile the same
// piece of 16 activation rows' q8 values in AMX's VNNI layout (K/4 rows of 16 rows x 4 bytes,
// built once per call), and tdpbssd gives the 16 x 16 int32 dots of that piece; each is
// rescaled in AVX-512 (one conversion, a multiply by the 16 dx, a multiply-add by the weight
// row's A; the minimum terms one more multiply-add) into float32 sums kept in 16 registers.
// A group of 16 weight rows is unpacked once into an L2 buffer and serves every 16 activation
// rows. Threads take groups of 16 weight rows (ranges of equal bytes). Only in the avx512vnni
// build, where CPUID has amx-int8 and amx-tile and the kernel grants tile data; from
// g_amx8.min_rows rows (kernels/quant.py sets it: quant_amx_config).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
}  // (namespace: the system headers below outside it)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
namespace {
struct AmxInt8 {
    bool enabled = false;
    int64_t min_rows = 1 << 30;
};
AmxInt8 g_amx8;

bool amx8_permitted() {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 24)) || !(d & (1u << 25))) return false;     // amx-tile, amx-int8
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

inline void amx8_barrier() { __asm__ volatile("" ::: "memory"); }   // orders C++ memory accesses around tile asm

struct alignas(64) Amx8Config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Tiles 0-3: C (16 x 16 int32); 4, 5: A (16 weight rows x ps bytes); 6, 7: B (ps / 4 rows x 64 bytes).
__attribute__((target("amx-tile,amx-int8"))) void amx8_load_config(int ps) {
    Amx8Config cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    for (int t = 4; t < 6; t++) cfg.colsb[t] = uint16_t(ps), cfg.rows[t] = 16;
    for (int t = 6; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = uint8_t(ps / 4);
    _tile_loadconfig(&cfg);
}

template <int QT>
constexpr int kPieceElems = QT == Q6_K ? 16 : 32;

// 32 codes (elements 32j ..) of a weight row into its pieces: piece p at codes + 16 PS p (the
// buffer holds the 16 rows' piece p together: one A tile, 16 rows of PS bytes).
template <int QT>
inline void amx8_store32(int8_t *codes, int64_t j, __m256i v) {
    if constexpr (kPieceElems<QT> == 32) {
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(codes + 512 * j), v);
    } else {
        _mm_storeu_si128(reinterpret_cast<__m128i *>(codes + 512 * j), _mm256_castsi256_si128(v));
        _mm_storeu_si128(reinterpret_cast<__m128i *>(codes + 512 * j + 256), _mm256_extracti128_si256(v, 1));
    }
}

// One weight row: its codes (K int8, signed where the type has an offset: decode<QT>'s; codes:
// the row's place in piece 0, see amx8_store32), the A of each piece (As [K / piece]) and, types
// with a minimum, the C of each 32 (Cs [K / 32]).
template <int QT>
inline void amx8_unpack(const uint8_t *w, int64_t K, int8_t *codes, float *As, float *Cs) {
    constexpr int B = int(kBytes[QT]);
    if constexpr (kPieces<QT> == 1) {
        const int64_t nb = K / 32;
        const __m512i at = _mm512_setr_epi32(0, B, 2 * B, 3 * B, 4 * B, 5 * B, 6 * B, 7 * B, 8 * B, 9 * B, 10 * B,
                                             11 * B, 12 * B, 13 * B, 14 * B, 15 * B);
        int64_t u = 0;
        for (; u + 16 <= nb; u += 16) {     // 16 blocks' d (and m) in one gather
            const __m512i dm = _mm512_i32gather_epi32(at, w + u * B, 1);
            _mm512_storeu_ps(As + u, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm)));
            if constexpr (kMin<QT>)
                _mm512_storeu_ps(Cs + u, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16))));
        }
        for (; u < nb; u++) {
            As[u] = f16(w + u * B);
            if constexpr (kMin<QT>) Cs[u] = f16(w + u * B + 2);
        }
        u = 0;
        if constexpr (QT == Q4_0 || QT == Q4_1) {      // two blocks per 512-bit unpack
            constexpr int o = QT == Q4_0 ? 2 : 4;
            for (; u + 2 <= nb; u += 2) {
                __m512i c = nibbles64(w + u * B + o, w + (u + 1) * B + o);
                if constexpr (QT == Q4_0) c = _mm512_sub_epi8(c, _mm512_set1_epi8(8));
                amx8_store32<QT>(codes, u, _mm512_castsi512_si256(c));
                amx8_store32<QT>(codes, u + 1, _mm512_extracti64x4_epi64(c, 1));
            }
        }
        for (; u < nb; u++) {
            Piece p;
            decode<QT>(w + u * B, &p);
            amx8_store32<QT>(codes, u, p.codes);
        }
    } else {
        for (int64_t u = 0; u < K / 256; u++) {
            const uint8_t *b = w + u * B;
            Piece p[8];
            decode<QT>(b, p);
            for (int j = 0; j < 8; j++) amx8_store32<QT>(codes, 8 * u + j, p[j].codes);
            if constexpr (QT == Q6_K) {     // (d * scale) of the 16 groups of 16, as dequantize
                const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b + 192));
                _mm512_storeu_ps(As + 16 * u, _mm512_mul_ps(_mm512_set1_ps(f16(b + 208)),
                                                            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc))));
            } else {                        // d * sc, -(dmin * mn) of the 8 sub-blocks
                for (int j = 0; j < 8; j++) As[8 * u + j] = p[j].A, Cs[8 * u + j] = p[j].C;
            }
        }
    }
}

// The int32 dots of one piece (tile 0-3 `c`) rescaled into acc: acc[i] lanes are 16 activation rows.
template <bool kMinTerm>
inline void amx8_rescale(const int32_t *c, const float *dx, const float *ds, const float *As, int64_t lda,
                         const float *Cs, int64_t ldc, __m512 *acc) {
    const __m512 d = _mm512_loadu_ps(dx);
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++)
        acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(c + 16 * i)), d),
                                 _mm512_set1_ps(As[i * lda]), acc[i]);
    if constexpr (kMinTerm) {
        const __m512 s = _mm512_loadu_ps(ds);
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) acc[i] = _mm512_fmadd_ps(s, _mm512_set1_ps(Cs[i * ldc]), acc[i]);
    }
}

struct Amx8Act {
    const int32_t *bv;   // [tiles][K/4][16]: q's 4-byte groups, 16 activation rows per tile (zero past T)
    const float *dx;     // [tiles][K/32][16]
    const float *ds;     // [tiles][K/32][16]
    int64_t T, K;
};

// n (<= 16) weight rows at w (ldw bytes apart) times all activation rows, into y's columns [col, col + n).
template <int QT>
__attribute__((target("amx-tile,amx-int8"))) void amx8_group(const uint8_t *w, int64_t ldw, int64_t n,
                                                              const Amx8Act &a, const float *bias, void *y,
                                                              int64_t ldy, int64_t col, bool y_bf16, int8_t *codes,
                                                              float *As, float *Cs, int32_t *cbuf) {
    constexpr int PS = kPieceElems<QT>;
    const int64_t K = a.K, np = K / PS, nb = K / 32, tiles = (a.T + 15) / 16;
    for (int64_t i = 0; i < 16; i++) {
        if (i < n) {
            amx8_unpack<QT>(w + i * ldw, K, codes + i * PS, As + i * np, Cs + i * nb);
        } else {                  // zero rows: their sums are zero (and never stored)
            for (int64_t p = 0; p < np; p++) std::memset(codes + (16 * p + i) * PS, 0, PS);
            std::fill(As + i * np, As + (i + 1) * np, 0.f);
            std::fill(Cs + i * nb, Cs + (i + 1) * nb, 0.f);
        }
    }
    amx8_barrier();
    const __mmask16 mask = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    for (int64_t tile = 0; tile < tiles; tile++) {
        const int32_t *bv = a.bv + tile * (K / 4) * 16;
        const float *dx = a.dx + tile * nb * 16, *ds = a.ds + tile * nb * 16;
        __m512 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
        auto rescale = [&](const int32_t *c, int64_t p) {
            const int64_t blk = PS == 32 ? p : p / 2;
            amx8_rescale<kMin<QT>>(c, dx + 16 * blk, ds + 16 * blk, As + p, np, Cs + blk, nb, acc);
        };
        constexpr int64_t kStep = PS / 4 * 16;    // int32 of bv per piece
        int64_t p = 0;
        for (; p + 4 <= np; p += 4) {             // four pieces, then their rescales
            amx8_barrier();
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            _tile_loadd(4, codes + 16 * p * PS, PS);
            _tile_loadd(6, bv + p * kStep, 64);
            _tile_dpbssd(0, 4, 6);
            _tile_loadd(5, codes + 16 * (p + 1) * PS, PS);
            _tile_loadd(7, bv + (p + 1) * kStep, 64);
            _tile_dpbssd(1, 5, 7);
            _tile_loadd(4, codes + 16 * (p + 2) * PS, PS);
            _tile_loadd(6, bv + (p + 2) * kStep, 64);
            _tile_dpbssd(2, 4, 6);
            _tile_loadd(5, codes + 16 * (p + 3) * PS, PS);
            _tile_loadd(7, bv + (p + 3) * kStep, 64);
            _tile_dpbssd(3, 5, 7);
            _tile_stored(0, cbuf, 64);
            _tile_stored(1, cbuf + 256, 64);
            _tile_stored(2, cbuf + 512, 64);
            _tile_stored(3, cbuf + 768, 64);
            amx8_barrier();
            for (int j = 0; j < 4; j++) rescale(cbuf + 256 * j, p + j);
        }
        for (; p < np; p++) {
            amx8_barrier();
            _tile_zero(0);
            _tile_loadd(4, codes + 16 * p * PS, PS);
            _tile_loadd(6, bv + p * kStep, 64);
            _tile_dpbssd(0, 4, 6);
            _tile_stored(0, cbuf, 64);
            amx8_barrier();
            rescale(cbuf, p);
        }
        __m512i r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_castps_si512(acc[i]);
        transpose16x16(r);                    // r[t]: activation row t's sums for the 16 weight rows
        const int64_t rows = std::min<int64_t>(16, a.T - 16 * tile);
        for (int64_t t = 0; t < rows; t++) {
            const __m512 v = _mm512_add_ps(_mm512_castsi512_ps(r[t]), b);
            const int64_t at = (16 * tile + t) * ldy + col;
            if (y_bf16)
                _mm256_mask_storeu_epi16(static_cast<uint16_t *>(y) + at, mask, _mm512_cvtepi32_epi16(bf16_bits(v)));
            else
                _mm512_mask_storeu_ps(static_cast<float *>(y) + at, mask, v);
        }
    }
}

using Amx8Fn = void (*)(const uint8_t *, int64_t, int64_t, const Amx8Act &, const float *, void *, int64_t, int64_t,
                        bool, int8_t *, float *, float *, int32_t *);
Amx8Fn amx8_fn(int qt) {
    return with_qtype(qt, [](auto q) -> Amx8Fn { return amx8_group<decltype(q)::value>; });
}

// This thread's share of the groups of 16 weight rows (ranges of equal bytes) through amx8_group;
// a (the activations' tiles) complete. Called inside quant_linear_small's parallel region.
__attribute__((target("amx-tile,amx-int8"))) void amx8_rows(const QuantPart *parts, int64_t nparts,
                                                             const Amx8Act &a, int64_t total, const float *bias,
                                                             void *y, int64_t ldy, bool y_bf16) {
    const int64_t K = a.K;
    static thread_local std::vector<int8_t> codes;
    static thread_local std::vector<float> scales;
    if (codes.size() < size_t(16 * K)) codes.resize(16 * K);
    if (scales.size() < size_t(16 * (K / 16 + K / 32))) scales.resize(16 * (K / 16 + K / 32));
    alignas(64) int32_t cbuf[1024];
    const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t lo = total * tid / nt, hi = total * (tid + 1) / nt;
    int ps = 0;                        // the tile configuration loaded (piece size)
    int64_t at = 0, first = 0;         // bytes before this group, its part's first row in y
    for (int64_t p = 0; p < nparts; first += parts[p].rows, p++) {
        const QuantPart &q = parts[p];
        const int qt = int(q.qtype);
        const int64_t row_bytes = K / kElems[qt] * kBytes[qt];
        const int this_ps = qt == Q6_K ? 16 : 32;
        for (int64_t r0 = 0; r0 < q.rows; r0 += 16) {
            const int64_t n = std::min<int64_t>(16, q.rows - r0), start = at;
            at += n * row_bytes;
            if (start < lo || start >= hi) continue;
            if (ps != this_ps) amx8_load_config(ps = this_ps);
            float *As = scales.data(), *Cs = As + 16 * (K / 16);
            amx8_fn(qt)(q.w + r0 * q.ldw, q.ldw, n, a, bias ? bias + first + r0 : nullptr, y, ldy, first + r0,
                        y_bf16, codes.data(), As, Cs, cbuf);
        }
    }
    if (ps != 0) _tile_release();
}

// ---- AMX-BF16 with the weights as A tiles (decode batches and small prefill chunks) ------------
// quant_linear_tiles' arithmetic (W dequantized to bf16 exactly as the packed tiles hold it, times
// bf16 x, float32 sums) without the packed layout: a group of 32 weight rows is dequantized
// row-major into an L2 buffer ([32][K] bf16: dequantize_row_vec's values, rounded as the tiles),
// which AMX reads as A tiles (16 weight rows x 32 k, a row stride of 2K bytes: no transposes);
// x is put once per call into AMX's VNNI layout as B tiles ([T/16][K/2][16][2]); tdpbf16ps sums
// every k of a 16 x 16 block of y.T in a C tile (no per-block rescale), 2 x 2 C tiles (32 weight
// rows x 32 activation rows) per pass over K, so each dequantized group serves every row of x.
// Threads take groups of 32 weight rows (ranges of equal bytes). Only in the avx512vnni build,
// where CPUID has amx-bf16 and amx-tile and the kernel grants tile data; for bf16 x of
// g_amxw.min_rows .. g_amxw.max_rows rows (kernels/quant.py sets them: quant_amxw_config).
struct AmxW {
    bool enabled = false;
    int64_t min_rows = 1 << 30, max_rows = 0;
};
AmxW g_amxw;

bool amxw_takes(int64_t T) { return g_amxw.enabled && T >= g_amxw.min_rows && T <= g_amxw.max_rows; }
bool amxw_enabled() { return g_amxw.enabled; }

bool amxw_permitted() {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;     // amx-tile, amx-bf16
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

__attribute__((target("amx-tile,amx-bf16"))) void amxw_load_config() {     // every tile 16 x 64 bytes
    Amx8Config cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
}

// Units [u0, u1) (blocks, super-blocks) of one weight row -> out (that row's bf16 [K]), the
// values of the packed tiles. The 32-element types' blocks go 16 at a time: their fp16 d (and m)
// in one gather and one conversion (the same floats as f16); q4_0 / q4_1's nibbles two blocks
// per 512-bit unpack and q4_k's sub-blocks two at a time, each pair through one table (amxw_pair4).
// Two pieces of 4-bit codes (n: 0..15) share one table: piece a's 16 values A * code (+ C) in
// its low half, b's in the high half, one rounding for both; b's indices n + 16.
// (q4_0: code = n - 8, the codes decode<Q4_0> gives; the same float operations as lut_values.)
template <int QT>
inline void amxw_pair4(__m256i na, __m256i nb, float Aa, float Ca, float Ab, float Cb, uint16_t *out, bool native) {
    const __m512 codes = QT == Q4_0 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                                    : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i table = bf16_pairs(lut_values<QT>(Aa, Ca, codes), lut_values<QT>(Ab, Cb, codes), native);
    const __m512i ia = _mm512_cvtepu8_epi16(na), ib = _mm512_or_si512(_mm512_cvtepu8_epi16(nb), _mm512_set1_epi16(16));
    _mm512_storeu_si512(out, _mm512_permutexvar_epi16(ia, table));
    _mm512_storeu_si512(out + 32, _mm512_permutexvar_epi16(ib, table));
}

template <int QT>
void amxw_units(const uint8_t *row, int64_t u0, int64_t u1, uint16_t *out, bool native) {
    constexpr int P = kPieces<QT>;
    const __m512 lut0 = lut_codes<QT>(0), lut1 = lut_codes<QT>(1);
    int64_t u = u0;
    if constexpr (QT == Q4_K) {       // sub-blocks 2c, 2c + 1: one table
        for (; u < u1; u++) {
            Piece p[8];
            decode<QT>(row + u * kBytes[QT], p);
            for (int j = 0; j < 8; j += 2)
                amxw_pair4<QT>(p[j].codes, p[j + 1].codes, p[j].A, p[j].C, p[j + 1].A, p[j + 1].C, out + (u * 8 + j) * 32,
                               native);
        }
        return;
    }
    if constexpr (P == 1) {
        constexpr int B = int(kBytes[QT]);
        const __m512i at = _mm512_setr_epi32(0, B, 2 * B, 3 * B, 4 * B, 5 * B, 6 * B, 7 * B, 8 * B, 9 * B, 10 * B,
                                             11 * B, 12 * B, 13 * B, 14 * B, 15 * B);
        alignas(64) float As[16], Cs[16];
        for (; u + 16 <= u1; u += 16) {
            const uint8_t *b = row + u * B;
            const __m512i dm = _mm512_i32gather_epi32(at, b, 1);
            _mm512_store_ps(As, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm)));
            if constexpr (kMin<QT>) _mm512_store_ps(Cs, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16))));
            for (int j = 0; j < 16; j += 2) {
                if constexpr (QT == Q4_0 || QT == Q4_1) {     // raw nibbles, one table for both blocks
                    constexpr int o = QT == Q4_0 ? 2 : 4;
                    const __m512i c = nibbles64(b + j * B + o, b + (j + 1) * B + o);
                    amxw_pair4<QT>(_mm512_castsi512_si256(c), _mm512_extracti64x4_epi64(c, 1), As[j],
                                   kMin<QT> ? Cs[j] : 0.f, As[j + 1], kMin<QT> ? Cs[j + 1] : 0.f, out + (u + j) * 32,
                                   native);
                    continue;
                }
                Piece d0, d1;
                decode<QT>(b + j * B, &d0);
                decode<QT>(b + (j + 1) * B, &d1);
                const Piece p0{d0.codes, As[j], kMin<QT> ? Cs[j] : 0.f, 1, 1};
                const Piece p1{d1.codes, As[j + 1], kMin<QT> ? Cs[j + 1] : 0.f, 1, 1};
                _mm512_storeu_si512(out + (u + j) * 32, piece_bf16<QT>(p0, lut0, lut1, native));
                _mm512_storeu_si512(out + (u + j + 1) * 32, piece_bf16<QT>(p1, lut0, lut1, native));
            }
        }
    }
    for (; u < u1; u++) {
        Piece p[P];
        decode<QT>(row + u * kBytes[QT], p);
        for (int j = 0; j < P; j++)
            _mm512_storeu_si512(out + (u * P + j) * 32, piece_bf16<QT>(p[j], lut0, lut1, native));
    }
}

// Q4_1R8's row l of the group at g (see QType): units u0 .. u1 as amxw_units<Q4_1> gives them,
// each block first put together in the file's layout (20 bytes on the stack).
void amxw_units_r8(const uint8_t *g, int l, int64_t u0, int64_t u1, uint16_t *out, bool native) {
    alignas(64) uint8_t blk[2][32];
    int64_t u = u0;
    for (; u + 2 <= u1; u += 2) {
        r8_block(g + u * 160, l, blk[0]), r8_block(g + (u + 1) * 160, l, blk[1]);
        const __m512i c = nibbles64(blk[0] + 4, blk[1] + 4);
        amxw_pair4<Q4_1>(_mm512_castsi512_si256(c), _mm512_extracti64x4_epi64(c, 1), f16(blk[0]), f16(blk[0] + 2),
                         f16(blk[1]), f16(blk[1] + 2), out + u * 32, native);
    }
    if (u < u1) {
        r8_block(g + u * 160, l, blk[0]);
        Piece p;
        decode<Q4_1>(blk[0], &p);
        _mm512_storeu_si512(out + u * 32, piece_bf16<Q4_1>(p, lut_codes<Q4_1>(0), lut_codes<Q4_1>(1), native));
    }
}

using AmxWUnits = void (*)(const uint8_t *, int64_t, int64_t, uint16_t *, bool);
AmxWUnits amxw_units_fn(int qt) {
    return with_qtype(qt, [](auto q) -> AmxWUnits { return amxw_units<decltype(q)::value>; });
}

// A group of n weight rows being dequantized into dst [32][K] (rows past n zeroed first) a few
// units at a time (step), between the tile operations of the group before it, so the vector
// work of one group overlaps the AMX work of the other; finish() does what is left.
struct AmxWNext {
    AmxWUnits fn = nullptr;
    const uint8_t *w = nullptr;
    int64_t ldw = 0, n = 0, units = 0, K = 0;     // units per row
    uint16_t *dst = nullptr;
    bool native = false;
    int64_t row = 0, unit = 0, per = 0;           // the cursor; units per step
    bool r8 = false;                              // Q4_1R8: w its first group, ldw a group's bytes
    void step(int64_t count) {
        while (count > 0 && row < n) {
            const int64_t take = std::min(count, units - unit);
            if (r8) amxw_units_r8(w + row / 8 * ldw, int(row % 8), unit, unit + take, dst + row * K, native);
            else fn(w + row * ldw, unit, unit + take, dst + row * K, native);
            count -= take;
            if ((unit += take) == units) row++, unit = 0;
        }
    }
    void finish() { step(n * units); }
    int64_t left() const { return (n - row) * units - unit; }
};

// C tiles 0 (weight rows 0-15 x activation tile b0), 1 (0-15 x b1, PAIR), 2 (16-31 x b0, TWO),
// 3 (16-31 x b1, both) summed over all K: A tiles from wb [32][K], B tiles b0, b1 [K/2][16][2].
// Stored into cbuf [4][16][16] float32 (tile i at 256 i). Between the tile operations: nx.per
// units of the next group dequantized (AmxWNext), and the weight bytes of the group after it
// prefetched into L2 (pf: per cache lines a step, from pf.at), so their memory reads overlap the
// AMX work instead of stalling a dequantize.
struct AmxWPrefetch {
    const uint8_t *at, *end;
    int64_t per;          // cache lines per K step
    PrefetchCursor *extra = nullptr;     // and the thread's share of a Handover: extra_per lines a K step
    int64_t extra_per = 0;
};

template <bool TWO, bool PAIR>
__attribute__((target("amx-tile,amx-bf16"))) inline void amxw_pass(const uint16_t *wb, const uint16_t *b0,
                                                                   const uint16_t *b1, int64_t K, float *cbuf,
                                                                   AmxWPrefetch &pf, AmxWNext &nx) {
    const int64_t stride = 2 * K;
    _tile_zero(0);
    if (PAIR) _tile_zero(1);
    if (TWO) _tile_zero(2);
    if (TWO && PAIR) _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32) {
        for (int64_t i = 0; i < pf.per && pf.at < pf.end; i++, pf.at += 64)
            _mm_prefetch(reinterpret_cast<const char *>(pf.at), _MM_HINT_T1);
        if (pf.extra) pf.extra->step(pf.extra_per);
        _tile_loadd(4, wb + k, stride);
        _tile_loadd(6, b0 + k * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (PAIR) {
            _tile_loadd(7, b1 + k * 16, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (TWO) {
            _tile_loadd(5, wb + 16 * K + k, stride);
            _tile_dpbf16ps(2, 5, 6);
            if (PAIR) _tile_dpbf16ps(3, 5, 7);
        }
        nx.step(nx.per);
    }
    _tile_stored(0, cbuf, 64);
    if (PAIR) _tile_stored(1, cbuf + 256, 64);
    if (TWO) _tile_stored(2, cbuf + 512, 64);
    if (TWO && PAIR) _tile_stored(3, cbuf + 768, 64);
}

// Two groups of 32 weight rows (wa, wb2: [32][K] each) times one activation tile b0: C tiles 0-3
// their rows 0-15, 16-31, 32-47, 48-63 (four chains of sums where one tile of x would give two).
__attribute__((target("amx-tile,amx-bf16"))) inline void amxw_pass4(const uint16_t *wa, const uint16_t *wb2,
                                                                    const uint16_t *b0, int64_t K, float *cbuf,
                                                                    AmxWPrefetch &pf, AmxWNext &nx) {
    const int64_t stride = 2 * K;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32) {
        for (int64_t i = 0; i < pf.per && pf.at < pf.end; i++, pf.at += 64)
            _mm_prefetch(reinterpret_cast<const char *>(pf.at), _MM_HINT_T1);
        if (pf.extra) pf.extra->step(pf.extra_per);
        _tile_loadd(6, b0 + k * 16, 64);
        _tile_loadd(4, wa + k, stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, wa + 16 * K + k, stride);
        _tile_dpbf16ps(1, 5, 6);
        _tile_loadd(7, wb2 + k, stride);
        _tile_dpbf16ps(2, 7, 6);
        _tile_loadd(4, wb2 + 16 * K + k, stride);
        _tile_dpbf16ps(3, 4, 6);
        nx.step(nx.per);
    }
    _tile_stored(0, cbuf, 64);
    _tile_stored(1, cbuf + 256, 64);
    _tile_stored(2, cbuf + 512, 64);
    _tile_stored(3, cbuf + 768, 64);
}

// One C tile's sums (c: [16 weight rows][16 activation rows] float32) + bias into y.T's block:
// rows [t0, t0 + nt) of y, columns [col, col + nw).
// Rounded to bf16 by vcvtneps2bf16 where the CPU has AVX512-BF16 (asm, as bf16_pairs: the same
// value but for float32 denormals, which it flushes), else bf16_bits.
inline void amxw_store(const float *c, const float *bias, uint16_t *y, int64_t ldy, int64_t t0, int64_t nt,
                       int64_t col, int64_t nw, bool native) {
    __m512i r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(c + 16 * i);
    transpose16x16(r);                       // r[t]: activation row t's sums of the 16 weight rows
    const __mmask16 mask = nw >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << nw) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    for (int64_t t = 0; t < nt; t++) {
        const __m512 v = _mm512_add_ps(_mm512_castsi512_ps(r[t]), b);
        __m256i h;
        if (native) __asm__("vcvtneps2bf16 %1, %0" : "=v"(h) : "v"(v));
        else h = _mm512_cvtepi32_epi16(bf16_bits(v));
        _mm256_mask_storeu_epi16(y + (t0 + t) * ldy + col, mask, h);
    }
}

// n weight rows (a block of groups of 32), dequantized in wb [n rounded up to 32][K] (rows past n
// zero), times all T rows of x (bv: its B tiles) into y's columns [col, col + n): per pair of
// activation tiles, each group of 32 in turn, so the pair's B tiles (and the block's A tiles)
// stay in L2 for all of them.
__attribute__((target("amx-tile,amx-bf16"))) void amxw_block(const uint16_t *wb, int64_t n, const uint16_t *bv,
                                                               int64_t T, int64_t K, const float *bias, uint16_t *y,
                                                               int64_t ldy, int64_t col, float *cbuf,
                                                               AmxWPrefetch pf, AmxWNext &nx) {
    const int64_t tiles = (T + 15) / 16, groups = (n + 31) / 32;
    const int64_t steps = (tiles / 2 * groups + tiles % 2 * (groups / 2 + groups % 2)) * (K / 32);
    pf.per = (pf.end - pf.at + 64 * steps - 1) / (64 * steps);
    if (pf.extra) pf.extra_per = (pf.extra_per + steps - 1) / steps;       // (given: lines for this block)
    nx.per = (nx.left() + steps - 1) / steps;
    for (int64_t t0 = 0; t0 < tiles; t0 += 2) {
        const bool pair = t0 + 1 < tiles;
        const uint16_t *b0 = bv + t0 * K * 16, *b1 = b0 + K * 16;
        for (int64_t j = 0; j < groups; j++) {
            const uint16_t *w = wb + j * 32 * K;
            if (!pair && n - 32 * j >= 64) {       // a lone activation tile: two whole groups at once
                amx8_barrier();
                amxw_pass4(w, w + 32 * K, b0, K, cbuf, pf, nx);
                amx8_barrier();
                for (int i = 0; i < 4; i++)
                    amxw_store(cbuf + 256 * i, bias ? bias + 32 * j + 16 * i : nullptr, y, ldy, 16 * t0,
                               std::min<int64_t>(16, T - 16 * t0), col + 32 * j + 16 * i, 16, native_bf16());
                j++;
                continue;
            }
            const int64_t nj = std::min<int64_t>(32, n - 32 * j);
            const bool two = nj > 16;
            amx8_barrier();
            if (two && pair) amxw_pass<true, true>(w, b0, b1, K, cbuf, pf, nx);
            else if (two) amxw_pass<true, false>(w, b0, b1, K, cbuf, pf, nx);
            else if (pair) amxw_pass<false, true>(w, b0, b1, K, cbuf, pf, nx);
            else amxw_pass<false, false>(w, b0, b1, K, cbuf, pf, nx);
            amx8_barrier();
            for (int h = 0; h < (two ? 2 : 1); h++)
                for (int p = 0; p < (pair ? 2 : 1); p++)
                    amxw_store(cbuf + 256 * (2 * h + p), bias ? bias + 32 * j + 16 * h : nullptr, y, ldy,
                               16 * (t0 + p), std::min<int64_t>(16, T - 16 * (t0 + p)), col + 32 * j + 16 * h,
                               std::min<int64_t>(16, nj - 16 * h), native_bf16());
        }
    }
}

constexpr int64_t kAmxWBlockBytes = 384 * 1024;    // the bf16 weights of a block (two in L2: this and the next)

// This thread's share of the groups of 32 weight rows (ranges of equal bytes); bv complete. Its
// groups go in blocks of consecutive rows of one part (as many as keep kAmxWBlockBytes of bf16
// weights, one group where x has at most 64 rows), in two buffers: block i's AMX passes read
// one while block i + 1 is dequantized into the other. Called inside amxw_linear's parallel region.
__attribute__((target("amx-tile,amx-bf16"))) void amxw_rows(const QuantPart *parts, int64_t nparts, const uint32_t *bv,
                                                              int64_t T, int64_t K, int64_t total, const float *bias,
                                                              uint16_t *y, int64_t ldy, bool native,
                                                              const Handover *plan) {
    const int64_t per_block = T <= 64 ? (128 * K <= kAmxWBlockBytes ? 64 : 32)        // rows
                                      : std::max<int64_t>(1, kAmxWBlockBytes / (64 * K)) * 32;
    static thread_local std::vector<uint16_t> wb;
    static thread_local std::vector<RowBlock> mine;
    if (wb.size() < size_t(2 * per_block * K)) wb.resize(2 * per_block * K);
    share_blocks(parts, nparts, K, total, per_block, mine);
    if (mine.empty()) return;
    auto next_of = [&](size_t i) {       // block i's dequantize, not started, into buffer i % 2
        AmxWNext nx;
        if (i >= mine.size()) return nx;
        const RowBlock &g = mine[i];
        uint16_t *dst = wb.data() + (i % 2) * per_block * K;
        const int64_t padded = (g.n + 31) / 32 * 32;
        if (g.n < padded) std::fill(dst + g.n * K, dst + padded * K, uint16_t(0));
        nx.fn = amxw_units_fn(int(g.q->qtype));
        nx.r8 = g.q->qtype == Q4_1R8;          // (its blocks of 32 rows start on a group: r0 % 32 == 0)
        nx.w = g.q->w + (nx.r8 ? g.r0 / 8 : g.r0) * g.q->ldw, nx.ldw = g.q->ldw, nx.n = g.n;
        nx.units = K / kElems[g.q->qtype];
        nx.K = K, nx.dst = dst, nx.native = native;
        return nx;
    };
    PrefetchCursor extra(plan, omp_get_thread_num(), omp_get_num_threads());
    const int64_t extra_lines = extra.lines(), nblocks = static_cast<int64_t>(mine.size());
    amxw_load_config();
    alignas(64) float cbuf[1024];
    AmxWNext now = next_of(0);
    now.finish();
    for (size_t i = 0; i < mine.size(); i++) {
        const RowBlock &g = mine[i];
        AmxWNext nx = next_of(i + 1);
        AmxWPrefetch ahead{nullptr, nullptr, 0};          // block i + 2's bytes, where its rows are contiguous
        if (extra_lines > 0) ahead.extra = &extra, ahead.extra_per = (extra_lines + nblocks - 1) / nblocks;
        if (i + 2 < mine.size() && mine[i + 2].q->ldw == mine[i + 2].row_bytes) {
            const RowBlock &h = mine[i + 2];
            ahead.at = h.q->w + h.r0 * h.q->ldw, ahead.end = ahead.at + h.n * h.row_bytes;
        } else if (i + 2 < mine.size() && mine[i + 2].q->qtype == Q4_1R8) {    // its groups: contiguous too
            const RowBlock &h = mine[i + 2];
            ahead.at = h.q->w + h.r0 / 8 * h.q->ldw, ahead.end = ahead.at + h.n * h.row_bytes;
        }
        amxw_block(wb.data() + (i % 2) * per_block * K, g.n, reinterpret_cast<const uint16_t *>(bv), T, K,
                   bias ? bias + g.first + g.r0 : nullptr, y, ldy, g.first + g.r0, cbuf, ahead, nx);
        nx.finish();
    }
    _tile_release();
}

int amxw_linear(const QuantPart *parts, int64_t nparts, const uint16_t *x, int64_t T, int64_t K, const float *bias,
                uint16_t *y, int64_t ldy, const Handover *plan) {
    const int64_t tiles = (T + 15) / 16, pairs = K / 2;
    std::vector<uint32_t> bv(tiles * pairs * 16);       // x's bf16 pairs: [tiles][K/2][16]
    const uint32_t *x32 = reinterpret_cast<const uint32_t *>(x);
    int64_t total = 0;                                  // weight bytes
    for (int64_t p = 0; p < nparts; p++) total += parts[p].rows * (K / kElems[parts[p].qtype] * kBytes[parts[p].qtype]);
    const bool native = native_bf16();
#pragma omp parallel
    {
        // 16 rows x 16 pairs at a time, transposed in registers (pairs: K / 2, a multiple of 16)
#pragma omp for schedule(static)
        for (int64_t i = 0; i < tiles * (pairs / 16); i++) {
            const int64_t k = i / (pairs / 16), g = i % (pairs / 16) * 16;
            __m512i r[16];
            for (int64_t c = 0; c < 16; c++)
                r[c] = 16 * k + c < T ? _mm512_loadu_si512(x32 + (16 * k + c) * pairs + g) : _mm512_setzero_si512();
            transpose16x16(r);
            for (int64_t c = 0; c < 16; c++) _mm512_storeu_si512(&bv[(k * pairs + g + c) * 16], r[c]);
        }
        amxw_rows(parts, nparts, bv.data(), T, K, total, bias, y, ldy, native, plan);
        run_after(plan);
    }
    return 0;
}
#else
bool amxw_takes(int64_t) { return false; }
bool amxw_enabled() { return false; }
int amxw_linear(const QuantPart *, int64_t, const uint16_t *, int64_t, int64_t, const float *, uint16_t *, int64_t,
                const Handover *) {
    return 1;
}
#endif
}  // namespace

// enable: the AMX-BF16 path with weights as A tiles for bf16 x of min_rows .. max_rows rows in
// quant_linear_tiles (1) or not (0). Returns 1 where it is in use after the call, 0 where not (not
// this build, the CPU or kernel lacks AMX-BF16, or disabled).
extern "C" int quant_amxw_config(int64_t enable, int64_t min_rows, int64_t max_rows) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    static const bool usable = amxw_permitted();
    g_amxw.enabled = usable && enable != 0;
    g_amxw.min_rows = std::max<int64_t>(1, min_rows);
    g_amxw.max_rows = max_rows;
    return g_amxw.enabled ? 1 : 0;
#else
    (void)enable, (void)min_rows, (void)max_rows;
    return 0;
#endif
}

// enable: use the AMX-INT8 dots where usable (1) or not (0); min_rows: from how many rows of x.
// Returns 1 where they are in use after the call, 0 where not (not this build, the CPU or kernel
// lacks AMX-INT8, or disabled).
extern "C" int quant_amx_config(int64_t enable, int64_t min_rows) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    static const bool usable = amx8_permitted();
    g_amx8.enabled = usable && enable != 0;
    g_amx8.min_rows = std::max<int64_t>(1, min_rows);
    return g_amx8.enabled ? 1 : 0;
#else
    (void)enable, (void)min_rows;
    return 0;
#endif
}

namespace {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
// Q4_1R8 (see QType) at NT activation rows from t0: out[t * ldo + l] = row l of the group at g
// against activation row t0 + t. Per unit: the nibbles' two vectors masked once (low, and high in
// place: 16 times the code, taken off by a shift of the exact int32 sums), per row four dots
// against 8-byte broadcasts, one conversion and one multiply-add by the 8 rows' scales (spread to
// their lane pairs), the minimum terms 8 wide; the rows' sums out of their lane pairs at the end.
template <int NT>
void r8_group(const uint8_t *g, int64_t nb, const Act &a, int64_t t0, float *out, int64_t ldo) {
    // out[t * ldo + l] = row l's dot with activation row t0 + t
    const __m512i m4 = _mm512_set1_epi8(15), h4 = _mm512_set1_epi8(char(0xF0));
    const __m512i spread = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    __m512 acc[NT][2];
    __m256 mins[NT];
    for (int t = 0; t < NT; t++) acc[t][0] = acc[t][1] = _mm512_setzero_ps(), mins[t] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nb; j++) {
        const uint8_t *u = g + j * 160;
        _mm_prefetch(reinterpret_cast<const char *>(u + 24 * 160), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char *>(u + 24 * 160 + 64), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char *>(u + 24 * 160 + 128), _MM_HINT_T0);
        const __m512i v0 = _mm512_loadu_si512(u + 32), v1 = _mm512_loadu_si512(u + 96);
        const __m512i lo0 = _mm512_and_si512(v0, m4), lo1 = _mm512_and_si512(v1, m4);
        const __m512i hi0 = _mm512_and_si512(v0, h4), hi1 = _mm512_and_si512(v1, h4);
        const __m256 A = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(u)));
        const __m256 M = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(u + 16)));
        for (int t = 0; t < NT; t++) {
            const int8_t *x = a.q + (t0 + t) * a.K + j * 32;
            int64_t x8[4];
            std::memcpy(x8, x, 32);
            const __m512i lo = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo0, _mm512_set1_epi64(x8[0])),
                                                   lo1, _mm512_set1_epi64(x8[1]));
            const __m512i hi = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), hi0, _mm512_set1_epi64(x8[2])),
                                                   hi1, _mm512_set1_epi64(x8[3]));
            const __m512i dot = _mm512_add_epi32(lo, _mm512_srai_epi32(hi, 4));
            const float dx = a.d[(t0 + t) * a.nb + j], ds = a.ds[(t0 + t) * a.nb + j];
            const __m512 S = _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(_mm256_mul_ps(A, _mm256_set1_ps(dx))));
            __m512 &s = acc[t][j % 2];
            s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), S, s);
            mins[t] = _mm256_fmadd_ps(M, _mm256_set1_ps(ds), mins[t]);
        }
    }
    for (int t = 0; t < NT; t++) {
        const __m512 sum = _mm512_add_ps(acc[t][0], acc[t][1]);
        const __m512 pairs = _mm512_add_ps(sum, _mm512_permute_ps(sum, 0xB1));     // lane 2l: row l's
        const __m256 rows = _mm512_castps512_ps256(
            _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0), pairs));
        _mm256_storeu_ps(out + t * ldo, _mm256_add_ps(rows, mins[t]));
    }
}
// NT activation rows per pass (up to 4: registers)
using R8Fn = void (*)(const uint8_t *, int64_t, const Act &, int64_t, float *, int64_t);
constexpr R8Fn kR8[5] = {nullptr, r8_group<1>, r8_group<2>, r8_group<3>, r8_group<4>};
#endif

// A thread's activation buffers (Act's arrays), kept from call to call: no allocation per product.
struct ActBuffers {
    std::vector<int8_t, Aligned64<int8_t>> q, qx;     // 64-byte aligned: the dots' 512-bit loads split no line
    std::vector<float, Aligned64<float>> d, ds;
    std::vector<int32_t, Aligned64<int32_t>> starts[kNumTypes];
};
thread_local ActBuffers t_act;

template <class V>
typename V::value_type *fit(V &v, int64_t n) {        // v's storage for at least n (it only grows)
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    return v.data();
}

// The calling thread's Act for T rows of K: q, d, ds, and where the parts' types read them (not
// on the AMX-INT8 path, `amx`) Act::qx and Act::start.
Act thread_act(const QuantPart *parts, int64_t nparts, int64_t T, int64_t K, bool amx) {
    ActBuffers &b = t_act;
    const int64_t nb = K / 32;
    Act a{fit(b.q, T * K), fit(b.d, T * nb), fit(b.ds, T * nb), K, nb, {}};
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    // (the pair types read Act::start only in passes of one or two rows: kStarts)
    const bool small_pass = T <= 2 || (T % kMaxNT != 0 && T % kMaxNT <= 2);
    for (int64_t p = 0; p < nparts && !amx; p++) {
        const int qt = int(parts[p].qtype);
        if (qt == Q4_0X) a.qx = fit(b.qx, T * K);
        if (kOffset[qt] != 0 && (qt == Q6_K || small_pass)) a.start[qt] = fit(b.starts[qt], T * K / 4);
    }
#else
    (void)parts, (void)nparts, (void)amx;
#endif
    return a;
}

// Activation block i (row i / nb, block i % nb) of x into a's arrays.
inline void quantize_into(const void *x, int64_t ldx, bool bf16, int64_t i, const Act &a) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    quantize_start_one(x, ldx, bf16, i / a.nb, i % a.nb, a);
#else
    quantize_one(x, ldx, bf16, i / a.nb, i % a.nb, a.K, const_cast<int8_t *>(a.q), const_cast<float *>(a.d),
                 const_cast<float *>(a.ds));
#endif
}

// Up to this many activation blocks (T = 1 at K = 2048) every thread quantizes them all itself
// (into its own buffers) rather than its share and then waiting for the others: the copy costs
// less than the barrier (measured at the 135M shape: ~0.4 us a product of the ~1.8 us a parallel
// region cost with it).
constexpr int64_t kOwnBlocks = 64;

// Inside a product's parallel region: this thread's Act, x's T rows quantized into it: every block
// into the thread's own buffers (`own`), or its share into `shared`'s and a barrier.
Act quantize_in_region(const Act &shared, bool own, const QuantPart *parts, int64_t nparts, int64_t T, bool amx,
                       const void *x, int64_t ldx, bool x_bf16) {
    Act a = shared;
    if (own) {
        if (omp_get_thread_num() != 0) a = thread_act(parts, nparts, T, a.K, amx);
        for (int64_t i = 0; i < T * a.nb; i++) quantize_into(x, ldx, x_bf16, i, a);
    } else {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < T * a.nb; i++) quantize_into(x, ldx, x_bf16, i, a);
    }
    return a;
}

// y[t][r] (float32 or bf16, rows ldy apart) = v + bias[r] (bias float32, or null: + 0).
inline void put_out(void *y, bool y_bf16, int64_t ldy, const float *bias, int64_t t, int64_t r, float v) {
    v += bias ? bias[r] : 0.f;
    if (y_bf16) static_cast<uint16_t *>(y)[t * ldy + r] = f32_to_bf16(v);
    else static_cast<float *>(y)[t * ldy + r] = v;
}
}  // namespace

// y [T][ldy] (float32 or bf16) = x [T][ldx] (float32 or bf16) @ W.T + bias, W the parts stacked
// by rows (K columns each), through the integer dots. 0 on success.
extern "C" int quant_linear_small(const QuantPart *parts, int64_t nparts, const void *x, int64_t ldx, int x_bf16,
                                  int64_t T, int64_t K, const float *bias, void *y, int64_t ldy, int y_bf16) {
    const Handover *plan = t_handover;
    t_handover = nullptr;
    if (!valid(parts, nparts, K) || T <= 0) return 1;
    const int64_t nb = K / 32;
    const bool r8 = any_r8(parts, nparts);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    if (r8 && nparts == 1) {
        if (parts[0].rows % 8) return 1;
        const Act act = thread_act(parts, nparts, T, K, false);
        const int64_t groups = parts[0].rows / 8;
#pragma omp parallel if (groups * K * T >= 4096)
        {
            const Act a = quantize_in_region(act, T * nb <= kOwnBlocks, parts, nparts, T, false, x, ldx, x_bf16 != 0);
            const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
            const int64_t g0 = groups * tid / nt, g1 = groups * (tid + 1) / nt;
            PrefetchCursor ahead(plan, tid, nt);          // a LoRA delta's adapter weights (Handover)
            const int64_t per_group = g1 > g0 ? (ahead.lines() + g1 - g0 - 1) / (g1 - g0) : 0;
            float v[4 * 8];
            for (int64_t g = g0; g < g1; g++)
                for (int64_t t0 = 0; t0 < T; t0 += 4) {
                    if (t0 == 0) ahead.step(per_group);
                    const int n = int(std::min<int64_t>(4, T - t0));
                    kR8[n](parts[0].w + g * parts[0].ldw, nb, a, t0, v, 8);
                    for (int t = 0; t < n; t++)
                        for (int i = 0; i < 8; i++) put_out(y, y_bf16 != 0, ldy, bias, t0 + t, 8 * g + i, v[t * 8 + i]);
                }
            run_after(plan);
        }
        return 0;
    }
#endif
    if (r8) {         // several parts, or no AVX-512: the rows in the file's layout
        t_handover = plan;
        const PlainParts plain(parts, nparts, K);
        return quant_linear_small(plain.parts.data(), nparts, x, ldx, x_bf16, T, K, bias, y, ldy, y_bf16);
    }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    // AMX-INT8 from g_amx8.min_rows rows: the activations also as B tiles (amx8_group)
    const bool amx = g_amx8.enabled && T >= g_amx8.min_rows;
    const int64_t tiles = amx ? (T + 15) / 16 : 0;
    std::vector<int32_t> bv(tiles * (K / 4) * 16);
    std::vector<float> dxt(tiles * nb * 16), dst(tiles * nb * 16);
    const Amx8Act at{bv.data(), dxt.data(), dst.data(), T, K};
#else
    const bool amx = false;
#endif
    const bool own = !amx && T * nb <= kOwnBlocks;
    const Act shared = thread_act(parts, nparts, T, K, amx);
    std::vector<RowFn> full(nparts), tail(nparts);
    std::vector<Row2Fn> two(nparts);          // T = 1: two weight rows per call where the type has it
    std::vector<int64_t> ends(nparts);        // one past each part's last row in y
    int64_t N = 0, total = 0;                 // rows, weight bytes
    for (int64_t p = 0; p < nparts; p++) {
        total += parts[p].rows * (K / kElems[parts[p].qtype] * kBytes[parts[p].qtype]);
        full[p] = row_fn(int(parts[p].qtype), int(std::min<int64_t>(kMaxNT, T)));
        tail[p] = row_fn(int(parts[p].qtype), int(T % kMaxNT));
        two[p] = T == 1 ? row2_fn(int(parts[p].qtype)) : nullptr;
        ends[p] = N += parts[p].rows;
    }
    // One parallel region: the activations' blocks (each thread its share, or all of them: `own`),
    // then the weight rows (each thread a contiguous range, so it streams its rows' bytes once; up
    // to kMaxNT activation rows per pass).
#pragma omp parallel if (N * K * T >= 32768)
    {
        const Act a = quantize_in_region(shared, own, parts, nparts, T, amx, x, ldx, x_bf16 != 0);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        if (amx) {
            // B tiles: row g of tile k holds the 4-byte group g of activation rows 16k .. 16k + 15
#pragma omp for schedule(static)
            for (int64_t i = 0; i < tiles * (K / 4); i++) {
                const int64_t k = i / (K / 4), g = i % (K / 4);
                for (int64_t c = 0; c < 16; c++) {
                    int32_t v = 0;
                    if (16 * k + c < T) std::memcpy(&v, a.q + (16 * k + c) * K + 4 * g, 4);
                    bv[i * 16 + c] = v;
                }
            }
#pragma omp for schedule(static)
            for (int64_t i = 0; i < tiles * nb; i++) {
                const int64_t k = i / nb, j = i % nb;
                for (int64_t c = 0; c < 16; c++) {
                    const bool real = 16 * k + c < T;
                    dxt[i * 16 + c] = real ? a.d[(16 * k + c) * nb + j] : 0.f;
                    dst[i * 16 + c] = real ? a.ds[(16 * k + c) * nb + j] : 0.f;
                }
            }
            amx8_rows(parts, nparts, at, total, bias, y, ldy, y_bf16 != 0);
        } else
#endif
        {
        // Each thread a contiguous range of rows holding an equal share of the weight bytes
        // (parts of different types cost differently per row).
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t begin = row_at_byte(parts, nparts, K, total * tid / nt);
        const int64_t end = row_at_byte(parts, nparts, K, total * (tid + 1) / nt);
        PrefetchCursor ahead(plan, tid, nt);
        const int64_t per_row = end > begin ? (ahead.lines() + end - begin - 1) / (end - begin) : 0;
        auto put = [&](int64_t t, int64_t r, float v) { put_out(y, y_bf16 != 0, ldy, bias, t, r, v); };
        for (int64_t r = begin; r < end; r++) {
            int64_t p = 0;
            while (r >= ends[p]) p++;
            const uint8_t *row = parts[p].w + (r - (ends[p] - parts[p].rows)) * parts[p].ldw;
            ahead.step(per_row);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
            if (two[p] != nullptr && r + kPassRows <= std::min(end, ends[p])) {    // rows r .. of one part
                float vs[kPassRows];
                two[p](row, parts[p].ldw, a, vs);
                for (int i = 0; i < kPassRows; i++) put(0, r + i, vs[i]);
                ahead.step(per_row * (kPassRows - 1));
                r += kPassRows - 1;
                continue;
            }
#endif
            // (one row a pass here: the whole row that far ahead, once)
            prefetch_bytes(row + prefetch_rows(parts[p].ldw, 1) * parts[p].ldw, 0, 1,
                           K / kElems[parts[p].qtype] * kBytes[parts[p].qtype]);
            for (int64_t t0 = 0; t0 < T; t0 += kMaxNT) {
                const int nt = int(std::min<int64_t>(kMaxNT, T - t0));
                float vals[kMaxNT];
                (nt == kMaxNT || nt == T ? full[p] : tail[p])(row, a, t0, vals, 1);
                for (int i = 0; i < nt; i++) put(t0 + i, r, vals[i]);
            }
        }
        }
        run_after(plan);
    }
    return 0;
}

// out [rows][ldo bytes] = x [rows][ldx] (float32 or bf16) in q8_0 or q4_0 blocks, llama.cpp's
// reference rounding as gguf.quants computes it (q4_0's value in double, then float, then
// truncated: -ffp-contract=off keeps it unfused). 0 on success.
extern "C" int quant_quantize(int qt, const void *x, int64_t ldx, int x_bf16, int64_t rows, int64_t cols,
                              uint8_t *out, int64_t ldo) {
    if ((qt != Q8_0 && qt != Q4_0) || cols % 32) return 1;
#pragma omp parallel for schedule(static) if (rows * cols >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        float v[32];
        for (int64_t j = 0; j < cols / 32; j++) {
            for (int i = 0; i < 32; i++)
                v[i] = x_bf16 ? bf16_to_f32(static_cast<const uint16_t *>(x)[r * ldx + j * 32 + i])
                              : static_cast<const float *>(x)[r * ldx + j * 32 + i];
            uint8_t *b = out + r * ldo + j * kBytes[qt];
            if (qt == Q8_0) {
                float amax = 0.f;
                for (int i = 0; i < 32; i++) amax = std::max(amax, std::fabs(v[i]));
                const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
                const uint16_t h = f32_to_f16(d);
                std::memcpy(b, &h, 2);
                for (int i = 0; i < 32; i++) b[2 + i] = uint8_t(int8_t(std::round(v[i] * id)));
            } else {
                int imax = 0;                    // the first element of largest magnitude, with its sign
                for (int i = 1; i < 32; i++)
                    if (std::fabs(v[i]) > std::fabs(v[imax])) imax = i;
                const float d = v[imax] / -8.f, id = d != 0.f ? 1.f / d : 0.f;
                const uint16_t h = f32_to_f16(d);
                std::memcpy(b, &h, 2);
                int q[32];
                for (int i = 0; i < 32; i++) {
                    const float t = std::trunc(float(double(v[i]) * double(id) + 8.5));
                    q[i] = std::min(15, int(t));
                }
                for (int i = 0; i < 16; i++) b[2 + i] = uint8_t(q[i] | (q[i + 16] << 4));
            }
        }
    }
    return 0;
}
