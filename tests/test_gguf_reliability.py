"""GGUF files from strangers, round two (issue 51): what test_gguf_hostile.py's cases left open.
A block_count above the layers the file holds, tensors the model needs that the file lacks, and
tensors of names no such model has ended in a traceback (KeyError, ValueError: exit 1); a
rope.dimension_count above the head dimension was taken as is (RoPE turns that many values of
each head in place: the compiled loop would write past the head). Each is now a GGUFFileError
naming the file and the field, and `pagedserve generate` exits 2 with one line, no traceback."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pagedserve.models.gguf_check import check_gguf
from pagedserve.models.gguf_reader import GGUFFileError
from tests.gguf_utils import finish
from tests.test_gguf_hostile import llama_header, llama_tensors


def write_gguf(path: Path, tokenizer, meta: dict | None = None, drop: tuple[str, ...] = (),
               extra: dict[str, tuple[int, ...]] | None = None) -> Path:
    """test_gguf_hostile's tiny llama with header overrides, tensors dropped and extra ones."""
    import gguf
    vocab = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = sorted(vocab["vocab"], key=vocab["vocab"].get)
    w = gguf.GGUFWriter(str(path), "llama")
    for key, (kind, value) in {**llama_header(len(tokens)), **(meta or {})}.items():
        w.add_key_value(key, value, getattr(gguf.GGUFValueType, kind))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in vocab["merges"]])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    rng = np.random.default_rng(0)
    for name, shape in {**llama_tensors(len(tokens)), **(extra or {})}.items():
        if name not in drop:
            w.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))
    finish(w)
    return path


# name -> (header overrides, tensors dropped, extra tensors, the field the error names)
CASES = {
    "block_count_2_of_1": ({"llama.block_count": ("UINT32", 2)}, (), {}, "blk.1."),
    "block_count_10_6": ({"llama.block_count": ("UINT32", 10**6)}, (), {}, "blk.1."),
    "rope_dimension_count_4096": ({"llama.rope.dimension_count": ("UINT32", 4096)}, (), {}, "rope.dimension_count"),
    "rope_dimension_count_odd": ({"llama.rope.dimension_count": ("UINT32", 7)}, (), {}, "rope.dimension_count"),
}
# Files check_gguf lets through (every tensor it knows has its shape) that the loader refuses.
LOADER_CASES = {
    "no_ffn_gate": ((), ("blk.0.ffn_gate.weight",), {}, "blk.0.ffn_gate.weight"),
    "no_output_norm": ((), ("output_norm.weight",), {}, "output_norm.weight"),
    "unknown_layer_tensor": ((), (), {"blk.0.mystery.weight": (4, 4)}, "blk.0.mystery.weight"),
    "unknown_top_tensor": ((), (), {"mystery.weight": (4, 4)}, "mystery.weight"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_metadata_the_layers_cannot_hold_is_named(case, tiny_tokenizer, tmp_path):
    meta, drop, extra, field = CASES[case]
    path = write_gguf(tmp_path / f"{case}.gguf", tiny_tokenizer, meta, drop, extra)
    with pytest.raises(GGUFFileError, match=rf"{case}\.gguf: .*{field}"):
        check_gguf(str(path))


@pytest.mark.parametrize("case", sorted(LOADER_CASES))
def test_a_missing_or_unknown_tensor_is_named(case, tiny_tokenizer, tmp_path, monkeypatch):
    """(`pagedserve generate` prints a GGUFFileError as one line and exits 2: test_gguf_hostile.)"""
    from pagedserve import LLM
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    drop, extra, field = LOADER_CASES[case][1:]
    path = write_gguf(tmp_path / f"{case}.gguf", tiny_tokenizer, None, drop, extra)
    with pytest.raises(GGUFFileError, match=rf"{case}\.gguf: {field}: "):
        LLM(str(path), dtype="float32", num_gpu_blocks_override=16)
