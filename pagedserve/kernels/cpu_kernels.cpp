// Paged decode attention for CPUs: one query token per sequence, reading keys and values
// straight from their cache blocks through the block table (no gathered copy).
//
// Work is split over (sequence, KV head, context partition). The query heads that share
// a KV head (GQA) are processed together, so each key and value is loaded once for all of
// them. A partition keeps a running max, sum and weighted sum of values (online softmax);
// the partitions of one (sequence, head) are merged at the end. Math is float32 whatever
// the storage type (float32 or bfloat16).
//
// Layouts: q, out [N, Hq, D]; caches [num_blocks, B, Hkv, D]; block_tables [N, stride].
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kMaxGroup = 16, kMaxDim = 256, kMaxBlock = 256;

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) {
    uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline void store(float *dst, float x) { *dst = x; }
inline void store(uint16_t *dst, float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    *dst = static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);   // round to nearest even
}

// One partition's state for G heads: m[G], l[G], acc[G][D], laid out in `p`.
template <typename T>
void attend_partition(const float *q, const T *kc, const T *vc, const int64_t *table, int64_t t0, int64_t t1,
                      int64_t h, int64_t Hkv, int64_t D, int64_t B, int64_t G, float *p) {
    float *m = p, *l = p + G, *acc = p + 2 * G;
    float s[kMaxBlock];
    for (int64_t start = t0; start < t1;) {
        const int64_t blk = table[start / B], off = start % B;
        const int64_t n = std::min(B - off, t1 - start);
        const T *kb = kc + ((blk * B + off) * Hkv + h) * D;
        const T *vb = vc + ((blk * B + off) * Hkv + h) * D;
        for (int64_t g = 0; g < G; g++) {
            const float *qg = q + g * D;
            float mx = m[g];
            for (int64_t t = 0; t < n; t++) {
                const T *kt = kb + t * Hkv * D;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; d++) dot += qg[d] * to_f32(kt[d]);
                s[t] = dot;
                mx = std::max(mx, dot);
            }
            const float correction = std::exp(m[g] - mx);
            m[g] = mx;
            float sum = l[g] * correction;
            float *a = acc + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) a[d] *= correction;
            for (int64_t t = 0; t < n; t++) {
                const float w = std::exp(s[t] - mx);
                sum += w;
                const T *vt = vb + t * Hkv * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) a[d] += w * to_f32(vt[d]);
            }
            l[g] = sum;
        }
        start += n;
    }
}

template <typename T>
int paged_decode(const T *q, const T *kc, const T *vc, const int64_t *tables, int64_t table_stride,
                 const int64_t *seq_lens, T *out, int64_t N, int64_t Hq, int64_t Hkv, int64_t D, int64_t B,
                 float scale, int64_t partition_size) {
    const int64_t G = Hq / Hkv;
    if (G > kMaxGroup || D > kMaxDim || B > kMaxBlock || Hq % Hkv) return 1;
    int64_t max_len = 1;
    for (int64_t i = 0; i < N; i++) max_len = std::max(max_len, seq_lens[i]);
    const int64_t P = (max_len + partition_size - 1) / partition_size;
    const int64_t stride = G * (2 + D);
    std::vector<float> parts(N * Hkv * P * stride);

#pragma omp parallel for collapse(3) schedule(dynamic, 1)
    for (int64_t i = 0; i < N; i++)
        for (int64_t h = 0; h < Hkv; h++)
            for (int64_t j = 0; j < P; j++) {
                float *p = parts.data() + ((i * Hkv + h) * P + j) * stride;
                for (int64_t g = 0; g < G; g++) p[g] = -INFINITY;      // m; l and acc start at 0
                const int64_t t0 = j * partition_size, t1 = std::min(t0 + partition_size, seq_lens[i]);
                if (t0 >= t1) continue;
                float qf[kMaxGroup * kMaxDim];
                for (int64_t g = 0; g < G; g++)
                    for (int64_t d = 0; d < D; d++)
                        qf[g * D + d] = to_f32(q[(i * Hq + h * G + g) * D + d]) * scale;
                attend_partition(qf, kc, vc, tables + i * table_stride, t0, t1, h, Hkv, D, B, G, p);
            }

#pragma omp parallel for collapse(2)
    for (int64_t i = 0; i < N; i++)
        for (int64_t h = 0; h < Hkv; h++) {
            const float *ps = parts.data() + (i * Hkv + h) * P * stride;
            for (int64_t g = 0; g < G; g++) {
                float m = -INFINITY;
                for (int64_t j = 0; j < P; j++) m = std::max(m, ps[j * stride + g]);
                float l = 0.f, o[kMaxDim] = {0.f};
                for (int64_t j = 0; j < P; j++) {
                    const float *pj = ps + j * stride;
                    const float c = std::exp(pj[g] - m);     // 0 for an empty partition
                    l += c * pj[G + g];
                    const float *a = pj + 2 * G + g * D;
                    for (int64_t d = 0; d < D; d++) o[d] += c * a[d];
                }
                T *dst = out + (i * Hq + h * G + g) * D;
                for (int64_t d = 0; d < D; d++) store(dst + d, o[d] / l);
            }
        }
    return 0;
}

}  // namespace

