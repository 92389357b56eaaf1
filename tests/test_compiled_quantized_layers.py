"""The compiled layer loop (kernels/cpu.py DecoderLayers, cpu_kernels.cpp decoder_layers) over
quantized weights: it runs the same quant kernels (kernels/quant.py) as the Python layer loop, so
its logits equal the Python loop's over the same weights (up to float summation order) and its
greedy tokens are the same; for GGUF files of Q4_0, Q8_0, Q4_K, a Q4_K_M-like mix (a fused qkv
stored in parts of different types), a layer mixing float and quantized projections, a model
quantized at load with a qkv bias, bf16 and float32 activations, an 8-bit KV cache, every ISA
variant of both libraries; and it is really on (no silent fallback), and off where the quant
kernels are not built."""
from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.attention.cpu_backend import CpuAttention
from pagedserve.kernels import cpu, quant
from pagedserve.kernels.cpu_ops import CpuDecoderLayers, CpuOps
from pagedserve.models.loader import default_model_path, load_model
from tests.test_models import paged_logits
from tests.test_quantized_models import MIXES, base_model, write_quantized_llama  # noqa: F401 (a fixture)

gguf = pytest.importorskip("gguf")

# A prompt longer than the integer path's row thresholds: its prefill runs the dequantized tiles (on avx2 /
# avxvnni, where every part is in an r8 layout with the integer GEMM: that GEMM, quant.batch_rows).
PROMPT = ("Paged attention stores keys and values in fixed-size blocks, so continuous batching can schedule "
          "every running sequence at each iteration without copying its cache around.")
# Logits of the two loops: the same kernels on the same inputs (tight: only summation order may differ).
ATOL = {"float32": 1e-4, "bfloat16": 2e-2}


@pytest.fixture(scope="module")
def gguf_files(base_model, tmp_path_factory):  # noqa: F811
    """mix -> the path of the base model written as a GGUF file of that mix."""
    cfg, hf, tok_dir, tok = base_model
    root = tmp_path_factory.mktemp("compiled_quant")
    files = {}
    ggml = gguf.GGMLQuantizationType
    for mix, types in {**{m: MIXES[m] for m in ("q4_0", "q8_0", "q4_k_m")}, "q4_k": {"*": ggml.Q4_K},
                       # float and quantized projections in one layer: o in F16 (packed float), down in Q8_0
                       "float_o": {"*": ggml.Q4_0, "attn_output": ggml.F16, "ffn_down": ggml.Q8_0}}.items():
        files[mix] = root / f"tiny-{mix}.gguf"
        write_quantized_llama(cfg, hf.state_dict(), files[mix], types)
    return files, tok_dir, tok


class _Counting:
    """Wraps a model's compiled loop: counts the steps it ran and the ones it declined (where
    LlamaModel.forward would silently run the Python loop instead)."""

    def __init__(self, compiled: CpuDecoderLayers) -> None:
        self.compiled, self.ran, self.declined = compiled, 0, 0

    def forward(self, *args) -> bool:
        ok = self.compiled.forward(*args)
        self.ran, self.declined = self.ran + ok, self.declined + (not ok)
        return ok


def _quantized_model(path, dtype: str, **kwargs):
    model, _, _ = load_model(str(path), dtype, CpuAttention(), ops=CpuOps(), **kwargs)
    model.pack_linear_weights()
    compiled = model.compiled_layers
    assert isinstance(compiled, CpuDecoderLayers), "the compiled loop is off for a quantized model"
    assert compiled.layers.quantized
    return model, compiled


def _assert_loops_agree(model, compiled, prompt: list[int], dtype: str) -> None:
    """Prefill (tiles), chunked prefill (integer path, not decode-only) and decode through the
    compiled loop and through the Python loop: the same logits, the same greedy tokens."""
    assert len(prompt) > max(quant.SMALL_BATCH_ROWS, getattr(quant, "DECODE_BATCH_ROWS", 0))
    for chunk in (len(prompt), 5, 1):
        counting = _Counting(compiled)
        model.compiled_layers = counting
        fused = paged_logits(model, prompt, chunk, block=16)
        assert counting.ran > 0 and counting.declined == 0, (counting.ran, counting.declined)
        model.compiled_layers = None
        layer_by_layer = paged_logits(model, prompt, chunk, block=16)
        model.compiled_layers = compiled
        torch.testing.assert_close(fused, layer_by_layer, atol=ATOL[dtype], rtol=0)
        assert torch.equal(fused.argmax(-1), layer_by_layer.argmax(-1)), chunk


