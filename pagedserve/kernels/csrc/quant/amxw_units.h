// AMX-BF16 with weights as A tiles: dequantizing units of weight rows to bf16.
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {
#if defined(PS_DOTS512)

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
#endif
}  // namespace
