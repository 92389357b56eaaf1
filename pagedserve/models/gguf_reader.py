"""A lean GGUF reader for loading weights: the scalar metadata, the tensor table, and each tensor's
data as a view of the memory-mapped file.

gguf.GGUFReader builds numpy objects for every element of every metadata array: for a tokenizer of
49k tokens and merges that is 160 MB of Python objects (600 MB for a 128k vocabulary), held while the
weights load and counted in the load's peak memory. Here arrays are skipped (only their length is
kept), so parsing costs next to nothing. Every length read from the file is checked against it
first (files come from strangers): a bad one is a GGUFFileError naming the file and the field
(models/gguf_check.py then checks the metadata against the tensors). Same attribute names as
gguf.GGUFReader where the loader reads them (`fields[name].contents()`, `len(fields[name].data)`,
`tensors`, `data`), so either serves `args_from_gguf` and `GGUFSource`.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from math import prod

import numpy as np
from pagedserve.utils import cdiv

_MAGIC = 0x46554747                     # "GGUF", little-endian
# GGUF value types: struct format of the scalars; 8: string, 9: array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SHORT_ARRAY = 64                       # arrays up to this many numbers are kept (none the loader reads is longer)
_HEADER_BYTES = 24                      # magic, version, tensor count, metadata count
_MIN_KV_BYTES = 8 + 4 + 1               # a key's length, its value type, the smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8    # name length, n_dims, one dimension, type, offset
_MAX_DIMS = 4                           # GGML_MAX_DIMS
_MAX_ARRAY_DEPTH = 4                    # arrays of arrays (none the loader reads nests at all)
_MAX_ELEMENTS = 2**48                   # per tensor: far above any model, far below an int64 overflow


class GGUFFileError(ValueError):
    """A GGUF file that cannot be read safely: says which file and which field (a metadata key, a
    tensor, the header) and what is wrong. Raised before anything reads a tensor's bytes."""

    def __init__(self, path: str, field: str, problem: str) -> None:
        super().__init__(f"{path}: {field}: {problem}")
        self.path, self.field = path, field


