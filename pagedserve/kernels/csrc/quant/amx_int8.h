// AMX-INT8 dots for many activation rows (avx512vnni build).
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

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
#if defined(PS_DOTS512)
struct AmxInt8 {
    bool enabled = false;
    int64_t min_rows = 1 << 30;
};
AmxInt8 g_amx8;

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
        transpose16_epi32(r);                    // r[t]: activation row t's sums for the 16 weight rows
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
#endif
}  // namespace
