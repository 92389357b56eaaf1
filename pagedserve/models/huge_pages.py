"""Weights in transparent huge pages (2 MiB) instead of 4 KiB ones.

A decode step streams every weight byte once, and with 4 KiB pages a 1 GB model is 250k pages
a token: a TLB miss and a page walk each, and the hardware prefetchers stop at every 4 KiB
boundary. In 2 MiB pages the 1.7B shape's Q4_0 file decoded 1.2x faster here
(`PAGEDSERVE_HUGE_PAGES=0` / `1` on `benchmarks/quantized.py --full`). A GGUF file's mapping is
in 4 KiB page-cache pages (file-backed huge pages need filesystem support that is rarely there),
so the loader copies each quantized matrix into anonymous memory advised MADV_HUGEPAGE (one
after another: _Arena) and drops the file's pages: resident memory stays the file's size, one
matrix more at most while loading.

The KV cache too (`zeros`, the model runner's): a decode step reads each sequence's blocks
scattered over it, a head's keys of a block 2 KB in a row, and in 4 KiB pages each such run was a
page of its own (decode attention over one 30-layer cache, cold: 1.09-1.16x as fast in huge pages,
benchmarks/RESULTS.md).

Where the kernel has no THP (or `PAGEDSERVE_HUGE_PAGES=0`), tensors stay as they are.
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
CHUNK = 256 << 20               # each mapping of the arena (only its touched pages are resident)
ALIGN = 64                      # each tensor's start: a cache line
MIN_BYTES = 256 << 10           # smaller tensors (norms, biases) stay where they are
KV_MIN_BYTES = 64 << 20         # a smaller KV cache stays in 4 KiB pages (its last huge page, part used, is >3% of it)
ENV = "PAGEDSERVE_HUGE_PAGES"
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether anonymous memory advised MADV_HUGEPAGE gets huge pages here (THP 'always' or
    'madvise'), and they are not turned off."""
    if os.environ.get(ENV, "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in _THP_SETTING.read_text()
    except OSError:
        return False


def _mapping(size: int) -> torch.Tensor:
    """`size` bytes (uint8) of a new anonymous mapping advised MADV_HUGEPAGE, from a 2 MiB boundary
    (the tensor keeps the mapping alive: torch.frombuffer holds it)."""
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    flat = torch.frombuffer(region, dtype=torch.uint8)
    skip = -flat.data_ptr() % HUGE_PAGE
    return flat[skip:skip + size]


class _Arena:
    """Weights placed one after another in 2 MiB-aligned anonymous mappings advised
    MADV_HUGEPAGE (a bump allocator for one model's weights: new_model starts the next model in
    new mappings). Small matrices share huge pages, so at most the last, partly touched huge page
    of each mapping is wasted. A tensor keeps its mapping alive (torch.frombuffer holds it)."""

    def __init__(self) -> None:
        self._flat: torch.Tensor | None = None     # the current mapping, as bytes from its aligned start
        self._at = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if self._flat is None or self._at + nbytes > self._flat.numel():
            self._flat, self._at = _mapping(max(CHUNK, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)), 0
        out = self._flat[self._at:self._at + nbytes]
        self._at += -(-nbytes // ALIGN) * ALIGN
        return out.view(dtype).view(shape)


_ARENA = _Arena()


def new_model() -> None:
    """Called once a model's weights are placed: the next weights start a new mapping, so a
    model's weights never share one with another model's and hold their mappings alone (unloading
    a model returns all its pages: a multi-model server loads and unloads several in one process,
    server/models_manager.py)."""
    _ARENA._flat, _ARENA._at = None, 0


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in huge pages (see _Arena)."""
    return _ARENA.empty(shape, dtype)


def stack_rows(parts: list[torch.Tensor], pad_rows: int = 0) -> torch.Tensor | None:
    """2-D `parts` (rows of one width and dtype, on the CPU) stacked by rows, `pad_rows` zero rows
    after them, in huge pages; None where huge pages are not available or for a small result (a
    norm's weight: not worth a copy)."""
    rows = sum(p.shape[0] for p in parts) + pad_rows
    width, dtype = parts[0].shape[1], parts[0].dtype
    if rows * width * dtype.itemsize < MIN_BYTES or parts[0].device.type != "cpu" or not available():
        return None
    out = empty((rows, width), dtype)
    at = 0
    for p in parts:
        out[at:at + p.shape[0]].copy_(p)
        at += p.shape[0]
    out[at:].zero_()
    return out


def copy_to_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `t` in huge pages; `t` itself where huge pages are not available or
    it is small."""
    if t.device.type != "cpu" or t.numel() * t.element_size() < MIN_BYTES or not available():
        return t
    out = empty(tuple(t.shape), t.dtype)
    out.copy_(t)
    return out


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """A zeroed KV cache in huge pages, in a mapping of its own (not the weights' arena), every
    page touched now as torch.zeros touches them; None where huge pages are not available or below
    KV_MIN_BYTES."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if nbytes < KV_MIN_BYTES or not available():
        return None
    return _mapping(nbytes).view(dtype).view(shape).zero_()
