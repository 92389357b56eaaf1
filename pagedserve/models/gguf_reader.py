"""A lean GGUF reader for loading weights: the scalar metadata, the tensor table, and each tensor's
data as a view of the memory-mapped file.

gguf.GGUFReader builds numpy objects for every element of every metadata array: for a tokenizer of
49k tokens and merges that is 160 MB of Python objects (600 MB for a 128k vocabulary), held while the
weights load and counted in the load's peak memory. Here arrays are skipped (only their length is
kept), so parsing costs next to nothing. Same attribute names as gguf.GGUFReader where the loader
reads them (`fields[name].contents()`, `len(fields[name].data)`, `tensors`, `data`), so either
serves `args_from_gguf` and `GGUFSource`.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from pagedserve.utils import cdiv

_MAGIC = 0x46554747                     # "GGUF", little-endian
# GGUF value types: struct format of the scalars; 8: string, 9: array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SHORT_ARRAY = 64                       # arrays up to this many numbers are kept (none the loader reads is longer)


@dataclass
class Field:
    value: object
    count: int = 1                      # elements of an array

    def contents(self):
        return self.value

    @property
    def data(self) -> range:            # as GGUFReader's field.data: one index per array element
        return range(self.count)


@dataclass
class Tensor:
    name: str
    tensor_type: object                 # gguf.GGMLQuantizationType
    shape: np.ndarray                   # dimensions, innermost first (as GGUF lists them)
    n_bytes: int
    data_offset: int                    # from the start of the file
    data: np.ndarray                    # a view of the mapping: typed for floats, uint8 [rows, bytes per row] else


class GGUFFile:
    def __init__(self, path: str) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape
        self.data = np.memmap(path, mode="r")
        buf = self.data._mmap if getattr(self.data, "_mmap", None) is not None else self.data
        self._buf, self._pos = buf, 0
        if self._unpack("I") != _MAGIC:
            raise ValueError(f"{path}: not a GGUF file")
        version = self._unpack("I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 and later are)")
        n_tensors, n_kv = self._unpack("Q"), self._unpack("Q")
        self.fields: dict[str, Field] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._unpack("I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._unpack("Q") for _ in range(self._unpack("I"))]
            infos.append((name, GGMLQuantizationType(self._unpack("I")), dims, self._unpack("Q")))
        alignment = int(self.fields["general.alignment"].value) if "general.alignment" in self.fields else 32
        start = cdiv(self._pos, alignment) * alignment
        floats = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                  "I32": np.int32, "I64": np.int64}
        self.tensors: list[Tensor] = []
        for name, ggml, dims, offset in infos:
            block, block_bytes = GGML_QUANT_SIZES[ggml]
            n_bytes = int(np.prod(dims)) * block_bytes // block
            np_dims = tuple(reversed(dims))
            at = start + offset
            if ggml.name in floats:
                data = np.ndarray(np_dims, dtype=floats[ggml.name], buffer=self.data, offset=at)
            else:
                data = np.ndarray(quant_shape_to_byte_shape(np_dims, ggml), dtype=np.uint8, buffer=self.data,
                                  offset=at)
            self.tensors.append(Tensor(name, ggml, np.array(dims, dtype=np.uint64), n_bytes, at, data))
        del self._buf

    def _unpack(self, fmt: str):
        value = struct.unpack_from("<" + fmt, self._buf, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("Q")
        text = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return text

    def _skip_string(self) -> None:
        self._pos += 8 + struct.unpack_from("<Q", self._buf, self._pos)[0]

    def _value(self, kind: int) -> Field:
        if kind in _SCALARS:
            return Field(self._unpack(_SCALARS[kind]))
        if kind == 8:
            return Field(self._string())
        if kind != 9:
            raise ValueError(f"unknown GGUF value type {kind}")
        elem, count = self._unpack("I"), self._unpack("Q")
        if elem in _SCALARS:
            size = struct.calcsize(_SCALARS[elem])
            values = list(struct.unpack_from(f"<{count}{_SCALARS[elem]}", self._buf, self._pos)) \
                if count <= _SHORT_ARRAY else None
            self._pos += size * count
            return Field(values, count)
        for _ in range(count):
            if elem == 8:
                self._skip_string()
            else:
                self._value(elem)
        return Field(None, count)
