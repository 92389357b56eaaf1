// LoRA deltas' tables and the shrink / expand products over Vec.
// Part of cpu_kernels (csrc/cpu_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {

// LoRA deltas (lora/weights.py LoRAStep, kernels/cpu.py LoraTable). Per layer and projection
// the step's slot range (span slots from lo) is a view of lora/weights.py's stacked tensors:
// A [span * K, in] and BT [span * K, ldb] (K = nparts * R rank rows per slot, R per part; BT
// row k of a slot holds part k / R's rank row in that part's output columns). row_block[t] is
// row t's slot less lo (negative: a base row, which costs nothing). The rows are grouped by
// slot into blocks of up to kLoraRows, and each block's delta uses only its own slot's
// weights, only the rank rows its adapter fills (slot_info): u = x @ A_s.T, rounded to T as
// a T GEMM would; then y += u @ BT_s, added in float32 and rounded into y once. Work grows
// with the rows, not rows x adapters; each slot's weights are read once per block.
struct LoraProj {
    int64_t a, bt, ldb, nparts;  // the range's A and BT (0: no delta), BT's row length, parts
    int64_t offset[3], size[3];  // each part's first output column and count
    int64_t btp;                 // BT in rank pairs [span * K / 2, ldb, 2] (bf16 AMX tiles' B), or 0
};
struct LoraRefs {
    const LoraProj *layers;      // [layers][4]: qkv, o, gate_up, down
    const int64_t *row_block;    // [T]
    int64_t rank;                // R: rank rows per part and slot
    const int64_t *slot_info;    // [span][4]: the adapter's rank | (parts it targets, a bit each) << 16
    int64_t span;
};

constexpr int kLoraRows = 4;
constexpr int kAheadCols = 2;     // rows of one slot per block: each weight load serves them all

// u[i][k0 + k] (ldu) for k < NK, i < NR: the rows xr dotted with rows k0.. of A (rows lda
// apart) over len inputs, in float32 (a partial sum: lora_delta rounds the whole sum).
// NR and NK fixed at compile time so the sums stay in registers.
template <class V, int NR, int NK, typename T>
void lora_shrink_tile(const T *const *xr, const T *a, int64_t lda, int64_t k0, int64_t len, float *u, int64_t ldu) {
    using Reg = typename V::reg;
    constexpr int W = V::W;
    const int64_t body = len / W * W;
    Reg acc[NK][NR];
    for (int k = 0; k < NK; k++)
        for (int i = 0; i < NR; i++) acc[k][i] = V::zero();
    const T *next = a + (k0 + NK) * lda;    // the next tile's rows: requested while these are summed
    for (int64_t c = 0; c < body; c += W) {
        Reg w[NK];
        for (int k = 0; k < NK; k++) __builtin_prefetch(next + k * lda + c, 0, 3);
        for (int k = 0; k < NK; k++) w[k] = V::load(a + (k0 + k) * lda + c);
        for (int i = 0; i < NR; i++) {
            const Reg xv = V::load(xr[i] + c);
            for (int k = 0; k < NK; k++) acc[k][i] = V::fmadd(xv, w[k], acc[k][i]);
        }
    }
    for (int k = 0; k < NK; k++)
        for (int i = 0; i < NR; i++) {
            float s = V::reduce_add(acc[k][i]);
            for (int64_t c = body; c < len; c++) s += to_f32(xr[i][c]) * to_f32(a[(k0 + k) * lda + c]);
            u[i * ldu + k0 + k] = s;
        }
}

template <class V, int NR, typename T>
void lora_shrink_rows(const T *const *xr, const T *a, int64_t lda, int64_t r, int64_t len, float *u, int64_t ldu) {
    constexpr int KA = V::W == 16 ? 4 : 2;
    int64_t k0 = 0;
    for (; k0 + KA <= r; k0 += KA) lora_shrink_tile<V, NR, KA>(xr, a, lda, k0, len, u, ldu);
    for (; k0 < r; k0++) lora_shrink_tile<V, NR, 1>(xr, a, lda, k0, len, u, ldu);
}

