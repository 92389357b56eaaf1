"""Linear layers over weights kept in GGUF block formats (quant_kernels.cpp, via ctypes).

The formats, `QuantizedWeight` and the torch reference live in pagedserve/quant_format.py (a
room of their own, which models/ imports too); this module re-exports them. Layouts of a type's
own bytes (REPACKED): `repack` rewrites a q4_0 matrix whose width is a
multiple of 256, in place where the loader owns its copy (not a file's mapping), as q4_0x8:
each 8 blocks' scales together and their nibbles rearranged so that every 32-bit lane of a
512-bit dot falls in one block, which makes the avx512vnni T = 1 dot about 2x faster in L2 and
the 1.7B shape's Q4_0 decode 1.18x (benchmarks/quantized.py --full); every path and variant
computes the same values from it (the others through decode's pieces), `file_layout` undoes it.

Two paths, chosen per call by the number of activation rows T:
- T <= batch_rows(decode, bf16): SMALL_BATCH_ROWS, or DECODE_BATCH_ROWS for a batch of decode
  tokens only (decode, small batches; prefill chunks switch earlier, since tiles keep them closer
  to the float model); AMX_BATCH_ROWS for both where bf16 tiles run on cpu.py's AMX GEMM: the
  activations are quantized once per call
  into 8-bit blocks of 32 (int8 values q, one float scale dx per block, and dx * sum(q) for the
  minimum terms), then every 32 weights give one integer dot product of their codes with q
  (vpdpbusd: unsigned codes x signed q; q8_0 / q6_k signed codes as |w| x q with w's sign) and
  one float32 multiply-add by the block's scale:
      y += (A * dx) * dot(code, q) + C * (dx * sum(q))
  A, C: the block's (sub-block's) scale and minimum or offset term (q4_0: C = -8 A; q6_k's
  per-16 scales multiply the dot's lanes). Mathematically y = x8 @ W.T with x8 = dx * q, the
  activations as the q8 blocks hold them: `reference_linear` computes that in float64 for the
  tests; variants differ from it only by float32 summation order. OpenMP over output rows (the
  thread count torch / the engine set), up to 8 (AVX-512) or 4 activation rows per pass over a
  weight row. Every type, every variant has this path. In the avx512vnni build, where the CPU
  has AMX-INT8 and cpu.py's AMX switch is on (amx_int8_in_use()), from AMX_INT8_MIN_ROWS rows
  the same dots run on AMX tiles (tdpbssd): 16 weight rows' codes of one 32-element piece
  (q6_k: 16) as signed int8 times 16 activation rows' q8 values, each piece's 16 x 16 int32 dots
  rescaled by A * dx in AVX-512 (and + C * ds); a group of 16 weight rows is unpacked once into
  an L2 buffer for all activation rows, so the integer path's cost per row of x is the rescale,
  not the unpacking, and it holds batches of decode tokens up to AMX_INT8_BATCH_ROWS (prefill
  chunks keep the thresholds above: tiles from 12 / 16 rows, closer to the float model).
- larger T (prefill): weight tiles (tile_rows: about TILE_ELEMENTS weights) are dequantized in
  C++ straight into the packed layout of kernels/cpu.py's GEMM (bf16 for bf16 activations,
  float32 for float32) and multiplied by that GEMM straight into their columns of y (its
  address, linear_packed_ld_*, passed to quant_kernels.cpp: one call per layer; bf16 on AMX where
  cpu.amx_in_use()): exactly cpu.linear over the dequantized weight, without the whole matrix
  ever in float. A tile is dequantized 16 rows x 256 columns at a time through an L1 buffer
  (floats in registers, bf16 by vcvtne2ps2bf16 where the CPU has it, 16x16 transposes in
  registers). Without cpu.py's kernels: a float32 scratch tile and torch.matmul.
  For bf16 x where amxw_in_use() (AMX-BF16, cpu.py's AMX switch on, avx512vnni build),
  quant_linear_tiles computes the same values another way: x of amxw_rows() rows (8..384) with
  the weights as AMX A tiles (amxw_linear in quant_kernels.cpp: 32 weight rows dequantized
  row-major, bf16 as the packed tiles, into an L2 buffer, overlapping the AMX passes of the 32
  before; x once per call as B tiles; every k summed in float32 tiles), and the integer path
  stops below 8 rows for bf16 x (decode and prefill alike); more rows: the packed tiles, each
  thread packing its own ~512 KiB blocks and running the GEMM on them alone (fused_tiles).

Variants (VARIANTS, best first), the same source compiled with each family's flags:
`avx512vnni` (AVX-512 BW/VL + VNNI: 64 weights per vpdpbusd, scales of two blocks or a
super-block's eight converted together; codes always unsigned, q8_0's offset (128 after flipping
its sign bit) in one- or two-row passes and q6_k's (32) always taken off in the integers by
starting the dot from -offset times the activations' sums of 4, computed once per call (q4_0's,
q5_0's as the minimum term C * ds); nibbles and fifth bits unpacked by broadcast loads, masked
shifts and byte masks, with no permutes; the 32-element types in groups of 16 blocks: their 16
fp16 scales (and q4_1 / q5_1's minimums) in one gather, converted and multiplied by the 16
activation scales at once, so each pair of blocks costs one dot, one conversion, one spread and
one multiply-add, one chain of sums per row (so a row's bits never depend on the rows a pass:
INVARIANT_DOTS); at T = 1 two weight rows per call (all types but q5_0 / q5_1, slower so), a
32-element group's activation loads serving both, the super-blocks' two streams interleaved),
`vnni256` (AVX-512 VNNI + VL: the avxvnni source, r8 layouts and 256-bit dots, with vpdpbusd's EVEX form;
the default where the CPU has no AMX-INT8, which the avx512vnni build's AMX paths need: on Zen 4 its 512-bit
dots decoded every file type slower than the r8 kernels, K-quants included: benchmarks/RESULTS.md),
`avxvnni` (AVX2 + AVX-VNNI: the VEX vpdpbusd on 32 weights), `avx2` (maddubs + madd: no pair saturates,
codes <= 63 or |w| <= 128 times |q| <= 127; both: one or two rows of a 32-element type in groups of 8 blocks, their scales in one gather), `scalar` (plain loops over the same integers). The best the CPU's flags allow (and a
variant's `default_needs`) is chosen at first use; $PAGEDSERVE_QUANT_KERNELS forces one; `using_variant` runs a block with another
(tests run all the CPU supports). Chosen, built and loaded by a cpu.KernelLibrary (KERNELS),
as kernels/cpu.py's library is (system C++ compiler on first use, cached under
~/.cache/pagedserve/kernels by source and flags; the flags add -ffp-contract=off so dequantize
matches gguf bit for bit); where none builds, torch stands in (dequantize in row chunks, float
matmul).
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from typing import Sequence

import torch

from pagedserve.kernels import cpu
from pagedserve.quant_format import (  # noqa: F401 (re-exported: the formats and reference, as before)
    BLOCK, BLOCK_BYTES, QTYPES, QUANTIZE_TYPES, R8, R8_FIELDS, R8_GEMM, R8_OF, REPACKED, SUPER_ACT, ROW_CHUNK_ELEMENTS, QuantizedWeight,
    _q4_0x8_order, activation_block, r8_order, _rows_of, _row_chunks, concat_rows, dequantize_torch, file_layout, from_gguf_blocks,
    q8_activations, quantize_activations, quantize_torch, reference_linear, slice_cols, slice_rows)

logger = logging.getLogger(__name__)

# The `qtype` argument of the C functions: csrc/quant/qtypes.h's QType order (the GGUF types with
# the integer dots' templates, the repacked layouts, then MXFP4, which quant/mxfp4.h computes, and its
# r8 layout).
_QTYPE_ID = {q: i for i, q in enumerate(tuple(q for q in QTYPES if q != "mxfp4") +
                                        tuple(q for q in REPACKED if q != "mxfp4r8") + ("mxfp4", "mxfp4r8"))}
R8_DECODE_ROWS = 32     # q4_1r8's integer dots against the AMX-BF16 tiles at the 135M shape: equal at 32 rows
R8_VARIANTS = ("avx2", "avxvnni", "vnni256")    # where repack makes every R8_OF layout (256-bit kernels: dot_*r8_256.h)
# There the integer dots over r8 layouts take every decode batch (faster than the tiles, which unpack
# the rows first, from 1 to 512 rows), and every prefill chunk too where each part has the integer
# GEMM (R8_GEMM: csrc/quant/gemm_r8_256.h, from 8 rows: a unit's codes unpacked once per tile of 64
# activation rows, the same arithmetic per row as the dots; faster than the float tiles on Zen 3:
# benchmarks/RESULTS.md, issue 47), so a row's arithmetic never depends on the batch in any step (the
# products are batch-invariant whatever the engine's batch_invariant setting, issue 51). Products
# with an mxfp4r8 part (no GEMM) keep that only in a batch-invariant step (linear(invariant=True), or
# set_batch_invariant(True) for every product: kernel tests, benchmarks; $PAGEDSERVE_BATCH_INVARIANT
# is the engine's: config.py); other steps' prefill chunks take the float tiles.
R8_ALL_ROWS = 1 << 30
# Where repack makes the r8 layouts of a mixture-of-experts layer's experts (repack's `experts`): the
# R8_VARIANTS, and avx512vnni, whose experts kernel (csrc/moe/experts.h) runs the same 256-bit r8
# dots and GEMM with its EVEX vpdpbusd while its dense products keep their own layouts and kernels.
EXPERT_R8_VARIANTS = R8_VARIANTS + ("avx512vnni",)
# Variants whose integer dots over the files' layouts compute a row the same way whatever the rows
# around it (csrc/quant/dot_avx512vnni.h: one chain of sums per row and one form of each type's
# offset whatever the rows a pass; the super-block dots per row; q4_1r8's 512-bit dots per row):
# there a batch-invariant step takes the integer dots at every row count of every product (no
# dequantized tiles, no AMX-BF16 weights-as-A tiles) and no AMX-INT8 tiles (quant_linear_small's
# `invariant`), decode, verification and prefill rows alike; other steps keep the faster tiles
# above batch_rows' thresholds (issue 51).
INVARIANT_DOTS = ("avx512vnni",)
_batch_invariant = False


def set_batch_invariant(enabled: bool) -> None:
    """Every product's prefill chunks over r8 layouts on the integer dots as decode rows (see
    R8_ALL_ROWS), whether or not the call asks for it (linear's `invariant`)."""
    global _batch_invariant
    _batch_invariant = bool(enabled)


def invariance_changes(qtypes: set[str]) -> bool:
    """Whether linear's `invariant` changes the arithmetic of products of these block types: on
    the INVARIANT_DOTS variants of every quantized type (their integer dots then take rows the
    tiles take in other steps); on the R8_VARIANTS only of r8 layouts without the integer GEMM
    (mxfp4r8), whose integer dots then take a prefill chunk's rows too (batch_rows; the other r8
    layouts take them in every step). Elsewhere a row's arithmetic is the same in either kind of
    step (the engine then marks no cached block batch-dependent: Scheduler.batch_dependent_steps)."""
    active = KERNELS.variant()
    if active in INVARIANT_DOTS:
        return any(q in QTYPES or q in REPACKED for q in qtypes)
    return active in R8_VARIANTS and any(q in R8 and q not in R8_GEMM for q in qtypes)


REPACK_ENV = "PAGEDSERVE_QUANT_REPACK"   # 0: keep the file's layout (repack() returns its weight as it is)

# T up to this: integer dots on q8 activations; above: dequantized tiles (batch_rows() picks).
# Measured interleaved in one process (2 threads, Sapphire Rapids): over the vdpbf16ps GEMM the
# tiles won from 17 rows (prefill chunks) and decode batches kept the integer path to 32; over
# cpu.py's AMX GEMM (cpu.amx_in_use()) they win from 12 rows at the 1.7B shapes and from 9-12 at
# the 135M ones, for prefill and decode alike (benchmarks/gemm.py prints the crossover per type).
SMALL_BATCH_ROWS = 16        # without AMX
DECODE_BATCH_ROWS = 32       # the same for batches of decode tokens only (linear(decode=True)), without AMX
AMX_BATCH_ROWS = 12          # both, where the GEMM runs on AMX (and the dots do not: no AMX-INT8)
# Where the integer dots run on AMX-INT8 tiles (amx_int8_in_use()): from AMX_INT8_MIN_ROWS rows
# (fewer: vpdpbusd) up to AMX_INT8_BATCH_ROWS in batches of decode tokens, either activation dtype.
# Measured interleaved (2 threads, quiet, 1.7B layer shapes; benchmarks/gemm.py): over vpdpbusd
# AMX-INT8 wins from 8 rows (q4_0 0.79x, q4_k 1.01x, q6_k 1.07x the time), over the bf16 tiles
# on AMX up to ~30 (24 rows: 0.80-0.89x; 32: q4_0 0.97x, q4_k 1.05x, q8_0 1.10x).
AMX_INT8_MIN_ROWS = 8
AMX_INT8_BATCH_ROWS = 28


# Where cpu.py's AMX switch is on and the active variant (avx512vnni) finds AMX-BF16
# (amxw_in_use()): quant_linear_tiles runs bf16 x of AMXW_MIN_ROWS .. AMXW_MAX_ROWS rows on
# AMX-BF16 with the weights as A tiles (32 weight rows dequantized row-major into L2, x once per
# call as B tiles: no packed layout, no per-block rescale), and the integer dots stop below
# AMXW_MIN_ROWS for bf16 x, decode batches and prefill chunks alike (the values are the tiles':
# bf16 weights times bf16 x, float32 sums). Measured interleaved in one process (2 threads,
# Sapphire Rapids, 1.7B and 135M layer shapes): see docs/architecture.md's quantized rows.
AMXW_MIN_ROWS = 8
AMXW_MAX_ROWS = 384


class _AmxPath:
    """One of the quant library's AMX paths, following cpu.py's AMX switch ($PAGEDSERVE_AMX,
    cpu.set_amx / using_amx) unless set alone: `wanted` (None: as cpu.amx_in_use()) and its row
    parameters (None: the defaults), handed to the library's `config` function whenever they, or
    the active library, changed since the last call."""

    def __init__(self, config: str, default: tuple[int, ...]) -> None:
        self.config, self.default = config, default
        self.wanted: bool | None = None
        self.params: tuple[int, ...] | None = None
        self._key: tuple | None = None       # the state the active library was configured for
        self._active = False

    def rows(self) -> tuple[int, ...]:
        return self.params or self.default

    def in_use(self) -> bool:
        lib = KERNELS.lib if KERNELS.active is not None else load()
        wanted = cpu.amx_in_use() if self.wanted is None else (self.wanted and cpu.amx_in_use())
        key = (id(lib), wanted, self.rows())
        if key != self._key:
            self._key = key
            self._active = bool(lib is not None and getattr(lib, self.config)(int(wanted), *self.rows()))
        return self._active

    def set(self, enabled: bool | None, params: tuple[int, ...] | None) -> bool:
        self.wanted, self.params = enabled, params
        return self.in_use()

    @contextlib.contextmanager
    def using(self, enabled: bool | None, params: tuple[int, ...] | None):
        previous = (self.wanted, self.params)
        try:
            yield self.set(enabled, params)
        finally:
            self.set(*previous)


_AMXW = _AmxPath("quant_amxw_config", (AMXW_MIN_ROWS, AMXW_MAX_ROWS))
# The AMX-INT8 dots: set_amx_int8 / using_amx_int8 turn them off alone or move their first row
# (tests, benchmarks/gemm.py).
_AMX8 = _AmxPath("quant_amx_config", (AMX_INT8_MIN_ROWS,))


def amxw_rows() -> tuple[int, int]:
    """The rows of bf16 x (first, last) the AMX-BF16 weights-as-A path takes."""
    return _AMXW.rows()


def amxw_in_use() -> bool:
    """Whether quant_linear_tiles runs bf16 x of amxw_rows() rows with the weights as AMX A
    tiles (configures the active library where the switches changed since its last call)."""
    return _AMXW.in_use()


def set_amxw(enabled: bool | None, rows: tuple[int, int] | None = None) -> bool:
    """The weights-as-A AMX-BF16 path on (where cpu.amx_in_use()), off, or None: as cpu's AMX
    switch; for rows (first, last) of bf16 x (None: AMXW_MIN_ROWS, AMXW_MAX_ROWS). Returns
    amxw_in_use()."""
    return _AMXW.set(enabled, rows)


def using_amxw(enabled: bool | None, rows: tuple[int, int] | None = None):
    """A block with set_amxw(enabled, rows), then the previous settings."""
    return _AMXW.using(enabled, rows)


# The fewest activation rows the r8 GEMM (csrc/quant/gemm_r8_256.h) takes; fewer run the 1-4-row
# dots. Both give a row the same bits, so the crossover is free to sit where it is cheaper, per build
# (`benchmarks/gemm_r8.py --shape smollm2-1.7b --crossover ...`, 2 threads; benchmarks/RESULTS.md):
# avx2 on Zen 3, the GEMM 0.54-0.79x the dots' time from 8 rows (1.07-1.09x at 4); vnni256 on Zen 4,
# the dots faster up to 16 rows (GEMM / dots at 16: q4_0 1.14, q4_k 1.14, q8_0 1.05, q6_k 0.98), so
# there the GEMM starts at 17. Both cost per row (no fixed cost per 64-row tile).
# (The value is gemm_r8_256.h's kDenseGemmMinRows, read from the active library by gemm_r8_min_rows;
# R8_GEMM_MIN_ROWS answers where no kernels are built.)
R8_GEMM_MIN_ROWS = 8


def gemm_r8_min_rows() -> int:
    """The active library's first r8 GEMM row count (its build's kDenseGemmMinRows, unless moved)."""
    lib = load()
    return int(lib.quant_gemm_r8_config(0)) if lib is not None else R8_GEMM_MIN_ROWS


def set_gemm_r8_min_rows(rows: int) -> int:
    """Move the r8 GEMM's first row count (tests, benchmarks; rows >= 1) in the active library;
    returns the previous one."""
    if rows < 1:
        raise ValueError(f"set_gemm_r8_min_rows: {rows} rows (at least 1)")
    lib = load()
    return int(lib.quant_gemm_r8_config(int(rows))) if lib is not None else R8_GEMM_MIN_ROWS


def batch_rows(decode: bool = False, bf16: bool = False, r8: bool = False, invariant: bool = False,
               gemm: bool = False) -> int:
    """The most rows of x the integer path takes (more: dequantized tiles), for a batch of
    decode tokens only (`decode`) or any batch, of bf16 activations or float32 ones, as the GEMM
    the tiles would run on makes it pay (AMX: bf16 only); `r8`: weights all in r8 layouts, whose integer
    dots beat the tiles up to R8_DECODE_ROWS rows of a decode batch, and on the 256-bit variants
    (R8_VARIANTS) at any number of decode rows (R8_ALL_ROWS), and of any rows of prefill chunks
    too where `gemm` (every part in R8_GEMM: the integer GEMM's) or in a batch-invariant step
    (`invariant`, or set_batch_invariant(True)): a row's arithmetic then never depends on the batch.
    On the INVARIANT_DOTS variants a batch-invariant step takes every row count of any layout."""
    invariant = invariant or _batch_invariant
    active = KERNELS.variant()
    if invariant and active in INVARIANT_DOTS or r8 and (decode or gemm or invariant) and active in R8_VARIANTS:
        return R8_ALL_ROWS
    if decode and r8:
        return R8_DECODE_ROWS
    if bf16 and amxw_in_use():
        return amxw_rows()[0] - 1
    # Prefill chunks keep the float tiles above the old thresholds: closer to the float model
    # (the default model's float32 oracle tests diverge with 8-bit activations up to 28 rows).
    if decode and amx_int8_in_use():
        return AMX_INT8_BATCH_ROWS
    if bf16 and cpu.amx_in_use():
        return AMX_BATCH_ROWS
    return DECODE_BATCH_ROWS if decode else SMALL_BATCH_ROWS


def amx_int8_in_use() -> bool:
    """Whether quant_linear_small runs its dots on AMX-INT8 tiles (from amx_int8_min_rows()
    rows; configures the active library where the switches changed since its last call)."""
    return _AMX8.in_use()


def amx_int8_min_rows() -> int:
    return _AMX8.rows()[0]


def set_amx_int8(enabled: bool | None, min_rows: int | None = None) -> bool:
    """AMX-INT8 dots on (where cpu.amx_in_use()), off, or None: as cpu's AMX switch; from
    min_rows rows (None: AMX_INT8_MIN_ROWS). Returns amx_int8_in_use()."""
    return _AMX8.set(enabled, (min_rows,) if min_rows else None)


def using_amx_int8(enabled: bool | None, min_rows: int | None = None):
    """A block with set_amx_int8(enabled, min_rows), then the previous settings."""
    return _AMX8.using(enabled, (min_rows,) if min_rows else None)


TILE_ELEMENTS = 1 << 20      # weights dequantized per tile of the large-batch path (4 MiB in float32)
SOURCE = cpu.CSRC / "quant_kernels.cpp"
ENV_VARIANT = "PAGEDSERVE_QUANT_KERNELS"
_EXACT = ("-ffp-contract=off",)    # no fused multiply-adds the source does not ask for: dequantize matches gguf
_AVX2 = _EXACT + ("-mavx2", "-mfma", "-mf16c")
_AVX2_FLAGS = ("avx2", "fma", "f16c")
_AVX512 = _AVX2 + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
_AVX512_FLAGS = _AVX2_FLAGS + ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
# Without AMX the avx512vnni build is not the default: on Zen 4 (2 vCPU, benchmarks/RESULTS.md, issue 50) its
# 512-bit dots decoded every file type slower than the r8 layouts' 256-bit dots (vnni256: the avxvnni source
# with vpdpbusd's EVEX form), interleaved (benchmarks/variant_ab.py): the 1.7B shape's Q4_0 0.61x, Q4_K_M
# 0.70x and Gemma 3 4B's Q4_K_M 0.72x (the q4_k / q6_k super-block dots too: no per-type mix of the two
# builds pays there), Q8_0 0.60x, the default Q4_1 0.89x; where AMX is, the avx512vnni build's AMX paths
# stay the default.
VARIANTS = (     # best first
    cpu.Variant("avx512vnni", _AVX512, _AVX512_FLAGS, default_needs=("amx_int8",)),
    cpu.Variant("vnni256", _AVX512 + ("-DPAGEDSERVE_DOTS256",), _AVX512_FLAGS),
    cpu.Variant("avxvnni", _AVX2 + ("-mavxvnni",), _AVX2_FLAGS + ("avx_vnni",)),
    cpu.Variant("avx2", _AVX2, _AVX2_FLAGS),
    cpu.Variant("scalar", _EXACT, ()),
)

_P, _I = ctypes.c_void_p, ctypes.c_int64


class QuantPart(ctypes.Structure):
    """QuantPart in quant_kernels.cpp: a weight (one part of a row-stacked product) as the C
    functions take it."""
    _fields_ = [("qtype", ctypes.c_int64), ("w", ctypes.c_void_p), ("ldw", ctypes.c_int64), ("rows", ctypes.c_int64)]


_SIGNATURES = {
    # r8 qtype, data (the file type's rows, rewritten in place), rows, blocks a row
    "quant_repack_r8": [ctypes.c_int, _P, _I, _I],
    # qtype, w, ldw (bytes), rows, cols, out (float32), ldo
    "quant_dequantize": [ctypes.c_int, _P, _I, _I, _I, _P, _I],
    # qtype, w, ldw, ids (int64), n, cols, out (float32)
    "quant_dequantize_rows": [ctypes.c_int, _P, _I, _P, _I, _I, _P],
    # qtype, x, ldx, x_is_bf16, rows, cols, out, ldo (bytes)
    "quant_quantize": [ctypes.c_int, _P, _I, ctypes.c_int, _I, _I, _P, _I],
    # x, ldx, x_is_bf16, rows, cols, q (int8 [rows, cols]), d (float32 [rows, cols / 256]), bs (int16 [rows, cols / 16]):
    # the super-block activations the 256-bit and scalar builds' q4_kr8 / q5_kr8 / q6_kr8 kernels multiply
    "quant_quantize_super": [_P, _I, ctypes.c_int, _I, _I, _P, _P, _P],
    # parts, nparts, x, ldx, x_is_bf16, T, K, bias (float32 or null), y, ldy, y_is_bf16, invariant (no AMX-INT8)
    "quant_linear_small": [_P, _I, _P, _I, ctypes.c_int, _I, _I, _P, _P, _I, ctypes.c_int, ctypes.c_int],
    # parts, nparts, x, x_is_bf16, T, K, bias, y, ldy, gemm (cpu.py's linear_packed_ld_*), tile_rows
    "quant_linear_tiles": [_P, _I, _P, ctypes.c_int, _I, _I, _P, _P, _I, _P, _I],
    # enable, min_rows -> 1 where quant_linear_small runs its dots on AMX-INT8 (avx512vnni build)
    "quant_amx_config": [_I, _I],
    # enable, min_rows, max_rows -> 1 where quant_linear_tiles runs bf16 x of those rows on AMX-BF16
    # with the weights as A tiles (avx512vnni build)
    "quant_amxw_config": [_I, _I, _I],
    # min_rows -> the previous value: the fewest activation rows the r8 GEMM (gemm_r8_256.h) takes
    "quant_gemm_r8_config": [_I],
    # plan (cpu_kernels.cpp's Handover, or null): the calling thread's next linear call fetches its
    # ranges and runs its `after` at the end of its parallel region
    "quant_handover_next": [_P],
    # experts (MoEExpert [E]), E, x, ldx, x_is_bf16, T, H, I, ids (int64 [T, k]), weights (float32 [T, k]), k,
    # glu (MoEGlu, or null: SwiGLU), out (float32 [T, H], added to): a layer's routed experts (kernels/moe.py)
    "quant_moe_experts": [_P, _I, _P, _I, ctypes.c_int, _I, _I, _I, _P, _P, _I, _P, _P],
}
KERNELS = cpu.KernelLibrary(SOURCE, VARIANTS, ENV_VARIANT, _SIGNATURES, "quant_kernel_variant", "quant kernel", logger,
                            "quantized-weight kernels (%s) unavailable, using torch: %s",
                            build_seconds={"avx512vnni": 20, "vnni256": 8, "avxvnni": 5, "avx2": 4, "scalar": 4})
VARIANTS = KERNELS.variants      # as this machine has them (off x86: scalar only)


def repack(w: QuantizedWeight, in_place: bool = False, mapped: bool = False, experts: bool = False) -> QuantizedWeight:
    """w in the layout the decode kernels read fastest where there is one (q4_0 with columns a
    multiple of 256: q4_0x8, about 2x the T = 1 dot's compute rate; q4_1 with rows a multiple of
    8 on the avx512vnni variant: q4_1r8, 2-3x at 1-8 rows (Zen 4 without AMX: 1.4x at T = 1, 2.7x from 4 rows
    up to 512, where they equal the bf16 tiles: the dots a batch-invariant step runs); on the avx2 and avxvnni
    variants (R8_VARIANTS) q4_0, q4_1, q5_0, q8_0, q4_k, q5_k, q6_k and mxfp4 with rows a multiple of 8:
    their r8 layouts (R8_OF), 1.5-2.5x at 1-16 rows; q4_k 2.4x at T = 1 on Zen 3), else w itself. in_place:
    w's bytes are rewritten (only where the caller owns them: not a file's mapping), no copy
    of the whole matrix; else a new tensor. mapped: a small matrix the loader left in the file's
    mapping: a copy in an r8 layout on the R8_VARIANTS (so that every projection of a model is r8:
    batch-invariant rows, and the compiled loop's integer dots at any batch), else w itself.
    experts: a mixture-of-experts layer's expert, in its r8 layout on the EXPERT_R8_VARIANTS too (the
    experts kernel's). Every path computes the same values from either."""
    r8_variants = EXPERT_R8_VARIANTS if experts else R8_VARIANTS
    if mapped and variant() not in r8_variants:
        return w
    r8_here = variant() in r8_variants or (w.qtype == "q4_1" and variant() == "avx512vnni")
    if w.qtype in R8_OF and w.shape[0] % 8 == 0 and w.data.is_contiguous() and \
            os.environ.get(REPACK_ENV, "1") != "0" and r8_here:
        r8 = R8_OF[w.qtype]
        lib = load()
        if lib is not None:     # (the C++ shuffle, in place: ~10x torch's byte gathers, a 12 GB model's load)
            out = (w.data if in_place else w.data.clone()).view(w.shape[0] // 8, -1)
            _check(lib.quant_repack_r8(_QTYPE_ID[r8], out.data_ptr(), w.shape[0], w.shape[1] // BLOCK[r8]),
                   "quant_repack_r8")
            return QuantizedWeight(r8, w.shape, out)
        out = w.data.view(w.shape[0] // 8, -1) if in_place else \
            torch.empty(w.shape[0] // 8, w.row_bytes * 8, dtype=torch.uint8)
        step = max(8, ROW_CHUNK_ELEMENTS // w.shape[1] // 8 * 8)     # groups of rows at a time: little scratch
        for r0 in range(0, w.shape[0], step):      # (in place: the same storage, the loader's huge-page copy)
            r1 = min(w.shape[0], r0 + step)
            out[r0 // 8:r1 // 8] = r8_order(r8, w.data[r0:r1], r1 - r0, w.shape[1] // BLOCK[r8], True)
        return QuantizedWeight(r8, w.shape, out)
    if w.qtype != "q4_0" or w.shape[1] % 256 or os.environ.get(REPACK_ENV, "1") == "0" or mapped:
        return w
    out = w.data if in_place else torch.empty_like(w.data)
    for r0, r1 in _row_chunks(*w.shape):
        out[r0:r1] = _q4_0x8_order(w.data[r0:r1], to_x8=True)
    return QuantizedWeight("q4_0x8", w.shape, out)


def dequantize(w: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight as a float matrix [rows, cols] (exactly gguf.quants.dequantize's values)."""
    w = _rows_of(w)
    lib = load()
    if lib is None:
        return dequantize_torch(w, dtype)
    rows, cols = w.shape
    out = torch.empty(rows, cols, dtype=torch.float32)
    if rows and cols:
        _check(lib.quant_dequantize(_QTYPE_ID[w.qtype], w.data.data_ptr(), w.data.stride(0), rows, cols,
                                    out.data_ptr(), cols), "quant_dequantize")
    return out if dtype == torch.float32 else out.to(dtype)


_FEW_IDS = 64                   # ids an embedding lookup checks in Python (a decode step's): no tensor reductions


def embedding(w: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows `ids` of w dequantized ([*ids.shape, cols]): a quantized embedding table's lookup (of
    an r8 layout, a tied LM head's: each row read from its group's units, no copy of the table)."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    if flat.numel():
        # (a decode step's few ids checked in Python: two tensor reductions cost more than its lookup)
        listed = flat.tolist() if flat.numel() <= _FEW_IDS else None
        low, high = (min(listed), max(listed)) if listed else (int(flat.min()), int(flat.max()))
        if low < 0 or high >= w.shape[0]:
            raise IndexError(f"embedding: ids out of range for {w.shape[0]} rows")
    lib = load()
    if lib is None:
        w = _rows_of(w)
        out = torch.stack([dequantize_torch(slice_rows(w, i, i + 1))[0] for i in flat.tolist()]) if flat.numel() \
            else torch.empty(0, w.shape[1])
    else:
        out = torch.empty(flat.numel(), w.shape[1], dtype=torch.float32)
        if flat.numel():
            # (an r8 table: data's rows are its groups of 8, stride(0) a group's bytes)
            _check(lib.quant_dequantize_rows(_QTYPE_ID[w.qtype], w.data.data_ptr(), w.data.stride(0), flat.data_ptr(),
                                             flat.numel(), w.shape[1], out.data_ptr()), "quant_dequantize_rows")
    return out.view(*ids.shape, w.shape[1]).to(dtype)


def quantize(weight: torch.Tensor, qtype: str) -> QuantizedWeight:
    """A float / bf16 [rows, cols] weight in q8_0 or q4_0 (the same bytes as
    gguf.quants.quantize): in C++ over the weight as it is, else in torch row chunk by row
    chunk (never a float32 copy of the whole matrix)."""
    if qtype not in QUANTIZE_TYPES:
        raise ValueError(f"quantize() makes {', '.join(QUANTIZE_TYPES)}, not {qtype!r}")
    rows, cols = weight.shape
    if cols % BLOCK[qtype]:
        raise ValueError(f"{qtype}: {cols} columns are not a multiple of its block ({BLOCK[qtype]})")
    lib = load()
    if lib is not None and weight.dtype in (torch.float32, torch.bfloat16) and weight.is_cpu:
        row_bytes = cols // BLOCK[qtype] * BLOCK_BYTES[qtype]
        data = torch.empty(rows, row_bytes, dtype=torch.uint8)
        if weight.stride(1) != 1:
            weight = weight.contiguous()
        if rows:
            _check(lib.quant_quantize(_QTYPE_ID[qtype], weight.data_ptr(), weight.stride(0),
                                      int(weight.dtype == torch.bfloat16), rows, cols, data.data_ptr(), row_bytes),
                   "quant_quantize")
        return QuantizedWeight(qtype, (rows, cols), data)
    return quantize_torch(weight, qtype)


# ---- linear -----------------------------------------------------------------------------------
def linear(x: torch.Tensor, w: QuantizedWeight | Sequence[QuantizedWeight],
           bias: torch.Tensor | None = None, decode: bool = False, out_dtype: torch.dtype | None = None,
           invariant: bool = False) -> torch.Tensor:
    """x [T, cols] (float32 or bf16) @ w.T (+ bias) -> [T, rows] in out_dtype (default x's;
    the integer path writes float32 straight from its sums, as the LM head's logits want). T up to
    batch_rows(decode, bf16, r8, invariant) (`decode`: x holds decode tokens only; `invariant`: a
    batch-invariant step): integer dots over q8 activations; more: dequantized weight tiles.
    w may be several weights of one width (any types), stacked by rows as one product: a fused
    projection (qkv, gate_up) whose parts are stored apart, with no copy of them (the
    activations are quantized once, one parallel pass covers every part's rows)."""
    if isinstance(w, QuantizedWeight):        # the common case, per layer per step: few checks
        parts, (rows, cols) = [w], w.shape
    else:
        parts = list(w)
        rows, cols = sum(p.shape[0] for p in parts), parts[0].shape[1]
        if any(p.shape[1] != cols for p in parts):
            raise ValueError(f"linear: weights of different widths {[p.shape for p in parts]}")
    if x.dim() != 2 or x.shape[1] != cols:
        raise ValueError(f"linear: x {tuple(x.shape)} does not match weights of width {cols}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"linear: x must be float32 or bfloat16, got {x.dtype}")
    lib = KERNELS.lib if KERNELS.active is not None else load()
    out_dtype = out_dtype or x.dtype
    if x.shape[0] == 0 or rows == 0:
        return torch.zeros(x.shape[0], rows, dtype=out_dtype)
    r8 = all(p.qtype in R8 for p in parts)
    gemm = r8 and all(p.qtype in R8_GEMM for p in parts)
    invariant = invariant or _batch_invariant
    if lib is not None and x.shape[0] <= batch_rows(decode, x.dtype == torch.bfloat16, r8, invariant, gemm) and \
            out_dtype in (torch.float32, torch.bfloat16):
        return _linear_small(x, parts, bias, lib, out_dtype, invariant)
    return _linear_tiles(x, parts, bias, lib).to(out_dtype)


def _c_parts(parts: list[QuantizedWeight]):
    if len(parts) == 1:
        return ctypes.byref(c_part(parts[0])), 1
    return (QuantPart * len(parts))(*[c_part(p) for p in parts]), len(parts)


def _linear_small(x: torch.Tensor, parts: list[QuantizedWeight], bias: torch.Tensor | None, lib,
                  out_dtype: torch.dtype | None = None, invariant: bool = False) -> torch.Tensor:
    """The integer path (any T; linear() takes it up to SMALL_BATCH_ROWS); out: float32 or bf16;
    `invariant`: no AMX-INT8 tiles (a batch-invariant step's product)."""
    rows, cols = parts[0].shape[0] if len(parts) == 1 else sum(p.shape[0] for p in parts), x.shape[1]
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(x.shape[0], rows, dtype=out_dtype or x.dtype)
    bias32 = None if bias is None else bias.float().contiguous()
    _check(lib.quant_linear_small(*_c_parts(parts), x.data_ptr(), x.stride(0), int(x.dtype == torch.bfloat16),
                                  x.shape[0], cols, None if bias32 is None else bias32.data_ptr(), out.data_ptr(),
                                  rows, int(out.dtype == torch.bfloat16), int(invariant)), "quant_linear_small")
    return out


def tile_rows(cols: int) -> int:
    """Weight rows per tile of the large-batch path: about TILE_ELEMENTS weights, a multiple of
    32 (the GEMM's strips), at least two strips per thread."""
    return max(64 * torch.get_num_threads(), TILE_ELEMENTS // max(cols, 1) // 32 * 32)


def _linear_tiles(x: torch.Tensor, parts: list[QuantizedWeight], bias: torch.Tensor | None, lib) -> torch.Tensor:
    """x @ W.T with W dequantized a tile of rows at a time: into kernels/cpu.py's packed GEMM
    (bf16 tiles for bf16 x, float32 for float32 x), else a float32 scratch and torch.matmul."""
    rows, cols = sum(p.shape[0] for p in parts), x.shape[1]
    gemm = cpu._kernel("linear_packed_ld", x)
    if lib is not None and gemm is not None and not (x.dtype == torch.bfloat16 and cols % 2):
        x = x.contiguous()
        out = torch.empty(x.shape[0], rows, dtype=x.dtype)
        bias32 = None if bias is None else bias.float().contiguous()
        _check(lib.quant_linear_tiles(*_c_parts(parts), x.data_ptr(), int(x.dtype == torch.bfloat16), x.shape[0],
                                      cols, None if bias32 is None else bias32.data_ptr(), out.data_ptr(), rows,
                                      ctypes.cast(gemm, ctypes.c_void_p).value, tile_rows(cols)),
               "quant_linear_tiles")
        return out
    x32 = x.float()
    out = torch.empty(x.shape[0], rows, dtype=torch.float32)
    step = tile_rows(cols)
    scratch = torch.empty(min(step, max(p.shape[0] for p in parts)), cols, dtype=torch.float32)
    first = 0
    for w in parts:
        for r0 in range(0, w.shape[0], step):
            r1 = min(w.shape[0], r0 + step)
            tile = scratch[:r1 - r0]
            if lib is not None:
                _check(lib.quant_dequantize(_QTYPE_ID[w.qtype], w.data[r0:r1].data_ptr(), w.data.stride(0), r1 - r0,
                                            cols, tile.data_ptr(), cols), "quant_dequantize")
            else:
                tile.copy_(dequantize_torch(slice_rows(w, r0, r1)))
            out[:, first + r0:first + r1] = x32 @ tile.T
        first += w.shape[0]
    if bias is not None:
        out += bias.float()
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def _check(status: int, name: str) -> None:
    if status != 0:
        raise RuntimeError(f"{name} failed (status {status})")


# ---- variants ---------------------------------------------------------------------------------
def supported_variants() -> list[str]:
    """The variants this CPU can run, best first (always ends with `scalar`)."""
    return KERNELS.supported()


def choose_variant() -> str:
    """$PAGEDSERVE_QUANT_KERNELS if set (refused if this CPU cannot run it), else the best the
    CPU supports."""
    return KERNELS.choose()


def load_variant(name: str) -> ctypes.CDLL | None:
    """Variant `name`'s library, compiled on first use; None (with a warning) if it cannot be
    built. Raises where this CPU cannot run it."""
    return KERNELS.load_variant(name)


def load() -> ctypes.CDLL | None:
    """The active variant's library (chosen on first call; where the best fails to build, the
    next); None if none can be built (then torch computes)."""
    return KERNELS.load()


def use_variant(name: str) -> ctypes.CDLL | None:
    """Make variant `name` the one linear() and dequantize() call."""
    return KERNELS.use(name)


def using_variant(name: str):
    """Run a block with variant `name` active, then restore the previous one (a context manager
    yielding its library)."""
    return KERNELS.using(name)


def kernel_address(name: str) -> int | None:
    """The address of the active variant's C function `name` (quant_linear_small,
    quant_linear_tiles, quant_dequantize, quant_quantize; signatures in quant_kernels.cpp), for
    compiled callers such as a layer loop that runs every projection without Python; pass
    weights as `c_part(w)`. None where no variant is built."""
    lib = load()
    return None if lib is None else ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def c_part(w: QuantizedWeight) -> QuantPart:
    """w as the C functions' QuantPart (built once per weight, kept on it: linear() runs per layer
    per step; pickling leaves it out; holds w.data's address: keep w alive while it is used)."""
    part = w.__dict__.get("_part")
    if part is None:
        part = w.__dict__["_part"] = QuantPart(_QTYPE_ID[w.qtype], w.data.data_ptr(), w.data.stride(0), w.shape[0])
    return part


def variant() -> str | None:
    """The variant in use, or None where none could be built (torch computes)."""
    return KERNELS.variant()


def describe() -> dict:
    """Which variant is in use and why, and which path runs which batch size."""
    active = variant()
    forced = KERNELS.forced()
    gemm = f"cpu.py's packed GEMM ({cpu.variant()}, {cpu.describe_amx()})" if active and cpu.load() is not None \
        else "torch.matmul"
    small = f"integer dots over q8 activations ({active})" if active else "torch (dequantize + matmul)"
    return dict(
        quant_kernels=active or "torch",
        quant_kernels_supported=supported_variants(),
        quant_kernels_reason=(f"forced by {ENV_VARIANT}={forced}" if forced else
                              "the best this CPU's flags allow" if active else "no variant could be built"),
        quant_small_batch_rows=batch_rows(False),
        quant_decode_batch_rows=batch_rows(True),
        quant_amx_batch_rows=batch_rows(False, bf16=True),
        quant_amx_int8=(f"AMX-INT8 dots from {amx_int8_min_rows()} to {AMX_INT8_BATCH_ROWS} rows"
                        if amx_int8_in_use() else "off"),
        quant_amxw=(f"bf16 x of {amxw_rows()[0]} to {amxw_rows()[1]} rows on AMX-BF16, weights as A tiles"
                    if amxw_in_use() else "off"),
        quant_paths={q: f"T <= {batch_rows(False)} ({batch_rows(True)} decode tokens; bf16 x: "
                        f"{batch_rows(False, True)}): {small}; above: tiles "
                        f"dequantized into {gemm}" + (f" (bf16 x up to {amxw_rows()[1]} rows: weights as AMX A tiles)"
                                                      if amxw_in_use() else "") for q in QTYPES},
    )
