// CPU kernels of pagedserve, in sections: paged decode attention; K/V writes; the GEMMs over
// packed weights; fused element-wise layers; greedy sampling's argmax; tiled prefill attention;
// one step's attention (decode rows, then prefill chunks); every decoder layer in one call.
//
// Paged decode attention: one query token per sequence, reading keys and values straight
// from their cache blocks through the block table (no gathered copy).
//
// Work is split over (sequence, KV head, context partition). The query heads that share
// a KV head (GQA) are processed together, so each key and value is loaded once for all of
// them. A partition keeps a running max, sum and weighted sum of values (online softmax);
// the partitions of one (sequence, head) are merged at the end. Math is float32 whatever
// the storage type (float32 or bfloat16).
//
// Layouts: q, out [N, Hq, D]; caches [num_blocks, B, Hkv, D] in any order of the first three
// dims (strides in a Layout; D contiguous); block_tables [N, stride].
//
// 8-bit KV caches (kernels take the cache's element type K apart from the query's T): each
// (token, KV head) row holds D one-byte codes and, for the scaled formats, a bf16 scale after
// them (row = D + 2 bytes; attention/kv_format.py). Codes become float32 in registers (FP8 via
// a shift into fp16 bits and F16C's conversion, int8 by sign extension); the scales are applied
// to whole scores (K: s_t = scale_t * q . k_t) and softmax weights (V: w_t scale_t), so no
// element is scaled and no block is ever dequantized into memory.
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
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

namespace {

struct Layout {   // element strides of a cache: between blocks, token slots, KV heads
    int64_t block, token, head;
};

constexpr int64_t kMaxGroup = 16, kMaxDim = 256, kMaxBlock = 256, kMaxPartition = 512;
constexpr int64_t kAhead = 32;  // rows prefetched ahead of use

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) {
    uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline void store(float *dst, float x) { *dst = x; }
inline void store(uint16_t *dst, float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    *dst = static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);   // round to nearest even
}

// ---- 8-bit KV cache element types: one byte each -------------------------------------------------
struct E5M2 { uint8_t b; };   // fp8 e5m2: the top byte of an fp16, no scale
struct E4M3 { uint8_t b; };   // fp8 e4m3fn with a bf16 scale per (token, head) row
struct I8 { int8_t b; };      // int8 (symmetric, +-127) with a bf16 scale per row
template <typename K> constexpr bool kQuant = sizeof(K) == 1;
template <typename K> constexpr bool kScaled = std::is_same_v<K, E4M3> || std::is_same_v<K, I8>;

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

// One partition's state for G heads: m[G], l[G], acc[G][D], laid out in `p`.
template <typename T>
void attend_partition(const float *q, const T *kc, const T *vc, const int64_t *table, int64_t t0, int64_t t1,
                      int64_t h, Layout L, int64_t D, int64_t B, int64_t G, float *p) {
    // T: the cache's element type (the query is float32 already); 8-bit rows carry their scale.
    float *m = p, *l = p + G, *acc = p + 2 * G;
    float s[kMaxBlock];
    for (int64_t start = t0; start < t1;) {
        const int64_t blk = table[start / B], off = start % B;
        const int64_t n = std::min(B - off, t1 - start);
        const T *kb = kc + blk * L.block + off * L.token + h * L.head;
        const T *vb = vc + blk * L.block + off * L.token + h * L.head;
        for (int64_t g = 0; g < G; g++) {
            const float *qg = q + g * D;
            float mx = m[g];
            for (int64_t t = 0; t < n; t++) {
                const T *kt = kb + t * L.token;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; d++) dot += qg[d] * to_f32(kt[d]);
                if constexpr (kScaled<T>) dot *= row_scale(kt, D);
                s[t] = dot;
                mx = std::max(mx, dot);
            }
            const float correction = std::exp(m[g] - mx);
            m[g] = mx;
            float sum = l[g] * correction;
            float *a = acc + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) a[d] *= correction;
            for (int64_t t = 0; t < n; t++) {
                const float w = std::exp(s[t] - mx);
                sum += w;
                const T *vt = vb + t * L.token;
                const float wv = w * row_scale(vt, D);
#pragma omp simd
                for (int64_t d = 0; d < D; d++) a[d] += wv * to_f32(vt[d]);
            }
            l[g] = sum;
        }
        start += n;
    }
}

// Where the key and value rows of tokens t0..t1 of KV head h are: walks the block table.
template <typename T>
void row_pointers(const T *kc, const T *vc, const int64_t *table, int64_t t0, int64_t t1, int64_t h, Layout L,
                  int64_t B, const T **krow, const T **vrow) {
    for (int64_t t = 0, pos = t0; pos < t1;) {
        const int64_t off = pos % B, count = std::min(B - off, t1 - pos);
        const int64_t row = table[pos / B] * L.block + off * L.token + h * L.head;
        for (int64_t c = 0; c < count; c++, t++) {
            krow[t] = kc + row + c * L.token;
            vrow[t] = vc + row + c * L.token;
        }
        pos += count;
    }
}

#ifdef __AVX512F__
// ---- AVX-512 path: vector exp, 16 lanes of the head dimension per register --------------------
inline __m512 load16(const float *p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t *p) {   // bf16 -> f32 is a 16-bit shift
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m128i load_bytes16(const void *p) { return _mm_loadu_si128(reinterpret_cast<const __m128i *>(p)); }
inline __m512 load16(const E5M2 *p) {       // the byte is an fp16's top byte: shift, then convert
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(load_bytes16(p)), 8));
}
inline __m512 load16(const E4M3 *p) {       // sign-extend, shift under fp16's fields, clear bit 14
    const __m256i x = _mm256_slli_epi16(_mm256_cvtepi8_epi16(load_bytes16(p)), 7);
    return _mm512_cvtph_ps(_mm256_and_si256(x, _mm256_set1_epi16(static_cast<short>(0xBF80))));
}
inline __m512 load16(const I8 *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load_bytes16(p))); }

// e^x for x <= 0 (softmax weights): x = n ln2 + r with |r| <= ln2/2 (ln2 split in two parts so
// r is exact), e^r by its Taylor series to degree 7 (relative error < 1e-8), times 2^n.
inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-110.f));          // e^-110 rounds to 0 in float32
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.4286068203094172e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040);
    for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    return _mm512_scalef_ps(p, n);
}

// Round to the storage type (nearest even for bf16), kept as float32; and store 16 values.
inline __m512 round_to(__m512 v, const float *) { return v; }
inline __m512 round_to(__m512 v, const uint16_t *) {
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void store16(float *dst, __m512 v) { _mm512_storeu_ps(dst, v); }
inline void store16(uint16_t *dst, __m512 v) {
    const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(round_to(v, dst)), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(dst), _mm512_cvtepi32_epi16(bits));
}

// e^x for any x: large arguments overflow to +inf, as expf does.
inline __m512 exp16_any(__m512 x) { return exp16(_mm512_min_ps(x, _mm512_set1_ps(89.f))); }

// Lane t of the result is the sum of the 16 lanes of v[t]: four rounds of pairwise shuffles
// and adds, ~3 operations per vector instead of ~8 for a reduction each.
inline __m512 transpose_sum16(const __m512 *v) {
    __m512 r[8], x[4], y[2];
    for (int i = 0; i < 8; i++)   // per 128-bit chunk: v[2i], v[2i+1], v[2i], v[2i+1]
        r[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  // per chunk: v[4i .. 4i+3]
        const __m512d a = _mm512_castps_pd(r[2 * i]), b = _mm512_castps_pd(r[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++)    // chunks: v[8i..8i+3] twice, v[8i+4..8i+7] twice
        y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
}

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

// q . k in 16 float32 lanes (to be summed), for each storage type.
inline __m512 dot_lanes(const float *q, const float *k, int64_t D) {
    __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
    for (int64_t d = 16; d < D; d += 16) dot = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), dot);
    return dot;
}
inline __m512 dot_lanes(const uint16_t *q, const uint16_t *k, int64_t D) {
    __m512 dot = _mm512_setzero_ps();
#ifdef __AVX512BF16__
    // bf16 pairs multiplied exactly, summed in float32: 32 elements per instruction.
    for (int64_t d = 0; d < D; d += 32)
        dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(k + d));
#else
    for (int64_t d = 0; d < D; d += 16) dot = _mm512_fmadd_ps(load16(q + d), load16(k + d), dot);
#endif
    return dot;
}

// Scores of one query head against key rows, 16 at a time: s[t] = scale * q . k_t. `krow` has
// a multiple of 16 entries (the tail repeats a real row; the caller masks those scores).
// Rows come from scattered blocks, which the hardware prefetcher does not foresee: the next
// 16 rows' first `span` elements are requested while these are computed.
template <typename T>
void scores(const T *q, const T *const *krow, const T *const *vrow, int64_t n, int64_t D, float scale, float *s, bool prefetch) {
    const __m512 sv = _mm512_set1_ps(scale);
    for (int64_t t = 0; t < n; t += 16) {
        for (int64_t i = t + kAhead; prefetch && i < std::min(t + kAhead + 16, n); i++)
            for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) {
                _mm_prefetch(reinterpret_cast<const char *>(krow[i]) + b, _MM_HINT_T1);
                _mm_prefetch(reinterpret_cast<const char *>(vrow[i]) + b, _MM_HINT_T1);
            }
        __m512 dots[16];
        for (int i = 0; i < 16; i++) dots[i] = dot_lanes(q, krow[t + i], D);
        _mm512_storeu_ps(s + t, _mm512_mul_ps(transpose_sum16(dots), sv));
    }
}

// 32 values of a row as float32, in two registers: (even, odd) elements for bf16 (two bit
// operations), plain order for float32. The order is undone once, when the sums are stored.
inline void load32(const float *p, __m512 &a, __m512 &b) { a = _mm512_loadu_ps(p); b = _mm512_loadu_ps(p + 16); }
inline void load32(const uint16_t *p, __m512 &a, __m512 &b) {
    const __m512i x = _mm512_loadu_si512(p);
    a = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    b = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void store32(float *dst, __m512 a, __m512 b, const float *) { _mm512_storeu_ps(dst, a); _mm512_storeu_ps(dst + 16, b); }
inline void load32(const I8 *p, __m512 &a, __m512 &b) { a = load16(p); b = load16(p + 16); }   // plain order
// FP8: the 32 codes' fp16 bits built in one 512-bit register (one widening, shift and mask for
// 32 lanes instead of two for 16 each), then two conversions: e4m3 4 operations per 16 codes
// instead of 5 (27% less time converting in a microbenchmark here), e5m2 3.5 instead of 4.
inline __m512i load_bytes32(const void *p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p))); }
inline void halves_to_f32(__m512i h, __m512 &a, __m512 &b) {
    a = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    b = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}
inline void load32(const E5M2 *p, __m512 &a, __m512 &b) { halves_to_f32(_mm512_slli_epi16(load_bytes32(p), 8), a, b); }
inline void load32(const E4M3 *p, __m512 &a, __m512 &b) {
    const __m512i x = _mm512_slli_epi16(_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p))), 7);
    halves_to_f32(_mm512_and_si512(x, _mm512_set1_epi16(static_cast<short>(0xBF80))), a, b);
}
template <typename K, std::enable_if_t<kQuant<K>, int> = 0>
inline void store32(float *dst, __m512 a, __m512 b, const K *) { _mm512_storeu_ps(dst, a); _mm512_storeu_ps(dst + 16, b); }
inline void store32(float *dst, __m512 even, __m512 odd, const uint16_t *) {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    _mm512_storeu_ps(dst, _mm512_permutex2var_ps(even, lo, odd));
    _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(even, hi, odd));
}

// The same for the G query heads of a KV head (q: G rows of D = 32 J float32) over 8-bit key
// rows: each block of 16 rows is converted once, into a tile of float32 in L1, for all G heads
// (converting per head would cost G times as much); s[g * ld + t] = scale ksc_t q_g . k_t, with
// ksc_t a scaled row's own scale, read here beside its codes (no pass over the rows before).
// A head's query stays in registers over the 16 rows (up to D = 128), so each FMA loads only
// its tile operand.
template <int J, typename K>
void scores_kv8(const float *q, int64_t G, const K *const *krow, const K *const *vrow, int64_t n, float scale,
                float *s, int64_t ld) {
    constexpr int64_t D = 32 * J;
    const __m512 sv = _mm512_set1_ps(scale);
    alignas(64) float tile[16 * D];
    for (int64_t t = 0; t < n; t += 16) {
        for (int64_t i = t + kAhead; i < std::min(t + kAhead + 16, n); i++)
            for (int64_t b = 0; b < D; b += 64) {
                _mm_prefetch(reinterpret_cast<const char *>(krow[i]) + b, _MM_HINT_T1);
                _mm_prefetch(reinterpret_cast<const char *>(vrow[i]) + b, _MM_HINT_T1);
            }
        __m512 kv = sv;
        if constexpr (kScaled<K>) {
            alignas(64) float ksc[16];
            for (int i = 0; i < 16; i++) ksc[i] = row_scale(krow[t + i], D);
            kv = _mm512_mul_ps(sv, _mm512_load_ps(ksc));
        }
        if (G == 1) {      // one head (no grouping): the converted row goes straight into its dot
            __m512 qr[2 * J], dots[16];
            for (int j = 0; j < 2 * J; j++) qr[j] = _mm512_loadu_ps(q + 16 * j);
            for (int i = 0; i < 16; i++) {
                __m512 dot = _mm512_setzero_ps();
                for (int j = 0; j < J; j++) {
                    __m512 a, b;
                    load32(krow[t + i] + 32 * j, a, b);
                    dot = _mm512_fmadd_ps(qr[2 * j + 1], b, _mm512_fmadd_ps(qr[2 * j], a, dot));
                }
                dots[i] = dot;
            }
            _mm512_storeu_ps(s + t, _mm512_mul_ps(transpose_sum16(dots), kv));
            continue;
        }
        for (int i = 0; i < 16; i++)
            for (int j = 0; j < J; j++) {
                __m512 a, b;
                load32(krow[t + i] + 32 * j, a, b);
                _mm512_store_ps(tile + i * D + 32 * j, a);
                _mm512_store_ps(tile + i * D + 32 * j + 16, b);
            }
        for (int64_t g = 0; g < G; g++) {
            __m512 qr[2 * J], dots[16];
            for (int j = 0; j < 2 * J; j++) qr[j] = _mm512_loadu_ps(q + g * D + 16 * j);
            for (int i = 0; i < 16; i++) {
                __m512 dot = _mm512_mul_ps(qr[0], _mm512_load_ps(tile + i * D));
                for (int j = 1; j < 2 * J; j++) dot = _mm512_fmadd_ps(qr[j], _mm512_load_ps(tile + i * D + 16 * j), dot);
                dots[i] = dot;
            }
            _mm512_storeu_ps(s + g * ld + t, _mm512_mul_ps(transpose_sum16(dots), kv));
        }
    }
}

// acc[c][0:D] = sum_t w[c][t] v_t for the first `heads` (<= C) heads, D = 32 J: each value row
// is loaded and converted once for all of them; C J <= 8 keeps the 2 C J sums in registers.
template <int J, int C, typename T>
void weighted_values(const float *w, int64_t w_stride, int heads, const T *const *vrow, int64_t n, float *acc,
                     bool prefetch) {
    constexpr int64_t D = 32 * J;
    __m512 a[C][2 * J];
    for (int c = 0; c < C; c++)
        for (int j = 0; j < 2 * J; j++) a[c][j] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
        if (prefetch && t + kAhead < n)
            for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64)
                _mm_prefetch(reinterpret_cast<const char *>(vrow[t + kAhead]) + b, _MM_HINT_T1);
        __m512 v[2 * J];
        for (int j = 0; j < J; j++) load32(vrow[t] + 32 * j, v[2 * j], v[2 * j + 1]);
        const float vs = row_scale(vrow[t], D);       // a scaled 8-bit row's scale (else 1)
        for (int c = 0; c < C; c++) {
            if (c >= heads) break;
            const __m512 wt = _mm512_set1_ps(w[c * w_stride + t] * vs);
            for (int j = 0; j < 2 * J; j++) a[c][j] = _mm512_fmadd_ps(wt, v[j], a[c][j]);
        }
    }
    for (int c = 0; c < heads; c++)
        for (int j = 0; j < J; j++) store32(acc + c * D + 32 * j, a[c][2 * j], a[c][2 * j + 1], vrow[0]);
}

#ifdef __AVX512BF16__
// The same for bf16 values with bf16 weights (each softmax weight rounded to bf16, as flash
// attention rounds P before its PV product): rows t and t+1 interleaved into (v_t[d],
// v_t+1[d]) pairs, so one bf16 dot product adds w_t v_t[d] + w_t+1 v_t+1[d] for 16 dims, half
// the instructions of converting to float32 and two FMAs. `w` holds bf16 weights in pairs,
// `n` is even (the padding rows have weight 0). The interleave works within 128-bit lanes:
// sum register 2j holds dims {0-3, 8-11, 16-19, 24-27} of 32, 2j+1 the others; undone at store.
template <int J, int C>
void weighted_values_bf16(const uint16_t *w, int64_t w_stride, int heads, const uint16_t *const *vrow, int64_t n,
                          float *acc, bool prefetch) {
    constexpr int64_t D = 32 * J;
    __m512 a[C][2 * J];
    for (int c = 0; c < C; c++)
        for (int j = 0; j < 2 * J; j++) a[c][j] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 2) {
        if (prefetch && t + kAhead < n)
            for (int64_t i = t + kAhead; i < std::min(t + kAhead + 2, n); i++)
                for (int64_t b = 0; b < D * 2; b += 64) _mm_prefetch(reinterpret_cast<const char *>(vrow[i]) + b, _MM_HINT_T1);
        __m512i v[2 * J];
        for (int j = 0; j < J; j++) {
            const __m512i x = _mm512_loadu_si512(vrow[t] + 32 * j), y = _mm512_loadu_si512(vrow[t + 1] + 32 * j);
            v[2 * j] = _mm512_unpacklo_epi16(x, y);
            v[2 * j + 1] = _mm512_unpackhi_epi16(x, y);
        }
        for (int c = 0; c < C; c++) {
            if (c >= heads) break;
            uint32_t pair;
            std::memcpy(&pair, w + c * w_stride + t, 4);
            const __m512bh wt = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
            for (int j = 0; j < 2 * J; j++) a[c][j] = _mm512_dpbf16_ps(a[c][j], (__m512bh)v[j], wt);
        }
    }
    // Lane k of register lo holds dim 8(k/4) + k%4, of hi 8(k/4) + 4 + k%4.
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int c = 0; c < heads; c++)
        for (int j = 0; j < J; j++) {
            _mm512_storeu_ps(acc + c * D + 32 * j, _mm512_permutex2var_ps(a[c][2 * j], first, a[c][2 * j + 1]));
            _mm512_storeu_ps(acc + c * D + 32 * j + 16, _mm512_permutex2var_ps(a[c][2 * j], second, a[c][2 * j + 1]));
        }
}
#endif

