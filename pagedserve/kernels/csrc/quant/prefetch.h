// Software prefetch of the weight stream (decode).
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {

// ---- software prefetch of the weight stream (decode) --------------------------------------------
// A thread's rows are one forward stream, but the hardware prefetchers stop at each 4 KiB page and
// are trained again; a dot kernel at T = 1 keeps too few loads in flight to hide the miss latency
// itself (measured: 1.5-1.9x slower over weights in L3 / DRAM than in L2). So each pass asks for
// the same bytes of the rows about kPrefetchBytes ahead while it multiplies the current ones
// (row_dot2: kFarPasses passes on). With prefetcht2 that far ahead, the file-layout dots (avx512vnni
// build, forced on Zen 4: benchmarks/r8_stream.py) streamed q4_k 1.5x / 1.6x (2 / 1 threads), q6_k 1.7x /
// 2.3x and q4_0x8 1.7x / 2.5x as fast as prefetcht0 over the next pass (prefetcht2 alone: 1.2-1.7x).
constexpr int64_t kPrefetchBytes = 4096;
constexpr int64_t kFarPasses = 4;
inline int64_t prefetch_rows(int64_t ldw, int64_t pass_rows) {    // rows ahead: at least the next pass
    return std::max<int64_t>(pass_rows, (kPrefetchBytes + ldw - 1) / std::max<int64_t>(ldw, 1));
}
// bytes [0, n) of `rows` rows at p, ldw apart (the lines they touch, give or take the last one,
// which the next call's first prefetch covers).
inline void prefetch_bytes(const uint8_t *p, int64_t ldw, int rows, int64_t n) {
    for (int r = 0; r < rows; r++)
        for (int64_t l = 0; l < n; l += 64) __builtin_prefetch(p + r * ldw + l, 0, 1);     // prefetcht2
}
}  // namespace
