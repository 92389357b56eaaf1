"""Quantized weights, end to end: tiny random Llama models written as GGUF files of each block type
(Q8_0, Q4_0, Q4_1, Q5_1 quantized by the gguf package; the K-quants as random valid blocks; Q4_K_M
and Q5_K_M-like mixes; a file with types that have no kernel), loaded in their blocks, against the
transformers float32 oracle on the same dequantized weights: greedy tokens agree (teacher-forced,
every token is the oracle's argmax up to a near-tie), prompt logprobs within a tolerance, and the
perplexity of a fixed text within 1%. The default model (Q4_1) natively against its dequantized
path; the bytes the loaded weights hold against the file; quantize-at-load of an HF model; tensor
parallelism of a quantized file; and the settings' refusals."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import cache_dir
from pagedserve.kernels import quant
from pagedserve.models.loader import _unpermute_rotary, default_model_path
from tests.gguf_utils import K_SCALES, finish, gguf_name, hf_writer, random_k_blocks
from tests.q8_oracle import integer_path_modules, q8_inputs

gguf = pytest.importorskip("gguf")
GGML = gguf.GGMLQuantizationType

# Tolerances of the native kernels (8-bit activations, as llama.cpp) against float32 on the same
# weights: a generated token may differ from the oracle's argmax only where the oracle's top logit
# is within MARGIN of it; prompt logprobs within LOGPROB_ATOL; perplexity within 1%.
MARGIN = 0.15
LOGPROB_ATOL = 0.15
# The default model's decode steps (8-bit activations over Q4_1) move logprobs by up to ~0.2 nats
# against its dequantized float32 path (its prefill, on dequantized tiles, matches exactly).
DEFAULT_MODEL_MARGIN = 0.35
TEXT = "Paged attention stores keys and values in fixed-size blocks. Continuous batching schedules every " \
       "running sequence at each iteration."
PROMPTS = ["The quick brown fox", "Once upon a time there was", "def add(a, b):"]

# name -> (the layers' type, by GGUF tensor kind; default for kinds not listed)
MIXES = {
    "q8_0": {"*": GGML.Q8_0},
    "q4_0": {"*": GGML.Q4_0},
    "q4_1": {"*": GGML.Q4_1},
    "q5_1": {"*": GGML.Q5_1},
    "q5_0": {"*": GGML.Q5_0},       # (q5_0r8 on the 256-bit variants: Gemma 3's, gpt-oss's widths in Q4_K_M)
    # as llama.cpp's Q4_K_M / Q5_K_M: v, down and the output matrix in Q6_K (q/k/v then differ)
    "q4_k_m": {"*": GGML.Q4_K, "attn_v": GGML.Q6_K, "ffn_down": GGML.Q6_K, "output": GGML.Q6_K},
    "q5_k_m": {"*": GGML.Q5_K, "attn_v": GGML.Q6_K, "ffn_down": GGML.Q6_K, "output": GGML.Q6_K},
    # types without a kernel: dequantized at load (v: a float part of the fused q/k/v); the
    # embedding's rows dequantized by the gguf package at each lookup
    "q3_k_fallback": {"*": GGML.Q4_K, "attn_v": GGML.Q2_K, "ffn_down": GGML.Q3_K, "output": GGML.Q6_K,
                      "token_embd": GGML.Q3_K},
}


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF's q/k rows into llama.cpp's rotary layout (what its converter writes)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _ggml_raw(qtype, w: np.ndarray, rng) -> np.ndarray:
    if qtype.name in K_SCALES:
        return random_k_blocks(qtype, *w.shape, rng, std=float(w.std()))
    return gguf.quants.quantize(w, qtype)


def write_quantized_llama(cfg, state: dict[str, torch.Tensor], path, mix: dict) -> dict[str, torch.Tensor]:
    """Write an HF Llama state dict as llama.cpp would (`llama` architecture, q/k rows permuted),
    each matmul weight in the mix's type; return the oracle's state dict: the file's weights
    dequantized (and un-permuted) into HF's names, the weights the native kernels compute with."""
    rng = np.random.default_rng(0)
    w = hf_writer(path, "llama", cfg)
    oracle = {}
    for name, t in state.items():
        kind, name_in_file = gguf_name(name)
        a = t.detach().float().numpy().astype(np.float32)
        heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(kind)
        if heads:
            a = _permute(a, heads)
        if a.ndim == 1:
            w.add_tensor(name_in_file, a)
            oracle[name] = t.detach().float().clone()
            continue
        qtype = mix.get(kind, mix["*"])
        raw = _ggml_raw(qtype, a, rng)
        w.add_tensor(name_in_file, raw, raw_dtype=qtype)
        back = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32)
        oracle[name] = torch.from_numpy(_unpermute_rotary(back, heads) if heads else back).clone()
    finish(w)
    return oracle


