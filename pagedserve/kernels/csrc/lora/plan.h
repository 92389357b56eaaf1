// A LoRA delta's blocks, items and team run (lora_delta).
// Part of cpu_kernels (csrc/cpu_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {

// A block: up to kLoraRows rows of one slot on the vector path, or (amx) up to kLoraAmxMax on
// AMX tiles. A shrink item: block b's parts (j = -1), or its part j only.
struct LoraBlock { int64_t slot, rank, parts; int n; bool amx; int64_t rows[16]; };
struct LoraItem { int64_t b, j; };

// Projection p's blocks for the step's rows (grouped by slot; only the slots whose adapter
// targets it) and the shrink items over them. Returns whether the team should run them: one
// OpenMP meeting per phase costs most when other processes hold the cores, so the team joins
// when the work or the adapter bytes to read are large enough (both cores' loads in flight read
// cold weights at about 1.6x one core's rate). Items: one per block, or per (block, part) where
// there are too few blocks to keep every thread busy.
template <typename T>
bool lora_plan(const LoraRefs *lr, const LoraProj &p, int which, int64_t in, int64_t T_,
               std::vector<LoraBlock> &blocks, std::vector<LoraItem> &items) {
    thread_local std::vector<int64_t> mine;
    blocks.clear();
    items.clear();
#ifdef __AVX512BF16__
    const bool amx = std::is_same_v<T, uint16_t> && lora_amx_usable(lr->rank, in);
#else
    const bool amx = false;
#endif
    int64_t macs = 0, weights = 0;
    for (int64_t s = 0; s < lr->span; s++) {     // each slot's rows, in blocks
        const int64_t info = lr->slot_info[s * 4 + which], rank = info & 0xFFFF, parts = info >> 16;
        if (rank == 0 || parts == 0) continue;
        mine.clear();
        for (int64_t t = 0; t < T_; t++)
            if (lr->row_block[t] == s) mine.push_back(t);
        const int64_t count = static_cast<int64_t>(mine.size());
        if (count == 0) continue;
        int64_t slot_weights = 0;                    // its A and BT elements this projection reads
        for (int64_t j = 0; j < p.nparts; j++)
            if ((parts >> j) & 1) slot_weights += rank * (in + p.size[j]);
        weights += slot_weights, macs += count * slot_weights;
        for (int64_t i = 0; i < count;) {
            const bool tiles = amx && count - i >= kLoraAmxRows;     // AMX blocks of up to 16 rows
            LoraBlock blk{s, rank, parts, static_cast<int>(std::min<int64_t>(tiles ? kLoraAmxMax : kLoraRows, count - i)),
                          tiles, {}};
            for (int k = 0; k < blk.n; k++) blk.rows[k] = mine[i + k];
            i += blk.n;
            blocks.push_back(blk);
        }
    }
    const bool team = macs >= (1 << 18) || weights >= (1 << 14);
    const int64_t nb = static_cast<int64_t>(blocks.size()), threads = team ? omp_get_max_threads() : 1;
    for (int64_t b = 0; b < nb; b++) {
        if (nb >= 2 * threads) {
            items.push_back({b, -1});
            continue;
        }
        for (int64_t j = 0; j < p.nparts; j++)
            if ((blocks[b].parts >> j) & 1) items.push_back({b, j});
    }
    return team;
}

