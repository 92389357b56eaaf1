// The KV cache's Layout (strides) and the attention kernels' size limits.
// Part of cpu_kernels (csrc/cpu_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {

struct Layout {   // element strides of a cache: between blocks, token slots, KV heads
    int64_t block, token, head;
};

constexpr int64_t kMaxGroup = 16, kMaxDim = 256, kMaxBlock = 256, kMaxPartition = 512;
constexpr int64_t kAhead = 32;  // rows prefetched ahead of use
}  // namespace
