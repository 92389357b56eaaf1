// The calling thread's Handover: prefetch cursor, run_after, quant_handover_next.
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {
thread_local const Handover *t_handover = nullptr;    // the calling thread's, for its next call

// A thread's walk over its ranges, a few lines at a time between its own work.
struct PrefetchCursor {
    const ThreadPrefetch *tp = nullptr;
    int64_t r = 0, run = 0, off = 0;       // range, run in it, byte in the run
    PrefetchCursor(const Handover *plan, int64_t tid, int64_t team) {
        if (plan != nullptr && plan->threads == team && tid < kPrefetchThreads) tp = &plan->t[tid];
    }
    int64_t lines() const {
        int64_t total = 0;
        for (int64_t i = 0; tp && i < tp->n; i++) total += (tp->r[i].bytes + 63) / 64 * tp->r[i].count;
        return total;
    }
    void step(int64_t count) {
        for (; tp && count > 0 && r < tp->n; count--) {
            const PrefetchRange &g = tp->r[r];
            __builtin_prefetch(g.at + run * g.stride + off, 0, 2);
            if ((off += 64) < g.bytes) continue;
            off = 0;
            if (++run == g.count) r++, run = 0;
        }
    }
};
// At the end of a product's parallel region, in every thread.
inline void run_after(const Handover *plan) {
    if (plan == nullptr || plan->after == nullptr) return;
    plan->after(plan->ctx);
    if (omp_get_thread_num() == 0) const_cast<Handover *>(plan)->ran = 1;
}
}  // namespace


// The calling thread's next quant_linear_small or quant_linear_tiles call (its AMX-BF16 path;
// the others ignore it) fetches plan's ranges and runs plan->after (null: nothing), then forgets it.
extern "C" int quant_handover_next(const Handover *plan) {
    t_handover = plan;
    return 0;
}
