// The 32-element types' dots on AVX-512 VNNI: 64 elements a dot (pair32, group16).
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {
#if defined(__AVX2__)

#if defined(PS_DOTS512)
// ---- AVX-512 VNNI: 64 elements (two pieces) per dot product, scales two or eight at a time ----
// The integer dot of 64 unsigned codes with 64 activations, as floats (16 lanes of 4).
inline __m512 dot64(__m512i codes, const int8_t *q) {
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, _mm512_loadu_si512(q)));
}

// Two 32-element blocks (blocks u, u + 1 of the row, at b0) against activation rows t0 ..:
// codes in the activations' order [0, 64), unsigned; the offsets of q4_0, q5_0 as C * ds (C =
// -offset * A) whatever the rows a pass, so that a row's arithmetic never depends on how many
// share the call (batch invariance, issue 51); q8_0's for one or two rows (decode) in the integers
// by a dot started from Act::start, for more by signed codes (|w| times q with w's sign): the same
// int32 dots either way (exact), so the same bits; q6_k's always from Act::start. The two scales
// A times the two dx in one 128-bit multiply, spread to the dot's lanes; the minimums (q4_1, q5_1)
// as C * ds, one form for any number of rows.
template <int QT, int NT>
constexpr bool kStarts = kOffset[QT] != 0 && (QT == Q6_K || (QT == Q8_0 && NT <= 2));

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
// per pair on its two scales). One chain of sums per row whatever NT and R, so that a row's result
// never depends on how many activation or weight rows share the pass (batch invariance, issue 51;
// at T = 1 the R weight rows' chains run side by side). R weight rows (b0, b0 + ldw, ..: acc[r])
// share each activation load.
template <int QT, int NT, int R = 1>
inline void group16(Acc<NT> *acc, const Act &a, const int8_t *q0, const float *d0, const float *ds0, const int32_t *st0,
                    const uint8_t *b0, int64_t ldw = 0) {
    constexpr int B = int(kBytes[QT]);
    const __m512i at = _mm512_setr_epi32(0, B, 2 * B, 3 * B, 4 * B, 5 * B, 6 * B, 7 * B, 8 * B, 9 * B, 10 * B, 11 * B,
                                         12 * B, 13 * B, 14 * B, 15 * B);
    constexpr bool kOffsetTerm = (QT == Q4_0 || QT == Q5_0) && !kStarts<QT, NT>;
    constexpr bool kMinTerm = QT == Q4_1 || QT == Q5_1 || kOffsetTerm;
    // q4_1: each block's high nibbles taken in place (16 times the code: one AND, no masked shift),
    // their lanes scaled by S / 16 (exact: a power of two), the same products
    constexpr bool kHigh16 = QT == Q4_1;
    __m512 S[R][NT], S16[R][NT], sum[R][NT];
    for (int r = 0; r < R; r++) {
        const __m512i dm = _mm512_i32gather_epi32(at, b0 + r * ldw, 1);   // each block's first 4 bytes: d (and m)
        const __m512 A = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
        __m512 C = _mm512_setzero_ps();
        if constexpr (QT == Q4_1 || QT == Q5_1) C = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
        if constexpr (kOffsetTerm) C = _mm512_mul_ps(A, _mm512_set1_ps(-float(kOffset[QT])));
        for (int t = 0; t < NT; t++) {
            S[r][t] = _mm512_mul_ps(A, _mm512_loadu_ps(d0 + t * a.nb));
            if constexpr (kHigh16) S16[r][t] = _mm512_mul_ps(S[r][t], _mm512_set1_ps(1.f / 16));
            sum[r][t] = kMinTerm ? _mm512_fmadd_ps(C, _mm512_loadu_ps(ds0 + t * a.nb), acc[r].w[t]) : acc[r].w[t];
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
                sum[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, sum[r][t]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++) acc[r].w[t] = sum[r][t];
}

// One super-block: q0, d0, ds0 point at its first 32 activations of row t0.
#endif
#endif
}  // namespace
