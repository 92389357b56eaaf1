"""GGUF files from strangers (issue 51): a file whose metadata contradicts its tensors, or whose
counts, lengths, dimensions or offsets do not fit in it, is refused before anything reads a
tensor, with a GGUFFileError (a ValueError) that names the file and the field, on every path a
GGUF file takes (our reader, gguf's reader behind the float cache, transformers' tokenizer
reader); `pagedserve generate` on one exits non-zero with that one line, never by a signal."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pagedserve.models.gguf_check import check_gguf
from pagedserve.models.gguf_reader import GGUFFileError
from tests.gguf_utils import finish

HIDDEN, HEADS, KV_HEADS, INTER, LAYERS = 64, 4, 2, 128, 1
HEAD_DIM = HIDDEN // HEADS

# ---- files written with the gguf package: valid structure, metadata to contradict -------------------


def llama_header(vocab: int) -> dict:
    """The metadata of a tiny llama GGUF: key -> (GGUF value type name, value)."""
    return {"llama.block_count": ("UINT32", LAYERS), "llama.context_length": ("UINT32", 256),
            "llama.embedding_length": ("UINT32", HIDDEN), "llama.feed_forward_length": ("UINT32", INTER),
            "llama.attention.head_count": ("UINT32", HEADS), "llama.attention.head_count_kv": ("UINT32", KV_HEADS),
            "llama.attention.layer_norm_rms_epsilon": ("FLOAT32", 1e-5), "llama.rope.freq_base": ("FLOAT32", 1e4),
            "llama.vocab_size": ("UINT32", vocab)}


def llama_tensors(vocab: int) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape (rows first) of the tiny llama."""
    shapes = {"token_embd.weight": (vocab, HIDDEN), "output_norm.weight": (HIDDEN,), "output.weight": (vocab, HIDDEN)}
    for i in range(LAYERS):
        shapes.update({f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                       f"blk.{i}.attn_q.weight": (HEADS * HEAD_DIM, HIDDEN),
                       f"blk.{i}.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                       f"blk.{i}.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                       f"blk.{i}.attn_output.weight": (HIDDEN, HEADS * HEAD_DIM),
                       f"blk.{i}.ffn_gate.weight": (INTER, HIDDEN), f"blk.{i}.ffn_up.weight": (INTER, HIDDEN),
                       f"blk.{i}.ffn_down.weight": (HIDDEN, INTER)})
    return shapes


def write_llama_gguf(path: Path, tokenizer, meta: dict | None = None, shapes: dict | None = None,
                     tokens: list[str] | None = None) -> Path:
    """A tiny llama GGUF with `tokenizer`'s vocabulary (gpt2 BPE), random weights; `meta`
    overrides header keys (key -> (type, value); None drops it), `shapes` tensor shapes."""
    import gguf
    vocab = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    all_tokens = sorted(vocab["vocab"], key=vocab["vocab"].get)
    header = {**llama_header(len(all_tokens)), **(meta or {})}
    w = gguf.GGUFWriter(str(path), "llama")
    for key, spec in header.items():
        if spec is not None:
            w.add_key_value(key, spec[1], getattr(gguf.GGUFValueType, spec[0]))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(all_tokens if tokens is None else tokens)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in vocab["merges"]])
    if "tokenizer.ggml.bos_token_id" not in (meta or {}):
        w.add_bos_token_id(tokenizer.bos_token_id)
    if "tokenizer.ggml.eos_token_id" not in (meta or {}):
        w.add_eos_token_id(tokenizer.eos_token_id)
    rng = np.random.default_rng(0)
    for name, shape in {**llama_tensors(len(all_tokens)), **(shapes or {})}.items():
        w.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))
    finish(w)
    return path


# name -> (metadata overrides, tensor shape overrides, the field the error must name)
CONTRADICTIONS = {
    "embedding_length": ({"llama.embedding_length": ("UINT32", 65536)}, {}, "embedding_length"),
    "attn_output_rows": ({}, {"blk.0.attn_output.weight": (4096, HIDDEN)}, "blk.0.attn_output.weight"),
    "head_count_kv_3_of_2": ({"llama.attention.head_count": ("UINT32", 2),
                              "llama.attention.head_count_kv": ("UINT32", 3)}, {}, "head_count_kv"),
    "feed_forward_length": ({"llama.feed_forward_length": ("UINT32", 131072)}, {}, "feed_forward_length"),
}
SEMANTIC = {
    "head_count_0": ({"llama.attention.head_count": ("UINT32", 0)}, "attention.head_count"),
    "head_count_negative": ({"llama.attention.head_count": ("INT32", -4)}, "attention.head_count"),
    "head_count_kv_0": ({"llama.attention.head_count_kv": ("UINT32", 0)}, "head_count_kv"),
    "bos_out_of_range": ({"tokenizer.ggml.bos_token_id": ("UINT32", 400)}, "bos_token_id"),
    "eos_out_of_range": ({"tokenizer.ggml.eos_token_id": ("UINT32", 1 << 31)}, "eos_token_id"),
    "vocab_larger_than_embedding": ({"llama.vocab_size": ("UINT32", 500)}, "token_embd.weight"),
    "vocab_size_0": ({"llama.vocab_size": ("UINT32", 0)}, "vocab_size"),
    "head_count_a_string": ({"llama.attention.head_count": ("STRING", "four")}, "attention.head_count"),
    "block_count_missing": ({"llama.block_count": None}, "block_count"),
}


