// The KV cache's Layout (strides) and the attention kernels' size limits.
// Part of cpu_kernels (csrc/cpu_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {

struct Layout {   // element strides of a cache: between blocks, token slots, KV heads
    int64_t block, token, head;
};

// Per-layer changes to the scores (Gemma 2's soft-capping, gpt-oss's sinks); {0, null}: none.
struct ScoreMods {
    float softcap;          // scores (already scaled) -> softcap * tanh(score / softcap); 0: none
    const float *sinks;     // [Hq] float32: a logit per query head that joins each softmax's denominator
};
// A softmax's denominator with head g's sink: l (the sum of e^(s - m) over its keys) + e^(sink - m).
inline float with_sink(float l, float m, const ScoreMods &mods, int64_t head) {
    return mods.sinks ? l + std::exp(mods.sinks[head] - m) : l;
}
inline float softcap1(float s, float cap) { return cap * std::tanh(s / cap); }

constexpr int64_t kMaxGroup = 16, kMaxDim = 256, kMaxBlock = 256, kMaxPartition = 512;
constexpr int64_t kAhead = 32;  // rows prefetched ahead of use
}  // namespace
