// A few rows: the integer dots' linear layer (quant_linear_small).
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {

// A thread's activation buffers (Act's arrays), kept from call to call: no allocation per product.
struct ActBuffers {
    std::vector<int8_t, Aligned64<int8_t>> q, qx;     // 64-byte aligned: the dots' 512-bit loads split no line
    std::vector<float, Aligned64<float>> d, ds;
    std::vector<int32_t, Aligned64<int32_t>> starts[kNumTypes];
    std::vector<int8_t, Aligned64<int8_t>> qk;        // Act's super-block fields
    std::vector<float, Aligned64<float>> dk;
    std::vector<int16_t, Aligned64<int16_t>> bsk;
};
thread_local ActBuffers t_act;

template <class V>
typename V::value_type *fit(V &v, int64_t n) {        // v's storage for at least n (it only grows)
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    return v.data();
}

// The calling thread's Act for T rows of K: q, d, ds, and where the parts' types read them (not
// on the AMX-INT8 path, `amx`) Act::qx and Act::start, or Act::qk, dk, bsk.
Act thread_act(const QuantPart *parts, int64_t nparts, int64_t T, int64_t K, bool amx) {
    ActBuffers &b = t_act;
    const int64_t nb = K / 32;
    Act a{fit(b.q, T * K), fit(b.d, T * nb), fit(b.ds, T * nb), K, nb, {}};
    bool all_super = true;
    for (int64_t p = 0; p < nparts; p++)
        if (reads_super(int(parts[p].qtype)) && K % 256 == 0) {
            a.qk = fit(b.qk, T * K);
            a.dk = fit(b.dk, T * (K / 256));
            a.bsk = fit(b.bsk, T * (K / 16));
        } else {
            all_super = false;
        }
    a.blocks32 = !all_super || amx;
#if defined(PS_DOTS512)
    // (Act::start: q6_k's always, q8_0's in passes of one or two rows: kStarts)
    const bool small_pass = T <= 2 || (T % kMaxNT != 0 && T % kMaxNT <= 2);
    for (int64_t p = 0; p < nparts && !amx; p++) {
        const int qt = int(parts[p].qtype);
        if (qt == Q4_0X) a.qx = fit(b.qx, T * K);
        if (qt == Q6_K || (qt == Q8_0 && small_pass)) a.start[qt] = fit(b.starts[qt], T * K / 4);
    }
#else
    (void)parts, (void)nparts, (void)amx;
#endif
    return a;
}

// Activation block i (row i / nb, block i % nb) of x into a's arrays.
inline void quantize_into(const void *x, int64_t ldx, bool bf16, int64_t i, const Act &a) {
#if defined(PS_DOTS512)
    quantize_start_one(x, ldx, bf16, i / a.nb, i % a.nb, a);
#else
    quantize_one(x, ldx, bf16, i / a.nb, i % a.nb, a.K, const_cast<int8_t *>(a.q), const_cast<float *>(a.d),
                 const_cast<float *>(a.ds));
#endif
}

// Up to this many activation blocks (T = 1 at K = 2048) every thread quantizes them all itself
// (into its own buffers) rather than its share and then waiting for the others: the copy costs
// less than the barrier (measured at the 135M shape: ~0.4 us a product of the ~1.8 us a parallel
// region cost with it).
constexpr int64_t kOwnBlocks = 64;

// Inside a product's parallel region: this thread's Act, x's T rows quantized into it: every block
// into the thread's own buffers (`own`), or its share into `shared`'s and a barrier.
Act quantize_in_region(const Act &shared, bool own, const QuantPart *parts, int64_t nparts, int64_t T, bool amx,
                       const void *x, int64_t ldx, bool x_bf16) {
    Act a = shared;
    const int64_t ns = a.qk != nullptr ? a.K / 256 : 0;      // super-blocks a row (where read)
    const int64_t nb = a.blocks32 ? a.nb : 0;                 // blocks of 32 a row (where read)
    if (own) {
        if (omp_get_thread_num() != 0) a = thread_act(parts, nparts, T, a.K, amx);
        for (int64_t i = 0; i < T * nb; i++) quantize_into(x, ldx, x_bf16, i, a);
        for (int64_t i = 0; i < T * ns; i++) quantize_super_one(x, ldx, x_bf16, i / ns, i % ns, a);
    } else {
#pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < T * nb; i++) quantize_into(x, ldx, x_bf16, i, a);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < T * ns; i++) quantize_super_one(x, ldx, x_bf16, i / ns, i % ns, a);
    }
    return a;
}

constexpr int64_t kShareGroups = 8;     // groups of 8 rows an item of quant_linear_small's r8 path (WorkShare)

// y[t][r] (float32 or bf16, rows ldy apart) = v + bias[r] (bias float32, or null: + 0).
inline void put_out(void *y, bool y_bf16, int64_t ldy, const float *bias, int64_t t, int64_t r, float v) {
    v += bias ? bias[r] : 0.f;
    if (y_bf16) static_cast<uint16_t *>(y)[t * ldy + r] = f32_to_bf16(v);
    else static_cast<float *>(y)[t * ldy + r] = v;
}

// Many activation rows over r8 layouts: the GEMM of quant/gemm_r8_256.h (included after this room).
bool gemm_r8_takes(const QuantPart *parts, int64_t nparts, int64_t T);
int gemm_r8_linear(const QuantPart *parts, int64_t nparts, const void *x, int64_t ldx, bool x_bf16, int64_t T, int64_t K,
                   const float *bias, void *y, int64_t ldy, bool y_bf16, const Handover *plan);
}  // namespace

