"""What the KV cache stores per (token, KV head): the model's dtype (`auto`) or 8-bit codes.

The 8-bit formats keep the cache tensor's shape but for its last dimension, which becomes the
row's bytes: D codes, then, for the scaled formats, the row's scale as bf16 (D + 2 bytes). A
block then carries its own scales, so copy-on-write, swap, tensor parallelism and every
other whole-block move need nothing more.

- `fp8_e5m2`: the top byte of an fp16 (2 mantissa bits, range +-57344), no scale. Converts by a
  shift and F16C (AVX2) / AVX-512's fp16 conversion: the cheapest code to read, exactly 2x.
- `fp8_e4m3` (what `fp8` means, on every ISA, as in vLLM): e4m3fn (3 mantissa bits, half e5m2's
  error) times a bf16 scale per (token, head) row, largest |x| / 448. Converts by a sign
  extension, shift and mask into fp16 bits and the same F16C conversion (as fp16 the bits read
  value / 256, subnormals included; the 256 goes into the scale). The integer steps run on 32
  codes per AVX-512 register (16 on AVX2) before the two conversions: 4 operations per 16 values
  on AVX-512 against int8's 2 (27% less time than 16 at a time, in an interleaved microbenchmark).
  Two other ways lost there: a 128-entry byte lookup into bf16 (vpermi2b) was no faster, all
  shuffles on one port; building float32 bits directly (sign | bits << 20, times 2^120) makes
  e4m3's subnormal codes float32 denormals, and an FMA on those takes a microcode assist (over
  50x slower per vector).
- `int8`: symmetric int8 (+-127) times a bf16 scale per row, largest |x| / 127; converts by a
  sign extension and an int-to-float conversion: the cheapest conversion and (a uniform step of
  amax / 127 against e4m3's 3 mantissa bits) the smallest error of the three, so the best
  choice on CPUs; `fp8` stays an FP8 format, as users of vLLM's name expect.

What `fp8` means on each ISA: e4m3 on every kernel variant (avx512bf16, avx512, avx2, scalar),
never a per-ISA choice. No x86 CPU has FP8 arithmetic, so no variant has a native FP8 format to
prefer; each converts the same bytes to float32 (AVX-512: 32-lane integer steps and vcvtph2ps;
AVX2: F16C; scalar: the exact bit conversion in C), so a block means the same values wherever it
runs: swapped, prefix-cached, on another tensor-parallel rank, and the torch reference below.
e4m3 rather than e5m2 because that is vLLM's meaning of `fp8` and it halves e5m2's error; int8
remains the cheapest to convert and the most accurate on a CPU, so the one to choose there.

Why a scale per (token, head) row rather than per block: a block fills over many steps, and a
per-block scale would have to be fixed in advance or requantize the block's earlier tokens;
a row's scale is computed once from its own values, when it is written, and is exact to reason
about (the reference below quantizes alike). The kernels apply it to whole scores and softmax
weights, never per element. Its 2 bytes per 64-dim row keep 1.94x the rows of bf16.

`quantize` / `dequantize` are the torch reference of the write and read kernels (bit-exact
with them); the torch attention backend stores through them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.config import KV_CACHE_DTYPE_ALIASES as ALIASES


@dataclass(frozen=True)
class KVFormat:
    name: str                 # auto | fp8_e4m3 | fp8_e5m2 | int8
    code: int                 # the kernels' number of the format (0: the model's dtype)
    qmax: float = 0.0         # the largest code's value (scaled formats: |x| / scale <= qmax)
    scaled: bool = False      # a bf16 scale per (token, head) row after the codes

    @property
    def quantized(self) -> bool:
        return self.code != 0

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.uint8 if self.quantized else model_dtype

    def row_elements(self, head_dim: int) -> int:
        """The last dimension of the cache tensor: one (token, head) row."""
        return head_dim + (2 if self.scaled else 0)

    def row_bytes(self, head_dim: int, model_dtype: torch.dtype) -> int:
        return self.row_elements(head_dim) * self.storage_dtype(model_dtype).itemsize

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int, model_dtype: torch.dtype) -> int:
        """K and V of one token in every layer."""
        return num_layers * 2 * num_kv_heads * self.row_bytes(head_dim, model_dtype)

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] (any float dtype) -> uint8 rows [..., D (+ 2)], as the write kernel does."""
        x = x.float()
        if self.name == "fp8_e5m2":
            return x.clamp(-57344.0, 57344.0).to(torch.float8_e5m2).view(torch.uint8)
        amax = x.abs().amax(dim=-1, keepdim=True)
        scale = (amax / self.qmax).to(torch.bfloat16)
        divisor = torch.where(scale == 0, torch.ones_like(scale, dtype=torch.float32), scale.float())
        y = (x / divisor).clamp(-self.qmax, self.qmax)
        codes = y.to(torch.float8_e4m3fn).view(torch.uint8) if self.name == "fp8_e4m3" else \
            y.round().to(torch.int8).view(torch.uint8)
        return torch.cat([codes, scale.view(torch.uint8).reshape(*x.shape[:-1], 2)], dim=-1)

    def dequantize(self, rows: torch.Tensor, head_dim: int) -> torch.Tensor:
        """uint8 rows [..., D (+ 2)] (any strides) -> float32 [..., D]: the values the kernels read."""
        codes = rows[..., :head_dim].contiguous()
        if self.name == "fp8_e5m2":
            return codes.view(torch.float8_e5m2).float()
        values = codes.view(torch.float8_e4m3fn).float() if self.name == "fp8_e4m3" else \
            codes.view(torch.int8).float()
        scale = rows[..., head_dim:head_dim + 2].contiguous().view(torch.bfloat16).float()
        return values * scale


FORMATS = {f.name: f for f in (KVFormat("auto", 0), KVFormat("fp8_e5m2", 1),
                               KVFormat("fp8_e4m3", 2, qmax=448.0, scaled=True),
                               KVFormat("int8", 3, qmax=127.0, scaled=True))}


def kv_format(name: str | None) -> KVFormat:
    """The format of a `kv_cache_dtype` setting (`fp8` is `fp8_e4m3`)."""
    name = ALIASES.get(name or "auto", name or "auto")
    if name not in FORMATS:
        raise ValueError(f"kv_cache_dtype must be one of auto, fp8, {', '.join(n for n in FORMATS if n != 'auto')}; "
                         f"got {name!r}")
    return FORMATS[name]
