// Handover: shared by cpu_kernels (project_lora makes one) and quant_kernels (its products take it).
#pragma once

// Work handed to the next call (cpu_kernels.cpp project_lora: a LoRA delta): per thread, bytes
// to fetch into its L2 while its share of the weights streams (the delta's adapter weights, which
// the same thread reads right after: the weights' dots and tiles leave memory bandwidth unused,
// the delta alone would wait on it), and work for every thread to run at the end of the
// product, inside its parallel region (the delta: one OpenMP meeting, not two). The same layout
// as cpu_kernels.cpp's.
constexpr int kPrefetchThreads = 8, kPrefetchRanges = 128;
struct PrefetchRange {
    const char *at;
    int64_t bytes, count, stride;      // count runs of `bytes`, `stride` bytes apart
};
struct ThreadPrefetch {
    int64_t n;
    PrefetchRange r[kPrefetchRanges];
};
struct Handover {
    int64_t threads;     // the team's size the plan was made for (threads past kPrefetchThreads: none)
    ThreadPrefetch t[kPrefetchThreads];
    void (*after)(const void *ctx);     // or null: every thread calls it when its share of the product is
    const void *ctx;                    // done, inside the region (the delta: one meeting, not two)
    int64_t ran;                        // set (by thread 0) where `after` ran
};