// One whole partition from scratch (m, l, acc as attend_partition leaves them), for head dims
// D = 32 J: each query head's scores and softmax weights (vector exp), then the weighted sums
// of values for all heads together.
// T: the query's type; K: the cache's (T, or an 8-bit format: q in float32, scaled rows' key
// scales on the scores, value scales on the softmax weights after their sum).
template <int J, typename T, typename K = T>
void attend_partition_avx512(const T *q, float scale, const K *kc, const K *vc, const int64_t *table, int64_t t0,
                             int64_t t1, int64_t h, Layout L, int64_t B, int64_t G, float *p) {
    constexpr int64_t D = 32 * J, C = J >= 8 ? 1 : 8 / J;
    float *m = p, *l = p + G, *acc = p + 2 * G;
    const int64_t n = t1 - t0, padded = (n + 15) / 16 * 16, W = padded;
    // Per-thread scratch, grown once: row pointers and every head's scores for the partition.
    thread_local std::vector<const K *> krow, vrow;
    thread_local std::vector<float> scores_buf;
    if (static_cast<int64_t>(krow.size()) < padded) krow.resize(padded), vrow.resize(padded);
    if (static_cast<int64_t>(scores_buf.size()) < G * W) scores_buf.resize(G * W);
#ifdef __AVX512BF16__
    constexpr bool kBf16Weights = std::is_same_v<T, uint16_t> && std::is_same_v<K, uint16_t>;
    thread_local std::vector<uint16_t> weights_bf16;
    if (kBf16Weights && static_cast<int64_t>(weights_bf16.size()) < G * W) weights_bf16.resize(G * W);
#endif
    row_pointers(kc, vc, table, t0, t1, h, L, B, krow.data(), vrow.data());
    for (int64_t t = n; t < padded; t++) krow[t] = krow[0], vrow[t] = vrow[0];   // weights 0 below
    for (int64_t t = 0; t < std::min(kAhead, n); t++)
        for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(K)); b += 64) {
            _mm_prefetch(reinterpret_cast<const char *>(krow[t]) + b, _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char *>(vrow[t]) + b, _MM_HINT_T1);
        }
    if constexpr (kQuant<K>) {      // every head's scores, each key row converted once
        alignas(64) float qf[kMaxGroup * D];
        for (int64_t d = 0; d < G * D; d++) qf[d] = to_f32(q[d]);
        scores_kv8<J>(qf, G, krow.data(), vrow.data(), n, scale, scores_buf.data(), W);
    }
    for (int64_t g = 0; g < G; g++) {
        float *sg = scores_buf.data() + g * W;
        if constexpr (!kQuant<K>) scores(q + g * D, krow.data(), vrow.data(), n, D, scale, sg, g == 0);
        for (int64_t t = n; t < padded; t++) sg[t] = -INFINITY;
        __m512 mxv = _mm512_loadu_ps(sg);
        for (int64_t t = 16; t < padded; t += 16) mxv = _mm512_max_ps(mxv, _mm512_loadu_ps(sg + t));
        const float mx = _mm512_reduce_max_ps(mxv);
        mxv = _mm512_set1_ps(mx);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < padded; t += 16) {   // padding: e^-inf = 0
            __m512 w = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + t), mxv));
#ifdef __AVX512BF16__
            if constexpr (kBf16Weights) {    // the weights the value pass uses, and their sum
                const __m256bh wb = _mm512_cvtneps_pbh(w);
                _mm256_storeu_si256(reinterpret_cast<__m256i *>(weights_bf16.data() + g * W + t), (__m256i)wb);
                w = _mm512_cvtpbh_ps(wb);
            }
#endif
            sum = _mm512_add_ps(sum, w);
            _mm512_storeu_ps(sg + t, w);
        }
        m[g] = mx;
        l[g] = _mm512_reduce_add_ps(sum);
    }
    for (int64_t g = 0; g < G; g += C) {
        const int heads = static_cast<int>(std::min(C, G - g));
#ifdef __AVX512BF16__
        if constexpr (kBf16Weights) {
            weighted_values_bf16<J, C>(weights_bf16.data() + g * W, W, heads, vrow.data(), padded, acc + g * D, g == 0);
            continue;
        }
#endif
        weighted_values<J, C>(scores_buf.data() + g * W, W, heads, vrow.data(), n, acc + g * D, g == 0);
    }
}
#endif

// ---- float32 vectors of each build, one interface ---------------------------------------------
// Kernels written once over `V` (V16: AVX-512, V8: AVX2+FMA, VPortable: plain loops the compiler
// vectorises as it can) run on every CPU family: W float32 lanes; bf16 values are converted in
// registers (a 16-bit shift) and all arithmetic is float32, as on CPUs without bf16 arithmetic.
// Softmax e^x for x <= 0 (exp) and for any x (exp_any): x = n ln2 + r (ln2 split in two so r
// is exact), e^r by its Taylor series to degree 7 (relative error < 1e-8), times 2^n.
struct VPortable {
    static constexpr int W = 8;
    struct reg { float v[W]; };
    template <typename F> static reg map(F f) { reg r; for (int i = 0; i < W; i++) r.v[i] = f(i); return r; }
    static reg zero() { return set1(0.f); }
    static reg set1(float x) { return map([&](int) { return x; }); }
    static reg load(const float *p) { return map([&](int i) { return p[i]; }); }
    static reg load(const uint16_t *p) { return map([&](int i) { return to_f32(p[i]); }); }
    template <typename K, std::enable_if_t<kQuant<K>, int> = 0>
    static reg load(const K *p) { return map([&](int i) { return to_f32(p[i]); }); }
    template <typename T> static void load2(const T *p, reg &a, reg &b) { a = load(p); b = load(p + W); }
    static void load_pairs(const uint16_t *p, reg &even, reg &odd) {   // W (even, odd) bf16 pairs
        even = map([&](int i) { return to_f32(p[2 * i]); });
        odd = map([&](int i) { return to_f32(p[2 * i + 1]); });
    }
    static reg add(reg a, reg b) { return map([&](int i) { return a.v[i] + b.v[i]; }); }
    static reg sub(reg a, reg b) { return map([&](int i) { return a.v[i] - b.v[i]; }); }
    static reg mul(reg a, reg b) { return map([&](int i) { return a.v[i] * b.v[i]; }); }
    static reg div(reg a, reg b) { return map([&](int i) { return a.v[i] / b.v[i]; }); }
    static reg max(reg a, reg b) { return map([&](int i) { return std::max(a.v[i], b.v[i]); }); }
    static reg fmadd(reg a, reg b, reg c) { return map([&](int i) { return a.v[i] * b.v[i] + c.v[i]; }); }
    static reg exp(reg x) { return map([&](int i) { return std::exp(x.v[i]); }); }
    static reg exp_any(reg x) { return exp(x); }
    static reg round_bf16(reg x) {
        return map([&](int i) { uint16_t b; ::store(&b, x.v[i]); return to_f32(b); });
    }
    static void store(float *p, reg x) { for (int i = 0; i < W; i++) p[i] = x.v[i]; }
    static void store(uint16_t *p, reg x) { for (int i = 0; i < W; i++) ::store(p + i, x.v[i]); }
    static float reduce_add(reg x) { float s = 0.f; for (int i = 0; i < W; i++) s += x.v[i]; return s; }
    static float reduce_max(reg x) { float s = x.v[0]; for (int i = 1; i < W; i++) s = std::max(s, x.v[i]); return s; }
    static void prefetch(const void *p) { __builtin_prefetch(p, 0, 2); }
};

#ifdef __AVX2__
struct V8 {
    static constexpr int W = 8;
    using reg = __m256;
    static reg zero() { return _mm256_setzero_ps(); }
    static reg set1(float x) { return _mm256_set1_ps(x); }
    static reg load(const float *p) { return _mm256_loadu_ps(p); }
    static reg load(const uint16_t *p) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    }
    // 8 codes of an 8-bit cache (F16C for the FP8 formats, as the AVX-512 load16s).
    static __m128i bytes8(const void *p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i *>(p)); }
    static reg load(const E5M2 *p) { return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes8(p)), 8)); }
    static reg load(const E4M3 *p) {
        const __m128i x = _mm_slli_epi16(_mm_cvtepi8_epi16(bytes8(p)), 7);
        return _mm256_cvtph_ps(_mm_and_si128(x, _mm_set1_epi16(static_cast<short>(0xBF80))));
    }
    static reg load(const I8 *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes8(p))); }
    // 2 W values: FP8's fp16 bits for 16 codes built in one register, then two conversions.
    template <typename T> static void load2(const T *p, reg &a, reg &b) { a = load(p); b = load(p + W); }
    static void halves(__m256i h, reg &a, reg &b) {
        a = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        b = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    }
    static __m128i bytes16(const void *p) { return _mm_loadu_si128(reinterpret_cast<const __m128i *>(p)); }
    static void load2(const E5M2 *p, reg &a, reg &b) { halves(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes16(p)), 8), a, b); }
    static void load2(const E4M3 *p, reg &a, reg &b) {
        const __m256i x = _mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes16(p)), 7);
        halves(_mm256_and_si256(x, _mm256_set1_epi16(static_cast<short>(0xBF80))), a, b);
    }
    static void load_pairs(const uint16_t *p, reg &even, reg &odd) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p));
        even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
        odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
    }
    static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
    static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
    static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
    static reg div(reg a, reg b) { return _mm256_div_ps(a, b); }
    static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
    static reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
    // No scalef: 2^n is built in the exponent bits, so n stays >= -126 (x >= -87.3); below,
    // e^x (< 1.2e-38) is flushed to 0, as e^-inf must be.
    static reg exp(reg x) {
        const reg keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ);
        x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
        const reg n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        reg r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
        r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.4286068203094172e-06f), r);
        reg p = _mm256_set1_ps(1.f / 5040);
        for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
    }
    static reg exp_any(reg x) {        // n = 128 (x > 88.4) gives the exponent of +inf, as expf overflows
        return exp(_mm256_min_ps(x, _mm256_set1_ps(89.f)));
    }
    static reg round_bf16(reg v) {     // to nearest even, kept as float32
        __m256i u = _mm256_castps_si256(v);
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
        return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
    }
    static void store(float *p, reg x) { _mm256_storeu_ps(p, x); }
    static void store(uint16_t *p, reg x) {
        const __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(x)), 16);
        _mm_storeu_si128(reinterpret_cast<__m128i *>(p),
                         _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
    }
    static float reduce_add(reg x) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
    }
    static float reduce_max(reg x) {
        __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
        s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
    }
    static void prefetch(const void *p) { _mm_prefetch(reinterpret_cast<const char *>(p), _MM_HINT_T1); }
    // In place: r[i] lane j <- r[j] lane i (3 rounds of 8 shuffles, as transpose16_epi32).
    static void transpose(reg *r) {
        reg t[8], u[8];
        for (int k = 0; k < 4; k++) {
            t[2 * k] = _mm256_unpacklo_ps(r[2 * k], r[2 * k + 1]);
            t[2 * k + 1] = _mm256_unpackhi_ps(r[2 * k], r[2 * k + 1]);
        }
        for (int m = 0; m < 2; m++) {      // u[4m + c], 128-bit half L: column 4L + c of rows 4m..4m+3
            u[4 * m] = _mm256_shuffle_ps(t[4 * m], t[4 * m + 2], 0x44);
            u[4 * m + 1] = _mm256_shuffle_ps(t[4 * m], t[4 * m + 2], 0xEE);
            u[4 * m + 2] = _mm256_shuffle_ps(t[4 * m + 1], t[4 * m + 3], 0x44);
            u[4 * m + 3] = _mm256_shuffle_ps(t[4 * m + 1], t[4 * m + 3], 0xEE);
        }
        for (int c = 0; c < 4; c++) {
            r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
            r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
        }
    }
};
#endif

#ifdef __AVX512F__
struct V16 {
    static constexpr int W = 16;
    using reg = __m512;
    static reg zero() { return _mm512_setzero_ps(); }
    static reg set1(float x) { return _mm512_set1_ps(x); }
    template <typename T> static reg load(const T *p) { return load16(p); }
    template <typename T> static void load2(const T *p, reg &a, reg &b) { a = load(p); b = load(p + W); }
    static void load_pairs(const uint16_t *p, reg &even, reg &odd) { load32(p, even, odd); }
    static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
    static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
    static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
    static reg div(reg a, reg b) { return _mm512_div_ps(a, b); }
    static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
    static reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
    static reg exp(reg x) { return exp16(x); }
    static reg exp_any(reg x) { return exp16_any(x); }
    static reg round_bf16(reg x) { return round_to(x, static_cast<const uint16_t *>(nullptr)); }
    template <typename T> static void store(T *p, reg x) { store16(p, x); }
    static float reduce_add(reg x) { return _mm512_reduce_add_ps(x); }
    static float reduce_max(reg x) { return _mm512_reduce_max_ps(x); }
    static void prefetch(const void *p) { _mm_prefetch(reinterpret_cast<const char *>(p), _MM_HINT_T1); }
    static void transpose(reg *r) {      // r[i] lane j <- r[j] lane i
        __m512i x[16];
        for (int i = 0; i < 16; i++) x[i] = _mm512_castps_si512(r[i]);
        transpose16_epi32(x);
        for (int i = 0; i < 16; i++) r[i] = _mm512_castsi512_ps(x[i]);
    }
};
using Vec = V16;          // the widest vectors of this build
#elif defined(__AVX2__)
using Vec = V8;
#else
using Vec = VPortable;
#endif

// Rounds to the storage type T (bf16: nearest even), kept as float32; identity for float32.
template <class V> typename V::reg round_as_v(typename V::reg x, const float *) { return x; }
template <class V> typename V::reg round_as_v(typename V::reg x, const uint16_t *) { return V::round_bf16(x); }


// ---- decode attention over V: the partition kernel of the other builds -----------------------
// (AVX2; AVX-512 at head dims without a kernel above.) Same results as attend_partition_avx512:
// each query head's scores (q in float32, keys converted in registers), softmax weights by the
// vector exp, then the weighted sums of values, each value row loaded and converted once per
// 4 W dims for 2 heads at a time (12 sums and 4 rows in AVX2's 16 registers).
template <class V, int D, typename T, typename K = T>
void attend_partition_vec(const T *q, float scale, const K *kc, const K *vc, const int64_t *table, int64_t t0,
                          int64_t t1, int64_t h, Layout L, int64_t B, int64_t G, float *p) {
    using R = typename V::reg;
    constexpr int W = V::W, NR = D / W, NV = NR < 4 ? NR : 4, C = 2;
    float *m = p, *l = p + G, *acc = p + 2 * G;
    const int64_t n = t1 - t0, padded = (n + W - 1) / W * W;
    thread_local std::vector<const K *> krow, vrow;
    thread_local std::vector<float> sbuf;
    if (static_cast<int64_t>(krow.size()) < n) krow.resize(n), vrow.resize(n);
    if (static_cast<int64_t>(sbuf.size()) < G * padded) sbuf.resize(G * padded);
    row_pointers(kc, vc, table, t0, t1, h, L, B, krow.data(), vrow.data());
    // Scaled 8-bit rows: each row's scale is read beside its codes, on its scores and weights.
    if constexpr (kQuant<K>) {      // every head's scores, each key row converted once (to L1)
        float qall[kMaxGroup * D], row[D];
        for (int64_t d = 0; d < G * D; d++) qall[d] = to_f32(q[d]) * scale;
        for (int64_t t = 0; t < n; t++) {
            if (t + kAhead < n)
                for (int64_t b = 0; b < D; b += 64) {
                    V::prefetch(reinterpret_cast<const char *>(krow[t + kAhead]) + b);
                    V::prefetch(reinterpret_cast<const char *>(vrow[t + kAhead]) + b);
                }
            if constexpr (NR % 2 == 0) {
                for (int j = 0; j < NR; j += 2) {
                    R a, b;
                    V::load2(krow[t] + j * W, a, b);
                    V::store(row + j * W, a);
                    V::store(row + (j + 1) * W, b);
                }
            } else {
                for (int j = 0; j < NR; j++) V::store(row + j * W, V::load(krow[t] + j * W));
            }
            const float ks = row_scale(krow[t], D);
            for (int64_t g = 0; g < G; g++) {
                R a0 = V::zero(), a1 = V::zero();
                for (int j = 0; j < NR; j += 2) {
                    a0 = V::fmadd(V::load(qall + g * D + j * W), V::load(row + j * W), a0);
                    if (j + 1 < NR) a1 = V::fmadd(V::load(qall + g * D + (j + 1) * W), V::load(row + (j + 1) * W), a1);
                }
                sbuf[g * padded + t] = V::reduce_add(V::add(a0, a1)) * ks;
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float qg[D], *s = sbuf.data() + g * padded;
        for (int d = 0; d < D; d++) qg[d] = to_f32(q[g * D + d]) * scale;
        for (int64_t t = 0; t < n && !kQuant<K>; t++) {
            if (g == 0 && t + kAhead < n)
                for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(K)); b += 64) {
                    V::prefetch(reinterpret_cast<const char *>(krow[t + kAhead]) + b);
                    V::prefetch(reinterpret_cast<const char *>(vrow[t + kAhead]) + b);
                }
            R a0 = V::zero(), a1 = V::zero();
            for (int j = 0; j < NR; j += 2) {
                a0 = V::fmadd(V::load(qg + j * W), V::load(krow[t] + j * W), a0);
                if (j + 1 < NR) a1 = V::fmadd(V::load(qg + (j + 1) * W), V::load(krow[t] + (j + 1) * W), a1);
            }
            s[t] = V::reduce_add(V::add(a0, a1));
        }
        for (int64_t t = n; t < padded; t++) s[t] = -INFINITY;
        R mxv = V::load(s);
        for (int64_t t = W; t < padded; t += W) mxv = V::max(mxv, V::load(s + t));
        const float mx = V::reduce_max(mxv);
        R sum = V::zero();
        for (int64_t t = 0; t < padded; t += W) {      // padding: e^-inf = 0
            const R w = V::exp(V::sub(V::load(s + t), V::set1(mx)));
            V::store(s + t, w);
            sum = V::add(sum, w);
        }
        m[g] = mx;
        l[g] = V::reduce_add(sum);
    }
    for (int64_t g0 = 0; g0 < G; g0 += C) {
        const int64_t heads = std::min<int64_t>(C, G - g0);
        for (int d0 = 0; d0 < D; d0 += NV * W) {
            R a[C][NV];
            for (auto &row : a)
                for (auto &x : row) x = V::zero();
            for (int64_t t = 0; t < n; t++) {
                R v[NV];
                if constexpr (D % (2 * W) == 0 && NV % 2 == 0) {     // whole pairs (8-bit: one widening)
                    for (int j = 0; j < NV; j += 2)
                        if (d0 + j * W < D) V::load2(vrow[t] + d0 + j * W, v[j], v[j + 1]);
                        else v[j] = v[j + 1] = V::zero();
                } else {
                    for (int j = 0; j < NV; j++) v[j] = d0 + j * W < D ? V::load(vrow[t] + d0 + j * W) : V::zero();
                }
                const float vs = row_scale(vrow[t], D);      // a scaled row's scale (else 1)
                for (int c = 0; c < C && c < heads; c++) {
                    const R w = V::set1(sbuf[(g0 + c) * padded + t] * vs);
                    for (int j = 0; j < NV; j++)
                        if (d0 + j * W < D) a[c][j] = V::fmadd(w, v[j], a[c][j]);
                }
            }
            for (int c = 0; c < heads; c++)
                for (int j = 0; j < NV; j++)
                    if (d0 + j * W < D) V::store(acc + (g0 + c) * D + d0 + j * W, a[c][j]);
        }
    }
}

