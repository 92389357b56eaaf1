// A unit of an r8 layout (repack_r8.h: 8 weight rows interleaved) unpacked into 256-bit registers
// (AVX2, AVX-VNNI): its fp16 scales, the K-quants' 6-bit scale and minimum words, and the codes of a
// 32-element block as c[h][k], half h (rows 4 h .. 4 h + 3) and piece k (8 bytes of each of the 4
// rows: elements 8 k .. 8 k + 7, against the activations' k-th 8-byte broadcast); q6_k's instead as
// 8 rows a register (4 bytes of each: q6_codes_256). The decode dots
// (dot_r8_256.h, dot_k_r8_256.h) and the GEMM (gemm_r8_256.h) unpack through these same helpers:
// their results are equal bit for bit because each gets the same codes and scales.
// Lanes of a block's 8-row result are in the hadd's order (0, 1, 4, 5, 2, 3, 6, 7): the scales are
// permuted once to meet them (r8_order).
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {

// In every AVX2 build: the avx512vnni build's (PS_DOTS512) dense products keep their own kernels, but
// its mixture-of-experts layers run their experts over r8 layouts (moe/experts.h).
#if defined(__AVX2__)
// The hadd's row order of a block's 8 rows (its own inverse).
inline __m256i r8_order() { return _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7); }

inline __m256i r8_load(const uint8_t *p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)); }

// The 8 rows' fp16 scales at p as floats, in the hadd's order.
inline __m256 r8_f16x8(const uint8_t *p) {
    return _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))), r8_order());
}

// (x, shifted in its 16-bit lanes by s: left for s > 0) & mask: a bit field of each byte moved in place
inline __m256i move_bits(__m256i x, int s, int mask) {
    const __m256i v = s > 0 ? _mm256_slli_epi16(x, s) : s < 0 ? _mm256_srli_epi16(x, -s) : x;
    return _mm256_and_si256(v, _mm256_set1_epi8(char(mask)));
}

// Q5_0R8: the fifth bits into a half's codes c[0..3] (elements 0-7, 8-15, 16-23, 24-31 of its 4
// rows, 8 bytes a row): byte k of row l's qh (4 rows' qh at qh) holds bit i of element 8 k + i.
inline void q5_high(__m256i c[4], const uint8_t *qh) {
    const __m256i words = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i *>(qh)));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL), b16 = _mm256_set1_epi8(16);
    for (int k = 0; k < 4; k++) {
        // byte 8 l' + i of the result: qh byte k of row l' (byte 4 l' + k of each 128-bit lane's copy)
        const __m256i pick = _mm256_setr_epi8(k, k, k, k, k, k, k, k, 4 + k, 4 + k, 4 + k, 4 + k, 4 + k, 4 + k, 4 + k, 4 + k,
                                              8 + k, 8 + k, 8 + k, 8 + k, 8 + k, 8 + k, 8 + k, 8 + k, 12 + k, 12 + k, 12 + k,
                                              12 + k, 12 + k, 12 + k, 12 + k, 12 + k);
        const __m256i b = _mm256_shuffle_epi8(words, pick);
        c[k] = _mm256_or_si256(c[k], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(b, bit), bit), b16));
    }
}

// The nibbles of a unit's two 64-byte code vectors at q (q4_0r8's order, MXFP4R8's too): per half,
// vector 0's low nibbles, vector 1's low, vector 0's high, vector 1's high.
inline void r8_nibbles(const uint8_t *q, __m256i c[2][4]) {
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int h = 0; h < 2; h++) {
        const __m256i v0 = r8_load(q + 32 * h), v1 = r8_load(q + 64 + 32 * h);
        c[h][0] = _mm256_and_si256(v0, m4);
        c[h][1] = _mm256_and_si256(v1, m4);
        c[h][2] = _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4);
        c[h][3] = _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4);
    }
}

// Q4_0R8, Q4_1R8, Q5_0R8: unit u's codes (q5_0 with its fifth bits; offsets not taken off), in
// r8_nibbles' order.
template <int QT>
inline void q4_unit_codes(const uint8_t *u, __m256i c[2][4]) {
    r8_nibbles(u + r8_codes_at(QT), c);
    if constexpr (QT == Q5_0R8)
        for (int h = 0; h < 2; h++) q5_high(c[h], u + 16 + 16 * h);
}

