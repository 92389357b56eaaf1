// AMX-BF16 with weights as A tiles: the passes and amxw_linear; quant_amx*_config.
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {
#if defined(PS_DOTS512)

// A group of n weight rows being dequantized into dst [32][K] (rows past n zeroed first) a few
// units at a time (step), between the tile operations of the group before it, so the vector
// work of one group overlaps the AMX work of the other; finish() does what is left.
struct AmxWNext {
    AmxWUnits fn = nullptr;
    const uint8_t *w = nullptr;
    int64_t ldw = 0, n = 0, units = 0, K = 0;     // units per row
    uint16_t *dst = nullptr;
    bool native = false;
    int64_t row = 0, unit = 0, per = 0;           // the cursor; units per step
    bool r8 = false;                              // Q4_1R8: w its first group, ldw a group's bytes
    void step(int64_t count) {
        while (count > 0 && row < n) {
            const int64_t take = std::min(count, units - unit);
            if (r8) amxw_units_r8(w + row / 8 * ldw, int(row % 8), unit, unit + take, dst + row * K, native);
            else fn(w + row * ldw, unit, unit + take, dst + row * K, native);
            count -= take;
            if ((unit += take) == units) row++, unit = 0;
        }
    }
    void finish() { step(n * units); }
    int64_t left() const { return (n - row) * units - unit; }
};

// C tiles 0 (weight rows 0-15 x activation tile b0), 1 (0-15 x b1, PAIR), 2 (16-31 x b0, TWO),
// 3 (16-31 x b1, both) summed over all K: A tiles from wb [32][K], B tiles b0, b1 [K/2][16][2].
// Stored into cbuf [4][16][16] float32 (tile i at 256 i). Between the tile operations: nx.per
// units of the next group dequantized (AmxWNext), and the weight bytes of the group after it
// prefetched into L2 (pf: per cache lines a step, from pf.at), so their memory reads overlap the
// AMX work instead of stalling a dequantize.
struct AmxWPrefetch {
    const uint8_t *at, *end;
    int64_t per;          // cache lines per K step
    PrefetchCursor *extra = nullptr;     // and the thread's share of a Handover: extra_per lines a K step
    int64_t extra_per = 0;
};

template <bool TWO, bool PAIR>
__attribute__((target("amx-tile,amx-bf16"))) inline void amxw_pass(const uint16_t *wb, const uint16_t *b0,
                                                                   const uint16_t *b1, int64_t K, float *cbuf,
                                                                   AmxWPrefetch &pf, AmxWNext &nx) {
    const int64_t stride = 2 * K;
    _tile_zero(0);
    if (PAIR) _tile_zero(1);
    if (TWO) _tile_zero(2);
    if (TWO && PAIR) _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32) {
        for (int64_t i = 0; i < pf.per && pf.at < pf.end; i++, pf.at += 64)
            _mm_prefetch(reinterpret_cast<const char *>(pf.at), _MM_HINT_T1);
        if (pf.extra) pf.extra->step(pf.extra_per);
        _tile_loadd(4, wb + k, stride);
        _tile_loadd(6, b0 + k * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (PAIR) {
            _tile_loadd(7, b1 + k * 16, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (TWO) {
            _tile_loadd(5, wb + 16 * K + k, stride);
            _tile_dpbf16ps(2, 5, 6);
            if (PAIR) _tile_dpbf16ps(3, 5, 7);
        }
        nx.step(nx.per);
    }
    _tile_stored(0, cbuf, 64);
    if (PAIR) _tile_stored(1, cbuf + 256, 64);
    if (TWO) _tile_stored(2, cbuf + 512, 64);
    if (TWO && PAIR) _tile_stored(3, cbuf + 768, 64);
}

// Two groups of 32 weight rows (wa, wb2: [32][K] each) times one activation tile b0: C tiles 0-3
// their rows 0-15, 16-31, 32-47, 48-63 (four chains of sums where one tile of x would give two).
__attribute__((target("amx-tile,amx-bf16"))) inline void amxw_pass4(const uint16_t *wa, const uint16_t *wb2,
                                                                    const uint16_t *b0, int64_t K, float *cbuf,
                                                                    AmxWPrefetch &pf, AmxWNext &nx) {
    const int64_t stride = 2 * K;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32) {
        for (int64_t i = 0; i < pf.per && pf.at < pf.end; i++, pf.at += 64)
            _mm_prefetch(reinterpret_cast<const char *>(pf.at), _MM_HINT_T1);
        if (pf.extra) pf.extra->step(pf.extra_per);
        _tile_loadd(6, b0 + k * 16, 64);
        _tile_loadd(4, wa + k, stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, wa + 16 * K + k, stride);
        _tile_dpbf16ps(1, 5, 6);
        _tile_loadd(7, wb2 + k, stride);
        _tile_dpbf16ps(2, 7, 6);
        _tile_loadd(4, wb2 + 16 * K + k, stride);
        _tile_dpbf16ps(3, 4, 6);
        nx.step(nx.per);
    }
    _tile_stored(0, cbuf, 64);
    _tile_stored(1, cbuf + 256, 64);
    _tile_stored(2, cbuf + 512, 64);
    _tile_stored(3, cbuf + 768, 64);
}

// One C tile's sums (c: [16 weight rows][16 activation rows] float32) + bias into y.T's block:
// rows [t0, t0 + nt) of y, columns [col, col + nw).
// Rounded to bf16 by vcvtneps2bf16 where the CPU has AVX512-BF16 (asm, as bf16_pairs: the same
// value but for float32 denormals, which it flushes), else bf16_bits.
inline void amxw_store(const float *c, const float *bias, uint16_t *y, int64_t ldy, int64_t t0, int64_t nt,
                       int64_t col, int64_t nw, bool native) {
    __m512i r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(c + 16 * i);
    transpose16_epi32(r);                       // r[t]: activation row t's sums of the 16 weight rows
    const __mmask16 mask = nw >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << nw) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    for (int64_t t = 0; t < nt; t++) {
        const __m512 v = _mm512_add_ps(_mm512_castsi512_ps(r[t]), b);
        __m256i h;
        if (native) __asm__("vcvtneps2bf16 %1, %0" : "=v"(h) : "v"(v));
        else h = _mm512_cvtepi32_epi16(bf16_bits(v));
        _mm256_mask_storeu_epi16(y + (t0 + t) * ldy + col, mask, h);
    }
}

// n weight rows (a block of groups of 32), dequantized in wb [n rounded up to 32][K] (rows past n
// zero), times all T rows of x (bv: its B tiles) into y's columns [col, col + n): per pair of
// activation tiles, each group of 32 in turn, so the pair's B tiles (and the block's A tiles)
// stay in L2 for all of them.
__attribute__((target("amx-tile,amx-bf16"))) void amxw_block(const uint16_t *wb, int64_t n, const uint16_t *bv,
                                                               int64_t T, int64_t K, const float *bias, uint16_t *y,
                                                               int64_t ldy, int64_t col, float *cbuf,
                                                               AmxWPrefetch pf, AmxWNext &nx) {
    const int64_t tiles = (T + 15) / 16, groups = (n + 31) / 32;
    const int64_t steps = (tiles / 2 * groups + tiles % 2 * (groups / 2 + groups % 2)) * (K / 32);
    pf.per = (pf.end - pf.at + 64 * steps - 1) / (64 * steps);
    if (pf.extra) pf.extra_per = (pf.extra_per + steps - 1) / steps;       // (given: lines for this block)
    nx.per = (nx.left() + steps - 1) / steps;
    for (int64_t t0 = 0; t0 < tiles; t0 += 2) {
        const bool pair = t0 + 1 < tiles;
        const uint16_t *b0 = bv + t0 * K * 16, *b1 = b0 + K * 16;
        for (int64_t j = 0; j < groups; j++) {
            const uint16_t *w = wb + j * 32 * K;
            if (!pair && n - 32 * j >= 64) {       // a lone activation tile: two whole groups at once
                amx8_barrier();
                amxw_pass4(w, w + 32 * K, b0, K, cbuf, pf, nx);
                amx8_barrier();
                for (int i = 0; i < 4; i++)
                    amxw_store(cbuf + 256 * i, bias ? bias + 32 * j + 16 * i : nullptr, y, ldy, 16 * t0,
                               std::min<int64_t>(16, T - 16 * t0), col + 32 * j + 16 * i, 16, native_bf16());
                j++;
                continue;
            }
            const int64_t nj = std::min<int64_t>(32, n - 32 * j);
            const bool two = nj > 16;
            amx8_barrier();
            if (two && pair) amxw_pass<true, true>(w, b0, b1, K, cbuf, pf, nx);
            else if (two) amxw_pass<true, false>(w, b0, b1, K, cbuf, pf, nx);
            else if (pair) amxw_pass<false, true>(w, b0, b1, K, cbuf, pf, nx);
            else amxw_pass<false, false>(w, b0, b1, K, cbuf, pf, nx);
            amx8_barrier();
            for (int h = 0; h < (two ? 2 : 1); h++)
                for (int p = 0; p < (pair ? 2 : 1); p++)
                    amxw_store(cbuf + 256 * (2 * h + p), bias ? bias + 32 * j + 16 * h : nullptr, y, ldy,
                               16 * (t0 + p), std::min<int64_t>(16, T - 16 * (t0 + p)), col + 32 * j + 16 * h,
                               std::min<int64_t>(16, nj - 16 * h), native_bf16());
        }
    }
}

constexpr int64_t kAmxWBlockBytes = 384 * 1024;    // the bf16 weights of a block (two in L2: this and the next)

// This thread's share of the groups of 32 weight rows (ranges of equal bytes); bv complete. Its
// groups go in blocks of consecutive rows of one part (as many as keep kAmxWBlockBytes of bf16
// weights, one group where x has at most 64 rows), in two buffers: block i's AMX passes read
// one while block i + 1 is dequantized into the other. Called inside amxw_linear's parallel region.
__attribute__((target("amx-tile,amx-bf16"))) void amxw_rows(const QuantPart *parts, int64_t nparts, const uint32_t *bv,
                                                              int64_t T, int64_t K, int64_t total, const float *bias,
                                                              uint16_t *y, int64_t ldy, bool native,
                                                              const Handover *plan) {
    const int64_t per_block = T <= 64 ? (128 * K <= kAmxWBlockBytes ? 64 : 32)        // rows
                                      : std::max<int64_t>(1, kAmxWBlockBytes / (64 * K)) * 32;
    static thread_local std::vector<uint16_t> wb;
    static thread_local std::vector<RowBlock> mine;
    if (wb.size() < size_t(2 * per_block * K)) wb.resize(2 * per_block * K);
    share_blocks(parts, nparts, K, total, per_block, mine);
    if (mine.empty()) return;
    auto next_of = [&](size_t i) {       // block i's dequantize, not started, into buffer i % 2
        AmxWNext nx;
        if (i >= mine.size()) return nx;
        const RowBlock &g = mine[i];
        uint16_t *dst = wb.data() + (i % 2) * per_block * K;
        const int64_t padded = (g.n + 31) / 32 * 32;
        if (g.n < padded) std::fill(dst + g.n * K, dst + padded * K, uint16_t(0));
        nx.fn = amxw_units_fn(int(g.q->qtype));
        nx.r8 = g.q->qtype == Q4_1R8;          // (its blocks of 32 rows start on a group: r0 % 32 == 0)
        nx.w = g.q->w + (nx.r8 ? g.r0 / 8 : g.r0) * g.q->ldw, nx.ldw = g.q->ldw, nx.n = g.n;
        nx.units = K / kElems[g.q->qtype];
        nx.K = K, nx.dst = dst, nx.native = native;
        return nx;
    };
    PrefetchCursor extra(plan, omp_get_thread_num(), omp_get_num_threads());
    const int64_t extra_lines = extra.lines(), nblocks = static_cast<int64_t>(mine.size());
    amxw_load_config();
    alignas(64) float cbuf[1024];
    AmxWNext now = next_of(0);
    now.finish();
    for (size_t i = 0; i < mine.size(); i++) {
        const RowBlock &g = mine[i];
        AmxWNext nx = next_of(i + 1);
        AmxWPrefetch ahead{nullptr, nullptr, 0};          // block i + 2's bytes, where its rows are contiguous
        if (extra_lines > 0) ahead.extra = &extra, ahead.extra_per = (extra_lines + nblocks - 1) / nblocks;
        if (i + 2 < mine.size() && mine[i + 2].q->ldw == mine[i + 2].row_bytes) {
            const RowBlock &h = mine[i + 2];
            ahead.at = h.q->w + h.r0 * h.q->ldw, ahead.end = ahead.at + h.n * h.row_bytes;
        } else if (i + 2 < mine.size() && mine[i + 2].q->qtype == Q4_1R8) {    // its groups: contiguous too
            const RowBlock &h = mine[i + 2];
            ahead.at = h.q->w + h.r0 / 8 * h.q->ldw, ahead.end = ahead.at + h.n * h.row_bytes;
        }
        amxw_block(wb.data() + (i % 2) * per_block * K, g.n, reinterpret_cast<const uint16_t *>(bv), T, K,
                   bias ? bias + g.first + g.r0 : nullptr, y, ldy, g.first + g.r0, cbuf, ahead, nx);
        nx.finish();
    }
    _tile_release();
}

int amxw_linear(const QuantPart *parts, int64_t nparts, const uint16_t *x, int64_t T, int64_t K, const float *bias,
                uint16_t *y, int64_t ldy, const Handover *plan) {
    const int64_t tiles = (T + 15) / 16, pairs = K / 2;
    std::vector<uint32_t> bv(tiles * pairs * 16);       // x's bf16 pairs: [tiles][K/2][16]
    const uint32_t *x32 = reinterpret_cast<const uint32_t *>(x);
    int64_t total = 0;                                  // weight bytes
    for (int64_t p = 0; p < nparts; p++) total += parts[p].rows * (K / kElems[parts[p].qtype] * kBytes[parts[p].qtype]);
    const bool native = native_bf16();
#pragma omp parallel
    {
        // 16 rows x 16 pairs at a time, transposed in registers (pairs: K / 2, a multiple of 16)
#pragma omp for schedule(static)
        for (int64_t i = 0; i < tiles * (pairs / 16); i++) {
            const int64_t k = i / (pairs / 16), g = i % (pairs / 16) * 16;
            __m512i r[16];
            for (int64_t c = 0; c < 16; c++)
                r[c] = 16 * k + c < T ? _mm512_loadu_si512(x32 + (16 * k + c) * pairs + g) : _mm512_setzero_si512();
            transpose16_epi32(r);
            for (int64_t c = 0; c < 16; c++) _mm512_storeu_si512(&bv[(k * pairs + g + c) * 16], r[c]);
        }
        amxw_rows(parts, nparts, bv.data(), T, K, total, bias, y, ldy, native, plan);
        run_after(plan);
    }
    return 0;
}
#else
bool amxw_takes(int64_t) { return false; }
bool amxw_enabled() { return false; }
int amxw_linear(const QuantPart *, int64_t, const uint16_t *, int64_t, int64_t, const float *, uint16_t *, int64_t,
                const Handover *) {
    return 1;
}
#endif
}  // namespace