// The partition kernel for this head dim: vectorised where the CPU and head dim allow.
template <typename T, typename K = T>
auto pick_partition_kernel(int64_t D) -> void (*)(const T *, float, const K *, const K *, const int64_t *, int64_t,
                                                  int64_t, int64_t, Layout, int64_t, int64_t, float *) {
#ifdef __AVX512F__
    switch (D) {
        case 32: return attend_partition_avx512<1, T, K>;
        case 64: return attend_partition_avx512<2, T, K>;
        case 128: return attend_partition_avx512<4, T, K>;
        case 256: return attend_partition_avx512<8, T, K>;
    }
#endif
#if defined(__AVX2__)
    switch (D) {
        case 32: return attend_partition_vec<Vec, 32, T, K>;
        case 64: return attend_partition_vec<Vec, 64, T, K>;
        case 80: return attend_partition_vec<Vec, 80, T, K>;
        case 96: return attend_partition_vec<Vec, 96, T, K>;
        case 128: return attend_partition_vec<Vec, 128, T, K>;
        case 256: return attend_partition_vec<Vec, 256, T, K>;
    }
#endif
    return nullptr;
}

template <typename T, typename K = T>
int paged_decode(const T *q, int64_t q_stride, const K *kc, const K *vc, const int64_t *tables, int64_t table_stride,
                 const int64_t *seq_lens, T *out, int64_t N, int64_t Hq, int64_t Hkv, int64_t D, int64_t B, Layout L,
                 float scale, int64_t partition_size) {
    const int64_t G = Hq / Hkv;
    if (G > kMaxGroup || D > kMaxDim || B > kMaxBlock || Hq % Hkv || partition_size > kMaxPartition) return 1;
    const auto fast = pick_partition_kernel<T, K>(D);
    int64_t max_len = 1;
    for (int64_t i = 0; i < N; i++) max_len = std::max(max_len, seq_lens[i]);
    // Contexts are split into partitions (parallel work for few queries, and each partition's
    // keys, values and scores stay in L1/L2); the partial results are merged after. Where every
    // context fits one partition, results go straight to `out`, with no merge buffer.
    // (Whole contexts as one partition measured 13% slower at 16 queries x 1500 tokens.)
    const int threads = omp_get_max_threads();
    const int64_t P = (max_len + partition_size - 1) / partition_size;
    const int64_t stride = G * (2 + D);
    std::vector<float> parts(P > 1 ? N * Hkv * P * stride : 0);

    // Heads innermost: with enough (sequence, partition) items to share, one thread takes all
    // KV heads of an item, so each cached row (all heads of a token) streams from memory once.
    const int64_t chunk = N * P >= 4 * threads ? Hkv : 1;
#pragma omp parallel for collapse(3) schedule(dynamic, chunk)
    for (int64_t i = 0; i < N; i++)
        for (int64_t j = 0; j < P; j++)
            for (int64_t h = 0; h < Hkv; h++) {
                thread_local std::vector<float> own;        // the item's state when P == 1
                float *p;
                if (P > 1) {
                    p = parts.data() + ((i * Hkv + h) * P + j) * stride;
                } else {
                    own.assign(stride, 0.f);
                    p = own.data();
                }
                for (int64_t g = 0; g < G; g++) p[g] = -INFINITY;      // m; l and acc start at 0
                const int64_t t0 = j * partition_size, t1 = std::min(t0 + partition_size, seq_lens[i]);
                if (t0 >= t1) continue;
                const T *qg = q + i * q_stride + h * G * D;      // the G query heads of KV head h
                if (fast) {
                    fast(qg, scale, kc, vc, tables + i * table_stride, t0, t1, h, L, B, G, p);
                } else {
                    float qf[kMaxGroup * kMaxDim];
                    for (int64_t d = 0; d < G * D; d++) qf[d] = to_f32(qg[d]) * scale;
                    attend_partition(qf, kc, vc, tables + i * table_stride, t0, t1, h, L, D, B, G, p);
                }
                if (P == 1)
                    for (int64_t g = 0; g < G; g++) {
                        T *dst = out + (i * Hq + h * G + g) * D;
                        for (int64_t d = 0; d < D; d++) store(dst + d, p[2 * G + g * D + d] / p[G + g]);
                    }
            }
    if (P == 1) return 0;

#pragma omp parallel for collapse(2)
    for (int64_t i = 0; i < N; i++)
        for (int64_t h = 0; h < Hkv; h++) {
            const float *ps = parts.data() + (i * Hkv + h) * P * stride;
            for (int64_t g = 0; g < G; g++) {
                float m = -INFINITY;
                for (int64_t j = 0; j < P; j++) m = std::max(m, ps[j * stride + g]);
                float l = 0.f, o[kMaxDim] = {0.f};
                for (int64_t j = 0; j < P; j++) {
                    const float *pj = ps + j * stride;
                    const float c = std::exp(pj[g] - m);     // 0 for an empty partition
                    l += c * pj[G + g];
                    const float *a = pj + 2 * G + g * D;
                    for (int64_t d = 0; d < D; d++) o[d] += c * a[d];
                }
                T *dst = out + (i * Hq + h * G + g) * D;
                for (int64_t d = 0; d < D; d++) store(dst + d, o[d] / l);
            }
        }
    return 0;
}

}  // namespace

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

// ---- linear layers: the driver shared by the bf16 and float32 GEMMs ---------------------------
// w is packed in strips of 32 output columns (two tiles of 16, K * 16 values each). Each
// thread takes a range of strips and runs every tile of up to 8 rows of x over them, so each
// weight byte streams from memory once per call whatever M is, and stays in cache across rows.
template <typename X, typename Wt, typename Y, typename Tile>
void gemm_strips(const X *x, const Wt *w, const float *bias, Y *y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                 Tile tile) {
    const int64_t strips = (N + 31) / 32;
#pragma omp parallel for schedule(static)
    for (int64_t s = 0; s < strips; s++) {
        const Wt *w0 = w + (2 * s) * K * 16, *w1 = w0 + K * 16;
        for (int64_t m = 0; m < M; m += 8)
            tile(std::min<int64_t>(8, M - m), x + m * K, K, w0, w1, bias, y + m * ldy, ldy, 32 * s, N);
    }
}

#ifdef __AVX512F__
namespace {
// The first `left` of 16 lanes (all 16 from 16 on): a row's last, partial vector.
inline __mmask16 first_lanes(int64_t left) { return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1); }

inline void store_masked(float *dst, __mmask16 mask, __m512 v) { _mm512_mask_storeu_ps(dst, mask, v); }
#ifdef __AVX512BF16__
inline void store_masked(uint16_t *dst, __mmask16 mask, __m512 v) {
    _mm256_mask_storeu_epi16(dst, mask, (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

// A tile's float32 sums (MR rows x 32 columns from n0) plus bias, stored to columns < N of y
// (rounded to bf16 where Y is bf16).
template <int MR, typename Y>
void store_tile(const __m512 (&acc)[MR][2], const float *bias, Y *y, int64_t ldy, int64_t n0, int64_t N) {
    for (int half = 0; half < 2; half++) {
        const int64_t n = n0 + 16 * half;
        if (n >= N) break;
        const __mmask16 mask = first_lanes(N - n);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
        for (int m = 0; m < MR; m++) store_masked(y + m * ldy + n, mask, _mm512_add_ps(acc[m][half], b));
    }
}
}  // namespace
#endif

// ---- bf16 linear layers: y[M, N] = x[M, K] w[N, K]^T (+ bias) ---------------------------------
// The weight is packed once at load into tiles of 16 output columns with K in pairs,
// [N/16][K/2][16][2], the operand layout of the AVX512-BF16 dot-product instruction (bf16
// pairs multiplied exactly, summed in float32). A tile of up to 8 rows x 32 columns keeps 16
// sums in registers; per pair of K, two weight loads serve all rows.
#ifdef __AVX512BF16__
namespace {

constexpr int64_t kPrefetchPairs = 32;   // weight K-pairs (64 bytes each) requested ahead of use
template <int MR, typename Y>     // Y: the output type, bf16 or (attention scores) float32
void gemm_tile(const uint16_t *x, int64_t K, const uint16_t *w0, const uint16_t *w1, const float *bias,
               Y *y, int64_t ldy, int64_t n0, int64_t N) {
    __m512 acc[MR][2];
    for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < K / 2; kp++) {
        _mm_prefetch(reinterpret_cast<const char *>(w0 + (kp + kPrefetchPairs) * 32), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char *>(w1 + (kp + kPrefetchPairs) * 32), _MM_HINT_T1);
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w0 + kp * 32);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(w1 + kp * 32);
        for (int m = 0; m < MR; m++) {
            int32_t pair;
            std::memcpy(&pair, x + m * K + 2 * kp, 4);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, b0);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, b1);
        }
    }
    store_tile<MR>(acc, bias, y, ldy, n0, N);
}

// The tile for each row count 1..8; Y: bf16 output (linear layers) or float32 (attention scores).
template <typename Y>
constexpr void (*kTiles[9])(const uint16_t *, int64_t, const uint16_t *, const uint16_t *, const float *, Y *,
                            int64_t, int64_t, int64_t) = {
    nullptr, gemm_tile<1, Y>, gemm_tile<2, Y>, gemm_tile<3, Y>, gemm_tile<4, Y>,
    gemm_tile<5, Y>, gemm_tile<6, Y>, gemm_tile<7, Y>, gemm_tile<8, Y>};
}  // namespace

