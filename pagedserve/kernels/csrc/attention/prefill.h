// Prefill attention: tiles of queries against tiles of keys (paged_prefill).
// Part of cpu_kernels (csrc/cpu_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

// ---- prefill attention: tiles of queries against tiles of keys -------------------------------
// The decode kernel serves prefill tokens one query at a time, each re-reading its whole
// prefix: at a 2000-token prompt that is half of the prefill's time. Here the queries of one
// sequence's chunk (up to max(16 tokens, kQueryRows rows) x the G heads of a KV head) meet 32
// keys at a time as two
// small GEMMs on the GEMM tiles above: scores = Q K^T (K packed like a weight), then
// O += P V (V packed likewise), with an online softmax between (as flash attention).
// bf16 with AVX512-BF16: bf16 dot products, P rounded to bf16 for the second product as flash
// attention does. Otherwise (AVX2, AVX-512, either storage type): float32 FMAs over `Vec`,
// keys and values converted to float32 as they are packed.
#ifdef __AVX2__
namespace {
constexpr int64_t kQueryTokens = 16, kKeyTile = 32;
// Both paths meet up to kQueryRows query rows (tokens x G) with each key tile: a short chunk
// after a long cached prefix (a prefix-cache or disk-tier hit's suffix) then packs each cached
// key and value tile once for the whole chunk instead of once per 16 tokens (the packing and
// softmax, not the products, were most of such a chunk's attention; with bf16 dots too: a
// 33-token turn after a 2k-token history cost 50-60 ms more than a 32-token one at 16 tokens an
// item, three items against two). 64 rows: the item's buffers (q, the sums, P V) stay in L2.
constexpr int64_t kQueryRows = 64;

// Query tokens per item for a chunk of n tokens at group size G: equal parts of at most
// max(16, kQueryRows / G) tokens.
inline int64_t query_tile(int64_t n, int64_t G) {
    const int64_t cap = std::max<int64_t>(kQueryTokens, kQueryRows / G);
    const int64_t parts = (n + cap - 1) / cap;
    return (n + parts - 1) / parts;
}

// The first key a tile of queries from position `pos` on reads: 0, or with a sliding window the
// first query's window's first key (the table's blocks before it are -1, never read).
inline int64_t first_key(int64_t pos, int64_t window) {
    return window > 0 ? std::max<int64_t>(0, pos + 1 - window) : 0;
}
// The keys t0 + lo .. t0 + valid of a tile of nk keys from t0 that the query at `pos` reads.
struct KeySpan { int64_t lo, valid; };
inline KeySpan key_span(int64_t pos, int64_t t0, int64_t nk, int64_t window) {
    const int64_t lo = window > 0 ? std::max<int64_t>(0, pos + 1 - window - t0) : 0;
    return {std::min(lo, nk), std::min(nk, pos + 1 - t0)};
}

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
// token j sees the first base + j + 1 keys (with a window, only the last `window` of them).
void prefill_item(const uint16_t *q, int64_t q_stride, const uint16_t *kc, const uint16_t *vc, const int64_t *table,
                  int64_t base, int64_t j0, int64_t nq, int64_t h, int64_t G, int64_t D, int64_t B, Layout L,
                  float scale, uint16_t *out, int64_t out_stride, int64_t window, const ScoreMods &mods) {
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
    for (int64_t t0 = first_key(base + j0, window); t0 < kend; t0 += kKeyTile) {
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
        // Online softmax per row; masked keys (past the row's causal end, or before its window)
        // get weight 0.
        for (int64_t r = 0; r < R; r++) {
            const KeySpan k = key_span(base + j0 + r / G, t0, nk, window);
            uint16_t *pr = &pbuf[r * kKeyTile];
            if (k.valid <= k.lo) {
                std::memset(pr, 0, kKeyTile * sizeof(uint16_t));
                continue;
            }
            const __mmask32 live = (k.valid >= 32 ? 0xFFFFFFFFu : ((1u << k.valid) - 1)) & ~((1u << k.lo) - 1);
            __m512 r0 = _mm512_mul_ps(_mm512_loadu_ps(&sbuf[r * kKeyTile]), _mm512_set1_ps(scale));
            __m512 r1 = _mm512_mul_ps(_mm512_loadu_ps(&sbuf[r * kKeyTile + 16]), _mm512_set1_ps(scale));
            if (mods.softcap != 0.f) r0 = softcap16(r0, mods.softcap), r1 = softcap16(r1, mods.softcap);
            const __m512 s0 = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), static_cast<__mmask16>(live), r0);
            const __m512 s1 = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), static_cast<__mmask16>(live >> 16), r1);
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
        const __m512 inv = _mm512_set1_ps(1.f / with_sink(lrow[r], mrow[r], mods, h * G + r % G));
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
                      T *out, int64_t out_stride, int64_t window, const ScoreMods &mods) {
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
    for (int64_t t0 = first_key(base + j0, window); t0 < kend; t0 += kKeyTile) {
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
        // Online softmax per row; masked keys (past the row's causal end, or before its window)
        // get weight 0.
        for (int64_t r = 0; r < R; r++) {
            const KeySpan k = key_span(base + j0 + r / G, t0, nk, window);
            float *s = &sbuf[r * kKeyTile];
            if (k.valid <= k.lo) {
                std::memset(s, 0, kKeyTile * sizeof(float));
                continue;
            }
            if constexpr (kScaled<K>)
                for (int64_t c = 0; c < k.valid; c++) s[c] *= ksc[c];
            if (mods.softcap != 0.f) softcap_scores<V>(s, kKeyTile, mods.softcap);
            for (int64_t c = 0; c < k.lo; c++) s[c] = -INFINITY;
            for (int64_t c = k.valid; c < kKeyTile; c++) s[c] = -INFINITY;
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
        const Reg inv = V::set1(1.f / with_sink(lrow[r], mrow[r], mods, h * G + r % G));
        for (int64_t d = 0; d < D; d += W) V::store(dst + d, V::mul(V::load(&obuf[r * D + d]), inv));
    }
}

// q, out: the rows of the prefill tokens [T, Hq, D] (q with row stride q_stride, out
// contiguous); sequence i's chunk is rows query_start[i]..query_start[i+1] (counted from
// query_start[0]) and ends at context length seq_lens[i]. Returns 1 for shapes it does not
// take (the caller then runs the decode kernel per token). window: each query reads its last
// `window` positions only (0: all); mods: the layer's soft-capping and sinks.
template <typename T, typename K = T>
int paged_prefill(const T *q, int64_t q_stride, const K *kc, const K *vc, const int64_t *tables, int64_t table_stride,
                  const int64_t *seq_lens, const int64_t *query_start, int64_t S, T *out, int64_t Hq, int64_t Hkv,
                  int64_t D, int64_t B, Layout L, float scale, int64_t window = 0,
                  const ScoreMods &mods = {0.f, nullptr}) {
#ifdef __AVX512BF16__
    constexpr bool kBf16Dots = std::is_same_v<T, uint16_t> && std::is_same_v<K, uint16_t>;
#else
    constexpr bool kBf16Dots = false;
#endif
    if (D % (kBf16Dots ? 32 : 16) || D > kMaxDim || Hq % Hkv || Hq / Hkv > kMaxGroup) return 1;
    const int64_t G = Hq / Hkv, q0 = query_start[0];
    struct Item { int64_t seq, j0, nq, h; };
    std::vector<Item> items;
    for (int64_t i = 0; i < S; i++) {
        const int64_t n = query_start[i + 1] - query_start[i];
        const int64_t tile = query_tile(n, G);
        for (int64_t j0 = 0; j0 < n; j0 += tile)
            for (int64_t h = 0; h < Hkv; h++) items.push_back({i, j0, std::min(tile, n - j0), h});
    }
#pragma omp parallel for schedule(dynamic, 1)
    for (size_t k = 0; k < items.size(); k++) {
        const Item &it = items[k];
        const int64_t n = query_start[it.seq + 1] - query_start[it.seq];
        const int64_t row = query_start[it.seq] - q0;
        const auto item = [&](auto fn) {
            fn(q + row * q_stride, q_stride, kc, vc, tables + it.seq * table_stride, seq_lens[it.seq] - n, it.j0,
               it.nq, it.h, G, D, B, L, scale, out + row * Hq * D, Hq * D, window, mods);
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
