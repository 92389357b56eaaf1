// Work shared by a team without a fixed split: WorkShare (the experts kernel's decode phases,
// quant_linear_small's r8 groups).
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {
// Items [0, n) shared by a team: thread t's own share [n t / nt, n (t + 1) / nt) taken
// from its front (its matrices' rows in order: one forward stream each), then, that done, the
// back item of whichever share has the most left. Every item runs once whatever the team's size.
class WorkShare {
  public:
    WorkShare(int64_t n, int64_t nt) : nt_(nt), shares_(new Share[nt]) {
        for (int64_t t = 0; t < nt; t++) shares_[t].v = uint64_t(n * t / nt) << 32 | uint64_t(n * (t + 1) / nt);
    }
    int64_t next(int64_t tid) {             // an item for thread tid, or -1: none left
        if (tid < nt_) {
            const int64_t i = take(shares_[tid].v, true);
            if (i >= 0) return i;
        }
        for (;;) {
            int64_t most = 0, from = -1;
            for (int64_t t = 0; t < nt_; t++) {
                const uint64_t v = shares_[t].v.load();
                if (int64_t(v & 0xffffffffu) - int64_t(v >> 32) > most) most = int64_t(v & 0xffffffffu) - int64_t(v >> 32), from = t;
            }
            if (from < 0) return -1;
            const int64_t i = take(shares_[from].v, false);
            if (i >= 0) return i;
        }
    }

  private:
    static int64_t take(std::atomic<uint64_t> &share, bool front) {    // (front << 32 | back), -1 if empty
        uint64_t v = share.load();
        for (;;) {
            const uint64_t lo = v >> 32, hi = v & 0xffffffffu;
            if (lo >= hi) return -1;
            if (share.compare_exchange_weak(v, front ? (lo + 1) << 32 | hi : lo << 32 | (hi - 1)))
                return int64_t(front ? lo : hi - 1);
        }
    }
    // Each share on its own cache line: a thread takes its own items without pulling in the line
    // the other thread is writing. Shared, at the default model's small products (one item a few
    // microseconds), 46% of quant_linear_small's own region samples sat on that load; apart, 5%.
    struct alignas(64) Share {
        std::atomic<uint64_t> v;
    };
    int64_t nt_;
    std::unique_ptr<Share[]> shares_;
};
}  // namespace