@dataclass
class Field:
    value: object
    count: int = 1                      # elements of an array
    kind: int = -1                      # GGUF value type (9: array; elem_kind: its elements')
    elem_kind: int = -1

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
    """Every count, length, dimension and offset is checked against the file before it is used
    (GGUFFileError names the field), so a truncated or hostile file cannot make it read past the
    end, allocate what a count claims, or recurse without bound."""

    def __init__(self, path: str) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape
        self.path = str(path)
        size = os.path.getsize(path)
        if size < _HEADER_BYTES:
            raise GGUFFileError(self.path, "header", f"the file is {size} bytes, shorter than a GGUF header")
        self.data = np.memmap(path, mode="r")
        buf = self.data._mmap if getattr(self.data, "_mmap", None) is not None else self.data
        self._buf, self._pos, self._size = buf, 0, size
        if self._unpack("I", "magic") != _MAGIC:
            raise GGUFFileError(self.path, "magic", "not a GGUF file")
        version = self._unpack("I", "version")
        if version not in (2, 3):
            raise GGUFFileError(self.path, "version", f"GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = self._unpack("Q", "tensor_count"), self._unpack("Q", "metadata_kv_count")
        self._fits(n_kv, _MIN_KV_BYTES, "metadata_kv_count")
        self.fields: dict[str, Field] = {}
        for i in range(n_kv):
            key = self._string(f"metadata key #{i}")
            if key in self.fields:
                raise GGUFFileError(self.path, key, "the key appears twice")
            self.fields[key] = self._value(self._unpack("I", key), key, 0)
        self._fits(n_tensors, _MIN_TENSOR_INFO_BYTES, "tensor_count")
        infos = []
        for i in range(n_tensors):
            name = self._string(f"tensor #{i}'s name")
            n_dims = self._unpack("I", name)
            if not 1 <= n_dims <= _MAX_DIMS:
                raise GGUFFileError(self.path, name, f"n_dims {n_dims} (1 to {_MAX_DIMS} allowed)")
            dims = [self._unpack("Q", name) for _ in range(n_dims)]
            type_id = self._unpack("I", name)
            infos.append((name, type_id, dims, self._unpack("Q", name)))
        alignment = self._alignment()
        start = cdiv(self._pos, alignment) * alignment
        floats = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                  "I32": np.int32, "I64": np.int64}
        self.tensors: list[Tensor] = []
        seen: set[str] = set()
        for name, type_id, dims, offset in infos:
            if name in seen:
                raise GGUFFileError(self.path, name, "the tensor appears twice")
            seen.add(name)
            try:
                ggml = GGMLQuantizationType(type_id)
                block, block_bytes = GGML_QUANT_SIZES[ggml]
            except (ValueError, KeyError):
                raise GGUFFileError(self.path, name, f"unknown tensor type {type_id}") from None
            if any(d < 1 or d > _MAX_ELEMENTS for d in dims) or prod(dims) > _MAX_ELEMENTS:
                raise GGUFFileError(self.path, name, f"dimensions {dims} (each at least 1, at most "
                                                     f"{_MAX_ELEMENTS} elements)")
            if dims[0] % block:
                raise GGUFFileError(self.path, name, f"{dims[0]} columns are not whole {ggml.name} blocks of {block}")
            n_bytes = prod(dims) // block * block_bytes
            if offset % alignment:
                raise GGUFFileError(self.path, name, f"data offset {offset} is not a multiple of the alignment "
                                                     f"({alignment})")
            at = start + offset
            if at + n_bytes > size:
                raise GGUFFileError(self.path, name, f"its data ({n_bytes} bytes at offset {at}) runs past the end "
                                                     f"of the file ({size} bytes): truncated or a bad offset")
            np_dims = tuple(reversed(dims))
            if ggml.name in floats:
                data = np.ndarray(np_dims, dtype=floats[ggml.name], buffer=self.data, offset=at)
            else:
                data = np.ndarray(quant_shape_to_byte_shape(np_dims, ggml), dtype=np.uint8, buffer=self.data,
                                  offset=at)
            self.tensors.append(Tensor(name, ggml, np.array(dims, dtype=np.uint64), n_bytes, at, data))
        del self._buf

    def _alignment(self) -> int:
        f = self.fields.get("general.alignment")
        if f is None:
            return 32
        if f.kind != 4 or f.value < 1 or f.value & (f.value - 1):
            raise GGUFFileError(self.path, "general.alignment", f"{f.value!r} is not a power of two (uint32)")
        return f.value

    def _fits(self, count: int, min_bytes: int, field: str) -> None:
        """A count of items each at least min_bytes long must fit in what is left of the file."""
        if count * min_bytes > self._size - self._pos:
            raise GGUFFileError(self.path, field, f"{count} items cannot fit in the {self._size - self._pos} bytes "
                                                  f"left of the file")

    def _need(self, n: int, field: str) -> None:
        if n > self._size - self._pos:
            raise GGUFFileError(self.path, field, f"needs {n} bytes at offset {self._pos}, past the end of the "
                                                  f"file ({self._size} bytes)")

    def _unpack(self, fmt: str, field: str):
        size = struct.calcsize(fmt)
        self._need(size, field)
        value = struct.unpack_from("<" + fmt, self._buf, self._pos)[0]
        self._pos += size
        return value

    def _string(self, field: str) -> str:
        n = self._unpack("Q", field)
        self._need(n, field)
        text = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return text

    def _value(self, kind: int, field: str, depth: int) -> Field:
        if kind in _SCALARS:
            return Field(self._unpack(_SCALARS[kind], field), kind=kind)
        if kind == 8:
            return Field(self._string(field), kind=kind)
        if kind != 9:
            raise GGUFFileError(self.path, field, f"unknown GGUF value type {kind}")
        if depth >= _MAX_ARRAY_DEPTH:
            raise GGUFFileError(self.path, field, f"arrays nested more than {_MAX_ARRAY_DEPTH} deep")
        elem, count = self._unpack("I", field), self._unpack("Q", field)
        if elem in _SCALARS:
            size = struct.calcsize(_SCALARS[elem])
            self._need(size * count, field)
            values = list(struct.unpack_from(f"<{count}{_SCALARS[elem]}", self._buf, self._pos)) \
                if count <= _SHORT_ARRAY else None
            self._pos += size * count
            return Field(values, count, kind, elem)
        self._fits(count, 8 if elem == 8 else 12, field)      # a string's length, an array's header
        if elem == 8:
            self._skip_strings(count, field)
        else:
            for _ in range(count):
                self._value(elem, field, depth + 1)
        return Field(None, count, kind, elem)

    def _skip_strings(self, count: int, field: str) -> None:
        """Past `count` strings: a tokenizer's vocabulary and merges (~10^5 strings), so one tight
        loop rather than a method call per string."""
        length, buf, pos, size = struct.Struct("<Q").unpack_from, self._buf, self._pos, self._size
        for _ in range(count):
            end = pos + 8 + length(buf, pos)[0] if pos + 8 <= size else size + 1
            if end > size:
                raise GGUFFileError(self.path, field, f"a string at offset {pos} runs past the end of the file "
                                                      f"({size} bytes)")
            pos = end
        self._pos = pos