// Q4_KR8, Q5_KR8: the 12 scale bytes of each row as 3 words (lanes in the hadd's order, or with
// Order false the rows' order), k_scales on 8 rows at once: byte b of sc[i] (mn[i]) is sub-block
// 4 i + b's 6-bit scale (minimum).
template <bool Order = true>
inline void k_scale_words(const uint8_t *u, __m256i sc[2], __m256i mn[2]) {
    auto word = [&](int w) {
        const __m256i v = r8_load(u + 32 + 32 * w);
        return Order ? _mm256_permutevar8x32_epi32(v, r8_order()) : v;
    };
    const __m256i w0 = word(0), w1 = word(1), w2 = word(2);
    const __m256i m4 = _mm256_set1_epi8(15), m6 = _mm256_set1_epi8(63), m48 = _mm256_set1_epi8(48);
    sc[0] = _mm256_and_si256(w0, m6);
    sc[1] = _mm256_or_si256(_mm256_and_si256(w2, m4), _mm256_and_si256(_mm256_srli_epi32(w0, 2), m48));
    mn[0] = _mm256_and_si256(w1, m6);
    mn[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(w2, 4), m4), _mm256_and_si256(_mm256_srli_epi32(w1, 2), m48));
}

// Q4_KR8, Q5_KR8 against super-block activations (Act::qk): a unit's scales laid out to meet the
// integers. hs[i][h]: sc[i]'s dwords of half h's rows 4 h .. 4 h + 3 in both 128-bit lanes (so one
// shuffle per sub-block and half gives its 16-bit scale lanes, k_lanes); mp[k]: the minimums of
// sub-blocks 2 k, 2 k + 1 as two int16 per dword, rows in the hadd's order (k_min_sum).
// so: sc's words in the hadd's row order (k_pair_lanes, q4_k's one-register form).
struct KSuper {
    __m256i hs[2][2], mp[4], so[2];
};

inline void k_super_scales(const uint8_t *u, KSuper &ks) {
    __m256i sc[2], mn[2], sco[2], mno[2];
    k_scale_words<false>(u, sc, mn);
    k_scale_words<true>(u, sco, mno);
    for (int i = 0; i < 2; i++)
        for (int h = 0; h < 2; h++)
            ks.hs[i][h] = _mm256_permutevar8x32_epi32(sc[i], _mm256_setr_epi32(4 * h, 4 * h + 1, 4 * h + 2, 4 * h + 3, 4 * h,
                                                                                4 * h + 1, 4 * h + 2, 4 * h + 3));
    for (int k = 0; k < 4; k++) {
        const char b = char(2 * (k % 2)), z = char(0x80);
        const __m256i pick = _mm256_setr_epi8(b, z, b + 1, z, b + 4, z, b + 5, z, b + 8, z, b + 9, z, b + 12, z, b + 13, z,
                                              b, z, b + 1, z, b + 4, z, b + 5, z, b + 8, z, b + 9, z, b + 12, z, b + 13, z);
        ks.mp[k] = _mm256_shuffle_epi8(mno[k / 2], pick);
    }
    ks.so[0] = sco[0];
    ks.so[1] = sco[1];
}

// The 8 bytes at p in each 64-bit lane (one broadcast load).
inline __m256i bcast8(const int8_t *p) {
    return _mm256_castpd_si256(_mm256_broadcast_sd(reinterpret_cast<const double *>(p)));
}

// The 4 bytes at p in each 32-bit lane (one broadcast load).
inline __m256i bcast4(const int8_t *p) { return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float *>(p))); }

// Sub-block j's 6-bit scales as both int16 halves of each dword, rows in the hadd's order (a madd
// against k_dot8_q4's 16-bit sums).
inline __m256i k_pair_lanes(const KSuper &ks, int j) {
    const char b = char(j % 4), z = char(0x80);
    const __m256i pick = _mm256_setr_epi8(b, z, b, z, b + 4, z, b + 4, z, b + 8, z, b + 8, z, b + 12, z, b + 12, z,
                                          b, z, b, z, b + 4, z, b + 4, z, b + 8, z, b + 8, z, b + 12, z, b + 12, z);
    return _mm256_shuffle_epi8(ks.so[j / 4], pick);
}

