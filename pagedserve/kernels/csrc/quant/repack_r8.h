// The r8 layouts (Q4_1R8, Q4_0R8, Q8_0R8, Q5_0R8, Q4_KR8, Q5_KR8, Q6_KR8, MXFP4R8: see QType): a unit is one block
// (or super-block) of 8 rows; each field of the file's block (R8Field: start, bytes, piece), in the
// block's order, lies in pieces: piece k of row l at 8 * start + piece * (8 k + l) (q6_k's at 8 * at
// instead: its unit in the order its dot reads it; quant_format.py's R8_FIELDS: the same table).
// So q4_1r8 is their 8 fp16 d, 8 fp16 m, then vectors of 64 bytes whose byte 8 l + i of vector k is
// row l's qs[8 k + i]; rows unpacked from them into the file's layout
// (PlainParts) for the paths that read rows.
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {
struct R8Field {
    int start, bytes, piece;
    int at = -1;        // its place in the unit, in bytes / 8 (-1: start, the fields in the block's order)
};
constexpr int r8_at(R8Field f) { return f.at < 0 ? f.start : f.at; }
struct R8Fields {
    int n;
    R8Field f[14];
};
constexpr R8Fields r8_fields(int file) {
    switch (file) {
    case Q4_0: return {2, {{0, 2, 2}, {2, 16, 8}}};
    case Q4_1: return {3, {{0, 2, 2}, {2, 2, 2}, {4, 16, 8}}};
    case Q5_0: return {3, {{0, 2, 2}, {2, 4, 4}, {6, 16, 8}}};
    case Q8_0: return {2, {{0, 2, 2}, {2, 32, 8}}};
    case Q4_K: return {4, {{0, 2, 2}, {2, 2, 2}, {4, 12, 4}, {16, 128, 8}}};
    case Q5_K: return {5, {{0, 2, 2}, {2, 2, 2}, {4, 12, 4}, {16, 32, 8}, {48, 128, 8}}};
    // q6_k: the 16 scales, d, then per (n, b) < (2, 2) 384 bytes (unpack_r8_256.h's q6 chunk): qh[32 n + 16 b ..],
    // ql[64 n + 16 b ..], ql[64 n + 32 + 16 b ..], 16 bytes each a row: the unit in the order its dot reads it
    case Q6_K:
        return {14, {{0, 16, 4, 34}, {16, 16, 4, 82}, {32, 16, 4, 50}, {48, 16, 4, 98}, {64, 16, 4, 130}, {80, 16, 4, 178},
                     {96, 16, 4, 146}, {112, 16, 4, 194}, {128, 16, 4, 18}, {144, 16, 4, 66}, {160, 16, 4, 114},
                     {176, 16, 4, 162}, {192, 16, 1, 0}, {208, 2, 2, 16}}};
    case MXFP4: return {2, {{0, 1, 1}, {1, 16, 8}}};
    }
    return {0, {}};
}
constexpr int64_t r8_unit_bytes(int qt) { return 8 * kBytes[r8_file_type(qt)]; }     // 160, 144, 272, ...
constexpr int r8_codes_at(int qt) { return qt == Q5_0R8 ? 48 : qt == Q4_1R8 ? 32 : 16; }    // (32-element types) after d (m, qh)

// Row l's block of the r8 unit at u, in the file type's layout (kBytes bytes at b).
inline void r8_block(int qt, const uint8_t *u, int l, uint8_t *b) {
    const R8Fields fs = r8_fields(r8_file_type(qt));
    for (int i = 0; i < fs.n; i++) {
        const R8Field f = fs.f[i];
        const uint8_t *src = u + 8 * r8_at(f) + f.piece * l;
        uint8_t *dst = b + f.start;
        // (each piece size its own constant-size copy: a move, not a call; unpacking is per product)
        switch (f.piece) {
        case 1: for (int k = 0; k < f.bytes; k++) dst[k] = src[8 * k]; break;
        case 2: for (int k = 0; k < f.bytes / 2; k++) std::memcpy(dst + 2 * k, src + 16 * k, 2); break;
        case 4: for (int k = 0; k < f.bytes / 4; k++) std::memcpy(dst + 4 * k, src + 32 * k, 4); break;
        default: for (int k = 0; k < f.bytes / 8; k++) std::memcpy(dst + 8 * k, src + 64 * k, 8); break;
        }
    }
}
inline void r8_block(const uint8_t *u, int l, uint8_t *b) { r8_block(Q4_1R8, u, l, b); }     // (amxw_units' q4_1r8)

// Group g's 8 rows (nb blocks) in the file type's layout into rows (row_bytes apart).
inline void unpack_r8(int qt, const uint8_t *g, int64_t nb, uint8_t *rows, int64_t row_bytes) {
    const int64_t U = r8_unit_bytes(qt), B = kBytes[r8_file_type(qt)];
    for (int64_t j = 0; j < nb; j++)
        for (int l = 0; l < 8; l++) r8_block(qt, g + j * U, l, rows + l * row_bytes + j * B);
}

// Row r of a weight as K floats (dequantize_row's values): a row of blocks ldw bytes apart, or, in
// an r8 layout, row r % 8 of group r / 8 (groups ldw bytes apart), its blocks gathered first.
void dequantize_any_row(int qt, const uint8_t *w, int64_t ldw, int64_t r, int64_t K, float *y) {
    if (!is_r8(qt)) return dequantize_row(qt, w + r * ldw, K, y);
    const int file = r8_file_type(qt);
    const int64_t B = kBytes[file], U = r8_unit_bytes(qt), nb = K / kElems[file];
    thread_local std::vector<uint8_t> row;
    if (static_cast<int64_t>(row.size()) < nb * B) row.resize(nb * B);
    const uint8_t *g = w + r / 8 * ldw;
    for (int64_t j = 0; j < nb; j++) r8_block(qt, g + j * U, int(r % 8), row.data() + j * B);
    dequantize_row(file, row.data(), K, y);
}

// A group's 8 rows of nb blocks (the file type File's layout, one after another) into its nb r8
// units: r8_block's inverse, the fields known at compile time (their copies unrolled).
template <int File>
void r8_pack_group(const uint8_t *rows, int64_t nb, uint8_t *units) {
    constexpr R8Fields fs = r8_fields(File);
    constexpr int64_t B = kBytes[File];
    for (int64_t j = 0; j < nb; j++) {
        uint8_t *u = units + j * 8 * B;
        for (int l = 0; l < 8; l++) {
            const uint8_t *b = rows + (l * nb + j) * B;
            for (int i = 0; i < fs.n; i++) {
                const R8Field f = fs.f[i];
                const uint8_t *src = b + f.start;
                uint8_t *dst = u + 8 * r8_at(f) + f.piece * l;
                switch (f.piece) {
                case 1: for (int k = 0; k < f.bytes; k++) dst[8 * k] = src[k]; break;
                case 2: for (int k = 0; k < f.bytes / 2; k++) std::memcpy(dst + 16 * k, src + 2 * k, 2); break;
                case 4: for (int k = 0; k < f.bytes / 4; k++) std::memcpy(dst + 32 * k, src + 4 * k, 4); break;
                default: for (int k = 0; k < f.bytes / 8; k++) std::memcpy(dst + 64 * k, src + 8 * k, 8); break;
                }
            }
        }
    }
}
using R8PackGroup = void (*)(const uint8_t *, int64_t, uint8_t *);
R8PackGroup r8_pack_group_of(int file) {
    switch (file) {
    case Q4_0: return r8_pack_group<Q4_0>;
    case Q4_1: return r8_pack_group<Q4_1>;
    case Q5_0: return r8_pack_group<Q5_0>;
    case Q8_0: return r8_pack_group<Q8_0>;
    case Q4_K: return r8_pack_group<Q4_K>;
    case Q5_K: return r8_pack_group<Q5_K>;
    case Q6_K: return r8_pack_group<Q6_K>;
    case MXFP4: return r8_pack_group<MXFP4>;
    }
    return nullptr;
}
}  // namespace

