"""Our model code against transformers' own forward, on the same weights (float32)."""
import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.attention.cpu_backend import CpuAttention
from pagedserve.attention.torch_backend import TorchAttention
from pagedserve.kernels.cpu import PackedWeight
from pagedserve.kernels.cpu_ops import CpuOps
from pagedserve.models.loader import load_model
from pagedserve.batch import ScheduledTokens
from pagedserve.worker.model_runner import ModelRunner
from tests.conftest import PROMPTS, VARIANTS, hf_greedy

BLOCK = 4


def paged_logits(model, prompt: list[int], chunk: int, num_blocks: int = 64, block: int = BLOCK) -> torch.Tensor:
    """Logits at every position, computing the prompt in chunks of `chunk` tokens through a
    shuffled (non-contiguous, out-of-order) block table."""
    runner = ModelRunner(model, num_blocks, block, sampler=None)
    blocks = list(range(num_blocks))
    random.Random(0).shuffle(blocks)
    table = blocks[: -(-len(prompt) // block)]
    rows = []
    for start in range(0, len(prompt), chunk):
        n = min(chunk, len(prompt) - start)
        ids, pos, meta = runner._prepare([ScheduledTokens(1, prompt[start:start + n], start, table)])
        hidden = model.forward(ids, pos, meta, runner.kv_cache)
        rows.append(model.compute_logits(hidden))
    return torch.cat(rows)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_logits_match_transformers(tiny_models, name):
    tm = tiny_models(name)
    model, args, dtype = load_model(tm.path, "float32", TorchAttention())
    assert dtype == torch.float32
    prompt = tm.tokenizer.encode(PROMPTS[5])
    with torch.no_grad():
        ref = tm.hf(torch.tensor([prompt])).logits[0]
    for chunk in (len(prompt), 5, 1):   # one prefill, chunked prefill, token-by-token decode
        ours = paged_logits(model, prompt, chunk)
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama3_rope", "llama_gqa_untied"])
def test_transformers4_config_form_loads_the_same(tiny_models, name):
    """A config with rope_theta / rope_scaling (transformers 4) gives the same model."""
    tm = tiny_models(name, v4_config=True)
    model, _, _ = load_model(tm.path, "float32", TorchAttention())
    prompt = tm.tokenizer.encode(PROMPTS[2])
    with torch.no_grad():
        ref = tm.hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(paged_logits(model, prompt, len(prompt)), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_greedy_tokens_match_transformers_generate(tiny_models, name):
    tm = tiny_models(name)
    if (tm.hf.config.rope_parameters or {}).get("rope_type") == "longrope":
        pytest.skip("LongRoPE's switch: tests/test_architectures.py generates on both sides of it")
    llm = LLM(tm.path, dtype="float32", num_gpu_blocks_override=256, block_size=16)
    prompts = [tm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, min_tokens=24), use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(tm.hf, p, 24)
    assert llm.kv_cache_stats()["num_used_blocks"] == 0


@pytest.mark.parametrize("name", ["llama_gqa_untied", "qwen2_bias_tied"])
def test_greedy_tokens_match_transformers_on_avx2_kernels(avx2_kernels, tiny_models, name):
    """The float32 oracle on the kernels a CPU without AVX-512 runs."""
    test_greedy_tokens_match_transformers_generate(tiny_models, name)


def test_bfloat16_engine_runs_on_avx2_kernels(avx2_kernels, tiny_llama):
    """bf16 storage on AVX2 (float32 arithmetic in the kernels): every linear layer goes
    through our packed GEMM, the compiled layer loop runs, and greedy tokens stay close to
    the float32 engine's."""
    llm = LLM(tiny_llama.path, dtype="bfloat16", num_gpu_blocks_override=256, block_size=16)
    model = llm.engine.runner.model
    assert model.compiled_layers is not None and isinstance(model.lm_head, PackedWeight)
    prompt = tiny_llama.tokenizer.encode(PROMPTS[0])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt[:5]}],
                           SamplingParams(temperature=0, max_tokens=8, min_tokens=8, prompt_logprobs=1),
                           use_tqdm=False)
    assert out[0].outputs[0].token_ids[:4] == hf_greedy(tiny_llama.hf, prompt, 4)
    # No step falls into torch's bf16 matmul (on such CPUs ~1.5% of its float32 rate).
    matmuls = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm"}
    assert not [e.key for e in prof.key_averages() if e.key in matmuls]