// ---- AMX-BF16 GEMM for many rows (Sapphire Rapids and later) ----------------------------------
// The packed layout is already AMX's: a weight tile's 16 rows of K pairs (64 bytes each) are a B
// tile in VNNI form (16 columns x 2 bf16 per row), so B tiles load straight from the packed
// weight with a 64-byte stride, 32 k values at a time. A tiles are 16 rows x 32 bf16 of x (row
// stride 2K bytes); C tiles 16 x 16 float32. A step multiplies 2 A x 2 B tiles into 4 C tiles
// (32 rows x 32 columns: one strip). x is copied into a zero-padded buffer where M or K is not a
// multiple of 32 (an O(MK) copy), and a strip's last partial K step is copied into zero-padded
// B tiles, so every tile load is whole. Threads take ranges of strips, as gemm_strips does; each
// thread runs blocks of strips (about kAmxBlockBytes of weights, kept in L2) over all rows of x.
// Used only where the CPU has AMX-BF16 and the kernel lets the process use tile data
// (arch_prctl ARCH_REQ_XCOMP_PERM), from kAmxRows rows (kernels/cpu.py sets both: gemm_amx_config).
namespace {
struct AmxConfig {
    bool usable = false;     // CPU and OS allow it (checked once)
    bool enabled = false;    // cpu.py's switch (PAGEDSERVE_AMX)
    int64_t min_rows = 32;   // rows from which linear_packed_bf16 takes this path
};
AmxConfig g_amx;

bool amx_permitted() {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = d & (1u << 24), bf16 = d & (1u << 22);
    if (!tile || !bf16) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

constexpr int64_t kAmxBlockBytes = 512 * 1024;

__attribute__((target("amx-tile,amx-bf16"))) void amx_load_config() {
    TileConfig cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;   // all tiles 16 x 64 bytes
    _tile_loadconfig(&cfg);
}

// The gcc intrinsics are asm statements without a memory clobber: this orders C++ accesses
// around tile loads and stores of the same memory.
inline void memory_barrier() { __asm__ volatile("" ::: "memory"); }

// A C tile's float32 sums (buf, as tilestored left them) for rows [m0, m0 + rows) and 16
// columns from n, plus bias, to y (bf16).
inline void amx_store(const float *buf, const float *bias, uint16_t *y, int64_t ldy, int64_t m0, int64_t rows,
                      int64_t n, int64_t N) {
    if (n >= N) return;
    const __mmask16 mask = first_lanes(N - n);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++)
        store_masked(y + (m0 + r) * ldy + n, mask, _mm512_add_ps(_mm512_loadu_ps(buf + 16 * r), b));
}

// One K step of 32 at column k: B tiles b0, b1 (64 bytes a row) into C tiles 0, 1 from x0's A
// tile (and 2, 3 from x1's where A == 2; x1 is null where A == 1), A rows `stride` bytes apart.
template <int A>
__attribute__((target("amx-tile,amx-bf16"), always_inline)) inline void amx_k_step(const uint16_t *b0,
                                                                                   const uint16_t *b1,
                                                                                   const uint16_t *x0,
                                                                                   const uint16_t *x1, int64_t k,
                                                                                   int64_t stride) {
    _tile_loadd(6, b0, 64);
    _tile_loadd(7, b1, 64);
    _tile_loadd(4, x0 + k, stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (A == 2) {
        _tile_loadd(5, x1 + k, stride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}

// One strip (32 columns from n0; w0, w1 its two packed tiles) times A = 1 or 2 A tiles of 16
// rows: x0 (rows m0..m0+15) and x1 (the next 16), each with ldx elements between rows and at
// least kfull (+ 32 where bt) columns. bt: the strip's last partial K step as two zero-padded B
// tiles (null where K % 32 == 0).
template <int A>
__attribute__((target("amx-tile,amx-bf16"))) void amx_strip(const uint16_t *x0, const uint16_t *x1, int64_t ldx,
                                                              int64_t kfull, const uint16_t *w0, const uint16_t *w1,
                                                              const uint16_t *bt, const float *bias, uint16_t *y, int64_t ldy,
                                                              int64_t m0, int64_t M, int64_t n0, int64_t N,
                                                              float *buf) {
    memory_barrier();
    _tile_zero(0);
    _tile_zero(1);
    if (A == 2) {
        _tile_zero(2);
        _tile_zero(3);
    }
    const int64_t stride = ldx * 2;
    for (int64_t k = 0; k < kfull; k += 32) amx_k_step<A>(w0 + k * 16, w1 + k * 16, x0, x1, k, stride);
    // the partial K step: x's padding columns are zero, and so are bt's rows past K
    if (bt != nullptr) amx_k_step<A>(bt, bt + 512, x0, x1, kfull, stride);
    const int64_t rows0 = std::min<int64_t>(16, M - m0);
    _tile_stored(0, buf, 64);
    _tile_stored(1, buf + 256, 64);
    if (A == 2) {
        _tile_stored(2, buf + 512, 64);
        _tile_stored(3, buf + 768, 64);
    }
    memory_barrier();
    amx_store(buf, bias, y, ldy, m0, rows0, n0, N);
    amx_store(buf + 256, bias, y, ldy, m0, rows0, n0 + 16, N);
    if (A == 2) {
        const int64_t rows1 = std::min<int64_t>(16, M - m0 - 16);
        amx_store(buf + 512, bias, y, ldy, m0 + 16, rows1, n0, N);
        amx_store(buf + 768, bias, y, ldy, m0 + 16, rows1, n0 + 16, N);
    }
}

__attribute__((target("amx-tile,amx-bf16"))) void amx_gemm(const uint16_t *x, const uint16_t *w, const float *bias,
                                                             uint16_t *y, int64_t ldy, int64_t M, int64_t N,
                                                             int64_t K) {
    const int64_t kfull = K / 32 * 32, tail = K - kfull;           // tail: even (packed bf16 needs even K)
    // Every A tile whole: with a K tail, all of x copied with zero columns up to a multiple of
    // 32; else only a last partial block of 16 rows, zero rows after M.
    const int64_t full = M / 16 * 16, ldx = tail ? kfull + 32 : K;
    std::vector<uint16_t> padded;
    if (tail) {
        padded.assign((full + (M > full ? 16 : 0)) * ldx, 0);
        for (int64_t m = 0; m < M; m++) std::memcpy(&padded[m * ldx], x + m * K, K * 2);
    } else if (M > full) {
        padded.assign(16 * K, 0);
        std::memcpy(padded.data(), x + full * K, (M - full) * K * 2);
    }
    auto rows_at = [&](int64_t m) -> const uint16_t * {    // the A tile of rows m..m+15
        if (tail) return &padded[m * ldx];
        return m < full ? x + m * K : padded.data();
    };
    const int64_t strips = (N + 31) / 32;
    const int64_t block = std::max<int64_t>(1, kAmxBlockBytes / (64 * K));     // strips per block (64 K bytes each)
#pragma omp parallel
    {
        amx_load_config();
        alignas(64) float buf[1024];     // the 4 C tiles, stored
        std::vector<uint16_t> bt(tail ? 1024 * block : 0);
        const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t s_begin = strips * id / nt, s_end = strips * (id + 1) / nt;
        for (int64_t s0 = s_begin; s0 < s_end; s0 += block) {
            const int64_t s1 = std::min(s_end, s0 + block);
            if (tail) {     // the block's partial K steps as zero-padded B tiles: 2 per strip, 16 rows of 64 bytes
                std::fill(bt.begin(), bt.end(), 0);
                for (int64_t s = s0; s < s1; s++)
                    for (int h = 0; h < 2; h++)
                        std::memcpy(&bt[(s - s0) * 1024 + h * 512], w + (2 * s + h) * K * 16 + kfull * 16,
                                    tail * 16 * 2);
            }
            for (int64_t m0 = 0; m0 < M; m0 += 32) {
                const uint16_t *x0 = rows_at(m0), *x1 = M - m0 > 16 ? rows_at(m0 + 16) : nullptr;
                for (int64_t s = s0; s < s1; s++) {
                    const uint16_t *w0 = w + 2 * s * K * 16, *w1 = w0 + K * 16;
                    const uint16_t *b = tail ? &bt[(s - s0) * 1024] : nullptr;
                    if (x1 != nullptr)
                        amx_strip<2>(x0, x1, ldx, kfull, w0, w1, b, bias, y, ldy, m0, M, 32 * s, N, buf);
                    else
                        amx_strip<1>(x0, x1, ldx, kfull, w0, w1, b, bias, y, ldy, m0, M, 32 * s, N, buf);
                }
            }
        }
        _tile_release();
    }
}
}  // namespace

// enable: use AMX where usable (1) or not (0); min_rows: from how many rows of x. Returns 1 where
// AMX is in use after the call, 0 where not (the CPU or kernel lacks it, or disabled).
extern "C" int gemm_amx_config(int64_t enable, int64_t min_rows) {
    static const bool usable = amx_permitted();
    g_amx.usable = usable;
    g_amx.enabled = usable && enable != 0;
    g_amx.min_rows = std::max<int64_t>(1, min_rows);
    return g_amx.enabled ? 1 : 0;
}

// w: packed [Np/16][K/2][16][2] with Np a multiple of 32 (zero columns past N); K even;
// bias: float32 [N] or null; y: rows ldy elements apart (columns past N untouched).
extern "C" int linear_packed_ld_bf16(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y,
                                     int64_t ldy, int64_t M, int64_t N, int64_t K) {
    if (g_amx.enabled && M >= g_amx.min_rows) {
        amx_gemm(x, w, bias, y, ldy, M, N, K);
        return 0;
    }
    gemm_strips(x, w, bias, y, ldy, M, N, K, [](int64_t rows, auto... args) { kTiles<uint16_t>[rows](args...); });
    return 0;
}
#endif

// ---- float32 linear layers: the same tiles, one K step at a time ------------------------------
// w packed [Np/16][K][16] (Np a multiple of 32, zero columns past N); per K step two weight
// loads serve up to 8 rows, each row's x[k] broadcast once. (oneDNN's packed GEMM is as fast,
// but caches a primitive per row count: ~0.75 MB for every batch size a server ever sees.)
#ifdef __AVX512F__
namespace {
constexpr int64_t kPrefetchSteps = 32;   // weight K steps (64 bytes each) requested ahead of use

template <int MR>
void gemm_tile_f32(const float *x, int64_t K, const float *w0, const float *w1, const float *bias, float *y,
                   int64_t ldy, int64_t n0, int64_t N) {
    __m512 acc[MR][2];
    for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        _mm_prefetch(reinterpret_cast<const char *>(w0 + (k + kPrefetchSteps) * 16), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char *>(w1 + (k + kPrefetchSteps) * 16), _MM_HINT_T1);
        const __m512 b0 = _mm512_loadu_ps(w0 + k * 16), b1 = _mm512_loadu_ps(w1 + k * 16);
        for (int m = 0; m < MR; m++) {
            const __m512 a = _mm512_set1_ps(x[m * K + k]);
            acc[m][0] = _mm512_fmadd_ps(a, b0, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(a, b1, acc[m][1]);
        }
    }
    store_tile<MR>(acc, bias, y, ldy, n0, N);
}

using TileF32 = void (*)(const float *, int64_t, const float *, const float *, const float *, float *, int64_t,
                         int64_t, int64_t);
constexpr TileF32 kTilesF32[9] = {nullptr, gemm_tile_f32<1>, gemm_tile_f32<2>, gemm_tile_f32<3>, gemm_tile_f32<4>,
                                  gemm_tile_f32<5>, gemm_tile_f32<6>, gemm_tile_f32<7>, gemm_tile_f32<8>};
}  // namespace

extern "C" int linear_packed_ld_f32(const float *x, const float *w, const float *bias, float *y, int64_t ldy,
                                    int64_t M, int64_t N, int64_t K) {
    gemm_strips(x, w, bias, y, ldy, M, N, K, [](int64_t rows, auto... args) { kTilesF32[rows](args...); });
    return 0;
}
#endif

// ---- linear layers in float32 arithmetic, for builds without the tiles above -----------------
// bf16 weights (without AVX512-BF16) are converted in registers, two bit operations per 2 W
// values, and multiplied in float32 as llama.cpp does on AVX2; float32 weights as they are.
// Same packing as above. A tile is one 16-column weight tile (16 / W vectors of sums per row)
// for up to 4 rows (8 with AVX-512's 32 registers); x is float32, converted once per call.
namespace {
template <class V, int MR, typename Wt, typename Y>
void fma_tile(const float *x, int64_t K, const Wt *w, const float *bias, Y *y, int64_t ldy, int64_t n0, int64_t N) {
    constexpr int G = 16 / V::W;
    constexpr bool kBf16 = std::is_same_v<Wt, uint16_t>;
    constexpr int S = kBf16 && MR * G <= 4 ? 2 : 1;   // even and odd k summed apart: more chains for few rows
    typename V::reg acc[MR][G][S];
    for (auto &row : acc)
        for (auto &sums : row)
            for (auto &a : sums) a = V::zero();
    if constexpr (kBf16) {
        for (int64_t kp = 0; kp < K / 2; kp++) {       // 64 bytes of the tile per K pair
            V::prefetch(w + (kp + 32) * 32);
            for (int g = 0; g < G; g++) {
                typename V::reg even, odd;
                V::load_pairs(w + kp * 32 + g * 2 * V::W, even, odd);
                for (int m = 0; m < MR; m++) {
                    acc[m][g][0] = V::fmadd(V::set1(x[m * K + 2 * kp]), even, acc[m][g][0]);
                    acc[m][g][S - 1] = V::fmadd(V::set1(x[m * K + 2 * kp + 1]), odd, acc[m][g][S - 1]);
                }
            }
        }
    } else {
        for (int64_t k = 0; k < K; k++) {               // 64 bytes of the tile per K step
            V::prefetch(w + (k + 32) * 16);
            for (int g = 0; g < G; g++) {
                const typename V::reg b = V::load(w + k * 16 + g * V::W);
                for (int m = 0; m < MR; m++) acc[m][g][0] = V::fmadd(V::set1(x[m * K + k]), b, acc[m][g][0]);
            }
        }
    }
    for (int m = 0; m < MR; m++)
        for (int g = 0; g < G; g++) {
            const int64_t n = n0 + g * V::W;
            if (n >= N) break;
            typename V::reg sum = acc[m][g][0];
            if constexpr (S == 2) sum = V::add(sum, acc[m][g][1]);
            if (N - n >= V::W) {
                V::store(y + m * ldy + n, bias ? V::add(sum, V::load(bias + n)) : sum);
            } else {
                float part[V::W];
                V::store(part, sum);
                for (int64_t i = 0; i < N - n; i++) store(y + m * ldy + n + i, part[i] + (bias ? bias[n + i] : 0.f));
            }
        }
}

// Rows 1..MR through the tile of that many rows.
template <class V, int MR, typename Wt, typename Y>
void fma_tile_rows(int64_t rows, const float *x, int64_t K, const Wt *w, const float *bias, Y *y, int64_t ldy,
                   int64_t n0, int64_t N) {
    if (rows == MR) return fma_tile<V, MR>(x, K, w, bias, y, ldy, n0, N);
    if constexpr (MR > 1) fma_tile_rows<V, MR - 1>(rows, x, K, w, bias, y, ldy, n0, N);
}

template <class V, typename T>
void linear_fma(const T *x, const T *w, const float *bias, T *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    constexpr int kRows = V::W == 16 ? 8 : 4;
    std::vector<float> converted;
    const float *xf;
    if constexpr (std::is_same_v<T, float>) {
        xf = x;
    } else {
        converted.resize(M * K);
        for (int64_t i = 0; i < M * K; i++) converted[i] = to_f32(x[i]);
        xf = converted.data();
    }
    gemm_strips(xf, w, bias, y, ldy, M, N, K, [](int64_t rows, const float *xm, int64_t K, const T *w0, const T *w1,
                                            const float *b, T *ym, int64_t ldy, int64_t n0, int64_t N) {
        for (int64_t m = 0; m < rows; m += kRows) {
            const int64_t r = std::min<int64_t>(kRows, rows - m);
            fma_tile_rows<V, kRows>(r, xm + m * K, K, w0, b, ym + m * ldy, ldy, n0, N);
            if (n0 + 16 < N) fma_tile_rows<V, kRows>(r, xm + m * K, K, w1, b, ym + m * ldy, ldy, n0 + 16, N);
        }
    });
}
}  // namespace

#ifndef __AVX512BF16__
extern "C" int linear_packed_ld_bf16(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y,
                                     int64_t ldy, int64_t M, int64_t N, int64_t K) {
    linear_fma<Vec>(x, w, bias, y, ldy, M, N, K);
    return 0;
}
#endif
#ifndef __AVX512F__
extern "C" int linear_packed_ld_f32(const float *x, const float *w, const float *bias, float *y, int64_t ldy,
                                    int64_t M, int64_t N, int64_t K) {
    linear_fma<Vec>(x, w, bias, y, ldy, M, N, K);
    return 0;
}
#endif
// y [M, N] (rows N apart) = x [M, K] @ W.T (+ bias), W packed (kernels/cpu.py pack_weight).
extern "C" int linear_packed_bf16(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y, int64_t M,
                                  int64_t N, int64_t K) {
    return linear_packed_ld_bf16(x, w, bias, y, N, M, N, K);
}
extern "C" int linear_packed_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N,
                                 int64_t K) {
    return linear_packed_ld_f32(x, w, bias, y, N, M, N, K);
}
#ifndef __AVX512BF16__
extern "C" int gemm_amx_config(int64_t, int64_t) { return 0; }    // AMX only in the avx512bf16 build
#endif

// ---- element-wise layers, fused ----------------------------------------------------------------
// Each is one pass over memory where torch takes three to five (and as many dispatches). The
// rounding steps follow the reference: values are rounded to the storage type wherever the
// reference's separate ops round them.
namespace {

// Rounds a float32 to the storage type and back (identity for float32).
inline float round_as(float x, const float *) { return x; }
inline float round_as(float x, const uint16_t *) {
    uint16_t b;
    store(&b, x);
    return to_f32(b);
}

// x[r] += y[r] (in the storage type), then out[r] = weight * round(x[r] / rms(x[r])).
template <typename T>
void add_rms_norm(T *x, const T *y, const T *weight, T *out, int64_t M, int64_t H, float eps) {
#pragma omp parallel for schedule(static) if (M * H >= 65536)
    for (int64_t r = 0; r < M; r++) {
        T *xr = x + r * H;
        const T *yr = y ? y + r * H : nullptr;
        float sq = 0.f;
        int64_t i = 0;
        Vec::reg acc = Vec::zero();
        for (; i + Vec::W <= H; i += Vec::W) {
            Vec::reg v = Vec::load(xr + i);
            if (yr) {
                v = round_as_v<Vec>(Vec::add(v, Vec::load(yr + i)), xr);
                Vec::store(xr + i, v);
            }
            acc = Vec::fmadd(v, v, acc);
        }
        sq = Vec::reduce_add(acc);
        for (; i < H; i++) {
            if (yr) store(xr + i, to_f32(xr[i]) + to_f32(yr[i]));
            sq += to_f32(xr[i]) * to_f32(xr[i]);
        }
        const float inv = 1.f / std::sqrt(sq / H + eps);
        i = 0;
        for (; i + Vec::W <= H; i += Vec::W) {
            const Vec::reg normed = round_as_v<Vec>(Vec::mul(Vec::load(xr + i), Vec::set1(inv)), xr);
            Vec::store(out + r * H + i, Vec::mul(Vec::load(weight + i), normed));
        }
        for (; i < H; i++) store(out + r * H + i, to_f32(weight[i]) * round_as(to_f32(xr[i]) * inv, xr));
    }
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// out[r, :I] = round(silu(gate)) * up, where gate_up[r] = [gate (I), up (I)].
template <typename T>
void silu_and_mul(const T *gate_up, T *out, int64_t M, int64_t I) {
#pragma omp parallel for schedule(static) if (M * I >= 65536)
    for (int64_t r = 0; r < M; r++) {
        const T *g = gate_up + r * 2 * I, *u = g + I;
        T *o = out + r * I;
        int64_t i = 0;
        for (; i + Vec::W <= I; i += Vec::W) {
            const Vec::reg gv = Vec::load(g + i);
            const Vec::reg e = Vec::exp_any(Vec::sub(Vec::zero(), gv));
            const Vec::reg sv = round_as_v<Vec>(Vec::div(gv, Vec::add(Vec::set1(1.f), e)), o);
            Vec::store(o + i, Vec::mul(sv, Vec::load(u + i)));
        }
        for (; i < I; i++) {
            T rounded;
            store(&rounded, silu(to_f32(g[i])));
            store(o + i, to_f32(rounded) * to_f32(u[i]));
        }
    }
}
// RoPE in place on the first `heads` heads of each row of x (row stride `ld`), rotate-half
// layout: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, with cos/sin [T, D] per token. Each
// product and the sum are rounded as the reference's separate ops round them.
template <typename T>
void rope_inplace(T *x, int64_t ld, int64_t rows, int64_t heads, int64_t D, const T *cos, const T *sin) {
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) if (rows * heads * D >= 65536)
    for (int64_t t = 0; t < rows; t++) {
        const T *c = cos + t * D, *s = sin + t * D;
        for (int64_t h = 0; h < heads; h++) {
            T *x1 = x + t * ld + h * D, *x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = to_f32(x1[i]), b = to_f32(x2[i]);
                const float lo = round_as(a * to_f32(c[i]), x) + round_as(-b * to_f32(s[i]), x);
                const float hi = round_as(b * to_f32(c[half + i]), x) + round_as(a * to_f32(s[half + i]), x);
                store(x1 + i, lo);
                store(x2 + i, hi);
            }
        }
    }
}
}  // namespace

extern "C" {
int add_rms_norm_f32(float *x, const float *y, const float *w, float *out, int64_t M, int64_t H, float eps) {
    add_rms_norm(x, y, w, out, M, H, eps);
    return 0;
}
int add_rms_norm_bf16(uint16_t *x, const uint16_t *y, const uint16_t *w, uint16_t *out, int64_t M, int64_t H,
                      float eps) {
    add_rms_norm(x, y, w, out, M, H, eps);
    return 0;
}
int rope_inplace_f32(float *x, int64_t ld, int64_t rows, int64_t heads, int64_t D, const float *cos,
                     const float *sin) {
    rope_inplace(x, ld, rows, heads, D, cos, sin);
    return 0;
}
int rope_inplace_bf16(uint16_t *x, int64_t ld, int64_t rows, int64_t heads, int64_t D, const uint16_t *cos,
                      const uint16_t *sin) {
    rope_inplace(x, ld, rows, heads, D, cos, sin);
    return 0;
}
int silu_and_mul_f32(const float *gate_up, float *out, int64_t M, int64_t I) {
    silu_and_mul(gate_up, out, M, I);
    return 0;
}
int silu_and_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t M, int64_t I) {
    silu_and_mul(gate_up, out, M, I);
    return 0;
}
}


// ---- greedy sampling: the first maximum of each row ------------------------------------------
// As torch's max(dim=-1).indices (a NaN counts as the maximum), which on CPU compares one
// element at a time: 1.3-2.2 ms for 64 rows of a 49k vocabulary, 2-3% of a batch-64 decode step.
// Two vector passes over a row (in L2 for the second): its maximum, then where it first is.
extern "C" int argmax_rows_f32(const float *x, int64_t rows, int64_t cols, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows * cols >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * cols;
        float best = -INFINITY;
        bool nan = false;
        int64_t i = 0;
#ifdef __AVX512F__
        __m512 mx = _mm512_set1_ps(-INFINITY);
        __mmask16 unordered = 0;
        for (; i + 16 <= cols; i += 16) {
            const __m512 v = _mm512_loadu_ps(xr + i);
            unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            mx = _mm512_max_ps(mx, v);
        }
        best = _mm512_reduce_max_ps(mx);
        nan = unordered != 0;
#elif defined(__AVX2__)
        __m256 mx = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
        for (; i + 8 <= cols; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            mx = _mm256_max_ps(mx, v);
        }
        best = V8::reduce_max(mx);
        nan = _mm256_movemask_ps(unordered) != 0;
#endif
        for (; i < cols; i++) {
            nan |= std::isnan(xr[i]);
            best = std::max(best, xr[i]);
        }
        i = 0;
#ifdef __AVX512F__
        const __m512 target = _mm512_set1_ps(best);
        for (; i + 16 <= cols; i += 16) {   // stop at the first group of 16 that holds it
            const __m512 v = _mm512_loadu_ps(xr + i);
            if (nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ)) break;
        }
#elif defined(__AVX2__)
        const __m256 target = _mm256_set1_ps(best);
        for (; i + 8 <= cols; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            if (_mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, target, _CMP_EQ_OQ))) break;
        }
#endif
        while (i < cols && !(nan ? std::isnan(xr[i]) : xr[i] == best)) i++;
        out[r] = i < cols ? i : 0;
    }
    return 0;
}