// u[i][k] (ldu) for the block's n rows xr and the r rows of A (rows lda apart), over len inputs.
template <class V, typename T>
void lora_shrink(const T *const *xr, int n, const T *a, int64_t lda, int64_t r, int64_t len, float *u, int64_t ldu) {
    static_assert(kLoraRows == 4);
    switch (n) {
        case 1: return lora_shrink_rows<V, 1>(xr, a, lda, r, len, u, ldu);
        case 2: return lora_shrink_rows<V, 2>(xr, a, lda, r, len, u, ldu);
        case 3: return lora_shrink_rows<V, 3>(xr, a, lda, r, len, u, ldu);
        default: return lora_shrink_rows<V, 4>(xr, a, lda, r, len, u, ldu);
    }
}

// y rows yr, columns [c0, c1) += sum over k < r of u[i][k] * b[k][c] (b's rows ldb apart):
// in float32, rounded into y once.
template <class V, int NR, typename T>
void lora_expand_rows(const float *u, int64_t ldu, const T *b, int64_t ldb, int64_t r, T *const *yr, int64_t c0,
                      int64_t c1) {
    using Reg = typename V::reg;
    constexpr int W = V::W, CV = W == 16 ? 4 : 2, CW = CV * W;
    int64_t c = c0;
    for (; c + CW <= c1; c += CW) {
        Reg acc[NR][CV];
        for (int i = 0; i < NR; i++)
            for (int v = 0; v < CV; v++) acc[i][v] = V::zero();
        for (int64_t k = 0; k < r; k++) {
            Reg w[CV];
            const char *ahead = reinterpret_cast<const char *>(b + k * ldb + c + kAheadCols * CW);
            for (size_t off = 0; off < CW * sizeof(T); off += 64) __builtin_prefetch(ahead + off, 0, 3);
            for (int v = 0; v < CV; v++) w[v] = V::load(b + k * ldb + c + v * W);
            for (int i = 0; i < NR; i++) {
                const Reg s = V::set1(u[i * ldu + k]);
                for (int v = 0; v < CV; v++) acc[i][v] = V::fmadd(s, w[v], acc[i][v]);
            }
        }
        for (int i = 0; i < NR; i++)
            for (int v = 0; v < CV; v++) {
                T *dst = yr[i] + c + v * W;
                V::store(dst, V::add(V::load(dst), acc[i][v]));
            }
    }
    for (; c + W <= c1; c += W) {       // a column piece's last vectors (pieces are 16-column aligned)
        Reg acc[NR];
        for (int i = 0; i < NR; i++) acc[i] = V::zero();
        for (int64_t k = 0; k < r; k++) {
            const Reg w = V::load(b + k * ldb + c);
            for (int i = 0; i < NR; i++) acc[i] = V::fmadd(V::set1(u[i * ldu + k]), w, acc[i]);
        }
        for (int i = 0; i < NR; i++) V::store(yr[i] + c, V::add(V::load(yr[i] + c), acc[i]));
    }
    for (; c < c1; c++)
        for (int i = 0; i < NR; i++) {
            float s = 0.f;
            for (int64_t k = 0; k < r; k++) s += u[i * ldu + k] * to_f32(b[k * ldb + c]);
            store(yr[i] + c, to_f32(yr[i][c]) + s);
        }
}

template <class V, typename T>
void lora_expand(const float *u, int64_t ldu, int n, const T *b, int64_t ldb, int64_t r, T *const *yr, int64_t c0,
                 int64_t c1) {
    switch (n) {
        case 1: return lora_expand_rows<V, 1>(u, ldu, b, ldb, r, yr, c0, c1);
        case 2: return lora_expand_rows<V, 2>(u, ldu, b, ldb, r, yr, c0, c1);
        case 3: return lora_expand_rows<V, 3>(u, ldu, b, ldb, r, yr, c0, c1);
        default: return lora_expand_rows<V, 4>(u, ldu, b, ldb, r, yr, c0, c1);
    }
}

}  // namespace
