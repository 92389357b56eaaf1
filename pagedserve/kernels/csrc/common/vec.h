// Float32 vectors of each build behind one interface: VPortable, V8 (AVX2), V16 (AVX-512), Vec.
// Part of cpu_kernels (csrc/cpu_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {

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

// Soft-capping of scores s[0..n) in place, n a multiple of V::W: cap * tanh(s / cap), as
// tanh(x) = 1 - 2 / (e^(2x) + 1) (e^2x overflowing to +inf gives 1; underflowing to 0, -1).
template <class V>
void softcap_scores(float *s, int64_t n, float cap) {
    using R = typename V::reg;
    const R k = V::set1(2.f / cap), one = V::set1(1.f), two = V::set1(2.f), c = V::set1(cap);
    for (int64_t t = 0; t < n; t += V::W) {
        const R e = V::exp_any(V::mul(V::load(s + t), k));
        V::store(s + t, V::mul(c, V::sub(one, V::div(two, V::add(e, one)))));
    }
}

}  // namespace