// ---- prefill attention: tiles of queries against tiles of keys -------------------------------
// The decode kernel serves prefill tokens one query at a time, each re-reading its whole
// prefix: at a 2000-token prompt that is half of the prefill's time. Here the queries of one
// sequence's chunk (up to 16 tokens x the G heads of a KV head) meet 32 keys at a time as two
// small GEMMs on the GEMM tiles above: scores = Q K^T (K packed like a weight), then
// O += P V (V packed likewise), with an online softmax between (as flash attention).
// bf16 with AVX512-BF16: bf16 dot products, P rounded to bf16 for the second product as flash
// attention does. Otherwise (AVX2, AVX-512, either storage type): float32 FMAs over `Vec`,
// keys and values converted to float32 as they are packed.
#ifdef __AVX2__
namespace {
constexpr int64_t kQueryTokens = 16, kKeyTile = 32;

// Where the key and value rows of keys t0..t0+nk (nk <= 32) of KV head h are; the slots past
// nk repeat a real row (the caller masks their scores).
template <typename T>
void key_tile_rows(const T *kc, const T *vc, const int64_t *table, int64_t t0, int64_t nk, int64_t h, Layout L,
                   int64_t B, const T **krow, const T **vrow) {
    row_pointers(kc, vc, table, t0, t0 + nk, h, L, B, krow, vrow);
    for (int64_t c = nk; c < kKeyTile; c++) krow[c] = krow[nk - 1], vrow[c] = vrow[nk - 1];
}

#ifdef __AVX512BF16__
// The queries of (sequence i, KV head h, tokens j0..j0+nq): rows r = j * G + g, causal:
// token j sees the first base + j + 1 keys.
void prefill_item(const uint16_t *q, int64_t q_stride, const uint16_t *kc, const uint16_t *vc, const int64_t *table,
                  int64_t base, int64_t j0, int64_t nq, int64_t h, int64_t G, int64_t D, int64_t B, Layout L,
                  float scale, uint16_t *out, int64_t out_stride) {
    const int64_t R = nq * G, Rp = (R + 7) / 8 * 8;
    thread_local std::vector<uint16_t> qbuf, kpack, vpack, pbuf;
    thread_local std::vector<float> sbuf, obuf, tmp, mrow, lrow;
    qbuf.assign(Rp * D, 0);
    kpack.resize(kKeyTile * D);
    vpack.resize(kKeyTile * D);
    pbuf.assign(Rp * kKeyTile, 0);
    sbuf.resize(Rp * kKeyTile);
    tmp.resize(Rp * D);
    obuf.assign(R * D, 0.f);
    mrow.assign(R, -INFINITY);
    lrow.assign(R, 0.f);
    for (int64_t j = 0; j < nq; j++)
        std::memcpy(&qbuf[j * G * D], q + (j0 + j) * q_stride + h * G * D, G * D * sizeof(uint16_t));
    const int64_t kend = base + j0 + nq;     // keys the last query token sees
    const uint16_t *krow[kKeyTile], *vrow[kKeyTile];
    for (int64_t t0 = 0; t0 < kend; t0 += kKeyTile) {
        const int64_t nk = std::min(kKeyTile, kend - t0);
        key_tile_rows(kc, vc, table, t0, nk, h, L, B, krow, vrow);
        // K as a weight [32 keys][D]: tiles of 16 keys, [D/2][16][2]: a 16 x 16 transpose of
        // (bf16 pair) dwords per 16 keys and 16 pairs.
        for (int64_t c0 = 0; c0 < kKeyTile; c0 += 16)
            for (int64_t p0 = 0; p0 < D / 2; p0 += 16) {
                __m512i r[16];
                for (int c = 0; c < 16; c++) r[c] = _mm512_loadu_si512(krow[c0 + c] + 2 * p0);
                transpose16_epi32(r);
                uint16_t *dst = kpack.data() + (c0 / 16) * (D / 2) * 32 + p0 * 32;
                for (int p = 0; p < 16; p++) _mm512_storeu_si512(dst + p * 32, r[p]);
            }
        for (int64_t r = 0; r < Rp; r += 8) {
            const int64_t rows = std::min<int64_t>(8, Rp - r);
            kTiles<float>[rows](&qbuf[r * D], D, kpack.data(), kpack.data() + (D / 2) * 32, nullptr,
                                   &sbuf[r * kKeyTile], kKeyTile, 0, kKeyTile);
        }
        // Online softmax per row; masked keys (past the row's causal end) get weight 0.
        for (int64_t r = 0; r < R; r++) {
            const int64_t valid = std::min(nk, base + j0 + r / G + 1 - t0);
            uint16_t *pr = &pbuf[r * kKeyTile];
            if (valid <= 0) {
                std::memset(pr, 0, kKeyTile * sizeof(uint16_t));
                continue;
            }
            const __mmask32 live = valid >= 32 ? 0xFFFFFFFFu : ((1u << valid) - 1);
            const __m512 s0 = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), static_cast<__mmask16>(live),
                                                 _mm512_mul_ps(_mm512_loadu_ps(&sbuf[r * kKeyTile]), _mm512_set1_ps(scale)));
            const __m512 s1 = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), static_cast<__mmask16>(live >> 16),
                                                 _mm512_mul_ps(_mm512_loadu_ps(&sbuf[r * kKeyTile + 16]), _mm512_set1_ps(scale)));
            const float mx = std::max(mrow[r], _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
            const float alpha = std::exp(mrow[r] - mx);                 // 0 on the first tile
            const __m512 mv = _mm512_set1_ps(mx);
            const __m256bh p0 = _mm512_cvtneps_pbh(exp16(_mm512_sub_ps(s0, mv)));
            const __m256bh p1 = _mm512_cvtneps_pbh(exp16(_mm512_sub_ps(s1, mv)));
            _mm256_storeu_si256(reinterpret_cast<__m256i *>(pr), (__m256i)p0);
            _mm256_storeu_si256(reinterpret_cast<__m256i *>(pr + 16), (__m256i)p1);
            lrow[r] = lrow[r] * alpha + _mm512_reduce_add_ps(_mm512_add_ps(_mm512_cvtpbh_ps(p0), _mm512_cvtpbh_ps(p1)));
            mrow[r] = mx;
            if (alpha != 1.f)
                for (int64_t d = 0; d < D; d += 16)
                    _mm512_storeu_ps(&obuf[r * D + d], _mm512_mul_ps(_mm512_loadu_ps(&obuf[r * D + d]), _mm512_set1_ps(alpha)));
        }
        // V as a weight [D][32 keys]: tiles of 16 dims, [16 key pairs][16][2]: two rows' 16
        // values interleaved per store.
        for (int64_t c = 0; c < kKeyTile; c += 2)
            for (int64_t d = 0; d < D; d += 16) {
                const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(vrow[c] + d)));
                const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(vrow[c + 1] + d)));
                _mm512_storeu_si512(vpack.data() + (d / 16) * kKeyTile * 16 + c * 16,
                                    _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
            }
        for (int64_t r = 0; r < Rp; r += 8) {
            const int64_t rows = std::min<int64_t>(8, Rp - r);
            for (int64_t n0 = 0; n0 < D; n0 += 32)
                kTiles<float>[rows](&pbuf[r * kKeyTile], kKeyTile, vpack.data() + (n0 / 16) * kKeyTile * 16,
                                       vpack.data() + (n0 / 16 + 1) * kKeyTile * 16, nullptr, &tmp[r * D], D, n0, D);
        }
        for (int64_t i = 0; i < R * D; i += 16)
            _mm512_storeu_ps(&obuf[i], _mm512_add_ps(_mm512_loadu_ps(&obuf[i]), _mm512_loadu_ps(&tmp[i])));
    }
    for (int64_t r = 0; r < R; r++) {
        uint16_t *dst = out + (j0 + r / G) * out_stride + (h * G + r % G) * D;
        const __m512 inv = _mm512_set1_ps(1.f / lrow[r]);
        for (int64_t d = 0; d < D; d += 16) store16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(&obuf[r * D + d]), inv));
    }
}

#endif  // __AVX512BF16__

// The same item in float32 arithmetic over vectors V (q scaled and converted once; K^T packed
// through W x W register transposes, V by plain copies, both converted to float32), the GEMMs
// on fma_tile: MR rows x 16 columns. On AVX2 5 rows: the compiler keeps each row's broadcast
// x value for both weight vectors, so 10 sums + 5 broadcasts + a weight vector fill the 16
// registers (6 rows spill sums to the stack); AVX-512 has room for 8. Needs D % 16 == 0.
template <class V, typename T, typename K = T>
void prefill_item_vec(const T *q, int64_t q_stride, const K *kc, const K *vc, const int64_t *table, int64_t base,
                      int64_t j0, int64_t nq, int64_t h, int64_t G, int64_t D, int64_t B, Layout L, float scale,
                      T *out, int64_t out_stride) {
    using Reg = typename V::reg;
    constexpr int W = V::W, MR = W == 8 ? 5 : 8;
    const int64_t R = nq * G;
    thread_local std::vector<float> qbuf, kpack, vpack, sbuf, obuf, tmp, mrow, lrow;
    qbuf.resize(R * D);
    kpack.resize(kKeyTile * D);     // [32 / 16][D][16]: K^T as two weight tiles of 16 keys
    vpack.resize(kKeyTile * D);     // [D / 16][32][16]: V as D / 16 weight tiles of 16 dims
    sbuf.resize(R * kKeyTile);      // scores, then softmax weights, row by row
    tmp.resize(R * D);
    obuf.assign(R * D, 0.f);
    mrow.assign(R, -INFINITY);
    lrow.assign(R, 0.f);
    for (int64_t j = 0; j < nq; j++)
        for (int64_t d = 0; d < G * D; d++)
            qbuf[j * G * D + d] = to_f32(q[(j0 + j) * q_stride + h * G * D + d]) * scale;
    const int64_t kend = base + j0 + nq;     // keys the last query token sees
    const K *krow[kKeyTile], *vrow[kKeyTile];
    float ksc[kKeyTile], vsc[kKeyTile];      // scaled 8-bit rows: on the scores and on V as it is packed
    for (int64_t t0 = 0; t0 < kend; t0 += kKeyTile) {
        const int64_t nk = std::min(kKeyTile, kend - t0);
        key_tile_rows(kc, vc, table, t0, nk, h, L, B, krow, vrow);
        if constexpr (kScaled<K>)
            for (int64_t c = 0; c < kKeyTile; c++) ksc[c] = row_scale(krow[c], D), vsc[c] = row_scale(vrow[c], D);
        for (int64_t c0 = 0; c0 < kKeyTile; c0 += W)
            for (int64_t d0 = 0; d0 < D; d0 += W) {
                Reg r[W];
                for (int i = 0; i < W; i++) r[i] = V::load(krow[c0 + i] + d0);
                V::transpose(r);
                float *dst = kpack.data() + (c0 / 16) * D * 16 + d0 * 16 + c0 % 16;
                for (int i = 0; i < W; i++) V::store(dst + i * 16, r[i]);
            }
        for (int64_t r = 0; r < R; r += MR)
            for (int64_t c0 = 0; c0 < kKeyTile; c0 += 16)
                fma_tile_rows<V, MR>(std::min<int64_t>(MR, R - r), &qbuf[r * D], D, kpack.data() + (c0 / 16) * D * 16,
                                     nullptr, &sbuf[r * kKeyTile], kKeyTile, c0, kKeyTile);
        // Online softmax per row; masked keys (past the row's causal end) get weight 0.
        for (int64_t r = 0; r < R; r++) {
            const int64_t valid = std::min(nk, base + j0 + r / G + 1 - t0);
            float *s = &sbuf[r * kKeyTile];
            if (valid <= 0) {
                std::memset(s, 0, kKeyTile * sizeof(float));
                continue;
            }
            if constexpr (kScaled<K>)
                for (int64_t c = 0; c < valid; c++) s[c] *= ksc[c];
            for (int64_t c = valid; c < kKeyTile; c++) s[c] = -INFINITY;
            Reg mx = V::load(s);
            for (int64_t c = W; c < kKeyTile; c += W) mx = V::max(mx, V::load(s + c));
            const float m = std::max(mrow[r], V::reduce_max(mx));
            const float alpha = std::exp(mrow[r] - m);                  // 0 on the first tile
            Reg sum = V::zero();
            for (int64_t c = 0; c < kKeyTile; c += W) {
                const Reg w = V::exp(V::sub(V::load(s + c), V::set1(m)));
                V::store(s + c, w);
                sum = V::add(sum, w);
            }
            lrow[r] = lrow[r] * alpha + V::reduce_add(sum);
            mrow[r] = m;
            if (alpha != 1.f)
                for (int64_t d = 0; d < D; d += W) V::store(&obuf[r * D + d], V::mul(V::load(&obuf[r * D + d]), V::set1(alpha)));
        }
        for (int64_t c = 0; c < kKeyTile; c++) {
            const Reg vs = V::set1(kScaled<K> ? vsc[c] : 1.f);
            for (int64_t d = 0; d < D; d += W) {
                Reg x = V::load(vrow[c] + d);
                if constexpr (kScaled<K>) x = V::mul(x, vs);
                V::store(vpack.data() + (d / 16) * kKeyTile * 16 + c * 16 + d % 16, x);
            }
        }
        for (int64_t r = 0; r < R; r += MR)
            for (int64_t d0 = 0; d0 < D; d0 += 16)
                fma_tile_rows<V, MR>(std::min<int64_t>(MR, R - r), &sbuf[r * kKeyTile], kKeyTile,
                                     vpack.data() + (d0 / 16) * kKeyTile * 16, nullptr, &tmp[r * D], D, d0, D);
        for (int64_t i = 0; i < R * D; i += W) V::store(&obuf[i], V::add(V::load(&obuf[i]), V::load(&tmp[i])));
    }
    for (int64_t r = 0; r < R; r++) {
        T *dst = out + (j0 + r / G) * out_stride + (h * G + r % G) * D;
        const Reg inv = V::set1(1.f / lrow[r]);
        for (int64_t d = 0; d < D; d += W) V::store(dst + d, V::mul(V::load(&obuf[r * D + d]), inv));
    }
}

// q, out: the rows of the prefill tokens [T, Hq, D] (q with row stride q_stride, out
// contiguous); sequence i's chunk is rows query_start[i]..query_start[i+1] (counted from
// query_start[0]) and ends at context length seq_lens[i]. Returns 1 for shapes it does not
// take (the caller then runs the decode kernel per token).
template <typename T, typename K = T>
int paged_prefill(const T *q, int64_t q_stride, const K *kc, const K *vc, const int64_t *tables, int64_t table_stride,
                  const int64_t *seq_lens, const int64_t *query_start, int64_t S, T *out, int64_t Hq, int64_t Hkv,
                  int64_t D, int64_t B, Layout L, float scale) {
#ifdef __AVX512BF16__
    constexpr bool kBf16Dots = std::is_same_v<T, uint16_t> && std::is_same_v<K, uint16_t>;
#else
    constexpr bool kBf16Dots = false;
#endif
    if (D % (kBf16Dots ? 32 : 16) || D > kMaxDim || Hq % Hkv || Hq / Hkv > kMaxGroup) return 1;
    const int64_t G = Hq / Hkv, q0 = query_start[0];
    struct Item { int64_t seq, j0, h; };
    std::vector<Item> items;
    for (int64_t i = 0; i < S; i++)
        for (int64_t j0 = 0; j0 < query_start[i + 1] - query_start[i]; j0 += kQueryTokens)
            for (int64_t h = 0; h < Hkv; h++) items.push_back({i, j0, h});
#pragma omp parallel for schedule(dynamic, 1)
    for (size_t k = 0; k < items.size(); k++) {
        const Item &it = items[k];
        const int64_t n = query_start[it.seq + 1] - query_start[it.seq];
        const int64_t row = query_start[it.seq] - q0;
        const auto item = [&](auto fn) {
            fn(q + row * q_stride, q_stride, kc, vc, tables + it.seq * table_stride, seq_lens[it.seq] - n, it.j0,
               std::min(kQueryTokens, n - it.j0), it.h, G, D, B, L, scale, out + row * Hq * D, Hq * D);
        };
#ifdef __AVX512BF16__
        if constexpr (kBf16Dots) {
            item(prefill_item);
            continue;
        }
#endif
        item(prefill_item_vec<Vec, T, K>);
    }
    return 0;
}
}  // namespace
#endif

// ---- one step's attention: decode rows, then prefill chunks -----------------------------------
namespace {
struct AttentionRows {   // laid out by kernels/cpu.py (AttentionRows) from the step's metadata
    const int64_t *tables;
    int64_t table_stride;
    const int64_t *seq_lens, *query_start;   // per sequence; decodes (one query each) first
    int64_t num_seqs, num_decodes;
    const int64_t *token_tables;             // per query token (null without prefills): each token
    int64_t token_table_stride;              // as a sequence of its own over its causal prefix
    const int64_t *token_lens;
};

// Decode rows through the decode kernel; prefill chunks through the tiled prefill kernel where
// the build has one (AVX2 and up) and the shape fits, else each prefill token through the
// decode kernel.
template <typename T, typename K = T>
int attend(const T *q, int64_t q_stride, const K *kc, const K *vc, const AttentionRows &a, int64_t num_tokens, T *out,
           int64_t Hq, int64_t Hkv, int64_t D, int64_t B, Layout L, float scale, int64_t partition_size) {
    if (a.num_decodes == a.num_seqs)
        return paged_decode(q, q_stride, kc, vc, a.tables, a.table_stride, a.seq_lens, out, num_tokens, Hq, Hkv, D, B,
                            L, scale, partition_size);
#ifdef __AVX2__
    const int64_t nd = a.num_decodes;
    if (nd && paged_decode(q, q_stride, kc, vc, a.tables, a.table_stride, a.seq_lens, out, nd, Hq, Hkv, D, B, L,
                           scale, partition_size))
        return 1;
    if (paged_prefill(q + nd * q_stride, q_stride, kc, vc, a.tables + nd * a.table_stride, a.table_stride,
                      a.seq_lens + nd, a.query_start + nd, a.num_seqs - nd, out + nd * Hq * D, Hq, Hkv, D, B, L,
                      scale) == 0)
        return 0;
#endif
    if (a.token_tables == nullptr) return 1;
    return paged_decode(q, q_stride, kc, vc, a.token_tables, a.token_table_stride, a.token_lens, out, num_tokens, Hq,
                        Hkv, D, B, L, scale, partition_size);
}
}  // namespace