// Shrink of one item: ub [16][K] (block blk's rows; part j's rank columns at j * R) = x @ A_j.T
// for its parts, rounded to T as a T GEMM's output would be.
template <typename T>
void lora_shrink_item(const LoraRefs *lr, const LoraProj &p, const LoraBlock &blk, int64_t j0, const T *x,
                      int64_t in, float *ub) {
    const int64_t R = lr->rank, K = p.nparts * R, parts = j0 < 0 ? blk.parts : blk.parts & (int64_t{1} << j0);
    const T *A = reinterpret_cast<const T *>(p.a);
#ifdef __AVX512BF16__
    if constexpr (std::is_same_v<T, uint16_t>) {
        if (blk.amx) {
            float *uj[3] = {ub, ub + R, ub + 2 * R};
            lora_amx_shrink(A + blk.slot * K * in, in, R, blk.rank, parts, blk.n, blk.rows, x, 0, in, uj, K);
        }
    }
#endif
    if (!blk.amx) {
        const T *xr[kLoraRows];
        for (int r = 0; r < blk.n; r++) xr[r] = x + blk.rows[r] * in;
        for (int64_t j = 0; j < p.nparts; j++) {
            if (!((parts >> j) & 1)) continue;
#ifdef __AVX512BF16__
            if constexpr (std::is_same_v<T, uint16_t>) {
                lora_shrink_dp(xr, blk.n, A + (blk.slot * K + j * R) * in, in, blk.rank, in, ub + j * R, K);
                continue;
            }
#endif
            lora_shrink<Vec>(xr, blk.n, A + (blk.slot * K + j * R) * in, in, blk.rank, in, ub + j * R, K);
        }
    }
    for (int r = 0; r < blk.n; r++)
        for (int64_t j = 0; j < p.nparts; j++)
            if ((parts >> j) & 1) {
                float *uk = ub + r * K + j * R;
                int64_t k = 0;
                for (; k + Vec::W <= blk.rank; k += Vec::W) Vec::store(uk + k, round_as_v<Vec>(Vec::load(uk + k), x));
                for (; k < blk.rank; k++) {
                    T rounded;
                    store(&rounded, uk[k]);
                    uk[k] = to_f32(rounded);
                }
            }
}

// Thread t of nt's share of part j's output columns in the delta's expand, [c0, c1) within the
// part: the projection's columns split evenly, cut at multiples of 16 in each part (the part's
// end last). lora_team_run expands them and lora_prefetch_plan fetches their weights.
inline std::pair<int64_t, int64_t> lora_columns(const LoraProj &p, int64_t j, int64_t t, int64_t nt) {
    const int64_t N = p.offset[p.nparts - 1] + p.size[p.nparts - 1];
    auto cut = [&](int64_t g) {      // column g of y, as a cut in part j
        return g >= p.offset[j] + p.size[j] ? p.size[j] : std::max<int64_t>(0, g - p.offset[j]) / 16 * 16;
    };
    return {cut(N * t / nt), cut(N * (t + 1) / nt)};
}

// One projection's delta, planned (lora_plan) and ready for a team to run (lora_team_run).
template <typename T>
struct LoraCall {
    const LoraRefs *lr;
    const LoraProj *p;
    const T *x;
    int64_t in;
    T *y;
    int64_t ldy;
    const LoraBlock *blocks;
    int64_t nb;
    const LoraItem *items;
    int64_t ni;
    float *u;               // block b's rows' rank columns, [16][K] at b (part j's at j * R)
};

// The delta's plan for y [T, ldy] += projection `which` of `layer` for x [T, in], in the calling
// thread's buffers. Returns whether a team should run it; call.nb == 0: nothing to do.
template <typename T>
bool lora_prepare(const LoraRefs *lr, int64_t layer, int which, const T *x, int64_t in, T *y, int64_t ldy,
                  int64_t T_, LoraCall<T> &call) {
    thread_local std::vector<LoraBlock> blocks;
    thread_local std::vector<LoraItem> items;
    thread_local std::vector<float> scratch;
    call = LoraCall<T>{lr, nullptr, x, in, y, ldy, nullptr, 0, nullptr, 0, nullptr};
    if (lr == nullptr) return false;
    const LoraProj &p = lr->layers[layer * 4 + which];
    if (p.a == 0) return false;
    const bool team = lora_plan<T>(lr, p, which, in, T_, blocks, items);
    const int64_t nb = static_cast<int64_t>(blocks.size()), K = p.nparts * lr->rank;
    if (static_cast<int64_t>(scratch.size()) < nb * 16 * K) scratch.resize(nb * 16 * K);
    // (the team's threads use these pointers, not their own thread_local vectors)
    call.p = &p, call.blocks = blocks.data(), call.nb = nb, call.items = items.data();
    call.ni = static_cast<int64_t>(items.size()), call.u = scratch.data();
    return team;
}

