// A LoRA delta handed to the quantized base product before it (project_lora) and lora_delta_*.
// Part of cpu_kernels (csrc/cpu_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {

// What each of the nt threads of lora_team_run will read of the adapter weights, for the base
// product before it to fetch into that thread's L2 meanwhile: the A rows of its shrink items
// (the items go round-robin, schedule(static, 1)) and the BT pairs of its output columns
// (lora_columns). Nothing where BT has no pairs (float32).
template <typename T>
void lora_prefetch_plan(const LoraCall<T> &c, int64_t nt, Handover &plan) {
    const LoraProj &p = *c.p;
    const int64_t in = c.in, R = c.lr->rank, K = p.nparts * R;
    for (int64_t t = 0; t < kPrefetchThreads; t++) plan.t[t].n = 0;
    if (p.btp == 0) return;
    auto add = [&](int64_t t, const void *at, int64_t bytes, int64_t count, int64_t stride) {
        if (t >= kPrefetchThreads) return;
        ThreadPrefetch &tp = plan.t[t];
        if (tp.n < kPrefetchRanges && bytes > 0 && count > 0)
            tp.r[tp.n++] = {static_cast<const char *>(at), bytes, count, stride};
    };
    const T *A = reinterpret_cast<const T *>(p.a);
    const uint16_t *pairs = reinterpret_cast<const uint16_t *>(p.btp);
    for (int64_t i = 0; i < c.ni; i++) {
        const LoraItem &item = c.items[i];
        const LoraBlock &blk = c.blocks[item.b];
        for (int64_t j = 0; j < p.nparts; j++)
            if ((item.j < 0 || item.j == j) && ((blk.parts >> j) & 1))
                add(i % nt, A + (blk.slot * K + j * R) * in, blk.rank * in * int64_t(sizeof(T)), 1, 0);
    }
    int64_t last = -1;
    for (int64_t b = 0; b < c.nb; b++) {       // each slot's pairs once (its blocks are consecutive)
        const LoraBlock &blk = c.blocks[b];
        if (blk.slot == last) continue;
        last = blk.slot;
        for (int64_t t = 0; t < nt; t++) {
            for (int64_t j = 0; j < p.nparts; j++) {
                if (!((blk.parts >> j) & 1)) continue;
                const auto [c0, c1] = lora_columns(p, j, t, nt);     // the pair rows' columns
                if (c0 < c1)
                    add(t, pairs + ((blk.slot * K + j * R) / 2 * p.ldb + p.offset[j] + c0) * 2, (c1 - c0) * 4,
                        (blk.rank + 1) / 2, p.ldb * 4);
            }
        }
    }
}

using QuantHandover = int (*)(const Handover *plan);
int g_lora_handover = 1;
std::atomic<int> g_lora_handovers{0};     // deltas handed to a base product (tests: it is really on)

template <typename T>
void lora_after(const void *ctx) {
    lora_team_run(*static_cast<const LoraCall<T> *>(ctx));
}

// One projection and its LoRA delta. A quantized base product (quant_linear_small's rows, the
// AMX-BF16 tiles) fetches the delta's adapter weights ahead and runs the delta at its end, in
// the same OpenMP meeting (Handover.after): one meeting a projection, not two. Elsewhere
// (the packed GEMMs) the delta follows in a meeting of its own.
template <typename T>
int project_lora(const Proj &w, const ModelDims &m, bool decode, const LoraRefs *lora, int64_t layer, int which,
                 const T *x, const float *b, T *y, int64_t M, int64_t N, int64_t K) {
    thread_local Handover plan;
    LoraCall<T> call;
    const bool team = lora_prepare(lora, layer, which, x, K, y, N, M, call);
    const bool handed = call.nb > 0 && w.nparts > 0 && m.quant_handover != 0 && g_lora_handover;
    if (handed) {
        plan.threads = omp_get_max_threads();
        lora_prefetch_plan(call, plan.threads, plan);
        plan.after = &lora_after<T>, plan.ctx = &call, plan.ran = 0;
        reinterpret_cast<QuantHandover>(m.quant_handover)(&plan), g_lora_handovers++;
    }
    const int status = project(w, m, decode, x, b, y, M, N, K);
    if (handed) reinterpret_cast<QuantHandover>(m.quant_handover)(nullptr);
    if (status != 0 || call.nb == 0 || (handed && plan.ran)) return status;
#pragma omp parallel if (team)
    lora_team_run(call);
    return 0;
}

}  // namespace

extern "C" {
// One projection's LoRA delta on its own (tests/test_lora_kernel.py): y [T, ldy] += delta.
int lora_delta_f32(const LoraRefs *lr, int64_t layer, int64_t which, const float *x, int64_t in, float *y,
                   int64_t ldy, int64_t T) {
    return lora_delta(lr, layer, static_cast<int>(which), x, in, y, ldy, T);
}
int lora_delta_bf16(const LoraRefs *lr, int64_t layer, int64_t which, const uint16_t *x, int64_t in, uint16_t *y,
                    int64_t ldy, int64_t T) {
    return lora_delta(lr, layer, static_cast<int>(which), x, in, y, ldy, T);
}
// enable: hand each LoRA delta to the quantized base product before it (1: project_lora) or run
// it on its own (0; measuring it). Returns the setting.
int lora_handover_config(int64_t enable) { return g_lora_handover = enable != 0; }
// How many LoRA deltas were handed to a base product so far (wraps; tests compare counts).
int lora_handovers() { return g_lora_handovers.load(); }
}