def test_auto_dtype_fits_the_cpu(avx2_kernels, monkeypatch):
    """`auto` keeps a bf16 checkpoint in bf16 only where the CPU has bf16 arithmetic; on AVX2
    it stores float32 (faster for batches, measured), and an explicit bfloat16 still runs."""
    from pagedserve.config import resolve_dtype
    from pagedserve.kernels import cpu
    assert cpu.auto_keeps_bf16() is cpu.BF16_STORAGE_WITHOUT_BF16_ARITHMETIC is False
    assert resolve_dtype("auto", torch.bfloat16, cpu.auto_keeps_bf16()) == torch.float32
    assert resolve_dtype("auto", torch.float16, cpu.auto_keeps_bf16()) == torch.float32
    assert resolve_dtype("bfloat16", torch.float32, cpu.auto_keeps_bf16()) == torch.bfloat16
    monkeypatch.setattr(cpu, "BF16_STORAGE_WITHOUT_BF16_ARITHMETIC", True)    # the one-line switch
    assert resolve_dtype("auto", torch.bfloat16, cpu.auto_keeps_bf16()) == torch.bfloat16
    if "avx512bf16" in cpu.supported_variants():
        monkeypatch.setattr(cpu, "BF16_STORAGE_WITHOUT_BF16_ARITHMETIC", False)
        with cpu.using_variant("avx512bf16"):
            assert resolve_dtype("auto", torch.bfloat16, cpu.auto_keeps_bf16()) == torch.bfloat16


def test_unknown_architecture_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        load_model(str(tmp_path), "float32", TorchAttention())


def test_bfloat16_loads_and_stays_close(tiny_llama):
    model, _, dtype = load_model(tiny_llama.path, "bfloat16", TorchAttention())
    assert dtype == torch.bfloat16 and model.embed.dtype == torch.bfloat16
    prompt = tiny_llama.tokenizer.encode(PROMPTS[0])
    with torch.no_grad():
        ref = tiny_llama.hf(torch.tensor([prompt])).logits[0]
    ours = paged_logits(model, prompt, len(prompt))
    assert (ours - ref).abs().max() < 0.1 * ref.abs().max()


@pytest.mark.parametrize("name", ["llama_head64", "qwen2_bias_tied", "llama3_rope", "qwen3_untied", "phi3_longrope",
                                  "smollm3_nope", "granite_multipliers"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_layers_equal_the_layer_by_layer_path(kernel_variant, tiny_models, name, dtype):
    """On CPU all decoder layers run as one compiled call (kernels.cpu.DecoderLayers); it must
    give bit for bit what the Python loop over the same kernels gives, and match transformers."""
    tm = tiny_models(name)
    model, _, _ = load_model(tm.path, dtype, CpuAttention(), ops=CpuOps())
    model.pack_linear_weights()
    compiled = model.compiled_layers
    if compiled is None:
        pytest.skip("no compiled kernels for this CPU and dtype")
    prompt = tm.tokenizer.encode(PROMPTS[5])
    for chunk in (len(prompt), 5, 1):   # prefill, chunked prefill, decode
        model.compiled_layers = compiled
        fused = paged_logits(model, prompt, chunk, block=16)
        model.compiled_layers = None
        layer_by_layer = paged_logits(model, prompt, chunk, block=16)
        torch.testing.assert_close(fused, layer_by_layer, atol=0, rtol=0)
    if dtype == "float32":
        with torch.no_grad():
            ref = tm.hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(fused, ref, atol=1e-4, rtol=1e-4)