// A matrix's rows (the file type's layout, rows x nb blocks, rows a multiple of 8) rewritten in
// place as r8 layout qt's groups (quant_format.py's r8_order, to_r8): each group of 8 rows holds
// the same bytes in either layout, so each is repacked through a thread's buffer of one group.
// The loader's repack of every r8 weight (kernels/quant.py repack): a byte shuffle at memory speed.
extern "C" int quant_repack_r8(int qt, uint8_t *data, int64_t rows, int64_t nb) {
    if (qt < 0 || qt >= kNumTypes || !is_r8(qt) || rows % 8 || nb < 0) return 1;
    const int64_t B = kBytes[r8_file_type(qt)];
    const R8PackGroup pack = r8_pack_group_of(r8_file_type(qt));
#pragma omp parallel if (rows * nb >= 4096)
    {
        std::vector<uint8_t> group(static_cast<size_t>(8 * nb * B));
#pragma omp for schedule(static)
        for (int64_t g = 0; g < rows / 8; g++) {
            uint8_t *at = data + g * 8 * nb * B;
            std::memcpy(group.data(), at, group.size());
            pack(group.data(), nb, at);
        }
    }
    return 0;
}

namespace {
// The parts with each r8 part unpacked into the file's layout (a buffer of the calling
// thread's, kept between calls; both threads unpack): for the paths that read rows (the tiles,
// the other ISA variants).
struct PlainParts {
    std::vector<QuantPart> parts;
    PlainParts(const QuantPart *in, int64_t nparts, int64_t K) : parts(in, in + nparts) {
        static thread_local std::vector<uint8_t> buf;
        int64_t need = 0;
        for (int64_t p = 0; p < nparts; p++)
            if (is_r8(int(in[p].qtype))) need += in[p].rows * (K / kElems[in[p].qtype] * kBytes[in[p].qtype]);
        if (static_cast<int64_t>(buf.size()) < need) buf.resize(need);
        int64_t at = 0;
        for (int64_t p = 0; p < nparts; p++) {
            if (!is_r8(int(in[p].qtype))) continue;
            uint8_t *dst = buf.data() + at;
            const QuantPart q = in[p];
            const int qt = int(q.qtype), file = r8_file_type(qt);
            const int64_t row_bytes = K / kElems[file] * kBytes[file];
#pragma omp parallel for schedule(static) if (q.rows * K >= 65536)
            for (int64_t g = 0; g < q.rows / 8; g++)
                unpack_r8(qt, q.w + g * q.ldw, K / kElems[file], dst + 8 * g * row_bytes, row_bytes);
            parts[p] = {file, dst, row_bytes, q.rows};
            at += q.rows * row_bytes;
        }
    }
};
bool any_r8(const QuantPart *parts, int64_t nparts) {
    for (int64_t p = 0; p < nparts; p++)
        if (is_r8(int(parts[p].qtype))) return true;
    return false;
}
bool all_r8_groups(const QuantPart *parts, int64_t nparts) {      // every part r8 (rows a multiple of 8)
    for (int64_t p = 0; p < nparts; p++)
        if (!is_r8(int(parts[p].qtype)) || parts[p].rows % 8) return false;
    return true;
}
bool only_q4_1r8(const QuantPart *parts, int64_t nparts) {      // (of the r8 layouts: what amxw_rows reads)
    for (int64_t p = 0; p < nparts; p++)
        if (is_r8(int(parts[p].qtype)) && parts[p].qtype != Q4_1R8) return false;
    return true;
}
}  // namespace

// out float32 [n][cols] = rows ids[0..n) of W (an embedding lookup; a decode step's one id reads
// one row, in an r8 layout too: a tied LM head's table is not unpacked); ids checked by the caller.
// ldw: bytes between rows (r8: between groups of 8 rows).
extern "C" int quant_dequantize_rows(int qt, const uint8_t *w, int64_t ldw, const int64_t *ids, int64_t n,
                                     int64_t cols, float *out) {
    if (qt < 0 || qt >= kNumTypes || cols % kElems[qt]) return 1;
#pragma omp parallel for schedule(static) if (n * cols >= 65536)
    for (int64_t i = 0; i < n; i++) dequantize_any_row(qt, w, ldw, ids[i], cols, out + i * cols);
    return 0;
}