@pytest.mark.parametrize("mix,dtype", [(m, "float32") for m in ("q4_0", "q8_0", "q4_k", "q4_k_m", "float_o")] +
                         [(m, "bfloat16") for m in ("q4_0", "q4_k_m")])      # bf16 activations: two suffice
def test_compiled_loop_equals_the_python_loop_on_gguf_blocks(gguf_files, mix, dtype):
    files = gguf_files[0]
    model, compiled = _quantized_model(files[mix], dtype, quantization="gguf")
    if mix == "q4_k_m":         # q, k in Q4_K and v in Q6_K: qkv is a tuple of parts
        assert isinstance(model.layers[0].qkv, tuple)
    if mix == "float_o":
        assert isinstance(model.layers[0].o, cpu.PackedWeight) and quant.REPACKED.get(model.layers[0].down.qtype, "q8_0") == "q8_0"
    _assert_loops_agree(model, compiled, gguf_files[2].encode(PROMPT), dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_loop_runs_a_qkv_bias_quantized_at_load(tiny_models, dtype):
    """Qwen2 (a qkv bias), quantized at load to Q8_0 (the bias stays float)."""
    tm = tiny_models("qwen2_bias_tied")
    model, compiled = _quantized_model(tm.path, dtype, quantization="q8_0")
    assert model.layers[0].qkv_bias is not None and isinstance(model.layers[0].qkv, quant.QuantizedWeight)
    _assert_loops_agree(model, compiled, tm.tokenizer.encode(PROMPT), dtype)


@pytest.mark.parametrize("pair", [("avx512bf16", "avx512vnni"), ("avx512bf16", "vnni256"), ("avx512", "avxvnni"), ("avx2", "avx2"),
                                  ("scalar", "scalar")])
def test_compiled_loop_on_every_kernel_variant(gguf_files, pair):
    """Each CPU kernel variant (cpu.py) with a quant kernel variant (quant.py): the pairs cover
    every variant of both that the tests force elsewhere."""
    cpu_variant, quant_variant = pair
    missing = cpu.missing_flags(cpu_variant) + quant.KERNELS.missing_flags(quant_variant)
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}")
    files, _, tok = gguf_files
    with cpu.using_variant(cpu_variant) as lib, quant.using_variant(quant_variant) as qlib:
        assert lib is not None and qlib is not None
        model, compiled = _quantized_model(files["q4_k_m"], "float32", quantization="gguf")
        _assert_loops_agree(model, compiled, tok.encode(PROMPT), "float32")


def test_compiled_loop_over_an_8bit_kv_cache(gguf_files):
    """decoder_layers_kv8_* take the same table: the engine's greedy tokens equal the Python loop's."""
    files, tok_dir, _ = gguf_files
    llm = LLM(str(files["q4_k_m"]), tokenizer=tok_dir, dtype="bfloat16", kv_cache_dtype="int8",
              num_gpu_blocks_override=64, enable_prefix_caching=False)
    model = llm.engine.runner.model
    compiled = model.compiled_layers
    assert isinstance(compiled, CpuDecoderLayers) and compiled.layers.quantized and compiled.layers.kv_code
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    counting = _Counting(compiled)
    model.compiled_layers = counting
    fused = [o.outputs[0].token_ids for o in llm.generate([PROMPT, "The quick brown fox"], params, use_tqdm=False)]
    assert counting.ran > 0 and counting.declined == 0
    model.compiled_layers = None
    python = [o.outputs[0].token_ids for o in llm.generate([PROMPT, "The quick brown fox"], params, use_tqdm=False)]
    assert fused == python


def test_python_loop_where_the_quant_kernels_are_not_built(gguf_files, monkeypatch):
    files = gguf_files[0]
    monkeypatch.setattr(quant, "kernel_address", lambda name: None)
    model, _, _ = load_model(str(files["q4_0"]), "float32", CpuAttention(), ops=CpuOps(), quantization="gguf")
    model.pack_linear_weights()
    assert model.compiled_layers is None


def test_the_default_model_runs_the_compiled_loop():
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    llm = LLM(dtype="float32", kv_cache_memory=64 * 1024**2)
    model = llm.engine.runner.model
    assert isinstance(model.layers[0].qkv, quant.QuantizedWeight)
    compiled = model.compiled_layers
    assert isinstance(compiled, CpuDecoderLayers) and compiled.layers.quantized
    counting = _Counting(compiled)
    model.compiled_layers = counting
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert counting.ran > 0 and counting.declined == 0
    assert "Paris" in out[0].outputs[0].text
