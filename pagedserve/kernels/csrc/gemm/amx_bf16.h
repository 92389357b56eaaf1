// The AMX-BF16 GEMM for many rows (linear_packed_ld_bf16 in the avx512bf16 build).
// Part of cpu_kernels (csrc/cpu_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

#if defined(__AVX512BF16__)

// ---- AMX-BF16 GEMM for many rows (Sapphire Rapids and later) ----------------------------------
// The packed layout is already AMX's: a weight tile's 16 rows of K pairs (64 bytes each) are a B
// tile in VNNI form (16 columns x 2 bf16 per row), so B tiles load straight from the packed
// weight with a 64-byte stride, 32 k values at a time. A tiles are 16 rows x 32 bf16 of x (row
// stride 2K bytes); C tiles 16 x 16 float32. A step multiplies 2 A x 2 B tiles into 4 C tiles
// (32 rows x 32 columns: one strip). x is copied into a zero-padded buffer where M or K is not a
// multiple of 32 (an O(MK) copy), and a strip's last partial K step is copied into zero-padded
// B tiles, so every tile load is whole. Threads take ranges of strips, as gemm_strips does; each
// thread runs blocks of strips (about kAmxBlockBytes of weights, kept in L2) over all rows of x.
// Used only where the CPU has AMX-BF16 and the kernel lets the process use tile data
// (arch_prctl ARCH_REQ_XCOMP_PERM), from kAmxRows rows (kernels/cpu.py sets both: gemm_amx_config).
namespace {
struct AmxConfig {
    bool usable = false;     // CPU and OS allow it (checked once)
    bool enabled = false;    // cpu.py's switch (PAGEDSERVE_AMX)
    int64_t min_rows = 32;   // rows from which linear_packed_bf16 takes this path
};
AmxConfig g_amx;

struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

constexpr int64_t kAmxBlockBytes = 512 * 1024;

__attribute__((target("amx-tile,amx-bf16"))) void amx_load_config() {
    TileConfig cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;   // all tiles 16 x 64 bytes
    _tile_loadconfig(&cfg);
}

// The gcc intrinsics are asm statements without a memory clobber: this orders C++ accesses
// around tile loads and stores of the same memory.
inline void memory_barrier() { __asm__ volatile("" ::: "memory"); }

// A C tile's float32 sums (buf, as tilestored left them) for rows [m0, m0 + rows) and 16
// columns from n, plus bias, to y (bf16).
inline void amx_store(const float *buf, const float *bias, uint16_t *y, int64_t ldy, int64_t m0, int64_t rows,
                      int64_t n, int64_t N) {
    if (n >= N) return;
    const __mmask16 mask = first_lanes(N - n);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++)
        store_masked(y + (m0 + r) * ldy + n, mask, _mm512_add_ps(_mm512_loadu_ps(buf + 16 * r), b));
}