// q4_k (codes <= 15): a sub-block's 8 rows' dots times their scales L (k_pair_lanes) in one
// register, rows in the hadd's order. x: the sub-block's 32 activation codes; each 8-byte broadcast
// is used by both halves at once (one register live, not four: no code register spilled where the
// caller keeps c in registers). The sums are exact, so any order gives them.
// AVX2: each half's four products sum in 16 bits (<= 4 * 2 * 15 * 127), a 16-bit hadd adds the two
// lanes of a row pair (<= 30480 < 32768), one madd by the scales (each dword <= 2 * 30480 * 63).
// vpdpbusd: each half's dwords sum a row's 16 products (<= 16 * 15 * 127 = 30480), so a pack to 16
// bits keeps them (no saturation) in the hadd's order: the madd by the scales adds a row's two
// (Zen 4: 8 dpbusd + pack + madd a sub-block, against 8 maddubs + 6 adds + a 2-cycle hadd + madd).
// High16 (vpdpbusd): the codes are 16 times the nibbles (k4_high16_256): each dword 16 times the sum,
// exact (<= 16 * 30480 < 2^31), shifted back (arithmetic: exact for multiples of 16) before the pack.
template <bool High16 = false>
inline __m256i k_dot8_q4(const __m256i c[2][4], const int8_t *x, __m256i L) {
    __m256i h0 = _mm256_setzero_si256(), h1 = _mm256_setzero_si256();
    for (int k = 0; k < 4; k++) {
        const __m256i xb = bcast8(x + 8 * k);
#if defined(PS_VNNI256)
        h0 = dpbusd256(h0, c[0][k], xb);
        h1 = dpbusd256(h1, c[1][k], xb);
#else
        h0 = _mm256_add_epi16(h0, _mm256_maddubs_epi16(c[0][k], xb));
        h1 = _mm256_add_epi16(h1, _mm256_maddubs_epi16(c[1][k], xb));
#endif
    }
#if defined(PS_VNNI256)
    if constexpr (High16) {      // (maddubs' 16-bit sums could not hold them: kHigh16 false there)
        h0 = _mm256_srai_epi32(h0, 4);
        h1 = _mm256_srai_epi32(h1, 4);
    }
    return _mm256_madd_epi16(_mm256_packs_epi32(h0, h1), L);
#else
    return _mm256_madd_epi16(_mm256_hadd_epi16(h0, h1), L);
#endif
}

// Sub-block j's 6-bit scales as the int16 lanes of half h's maddubs sums (row 4 h + r's 4 lanes at
// 4 r .. 4 r + 3: the first two rows in the low 128 bits, the other two in the high).
inline __m256i k_lanes(const KSuper &ks, int j, int h) {
    const char b = char(j % 4), z = char(0x80);
    const __m256i pick = _mm256_setr_epi8(b, z, b, z, b, z, b, z, b + 4, z, b + 4, z, b + 4, z, b + 4, z,
                                          b + 8, z, b + 8, z, b + 8, z, b + 8, z, b + 12, z, b + 12, z, b + 12, z, b + 12, z);
    return _mm256_shuffle_epi8(ks.hs[j / 4][h], pick);
}

// Half h's codes c (<= 31) against the activations' broadcasts xb times the sub-block's scale lanes:
// the four products' 16-bit sums fit (<= 4 * 2 * 31 * 127 = 31496), then madd with the scales
// (<= 63): each dword <= 2 * 31496 * 63 (rows: two dwords each).
inline __m256i k_dot_half(const __m256i c[4], const __m256i xb[4], __m256i lanes) {
    const __m256i s = _mm256_add_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(c[0], xb[0]), _mm256_maddubs_epi16(c[1], xb[1])),
                                       _mm256_add_epi16(_mm256_maddubs_epi16(c[2], xb[2]), _mm256_maddubs_epi16(c[3], xb[3])));
    return _mm256_madd_epi16(s, lanes);
}

// The 8 rows' (the hadd's order) sum over the sub-blocks j of mn_j times the sum of the 32 codes of
// sub-block j (bs: the super-block's 16 sums of 16): |sum| <= 8 * 63 * 32 * 127, in int32.
inline __m256i k_min_sum(const KSuper &ks, const int16_t *bs) {
    const __m256i b32 = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(bs)), _mm256_set1_epi16(1));
    const __m256i pairs = _mm256_packs_epi32(b32, b32);      // (|32-sum| <= 4064: no saturation) words j of each lane twice
    __m256i m = _mm256_setzero_si256();
    for (int k = 0; k < 4; k++) {
        const int at = k < 2 ? k : k + 2;                     // dword (bs_2k, bs_2k+1)
        m = _mm256_add_epi32(m, _mm256_madd_epi16(ks.mp[k], _mm256_permutevar8x32_epi32(pairs, _mm256_set1_epi32(at))));
    }
    return m;
}

// D times sub-block j's 6-bit scale (or minimum) of the words w (k_scale_words' sc or mn).
inline __m256 k_sub_scale(__m256 D, const __m256i w[2], int j) {
    const __m256i v = _mm256_and_si256(_mm256_srl_epi32(w[j / 4], _mm_cvtsi32_si128(8 * (j % 4))), _mm256_set1_epi32(255));
    return _mm256_mul_ps(D, _mm256_cvtepi32_ps(v));
}