@pytest.fixture(scope="module")
def base_model(tiny_tokenizer, tmp_path_factory):
    """A random Llama whose dimensions are whole K-quant blocks (256), untied, with its tokenizer."""
    import transformers
    tok_dir = tmp_path_factory.mktemp("quant_tok")
    tiny_tokenizer.save_pretrained(tok_dir)
    cfg = transformers.LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1,
                                   tie_word_embeddings=False, bos_token_id=tiny_tokenizer.bos_token_id,
                                   eos_token_id=tiny_tokenizer.eos_token_id)
    torch.manual_seed(28)
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    return cfg, hf, str(tok_dir), tiny_tokenizer


def _oracle(cfg, state) -> torch.nn.Module:
    import transformers
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    hf.load_state_dict(state, strict=False)
    return hf


def _check_against_oracle(llm: LLM, hf, tok, margin: float = MARGIN, atol: float = LOGPROB_ATOL) -> float:
    """Greedy tokens teacher-forced through the oracle (each is its argmax up to `margin`), prompt
    logprobs within `atol`; returns the perplexity ratio ours / oracle's of TEXT."""
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        ids, gen = out.prompt_token_ids, list(out.outputs[0].token_ids)
        with torch.no_grad():
            logits = hf(torch.tensor([ids + gen])).logits[0].float()
        for i, t in enumerate(gen):
            row = logits[len(ids) + i - 1]
            assert row.max() - row[t] <= margin, (out.prompt, i, float(row.max() - row[t]))
    ids = tok.encode(TEXT)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    ours = torch.tensor([out.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i > 0])
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)[torch.arange(len(ids) - 1), ids[1:]]
    assert (ours - ref).abs().max() <= atol, float((ours - ref).abs().max())
    return float(torch.exp(-ours.mean()) / torch.exp(-ref.mean()))


@pytest.mark.parametrize("mix", list(MIXES))
def test_gguf_blocks_match_transformers_on_the_dequantized_weights(mix, base_model, tmp_path, caplog):
    cfg, hf, tok_dir, tok = base_model
    path = tmp_path / f"tiny-{mix}.gguf"
    oracle = _oracle(cfg, write_quantized_llama(cfg, hf.state_dict(), path, MIXES[mix]))
    with caplog.at_level("INFO", logger="pagedserve.models.loader"):
        llm = LLM(str(path), tokenizer=tok_dir, dtype="float32", num_gpu_blocks_override=64)
    # products on the integer path in every step (r8 layouts on the 256-bit variants, prefills too):
    # the oracle's see the same 8-bit inputs (tests/q8_oracle.py); the others' float ones (their
    # prefill on the float tiles, their decode within MARGIN)
    with q8_inputs(oracle, integer_path_modules(_model_of(llm))):
        ratio = _check_against_oracle(llm, oracle, tok)
    assert abs(ratio - 1) < 0.01, ratio
    if mix in ("q4_k_m", "q5_k_m") and quant.variant() in quant.R8_VARIANTS:     # the super-block r8 dots ran
        layer = _model_of(llm).layers[0]
        parts = [p for n in ("qkv", "o", "gate_up", "down")
                 for p in (getattr(layer, n) if isinstance(getattr(layer, n), tuple) else (getattr(layer, n),))]
        assert {p.qtype for p in parts} == {mix[:2] + "_kr8", "q6_kr8"}, [p.qtype for p in parts]
    if mix == "q5_0" and quant.variant() in quant.R8_VARIANTS:        # the q5_0r8 dots ran
        layer = _model_of(llm).layers[0]
        assert {p.qtype for n in ("qkv", "o", "gate_up", "down")
                for p in (getattr(layer, n) if isinstance(getattr(layer, n), tuple) else (getattr(layer, n),))} == \
            {"q5_0r8"}
    notes = [r.getMessage() for r in caplog.records if "quantized matmul weights" in r.getMessage()]
    assert len(notes) == 1, notes
    if mix == "q3_k_fallback":       # said once: which types, how many tensors
        assert "dequantized (types without a kernel): 2 Q2_K, 2 Q3_K" in notes[0], notes[0]
    else:
        assert "without a kernel" not in notes[0]
    models = cache_dir("models")                              # the native path caches no float copy
    assert not models.exists() or not any(p.name.startswith(path.stem + "-") for p in models.iterdir())