// y [T][ldy] (float32 or bf16) = x [T][ldx] (float32 or bf16) @ W.T + bias, W the parts stacked
// by rows (K columns each), through the integer dots. `invariant`: a batch-invariant step's call,
// where a row's arithmetic must not depend on T: no AMX-INT8 tiles (they take T >= g_amx8.min_rows
// and sum other pieces than vpdpbusd's dots). 0 on success.
extern "C" int quant_linear_small(const QuantPart *parts, int64_t nparts, const void *x, int64_t ldx, int x_bf16,
                                  int64_t T, int64_t K, const float *bias, void *y, int64_t ldy, int y_bf16,
                                  int invariant) {
    const Handover *plan = t_handover;
    t_handover = nullptr;
    if (!valid(parts, nparts, K) || T <= 0) return 1;
    const int64_t nb = K / 32;
    const bool r8 = any_r8(parts, nparts);
    if (gemm_r8_takes(parts, nparts, T)) return gemm_r8_linear(parts, nparts, x, ldx, x_bf16 != 0, T, K, bias, y, ldy, y_bf16 != 0, plan);
    if (r8 && all_r8_groups(parts, nparts)) {     // r8 parts: their groups of 8 rows, 1-4 activation rows a pass
        // (the calling thread's, kept from call to call: no allocation per product; the region
        // below reads them through these pointers, not by the thread_local names)
        thread_local std::vector<std::array<R8GroupFn, 5>> fns_buf;
        thread_local std::vector<int64_t> first_buf, row0_buf;
        std::array<R8GroupFn, 5> *kR8 = fit(fns_buf, nparts);
        int64_t *first = fit(first_buf, nparts + 1), *row0 = fit(row0_buf, nparts);   // each part's first group, first row
        first[0] = row0[0] = 0;
        for (int64_t p = 0; p < nparts; p++) {
            const int qt = int(parts[p].qtype);
            for (int n = 1; n <= 4; n++) kR8[p][n] = r8_group_fn(qt, n);
#if defined(PS_DOTS512)
            if (qt == Q4_1R8)
                for (int n = 1; n <= 4; n++) kR8[p][n] = kR8_512[n];
#endif
            first[p + 1] = first[p] + parts[p].rows / 8;
            if (p + 1 < nparts) row0[p + 1] = row0[p] + parts[p].rows;
        }
        const Act act = thread_act(parts, nparts, T, K, false);
        const int64_t groups = first[nparts];
        // Items of kShareGroups groups shared by WorkShare: each thread its own contiguous range
        // first, then the back items of what the other has left. A split by bytes alone left one
        // thread waiting where the parts' types cost differently a byte (qkv with v in Q6_K: the
        // thread holding v ended ~35% later); sharing also absorbs a thread the VM runs slower.
        const int64_t items = (groups + kShareGroups - 1) / kShareGroups, team = omp_get_max_threads();
        WorkShare share(items, team);
#pragma omp parallel if (groups * K * T >= 4096)
        {
            const Act a = quantize_in_region(act, T * nb <= kOwnBlocks, parts, nparts, T, false, x, ldx, x_bf16 != 0);
            const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
            PrefetchCursor ahead(plan, tid, nt);          // a LoRA delta's adapter weights (Handover)
            const int64_t mine = (items * (tid + 1) / nt - items * tid / nt) * kShareGroups;    // its own share's groups
            const int64_t per_group = mine > 0 ? (ahead.lines() + mine - 1) / mine : 0;
            float v[4 * 8];
            for (int64_t item; (item = share.next(tid)) >= 0;) {
                const int64_t g1 = std::min(groups, (item + 1) * kShareGroups);
                int64_t p = 0;
                for (int64_t g = item * kShareGroups; g < g1; g++) {
                    while (g >= first[p + 1]) p++;
                    const uint8_t *w = parts[p].w + (g - first[p]) * parts[p].ldw;
                    const int64_t r = row0[p] + 8 * (g - first[p]);
                    for (int64_t t0 = 0; t0 < T; t0 += 4) {
                        if (t0 == 0) ahead.step(per_group);
                        const int n = int(std::min<int64_t>(4, T - t0));
                        kR8[p][n](w, nb, a, t0, v, 8);
                        for (int t = 0; t < n; t++)
                            for (int i = 0; i < 8; i++) put_out(y, y_bf16 != 0, ldy, bias, t0 + t, r + i, v[t * 8 + i]);
                    }
                }
            }
            run_after(plan);
        }
        return 0;
    }
    if (r8) {         // several parts: the rows in the file's layout
        t_handover = plan;
        const PlainParts plain(parts, nparts, K);
        return quant_linear_small(plain.parts.data(), nparts, x, ldx, x_bf16, T, K, bias, y, ldy, y_bf16, invariant);
    }
#if defined(PS_DOTS512)
    // AMX-INT8 from g_amx8.min_rows rows: the activations also as B tiles (amx8_group); never in
    // a batch-invariant call (fewer rows take vpdpbusd)
    const bool amx = !invariant && g_amx8.enabled && T >= g_amx8.min_rows && !any_mxfp4(parts, nparts);
    const int64_t tiles = amx ? (T + 15) / 16 : 0;
    std::vector<int32_t> bv(tiles * (K / 4) * 16);
    std::vector<float> dxt(tiles * nb * 16), dst(tiles * nb * 16);
    const Amx8Act at{bv.data(), dxt.data(), dst.data(), T, K};
#else
    const bool amx = false;
    (void)invariant;
#endif
    const bool own = !amx && T * nb <= kOwnBlocks;
    const Act shared = thread_act(parts, nparts, T, K, amx);
    std::vector<RowFn> full(nparts), tail(nparts);
    std::vector<Row2Fn> two(nparts);          // T = 1: two weight rows per call where the type has it
    std::vector<int64_t> ends(nparts);        // one past each part's last row in y
    int64_t N = 0, total = 0;                 // rows, weight bytes
    for (int64_t p = 0; p < nparts; p++) {
        total += parts[p].rows * (K / kElems[parts[p].qtype] * kBytes[parts[p].qtype]);
        full[p] = row_fn(int(parts[p].qtype), int(std::min<int64_t>(kMaxNT, T)));
        tail[p] = row_fn(int(parts[p].qtype), int(T % kMaxNT));
        two[p] = T == 1 ? row2_fn(int(parts[p].qtype)) : nullptr;
        ends[p] = N += parts[p].rows;
    }
    // One parallel region: the activations' blocks (each thread its share, or all of them: `own`),
    // then the weight rows (each thread a contiguous range, so it streams its rows' bytes once; up
    // to kMaxNT activation rows per pass).
#pragma omp parallel if (N * K * T >= 32768)
    {
        const Act a = quantize_in_region(shared, own, parts, nparts, T, amx, x, ldx, x_bf16 != 0);
#if defined(PS_DOTS512)
        if (amx) {
            // B tiles: row g of tile k holds the 4-byte group g of activation rows 16k .. 16k + 15
#pragma omp for schedule(static)
            for (int64_t i = 0; i < tiles * (K / 4); i++) {
                const int64_t k = i / (K / 4), g = i % (K / 4);
                for (int64_t c = 0; c < 16; c++) {
                    int32_t v = 0;
                    if (16 * k + c < T) std::memcpy(&v, a.q + (16 * k + c) * K + 4 * g, 4);
                    bv[i * 16 + c] = v;
                }
            }
#pragma omp for schedule(static)
            for (int64_t i = 0; i < tiles * nb; i++) {
                const int64_t k = i / nb, j = i % nb;
                for (int64_t c = 0; c < 16; c++) {
                    const bool real = 16 * k + c < T;
                    dxt[i * 16 + c] = real ? a.d[(16 * k + c) * nb + j] : 0.f;
                    dst[i * 16 + c] = real ? a.ds[(16 * k + c) * nb + j] : 0.f;
                }
            }
            amx8_rows(parts, nparts, at, total, bias, y, ldy, y_bf16 != 0);
        } else
#endif
        {
        // Each thread a contiguous range of rows holding an equal share of the weight bytes
        // (parts of different types cost differently per row).
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t begin = row_at_byte(parts, nparts, K, total * tid / nt);
        const int64_t end = row_at_byte(parts, nparts, K, total * (tid + 1) / nt);
        PrefetchCursor ahead(plan, tid, nt);
        const int64_t per_row = end > begin ? (ahead.lines() + end - begin - 1) / (end - begin) : 0;
        auto put = [&](int64_t t, int64_t r, float v) { put_out(y, y_bf16 != 0, ldy, bias, t, r, v); };
        for (int64_t r = begin; r < end; r++) {
            int64_t p = 0;
            while (r >= ends[p]) p++;
            const uint8_t *row = parts[p].w + (r - (ends[p] - parts[p].rows)) * parts[p].ldw;
            ahead.step(per_row);
#if defined(PS_DOTS512)
            if (two[p] != nullptr && r + kPassRows <= std::min(end, ends[p])) {    // rows r .. of one part
                float vs[kPassRows];
                two[p](row, parts[p].ldw, a, vs);
                for (int i = 0; i < kPassRows; i++) put(0, r + i, vs[i]);
                ahead.step(per_row * (kPassRows - 1));
                r += kPassRows - 1;
                continue;
            }
#endif
            // (one row a pass here: the whole row that far ahead, once)
            prefetch_bytes(row + prefetch_rows(parts[p].ldw, 1) * parts[p].ldw, 0, 1,
                           K / kElems[parts[p].qtype] * kBytes[parts[p].qtype]);
            for (int64_t t0 = 0; t0 < T; t0 += kMaxNT) {
                const int nt = int(std::min<int64_t>(kMaxNT, T - t0));
                float vals[kMaxNT];
                (nt == kMaxNT || nt == T ? full[p] : tail[p])(row, a, t0, vals, 1);
                for (int i = 0; i < nt; i++) put(t0 + i, r, vals[i]);
            }
        }
        }
        run_after(plan);
    }
    return 0;
}