// The delta run by every thread of the current team (or one thread alone), in two phases: the
// shrink items, round-robin (where lora_prefetch_plan had their A rows fetched; the loop's
// barrier also waits for a base product in the same region), then the expand, each thread a
// range of the output columns over every block, as the base projection cut them
// (quant_linear_small and the packed GEMMs give each thread a contiguous range of output
// rows): y's lines are in the caches of the core that just wrote them, and each thread reads
// its share of every slot's BT.
template <typename T>
void lora_team_run(const LoraCall<T> &c) {
    const LoraProj &p = *c.p;
    const int64_t R = c.lr->rank, K = p.nparts * R;
    const T *BT = reinterpret_cast<const T *>(p.bt);
    const uint16_t *pairs = p.btp ? reinterpret_cast<const uint16_t *>(p.btp) : nullptr;
#pragma omp for schedule(static, 1)
    for (int64_t i = 0; i < c.ni; i++)
        lora_shrink_item(c.lr, p, c.blocks[c.items[i].b], c.items[i].j, c.x, c.in, c.u + c.items[i].b * 16 * K);
    // Expand: y += u_j @ BT_j over this thread's output columns (lora_columns).
    const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
    for (int64_t j = 0; j < p.nparts; j++) {
        const auto [c0, c1] = lora_columns(p, j, tid, nt);
        if (c0 >= c1) continue;
        for (int64_t b = 0; b < c.nb; b++) {
            const LoraBlock &blk = c.blocks[b];
            if (!((blk.parts >> j) & 1)) continue;
            const float *ub = c.u + b * 16 * K + j * R;
            const T *bj = BT + (blk.slot * K + j * R) * p.ldb + p.offset[j];
#ifdef __AVX512BF16__
            if constexpr (std::is_same_v<T, uint16_t>) {
                const uint16_t *pj = pairs ? pairs + ((blk.slot * K + j * R) / 2 * p.ldb + p.offset[j]) * 2 : nullptr;
                if (blk.amx) {
                    lora_amx_expand(bj, pj, p.ldb, R, blk.rank, blk.n, blk.rows, ub, K, c0, c1, p.size[j],
                                    c.y + p.offset[j], c.ldy);
                    continue;
                }
                if (pj != nullptr && R <= 128) {
                    uint16_t *yr[kLoraRows];
                    for (int r = 0; r < blk.n; r++) yr[r] = c.y + blk.rows[r] * c.ldy + p.offset[j];
                    lora_expand_dp(ub, K, blk.n, pj, bj, p.ldb, blk.rank, yr, c0, c1);
                    continue;
                }
            }
#endif
            T *yr[kLoraRows];
            for (int r = 0; r < blk.n; r++) yr[r] = c.y + blk.rows[r] * c.ldy + p.offset[j];
            lora_expand<Vec>(ub, K, blk.n, bj, p.ldb, blk.rank, yr, c0, c1);
        }
    }
}

// y [T, ldy] += the delta of projection `which` of `layer` for x [T, in], in a meeting of its own.
template <typename T>
int lora_delta(const LoraRefs *lr, int64_t layer, int which, const T *x, int64_t in, T *y, int64_t ldy,
               int64_t T_) {
    LoraCall<T> call;
    const bool team = lora_prepare(lr, layer, which, x, in, y, ldy, T_, call);
    if (call.nb == 0) return 0;
#pragma omp parallel if (team)
    lora_team_run(call);
    return 0;
}

}  // namespace
