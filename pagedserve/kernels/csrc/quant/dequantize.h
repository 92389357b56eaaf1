// Rows -> float32 (quant_dequantize; quant_dequantize_rows, which reads the r8 layouts too, in repack_r8.h).
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {

// Row w's K weights as floats (exactly gguf.quants' values).
void dequantize_row(int qt, const uint8_t *w, int64_t K, float *y) {
    if (qt == MXFP4) return mxfp4_dequantize_row(w, K, y);
#if defined(__AVX2__)
    with_qtype(qt, [&](auto q) { dequantize_row_vec<decltype(q)::value>(w, K, y); });
#else
    for (int64_t u = 0; u < K / kElems[qt]; u++) dequantize_block(qt, w + u * kBytes[qt], y + u * kElems[qt]);
#endif
}
}  // namespace

// w: rows of blocks, ldw bytes apart; out float32 [rows][ldo]. 0 on success.
extern "C" int quant_dequantize(int qt, const uint8_t *w, int64_t ldw, int64_t rows, int64_t cols, float *out,
                                int64_t ldo) {
    if (qt < 0 || qt >= kNumTypes || is_r8(qt) || cols % kElems[qt]) return 1;
#pragma omp parallel for schedule(static) if (rows * cols >= 65536)
    for (int64_t r = 0; r < rows; r++) dequantize_row(qt, w + r * ldw, cols, out + r * ldo);
    return 0;
}