extern "C" {
int paged_attention_f32(const float *q, int64_t q_stride, const float *kc, const float *vc, const AttentionRows *a,
                        int64_t num_tokens, float *out, int64_t Hq, int64_t Hkv, int64_t D, int64_t B,
                        int64_t block_stride, int64_t token_stride, int64_t head_stride, float scale,
                        int64_t partition_size) {
    return attend(q, q_stride, kc, vc, *a, num_tokens, out, Hq, Hkv, D, B,
                  Layout{block_stride, token_stride, head_stride}, scale, partition_size);
}
int paged_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *kc, const uint16_t *vc,
                         const AttentionRows *a, int64_t num_tokens, uint16_t *out, int64_t Hq, int64_t Hkv, int64_t D,
                         int64_t B, int64_t block_stride, int64_t token_stride, int64_t head_stride, float scale,
                         int64_t partition_size) {
    return attend(q, q_stride, kc, vc, *a, num_tokens, out, Hq, Hkv, D, B,
                  Layout{block_stride, token_stride, head_stride}, scale, partition_size);
}
}

// Over an 8-bit cache (`code`: KVCode; strides in bytes).
namespace {
template <typename F>
int with_kv_format(int64_t code, F f) {
    switch (code) {
        case kE5M2: return f(static_cast<const E5M2 *>(nullptr));
        case kE4M3: return f(static_cast<const E4M3 *>(nullptr));
        case kInt8: return f(static_cast<const I8 *>(nullptr));
    }
    return 1;
}
template <typename T>
int attend_kv8(const T *q, int64_t q_stride, const uint8_t *kc, const uint8_t *vc, const AttentionRows *a,
               int64_t num_tokens, T *out, int64_t Hq, int64_t Hkv, int64_t D, int64_t B, int64_t block_stride,
               int64_t token_stride, int64_t head_stride, float scale, int64_t partition_size, int64_t code) {
    return with_kv_format(code, [&](auto tag) {
        using K = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
        return attend(q, q_stride, reinterpret_cast<const K *>(kc), reinterpret_cast<const K *>(vc), *a, num_tokens,
                      out, Hq, Hkv, D, B, Layout{block_stride, token_stride, head_stride}, scale, partition_size);
    });
}
}  // namespace

extern "C" {
int paged_attention_kv8_f32(const float *q, int64_t q_stride, const uint8_t *kc, const uint8_t *vc,
                            const AttentionRows *a, int64_t num_tokens, float *out, int64_t Hq, int64_t Hkv, int64_t D,
                            int64_t B, int64_t block_stride, int64_t token_stride, int64_t head_stride, float scale,
                            int64_t partition_size, int64_t code) {
    return attend_kv8(q, q_stride, kc, vc, a, num_tokens, out, Hq, Hkv, D, B, block_stride, token_stride,
                      head_stride, scale, partition_size, code);
}
int paged_attention_kv8_bf16(const uint16_t *q, int64_t q_stride, const uint8_t *kc, const uint8_t *vc,
                             const AttentionRows *a, int64_t num_tokens, uint16_t *out, int64_t Hq, int64_t Hkv,
                             int64_t D, int64_t B, int64_t block_stride, int64_t token_stride, int64_t head_stride,
                             float scale, int64_t partition_size, int64_t code) {
    return attend_kv8(q, q_stride, kc, vc, a, num_tokens, out, Hq, Hkv, D, B, block_stride, token_stride,
                      head_stride, scale, partition_size, code);
}
}

// ---- every decoder layer of a step in one call ------------------------------------------------
// The loop of LlamaModel.forward over the kernels above, with no return to Python between
// them: at one token per step, the per-layer Python and dispatch work (~10 calls a layer) costs
// as much as a third of the weight streaming it surrounds. On entry x [T, H] is the residual
// stream and h [T, H] the first layer's normalised input; on return x is the final residual
// and h the final normalised hidden state.
namespace {
// One projection of a layer: a packed float weight (nparts 0: w is its PackedWeight's data) or a
// quantized one (w: an array of nparts QuantParts of quant_kernels.cpp, stacked by rows: one
// weight, or a fused projection whose parts are stored apart; tile_rows: rows per dequantized
// tile of its large-batch path).
struct Proj {
    int64_t w, nparts, tile_rows;
};
struct LayerPtrs {    // one row of the pointer table built in Python (kernels/cpu.py)
    Proj qkv;
    int64_t qkv_bias;
    Proj o, gate_up, down;
    int64_t input_norm, post_norm;
};
struct ModelDims {
    int64_t layers, hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
    // Quantized projections: quant_kernels.cpp's quant_linear_small and quant_linear_tiles by
    // address (a separate library: kernels/quant.py's kernel_address; 0 where no layer is
    // quantized), and the row counts up to which the integer path runs (kernels/quant.py's
    // thresholds: any batch, and a batch of decode tokens only); more rows take the tiles.
    int64_t quant_small, quant_tiles, small_rows, decode_rows;
    int64_t quant_handover;                   // quant_handover_next (project_lora), or 0
};
struct CacheRefs {    // element strides: layer and K/V of the cache tensor, then a Layout
    int64_t layer, kv, block, token, head, block_size, partition_size;
};

using QuantSmall = int (*)(const void *parts, int64_t nparts, const void *x, int64_t ldx, int x_bf16, int64_t T,
                           int64_t K, const float *bias, void *y, int64_t ldy, int y_bf16);
using QuantTiles = int (*)(const void *parts, int64_t nparts, const void *x, int x_bf16, int64_t T, int64_t K,
                           const float *bias, void *y, int64_t ldy, void *gemm, int64_t tile_rows);

inline int linear_any(const float *x, const float *w, const float *b, float *y, int64_t M, int64_t N, int64_t K) {
    return linear_packed_f32(x, w, b, y, M, N, K);
}
inline int linear_any(const uint16_t *x, const uint16_t *w, const float *b, uint16_t *y, int64_t M, int64_t N,
                      int64_t K) {
    return linear_packed_bf16(x, w, b, y, M, N, K);
}

// y [M, N] = x [M, K] @ W.T (+ b) for either kind of projection, as kernels/quant.py's linear
// chooses its path (`decode`: the step's rows are all decode tokens).
template <typename T>
int project(const Proj &p, const ModelDims &m, bool decode, const T *x, const float *b, T *y, int64_t M, int64_t N,
            int64_t K) {
    if (p.nparts == 0) return linear_any(x, reinterpret_cast<const T *>(p.w), b, y, M, N, K);
    constexpr int bf16 = std::is_same_v<T, uint16_t>;
    const void *parts = reinterpret_cast<const void *>(p.w);
    if (M <= (decode ? m.decode_rows : m.small_rows))
        return reinterpret_cast<QuantSmall>(m.quant_small)(parts, p.nparts, x, K, bf16, M, K, b, y, N, bf16);
    // The tiles multiply by this library's packed GEMM, as quant.py passes cpu.py's.
    void *gemm = bf16 ? reinterpret_cast<void *>(&linear_packed_ld_bf16) : reinterpret_cast<void *>(&linear_packed_ld_f32);
    return reinterpret_cast<QuantTiles>(m.quant_tiles)(parts, p.nparts, x, bf16, M, K, b, y, N, gemm, p.tile_rows);
}

inline float as_float(float v) { return v; }
inline float as_float(uint16_t v) {
    const uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}
inline void store_as(float *dst, float v) { *dst = v; }
inline void store_as(uint16_t *dst, float v) {     // to nearest even (the values are finite)
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    *dst = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// LoRA deltas (lora/weights.py LoRAStep, kernels/cpu.py LoraTable). Per layer and projection
// the step's slot range (span slots from lo) is a view of lora/weights.py's stacked tensors:
// A [span * K, in] and BT [span * K, ldb] (K = nparts * R rank rows per slot, R per part; BT
// row k of a slot holds part k / R's rank row in that part's output columns). row_block[t] is
// row t's slot less lo (negative: a base row, which costs nothing). The rows are grouped by
// slot into blocks of up to kLoraRows, and each block's delta uses only its own slot's
// weights, only the rank rows its adapter fills (slot_info): u = x @ A_s.T, rounded to T as
// a T GEMM would; then y += u @ BT_s, added in float32 and rounded into y once. Work grows
// with the rows, not rows x adapters; each slot's weights are read once per block.
struct LoraProj {
    int64_t a, bt, ldb, nparts;  // the range's A and BT (0: no delta), BT's row length, parts
    int64_t offset[3], size[3];  // each part's first output column and count
    int64_t btp;                 // BT in rank pairs [span * K / 2, ldb, 2] (bf16 AMX tiles' B), or 0
};
struct LoraRefs {
    const LoraProj *layers;      // [layers][4]: qkv, o, gate_up, down
    const int64_t *row_block;    // [T]
    int64_t rank;                // R: rank rows per part and slot
    const int64_t *slot_info;    // [span][4]: the adapter's rank | (parts it targets, a bit each) << 16
    int64_t span;
};

constexpr int kLoraRows = 4;
constexpr int kAheadCols = 2;     // rows of one slot per block: each weight load serves them all

// u[i][k0 + k] (ldu) for k < NK, i < NR: the rows xr dotted with rows k0.. of A (rows lda
// apart) over len inputs, in float32 (a partial sum: lora_delta rounds the whole sum).
// NR and NK fixed at compile time so the sums stay in registers.
template <class V, int NR, int NK, typename T>
void lora_shrink_tile(const T *const *xr, const T *a, int64_t lda, int64_t k0, int64_t len, float *u, int64_t ldu) {
    using Reg = typename V::reg;
    constexpr int W = V::W;
    const int64_t body = len / W * W;
    Reg acc[NK][NR];
    for (int k = 0; k < NK; k++)
        for (int i = 0; i < NR; i++) acc[k][i] = V::zero();
    const T *next = a + (k0 + NK) * lda;    // the next tile's rows: requested while these are summed
    for (int64_t c = 0; c < body; c += W) {
        Reg w[NK];
        for (int k = 0; k < NK; k++) __builtin_prefetch(next + k * lda + c, 0, 3);
        for (int k = 0; k < NK; k++) w[k] = V::load(a + (k0 + k) * lda + c);
        for (int i = 0; i < NR; i++) {
            const Reg xv = V::load(xr[i] + c);
            for (int k = 0; k < NK; k++) acc[k][i] = V::fmadd(xv, w[k], acc[k][i]);
        }
    }
    for (int k = 0; k < NK; k++)
        for (int i = 0; i < NR; i++) {
            float s = V::reduce_add(acc[k][i]);
            for (int64_t c = body; c < len; c++) s += as_float(xr[i][c]) * as_float(a[(k0 + k) * lda + c]);
            u[i * ldu + k0 + k] = s;
        }
}

template <class V, int NR, typename T>
void lora_shrink_rows(const T *const *xr, const T *a, int64_t lda, int64_t r, int64_t len, float *u, int64_t ldu) {
    constexpr int KA = V::W == 16 ? 4 : 2;
    int64_t k0 = 0;
    for (; k0 + KA <= r; k0 += KA) lora_shrink_tile<V, NR, KA>(xr, a, lda, k0, len, u, ldu);
    for (; k0 < r; k0++) lora_shrink_tile<V, NR, 1>(xr, a, lda, k0, len, u, ldu);
}

// u[i][k] (ldu) for the block's n rows xr and the r rows of A (rows lda apart), over len inputs.
template <class V, typename T>
void lora_shrink(const T *const *xr, int n, const T *a, int64_t lda, int64_t r, int64_t len, float *u, int64_t ldu) {
    static_assert(kLoraRows == 4);
    switch (n) {
        case 1: return lora_shrink_rows<V, 1>(xr, a, lda, r, len, u, ldu);
        case 2: return lora_shrink_rows<V, 2>(xr, a, lda, r, len, u, ldu);
        case 3: return lora_shrink_rows<V, 3>(xr, a, lda, r, len, u, ldu);
        default: return lora_shrink_rows<V, 4>(xr, a, lda, r, len, u, ldu);
    }
}

// y rows yr, columns [c0, c1) += sum over k < r of u[i][k] * b[k][c] (b's rows ldb apart):
// in float32, rounded into y once.
template <class V, int NR, typename T>
void lora_expand_rows(const float *u, int64_t ldu, const T *b, int64_t ldb, int64_t r, T *const *yr, int64_t c0,
                      int64_t c1) {
    using Reg = typename V::reg;
    constexpr int W = V::W, CV = W == 16 ? 4 : 2, CW = CV * W;
    int64_t c = c0;
    for (; c + CW <= c1; c += CW) {
        Reg acc[NR][CV];
        for (int i = 0; i < NR; i++)
            for (int v = 0; v < CV; v++) acc[i][v] = V::zero();
        for (int64_t k = 0; k < r; k++) {
            Reg w[CV];
            const char *ahead = reinterpret_cast<const char *>(b + k * ldb + c + kAheadCols * CW);
            for (size_t off = 0; off < CW * sizeof(T); off += 64) __builtin_prefetch(ahead + off, 0, 3);
            for (int v = 0; v < CV; v++) w[v] = V::load(b + k * ldb + c + v * W);
            for (int i = 0; i < NR; i++) {
                const Reg s = V::set1(u[i * ldu + k]);
                for (int v = 0; v < CV; v++) acc[i][v] = V::fmadd(s, w[v], acc[i][v]);
            }
        }
        for (int i = 0; i < NR; i++)
            for (int v = 0; v < CV; v++) {
                T *dst = yr[i] + c + v * W;
                V::store(dst, V::add(V::load(dst), acc[i][v]));
            }
    }
    for (; c + W <= c1; c += W) {       // a column piece's last vectors (pieces are 16-column aligned)
        Reg acc[NR];
        for (int i = 0; i < NR; i++) acc[i] = V::zero();
        for (int64_t k = 0; k < r; k++) {
            const Reg w = V::load(b + k * ldb + c);
            for (int i = 0; i < NR; i++) acc[i] = V::fmadd(V::set1(u[i * ldu + k]), w, acc[i]);
        }
        for (int i = 0; i < NR; i++) V::store(yr[i] + c, V::add(V::load(yr[i] + c), acc[i]));
    }
    for (; c < c1; c++)
        for (int i = 0; i < NR; i++) {
            float s = 0.f;
            for (int64_t k = 0; k < r; k++) s += u[i * ldu + k] * as_float(b[k * ldb + c]);
            store_as(yr[i] + c, as_float(yr[i][c]) + s);
        }
}

template <class V, typename T>
void lora_expand(const float *u, int64_t ldu, int n, const T *b, int64_t ldb, int64_t r, T *const *yr, int64_t c0,
                 int64_t c1) {
    switch (n) {
        case 1: return lora_expand_rows<V, 1>(u, ldu, b, ldb, r, yr, c0, c1);
        case 2: return lora_expand_rows<V, 2>(u, ldu, b, ldb, r, yr, c0, c1);
        case 3: return lora_expand_rows<V, 3>(u, ldu, b, ldb, r, yr, c0, c1);
        default: return lora_expand_rows<V, 4>(u, ldu, b, ldb, r, yr, c0, c1);
    }
}

#ifdef __AVX512BF16__
// y (bf16) += v, rounded to nearest even in one vcvtneps2bf16 (the deltas' outputs are never
// denormal, which it flushes; Vec::store's rounding by integer ops is the general one).
inline void lora_add_store(uint16_t *dst, __m512 v) {
    const __m512 sum = _mm512_add_ps(Vec::load(dst), v);
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(dst), (__m256i)_mm512_cvtneps_pbh(sum));
}
#endif

#ifdef __AVX512BF16__
// The vector path's bf16 sums on vdpbf16ps (two rank or input values per lane, no conversions;
// bf16 products are exact in float32, so only the order of the float32 sums differs).
// Shrink: u[i][k0 + k] (ldu) for k < NK, i < NR over len inputs (rows lda apart); the last
// len % 32 inputs through masked loads.
template <int NR, int NK>
void lora_shrink_tile_dp(const uint16_t *const *xr, const uint16_t *a, int64_t lda, int64_t k0, int64_t len,
                         float *u, int64_t ldu) {
    __m512 acc[NK][NR];
    for (int k = 0; k < NK; k++)
        for (int i = 0; i < NR; i++) acc[k][i] = _mm512_setzero_ps();
    const uint16_t *next = a + (k0 + NK) * lda;    // the next tile's rows: requested while these are summed
    for (int64_t c = 0; c < len; c += 32) {
        const __mmask32 m = len - c >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << (len - c)) - 1);
        __m512bh w[NK];
        for (int k = 0; k < NK; k++) __builtin_prefetch(next + k * lda + c, 0, 3);
        for (int k = 0; k < NK; k++) w[k] = (__m512bh)_mm512_maskz_loadu_epi16(m, a + (k0 + k) * lda + c);
        for (int i = 0; i < NR; i++) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, xr[i] + c);
            for (int k = 0; k < NK; k++) acc[k][i] = _mm512_dpbf16_ps(acc[k][i], xv, w[k]);
        }
    }
    for (int k = 0; k < NK; k++)
        for (int i = 0; i < NR; i++) u[i * ldu + k0 + k] = _mm512_reduce_add_ps(acc[k][i]);
}

template <int NR>
void lora_shrink_dp_rows(const uint16_t *const *xr, const uint16_t *a, int64_t lda, int64_t r, int64_t len, float *u,
                         int64_t ldu) {
    int64_t k0 = 0;
    for (; k0 + 4 <= r; k0 += 4) lora_shrink_tile_dp<NR, 4>(xr, a, lda, k0, len, u, ldu);
    for (; k0 < r; k0++) lora_shrink_tile_dp<NR, 1>(xr, a, lda, k0, len, u, ldu);
}

inline void lora_shrink_dp(const uint16_t *const *xr, int n, const uint16_t *a, int64_t lda, int64_t r, int64_t len,
                           float *u, int64_t ldu) {
    switch (n) {
        case 1: return lora_shrink_dp_rows<1>(xr, a, lda, r, len, u, ldu);
        case 2: return lora_shrink_dp_rows<2>(xr, a, lda, r, len, u, ldu);
        case 3: return lora_shrink_dp_rows<3>(xr, a, lda, r, len, u, ldu);
        default: return lora_shrink_dp_rows<4>(xr, a, lda, r, len, u, ldu);
    }
}