@pytest.mark.parametrize("case", sorted(SEMANTIC))
def test_metadata_out_of_range_is_named(case, tiny_tokenizer, tmp_path):
    meta, field = SEMANTIC[case]
    path = write_llama_gguf(tmp_path / f"{case}.gguf", tiny_tokenizer, meta=meta)
    with pytest.raises(GGUFFileError, match=rf"{case}\.gguf: .*{field}"):
        check_gguf(str(path))


def test_an_empty_vocabulary_and_more_tokens_than_the_embedding_are_named(tiny_tokenizer, tmp_path):
    path = tmp_path / "empty.gguf"        # (the gguf package writes no empty array)
    path.write_bytes(raw_gguf(kvs=base_kvs(vocab_size=False) + [
        kv("tokenizer.ggml.tokens", 9, u32(8) + struct.pack("<Q", 0))]))
    with pytest.raises(GGUFFileError, match=r"empty\.gguf: tokenizer\.ggml\.tokens: .*non-empty"):
        check_gguf(str(path))
    path = write_llama_gguf(tmp_path / "more.gguf", tiny_tokenizer, tokens=[f"t{i}" for i in range(500)])
    with pytest.raises(GGUFFileError, match=r"more\.gguf: tokenizer\.ggml\.tokens: 500 tokens"):
        check_gguf(str(path))


@pytest.mark.parametrize("case", sorted(CONTRADICTIONS))
def test_metadata_contradicting_the_tensors_is_named(case, tiny_tokenizer, tmp_path):
    meta, shapes, field = CONTRADICTIONS[case]
    path = write_llama_gguf(tmp_path / f"{case}.gguf", tiny_tokenizer, meta=meta, shapes=shapes)
    with pytest.raises(GGUFFileError, match=rf"{case}\.gguf: .*{field}"):
        check_gguf(str(path))


def test_every_path_a_gguf_file_takes_checks_it_first(tiny_tokenizer, tmp_path, monkeypatch):
    """Our reader's load, the float cache's conversion (gguf's reader) and the tokenizer
    (transformers' reader) all refuse the file before reading it; a valid file passes."""
    from pagedserve.models.loader import _gguf_source, _load_gguf, load_tokenizer
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    good = write_llama_gguf(tmp_path / "good.gguf", tiny_tokenizer)
    assert check_gguf(str(good))[1].hidden_size == HIDDEN
    bad = write_llama_gguf(tmp_path / "bad.gguf", tiny_tokenizer, meta={"llama.embedding_length": ("UINT32", 128)})
    for load in (_gguf_source, _load_gguf, load_tokenizer):
        with pytest.raises(GGUFFileError, match="bad.gguf: token_embd.weight: .*embedding_length"):
            load(str(bad))
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())


# One interpreter imports pagedserve once, then forks a child per file that runs `pagedserve
# generate` on it (cli.main) and exits with its status; the parent reports each child's wait
# status: an exit code, or the signal that ended it.
_FORK_EACH = """
import os, sys
from pagedserve import LLM, cli  # (imported once, before the forks)
import transformers
for path in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = cli.main(["generate", "--model", path, "--prompt", "The quick brown fox", "--max-tokens", "4"])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            import traceback; traceback.print_exc()
        finally:
            sys.stderr.flush(); sys.stdout.flush(); os._exit(code or 0)
    _, status = os.waitpid(pid, 0)
    print("STATUS", path, os.waitstatus_to_exitcode(status), flush=True)
"""


