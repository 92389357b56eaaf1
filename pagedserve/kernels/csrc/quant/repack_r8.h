// Q4_1R8 rows unpacked into q4_1's file layout (PlainParts).
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {
// Q4_1R8 (see QType): row l's block of the unit at u, in q4_1's file layout (20 bytes at b).
inline void r8_block(const uint8_t *u, int l, uint8_t *b) {
    std::memcpy(b, u + 2 * l, 2);
    std::memcpy(b + 2, u + 16 + 2 * l, 2);
    std::memcpy(b + 4, u + 32 + 8 * l, 8);
    std::memcpy(b + 12, u + 96 + 8 * l, 8);
}

// Group g's 8 rows in q4_1's file layout into rows (row_bytes apart).
void unpack_r8(const uint8_t *g, int64_t nb, uint8_t *rows, int64_t row_bytes) {
    for (int64_t j = 0; j < nb; j++)
        for (int l = 0; l < 8; l++) r8_block(g + j * 160, l, rows + l * row_bytes + j * 20);
}

// The parts with each Q4_1R8 part unpacked into the file's layout (a buffer of the calling
// thread's, kept between calls; both threads unpack): for the paths that read rows (the tiles,
// the other ISA variants).
struct PlainParts {
    std::vector<QuantPart> parts;
    PlainParts(const QuantPart *in, int64_t nparts, int64_t K) : parts(in, in + nparts) {
        static thread_local std::vector<uint8_t> buf;
        const int64_t row_bytes = K / kElems[Q4_1] * kBytes[Q4_1];
        int64_t need = 0;
        for (int64_t p = 0; p < nparts; p++)
            if (in[p].qtype == Q4_1R8) need += in[p].rows * row_bytes;
        if (static_cast<int64_t>(buf.size()) < need) buf.resize(need);
        int64_t at = 0;
        for (int64_t p = 0; p < nparts; p++) {
            if (in[p].qtype != Q4_1R8) continue;
            uint8_t *dst = buf.data() + at;
            const QuantPart q = in[p];
#pragma omp parallel for schedule(static) if (q.rows * K >= 65536)
            for (int64_t g = 0; g < q.rows / 8; g++)
                unpack_r8(q.w + g * q.ldw, K / kElems[Q4_1], dst + 8 * g * row_bytes, row_bytes);
            parts[p] = {Q4_1, dst, row_bytes, q.rows};
            at += q.rows * row_bytes;
        }
    }
};
bool any_r8(const QuantPart *parts, int64_t nparts) {
    for (int64_t p = 0; p < nparts; p++)
        if (parts[p].qtype == Q4_1R8) return true;
    return false;
}
}  // namespace
