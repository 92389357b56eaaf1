// One block of each type -> float32, plain loops (K-quant scales included).
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {
// q4_k / q5_k: 12 bytes -> 8 six-bit scales and mins.
void k_scales(const uint8_t *s, int sc[8], int mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 2) & 48);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 48);
    }
}

// k_scales four bytes at a time: the 8 scales' bytes and the 8 mins' bytes (byte j: sub-block j).
void k_scale_bytes(const uint8_t *s, uint64_t &sc, uint64_t &mn) {
    uint32_t s0, s1, s2;
    std::memcpy(&s0, s, 4);
    std::memcpy(&s1, s + 4, 4);
    std::memcpy(&s2, s + 8, 4);
    sc = uint64_t(s0 & 0x3f3f3f3fu) | uint64_t((s2 & 0x0f0f0f0fu) | ((s0 >> 2) & 0x30303030u)) << 32;
    mn = uint64_t(s1 & 0x3f3f3f3fu) | uint64_t(((s2 >> 4) & 0x0f0f0f0fu) | ((s1 >> 2) & 0x30303030u)) << 32;
}

// ---- dequantize: one block into kElems floats -------------------------------------------------
// Q4_0X (see QType): byte i (elements i, low nibble, and i + 16, high) of block l of the unit at b.
inline uint8_t q4_0x_byte(const uint8_t *b, int l, int i) { return b[16 + 64 * (i / 8) + 8 * l + i % 8]; }

void dequantize_block(int qt, const uint8_t *b, float *y) {
    switch (qt) {
    case Q8_0: {
        const float d = f16(b);
        for (int i = 0; i < 32; i++) y[i] = float(int8_t(b[2 + i])) * d;
        return;
    }
    case Q4_0X: {       // block l: d at 2 l, qs[i] at q4_0x_byte(b, l, i)
        for (int l = 0; l < 8; l++) {
            const float d = f16(b + 2 * l);
            for (int i = 0; i < 16; i++) {
                const uint8_t q = q4_0x_byte(b, l, i);
                y[32 * l + i] = d * float((q & 15) - 8);
                y[32 * l + i + 16] = d * float((q >> 4) - 8);
            }
        }
        return;
    }
    case Q4_0: case Q4_1: {
        const float d = f16(b);
        const uint8_t *qs = b + (qt == Q4_0 ? 2 : 4);
        if (qt == Q4_0) {
            for (int i = 0; i < 16; i++) {
                y[i] = d * float((qs[i] & 15) - 8);
                y[i + 16] = d * float((qs[i] >> 4) - 8);
            }
        } else {
            const float m = f16(b + 2);
            for (int i = 0; i < 16; i++) {
                y[i] = d * float(qs[i] & 15) + m;
                y[i + 16] = d * float(qs[i] >> 4) + m;
            }
        }
        return;
    }
    case Q5_0: case Q5_1: {
        const float d = f16(b);
        const int off = qt == Q5_0 ? 2 : 4;
        uint32_t qh;
        std::memcpy(&qh, b + off, 4);
        const uint8_t *qs = b + off + 4;
        for (int i = 0; i < 16; i++) {
            const int q0 = (qs[i] & 15) | (((qh >> i) & 1) << 4), q1 = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
            if (qt == Q5_0) {
                y[i] = d * float(q0 - 16);
                y[i + 16] = d * float(q1 - 16);
            } else {
                const float m = f16(b + 2);
                y[i] = d * float(q0) + m;
                y[i + 16] = d * float(q1) + m;
            }
        }
        return;
    }
    case Q4_K: case Q5_K: {
        const float d = f16(b), dmin = f16(b + 2);
        int sc[8], mn[8];
        k_scales(b + 4, sc, mn);
        const uint8_t *qh = b + 16, *qs = b + (qt == Q4_K ? 16 : 48);
        for (int j = 0; j < 8; j++) {
            const float dj = d * float(sc[j]), mj = dmin * float(mn[j]);
            const uint8_t *q = qs + (j / 2) * 32;
            const int shift = (j % 2) * 4;
            for (int l = 0; l < 32; l++) {
                int v = (q[l] >> shift) & 15;
                if (qt == Q5_K) v |= ((qh[l] >> j) & 1) << 4;
                y[j * 32 + l] = dj * float(v) - mj;
            }
        }
        return;
    }
    case Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = reinterpret_cast<const int8_t *>(b + 192);
        const float d = f16(b + 208);
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < 32; l++) {
                    const int e = 128 * h + 32 * k + l;
                    const int lo = (ql[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 15;
                    const int hi = (qh[32 * h + l] >> (2 * k)) & 3;
                    y[e] = (d * float(sc[e / 16])) * float((lo | (hi << 4)) - 32);
                }
        return;
    }
    }
}
}  // namespace
