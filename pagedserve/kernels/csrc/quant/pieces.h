// AVX2 integer dots and each type's blocks decoded into 32-element pieces (decode<QT>, Acc).
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {

// ---- the dot products of one weight row with NT activation rows ---------------------------------
// Each type's decoder yields, per 32 elements j of the row: the codes, the float A (scale) and
// C (minimum term, or 0), and for q6_k two integer scales of 16 elements each.
#if defined(__AVX2__)
__m256i dot_us(__m256i u, __m256i s) {       // 8 int32 lanes, each the sum of 4 adjacent u * s
#if defined(PS_VNNI256)     // (the avx512vnni build too: its EVEX form)
    return dpbusd256(_mm256_setzero_si256(), u, s);
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
#if defined(PS_DOTS512)
    __m512 w[NT];        // sums of the 512-bit pairs
    __m128 m2[NT];       // minimum terms of pairs of 32-element blocks
    __m256 m8[NT];       // minimum terms of super-blocks' 8 sub-blocks
#endif
    Acc() {
        for (int t = 0; t < NT; t++) {
            v[t] = _mm256_setzero_ps();
            s[t] = 0.f;
#if defined(PS_DOTS512)
            w[t] = _mm512_setzero_ps();
            m2[t] = _mm_setzero_ps();
            m8[t] = _mm256_setzero_ps();
#endif
        }
    }
    float total(int t) const {
#if defined(PS_DOTS512)
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
#endif
}  // namespace
