"""A GGUF file's tokenizer through transformers' GGUF reader, with a way around its gpt-oss bug.

transformers builds the tokenizer from the file's metadata (tokenizer.ggml.*), and on the way
parses the model's config; for a `gpt-oss` file it reads each `gpt-oss.rope.scaling.*` value as the
field's first part (its key's length, an array), and fails on every file llama.cpp's converter
writes (they carry YaRN's keys). The tokenizer needs none of those keys: where the reader fails, it
reads a copy of the file's metadata without them and without the tensors (a few MB: the vocabulary).
"""
from __future__ import annotations

import tempfile
from pathlib import Path


def load_gguf_tokenizer(path: str):
    from transformers import AutoTokenizer
    p = Path(path)
    try:
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    except TypeError:
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / p.name
            _metadata_copy(path, copy, drop=".rope.scaling.")
            return AutoTokenizer.from_pretrained(tmp, gguf_file=copy.name)


def _metadata_copy(path: str, out: Path, drop: str) -> None:
    """The file's metadata but the keys containing `drop`, no tensors."""
    import gguf
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or drop in field.name:
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(field.name, field.contents(), field.types[0], sub_type=field.types[-1])
        else:
            w.add_key_value(field.name, field.contents(), field.types[0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