// Expand from BT's rank pairs (pj: the part's first pair row, [pairs][ldb][2]): y rows yr,
// columns [c0, c1) += u @ BT_j, u rounded to bf16 already (exact here), a pair of rank values
// per lane; columns past the last 16 on the float path (bj: BT's part rows, ldb apart).
template <int NR>
void lora_expand_dp_rows(const float *u, int64_t ldu, const uint16_t *pj, const uint16_t *bj, int64_t ldb,
                         int64_t r, uint16_t *const *yr, int64_t c0, int64_t c1) {
    const int64_t np = (r + 1) / 2;
    __m512i up[NR][64];     // (u_2q, u_2q+1) per row, broadcast; r <= 128
    for (int i = 0; i < NR; i++)
        for (int64_t q = 0; q < np; q++) {
            uint16_t lo, hi = 0;
            store_as(&lo, u[i * ldu + 2 * q]);
            if (2 * q + 1 < r) store_as(&hi, u[i * ldu + 2 * q + 1]);
            up[i][q] = _mm512_set1_epi32(static_cast<int32_t>(lo | static_cast<uint32_t>(hi) << 16));
        }
    int64_t c = c0;
    for (; c + 64 <= c1; c += 64) {
        __m512 acc[NR][4];
        for (int i = 0; i < NR; i++)
            for (int v = 0; v < 4; v++) acc[i][v] = _mm512_setzero_ps();
        for (int64_t q = 0; q < np; q++) {
            const uint16_t *row = pj + (q * ldb + c) * 2;
            for (int v = 0; v < 4; v++) __builtin_prefetch(row + (kAheadCols * 64 + v * 16) * 2, 0, 3);
            __m512bh w[4];
            for (int v = 0; v < 4; v++) w[v] = (__m512bh)_mm512_loadu_si512(row + v * 32);
            for (int i = 0; i < NR; i++)
                for (int v = 0; v < 4; v++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], (__m512bh)up[i][q], w[v]);
        }
        for (int i = 0; i < NR; i++)
            for (int v = 0; v < 4; v++) lora_add_store(yr[i] + c + v * 16, acc[i][v]);
    }
    for (; c + 16 <= c1; c += 16) {
        __m512 acc[NR];
        for (int i = 0; i < NR; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t q = 0; q < np; q++) {
            const __m512bh w = (__m512bh)_mm512_loadu_si512(pj + (q * ldb + c) * 2);
            for (int i = 0; i < NR; i++) acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)up[i][q], w);
        }
        for (int i = 0; i < NR; i++) lora_add_store(yr[i] + c, acc[i]);
    }
    if (c < c1) lora_expand_rows<Vec, NR>(u, ldu, bj, ldb, r, yr, c, c1);
}

inline void lora_expand_dp(const float *u, int64_t ldu, int n, const uint16_t *pj, const uint16_t *bj, int64_t ldb,
                           int64_t r, uint16_t *const *yr, int64_t c0, int64_t c1) {
    switch (n) {
        case 1: return lora_expand_dp_rows<1>(u, ldu, pj, bj, ldb, r, yr, c0, c1);
        case 2: return lora_expand_dp_rows<2>(u, ldu, pj, bj, ldb, r, yr, c0, c1);
        case 3: return lora_expand_dp_rows<3>(u, ldu, pj, bj, ldb, r, yr, c0, c1);
        default: return lora_expand_dp_rows<4>(u, ldu, pj, bj, ldb, r, yr, c0, c1);
    }
}
#endif

constexpr int kLoraAmxRows = 6;    // a slot's rows from which AMX tiles take them (bf16, avx512bf16 build; measured)
constexpr int kLoraAmxMax = 16;    // rows per AMX block: one tile's rows

#ifdef __AVX512BF16__
// AMX tiles for one slot's rows (from kLoraAmxRows, up to 16 per block) of one part of a bf16
// projection: the same sums as the vector path, on tiles. Shrink (lora_amx_shrink) over inputs
// [i0, i1) as u.T = A_j @ x.T: A tiles straight from the part's rank rows (16 rank rows x 32
// inputs), B tiles from x's rows transposed in pairs (a per-call O(16 (i1 - i0)) copy); tiles
// 16 x 64 bytes (amx_load_config). Expand (lora_amx_expand) over the part's columns [c0, c1):
// u rounded to bf16 in rows of Rp (R rounded up to kk), zero past the slot's rank, kk rank
// values a step (lora_expand_config), 48 columns at a time: B tiles straight from BT's rank
// pairs made at load (LoraProj.btp), else BT's rows paired here; C tiles added into y in
// float32, rounded once; the part's last size % 16 columns on the vector path.
inline bool lora_amx_usable(int64_t R, int64_t in) {    // R <= 128: 4 expand steps at most
    return g_amx.enabled && R % 16 == 0 && R <= 128 && in % 32 == 0;
}

// The expand's tiles: C 0-2 16 x 16 float32; u (6) 16 rows x kk rank values; BT (4, 5, 7) kk / 2 pair rows.
__attribute__((target("amx-tile,amx-bf16"))) void lora_expand_config(int64_t kk) {
    TileConfig cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    cfg.colsb[6] = static_cast<uint16_t>(kk * 2);
    cfg.rows[4] = cfg.rows[5] = cfg.rows[7] = static_cast<uint8_t>(kk / 2);
    _tile_loadconfig(&cfg);
}

// Per part j in `parts`: uj[j][i][k] (ldu) for k < rank (the slot's rows j * R + k of a, rows
// in apart), i < n, over inputs [i0, i1): one transpose of x serves every part.
__attribute__((target("amx-tile,amx-bf16"))) void lora_amx_shrink(const uint16_t *a, int64_t in, int64_t R,
                                                                    int64_t rank, int64_t parts, int n,
                                                                    const int64_t *rows, const uint16_t *x,
                                                                    int64_t i0, int64_t i1, float *const *uj,
                                                                    int64_t ldu) {
    const int64_t len = i1 - i0;
    thread_local std::vector<uint32_t> xt_v;          // x.T in pairs: [len / 2][16]
    if (static_cast<int64_t>(xt_v.size()) < len * 8) xt_v.resize(len * 8);
    uint32_t *xt = xt_v.data();
    for (int64_t p0 = 0; p0 < len / 2; p0 += 16) {     // 16 pairs of the rows at a time, transposed
        __m512i r[16];
        for (int i = 0; i < 16; i++)
            r[i] = i < n ? _mm512_loadu_si512(x + rows[i] * in + i0 + 2 * p0) : _mm512_setzero_si512();
        transpose16_epi32(r);
        for (int c = 0; c < 16; c++) _mm512_storeu_si512(xt + (p0 + c) * 16, r[c]);
    }
    alignas(64) float buf[3 * 256];
    amx_load_config();
    memory_barrier();
    int64_t kbs[3], js[3];      // up to 3 rank blocks of 16 (a's row, its part) per pass over x
    int nk = 0;
    auto flush = [&]() {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        for (int64_t c = 0; c < len; c += 32) {
            _tile_loadd(6, xt + c / 2 * 16, 64);
            _tile_loadd(4, a + kbs[0] * in + i0 + c, in * 2);
            _tile_dpbf16ps(0, 4, 6);
            if (nk > 1) {
                _tile_loadd(5, a + kbs[1] * in + i0 + c, in * 2);
                _tile_dpbf16ps(1, 5, 6);
            }
            if (nk > 2) {
                _tile_loadd(7, a + kbs[2] * in + i0 + c, in * 2);
                _tile_dpbf16ps(2, 7, 6);
            }
        }
        _tile_stored(0, buf, 64);
        _tile_stored(1, buf + 256, 64);
        _tile_stored(2, buf + 512, 64);
        memory_barrier();
        for (int b = 0; b < nk; b++) {      // C tile (rank x rows) transposed into u's rows
            const int64_t k_in = kbs[b] - js[b] * R;
            const __mmask16 ranks = first_lanes(rank - k_in);
            __m512i t[16];
            for (int m = 0; m < 16; m++) t[m] = _mm512_load_si512(buf + b * 256 + m * 16);
            transpose16_epi32(t);
            float *u = uj[js[b]] + k_in;
            for (int i = 0; i < n; i++) _mm512_mask_storeu_epi32(u + i * ldu, ranks, t[i]);
        }
        nk = 0;
    };
    for (int64_t j = 0; j < 3; j++) {
        if (!((parts >> j) & 1)) continue;
        for (int64_t kb = 0; kb < rank; kb += 16) {
            kbs[nk] = j * R + kb, js[nk++] = j;
            if (nk == 3) flush();
        }
    }
    if (nk > 0) flush();
    _tile_release();
}

// y rows (y: the part's first column), the part's columns [c0, c1) += u @ BT_j; u [n][ldu]
// rounded to bf16 already; bj: BT's part rows (ldb apart); pj: their rank pairs (or null).
__attribute__((target("amx-tile,amx-bf16"))) void lora_amx_expand(const uint16_t *bj, const uint16_t *pj,
                                                                    int64_t ldb, int64_t R, int64_t rank, int n,
                                                                    const int64_t *rows, const float *u,
                                                                    int64_t ldu, int64_t c0, int64_t c1,
                                                                    int64_t size, uint16_t *y, int64_t ldy) {
    // kk: rank values per expand step (R = 16: one step of 16; else steps of 32)
    const int64_t kk = R % 32 == 0 ? 32 : 16, Rp = (R + kk - 1) / kk * kk, ksteps = (rank + kk - 1) / kk,
                  tile = kk * 16;     // bf16 per packed BT tile
    thread_local std::vector<uint16_t> ub_v, bb_v;    // u [16][Rp]; BT tiles [3][Rp/kk][kk/2][32]
    ub_v.assign(16 * Rp, 0);
    if (static_cast<int64_t>(bb_v.size()) < 3 * Rp * 16) bb_v.resize(3 * Rp * 16);   // zero rows stay zero
    uint16_t *ub = ub_v.data(), *bb = bb_v.data();
    for (int i = 0; i < n; i++)      // exact: u is rounded to bf16 already (its low halves are zero)
        for (int64_t k = 0; k < rank; k += 16) {
            const __mmask16 m = first_lanes(rank - k);
            const __m512i v = _mm512_srli_epi32(_mm512_maskz_loadu_epi32(m, u + i * ldu + k), 16);
            _mm256_mask_storeu_epi16(ub + i * Rp + k, m, _mm512_cvtepi32_epi16(v));
        }
    const int64_t full = size / 16 * 16, end = std::min(c1, full);
    // C tiles go out through buf: a group's are added into y one group later, after the next
    // group's tile operations, so the vector loads find the tile stores done (added at once, each
    // waited on its stores: most of the expand's time).
    alignas(64) float buf[2][3 * 256];
    int64_t pending_c = -1;
    int pending_nct = 0;
    auto add_pending = [&]() {
        const float *done = buf[(pending_c - c0) / 48 % 2];
        for (int ct = 0; ct < pending_nct; ct++)
            for (int i = 0; i < n; i++)
                lora_add_store(y + rows[i] * ldy + pending_c + ct * 16, _mm512_load_ps(done + ct * 256 + i * 16));
    };
    if (c0 < end) lora_expand_config(kk);
    for (int64_t c = c0; c < end; c += 48) {
        const int nct = static_cast<int>(std::min<int64_t>(3, (end - c) / 16));
        // B tiles: straight from the pairs made at load, or paired here into bb
        const uint16_t *tb[3][8];
        int64_t tstride = 64;
        if (pj != nullptr) {
            tstride = ldb * 4;
            for (int ct = 0; ct < nct; ct++)
                for (int64_t ks = 0; ks < ksteps; ks++) tb[ct][ks] = pj + (ks * kk / 2 * ldb + c + ct * 16) * 2;
        } else {
            for (int ct = 0; ct < nct; ct++)
                for (int64_t ks = 0; ks < ksteps; ks++) {
                    uint16_t *t = bb + (ct * (Rp / kk) + ks) * tile;
                    tb[ct][ks] = t;
                    for (int pr = 0; pr < kk / 2; pr++) {
                        const int64_t k = ks * kk + 2 * pr;
                        if (k >= rank) break;       // u is zero there: rows past the rank need only be finite
                        const uint16_t *r0 = bj + k * ldb + c + ct * 16;     // rank rows k, k + 1 < R
                        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)r0));
                        const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(r0 + ldb)));
                        _mm512_storeu_si512(t + pr * 32, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
                    }
                }
        }
        memory_barrier();
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        for (int64_t ks = 0; ks < ksteps; ks++) {
            _tile_loadd(6, ub + ks * kk, Rp * 2);
            _tile_loadd(4, tb[0][ks], tstride);
            _tile_dpbf16ps(0, 6, 4);
            if (nct > 1) {
                _tile_loadd(5, tb[1][ks], tstride);
                _tile_dpbf16ps(1, 6, 5);
            }
            if (nct > 2) {
                _tile_loadd(7, tb[2][ks], tstride);
                _tile_dpbf16ps(2, 6, 7);
            }
        }
        float *out = buf[(c - c0) / 48 % 2];
        _tile_stored(0, out, 64);
        _tile_stored(1, out + 256, 64);
        _tile_stored(2, out + 512, 64);
        memory_barrier();
        if (pending_c >= 0) add_pending();
        pending_c = c, pending_nct = nct;
    }
    if (pending_c >= 0) add_pending();
    if (c0 < end) _tile_release();
    if (c1 > full && full < size)
        for (int i0 = 0; i0 < n; i0 += kLoraRows) {
            uint16_t *yr[kLoraRows];
            const int m = std::min(kLoraRows, n - i0);
            for (int i = 0; i < m; i++) yr[i] = y + rows[i0 + i] * ldy;
            lora_expand<Vec>(u + i0 * ldu, ldu, m, bj, ldb, rank, yr, std::max(c0, full), size);
        }
}
#endif

// A block: up to kLoraRows rows of one slot on the vector path, or (amx) up to kLoraAmxMax on
// AMX tiles. A shrink item: block b's parts (j = -1), or its part j only.
struct LoraBlock { int64_t slot, rank, parts; int n; bool amx; int64_t rows[16]; };
struct LoraItem { int64_t b, j; };

// Projection p's blocks for the step's rows (grouped by slot; only the slots whose adapter
// targets it) and the shrink items over them. Returns whether the team should run them: one
// OpenMP meeting per phase costs most when other processes hold the cores, so the team joins
// when the work or the adapter bytes to read are large enough (both cores' loads in flight read
// cold weights at about 1.6x one core's rate). Items: one per block, or per (block, part) where
// there are too few blocks to keep every thread busy.
template <typename T>
bool lora_plan(const LoraRefs *lr, const LoraProj &p, int which, int64_t in, int64_t T_,
               std::vector<LoraBlock> &blocks, std::vector<LoraItem> &items) {
    thread_local std::vector<int64_t> mine;
    blocks.clear();
    items.clear();
#ifdef __AVX512BF16__
    const bool amx = std::is_same_v<T, uint16_t> && lora_amx_usable(lr->rank, in);
#else
    const bool amx = false;
#endif
    int64_t macs = 0, weights = 0;
    for (int64_t s = 0; s < lr->span; s++) {     // each slot's rows, in blocks
        const int64_t info = lr->slot_info[s * 4 + which], rank = info & 0xFFFF, parts = info >> 16;
        if (rank == 0 || parts == 0) continue;
        mine.clear();
        for (int64_t t = 0; t < T_; t++)
            if (lr->row_block[t] == s) mine.push_back(t);
        const int64_t count = static_cast<int64_t>(mine.size());
        if (count == 0) continue;
        int64_t slot_weights = 0;                    // its A and BT elements this projection reads
        for (int64_t j = 0; j < p.nparts; j++)
            if ((parts >> j) & 1) slot_weights += rank * (in + p.size[j]);
        weights += slot_weights, macs += count * slot_weights;
        for (int64_t i = 0; i < count;) {
            const bool tiles = amx && count - i >= kLoraAmxRows;     // AMX blocks of up to 16 rows
            LoraBlock blk{s, rank, parts, static_cast<int>(std::min<int64_t>(tiles ? kLoraAmxMax : kLoraRows, count - i)),
                          tiles, {}};
            for (int k = 0; k < blk.n; k++) blk.rows[k] = mine[i + k];
            i += blk.n;
            blocks.push_back(blk);
        }
    }
    const bool team = macs >= (1 << 18) || weights >= (1 << 14);
    const int64_t nb = static_cast<int64_t>(blocks.size()), threads = team ? omp_get_max_threads() : 1;
    for (int64_t b = 0; b < nb; b++) {
        if (nb >= 2 * threads) {
            items.push_back({b, -1});
            continue;
        }
        for (int64_t j = 0; j < p.nparts; j++)
            if ((blocks[b].parts >> j) & 1) items.push_back({b, j});
    }
    return team;
}

// Shrink of one item: ub [16][K] (block blk's rows; part j's rank columns at j * R) = x @ A_j.T
// for its parts, rounded to T as a T GEMM's output would be.
template <typename T>
void lora_shrink_item(const LoraRefs *lr, const LoraProj &p, const LoraBlock &blk, int64_t j0, const T *x,
                      int64_t in, float *ub) {
    const int64_t R = lr->rank, K = p.nparts * R, parts = j0 < 0 ? blk.parts : blk.parts & (int64_t{1} << j0);
    const T *A = reinterpret_cast<const T *>(p.a);
#ifdef __AVX512BF16__
    if constexpr (std::is_same_v<T, uint16_t>) {
        if (blk.amx) {
            float *uj[3] = {ub, ub + R, ub + 2 * R};
            lora_amx_shrink(A + blk.slot * K * in, in, R, blk.rank, parts, blk.n, blk.rows, x, 0, in, uj, K);
        }
    }
#endif
    if (!blk.amx) {
        const T *xr[kLoraRows];
        for (int r = 0; r < blk.n; r++) xr[r] = x + blk.rows[r] * in;
        for (int64_t j = 0; j < p.nparts; j++) {
            if (!((parts >> j) & 1)) continue;
#ifdef __AVX512BF16__
            if constexpr (std::is_same_v<T, uint16_t>) {
                lora_shrink_dp(xr, blk.n, A + (blk.slot * K + j * R) * in, in, blk.rank, in, ub + j * R, K);
                continue;
            }
#endif
            lora_shrink<Vec>(xr, blk.n, A + (blk.slot * K + j * R) * in, in, blk.rank, in, ub + j * R, K);
        }
    }
    for (int r = 0; r < blk.n; r++)
        for (int64_t j = 0; j < p.nparts; j++)
            if ((parts >> j) & 1) {
                float *uk = ub + r * K + j * R;
                int64_t k = 0;
                for (; k + Vec::W <= blk.rank; k += Vec::W) Vec::store(uk + k, round_as_v<Vec>(Vec::load(uk + k), x));
                for (; k < blk.rank; k++) {
                    T rounded;
                    store_as(&rounded, uk[k]);
                    uk[k] = as_float(rounded);
                }
            }
}

