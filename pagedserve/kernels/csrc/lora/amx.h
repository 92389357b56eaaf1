// LoRA shrink / expand on AMX-BF16 tiles.
// Part of cpu_kernels (csrc/cpu_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {

constexpr int kLoraAmxRows = 6;    // a slot's rows from which AMX tiles take them (bf16, avx512bf16 build; measured)
constexpr int kLoraAmxMax = 16;    // rows per AMX block: one tile's rows

#ifdef __AVX512BF16__
// AMX tiles for one slot's rows (from kLoraAmxRows, up to 16 per block) of one part of a bf16
// projection: the same sums as the vector path, on tiles. Shrink (lora_amx_shrink) over inputs
// [i0, i1) as u.T = A_j @ x.T: A tiles straight from the part's rank rows (16 rank rows x 32
// inputs), B tiles from x's rows transposed in pairs (a per-call O(16 (i1 - i0)) copy); tiles
// 16 x 64 bytes (amx_load_config). Expand (lora_amx_expand) over the part's columns [c0, c1):
// u rounded to bf16 in rows of Rp (R rounded up to kk), zero past the slot's rank, kk rank
// values a step (lora_expand_config), 48 columns at a time: B tiles straight from BT's rank
// pairs made at load (LoraProj.btp), else BT's rows paired here; C tiles added into y in
// float32, rounded once; the part's last size % 16 columns on the vector path.
inline bool lora_amx_usable(int64_t R, int64_t in) {    // R <= 128: 4 expand steps at most
    return g_amx.enabled && R % 16 == 0 && R <= 128 && in % 32 == 0;
}

// The expand's tiles: C 0-2 16 x 16 float32; u (6) 16 rows x kk rank values; BT (4, 5, 7) kk / 2 pair rows.
__attribute__((target("amx-tile,amx-bf16"))) void lora_expand_config(int64_t kk) {
    TileConfig cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    cfg.colsb[6] = static_cast<uint16_t>(kk * 2);
    cfg.rows[4] = cfg.rows[5] = cfg.rows[7] = static_cast<uint8_t>(kk / 2);
    _tile_loadconfig(&cfg);
}

// Per part j in `parts`: uj[j][i][k] (ldu) for k < rank (the slot's rows j * R + k of a, rows
// in apart), i < n, over inputs [i0, i1): one transpose of x serves every part.
__attribute__((target("amx-tile,amx-bf16"))) void lora_amx_shrink(const uint16_t *a, int64_t in, int64_t R,
                                                                    int64_t rank, int64_t parts, int n,
                                                                    const int64_t *rows, const uint16_t *x,
                                                                    int64_t i0, int64_t i1, float *const *uj,
                                                                    int64_t ldu) {
    const int64_t len = i1 - i0;
    thread_local std::vector<uint32_t> xt_v;          // x.T in pairs: [len / 2][16]
    if (static_cast<int64_t>(xt_v.size()) < len * 8) xt_v.resize(len * 8);
    uint32_t *xt = xt_v.data();
    for (int64_t p0 = 0; p0 < len / 2; p0 += 16) {     // 16 pairs of the rows at a time, transposed
        __m512i r[16];
        for (int i = 0; i < 16; i++)
            r[i] = i < n ? _mm512_loadu_si512(x + rows[i] * in + i0 + 2 * p0) : _mm512_setzero_si512();
        transpose16_epi32(r);
        for (int c = 0; c < 16; c++) _mm512_storeu_si512(xt + (p0 + c) * 16, r[c]);
    }
    alignas(64) float buf[3 * 256];
    amx_load_config();
    memory_barrier();
    int64_t kbs[3], js[3];      // up to 3 rank blocks of 16 (a's row, its part) per pass over x
    int nk = 0;
    auto flush = [&]() {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        for (int64_t c = 0; c < len; c += 32) {
            _tile_loadd(6, xt + c / 2 * 16, 64);
            _tile_loadd(4, a + kbs[0] * in + i0 + c, in * 2);
            _tile_dpbf16ps(0, 4, 6);
            if (nk > 1) {
                _tile_loadd(5, a + kbs[1] * in + i0 + c, in * 2);
                _tile_dpbf16ps(1, 5, 6);
            }
            if (nk > 2) {
                _tile_loadd(7, a + kbs[2] * in + i0 + c, in * 2);
                _tile_dpbf16ps(2, 7, 6);
            }
        }
        _tile_stored(0, buf, 64);
        _tile_stored(1, buf + 256, 64);
        _tile_stored(2, buf + 512, 64);
        memory_barrier();
        for (int b = 0; b < nk; b++) {      // C tile (rank x rows) transposed into u's rows
            const int64_t k_in = kbs[b] - js[b] * R;
            const __mmask16 ranks = first_lanes(rank - k_in);
            __m512i t[16];
            for (int m = 0; m < 16; m++) t[m] = _mm512_load_si512(buf + b * 256 + m * 16);
            transpose16_epi32(t);
            float *u = uj[js[b]] + k_in;
            for (int i = 0; i < n; i++) _mm512_mask_storeu_epi32(u + i * ldu, ranks, t[i]);
        }
        nk = 0;
    };
    for (int64_t j = 0; j < 3; j++) {
        if (!((parts >> j) & 1)) continue;
        for (int64_t kb = 0; kb < rank; kb += 16) {
            kbs[nk] = j * R + kb, js[nk++] = j;
            if (nk == 3) flush();
        }
    }
    if (nk > 0) flush();
    _tile_release();
}

