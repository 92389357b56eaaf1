// Decode attention on AVX-512: loads, exp, transposes, scores and the partition kernel.
// Part of cpu_kernels (csrc/cpu_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {

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

// Soft-capping of 16 scores: cap * tanh(s / cap), tanh(x) = 1 - 2 / (e^(2x) + 1) (as softcap_scores).
inline __m512 softcap16(__m512 s, float cap) {
    const __m512 one = _mm512_set1_ps(1.f), e = exp16_any(_mm512_mul_ps(s, _mm512_set1_ps(2.f / cap)));
    return _mm512_mul_ps(_mm512_set1_ps(cap), _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one))));
}

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
void attend_partition_avx512(const T *q, float scale, float softcap, const K *kc, const K *vc, const int64_t *table,
                             int64_t t0, int64_t t1, int64_t h, Layout L, int64_t B, int64_t G, float *p) {
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
        if (softcap != 0.f)
            for (int64_t t = 0; t < padded; t += 16) _mm512_storeu_ps(sg + t, softcap16(_mm512_loadu_ps(sg + t), softcap));
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
}  // namespace
