// Activations quantized into 8-bit blocks of 32 (Act), and for the super-block r8 kernels on the
// 256-bit and scalar builds also in blocks of 256 (Act::qk, dk, bsk: one scale per super-block).
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {

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
    // 256-bit and scalar builds, where a part is a super-block r8 type (reads_super; else null): the
    // same rows with one scale per 256 elements (quantize_super), so those kernels apply the
    // sub-block scales in integers and convert once per super-block.
    const int8_t *qk = nullptr;      // [T][K]      codes
    const float *dk = nullptr;       // [T][K/256]  d = amax(256 elements) / 127
    const int16_t *bsk = nullptr;    // [T][K/16]   the sum of each 16 consecutive codes of qk
    bool blocks32 = true;            // whether a part reads q, d, ds (false: every part reads qk)
};

// Whether layout qt's kernels read Act::qk / dk / bsk (the r8 layouts' kernels: 256-bit, or the
// scalar reference wherever no vector kernel has the layout; the AVX-512 build's file-layout K-quant
// kernels keep the blocks of 32).
constexpr bool reads_super(int qt) { return qt == Q4_KR8 || qt == Q5_KR8 || qt == Q6_KR8; }

constexpr int kOffset[kNumTypes] = {8, 0, 16, 0, 128, 0, 0, 32, 0, 0};     // what start[type] subtracts

#if defined(__AVX2__)
// The largest of mag's 8 lanes (each |x|: exact in any order).
inline float max8(__m256 mag) {
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mag), _mm256_extractf128_ps(mag, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    return _mm_cvtss_f32(m4);
}

// 32 codes (4 x 8 int32 lanes, |code| <= 127: packing's saturation never acts) as int8 at q, in order.
inline void store_codes32(const __m256i i[4], int8_t *q) {
    // lanes (0-3 | 4-7) of i0, i1, i2, i3 per 128 bits after the packs; the permute puts them in order
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(q),
                        _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// The sum of s8's 8 int32 lanes.
inline int sum8(__m256i s8) {
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    return _mm_cvtsi128_si32(s4);
}
#endif

// One block: as quant.py's quantize_activations (d = amax / 127; q = x * (1/d), half to even).
void quantize_block(const float *x, int8_t *q, float *d_out, float *ds_out) {
#if defined(__AVX2__)
    // In registers: the maximum is exact in any order, each q the same conversion as the scalar
    // loop's (|x * (1/d)| <= 127, so packing's saturation never acts), the sum an integer.
    const __m256 v[4] = {_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8), _mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24)};
    const __m256 sign = _mm256_set1_ps(-0.f);
    const float amax = max8(_mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                          _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]))));
    const float d = amax / 127.f, inv = d != 0.f ? 1.f / d : 0.f;
    const __m256 s = _mm256_set1_ps(inv);
    __m256i i[4];
    for (int k = 0; k < 4; k++) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], s));
    store_codes32(i, q);
    const int sum = sum8(_mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3])));
#else
    float amax = 0.f;
    for (int i = 0; i < 32; i++) amax = std::max(amax, std::fabs(x[i]));
    const float d = amax / 127.f, inv = d != 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int i = 0; i < 32; i++) {
        const int v = int(std::nearbyint(x[i] * inv));
        q[i] = int8_t(v);
        sum += v;
    }
#endif
    *d_out = d;
    *ds_out = d * float(sum);
}

// One super-block of 256: d = amax / 127, q = x * (1 / d) half to even (quantize_block's float
// operations, so the AVX2 and scalar forms agree bit for bit), bs[i] = the sum of q[16 i .. 16 i + 15].
void quantize_super(const float *x, int8_t *q, float *d_out, int16_t *bs) {
#if defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 mag = _mm256_setzero_ps();
    for (int k = 0; k < 32; k++) mag = _mm256_max_ps(mag, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * k)));
    const float amax = max8(mag);
    const float d = amax / 127.f, inv = d != 0.f ? 1.f / d : 0.f;
    const __m256 s = _mm256_set1_ps(inv);
    for (int c = 0; c < 8; c++) {        // 32 elements at a time, as quantize_block
        __m256i i[4];
        for (int k = 0; k < 4; k++) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 32 * c + 8 * k), s));
        store_codes32(i, q + 32 * c);
        for (int h = 0; h < 2; h++) bs[2 * c + h] = int16_t(sum8(_mm256_add_epi32(i[2 * h], i[2 * h + 1])));
    }
#else
    float amax = 0.f;
    for (int i = 0; i < 256; i++) amax = std::max(amax, std::fabs(x[i]));
    const float d = amax / 127.f, inv = d != 0.f ? 1.f / d : 0.f;
    for (int b = 0; b < 16; b++) {
        int sum = 0;                    // |sum| <= 16 * 127
        for (int i = 16 * b; i < 16 * b + 16; i++) {
            const int v = int(std::nearbyint(x[i] * inv));
            q[i] = int8_t(v);
            sum += v;
        }
        bs[b] = int16_t(sum);
    }
#endif
    *d_out = d;
}

// The N floats of activation row t from element `at`: in x itself (float32), or converted into buf (bf16).
template <int N>
const float *row_floats(const void *x, int64_t ldx, bool bf16, int64_t t, int64_t at, float buf[N]) {
    if (!bf16) return static_cast<const float *>(x) + t * ldx + at;
    const uint16_t *xr = static_cast<const uint16_t *>(x) + t * ldx + at;
    for (int i = 0; i < N; i++) buf[i] = bf16_to_f32(xr[i]);
    return buf;
}

// Super-block s of activation row t into a's qk, dk, bsk.
void quantize_super_one(const void *x, int64_t ldx, bool bf16, int64_t t, int64_t s, const Act &a) {
    float buf[256];
    const float *src = row_floats<256>(x, ldx, bf16, t, s * 256, buf);
    quantize_super(src, const_cast<int8_t *>(a.qk) + t * a.K + 256 * s, const_cast<float *>(a.dk) + t * (a.K / 256) + s,
                   const_cast<int16_t *>(a.bsk) + t * (a.K / 16) + 16 * s);
}

// Block j of activation row t.
void quantize_one(const void *x, int64_t ldx, bool bf16, int64_t t, int64_t j, int64_t K, int8_t *q, float *d,
                  float *ds) {
    const int64_t nb = K / 32;
    float buf[32];
    const float *src = row_floats<32>(x, ldx, bf16, t, j * 32, buf);
    quantize_block(src, q + t * K + j * 32, d + t * nb + j, ds + t * nb + j);
}

#if defined(PS_DOTS512)
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
}  // namespace
