"""Quantized weights as data: the GGML block formats and `QuantizedWeight`, a matrix kept in
them, with the layouts the loader may rewrite them into and a plain-torch reference of their
arithmetic. Both models/ (which loads and holds such weights) and kernels/ (kernels/quant.py,
which computes with them) import this room; it imports neither.

Formats (QTYPES): the llama.cpp/GGUF blocks, byte for byte as the file stores them.
32-element blocks: `q4_0` (fp16 d, 16 bytes of nibbles: w = d*(q-8)), `q4_1` (d, m: w = d*q + m),
`q5_0` / `q5_1` (the same with a fifth bit per element in a 32-bit qh: offset 16 / + m), `q8_0`
(d, 32 int8). 256-element super-blocks: `q4_k` / `q5_k` (fp16 d and dmin, 8 sub-blocks of 32
with 6-bit scale and min: w = d*sc*q - dmin*m), `q6_k` (16 sub-blocks of 16 with int8 scales:
w = d*sc*(q-32)). `mxfp4` (gpt-oss's experts, llama.cpp's MXFP4: an E8M0 scale byte e and 16
bytes of E2M1 codes, w = e2m1(code) * 2^(e - 127); pagedserve/mxfp4.py). Other GGUF types (Q2_K, Q3_K, IQ*) have no kernel: the caller dequantizes.

Layout: `QuantizedWeight.data` is the file's own layout, uint8 [rows, cols / BLOCK * BLOCK_BYTES]
(row-major blocks); from_gguf_blocks keeps it as given (a view of a memory map stays one), and
slice_rows / slice_cols (whole blocks) are views (rows may then be strided); concat_rows stacks
weights of one type (fused projections), one copy. REPACKED names the layouts kernels/quant.py's
`repack` rewrites a type into (q4_0x8 and the r8 layouts; see there); `file_layout` undoes them.

The torch reference: `dequantize_torch` (the same float operations as gguf.quants),
`quantize_torch` (q8_0 / q4_0: the bytes of gguf.quants.quantize), `quantize_activations` and
`reference_linear` (the small-batch kernels' arithmetic in float64: the tests' oracle).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pagedserve import mxfp4

QTYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "mxfp4")
# Layouts the loader makes of a file's type (repack): q4_0 in units of 8 blocks, the same bytes
# rearranged so a 512-bit dot's lanes each fall in one block (quant_kernels.cpp's Q4_0X): 8 fp16
# d, then two 64-byte vectors whose byte 8 l + j of vector k is block l's qs[8 k + j]; and the r8
# layouts (R8): 8 rows interleaved per block, data [rows / 8, row bytes * 8], a unit one block (or
# super-block) of 8 rows. A unit holds each field of the file's block (R8_FIELDS: start, bytes,
# piece), in the block's order, in pieces: piece k of row l at (8 * start) + piece * (8 k + l)
# (q6_kr8: 8 * at instead), so q4_1r8 is their 8 fp16 d, 8 fp16 m, then vectors of 64 bytes whose
# byte 8 l + i of vector k is row l's qs[8 k + i]; q4_0r8 and q8_0r8 the same (no m); q5_0r8: 8 d, the 8 rows' 32-bit qh
# (row l's at 16 + 4 l), then the qs as q4_0r8's; q4_kr8: 8 d, 8 dmin, the 12 scale bytes
# as 3 words per row (word w of row l at 32 + 32 w + 4 l), then the qs as above; q5_kr8 the same
# with qh as 8-byte pieces before the qs; q6_kr8: the 16 int8 scales in 1-byte pieces (row l's sc[i]
# at 8 i + l), 8 d, then 4 chunks of 384 bytes, each 16 bytes a row of qh, ql, ql in 4-byte pieces (a
# 32-byte vector holds 4 codes of each of the 8 rows: a row's sums stay in its dword), in the order its
# dot reads them (R8_FIELDS' at); mxfp4r8: the 8 rows' E8M0 bytes, then the qs as q4_0r8's. The dots
# on 256-bit registers (AVX2, AVX-VNNI): csrc/quant/dot_r8_256.h, dot_k_r8_256.h, dot_mxfp4_r8_256.h;
# q4_1r8 also 512-bit.
REPACKED = {"q4_0x8": "q4_0", "q4_1r8": "q4_1", "q4_0r8": "q4_0", "q8_0r8": "q8_0",
            "q4_kr8": "q4_k", "q5_kr8": "q5_k", "q6_kr8": "q6_k", "q5_0r8": "q5_0", "mxfp4r8": "mxfp4"}
R8 = ("q4_1r8", "q4_0r8", "q8_0r8", "q4_kr8", "q5_kr8", "q6_kr8", "q5_0r8", "mxfp4r8")   # data [rows / 8, row bytes * 8]
# The r8 layouts whose 256-bit and scalar kernels multiply activations with one scale per 256
# (quantize_activations(x, 256); csrc/quant/activations.h's quantize_super); the rest blocks of 32.
SUPER_ACT = ("q4_kr8", "q5_kr8", "q6_kr8")
R8_GEMM = tuple(q for q in R8 if q != "mxfp4r8")    # the layouts the 256-bit integer GEMM takes (csrc/quant/gemm_r8_256.h)
R8_OF = {"q4_1": "q4_1r8", "q4_0": "q4_0r8", "q8_0": "q8_0r8", "q4_k": "q4_kr8", "q5_k": "q5_kr8", "q6_k": "q6_kr8",
         "q5_0": "q5_0r8", "mxfp4": "mxfp4r8"}
R8_FIELDS = {       # the file type's block as (start, bytes, piece[, at]) fields, in order (at: placed at 8 * at, not 8 * start)
    "q4_0": ((0, 2, 2), (2, 16, 8)),
    "q5_0": ((0, 2, 2), (2, 4, 4), (6, 16, 8)),
    "q4_1": ((0, 2, 2), (2, 2, 2), (4, 16, 8)),
    "q8_0": ((0, 2, 2), (2, 32, 8)),
    "q4_k": ((0, 2, 2), (2, 2, 2), (4, 12, 4), (16, 128, 8)),
    "q5_k": ((0, 2, 2), (2, 2, 2), (4, 12, 4), (16, 32, 8), (48, 128, 8)),
    # q6_k (start, bytes, piece, at: the field at 8 * at): the 16 scales, d, then per (n, b) < (2, 2)
    # qh[32 n + 16 b ..], ql[64 n + 16 b ..], ql[64 n + 32 + 16 b ..]: the unit in the order its dot reads it
    "q6_k": ((0, 16, 4, 34), (16, 16, 4, 82), (32, 16, 4, 50), (48, 16, 4, 98), (64, 16, 4, 130), (80, 16, 4, 178),
             (96, 16, 4, 146), (112, 16, 4, 194), (128, 16, 4, 18), (144, 16, 4, 66), (160, 16, 4, 114), (176, 16, 4, 162),
             (192, 16, 1, 0), (208, 2, 2, 16)),
    "mxfp4": ((0, 1, 1), (1, 16, 8)),
}
BLOCK = {"q4_0": 32, "q4_1": 32, "q5_0": 32, "q5_1": 32, "q8_0": 32, "q4_k": 256, "q5_k": 256, "q6_k": 256,
         "mxfp4": 32, "q4_0x8": 256, "q4_1r8": 32, "q4_0r8": 32, "q8_0r8": 32, "q4_kr8": 256, "q5_kr8": 256,
         "q6_kr8": 256, "q5_0r8": 32, "mxfp4r8": 32}
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q8_0": 34, "q4_k": 144, "q5_k": 176, "q6_k": 210,
               "mxfp4": 17, "q4_0x8": 144, "q4_1r8": 20, "q4_0r8": 18, "q8_0r8": 34, "q4_kr8": 144, "q5_kr8": 176,
               "q6_kr8": 210, "q5_0r8": 22, "mxfp4r8": 17}
QUANTIZE_TYPES = ("q8_0", "q4_0")                       # what quantize() produces
ROW_CHUNK_ELEMENTS = 1 << 22  # elements per chunk where torch dequantizes / quantizes whole matrices


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A [out_features, in_features] matrix in a GGUF block format. data: uint8 [rows,
    cols / BLOCK * BLOCK_BYTES], each row its blocks in the file's layout (rows may be strided:
    a slice of whole blocks of columns is a view); q4_1r8 (repack): [rows / 8, that * 8], groups
    of 8 rows interleaved per block."""
    qtype: str
    shape: tuple[int, int]
    data: torch.Tensor

    def __post_init__(self) -> None:
        rows, cols = self.shape
        if self.qtype not in BLOCK:
            raise ValueError(f"no kernel for quantization type {self.qtype!r}; have {', '.join(QTYPES)}")
        if cols % BLOCK[self.qtype]:
            raise ValueError(f"{self.qtype}: {cols} columns are not a multiple of its block ({BLOCK[self.qtype]})")
        want = (rows // 8, self.row_bytes * 8) if self.qtype in R8 else (rows, self.row_bytes)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want or \
                (rows > 1 and self.data.stride(1) != 1):
            raise ValueError(f"{self.qtype} {self.shape}: data must be uint8 {list(want)} with "
                             f"contiguous rows, got {self.data.dtype} {tuple(self.data.shape)}")

    def __getstate__(self) -> dict:          # picklable (to other processes): without kernels' caches
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    @property
    def row_bytes(self) -> int:
        return self.shape[1] // BLOCK[self.qtype] * BLOCK_BYTES[self.qtype]

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes


def from_gguf_blocks(qtype: str, raw: torch.Tensor, shape: tuple[int, int]) -> QuantizedWeight:
    """The weight a GGUF tensor stores: raw uint8 [rows, row_bytes] (or flat) exactly as the file
    has it, kept as it is (no copy: a view of a memory map stays one)."""
    rows, cols = int(shape[0]), int(shape[1])
    if raw.dtype != torch.uint8:
        raise ValueError(f"raw GGUF blocks must be uint8, got {raw.dtype}")
    if cols % BLOCK.get(qtype, 1):
        raise ValueError(f"{qtype}: {cols} columns are not a multiple of its block ({BLOCK[qtype]})")
    if raw.dim() == 1 and qtype in BLOCK:
        raw = raw.view(rows, cols // BLOCK[qtype] * BLOCK_BYTES[qtype])
    return QuantizedWeight(qtype, (rows, cols), raw)


def slice_rows(w: QuantizedWeight, start: int, stop: int) -> QuantizedWeight:
    """Rows [start, stop) (output features), a view (of an r8 layout: in the file's layout, a copy)."""
    if not 0 <= start <= stop <= w.shape[0]:
        raise ValueError(f"rows [{start}, {stop}) out of range for {w.shape[0]} rows")
    w = _rows_of(w)
    return QuantizedWeight(w.qtype, (stop - start, w.shape[1]), w.data[start:stop])


def slice_cols(w: QuantizedWeight, start: int, stop: int) -> QuantizedWeight:
    """Columns [start, stop) (input features) by whole blocks, a view; ValueError where a bound
    is not on a block boundary."""
    w = _rows_of(w)
    block = BLOCK[w.qtype]
    if not 0 <= start <= stop <= w.shape[1] or start % block or stop % block:
        raise ValueError(f"{w.qtype}: columns [{start}, {stop}) of {w.shape[1]} do not split by whole blocks "
                         f"of {block}")
    b0, b1 = start // block * BLOCK_BYTES[w.qtype], stop // block * BLOCK_BYTES[w.qtype]
    return QuantizedWeight(w.qtype, (w.shape[0], stop - start), w.data[:, b0:b1])


def _q4_0x8_order(rows: torch.Tensor, to_x8: bool) -> torch.Tensor:
    """uint8 [n, units * 144] between q4_0's blocks and q4_0x8's units (a new tensor)."""
    n, units = rows.shape[0], rows.shape[1] // 144
    if to_x8:
        blk = rows.reshape(n, units, 8, 18)
        qs = blk[..., 2:].reshape(n, units, 8, 2, 8).transpose(2, 3).reshape(n, units, 128)
        return torch.cat([blk[..., :2].reshape(n, units, 16), qs], dim=2).view(n, units * 144)
    unit = rows.reshape(n, units, 144)
    qs = unit[..., 16:].reshape(n, units, 2, 8, 8).transpose(2, 3).reshape(n, units, 8, 16)
    return torch.cat([unit[..., :16].reshape(n, units, 8, 2), qs], dim=3).view(n, units * 144)


@functools.lru_cache(maxsize=None)
def _r8_places(qtype: str) -> torch.Tensor:
    """int64 [8 * B]: where byte b of row l's block (file layout, B bytes) lies in a unit of r8
    layout qtype (at index l * B + b): each field's piece k of row l at 8 * start + piece * (8 k + l)."""
    places = []
    for l in range(8):
        for start, size, piece, *at in R8_FIELDS[REPACKED[qtype]]:
            places += [8 * (at or [start])[0] + piece * (8 * (i // piece) + l) + i % piece for i in range(size)]
    return torch.tensor(places, dtype=torch.int64)


def r8_order(qtype: str, data: torch.Tensor, n: int, nb: int, to_r8: bool) -> torch.Tensor:
    """The file type's rows [n, nb * B] (a 2-D row-major array of nb blocks a row, n a multiple of
    8) <-> r8 layout qtype's groups of 8 rows [n / 8, nb * 8 B] (a new tensor). Any r8 layout of R8
    (the blocks of 32 or the super-blocks of 256 alike)."""
    G, B, places = n // 8, BLOCK_BYTES[qtype], _r8_places(qtype)
    if to_r8:
        blocks = data.reshape(G, 8, nb, B).permute(0, 2, 1, 3).reshape(G, nb, 8 * B)
        return torch.empty_like(blocks).index_copy_(2, places, blocks).view(G, nb * 8 * B)
    units = data.reshape(G, nb, 8 * B).index_select(2, places)
    return units.view(G, nb, 8, B).permute(0, 2, 1, 3).reshape(n, nb * B)


def _rows_of(w: QuantizedWeight) -> QuantizedWeight:
    """w where its data holds a row per row (every layout but the r8 ones, which become the file's: a copy)."""
    return file_layout(w) if w.qtype in R8 else w


def file_layout(w: QuantizedWeight) -> QuantizedWeight:
    """w in its file type's layout (repack's inverse; a new tensor where it was repacked)."""
    if w.qtype not in REPACKED:
        return w
    if w.qtype in R8:
        return QuantizedWeight(REPACKED[w.qtype], w.shape,
                               r8_order(w.qtype, w.data, w.shape[0], w.shape[1] // BLOCK[w.qtype], False))
    return QuantizedWeight(REPACKED[w.qtype], w.shape, _q4_0x8_order(w.data, to_x8=False))


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Weights of one type and width stacked by rows (a fused projection such as qkv or
    gate_up): one copy of their bytes. ValueError where types or widths differ (a Q4_K_M file
    may store q, k and v in different types: keep those apart)."""
    weights = [_rows_of(w) for w in weights]
    first = weights[0]
    if any(w.qtype != first.qtype or w.shape[1] != first.shape[1] for w in weights):
        raise ValueError("concat_rows: weights differ in type or width: "
                         + ", ".join(f"{w.qtype} {w.shape}" for w in weights))
    return QuantizedWeight(first.qtype, (sum(w.shape[0] for w in weights), first.shape[1]),
                           torch.cat([w.data for w in weights]))


# ---- torch reference: block decoding, quantization --------------------------------------------
def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte `offset` of each block, as float32 [n, 1]."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 2k]: the k low nibbles, then the k high nibbles."""
    return torch.cat([qs & 15, qs >> 4], dim=1)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 8k] bits, little-endian (bit i of byte j is element 8j + i)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], -1)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_k / q5_k's 12 bytes -> 8 6-bit scales and 8 6-bit mins (float32 [n, 8])."""
    a, b, c = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([a & 63, (c & 15) | ((a >> 2) & 48)], dim=1)
    mn = torch.cat([b & 63, (c >> 4) | ((b >> 2) & 48)], dim=1)
    return sc.float(), mn.float()


def _dequantize_blocks(qtype: str, blocks: torch.Tensor) -> torch.Tensor:
    """uint8 [n, BLOCK_BYTES] -> float32 [n, BLOCK], the same float operations as gguf.quants."""
    n = blocks.shape[0]
    if qtype == "q4_0x8":
        return _dequantize_blocks("q4_0", _q4_0x8_order(blocks, to_x8=False).view(-1, 18)).view(n, 256)
    if qtype == "q8_0":
        return _f16(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()
    if qtype == "mxfp4":
        return mxfp4.dequantize_gguf(blocks)
    if qtype == "q4_0":
        return _f16(blocks, 0) * (_nibbles(blocks[:, 2:]).float() - 8)
    if qtype == "q4_1":
        return _f16(blocks, 0) * _nibbles(blocks[:, 4:]).float() + _f16(blocks, 2)
    if qtype in ("q5_0", "q5_1"):
        offset = 2 if qtype == "q5_0" else 4
        q = (_nibbles(blocks[:, offset + 4:]) | (_bits(blocks[:, offset:offset + 4]) << 4)).float()
        return _f16(blocks, 0) * (q - 16) if qtype == "q5_0" else _f16(blocks, 0) * q + _f16(blocks, 2)
    if qtype in ("q4_k", "q5_k"):
        sc, mn = _k_scales(blocks[:, 4:16])
        d, dm = (_f16(blocks, 0) * sc).unsqueeze(-1), (_f16(blocks, 2) * mn).unsqueeze(-1)
        qs = blocks[:, 16:144] if qtype == "q4_k" else blocks[:, 48:176]
        q = torch.stack([qs.view(n, 4, 32) & 15, qs.view(n, 4, 32) >> 4], dim=2).view(n, 8, 32)
        if qtype == "q5_k":
            q = q | ((blocks[:, 16:48].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1) << 4
        return (d * q.float() - dm).view(n, 256)
    if qtype == "q6_k":
        ql, qh = blocks[:, 0:128].reshape(n, 2, 64), blocks[:, 128:192].reshape(n, 2, 1, 32)
        low = torch.cat([ql & 15, ql >> 4], dim=2).view(n, 2, 4, 32)
        high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 3
        q = ((low | (high << 4)).view(n, 16, 16).float() - 32)
        d = (_f16(blocks, 208) * blocks[:, 192:208].contiguous().view(torch.int8).float()).unsqueeze(-1)
        return (d * q).view(n, 256)
    raise ValueError(f"no kernel for quantization type {qtype!r}")


def _row_chunks(rows: int, cols: int):
    step = max(1, ROW_CHUNK_ELEMENTS // max(cols, 1))
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


def dequantize_torch(w: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """dequantize in plain torch (the reference of the C++ decoder, and its fallback)."""
    w = _rows_of(w)
    rows, cols = w.shape
    out = torch.empty(rows, cols, dtype=dtype)
    for r0, r1 in _row_chunks(rows, cols):
        blocks = w.data[r0:r1].contiguous().view(-1, BLOCK_BYTES[w.qtype])
        out[r0:r1] = _dequantize_blocks(w.qtype, blocks).view(r1 - r0, cols)
    return out


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    a = v.abs()
    floored = a.floor()
    return v.sign() * (floored + (2 * (a - floored)).floor())


def _quantize_blocks(qtype: str, x: torch.Tensor) -> torch.Tensor:
    """float32 [n, 32] -> uint8 [n, BLOCK_BYTES], llama.cpp's reference rounding (as gguf.quants)."""
    if qtype == "q8_0":
        d = x.abs().amax(dim=1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = _round_half_away(x * inv).to(torch.int8).view(torch.uint8)
        return torch.cat([d.half().view(torch.uint8), q], dim=1)
    if qtype == "q4_0":
        signed_max = x.gather(1, x.abs().argmax(dim=1, keepdim=True))
        d = signed_max / -8
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = (x.double() * inv.double() + 8.5).float().trunc().clamp(0, 15).to(torch.uint8)
        return torch.cat([d.half().view(torch.uint8), q[:, :16] | (q[:, 16:] << 4)], dim=1)
    raise ValueError(f"quantize() makes {', '.join(QUANTIZE_TYPES)}, not {qtype!r}")


def quantize_torch(weight: torch.Tensor, qtype: str) -> QuantizedWeight:
    """quantize in plain torch, row chunk by row chunk (the reference of the C++ quantizer, and
    its fallback): the same bytes as gguf.quants.quantize."""
    if qtype not in QUANTIZE_TYPES:
        raise ValueError(f"quantize() makes {', '.join(QUANTIZE_TYPES)}, not {qtype!r}")
    rows, cols = weight.shape
    if cols % BLOCK[qtype]:
        raise ValueError(f"{qtype}: {cols} columns are not a multiple of its block ({BLOCK[qtype]})")
    row_bytes = cols // BLOCK[qtype] * BLOCK_BYTES[qtype]
    data = torch.empty(rows, row_bytes, dtype=torch.uint8)
    for r0, r1 in _row_chunks(rows, cols):
        chunk = weight[r0:r1].float().reshape(-1, BLOCK[qtype])
        data[r0:r1] = _quantize_blocks(qtype, chunk).view(r1 - r0, row_bytes)
    return QuantizedWeight(qtype, (rows, cols), data)


def quantize_activations(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """What the small-batch kernels multiply: x [T, K] as int8 values [T, K] and one float32
    scale per `block` [T, K/block] (d = max|x| / 127, q = x * (1/d) rounded half to even). Blocks
    of 32, or of 256 where the 256-bit and scalar builds run a super-block r8 layout (SUPER_ACT)."""
    t, k = x.shape
    blocks = x.float().reshape(t, k // block, block)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.round(blocks * inv).to(torch.int8)
    return q.view(t, k), d.view(t, k // block)


def activation_block(qtype: str) -> int:
    """The activations' block the 256-bit and scalar kernels multiply layout `qtype` with: 256 for
    the SUPER_ACT layouts, else 32."""
    return 256 if qtype in SUPER_ACT else 32


def q8_activations(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x [T, K] as its 8-bit blocks hold it (quantize_activations), in float64."""
    q, d = quantize_activations(x, block)
    return (q.double().view(x.shape[0], -1, block) * d.double().unsqueeze(-1)).view(x.shape)


def reference_linear(x: torch.Tensor, w: QuantizedWeight, act_block: int | None = None) -> torch.Tensor:
    """The small-batch kernels' arithmetic in float64, no rounding but the inputs': the q8
    activations (blocks of act_block; by default activation_block(w.qtype)) times the dequantized
    weight (float64 [T, rows]). The tests' oracle."""
    return q8_activations(x, act_block or activation_block(w.qtype)) @ dequantize_torch(w).double().T