def test_amx_int8_batches_match_transformers(base_model, tmp_path):
    """A Q4_K_M file (q4_k and q6_k) whose batches of decode tokens and prefill chunks run the
    AMX-INT8 dots (from 1 row): greedy tokens and prompt logprobs as the oracle's on the same
    dequantized weights, as on the vpdpbusd path."""
    cfg, hf, tok_dir, tok = base_model
    path = tmp_path / "tiny-q4_k_m.gguf"
    oracle = _oracle(cfg, write_quantized_llama(cfg, hf.state_dict(), path, MIXES["q4_k_m"]))
    with quant.using_amx_int8(True, 1) as on:
        if not on:
            pytest.skip("no AMX-INT8 dots here (CPU, kernel or variant)")
        llm = LLM(str(path), tokenizer=tok_dir, dtype="float32", num_gpu_blocks_override=64)
        assert _model_of(llm).compiled_layers is not None
        ratio = _check_against_oracle(llm, oracle, tok)
    assert abs(ratio - 1) < 0.01, ratio


def _model_of(llm: LLM):
    """The loaded LlamaModel (under tensor parallelism: rank 0's shard)."""
    return llm.engine.executor.worker.runner.model


def test_mixed_types_stay_apart_and_same_types_fuse(base_model, tmp_path):
    from pagedserve.models.loader import load_model
    from pagedserve.attention.torch_backend import TorchAttention
    cfg, hf, _, _ = base_model
    path = tmp_path / "mix.gguf"
    write_quantized_llama(cfg, hf.state_dict(), path, MIXES["q4_k_m"])
    model, _, _ = load_model(str(path), "float32", TorchAttention(), quantization="gguf")
    layer = model.layers[0]
    assert isinstance(layer.qkv, tuple) and [p.qtype for p in layer.qkv] == ["q4_k", "q4_k", "q6_k"]
    assert isinstance(layer.gate_up, quant.QuantizedWeight) and layer.gate_up.qtype == "q4_k"
    assert layer.gate_up.shape == (2 * cfg.intermediate_size, cfg.hidden_size)
    assert layer.down.qtype == "q6_k" and model.lm_head.qtype == "q6_k"
    # Both ops objects run the parts and join their outputs (TorchOps through quant's reference).
    from pagedserve.kernels.cpu_ops import CpuOps
    from pagedserve.models.ops import TorchOps
    x = torch.randn(3, cfg.hidden_size)
    expected = torch.cat([quant.dequantize(p, torch.float32) for p in layer.qkv]) @ x.T
    for ops in (TorchOps(), CpuOps()):
        torch.testing.assert_close(ops.linear(x, layer.qkv), expected.T, atol=0.05, rtol=0.05)


def _vm_flags(address: int) -> str:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line
    raise AssertionError(f"no mapping holds {address:#x}")


