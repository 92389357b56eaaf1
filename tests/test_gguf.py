"""GGUF files of other architectures (here qwen2, written from a tiny random model) load through
the shared name mapping and generate what transformers generates; the float cache made from a
GGUF file is keyed by its content, one entry per file, and `pagedserve cache --clear` empties it."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.conftest import hf_greedy
from tests.gguf_utils import finish, gguf_name, hf_writer

def write_qwen2_gguf(tm, path) -> None:
    """As llama.cpp's converter writes a Qwen2 model: float32 tensors, q/k rows as in HF."""
    cfg = tm.hf.config
    w = hf_writer(path, "qwen2", cfg)
    for name, t in tm.hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w.add_tensor(gguf_name(name)[1], t.detach().float().numpy().astype(np.float32))
    finish(w)


@pytest.fixture
def qwen2_gguf(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    tm = tiny_models("qwen2_bias_tied")
    path = tmp_path / "tiny-qwen2.gguf"
    write_qwen2_gguf(tm, path)
    return tm, path


def test_qwen2_gguf_matches_transformers(qwen2_gguf, tmp_path):
    tm, path = qwen2_gguf
    # The tokenizer from the HF directory (the test's GGUF carries none).
    llm = LLM(str(path), tokenizer=tm.path, dtype="float32", num_gpu_blocks_override=64)
    assert llm.engine.model_args.architecture == "Qwen2ForCausalLM" and llm.engine.model_args.qkv_bias
    ids = tm.tokenizer.encode("Keys and values are stored in blocks of the cache")
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8, min_tokens=8,
                                                                 prompt_logprobs=0), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(tm.hf, ids, 8)
    # Logit for logit: each prompt token's logprob as transformers computes it.
    with torch.no_grad():
        ref = torch.log_softmax(tm.hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    ours = torch.tensor([out.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i > 0])
    torch.testing.assert_close(ours, ref[torch.arange(len(ids) - 1), ids[1:]], atol=1e-4, rtol=1e-4)


def test_an_entry_made_by_other_code_is_made_again(qwen2_gguf, tmp_path):
    """A cache entry stamped by another version of the reader (or with ModelArgs fields this
    code lacks) is converted again, never read as this code's."""
    import json
    from pagedserve.models.loader import _load_gguf
    tm, path = qwen2_gguf
    args, _ = _load_gguf(str(path))
    entry = next((tmp_path / "cache" / "models").iterdir())
    stamp = json.loads((entry / "source.json").read_text())
    (entry / "args.json").write_text(json.dumps({"a_field_of_other_code": 1}))
    (entry / "source.json").write_text(json.dumps({**stamp, "derivation": "other"}))
    again, _ = _load_gguf(str(path))
    assert again == args


def test_the_gguf_cache_is_keyed_by_content_one_entry_per_file(qwen2_gguf, tmp_path):
    from pagedserve.models.loader import _load_gguf
    tm, path = qwen2_gguf
    entries = lambda: sorted(p.name for p in (tmp_path / "cache" / "models").iterdir())   # noqa: E731
    args, weights = _load_gguf(str(path))
    first = entries()
    assert len(first) == 1
    os.utime(path, (1, 1))                                  # touched, same content: the entry is kept
    stamp = (tmp_path / "cache" / "models" / first[0] / "model.safetensors").stat().st_mtime_ns
    _load_gguf(str(path))
    assert (tmp_path / "cache" / "models" / first[0] / "model.safetensors").stat().st_mtime_ns == stamp
    # New content at the same path: the same entry, converted again (the cache does not grow).
    state = tm.hf.state_dict()
    state["model.norm.weight"] = state["model.norm.weight"] * 2
    tm.hf.load_state_dict(state)
    try:
        write_qwen2_gguf(tm, path)
    finally:
        state["model.norm.weight"] = state["model.norm.weight"] / 2
        tm.hf.load_state_dict(state)
    _, again = _load_gguf(str(path))
    assert entries() == first
    torch.testing.assert_close(again["norm.weight"], weights["norm.weight"] * 2)
    res = subprocess.run([sys.executable, "-m", "pagedserve.cli", "cache", "--clear"], capture_output=True,
                         text=True, env={**os.environ, "PAGEDSERVE_CACHE": str(tmp_path / "cache")}, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "models" in res.stdout and not (tmp_path / "cache" / "models").exists()


def test_an_unsupported_gguf_architecture_is_named(tmp_path):
    import gguf
    from pagedserve.models.loader import args_from_gguf
    path = tmp_path / "gemma.gguf"
    w = gguf.GGUFWriter(str(path), "gemma")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma'; supported: llama .*qwen2"):
        args_from_gguf(gguf.GGUFReader(str(path)))
