// Many rows: dequantized tiles through the packed GEMM (quant_linear_tiles).
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

// y [T][ldy] = x [T][K] @ W.T + bias for many rows of x, W the parts stacked by rows (x
// contiguous; x and y both float32 or both bf16; bias float32 over all rows or null): tiles of
// tile_rows rows (a multiple of 32) dequantized into the packed layout of kernels/cpu.py's GEMM
// and multiplied by it straight into their columns of y (`gemm`: cpu_kernels.cpp's
// linear_packed_ld_f32 or _bf16, passed by address); the whole matrix never exists in float.
// The tile's buffer is the calling thread's, kept between calls (no page faults per call). 0 on success.
using PackedGemm = int (*)(const void *, const void *, const float *, void *, int64_t, int64_t, int64_t, int64_t);
namespace {
bool amxw_takes(int64_t T);     // the AMX-BF16 path with weights as A tiles (below) takes T rows of bf16 x
int amxw_linear(const QuantPart *parts, int64_t nparts, const uint16_t *x, int64_t T, int64_t K, const float *bias,
                uint16_t *y, int64_t ldy, const Handover *plan);
bool amxw_enabled();

// Rows of one part, consecutive: [r0, r0 + n) of part q, whose first row is row `first` of y.
struct RowBlock {
    const QuantPart *q;
    int64_t r0, n, first, row_bytes;
};

// The calling thread's share of a product's weight rows (in its team: a range of equal weight
// bytes of `total`, in groups of 32 rows) as blocks of up to max_rows consecutive rows of a part.
void share_blocks(const QuantPart *parts, int64_t nparts, int64_t K, int64_t total, int64_t max_rows,
                  std::vector<RowBlock> &out) {
    const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t lo = total * tid / nt, hi = total * (tid + 1) / nt;
    out.clear();
    int64_t at = 0, first = 0;         // bytes before this group, its part's first row in y
    for (int64_t p = 0; p < nparts; first += parts[p].rows, p++) {
        const int64_t row_bytes = K / kElems[parts[p].qtype] * kBytes[parts[p].qtype];
        for (int64_t r0 = 0; r0 < parts[p].rows; r0 += 32) {
            const int64_t n = std::min<int64_t>(32, parts[p].rows - r0), start = at;
            at += n * row_bytes;
            if (start < lo || start >= hi) continue;
            RowBlock *last = out.empty() ? nullptr : &out.back();
            if (last && last->q == &parts[p] && last->r0 + last->n == r0 && last->n + n <= max_rows) last->n += n;
            else out.push_back({&parts[p], r0, n, first, row_bytes});
        }
    }
}

#if defined(__AVX512F__)
// quant_linear_tiles for bf16 x where AMX is on and T is past amxw_takes: each thread packs
// blocks of its own rows (about kFusedBytes of bf16, a range of equal weight bytes) into its own
// buffer and runs the GEMM on them alone (a nested parallel region of one thread), so a block is
// multiplied by the core that wrote it, from its L2, with no barrier between packing and GEMM.
constexpr int64_t kFusedBytes = 512 * 1024;
int fused_tiles(const QuantPart *parts, int64_t nparts, const void *x, int64_t T, int64_t K, const float *bias,
                void *y, int64_t ldy, void *gemm) {
    int64_t total = 0;
    for (int64_t p = 0; p < nparts; p++) total += parts[p].rows * (K / kElems[parts[p].qtype] * kBytes[parts[p].qtype]);
    const int64_t chunk = std::max<int64_t>(32, kFusedBytes / (2 * K) / 32 * 32);      // rows per block
    const bool native = native_bf16();
    int status = 0;
#pragma omp parallel reduction(| : status)
    {
        static thread_local std::vector<uint16_t> buf;
        static thread_local std::vector<RowBlock> mine;
        if (buf.size() < size_t(chunk * K)) buf.resize(chunk * K);
        share_blocks(parts, nparts, K, total, chunk, mine);
        omp_set_num_threads(1);                      // the GEMM's own parallel region: this thread alone
        for (const RowBlock &b : mine) {
            for (int64_t g = 0; g < (b.n + 31) / 32 * 2; g++)
                pack_group_bf16(int(b.q->qtype), b.q->w + (b.r0 + 16 * g) * b.q->ldw, b.q->ldw,
                                std::min<int64_t>(16, std::max<int64_t>(0, b.n - 16 * g)), K, buf.data() + g * K * 16,
                                native);
            status |= reinterpret_cast<PackedGemm>(gemm)(x, buf.data(), bias ? bias + b.first + b.r0 : nullptr,
                                                         static_cast<uint16_t *>(y) + b.first + b.r0, ldy, T, b.n, K);
        }
    }
    return status;
}
#endif
}  // namespace
extern "C" int quant_linear_tiles(const QuantPart *parts, int64_t nparts, const void *x, int x_bf16, int64_t T,
                                  int64_t K, const float *bias, void *y, int64_t ldy, void *gemm, int64_t tile_rows) {
    const Handover *plan = t_handover;
    t_handover = nullptr;
    if (!valid(parts, nparts, K) || T <= 0 || tile_rows <= 0 || tile_rows % 32 || (x_bf16 && K % 2) || gemm == nullptr)
        return 1;
    if (any_r8(parts, nparts) && !(x_bf16 && amxw_takes(T) && only_q4_1r8(parts, nparts))) {   // (amxw_rows reads Q4_1R8)
        t_handover = plan;            // (for the call below)
        const PlainParts plain(parts, nparts, K);
        return quant_linear_tiles(plain.parts.data(), nparts, x, x_bf16, T, K, bias, y, ldy, gemm, tile_rows);
    }
    const bool mx = any_mxfp4(parts, nparts);          // (no AMX or bf16 packer decodes it: dequantize_packed's floats)
    if (x_bf16 && amxw_takes(T) && !mx)
        return amxw_linear(parts, nparts, static_cast<const uint16_t *>(x), T, K, bias, static_cast<uint16_t *>(y), ldy,
                           plan);
#if defined(__AVX512F__)
    if (x_bf16 && amxw_enabled() && !mx) return fused_tiles(parts, nparts, x, T, K, bias, y, ldy, gemm);
#endif
    const int64_t elem = x_bf16 ? 2 : 4;
    static thread_local std::vector<uint8_t> packed;
    if (packed.size() < size_t(tile_rows * K * elem)) packed.resize(tile_rows * K * elem);
    auto *y8 = static_cast<uint8_t *>(y);
    int64_t first = 0;            // the parts' first row in y
    for (int64_t p = 0; p < nparts; first += parts[p].rows, p++) {
        const QuantPart &q = parts[p];
        for (int64_t r0 = 0; r0 < q.rows; r0 += tile_rows) {
            const int64_t n = std::min(tile_rows, q.rows - r0);
            dequantize_packed(int(q.qtype), q.w + r0 * q.ldw, q.ldw, n, K, packed.data(), x_bf16 != 0);
            const int status = reinterpret_cast<PackedGemm>(gemm)(x, packed.data(), bias ? bias + first + r0 : nullptr,
                                                                  y8 + (first + r0) * elem, ldy, T, n, K);
            if (status != 0) return status;
        }
    }
    return 0;
}
