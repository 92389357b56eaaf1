// Decode attention's plain partition loop and the key/value row pointers of a partition.
// Part of cpu_kernels (csrc/cpu_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {
// One partition's state for G heads: m[G], l[G], acc[G][D], laid out in `p`.
template <typename T>
void attend_partition(const float *q, float softcap, const T *kc, const T *vc, const int64_t *table, int64_t t0,
                      int64_t t1, int64_t h, Layout L, int64_t D, int64_t B, int64_t G, float *p) {
    // T: the cache's element type (the query is float32 and scaled already); 8-bit rows carry
    // their scale. softcap: ScoreMods.softcap (0: none).
    float *m = p, *l = p + G, *acc = p + 2 * G;
    float s[kMaxBlock];
    for (int64_t start = t0; start < t1;) {
        const int64_t blk = table[start / B], off = start % B;
        const int64_t n = std::min(B - off, t1 - start);
        const T *kb = kc + blk * L.block + off * L.token + h * L.head;
        const T *vb = vc + blk * L.block + off * L.token + h * L.head;
        for (int64_t g = 0; g < G; g++) {
            const float *qg = q + g * D;
            float mx = m[g];
            for (int64_t t = 0; t < n; t++) {
                const T *kt = kb + t * L.token;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; d++) dot += qg[d] * to_f32(kt[d]);
                if constexpr (kScaled<T>) dot *= row_scale(kt, D);
                if (softcap != 0.f) dot = softcap1(dot, softcap);
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
                const T *vt = vb + t * L.token;
                const float wv = w * row_scale(vt, D);
#pragma omp simd
                for (int64_t d = 0; d < D; d++) a[d] += wv * to_f32(vt[d]);
            }
            l[g] = sum;
        }
        start += n;
    }
}

// Where the key and value rows of tokens t0..t1 of KV head h are: walks the block table.
template <typename T>
void row_pointers(const T *kc, const T *vc, const int64_t *table, int64_t t0, int64_t t1, int64_t h, Layout L,
                  int64_t B, const T **krow, const T **vrow) {
    for (int64_t t = 0, pos = t0; pos < t1;) {
        const int64_t off = pos % B, count = std::min(B - off, t1 - pos);
        const int64_t row = table[pos / B] * L.block + off * L.token + h * L.head;
        for (int64_t c = 0; c < count; c++, t++) {
            krow[t] = kc + row + c * L.token;
            vrow[t] = vc + row + c * L.token;
        }
        pos += count;
    }
}
}  // namespace
