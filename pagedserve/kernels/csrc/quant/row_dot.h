// One weight row against NT activation rows, every type and build (row_dot, row_dot2).
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {
#if defined(__AVX2__)

// acc += row w's dots with activation rows t0 .. t0 + NT, from unit (block, super-block) u on.
template <int QT, int NT>
inline void row_acc(Acc<NT> &acc, const uint8_t *w, const Act &a, int64_t t0, int64_t u) {
    const int64_t units = a.K / kElems[QT];
    const int8_t *qa = a.q + t0 * a.K;
    const float *da = a.d + t0 * a.nb, *dsa = a.ds + t0 * a.nb;
    constexpr int P = kPieces<QT>;
#if defined(PS_DOTS512)
    const int32_t *sta = a.start[QT] == nullptr ? nullptr : a.start[QT] + t0 * (a.K / 4);   // Act::start of row t0
    // (the 32-element types: one chain of sums per row whatever NT, so that a row's result does not
    // depend on the batch: batch invariance, issue 51; row_dot2 keeps it too)
    if constexpr (P == 1) {
        for (; u + 16 <= units; u += 16)
            group16<QT, NT>(&acc, a, qa + u * 32, da + u, dsa + u, sta + u * 8, w + u * kBytes[QT]);
        for (; u + 2 <= units; u += 2) pair32<QT, NT>(acc, a, qa + u * 32, da + u, dsa + u, sta + u * 8, w + u * kBytes[QT]);
    } else {
        for (; u < units; u++)
            superblock<QT, NT>(acc, a, qa + u * 256, da + u * 8, dsa + u * 8, t0, u * 256,
                               w + u * kBytes[QT]);
    }
#else
    if constexpr (P == 1 && NT <= 2) {   // few rows: two chains of sums (AVX2 / AVX-VNNI)
        for (; u + 8 <= units; u += 8) group8<QT, NT>(acc, a, qa + u * 32, da + u, dsa + u, w + u * kBytes[QT]);
        Acc<NT> other;
        for (; u + 2 <= units; u += 2) {
            Piece p0, p1;
            decode<QT>(w + u * kBytes[QT], &p0);
            decode<QT>(w + (u + 1) * kBytes[QT], &p1);
            accumulate<QT, NT>(acc, a, qa + u * 32, da + u, dsa + u, p0);
            accumulate<QT, NT>(other, a, qa + (u + 1) * 32, da + u + 1, dsa + u + 1, p1);
        }
        for (int t = 0; t < NT; t++) {
            acc.v[t] = _mm256_add_ps(acc.v[t], other.v[t]);
            acc.s[t] += other.s[t];
        }
    }
#endif
    for (; u < units; u++) {          // 256-bit pieces (every unit on AVX2 / AVX-VNNI; an odd last block here)
        Piece p[P];
        decode<QT>(w + u * kBytes[QT], p);
        for (int i = 0; i < P; i++) {
            const int64_t j = u * P + i;
            accumulate<QT, NT>(acc, a, qa + j * 32, da + j, dsa + j, p[i]);
        }
    }
}

template <int QT, int NT>
void row_dot(const uint8_t *w, const Act &a, int64_t t0, float *out, int64_t ldo) {
    Acc<NT> acc;
    row_acc<QT, NT>(acc, w, a, t0, 0);
    for (int t = 0; t < NT; t++) out[t * ldo] = acc.total(t);
}

#if defined(PS_DOTS512)
// kPassRows weight rows (w, w + ldw, ..) against one activation row (T = 1; all types but q5_0 /
// q5_1): each group's activations (and Act::start) loaded once for them all, and fewer calls per row.
constexpr int kPassRows = 2;
template <int QT>
void row_dot2(const uint8_t *w, int64_t ldw, const Act &a, float *out) {
    constexpr int R = kPassRows;
    Acc<1> acc[R];
    const int64_t units = a.K / kElems[QT];
    const int32_t *sta = a.start[QT];
    // The same bytes of rows further on, kFarPasses times (prefetch.h): rows of 1 KiB or more, the
    // next pass's (measured at the 1.7B shape from memory, 24 layers in huge pages, with prefetcht0:
    // 1.06x on q4_0 and the Q4_K_M mix over about 4 KiB ahead); shorter rows, about 4 KiB ahead (the
    // 135M shape's q4_1, K = 576, from L3: 1.08x over the next pass).
    const int64_t ahead = kFarPasses * (ldw >= 1024 ? R : prefetch_rows(ldw, R)) * ldw;
    int64_t u = 0;
    if constexpr (kPieces<QT> == 1) {
        for (; u + 16 <= units; u += 16) {
            prefetch_bytes(w + ahead + u * kBytes[QT], ldw, R, 16 * kBytes[QT]);
            group16<QT, 1, R>(acc, a, a.q + u * 32, a.d + u, a.ds + u, sta + u * 8, w + u * kBytes[QT], ldw);
        }
        for (; u + 2 <= units; u += 2)     // the rows' tails in pairs of blocks here (no row_acc call per row)
            for (int r = 0; r < R; r++)
                pair32<QT, 1>(acc[r], a, a.q + u * 32, a.d + u, a.ds + u, sta + u * 8, w + r * ldw + u * kBytes[QT]);
    } else {                     // super-blocks: the rows' streams interleaved (independent chains)
        for (; u < units; u++) {
            prefetch_bytes(w + ahead + u * kBytes[QT], ldw, R, kBytes[QT]);
            for (int r = 0; r < R; r++)
                superblock<QT, 1>(acc[r], a, a.q + u * 256, a.d + u * 8, a.ds + u * 8, 0, u * 256,
                                  w + r * ldw + u * kBytes[QT]);
        }
    }
    for (int r = 0; r < R; r++) {
        if (u < units) row_acc<QT, 1>(acc[r], w + r * ldw, a, 0, u);
        out[r] = acc[r].total(0);
    }
}
#endif
#else
// Plain loops over the same integers.
template <int QT, int NT>
void row_dot(const uint8_t *w, const Act &a, int64_t t0, float *out, int64_t ldo) {
    float acc[NT] = {};
    const int64_t units = a.K / kElems[QT];
    for (int64_t u = 0; u < units; u++) {
        const uint8_t *b = w + u * kBytes[QT];
        const int subs = int(kElems[QT] / 32);
        int codes[256], scale16[16];
        float A[8], C[8];
        for (int i = 0; i < 16; i++) scale16[i] = 1;
        for (int j = 0; j < 8; j++) C[j] = 0.f;
        if constexpr (QT == Q8_0) {
            for (int i = 0; i < 32; i++) codes[i] = int8_t(b[2 + i]);
            A[0] = f16(b);
        } else if constexpr (QT == Q4_0 || QT == Q4_1) {
            const uint8_t *qs = b + (QT == Q4_0 ? 2 : 4);
            const int off = QT == Q4_0 ? 8 : 0;
            for (int i = 0; i < 16; i++) codes[i] = (qs[i] & 15) - off, codes[i + 16] = (qs[i] >> 4) - off;
            A[0] = f16(b);
            if (QT == Q4_1) C[0] = f16(b + 2);
        } else if constexpr (QT == Q5_0 || QT == Q5_1) {
            const int o = QT == Q5_0 ? 2 : 4, off = QT == Q5_0 ? 16 : 0;
            uint32_t qh;
            std::memcpy(&qh, b + o, 4);
            for (int i = 0; i < 16; i++) {
                codes[i] = ((b[o + 4 + i] & 15) | (((qh >> i) & 1) << 4)) - off;
                codes[i + 16] = ((b[o + 4 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - off;
            }
            A[0] = f16(b);
            if (QT == Q5_1) C[0] = f16(b + 2);
        } else if constexpr (QT == Q4_K || QT == Q5_K) {
            const float d = f16(b), dmin = f16(b + 2);
            int sc[8], mn[8];
            k_scales(b + 4, sc, mn);
            const uint8_t *qh = b + 16, *qs = b + (QT == Q4_K ? 16 : 48);
            for (int j = 0; j < 8; j++) {
                for (int l = 0; l < 32; l++) {
                    int v = (qs[(j / 2) * 32 + l] >> ((j % 2) * 4)) & 15;
                    if (QT == Q5_K) v |= ((qh[l] >> j) & 1) << 4;
                    codes[j * 32 + l] = v;
                }
                A[j] = d * float(sc[j]);
                C[j] = -(dmin * float(mn[j]));
            }
        } else if constexpr (QT == Q4_0X) {
            for (int l = 0; l < 8; l++) {
                for (int i = 0; i < 16; i++) {
                    const uint8_t q = q4_0x_byte(b, l, i);
                    codes[32 * l + i] = (q & 15) - 8, codes[32 * l + i + 16] = (q >> 4) - 8;
                }
                A[l] = f16(b + 2 * l);
            }
        } else if constexpr (QT == Q6_K) {
            const int8_t *sc = reinterpret_cast<const int8_t *>(b + 192);
            const float d = f16(b + 208);
            for (int h = 0; h < 2; h++)
                for (int k = 0; k < 4; k++)
                    for (int l = 0; l < 32; l++) {
                        const int lo = (b[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 15;
                        const int hi = (b[128 + 32 * h + l] >> (2 * k)) & 3;
                        codes[128 * h + 32 * k + l] = (lo | (hi << 4)) - 32;
                    }
            for (int g = 0; g < 16; g++) scale16[g] = sc[g];
            for (int j = 0; j < 8; j++) A[j] = d;
        }
        for (int s = 0; s < subs; s++) {
            const int64_t j = u * subs + s;
            for (int t = 0; t < NT; t++) {
                const int8_t *q = a.q + (t0 + t) * a.K + j * 32;
                int dot0 = 0, dot1 = 0;
                for (int i = 0; i < 16; i++) {
                    dot0 += codes[s * 32 + i] * q[i];
                    dot1 += codes[s * 32 + 16 + i] * q[16 + i];
                }
                const int dot = dot0 * scale16[2 * s] + dot1 * scale16[2 * s + 1];
                acc[t] += (A[s] * a.d[(t0 + t) * a.nb + j]) * float(dot);
                acc[t] += C[s] * a.ds[(t0 + t) * a.nb + j];
            }
        }
    }
    for (int t = 0; t < NT; t++) out[t * ldo] = acc[t];
}
#endif

#if defined(PS_DOTS512)
constexpr int kMaxNT = 8;       // activation rows per pass over a weight row (32 vector registers)
#else
constexpr int kMaxNT = 4;
#endif

using RowFn = void (*)(const uint8_t *, const Act &, int64_t, float *, int64_t);

template <int QT, int... NT>
constexpr RowFn pick(int nt, std::integer_sequence<int, NT...>) {
    RowFn fn = nullptr;
    ((nt == NT + 1 ? (fn = row_dot<QT, NT + 1>, 0) : 0), ...);
    return fn;
}

template <int QT>
RowFn row_fn(int nt) { return pick<QT>(nt, std::make_integer_sequence<int, kMaxNT>{}); }

RowFn row_fn(int qt, int nt) {
    if (qt == MXFP4) return mxfp4_row_fn(nt);
    return with_qtype(qt, [nt](auto q) { return row_fn<decltype(q)::value>(nt); });
}

using Row2Fn = void (*)(const uint8_t *, int64_t, const Act &, float *);
Row2Fn row2_fn(int qt) {         // two rows at T = 1 (null: none for this type / variant)
#if defined(PS_DOTS512)
    switch (qt) {
    case Q4_0: return row_dot2<Q4_0>;
    case Q4_1: return row_dot2<Q4_1>;
    case Q8_0: return row_dot2<Q8_0>;
    case Q4_K: return row_dot2<Q4_K>;
    case Q5_K: return row_dot2<Q5_K>;
    case Q6_K: return row_dot2<Q6_K>;
    case Q4_0X: return row_dot2<Q4_0X>;
    }                            // (q5_0, q5_1: slower in pairs, measured: their fifth bits' masks)
#endif
    (void)qt;
    return nullptr;
}
}  // namespace