// Q4_KR8, Q5_KR8: the codes of sub-block j (2 p + i: vectors 4 p .. 4 p + 3 of qs, low nibbles for
// i = 0, high for 1; q5_k's fifth bits from qh: bit j of qh[8 k + i']).
template <int QT>
inline void k_codes_256(const uint8_t *u, int j, __m256i c[2][4]) {
    constexpr int QS = QT == Q4_KR8 ? 128 : 384;     // the qs vectors (q5_k: after qh's 4)
    const int p = j / 2, i = j % 2;
    const __m256i m4 = _mm256_set1_epi8(15);
#pragma GCC unroll 8
    for (int h = 0; h < 2; h++)
#pragma GCC unroll 8
        for (int k = 0; k < 4; k++) {
            const __m256i v = r8_load(u + QS + 64 * (4 * p + k) + 32 * h);
            c[h][k] = _mm256_and_si256(i == 0 ? v : _mm256_srli_epi16(v, 4), m4);
            if constexpr (QT == Q5_KR8) c[h][k] = _mm256_or_si256(c[h][k], move_bits(r8_load(u + 128 + 64 * k + 32 * h), 4 - j, 16));
        }
}

// Whether q4_kr8's decode dots take sub-block 2 p + 1's codes as 16 times its nibbles (vpdpbusd's
// 32-bit sums hold them; maddubs' 16-bit ones would not).
#if defined(PS_VNNI256)
constexpr bool kHigh16 = true;
#else
constexpr bool kHigh16 = false;
#endif

// Q4_KR8: 16 times the codes of sub-block 2 p + 1 (the high nibbles of vectors 4 p .. 4 p + 3 of qs, in
// place: one and a vector, no shift), for k_dot8_q4<true>.
inline void k4_high16_256(const uint8_t *u, int p, __m256i c[2][4]) {
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 4; k++) c[h][k] = _mm256_and_si256(r8_load(u + 128 + 64 * (4 * p + k) + 32 * h), _mm256_set1_epi8(char(0xF0)));
}

// Q6_KR8 (repack_r8.h's fields): the 16 scales in 1-byte pieces (byte 8 i + l: row l's sc[i]), the 8
// fp16 d at 128, then from 144 a chunk of 384 bytes per (n, b) < (2, 2): its qh, ql (r % 2 = 0) and ql
// (r % 2 = 1) vectors, 4 each, in 4-byte pieces (a vector holds 4 bytes of each of the 8 rows, row l's
// in dword l): the unit in the order the dots read it, one chunk after another (a stream, not a
// jump back and forth between the ql and qh fields: 0.65-0.88x as fast from memory, measured).
constexpr int kQ6D = 128, kQ6Chunks = 144, kQ6Chunk = 384;

// Q6_KR8: the unsigned codes q (0..63) of the 16-element group i (sub-block j = i / 2, n = j / 4,
// r = j % 4, half b = i % 2) as c[m], elements 4 m .. 4 m + 3 of the group: chunk (n, b)'s qh
// vector m (bits 2 r, 2 r + 1) and its ql vector m of r % 2 (nibble r / 2).
inline void q6_codes_256(const uint8_t *u, int i, __m256i c[4]) {
    const int j = i / 2, n = j / 4, r = j % 4, b = i % 2;
    const uint8_t *chunk = u + kQ6Chunks + kQ6Chunk * (2 * n + b);
    const __m256i m4 = _mm256_set1_epi8(15);
#pragma GCC unroll 4
    for (int m = 0; m < 4; m++) {
        const __m256i qh = r8_load(chunk + 32 * m);
        const __m256i ql = r8_load(chunk + 128 * (1 + r % 2) + 32 * m);
        const __m256i lo = r < 2 ? _mm256_and_si256(ql, m4) : _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4);
        c[m] = _mm256_or_si256(lo, move_bits(qh, 4 - 2 * r, 0x30));
    }
}

// Q6_KR8: group i's 8 scale bytes (row l's at l).
inline __m128i q6_scale_bytes(const uint8_t *u, int i) {
    return _mm_loadl_epi64(reinterpret_cast<const __m128i *>(u + 8 * i));
}

// Q6_KR8: group i's scales as int32, row l's in dword l (a vpmulld against a row's dword sums).
inline __m256i q6_scales32(const uint8_t *u, int i) { return _mm256_cvtepi8_epi32(q6_scale_bytes(u, i)); }

// Q6_KR8: group i's scales as both int16 halves of dword l (a madd against a row's two 16-bit sums).
inline __m256i q6_scales16(const uint8_t *u, int i) {
    const __m128i s = q6_scale_bytes(u, i);
    return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s, s));
}

// Q6_KR8: sub-block j's scale pair of each row (sc[2 j], sc[2 j + 1] of row l as the int16 halves of
// dword l: a madd against the 16-sums bsk_2j, bsk_2j+1 as one broadcast dword).
inline __m256i q6_scale_pairs(const uint8_t *u, int j) {
    return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(q6_scale_bytes(u, 2 * j), q6_scale_bytes(u, 2 * j + 1)));
}

#endif

}  // namespace