// Thread t of nt's share of part j's output columns in the delta's expand, [c0, c1) within the
// part: the projection's columns split evenly, cut at multiples of 16 in each part (the part's
// end last). lora_team_run expands them and lora_prefetch_plan fetches their weights.
inline std::pair<int64_t, int64_t> lora_columns(const LoraProj &p, int64_t j, int64_t t, int64_t nt) {
    const int64_t N = p.offset[p.nparts - 1] + p.size[p.nparts - 1];
    auto cut = [&](int64_t g) {      // column g of y, as a cut in part j
        return g >= p.offset[j] + p.size[j] ? p.size[j] : std::max<int64_t>(0, g - p.offset[j]) / 16 * 16;
    };
    return {cut(N * t / nt), cut(N * (t + 1) / nt)};
}

// One projection's delta, planned (lora_plan) and ready for a team to run (lora_team_run).
template <typename T>
struct LoraCall {
    const LoraRefs *lr;
    const LoraProj *p;
    const T *x;
    int64_t in;
    T *y;
    int64_t ldy;
    const LoraBlock *blocks;
    int64_t nb;
    const LoraItem *items;
    int64_t ni;
    float *u;               // block b's rows' rank columns, [16][K] at b (part j's at j * R)
};

// The delta's plan for y [T, ldy] += projection `which` of `layer` for x [T, in], in the calling
// thread's buffers. Returns whether a team should run it; call.nb == 0: nothing to do.
template <typename T>
bool lora_prepare(const LoraRefs *lr, int64_t layer, int which, const T *x, int64_t in, T *y, int64_t ldy,
                  int64_t T_, LoraCall<T> &call) {
    thread_local std::vector<LoraBlock> blocks;
    thread_local std::vector<LoraItem> items;
    thread_local std::vector<float> scratch;
    call = LoraCall<T>{lr, nullptr, x, in, y, ldy, nullptr, 0, nullptr, 0, nullptr};
    if (lr == nullptr) return false;
    const LoraProj &p = lr->layers[layer * 4 + which];
    if (p.a == 0) return false;
    const bool team = lora_plan<T>(lr, p, which, in, T_, blocks, items);
    const int64_t nb = static_cast<int64_t>(blocks.size()), K = p.nparts * lr->rank;
    if (static_cast<int64_t>(scratch.size()) < nb * 16 * K) scratch.resize(nb * 16 * K);
    // (the team's threads use these pointers, not their own thread_local vectors)
    call.p = &p, call.blocks = blocks.data(), call.nb = nb, call.items = items.data();
    call.ni = static_cast<int64_t>(items.size()), call.u = scratch.data();
    return team;
}

// The delta run by every thread of the current team (or one thread alone), in two phases: the
// shrink items, round-robin (where lora_prefetch_plan had their A rows fetched; the loop's
// barrier also waits for a base product in the same region), then the expand, each thread a
// range of the output columns over every block, as the base projection cut them
// (quant_linear_small and the packed GEMMs give each thread a contiguous range of output
// rows): y's lines are in the caches of the core that just wrote them, and each thread reads
// its share of every slot's BT.
template <typename T>
void lora_team_run(const LoraCall<T> &c) {
    const LoraProj &p = *c.p;
    const int64_t R = c.lr->rank, K = p.nparts * R;
    const T *BT = reinterpret_cast<const T *>(p.bt);
    const uint16_t *pairs = p.btp ? reinterpret_cast<const uint16_t *>(p.btp) : nullptr;
#pragma omp for schedule(static, 1)
    for (int64_t i = 0; i < c.ni; i++)
        lora_shrink_item(c.lr, p, c.blocks[c.items[i].b], c.items[i].j, c.x, c.in, c.u + c.items[i].b * 16 * K);
    // Expand: y += u_j @ BT_j over this thread's output columns (lora_columns).
    const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
    for (int64_t j = 0; j < p.nparts; j++) {
        const auto [c0, c1] = lora_columns(p, j, tid, nt);
        if (c0 >= c1) continue;
        for (int64_t b = 0; b < c.nb; b++) {
            const LoraBlock &blk = c.blocks[b];
            if (!((blk.parts >> j) & 1)) continue;
            const float *ub = c.u + b * 16 * K + j * R;
            const T *bj = BT + (blk.slot * K + j * R) * p.ldb + p.offset[j];
#ifdef __AVX512BF16__
            if constexpr (std::is_same_v<T, uint16_t>) {
                const uint16_t *pj = pairs ? pairs + ((blk.slot * K + j * R) / 2 * p.ldb + p.offset[j]) * 2 : nullptr;
                if (blk.amx) {
                    lora_amx_expand(bj, pj, p.ldb, R, blk.rank, blk.n, blk.rows, ub, K, c0, c1, p.size[j],
                                    c.y + p.offset[j], c.ldy);
                    continue;
                }
                if (pj != nullptr && R <= 128) {
                    uint16_t *yr[kLoraRows];
                    for (int r = 0; r < blk.n; r++) yr[r] = c.y + blk.rows[r] * c.ldy + p.offset[j];
                    lora_expand_dp(ub, K, blk.n, pj, bj, p.ldb, blk.rank, yr, c0, c1);
                    continue;
                }
            }
#endif
            T *yr[kLoraRows];
            for (int r = 0; r < blk.n; r++) yr[r] = c.y + blk.rows[r] * c.ldy + p.offset[j];
            lora_expand<Vec>(ub, K, blk.n, bj, p.ldb, blk.rank, yr, c0, c1);
        }
    }
}

// y [T, ldy] += the delta of projection `which` of `layer` for x [T, in], in a meeting of its own.
template <typename T>
int lora_delta(const LoraRefs *lr, int64_t layer, int which, const T *x, int64_t in, T *y, int64_t ldy,
               int64_t T_) {
    LoraCall<T> call;
    const bool team = lora_prepare(lr, layer, which, x, in, y, ldy, T_, call);
    if (call.nb == 0) return 0;
#pragma omp parallel if (team)
    lora_team_run(call);
    return 0;
}

// quant_kernels.cpp's Handover (the same layout): per thread of the team, ranges of bytes to
// fetch, and the work to run at the end of the product.
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
    int64_t threads;
    ThreadPrefetch t[kPrefetchThreads];
    void (*after)(const void *ctx);     // every thread calls it at the end of the product, inside its region
    const void *ctx;
    int64_t ran;                        // set where `after` ran
};

// What each of the nt threads of lora_team_run will read of the adapter weights, for the base
// product before it to fetch into that thread's L2 meanwhile: the A rows of its shrink items
// (the items go round-robin, schedule(static, 1)) and the BT pairs of its output columns
// (lora_columns). Nothing where BT has no pairs (float32).
template <typename T>
void lora_prefetch_plan(const LoraCall<T> &c, int64_t nt, Handover &plan) {
    const LoraProj &p = *c.p;
    const int64_t in = c.in, R = c.lr->rank, K = p.nparts * R;
    for (int64_t t = 0; t < kPrefetchThreads; t++) plan.t[t].n = 0;
    if (p.btp == 0) return;
    auto add = [&](int64_t t, const void *at, int64_t bytes, int64_t count, int64_t stride) {
        if (t >= kPrefetchThreads) return;
        ThreadPrefetch &tp = plan.t[t];
        if (tp.n < kPrefetchRanges && bytes > 0 && count > 0)
            tp.r[tp.n++] = {static_cast<const char *>(at), bytes, count, stride};
    };
    const T *A = reinterpret_cast<const T *>(p.a);
    const uint16_t *pairs = reinterpret_cast<const uint16_t *>(p.btp);
    for (int64_t i = 0; i < c.ni; i++) {
        const LoraItem &item = c.items[i];
        const LoraBlock &blk = c.blocks[item.b];
        for (int64_t j = 0; j < p.nparts; j++)
            if ((item.j < 0 || item.j == j) && ((blk.parts >> j) & 1))
                add(i % nt, A + (blk.slot * K + j * R) * in, blk.rank * in * int64_t(sizeof(T)), 1, 0);
    }
    int64_t last = -1;
    for (int64_t b = 0; b < c.nb; b++) {       // each slot's pairs once (its blocks are consecutive)
        const LoraBlock &blk = c.blocks[b];
        if (blk.slot == last) continue;
        last = blk.slot;
        for (int64_t t = 0; t < nt; t++) {
            for (int64_t j = 0; j < p.nparts; j++) {
                if (!((blk.parts >> j) & 1)) continue;
                const auto [c0, c1] = lora_columns(p, j, t, nt);     // the pair rows' columns
                if (c0 < c1)
                    add(t, pairs + ((blk.slot * K + j * R) / 2 * p.ldb + p.offset[j] + c0) * 2, (c1 - c0) * 4,
                        (blk.rank + 1) / 2, p.ldb * 4);
            }
        }
    }
}

using QuantHandover = int (*)(const Handover *plan);
int g_lora_handover = 1;
std::atomic<int> g_lora_handovers{0};     // deltas handed to a base product (tests: it is really on)

template <typename T>
void lora_after(const void *ctx) {
    lora_team_run(*static_cast<const LoraCall<T> *>(ctx));
}

// One projection and its LoRA delta. A quantized base product (quant_linear_small's rows, the
// AMX-BF16 tiles) fetches the delta's adapter weights ahead and runs the delta at its end, in
// the same OpenMP meeting (Handover.after): one meeting a projection, not two. Elsewhere
// (the packed GEMMs) the delta follows in a meeting of its own.
template <typename T>
int project_lora(const Proj &w, const ModelDims &m, bool decode, const LoraRefs *lora, int64_t layer, int which,
                 const T *x, const float *b, T *y, int64_t M, int64_t N, int64_t K) {
    thread_local Handover plan;
    LoraCall<T> call;
    const bool team = lora_prepare(lora, layer, which, x, K, y, N, M, call);
    const bool handed = call.nb > 0 && w.nparts > 0 && m.quant_handover != 0 && g_lora_handover;
    if (handed) {
        plan.threads = omp_get_max_threads();
        lora_prefetch_plan(call, plan.threads, plan);
        plan.after = &lora_after<T>, plan.ctx = &call, plan.ran = 0;
        reinterpret_cast<QuantHandover>(m.quant_handover)(&plan), g_lora_handovers++;
    }
    const int status = project(w, m, decode, x, b, y, M, N, K);
    if (handed) reinterpret_cast<QuantHandover>(m.quant_handover)(nullptr);
    if (status != 0 || call.nb == 0 || (handed && plan.ran)) return status;
#pragma omp parallel if (team)
    lora_team_run(call);
    return 0;
}

}  // namespace

extern "C" {
// One projection's LoRA delta on its own (tests/test_lora_kernel.py): y [T, ldy] += delta.
int lora_delta_f32(const LoraRefs *lr, int64_t layer, int64_t which, const float *x, int64_t in, float *y,
                   int64_t ldy, int64_t T) {
    return lora_delta(lr, layer, static_cast<int>(which), x, in, y, ldy, T);
}
int lora_delta_bf16(const LoraRefs *lr, int64_t layer, int64_t which, const uint16_t *x, int64_t in, uint16_t *y,
                    int64_t ldy, int64_t T) {
    return lora_delta(lr, layer, static_cast<int>(which), x, in, y, ldy, T);
}
// enable: hand each LoRA delta to the quantized base product before it (1: project_lora) or run
// it on its own (0; measuring it). Returns the setting.
int lora_handover_config(int64_t enable) { return g_lora_handover = enable != 0; }
// How many LoRA deltas were handed to a base product so far (wraps; tests compare counts).
int lora_handovers() { return g_lora_handovers.load(); }
}

namespace {
// K: the cache's element type (T, or an 8-bit format: written through write_kv_quant).
template <typename T, typename K = T>
int decoder_layers(const LayerPtrs *layers, const T *final_norm, ModelDims m, T *x, T *h, const T *cos,
                   const T *sin, K *cache, CacheRefs c, const int64_t *slots, const AttentionRows &rows, int64_t T_,
                   const LoraRefs *lora) {
    const int64_t q_size = m.heads * m.head_dim, kv_size = m.kv_heads * m.head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size, I = m.intermediate, H = m.hidden;
    thread_local std::vector<T> scratch;           // qkv, attention out, o/down out, gate_up, act
    const int64_t need = T_ * (qkv_size + q_size + H + 3 * I);
    if (static_cast<int64_t>(scratch.size()) < need) scratch.resize(need);
    T *qkv = scratch.data(), *attn = qkv + T_ * qkv_size, *proj = attn + T_ * q_size, *gate_up = proj + T_ * H,
      *act = gate_up + T_ * 2 * I;
    const Layout L{c.block, c.token, c.head};
    const bool decode = rows.num_decodes == T_;      // decode tokens only: quantized weights' decode threshold
    for (int64_t l = 0; l < m.layers; l++) {
        const LayerPtrs &w = layers[l];
        K *kc = cache + l * c.layer, *vc = kc + c.kv;
        const T *next_norm = l + 1 < m.layers ? reinterpret_cast<const T *>(layers[l + 1].input_norm) : final_norm;
        if (project_lora(w.qkv, m, decode, lora, l, 0, h, reinterpret_cast<const float *>(w.qkv_bias), qkv, T_,
                         qkv_size, H))
            return 2;
        rope_inplace(qkv, qkv_size, T_, m.heads + m.kv_heads, m.head_dim, cos, sin);
        if constexpr (kQuant<K>)
            write_kv_quant(qkv + q_size, qkv + q_size + kv_size, qkv_size, m.head_dim, qkv_size, m.head_dim, kc, vc,
                           slots, T_, m.kv_heads, m.head_dim, c.block_size, c.block, c.token, c.head);
        else
            write_kv(reinterpret_cast<const char *>(qkv + q_size),
                     reinterpret_cast<const char *>(qkv + q_size + kv_size), qkv_size, m.head_dim, qkv_size,
                     m.head_dim, reinterpret_cast<char *>(kc), reinterpret_cast<char *>(vc), slots, T_, m.kv_heads,
                     m.head_dim, c.block_size, c.block, c.token, c.head, sizeof(T));
        if (attend(qkv, qkv_size, kc, vc, rows, T_, attn, m.heads, m.kv_heads, m.head_dim, c.block_size, L, m.scale,
                   c.partition_size))
            return l ? 2 : 1;        // the first layer refuses before it attends: nothing cached yet is wrong
        if (project_lora(w.o, m, decode, lora, l, 1, attn, nullptr, proj, T_, H, q_size)) return 2;
        add_rms_norm(x, proj, reinterpret_cast<const T *>(w.post_norm), h, T_, H, m.eps);
        if (project_lora(w.gate_up, m, decode, lora, l, 2, h, nullptr, gate_up, T_, 2 * I, H)) return 2;
        silu_and_mul(gate_up, act, T_, I);
        if (project_lora(w.down, m, decode, lora, l, 3, act, nullptr, proj, T_, H, I)) return 2;
        add_rms_norm(x, proj, next_norm, h, T_, H, m.eps);
    }
    return 0;
}
}  // namespace

extern "C" {
int decoder_layers_f32(const LayerPtrs *layers, const float *final_norm, const ModelDims *m, float *x, float *h,
                       const float *cos, const float *sin, float *cache, const CacheRefs *c, const int64_t *slots,
                       const AttentionRows *rows, const LoraRefs *lora, int64_t T) {
    return decoder_layers(layers, final_norm, *m, x, h, cos, sin, cache, *c, slots, *rows, T, lora);
}
int decoder_layers_bf16(const LayerPtrs *layers, const uint16_t *final_norm, const ModelDims *m, uint16_t *x,
                        uint16_t *h, const uint16_t *cos, const uint16_t *sin, uint16_t *cache, const CacheRefs *c,
                        const int64_t *slots, const AttentionRows *rows, const LoraRefs *lora, int64_t T) {
    return decoder_layers(layers, final_norm, *m, x, h, cos, sin, cache, *c, slots, *rows, T, lora);
}
}
namespace {
template <typename T>
int decoder_layers_kv8(const LayerPtrs *layers, const T *final_norm, const ModelDims *m, T *x, T *h, const T *cos,
                       const T *sin, uint8_t *cache, const CacheRefs *c, const int64_t *slots,
                       const AttentionRows *rows, const LoraRefs *lora, int64_t T_, int64_t code) {
    return with_kv_format(code, [&](auto tag) {
        using K = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
        return decoder_layers(layers, final_norm, *m, x, h, cos, sin, reinterpret_cast<K *>(cache), *c, slots, *rows,
                              T_, lora);
    });
}
}  // namespace

extern "C" {
int decoder_layers_kv8_f32(const LayerPtrs *layers, const float *final_norm, const ModelDims *m, float *x, float *h,
                           const float *cos, const float *sin, uint8_t *cache, const CacheRefs *c,
                           const int64_t *slots, const AttentionRows *rows, const LoraRefs *lora, int64_t T,
                           int64_t code) {
    return decoder_layers_kv8(layers, final_norm, m, x, h, cos, sin, cache, c, slots, rows, lora, T, code);
}
int decoder_layers_kv8_bf16(const LayerPtrs *layers, const uint16_t *final_norm, const ModelDims *m, uint16_t *x,
                            uint16_t *h, const uint16_t *cos, const uint16_t *sin, uint8_t *cache, const CacheRefs *c,
                            const int64_t *slots, const AttentionRows *rows, const LoraRefs *lora, int64_t T,
                            int64_t code) {
    return decoder_layers_kv8(layers, final_norm, m, x, h, cos, sin, cache, c, slots, rows, lora, T, code);
}
}