extern "C" {
int paged_decode_f32(const float *q, const float *kc, const float *vc, const int64_t *tables, int64_t table_stride,
                     const int64_t *seq_lens, float *out, int64_t N, int64_t Hq, int64_t Hkv, int64_t D, int64_t B,
                     float scale, int64_t partition_size) {
    return paged_decode(q, kc, vc, tables, table_stride, seq_lens, out, N, Hq, Hkv, D, B, scale, partition_size);
}
int paged_decode_bf16(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int64_t *tables,
                      int64_t table_stride, const int64_t *seq_lens, uint16_t *out, int64_t N, int64_t Hq,
                      int64_t Hkv, int64_t D, int64_t B, float scale, int64_t partition_size) {
    return paged_decode(q, kc, vc, tables, table_stride, seq_lens, out, N, Hq, Hkv, D, B, scale, partition_size);
}
}

// ---- small-batch linear layers in bfloat16 ---------------------------------------------------
// y[M, N] = x[M, K] @ w[N, K]^T for a handful of rows (decode with few sequences). Such a
// product is bound by reading w once; the AVX512-BF16 dot-product instruction multiplies
// bf16 pairs exactly and accumulates in float32, so each weight row streams from memory once
// for all M rows of x. Returns 1 where the CPU lacks AVX512-BF16 (the caller falls back).
#ifdef __AVX512BF16__
#include <immintrin.h>

namespace {
constexpr int kMaxRows = 8;

inline __m512bh load_bh(const uint16_t *p, __mmask32 mask) {
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

void linear_rows(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M, int64_t N,
                 int64_t K, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        __m512 acc[kMaxRows];
        for (int64_t m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
        const uint16_t *wr = w + n * K;
        for (int64_t k = 0; k < K; k += 32) {
            const __mmask32 mask = K - k >= 32 ? 0xFFFFFFFFu : ((1u << (K - k)) - 1);
            const __m512bh wv = load_bh(wr + k, mask);
            for (int64_t m = 0; m < M; m++) acc[m] = _mm512_dpbf16_ps(acc[m], wv, load_bh(x + m * K + k, mask));
        }
        const float b = bias ? to_f32(bias[n]) : 0.f;
        for (int64_t m = 0; m < M; m++) store(y + m * N + n, _mm512_reduce_add_ps(acc[m]) + b);
    }
}
}  // namespace

extern "C" int linear_bf16_small(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M,
                                 int64_t N, int64_t K) {
    if (M > kMaxRows) return 1;
    const int64_t chunk = 64;   // output rows per task: large enough to stream, many tasks to share
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += chunk) linear_rows(x, w, bias, y, M, N, K, n0, std::min(n0 + chunk, N));
    return 0;
}
#else
extern "C" int linear_bf16_small(const uint16_t *, const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t,
                                 int64_t) {
    return 1;
}
#endif