def test_quantized_weights_in_huge_pages_give_the_same_tokens(base_model, tmp_path, monkeypatch):
    """With huge pages (models/huge_pages.py) a GGUF file's blocks are copied out of its mapping
    into the arena, 64-byte aligned, and the runner's KV cache is a mapping of its own advised
    MADV_HUGEPAGE (VmFlags `hg`); without them the blocks stay views of the file and the cache a
    plain tensor; the tokens and logprobs are the same."""
    from pagedserve.models import huge_pages
    if not huge_pages.available():
        pytest.skip("no transparent huge pages on this kernel")
    cfg, hf, tok_dir, _ = base_model
    path = tmp_path / "tiny-q4_k_m.gguf"
    write_quantized_llama(cfg, hf.state_dict(), path, MIXES["q4_k_m"])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    runs = {}
    for huge in ("0", "1"):
        monkeypatch.setenv(huge_pages.ENV, huge)
        monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)         # the tiny model's matrices too
        monkeypatch.setattr(huge_pages, "KV_MIN_BYTES", 0)      # and its small KV cache
        llm = LLM(str(path), tokenizer=tok_dir, dtype="float32", num_gpu_blocks_override=64)
        model = _model_of(llm)
        weights = [model.layers[0].gate_up, model.layers[1].o, model.lm_head]
        in_arena = [w.data.untyped_storage().nbytes() >= huge_pages.CHUNK for w in weights]
        assert in_arena == [huge == "1"] * 3, (huge, in_arena)
        assert huge == "0" or all(w.data.data_ptr() % huge_pages.ALIGN == 0 for w in weights)
        cache = llm.engine.executor.worker.runner.kv_cache
        assert (" hg" in _vm_flags(cache.data_ptr())) == (huge == "1")
        assert huge == "0" or cache.data_ptr() % huge_pages.HUGE_PAGE == 0
        runs[huge] = [(list(o.outputs[0].token_ids), o.outputs[0].cumulative_logprob)
                      for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        del llm, model, weights, cache
    assert runs["0"] == runs["1"]


def test_huge_page_copies_are_exact_and_can_be_turned_off(monkeypatch):
    from pagedserve.models import huge_pages
    parts = [torch.randint(0, 256, (rows, 1000), dtype=torch.uint8) for rows in (300, 77)]
    monkeypatch.setenv(huge_pages.ENV, "0")
    assert huge_pages.stack_rows(parts, 5) is None and huge_pages.copy_to_huge_pages(parts[0]) is parts[0]
    assert huge_pages.zeros((64, 1 << 20), torch.uint8) is None
    monkeypatch.setenv(huge_pages.ENV, "1")
    if not huge_pages.available():
        pytest.skip("no transparent huge pages on this kernel")
    stacked = huge_pages.stack_rows(parts, 5)
    assert torch.equal(stacked, torch.cat(parts + [torch.zeros(5, 1000, dtype=torch.uint8)]))
    copy = huge_pages.copy_to_huge_pages(parts[0].float())
    assert torch.equal(copy, parts[0].float()) and copy.data_ptr() % huge_pages.ALIGN == 0
    assert huge_pages.stack_rows([parts[0][:2]]) is None        # a few bytes: left where they are
    zeros = huge_pages.zeros((64, 1 << 20), torch.bfloat16)     # (a KV cache's: at least KV_MIN_BYTES)
    assert torch.equal(zeros, torch.zeros(64, 1 << 20, dtype=torch.bfloat16)) and " hg" in _vm_flags(zeros.data_ptr())
    assert huge_pages.zeros((3, 1000), torch.bfloat16) is None  # a small cache: left to torch


def test_the_default_model_runs_in_its_blocks_like_its_dequantized_path():
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    native = LLM(dtype="float32", kv_cache_memory=64 * 1024**2)
    model = _model_of(native)
    # (rows interleaved in eights where the avx512vnni kernels run, q4_1, and on avx2 / avxvnni,
    # q4_1 and the tied head's q8_0 where the loader owns the table's copy: quant.repack)
    r8_here = quant.variant() in quant.R8_VARIANTS
    q4_1 = "q4_1r8" if quant.variant() == "avx512vnni" or r8_here else "q4_1"
    head = "q8_0r8" if r8_here and model.embed.owned else "q8_0"
    assert model.layers[0].qkv.qtype == q4_1 and model.lm_head.qtype == head     # tied: the embedding's
    assert model.lm_head is model.embed.weight
    dequantized = LLM(dtype="float32", kv_cache_memory=64 * 1024**2, gguf_dequantize=True)
    assert not isinstance(_model_of(dequantized).layers[0].qkv, quant.QuantizedWeight)
    prompts = ["The capital of France is", "def fibonacci(n):", "The three primary colors are"]
    outs = native.generate(prompts, SamplingParams(temperature=0, max_tokens=16, min_tokens=16), use_tqdm=False)
    for out in outs:
        ids, gen = out.prompt_token_ids, list(out.outputs[0].token_ids)
        ref = dequantized.generate({"prompt_token_ids": ids + gen}, SamplingParams(max_tokens=1, prompt_logprobs=1),
                                   use_tqdm=False)[0].prompt_logprobs
        for i, t in enumerate(gen):
            top = max(lp.logprob for lp in ref[len(ids) + i].values())
            assert top - ref[len(ids) + i][t].logprob <= DEFAULT_MODEL_MARGIN, (out.prompt, i)
    assert "Paris" in outs[0].outputs[0].text


_MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from pagedserve.attention.cpu_backend import CpuAttention
    from pagedserve.kernels.cpu_ops import CpuOps
    from pagedserve.models.loader import load_model
    from pagedserve.models.quantized import model_weight_bytes, _storages

    def rss(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    path, dtype, quantization = sys.argv[1], sys.argv[2], sys.argv[3] or None
    before = rss("VmRSS:")
    model, _, _ = load_model(path, dtype, CpuAttention(), ops=CpuOps(), quantization=quantization)
    model.pack_linear_weights()
    for w in model.layers:          # every weight's pages read once, as a forward pass does
        for t in (w.qkv, w.o, w.gate_up, w.down):
            for s in _storages(t):
                s.view(-1)[::4096].sum()
    print(json.dumps({"before": before, "peak": rss("VmHWM:"), "after": rss("VmRSS:"),
                      "weights": model_weight_bytes(model)}))
""")


def _load_memory(path: str, dtype: str, quantization: str | None) -> dict:
    res = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, path, dtype, quantization or ""], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PAGEDSERVE_CACHE": os.environ.get(
                             "PAGEDSERVE_CACHE", "")} if os.environ.get("PAGEDSERVE_CACHE") else None)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_loading_holds_about_the_files_bytes():
    """The default model's weights in memory are about its file (bytes counted, not time), and
    loading it peaks below 1.5x the file."""
    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    size = os.path.getsize(path)
    m = _load_memory(path, "float32", "gguf")
    assert 0.9 * size <= m["weights"] <= 1.02 * size, (m, size)
    assert m["peak"] - m["before"] < 1.5 * size, (m, size)


def test_an_hf_bf16_directory_loads_in_one_copy(tmp_path):
    """Tensor by tensor, no mapping kept: peak below 1.3x the checkpoint's bytes."""
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
                                   num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in transformers.LlamaForCausalLM(cfg).state_dict().items()}
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(0)
    save_file({k: torch.randn(s, generator=g).mul_(0.02).to(torch.bfloat16) for k, s in shapes.items()},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({**cfg.to_dict(), "architectures": ["LlamaForCausalLM"],
                                                      "torch_dtype": "bfloat16"}))
    size = os.path.getsize(tmp_path / "model.safetensors")
    m = _load_memory(str(tmp_path), "bfloat16", None)
    assert m["peak"] - m["before"] < 1.3 * size, (m, size)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_quantize_at_load_matches_transformers_on_the_quantized_weights(qtype, tiny_llama):
    llm = LLM(tiny_llama.path, dtype="float32", quantization=qtype, num_gpu_blocks_override=64)
    model = _model_of(llm)
    file_type = lambda w: quant.REPACKED.get(w.qtype, w.qtype)       # noqa: E731 (r8 layouts where repacked)
    assert file_type(model.layers[0].qkv) == qtype and file_type(model.lm_head) == "q8_0"
    state = {}
    for name, t in tiny_llama.hf.state_dict().items():
        if t.dim() == 2 and "embed_tokens" not in name:
            q = "q8_0" if name == "lm_head.weight" else qtype
            t = quant.dequantize(quant.quantize(t.float(), q), torch.float32)
        state[name] = t.float().clone()
    oracle = _oracle(tiny_llama.hf.config, state)
    ratio = _check_against_oracle(llm, oracle, tiny_llama.tokenizer)
    assert abs(ratio - 1) < 0.01, ratio


def test_tensor_parallel_ranks_split_quantized_blocks(base_model, tmp_path):
    """Two mp ranks over a Q8_0 file (rows by heads, columns by whole blocks) agree with the
    oracle; a Q4_K file whose attention output would split inside a 256-column block is refused."""
    cfg, hf, tok_dir, tok = base_model
    path = tmp_path / "tp.gguf"
    oracle = _oracle(cfg, write_quantized_llama(cfg, hf.state_dict(), path, MIXES["q8_0"]))
    llm = LLM(str(path), tokenizer=tok_dir, dtype="float32", num_gpu_blocks_override=64, tensor_parallel_size=2)
    try:
        o = _model_of(llm).layers[0].o        # rank 0's half of the attention output's columns
        assert isinstance(o, quant.QuantizedWeight) and o.shape == (cfg.hidden_size, cfg.hidden_size // 2)
        _check_against_oracle(llm, oracle, tok)
    finally:
        llm.shutdown()
    kpath = tmp_path / "tp-k.gguf"
    write_quantized_llama(cfg, hf.state_dict(), kpath, MIXES["q4_k_m"])
    with pytest.raises(ValueError, match=r"cannot be split at columns 0:128: its blocks hold 256 columns"):
        LLM(str(kpath), tokenizer=tok_dir, dtype="float32", num_gpu_blocks_override=64, tensor_parallel_size=2)


def test_quantization_settings_are_checked():
    from pagedserve.cli import build_parser
    from pagedserve.config import EngineConfig
    with pytest.raises(ValueError, match="quantizes an HF float model at load; the model is a .gguf"):
        EngineConfig(model="m.gguf", quantization="q4_0")
    with pytest.raises(ValueError, match="quantizes an HF float model"):
        EngineConfig(quantization="q8_0")              # the default model is a GGUF file
    with pytest.raises(ValueError, match="runs on the CPU only"):
        EngineConfig(model="m.gguf", quantization="gguf", device="cuda")
    with pytest.raises(ValueError, match="pass one"):
        EngineConfig(quantization="gguf", gguf_dequantize=True)
    with pytest.raises(ValueError, match="quantization must be one of gguf, q8_0, q4_0"):
        EngineConfig(quantization="awq")
    args = build_parser().parse_args(["generate", "--quantization", "gguf", "--gguf-dequantize"])
    assert args.quantization == "gguf" and args.gguf_dequantize
    assert build_parser().parse_args(["serve", "-q", "q8_0"]).quantization == "q8_0"


def test_gguf_quantization_needs_a_gguf_file(tiny_llama):
    with pytest.raises(ValueError, match="quantization='gguf' needs a .gguf model file"):
        LLM(tiny_llama.path, quantization="gguf")


def test_decode_batches_tell_the_kernels_so(base_model, tmp_path, monkeypatch):
    """LlamaModel.forward passes decode=True to the quantized linears on batches of decode
    tokens only (their integer path goes to DECODE_BATCH_ROWS), and never on a prefill chunk."""
    cfg, hf, tok_dir, _ = base_model
    path = tmp_path / "tiny-q4_0.gguf"
    write_quantized_llama(cfg, hf.state_dict(), path, MIXES["q4_0"])
    llm = LLM(str(path), tokenizer=tok_dir, dtype="float32", num_gpu_blocks_override=64)
    calls: list[tuple[int, bool]] = []
    real = quant.linear

    lm_head = _model_of(llm).lm_head
    _model_of(llm).compiled_layers = None    # the Python layer loop's flag (the compiled loop's: test_compiled_quantized_layers)

    invariant_calls: list[bool] = []

    def spy(x, w, bias=None, decode=False, out_dtype=None, invariant=False):
        if w is not lm_head:                                   # the logits' rows: not a batch kind
            calls.append((x.shape[0], decode))
            invariant_calls.append(invariant)
        return real(x, w, bias, decode, out_dtype, invariant)
    monkeypatch.setattr(quant, "linear", spy)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (20, 24)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    prefill = [rows for rows, decode in calls if not decode]
    assert prefill and min(prefill) > 2 and all(not decode for rows, decode in calls if rows > 2), calls
    assert {(2, True), (1, True)} >= {c for c in calls if c[1]} and (2, True) in calls, calls   # the decode steps
    # greedy requests: batch-invariant steps (batch_invariant auto), the prefill chunks told so
    assert all(inv for (rows, decode), inv in zip(calls, invariant_calls) if not decode)