// y rows (y: the part's first column), the part's columns [c0, c1) += u @ BT_j; u [n][ldu]
// rounded to bf16 already; bj: BT's part rows (ldb apart); pj: their rank pairs (or null).
__attribute__((target("amx-tile,amx-bf16"))) void lora_amx_expand(const uint16_t *bj, const uint16_t *pj,
                                                                    int64_t ldb, int64_t R, int64_t rank, int n,
                                                                    const int64_t *rows, const float *u,
                                                                    int64_t ldu, int64_t c0, int64_t c1,
                                                                    int64_t size, uint16_t *y, int64_t ldy) {
    // kk: rank values per expand step (R = 16: one step of 16; else steps of 32)
    const int64_t kk = R % 32 == 0 ? 32 : 16, Rp = (R + kk - 1) / kk * kk, ksteps = (rank + kk - 1) / kk,
                  tile = kk * 16;     // bf16 per packed BT tile
    thread_local std::vector<uint16_t> ub_v, bb_v;    // u [16][Rp]; BT tiles [3][Rp/kk][kk/2][32]
    ub_v.assign(16 * Rp, 0);
    if (static_cast<int64_t>(bb_v.size()) < 3 * Rp * 16) bb_v.resize(3 * Rp * 16);   // zero rows stay zero
    uint16_t *ub = ub_v.data(), *bb = bb_v.data();
    for (int i = 0; i < n; i++)      // exact: u is rounded to bf16 already (its low halves are zero)
        for (int64_t k = 0; k < rank; k += 16) {
            const __mmask16 m = first_lanes(rank - k);
            const __m512i v = _mm512_srli_epi32(_mm512_maskz_loadu_epi32(m, u + i * ldu + k), 16);
            _mm256_mask_storeu_epi16(ub + i * Rp + k, m, _mm512_cvtepi32_epi16(v));
        }
    const int64_t full = size / 16 * 16, end = std::min(c1, full);
    // C tiles go out through buf: a group's are added into y one group later, after the next
    // group's tile operations, so the vector loads find the tile stores done (added at once, each
    // waited on its stores: most of the expand's time).
    alignas(64) float buf[2][3 * 256];
    int64_t pending_c = -1;
    int pending_nct = 0;
    auto add_pending = [&]() {
        const float *done = buf[(pending_c - c0) / 48 % 2];
        for (int ct = 0; ct < pending_nct; ct++)
            for (int i = 0; i < n; i++)
                lora_add_store(y + rows[i] * ldy + pending_c + ct * 16, _mm512_load_ps(done + ct * 256 + i * 16));
    };
    if (c0 < end) lora_expand_config(kk);
    for (int64_t c = c0; c < end; c += 48) {
        const int nct = static_cast<int>(std::min<int64_t>(3, (end - c) / 16));
        // B tiles: straight from the pairs made at load, or paired here into bb
        const uint16_t *tb[3][8];
        int64_t tstride = 64;
        if (pj != nullptr) {
            tstride = ldb * 4;
            for (int ct = 0; ct < nct; ct++)
                for (int64_t ks = 0; ks < ksteps; ks++) tb[ct][ks] = pj + (ks * kk / 2 * ldb + c + ct * 16) * 2;
        } else {
            for (int ct = 0; ct < nct; ct++)
                for (int64_t ks = 0; ks < ksteps; ks++) {
                    uint16_t *t = bb + (ct * (Rp / kk) + ks) * tile;
                    tb[ct][ks] = t;
                    for (int pr = 0; pr < kk / 2; pr++) {
                        const int64_t k = ks * kk + 2 * pr;
                        if (k >= rank) break;       // u is zero there: rows past the rank need only be finite
                        const uint16_t *r0 = bj + k * ldb + c + ct * 16;     // rank rows k, k + 1 < R
                        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)r0));
                        const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(r0 + ldb)));
                        _mm512_storeu_si512(t + pr * 32, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
                    }
                }
        }
        memory_barrier();
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        for (int64_t ks = 0; ks < ksteps; ks++) {
            _tile_loadd(6, ub + ks * kk, Rp * 2);
            _tile_loadd(4, tb[0][ks], tstride);
            _tile_dpbf16ps(0, 6, 4);
            if (nct > 1) {
                _tile_loadd(5, tb[1][ks], tstride);
                _tile_dpbf16ps(1, 6, 5);
            }
            if (nct > 2) {
                _tile_loadd(7, tb[2][ks], tstride);
                _tile_dpbf16ps(2, 6, 7);
            }
        }
        float *out = buf[(c - c0) / 48 % 2];
        _tile_stored(0, out, 64);
        _tile_stored(1, out + 256, 64);
        _tile_stored(2, out + 512, 64);
        memory_barrier();
        if (pending_c >= 0) add_pending();
        pending_c = c, pending_nct = nct;
    }
    if (pending_c >= 0) add_pending();
    if (c0 < end) _tile_release();
    if (c1 > full && full < size)
        for (int i0 = 0; i0 < n; i0 += kLoraRows) {
            uint16_t *yr[kLoraRows];
            const int m = std::min(kLoraRows, n - i0);
            for (int i = 0; i < m; i++) yr[i] = y + rows[i0 + i] * ldy;
            lora_expand<Vec>(u + i0 * ldu, ldu, m, bj, ldb, rank, yr, std::max(c0, full), size);
        }
}
#endif
}  // namespace