def run_generate(paths: list[Path], tmp_path: Path) -> tuple[dict[str, int], str]:
    """`pagedserve generate` on each file: (path -> its exit code, negative for a signal; stderr)."""
    env = {**os.environ, "PAGEDSERVE_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(Path(__file__).parents[1])}
    res = subprocess.run([sys.executable, "-c", _FORK_EACH, *map(str, paths)], capture_output=True, text=True,
                         env=env, timeout=600)
    statuses = [line.split() for line in res.stdout.splitlines() if line.startswith("STATUS ")]
    assert len(statuses) == len(paths), (res.returncode, res.stdout[-2000:], res.stderr[-3000:])
    return {path: int(code) for _, path, code in statuses}, res.stderr


def test_pagedserve_generate_refuses_contradicting_files_without_a_signal(tiny_tokenizer, tmp_path):
    """The issue's crashes (SIGSEGV, glibc's aborts, NUL text from far past a weight): each now
    one line naming the field and the file, exit status 2."""
    paths = [write_llama_gguf(tmp_path / f"{case}.gguf", tiny_tokenizer, meta=meta, shapes=shapes)
             for case, (meta, shapes, _) in sorted(CONTRADICTIONS.items())]
    paths.append(tmp_path / "nested.gguf")
    paths[-1].write_bytes(nested_arrays(20_000))
    fields = [field for _, (_, _, field) in sorted(CONTRADICTIONS.items())] + ["general.nested"]
    codes, stderr = run_generate(paths, tmp_path)
    assert "Traceback" not in stderr, stderr[-3000:]
    for path, field in zip(paths, fields):
        assert codes[str(path)] > 0, (path.name, codes[str(path)], stderr[-3000:])
        assert any(path.name in line and field in line for line in stderr.splitlines()
                   if line.startswith("pagedserve: error: ")), (path.name, field, stderr[-3000:])


# ---- files written byte by byte: a structure that does not fit -------------------------------------

MAGIC, VERSION = 0x46554747, 3


def s(text: str | bytes, length: int | None = None) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw) if length is None else length) + raw


