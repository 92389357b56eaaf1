// Weights dequantized into the packed GEMM's tiles (bf16 or float32).
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {
#if defined(__AVX512F__)
// 16 floats -> their bf16 bits in the low halves of 32-bit lanes (to_bf16's rounding).
inline __m512i bf16_bits(__m512 x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)))),
        16);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
}

#endif

// 16 rows' floats (f: [16][ld], columns [0, c)) into packed columns from k0 of one tile of 16
// output rows (tile: [K/2][16][2] bf16, or [K][16] float32).
void pack16(const float *f, int64_t ld, int64_t c, int64_t k0, void *tile, bool bf16) {
#if defined(__AVX512F__)
    __m512i r[16];
    if (bf16) {     // 32 columns: each row's 16 bf16 pairs, transposed to 16 pair-rows of 16 output rows
        for (int64_t j = 0; j < c; j += 32) {
            for (int i = 0; i < 16; i++) {
                const __m256i lo = _mm512_cvtepi32_epi16(bf16_bits(_mm512_loadu_ps(f + i * ld + j)));
                const __m256i hi = _mm512_cvtepi32_epi16(bf16_bits(_mm512_loadu_ps(f + i * ld + j + 16)));
                r[i] = _mm512_inserti64x4(_mm512_zextsi256_si512(lo), hi, 1);
            }
            transpose16_epi32(r);
            uint16_t *dst = static_cast<uint16_t *>(tile) + (k0 + j) * 16;
            for (int p = 0; p < 16; p++) _mm512_storeu_si512(dst + p * 32, r[p]);
        }
    } else {
        for (int64_t j = 0; j < c; j += 16) {
            for (int i = 0; i < 16; i++) r[i] = _mm512_castps_si512(_mm512_loadu_ps(f + i * ld + j));
            transpose16_epi32(r);
            float *dst = static_cast<float *>(tile) + (k0 + j) * 16;
            for (int p = 0; p < 16; p++) _mm512_storeu_si512(dst + p * 16, r[p]);
        }
    }
#else
    if (bf16) {
        uint16_t *dst = static_cast<uint16_t *>(tile) + k0 * 16;
        for (int64_t k = 0; k < c; k++)
            for (int i = 0; i < 16; i++) dst[(k / 2) * 32 + 2 * i + k % 2] = f32_to_bf16(f[i * ld + k]);
    } else {
        float *dst = static_cast<float *>(tile) + k0 * 16;
        for (int64_t k = 0; k < c; k++)
            for (int i = 0; i < 16; i++) dst[k * 16 + i] = f[i * ld + k];
    }
#endif
}

#if defined(__AVX512F__)
// 32 floats (lo: elements 0..15, hi: 16..31) -> 32 bf16 in order, rounded to nearest even:
// vcvtne2ps2bf16 where the CPU has AVX512-BF16 (asm: this build's flags do not include it;
// weights are never float32 denormals, where it would differ), else bf16_bits.
inline __m512i bf16_pairs(__m512 lo, __m512 hi, bool native) {
    if (native) {
        __m512i r;
        __asm__("vcvtne2ps2bf16 %2, %1, %0" : "=v"(r) : "v"(hi), "v"(lo));
        return r;
    }
    return _mm512_inserti64x4(_mm512_zextsi256_si512(_mm512_cvtepi32_epi16(bf16_bits(lo))),
                              _mm512_cvtepi32_epi16(bf16_bits(hi)), 1);
}

bool native_bf16() {
    static const bool ok = __builtin_cpu_supports("avx512bf16");
    return ok;
}

// One group of 16 weight rows (n of them real, the rest zero) dequantized into a bf16 packed
// tile [K/2][16][2]: per 256 columns, each row's pieces (decode<QT>) become floats in registers
// (dequantize_row_vec's operations, so the same values) and bf16 pairs in an L1 buffer, whose 32-
// column slices are transposed in registers into the tile.
// Types whose codes (offset taken off) fit 5 bits: a piece's weights take 32 values at most,
// A * code (+ C), computed (with the same float operations) for every code and looked up by
// vpermw with the codes' low 5 bits as indices: code c at index c & 31.
template <int QT>
constexpr bool kLut = QT == Q4_0 || QT == Q4_1 || QT == Q5_0 || QT == Q5_1 || QT == Q4_K || QT == Q5_K ||
                      QT == Q4_0X;

template <int QT>
__m512 lut_codes(int half) {     // the code at indices 16 half .. 16 half + 15, as floats
    alignas(64) float c[16];
    for (int i = 0; i < 16; i++) {
        const int index = 16 * half + i;
        c[i] = float(kSigned<QT> && index >= 16 ? index - 32 : index);
    }
    return _mm512_load_ps(c);
}

template <int QT>
inline __m512 lut_values(float A, float C, __m512 codes) {
    __m512 v = _mm512_mul_ps(_mm512_set1_ps(A), codes);
    if constexpr (kMin<QT>) v = _mm512_add_ps(v, _mm512_set1_ps(C));
    return v;
}