// One K step of 32 at column k: B tiles b0, b1 (64 bytes a row) into C tiles 0, 1 from x0's A
// tile (and 2, 3 from x1's where A == 2; x1 is null where A == 1), A rows `stride` bytes apart.
template <int A>
__attribute__((target("amx-tile,amx-bf16"), always_inline)) inline void amx_k_step(const uint16_t *b0,
                                                                                   const uint16_t *b1,
                                                                                   const uint16_t *x0,
                                                                                   const uint16_t *x1, int64_t k,
                                                                                   int64_t stride) {
    _tile_loadd(6, b0, 64);
    _tile_loadd(7, b1, 64);
    _tile_loadd(4, x0 + k, stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (A == 2) {
        _tile_loadd(5, x1 + k, stride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}

// One strip (32 columns from n0; w0, w1 its two packed tiles) times A = 1 or 2 A tiles of 16
// rows: x0 (rows m0..m0+15) and x1 (the next 16), each with ldx elements between rows and at
// least kfull (+ 32 where bt) columns. bt: the strip's last partial K step as two zero-padded B
// tiles (null where K % 32 == 0).
template <int A>
__attribute__((target("amx-tile,amx-bf16"))) void amx_strip(const uint16_t *x0, const uint16_t *x1, int64_t ldx,
                                                              int64_t kfull, const uint16_t *w0, const uint16_t *w1,
                                                              const uint16_t *bt, const float *bias, uint16_t *y, int64_t ldy,
                                                              int64_t m0, int64_t M, int64_t n0, int64_t N,
                                                              float *buf) {
    memory_barrier();
    _tile_zero(0);
    _tile_zero(1);
    if (A == 2) {
        _tile_zero(2);
        _tile_zero(3);
    }
    const int64_t stride = ldx * 2;
    for (int64_t k = 0; k < kfull; k += 32) amx_k_step<A>(w0 + k * 16, w1 + k * 16, x0, x1, k, stride);
    // the partial K step: x's padding columns are zero, and so are bt's rows past K
    if (bt != nullptr) amx_k_step<A>(bt, bt + 512, x0, x1, kfull, stride);
    const int64_t rows0 = std::min<int64_t>(16, M - m0);
    _tile_stored(0, buf, 64);
    _tile_stored(1, buf + 256, 64);
    if (A == 2) {
        _tile_stored(2, buf + 512, 64);
        _tile_stored(3, buf + 768, 64);
    }
    memory_barrier();
    amx_store(buf, bias, y, ldy, m0, rows0, n0, N);
    amx_store(buf + 256, bias, y, ldy, m0, rows0, n0 + 16, N);
    if (A == 2) {
        const int64_t rows1 = std::min<int64_t>(16, M - m0 - 16);
        amx_store(buf + 512, bias, y, ldy, m0 + 16, rows1, n0, N);
        amx_store(buf + 768, bias, y, ldy, m0 + 16, rows1, n0 + 16, N);
    }
}

__attribute__((target("amx-tile,amx-bf16"))) void amx_gemm(const uint16_t *x, const uint16_t *w, const float *bias,
                                                             uint16_t *y, int64_t ldy, int64_t M, int64_t N,
                                                             int64_t K) {
    const int64_t kfull = K / 32 * 32, tail = K - kfull;           // tail: even (packed bf16 needs even K)
    // Every A tile whole: with a K tail, all of x copied with zero columns up to a multiple of
    // 32; else only a last partial block of 16 rows, zero rows after M.
    const int64_t full = M / 16 * 16, ldx = tail ? kfull + 32 : K;
    std::vector<uint16_t> padded;
    if (tail) {
        padded.assign((full + (M > full ? 16 : 0)) * ldx, 0);
        for (int64_t m = 0; m < M; m++) std::memcpy(&padded[m * ldx], x + m * K, K * 2);
    } else if (M > full) {
        padded.assign(16 * K, 0);
        std::memcpy(padded.data(), x + full * K, (M - full) * K * 2);
    }
    auto rows_at = [&](int64_t m) -> const uint16_t * {    // the A tile of rows m..m+15
        if (tail) return &padded[m * ldx];
        return m < full ? x + m * K : padded.data();
    };
    const int64_t strips = (N + 31) / 32;
    const int64_t block = std::max<int64_t>(1, kAmxBlockBytes / (64 * K));     // strips per block (64 K bytes each)
#pragma omp parallel
    {
        amx_load_config();
        alignas(64) float buf[1024];     // the 4 C tiles, stored
        std::vector<uint16_t> bt(tail ? 1024 * block : 0);
        const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t s_begin = strips * id / nt, s_end = strips * (id + 1) / nt;
        for (int64_t s0 = s_begin; s0 < s_end; s0 += block) {
            const int64_t s1 = std::min(s_end, s0 + block);
            if (tail) {     // the block's partial K steps as zero-padded B tiles: 2 per strip, 16 rows of 64 bytes
                std::fill(bt.begin(), bt.end(), 0);
                for (int64_t s = s0; s < s1; s++)
                    for (int h = 0; h < 2; h++)
                        std::memcpy(&bt[(s - s0) * 1024 + h * 512], w + (2 * s + h) * K * 16 + kfull * 16,
                                    tail * 16 * 2);
            }
            for (int64_t m0 = 0; m0 < M; m0 += 32) {
                const uint16_t *x0 = rows_at(m0), *x1 = M - m0 > 16 ? rows_at(m0 + 16) : nullptr;
                for (int64_t s = s0; s < s1; s++) {
                    const uint16_t *w0 = w + 2 * s * K * 16, *w1 = w0 + K * 16;
                    const uint16_t *b = tail ? &bt[(s - s0) * 1024] : nullptr;
                    if (x1 != nullptr)
                        amx_strip<2>(x0, x1, ldx, kfull, w0, w1, b, bias, y, ldy, m0, M, 32 * s, N, buf);
                    else
                        amx_strip<1>(x0, x1, ldx, kfull, w0, w1, b, bias, y, ldy, m0, M, 32 * s, N, buf);
                }
            }
        }
        _tile_release();
    }
}
}  // namespace

// enable: use AMX where usable (1) or not (0); min_rows: from how many rows of x. Returns 1 where
// AMX is in use after the call, 0 where not (the CPU or kernel lacks it, or disabled).
extern "C" int gemm_amx_config(int64_t enable, int64_t min_rows) {
    static const bool usable = amx_permitted(kAmxBf16);
    g_amx.usable = usable;
    g_amx.enabled = usable && enable != 0;
    g_amx.min_rows = std::max<int64_t>(1, min_rows);
    return g_amx.enabled ? 1 : 0;
}

// w: packed [Np/16][K/2][16][2] with Np a multiple of 32 (zero columns past N); K even;
// bias: float32 [N] or null; y: rows ldy elements apart (columns past N untouched).
extern "C" int linear_packed_ld_bf16(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y,
                                     int64_t ldy, int64_t M, int64_t N, int64_t K) {
    if (g_amx.enabled && M >= g_amx.min_rows) {
        amx_gemm(x, w, bias, y, ldy, M, N, K);
        return 0;
    }
    gemm_strips(x, w, bias, y, ldy, M, N, K, [](int64_t rows, auto... args) { kTiles<uint16_t>[rows](args...); });
    return 0;
}
#endif