def kv(key: str, kind: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", kind) + payload


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def info(name: str, dims: list[int], ggml: int = 0, offset: int = 0, n_dims: int | None = None) -> bytes:
    return s(name) + u32(len(dims) if n_dims is None else n_dims) + b"".join(struct.pack("<Q", d) for d in dims) \
        + u32(ggml) + struct.pack("<Q", offset)


def base_kvs(vocab_size: bool = True) -> list[bytes]:
    sizes = [("llama.block_count", 1), ("llama.embedding_length", HIDDEN), ("llama.attention.head_count", HEADS)]
    return [kv("general.architecture", 8, s("llama"))] + [
        kv(k, 4, u32(v)) for k, v in sizes + ([("llama.vocab_size", 400)] if vocab_size else [])]


def raw_gguf(kvs: list[bytes] | None = None, infos: list[bytes] | None = None, data: bytes | None = None,
             n_kv: int | None = None, n_tensors: int | None = None) -> bytes:
    """A GGUF file's bytes: by default a tiny llama header and one float32 norm of HIDDEN values."""
    kvs = base_kvs() if kvs is None else kvs
    infos = [info("output_norm.weight", [HIDDEN])] if infos is None else infos
    data = np.ones(HIDDEN, np.float32).tobytes() if data is None else data
    head = struct.pack("<IIQQ", MAGIC, VERSION, len(infos) if n_tensors is None else n_tensors,
                       len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(infos)
    return head + b"\0" * (-len(head) % 32) + data


def nested_arrays(depth: int) -> bytes:
    """A key whose value is an array of an array of ... `depth` deep (the innermost empty)."""
    value = u32(4) + struct.pack("<Q", 0)
    for _ in range(depth - 1):
        value = u32(9) + struct.pack("<Q", 1) + value
    return raw_gguf(kvs=[kv("general.architecture", 8, s("llama")), kv("general.nested", 9, value)])


BIG = 2**63
STRUCTURAL = {
    "truncated_data": (lambda: raw_gguf()[:-100], "output_norm.weight", "past the end"),
    "offset_past_the_end": (lambda: raw_gguf(infos=[info("output_norm.weight", [HIDDEN], offset=2**40)]),
                            "output_norm.weight", "past the end"),
    "n_dims_0": (lambda: raw_gguf(infos=[info("output_norm.weight", [], n_dims=0)]), "output_norm.weight",
                 "n_dims 0"),
    "n_dims_5": (lambda: raw_gguf(infos=[info("output_norm.weight", [HIDDEN, 1, 1, 1, 1])]),
                 "output_norm.weight", "n_dims 5"),
    "tensor_count_2_63": (lambda: raw_gguf(n_tensors=BIG), "tensor_count", "cannot fit"),
    "kv_count_2_63": (lambda: raw_gguf(n_kv=BIG), "metadata_kv_count", "cannot fit"),
    "array_count_2_63": (lambda: raw_gguf(kvs=[kv("tokenizer.ggml.tokens", 9, u32(8) + struct.pack("<Q", BIG))]),
                         "tokenizer.ggml.tokens", "cannot fit"),
    "number_array_2_63": (lambda: raw_gguf(kvs=[kv("general.list", 9, u32(4) + struct.pack("<Q", BIG))]),
                          "general.list", "past the end"),
    "key_length_2_63": (lambda: raw_gguf(kvs=[s("general.architecture", length=BIG)]), "metadata key #0",
                        "past the end"),
    "string_past_the_end": (lambda: raw_gguf(kvs=[kv("general.architecture", 8, s("llama", length=10**6))]),
                            "general.architecture", "past the end"),
    "tensor_name_past_the_end": (lambda: raw_gguf(infos=[s("output_norm.weight", length=10**6)]),
                                 "tensor #0's name", "past the end"),
    "arrays_nested_20000_deep": (lambda: nested_arrays(20_000), "general.nested", "nested"),
    "unknown_value_type": (lambda: raw_gguf(kvs=[kv("general.architecture", 99, b"")]), "general.architecture",
                           "unknown GGUF value type 99"),
    "unknown_tensor_type": (lambda: raw_gguf(infos=[info("output_norm.weight", [HIDDEN], ggml=99)]),
                            "output_norm.weight", "unknown tensor type 99"),
    "a_dimension_of_0": (lambda: raw_gguf(infos=[info("output_norm.weight", [HIDDEN, 0])]), "output_norm.weight",
                         "dimensions"),
    "a_dimension_of_2_62": (lambda: raw_gguf(infos=[info("output_norm.weight", [HIDDEN, 2**62])]),
                            "output_norm.weight", "dimensions"),
    "columns_not_whole_blocks": (lambda: raw_gguf(infos=[info("output_norm.weight", [48], ggml=2)]),
                                 "output_norm.weight", "blocks"),
    "misaligned_offset": (lambda: raw_gguf(infos=[info("output_norm.weight", [HIDDEN], offset=4)]),
                          "output_norm.weight", "alignment"),
    "alignment_not_a_power_of_two": (lambda: raw_gguf(kvs=[kv("general.alignment", 4, u32(24))]),
                                     "general.alignment", "power of two"),
    "duplicate_key": (lambda: raw_gguf(kvs=[kv("general.name", 8, s("a")), kv("general.name", 8, s("b"))]),
                      "general.name", "twice"),
    "not_gguf": (lambda: b"PK\x03\x04" + bytes(100), "magic", "not a GGUF file"),
    "shorter_than_a_header": (lambda: b"GGUF", "header", "shorter than a GGUF header"),
}


@pytest.mark.parametrize("case", sorted(STRUCTURAL))
def test_a_structure_that_does_not_fit_is_named(case, tmp_path):
    make, field, problem = STRUCTURAL[case]
    path = tmp_path / f"{case}.gguf"
    path.write_bytes(make())
    with pytest.raises(GGUFFileError) as e:
        check_gguf(str(path))
    assert str(e.value).startswith(f"{path}: {field}: ") and problem in str(e.value), str(e.value)


def test_the_raw_files_base_is_valid(tmp_path):
    """Each structural case differs from a file the checks accept in one field only."""
    path = tmp_path / "base.gguf"
    path.write_bytes(raw_gguf())
    reader, args = check_gguf(str(path))
    assert args.hidden_size == HIDDEN and reader.tensors[0].data.tolist() == [1.0] * HIDDEN


def test_the_compiled_loop_refuses_a_weight_its_buffers_would_not_fit(tiny_tokenizer, tmp_path):
    """Past the file's checks, the compiled layer loop itself refuses (in Python, before any
    kernel call) a projection whose rows or columns differ from what the args size its buffers by."""
    import dataclasses

    import torch

    from pagedserve.attention.cpu_backend import CpuAttention
    from pagedserve.kernels import cpu, quant
    from pagedserve.kernels.cpu_ops import CpuOps
    from pagedserve.models.loader import load_model
    path = write_llama_gguf(tmp_path / "good.gguf", tiny_tokenizer)
    model, _, _ = load_model(str(path), "float32", CpuAttention(), ops=CpuOps(), quantization="gguf")
    model.pack_linear_weights()
    if not cpu.DecoderLayers.supports(model):
        pytest.skip("the compiled layer loop is not built here")
    cpu.DecoderLayers(model)                                    # the file's own weights fit
    layer = model.layers[0]
    fitting = layer.gate_up
    layer.gate_up = quant.quantize(torch.randn(2 * INTER + 32, HIDDEN), "q8_0")    # 32 rows too many
    with pytest.raises(ValueError, match="layer 0 gate_up: a weight of 288 rows"):
        cpu.DecoderLayers(model)
    layer.gate_up = fitting
    model.args = dataclasses.replace(model.args, intermediate_size=4 * INTER)     # buffers the args size
    with pytest.raises(ValueError, match="layer 0 gate_up"):
        cpu.DecoderLayers(model)