// One decoded piece's 32 weights as bf16 (elements in order): looked up (kLut) or converted,
// dequantize_row_vec's float operations either way, then rounded to nearest even.
template <int QT>
inline __m512i piece_bf16(const Piece &p, __m512 lut0, __m512 lut1, bool native) {
    if constexpr (kLut<QT>) {     // codes of 5 bits or fewer: the piece's 32 values, looked up
        const __m512 v0 = lut_values<QT>(p.A, p.C, lut0), v1 = lut_values<QT>(p.A, p.C, lut1);
        const __m512i idx = _mm512_cvtepi8_epi16(p.codes);     // vpermw reads 5 bits
        return _mm512_permutexvar_epi16(idx, bf16_pairs(v0, v1, native));
    }
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(p.codes)));
    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(p.codes, 1)));
    float a0 = p.A, a1 = p.A;
    if constexpr (QT == Q6_K) a0 = p.A * float(p.sc0), a1 = p.A * float(p.sc1);
    __m512 v0 = _mm512_mul_ps(_mm512_set1_ps(a0), q0), v1 = _mm512_mul_ps(_mm512_set1_ps(a1), q1);
    if constexpr (kMin<QT>) {
        v0 = _mm512_add_ps(v0, _mm512_set1_ps(p.C));
        v1 = _mm512_add_ps(v1, _mm512_set1_ps(p.C));
    }
    return bf16_pairs(v0, v1, native);
}

template <int QT>
void pack_group_bf16(const uint8_t *w, int64_t ldw, int64_t n, int64_t K, uint16_t *tile, bool native) {
    constexpr int P = kPieces<QT>;
    const __m512 lut0 = lut_codes<QT>(0), lut1 = lut_codes<QT>(1);
    constexpr int64_t kCols = 256;
    alignas(64) uint16_t buf[16 * kCols];
    if (n < 16) std::fill(buf, buf + 16 * kCols, uint16_t(0));
    for (int64_t k0 = 0; k0 < K; k0 += kCols) {
        const int64_t c = std::min(kCols, K - k0);          // a multiple of the block
        for (int64_t i = 0; i < n; i++) {
            const uint8_t *row = w + i * ldw + k0 / kElems[QT] * kBytes[QT];
            for (int64_t u = 0; u < c / kElems[QT]; u++) {
                Piece p[P];
                decode<QT>(row + u * kBytes[QT], p);
                for (int j = 0; j < P; j++)
                    _mm512_store_si512(buf + i * kCols + (u * P + j) * 32, piece_bf16<QT>(p[j], lut0, lut1, native));
            }
        }
        for (int64_t j = 0; j < c; j += 32) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512(buf + i * kCols + j);
            transpose16_epi32(r);
            uint16_t *dst = tile + (k0 + j) * 16;
            for (int q = 0; q < 16; q++) _mm512_storeu_si512(dst + q * 32, r[q]);
        }
    }
}

void pack_group_bf16(int qt, const uint8_t *w, int64_t ldw, int64_t n, int64_t K, uint16_t *tile, bool native) {
    with_qtype(qt, [&](auto q) { pack_group_bf16<decltype(q)::value>(w, ldw, n, K, tile, native); });
}
#endif

// Rows [0, rows) of W dequantized into kernels/cpu.py's packed GEMM layout (PackedWeight):
// float32 [Np/16][K][16] or bf16 [Np/16][K/2][16][2] (rounded to nearest even), Np = rows
// rounded up to 32, zero rows past `rows`. Threads take whole groups of 16 rows (no two write
// one cache line); a group goes kChunk columns at a time through a float buffer that stays in
// L1 (16 x kChunk floats), then is rounded and transposed in registers.
constexpr int64_t kChunk = 256;
void dequantize_packed(int qt, const uint8_t *w, int64_t ldw, int64_t rows, int64_t K, void *out, bool bf16) {
    const int64_t groups = (rows + 31) / 32 * 2;
#if defined(__AVX512F__)
    const bool native = native_bf16();
#endif
#pragma omp parallel
    {
        alignas(64) float buf[16 * kChunk];
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t n = std::min<int64_t>(16, std::max<int64_t>(0, rows - 16 * g));
            void *tile = bf16 ? static_cast<void *>(static_cast<uint16_t *>(out) + g * K * 16)
                              : static_cast<void *>(static_cast<float *>(out) + g * K * 16);
#if defined(__AVX512F__)
            if (bf16 && qt != MXFP4) {
                pack_group_bf16(qt, w + 16 * g * ldw, ldw, n, K, static_cast<uint16_t *>(tile), native);
                continue;
            }
#endif
            if (n < 16) std::fill(buf, buf + 16 * kChunk, 0.f);
            for (int64_t k0 = 0; k0 < K; k0 += kChunk) {   // K and kChunk are multiples of the block
                const int64_t c = std::min(kChunk, K - k0), offset = k0 / kElems[qt] * kBytes[qt];
                for (int64_t i = 0; i < n; i++) dequantize_row(qt, w + (16 * g + i) * ldw + offset, c, buf + i * kChunk);
                pack16(buf, kChunk, c, k0, tile, bf16);
            }
        }
    }
}
}  // namespace
