// One step's attention (decode rows, then prefill chunks): paged_attention_*.
// Part of cpu_kernels (csrc/cpu_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

// ---- one step's attention: decode rows, then prefill chunks -----------------------------------
namespace {
struct AttentionRows {   // laid out by kernels/cpu.py (AttentionRows) from the step's metadata
    const int64_t *tables;
    int64_t table_stride;
    const int64_t *seq_lens, *query_start;   // per sequence; decodes (one query each) first
    int64_t num_seqs, num_decodes;
    const int64_t *token_tables;             // per query token (null without prefills): each token
    int64_t token_table_stride;              // as a sequence of its own over its causal prefix
    const int64_t *token_lens;
    int64_t window;                          // a sliding window (a hybrid model's KV group); 0: none
    int64_t num_verify;                      // verification chunks after the decodes: their rows
};                                           // attend one by one as decode rows (token_tables)

// Decode rows through the decode kernel; verification chunks' rows too, one by one (so that
// speculation's arithmetic is plain decoding's); prefill chunks through the tiled prefill kernel
// where the build has one (AVX2 and up) and the shape fits, else each prefill token through the
// decode kernel. With a sliding window every query reads only its window's rows (the decode
// kernel starts each at its length - window; the prefill tiles start at the first query's
// window and mask each row's). mods: the layer's soft-capping and sinks, on every path.
template <typename T, typename K = T>
int attend(const T *q, int64_t q_stride, const K *kc, const K *vc, const AttentionRows &a, int64_t num_tokens, T *out,
           int64_t Hq, int64_t Hkv, int64_t D, int64_t B, Layout L, float scale, int64_t partition_size,
           const ScoreMods &mods) {
    if (a.num_decodes == a.num_seqs)
        return paged_decode(q, q_stride, kc, vc, a.tables, a.table_stride, a.seq_lens, out, num_tokens, Hq, Hkv, D, B,
                            L, scale, partition_size, a.window, mods);
#ifdef __AVX2__
    const int64_t nd = a.num_decodes, nv = nd + a.num_verify, r0 = a.query_start[nd], r1 = a.query_start[nv];
    if (nd && paged_decode(q, q_stride, kc, vc, a.tables, a.table_stride, a.seq_lens, out, nd, Hq, Hkv, D, B, L,
                           scale, partition_size, a.window, mods))
        return 1;
    if (r1 > r0 && paged_decode(q + r0 * q_stride, q_stride, kc, vc, a.token_tables + r0 * a.token_table_stride,
                                a.token_table_stride, a.token_lens + r0, out + r0 * Hq * D, r1 - r0, Hq, Hkv, D, B, L,
                                scale, partition_size, a.window, mods))
        return 1;
    if (nv == a.num_seqs ||
        paged_prefill(q + r1 * q_stride, q_stride, kc, vc, a.tables + nv * a.table_stride, a.table_stride,
                      a.seq_lens + nv, a.query_start + nv, a.num_seqs - nv, out + r1 * Hq * D, Hq, Hkv, D, B, L,
                      scale, a.window, mods) == 0)
        return 0;
#endif
    if (a.token_tables == nullptr) return 1;
    return paged_decode(q, q_stride, kc, vc, a.token_tables, a.token_table_stride, a.token_lens, out, num_tokens, Hq,
                        Hkv, D, B, L, scale, partition_size, a.window, mods);
}
const ScoreMods kNoMods{0.f, nullptr};
inline const ScoreMods &mods_or_none(const ScoreMods *m) { return m ? *m : kNoMods; }
}  // namespace

extern "C" {
int paged_attention_f32(const float *q, int64_t q_stride, const float *kc, const float *vc, const AttentionRows *a,
                        int64_t num_tokens, float *out, int64_t Hq, int64_t Hkv, int64_t D, int64_t B,
                        int64_t block_stride, int64_t token_stride, int64_t head_stride, float scale,
                        int64_t partition_size, const ScoreMods *mods) {
    return attend(q, q_stride, kc, vc, *a, num_tokens, out, Hq, Hkv, D, B,
                  Layout{block_stride, token_stride, head_stride}, scale, partition_size, mods_or_none(mods));
}
int paged_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *kc, const uint16_t *vc,
                         const AttentionRows *a, int64_t num_tokens, uint16_t *out, int64_t Hq, int64_t Hkv, int64_t D,
                         int64_t B, int64_t block_stride, int64_t token_stride, int64_t head_stride, float scale,
                         int64_t partition_size, const ScoreMods *mods) {
    return attend(q, q_stride, kc, vc, *a, num_tokens, out, Hq, Hkv, D, B,
                  Layout{block_stride, token_stride, head_stride}, scale, partition_size, mods_or_none(mods));
}
}

// Over an 8-bit cache (`code`: KVCode; strides in bytes).
namespace {
template <typename F>
int with_kv_format(int64_t code, F f) {
    switch (code) {
        case kE5M2: return f(static_cast<const E5M2 *>(nullptr));
        case kE4M3: return f(static_cast<const E4M3 *>(nullptr));
        case kInt8: return f(static_cast<const I8 *>(nullptr));
    }
    return 1;
}
template <typename T>
int attend_kv8(const T *q, int64_t q_stride, const uint8_t *kc, const uint8_t *vc, const AttentionRows *a,
               int64_t num_tokens, T *out, int64_t Hq, int64_t Hkv, int64_t D, int64_t B, int64_t block_stride,
               int64_t token_stride, int64_t head_stride, float scale, int64_t partition_size, int64_t code,
               const ScoreMods *mods) {
    return with_kv_format(code, [&](auto tag) {
        using K = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
        return attend(q, q_stride, reinterpret_cast<const K *>(kc), reinterpret_cast<const K *>(vc), *a, num_tokens,
                      out, Hq, Hkv, D, B, Layout{block_stride, token_stride, head_stride}, scale, partition_size,
                      mods_or_none(mods));
    });
}
}  // namespace

extern "C" {
int paged_attention_kv8_f32(const float *q, int64_t q_stride, const uint8_t *kc, const uint8_t *vc,
                            const AttentionRows *a, int64_t num_tokens, float *out, int64_t Hq, int64_t Hkv, int64_t D,
                            int64_t B, int64_t block_stride, int64_t token_stride, int64_t head_stride, float scale,
                            int64_t partition_size, int64_t code, const ScoreMods *mods) {
    return attend_kv8(q, q_stride, kc, vc, a, num_tokens, out, Hq, Hkv, D, B, block_stride, token_stride,
                      head_stride, scale, partition_size, code, mods);
}
int paged_attention_kv8_bf16(const uint16_t *q, int64_t q_stride, const uint8_t *kc, const uint8_t *vc,
                             const AttentionRows *a, int64_t num_tokens, uint16_t *out, int64_t Hq, int64_t Hkv,
                             int64_t D, int64_t B, int64_t block_stride, int64_t token_stride, int64_t head_stride,
                             float scale, int64_t partition_size, int64_t code, const ScoreMods *mods) {
    return attend_kv8(q, q_stride, kc, vc, a, num_tokens, out, Hq, Hkv, D, B, block_stride, token_stride,
                      head_stride, scale, partition_size, code, mods);
}
}
