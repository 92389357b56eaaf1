// Decode attention over Vec and the driver over (sequence, KV head, partition): paged_decode.
// Part of cpu_kernels (csrc/cpu_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

// Paged decode attention: one query token per sequence, reading keys and values straight
// from their cache blocks through the block table (no gathered copy).
//
// Work is split over (sequence, KV head, context partition). The query heads that share
// a KV head (GQA) are processed together, so each key and value is loaded once for all of
// them. A partition keeps a running max, sum and weighted sum of values (online softmax);
// the partitions of one (sequence, head) are merged at the end. Math is float32 whatever
// the storage type (float32 or bfloat16). Per layer (ScoreMods): soft-capped scores (each
// partition kernel, on the scaled scores before their max) and a sink logit per head (in the
// last division only: l + e^(sink - m)).
//
// Layouts: q, out [N, Hq, D]; caches [num_blocks, B, Hkv, D] in any order of the first three
// dims (strides in a Layout; D contiguous); block_tables [N, stride].
//
namespace {

// ---- decode attention over V: the partition kernel of the other builds -----------------------
// (AVX2; AVX-512 at head dims without a kernel above.) Same results as attend_partition_avx512:
// each query head's scores (q in float32, keys converted in registers), softmax weights by the
// vector exp, then the weighted sums of values, each value row loaded and converted once per
// 4 W dims for 2 heads at a time (12 sums and 4 rows in AVX2's 16 registers).
template <class V, int D, typename T, typename K = T>
void attend_partition_vec(const T *q, float scale, float softcap, const K *kc, const K *vc, const int64_t *table,
                          int64_t t0, int64_t t1, int64_t h, Layout L, int64_t B, int64_t G, float *p) {
    using R = typename V::reg;
    constexpr int W = V::W, NR = D / W, NV = NR < 4 ? NR : 4, C = 2;
    float *m = p, *l = p + G, *acc = p + 2 * G;
    const int64_t n = t1 - t0, padded = (n + W - 1) / W * W;
    thread_local std::vector<const K *> krow, vrow;
    thread_local std::vector<float> sbuf;
    if (static_cast<int64_t>(krow.size()) < n) krow.resize(n), vrow.resize(n);
    if (static_cast<int64_t>(sbuf.size()) < G * padded) sbuf.resize(G * padded);
    row_pointers(kc, vc, table, t0, t1, h, L, B, krow.data(), vrow.data());
    // Scaled 8-bit rows: each row's scale is read beside its codes, on its scores and weights.
    if constexpr (kQuant<K>) {      // every head's scores, each key row converted once (to L1)
        float qall[kMaxGroup * D], row[D];
        for (int64_t d = 0; d < G * D; d++) qall[d] = to_f32(q[d]) * scale;
        for (int64_t t = 0; t < n; t++) {
            if (t + kAhead < n)
                for (int64_t b = 0; b < D; b += 64) {
                    V::prefetch(reinterpret_cast<const char *>(krow[t + kAhead]) + b);
                    V::prefetch(reinterpret_cast<const char *>(vrow[t + kAhead]) + b);
                }
            if constexpr (NR % 2 == 0) {
                for (int j = 0; j < NR; j += 2) {
                    R a, b;
                    V::load2(krow[t] + j * W, a, b);
                    V::store(row + j * W, a);
                    V::store(row + (j + 1) * W, b);
                }
            } else {
                for (int j = 0; j < NR; j++) V::store(row + j * W, V::load(krow[t] + j * W));
            }
            const float ks = row_scale(krow[t], D);
            for (int64_t g = 0; g < G; g++) {
                R a0 = V::zero(), a1 = V::zero();
                for (int j = 0; j < NR; j += 2) {
                    a0 = V::fmadd(V::load(qall + g * D + j * W), V::load(row + j * W), a0);
                    if (j + 1 < NR) a1 = V::fmadd(V::load(qall + g * D + (j + 1) * W), V::load(row + (j + 1) * W), a1);
                }
                sbuf[g * padded + t] = V::reduce_add(V::add(a0, a1)) * ks;
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float qg[D], *s = sbuf.data() + g * padded;
        for (int d = 0; d < D; d++) qg[d] = to_f32(q[g * D + d]) * scale;
        for (int64_t t = 0; t < n && !kQuant<K>; t++) {
            if (g == 0 && t + kAhead < n)
                for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(K)); b += 64) {
                    V::prefetch(reinterpret_cast<const char *>(krow[t + kAhead]) + b);
                    V::prefetch(reinterpret_cast<const char *>(vrow[t + kAhead]) + b);
                }
            R a0 = V::zero(), a1 = V::zero();
            for (int j = 0; j < NR; j += 2) {
                a0 = V::fmadd(V::load(qg + j * W), V::load(krow[t] + j * W), a0);
                if (j + 1 < NR) a1 = V::fmadd(V::load(qg + (j + 1) * W), V::load(krow[t] + (j + 1) * W), a1);
            }
            s[t] = V::reduce_add(V::add(a0, a1));
        }
        if (softcap != 0.f) softcap_scores<V>(s, padded, softcap);     // (the padding is set after)
        for (int64_t t = n; t < padded; t++) s[t] = -INFINITY;
        R mxv = V::load(s);
        for (int64_t t = W; t < padded; t += W) mxv = V::max(mxv, V::load(s + t));
        const float mx = V::reduce_max(mxv);
        R sum = V::zero();
        for (int64_t t = 0; t < padded; t += W) {      // padding: e^-inf = 0
            const R w = V::exp(V::sub(V::load(s + t), V::set1(mx)));
            V::store(s + t, w);
            sum = V::add(sum, w);
        }
        m[g] = mx;
        l[g] = V::reduce_add(sum);
    }
    for (int64_t g0 = 0; g0 < G; g0 += C) {
        const int64_t heads = std::min<int64_t>(C, G - g0);
        for (int d0 = 0; d0 < D; d0 += NV * W) {
            R a[C][NV];
            for (auto &row : a)
                for (auto &x : row) x = V::zero();
            for (int64_t t = 0; t < n; t++) {
                R v[NV];
                if constexpr (D % (2 * W) == 0 && NV % 2 == 0) {     // whole pairs (8-bit: one widening)
                    for (int j = 0; j < NV; j += 2)
                        if (d0 + j * W < D) V::load2(vrow[t] + d0 + j * W, v[j], v[j + 1]);
                        else v[j] = v[j + 1] = V::zero();
                } else {
                    for (int j = 0; j < NV; j++) v[j] = d0 + j * W < D ? V::load(vrow[t] + d0 + j * W) : V::zero();
                }
                const float vs = row_scale(vrow[t], D);      // a scaled row's scale (else 1)
                for (int c = 0; c < C && c < heads; c++) {
                    const R w = V::set1(sbuf[(g0 + c) * padded + t] * vs);
                    for (int j = 0; j < NV; j++)
                        if (d0 + j * W < D) a[c][j] = V::fmadd(w, v[j], a[c][j]);
                }
            }
            for (int c = 0; c < heads; c++)
                for (int j = 0; j < NV; j++)
                    if (d0 + j * W < D) V::store(acc + (g0 + c) * D + d0 + j * W, a[c][j]);
        }
    }
}

// The partition kernel for this head dim: vectorised where the CPU and head dim allow.
template <typename T, typename K = T>
auto pick_partition_kernel(int64_t D) -> void (*)(const T *, float, float, const K *, const K *, const int64_t *,
                                                  int64_t, int64_t, int64_t, Layout, int64_t, int64_t, float *) {
#ifdef __AVX512F__
    switch (D) {
        case 32: return attend_partition_avx512<1, T, K>;
        case 64: return attend_partition_avx512<2, T, K>;
        case 128: return attend_partition_avx512<4, T, K>;
        case 256: return attend_partition_avx512<8, T, K>;
    }
#endif
#if defined(__AVX2__)
    switch (D) {
        case 32: return attend_partition_vec<Vec, 32, T, K>;
        case 64: return attend_partition_vec<Vec, 64, T, K>;
        case 80: return attend_partition_vec<Vec, 80, T, K>;
        case 96: return attend_partition_vec<Vec, 96, T, K>;
        case 128: return attend_partition_vec<Vec, 128, T, K>;
        case 256: return attend_partition_vec<Vec, 256, T, K>;
    }
#endif
    return nullptr;
}

// How one sequence's context splits into partitions: a function of its own length (and of the
// thread count and KV heads, fixed for an engine), never of the batch around it, so a row's
// arithmetic is the same alone or in any batch (batch-invariant greedy output). Enough parts
// of partition_size tokens at most, rounded up to a multiple of `balance` (threads /
// gcd(threads, KV heads): 3 KV heads over 2 threads take 2 parts each, 6 items, 3 a thread, where
// whole heads left one thread 2 and the other 1: flash-decoding), but no part under kMinPart
// tokens; parts hold a multiple of 16 tokens (whole vectors of scores). Measured on Zen 3 (2 threads,
// cold KV): one KV head (Gemma 3 1B's) at 200 tokens 1.6x faster; 3 KV heads no change.
constexpr int64_t kMinPart = 64;
struct Split {
    int64_t parts, size;     // partitions and tokens in each (the last may hold fewer, or none)
};
inline Split split_context(int64_t len, int64_t partition_size, int64_t balance) {
    const int64_t base = std::max<int64_t>(1, (len + partition_size - 1) / partition_size);
    const int64_t most = std::max(base, len / kMinPart);
    const int64_t parts = std::max(base, std::min(most, (base + balance - 1) / balance * balance));
    const int64_t size = std::min(partition_size, ((len + parts - 1) / parts + 15) / 16 * 16);
    return {parts, size};
}

template <typename T, typename K = T>
int paged_decode(const T *q, int64_t q_stride, const K *kc, const K *vc, const int64_t *tables, int64_t table_stride,
                 const int64_t *seq_lens, T *out, int64_t N, int64_t Hq, int64_t Hkv, int64_t D, int64_t B, Layout L,
                 float scale, int64_t partition_size, int64_t window = 0, const ScoreMods &mods = {0.f, nullptr}) {
    const int64_t G = Hq / Hkv;
    if (G > kMaxGroup || D > kMaxDim || B > kMaxBlock || Hq % Hkv || partition_size > kMaxPartition) return 1;
    const auto fast = pick_partition_kernel<T, K>(D);
    // A sliding window: the query at position len - 1 reads positions len - window .. len - 1 only
    // (the table's blocks before them are never touched); partitions split that span.
    auto first = [&](int64_t i) { return window > 0 ? std::max<int64_t>(0, seq_lens[i] - window) : int64_t{0}; };
    // Contexts are split into partitions (parallel work for few queries, and each partition's
    // keys, values and scores stay in L1/L2); a sequence's partial results are merged by the
    // thread that finishes its last partition (no second parallel region). A sequence of one
    // partition writes straight to `out`.
    // (Whole contexts as one partition measured 13% slower at 16 queries x 1500 tokens.)
    const int threads = omp_get_max_threads();
    const int64_t balance = threads / std::gcd<int64_t>(threads, Hkv);
    std::vector<Split> split(N);
    std::vector<int64_t> offset(N + 1, 0);      // each sequence's first partition in `parts`
    int64_t P = 1;
    for (int64_t i = 0; i < N; i++) {
        split[i] = split_context(seq_lens[i] - first(i), partition_size, balance);
        P = std::max(P, split[i].parts);
        offset[i + 1] = offset[i] + (split[i].parts > 1 ? split[i].parts : 0);
    }
    const int64_t stride = G * (2 + D);
    std::vector<float> parts(offset[N] * Hkv * stride);
    std::unique_ptr<std::atomic<int64_t>[]> done(P > 1 ? new std::atomic<int64_t>[N * Hkv]() : nullptr);

    // Heads innermost: with enough (sequence, partition) items to share, one thread takes all
    // KV heads of an item, so each cached row (all heads of a token) streams from memory once.
    const int64_t chunk = N * P >= 4 * threads ? Hkv : 1;
#pragma omp parallel for collapse(3) schedule(dynamic, chunk)
    for (int64_t i = 0; i < N; i++)
        for (int64_t j = 0; j < P; j++)
            for (int64_t h = 0; h < Hkv; h++) {
                const Split sp = split[i];
                if (j >= sp.parts) continue;
                thread_local std::vector<float> own;        // the item's state when it is the sequence's only one
                float *p;
                if (sp.parts > 1) {
                    p = parts.data() + ((offset[i] + j) * Hkv + h) * stride;
                } else {
                    own.assign(stride, 0.f);
                    p = own.data();
                }
                for (int64_t g = 0; g < G; g++) p[g] = -INFINITY;      // m; l and acc start at 0
                const int64_t t0 = first(i) + j * sp.size, t1 = std::min(t0 + sp.size, seq_lens[i]);
                if (t0 < t1) {
                    const T *qg = q + i * q_stride + h * G * D;      // the G query heads of KV head h
                    if (fast) {
                        fast(qg, scale, mods.softcap, kc, vc, tables + i * table_stride, t0, t1, h, L, B, G, p);
                    } else {
                        float qf[kMaxGroup * kMaxDim];
                        for (int64_t d = 0; d < G * D; d++) qf[d] = to_f32(qg[d]) * scale;
                        attend_partition(qf, mods.softcap, kc, vc, tables + i * table_stride, t0, t1, h, L, D, B, G, p);
                    }
                }
                if (sp.parts == 1) {
                    for (int64_t g = 0; g < G; g++) {
                        T *dst = out + (i * Hq + h * G + g) * D;
                        const float l = with_sink(p[G + g], p[g], mods, h * G + g);
                        for (int64_t d = 0; d < D; d++) store(dst + d, p[2 * G + g * D + d] / l);
                    }
                } else if (done[i * Hkv + h].fetch_add(1, std::memory_order_acq_rel) == sp.parts - 1) {
                    // the last partition of (i, h) to finish: merge them all, in partition order
                    const float *ps = parts.data() + (offset[i] * Hkv + h) * stride;
                    for (int64_t g = 0; g < G; g++) {
                        float m = -INFINITY;
                        for (int64_t k = 0; k < sp.parts; k++) m = std::max(m, ps[k * Hkv * stride + g]);
                        float l = 0.f, o[kMaxDim] = {0.f};
                        for (int64_t k = 0; k < sp.parts; k++) {
                            const float *pk = ps + k * Hkv * stride;
                            const float c = std::exp(pk[g] - m);     // 0 for an empty partition
                            l += c * pk[G + g];
                            const float *a = pk + 2 * G + g * D;
                            for (int64_t d = 0; d < D; d++) o[d] += c * a[d];
                        }
                        l = with_sink(l, m, mods, h * G + g);
                        T *dst = out + (i * Hq + h * G + g) * D;
                        for (int64_t d = 0; d < D; d++) store(dst + d, o[d] / l);
                    }
                }
            }
    return 0;
}

}  // namespace
