// The GGML block types (QType), their sizes, and with_qtype.
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

namespace {

// kernels/quant.py's QTYPES order, then Q4_0X: q4_0 repacked at load (quant.repack) in units of 8
// blocks (256 elements, 144 bytes, the blocks' bytes rearranged): their 8 fp16 d, then two 64-byte
// vectors of nibbles whose byte 8 l + j of vector k is the block l's qs[8 k + j] (elements 8 k + j
// low, 16 + 8 k + j high). A 512-bit dot then has each 32-bit lane in one block (lanes 2l, 2l + 1:
// block l), so the unit's 16 int32 lanes take one conversion and one multiply-add by the 8 scales,
// where the file's layout costs that per two blocks (and a gather per 16): about 2x the T = 1 dot's
// compute rate (1.7B shape, in L2). The activations come permuted to match (Act::qx).
// Then Q4_1R8: q4_1 with 8 rows interleaved per block (quant.repack, rows a multiple of 8): the
// data is [rows / 8][blocks * 160], a unit one block of 8 rows: their 8 fp16 d, their 8 fp16 m,
// then two 64-byte vectors whose byte 8 l + i of vector k is row l's qs[8 k + i]. One 512-bit dot
// covers a block of 8 rows (lanes 2l, 2l + 1: row l) against 8-byte broadcasts of the activations;
// kElems / kBytes count its bytes per row and block as q4_1's (the same bytes). r8_group computes
// it; amxw_rows dequantizes it; every other path reads its rows unpacked (PlainParts).
// Then Q4_0R8 and Q8_0R8: q4_0 and q8_0 the same way (8 fp16 d, then two vectors of nibbles, or
// four of int8 codes: byte 8 l + i of vector k row l's qs[8 k + i]), made on the 256-bit variants
// (avx2, avxvnni), which compute them (and Q5_0R8) with dot_r8_256.h (256-bit registers).
// Then Q5_0R8 (q5_0 the same: 8 fp16 d, the 8 rows' 32-bit qh, then q4_0r8's vectors of nibbles),
// after the super-block ones below (its id follows them: quant.py's _QTYPE_ID order).
// Then Q4_KR8, Q5_KR8, Q6_KR8: the super-block types the same way, a unit one super-block of 8 rows
// (each field of the block in pieces: repack_r8.h's R8Field), computed by dot_k_r8_256.h.
// Then MXFP4 (gpt-oss's experts: 32 E2M1 codes and an E8M0 scale, 17 bytes), computed by
// quant/mxfp4.h alone (with_qtype's per-type templates do not cover it); then MXFP4R8, its r8
// layout (8 E8M0 bytes, then the codes as q4_0r8's), computed by quant/dot_mxfp4_r8_256.h.
enum QType { Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, Q4_0X, Q4_1R8, Q4_0R8, Q8_0R8, Q4_KR8, Q5_KR8, Q6_KR8,
             Q5_0R8, MXFP4, MXFP4R8, kNumTypes };
constexpr int64_t kElems[kNumTypes] = {32, 32, 32, 32, 32, 256, 256, 256, 256, 32, 32, 32, 256, 256, 256, 32, 32, 32};
constexpr int64_t kBytes[kNumTypes] = {18, 20, 22, 24, 34, 144, 176, 210, 144, 20, 18, 34, 144, 176, 210, 22, 17, 17};
// The r8 layouts: 8 rows interleaved per block (repack_r8.h); their file types.
constexpr bool is_r8(int qt) { return (qt >= Q4_1R8 && qt <= Q5_0R8) || qt == MXFP4R8; }
constexpr int r8_file_type(int qt) {
    return qt == Q4_1R8 ? Q4_1 : qt == Q4_0R8 ? Q4_0 : qt == Q8_0R8 ? Q8_0 : qt == Q4_KR8 ? Q4_K : qt == Q5_KR8 ? Q5_K
         : qt == Q5_0R8 ? Q5_0 : qt == MXFP4R8 ? MXFP4 : Q6_K;
}

// f(std::integral_constant<int, QT>{}) for the run-time type qt: the one switch behind every
// per-type table of template instances (a default result, null for a pointer, for none).
template <typename F> auto with_qtype(int qt, F &&f) {
    switch (qt) {
    case Q4_0: return f(std::integral_constant<int, Q4_0>{});
    case Q4_1: return f(std::integral_constant<int, Q4_1>{});
    case Q5_0: return f(std::integral_constant<int, Q5_0>{});
    case Q5_1: return f(std::integral_constant<int, Q5_1>{});
    case Q8_0: return f(std::integral_constant<int, Q8_0>{});
    case Q4_K: return f(std::integral_constant<int, Q4_K>{});
    case Q5_K: return f(std::integral_constant<int, Q5_K>{});
    case Q6_K: return f(std::integral_constant<int, Q6_K>{});
    case Q4_0X: return f(std::integral_constant<int, Q4_0X>{});
    }
    return decltype(f(std::integral_constant<int, Q4_0>{}))();
}

}  // namespace