// enable: the AMX-BF16 path with weights as A tiles for bf16 x of min_rows .. max_rows rows in
// quant_linear_tiles (1) or not (0). Returns 1 where it is in use after the call, 0 where not (not
// this build, the CPU or kernel lacks AMX-BF16, or disabled).
extern "C" int quant_amxw_config(int64_t enable, int64_t min_rows, int64_t max_rows) {
#if defined(PS_DOTS512)
    static const bool usable = amx_permitted(kAmxBf16);
    g_amxw.enabled = usable && enable != 0;
    g_amxw.min_rows = std::max<int64_t>(1, min_rows);
    g_amxw.max_rows = max_rows;
    return g_amxw.enabled ? 1 : 0;
#else
    (void)enable, (void)min_rows, (void)max_rows;
    return 0;
#endif
}

// enable: use the AMX-INT8 dots where usable (1) or not (0); min_rows: from how many rows of x.
// Returns 1 where they are in use after the call, 0 where not (not this build, the CPU or kernel
// lacks AMX-INT8, or disabled).
extern "C" int quant_amx_config(int64_t enable, int64_t min_rows) {
#if defined(PS_DOTS512)
    static const bool usable = amx_permitted(kAmxInt8);
    g_amx8.enabled = usable && enable != 0;
    g_amx8.min_rows = std::max<int64_t>(1, min_rows);
    return g_amx8.enabled ? 1 : 0;
#else
    (void)enable, (void)min_rows;
    return 0;
#endif
}
