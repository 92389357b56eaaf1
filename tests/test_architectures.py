"""The architectures of models/architectures.py as llama.cpp writes their GGUF files: each tiny
random model (tests/conftest.py VARIANTS, where its HF directory is checked against transformers
in tests/test_models.py) written with llama.cpp's tensor names and metadata keys generates what
transformers generates; in native Q8_0 blocks it may leave the oracle's argmax only at near-ties."""
from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.models import architectures
from pagedserve.quant_format import REPACKED
from tests.conftest import PROMPTS, hf_greedy
from tests.gguf_utils import add_tokenizer, write_hf_model

gguf = pytest.importorskip("gguf")

TEXT = "Keys and values are stored in blocks of the cache. Continuous batching schedules"
# Native Q8_0 (8-bit activations) against float32 on the same weights: a generated token may
# leave the oracle's argmax only where the top logit is within MARGIN of it (tests/test_quantized_models.py).
MARGIN = 0.15
LOGPROB_ATOL = 0.15


def _qwen3_header(w, cfg) -> None:
    w.add_key_length(cfg.head_dim)          # the converter writes a config's head_dim
    w.add_value_length(cfg.head_dim)


def _llama_header(w, cfg) -> None:
    w.add_rope_dimension_count(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def _llama3_rope_freqs(cfg) -> dict:
    """Llama 3's RoPE scaling as llama.cpp's converter stores it: a rope_freqs tensor holding each
    frequency's divisor (1 for short wavelengths, `factor` for long ones, smoothed between)."""
    import math
    rope = cfg.rope_parameters
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    dim = cfg.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    divisors = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            divisors.append(1.0)
        elif wavelen > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return {"rope_freqs.weight": divisors}


def _qwen3_yarn_header(w, cfg) -> None:
    """As llama.cpp's converter writes a config's YaRN (the keys it has; no attention factor here)."""
    _qwen3_header(w, cfg)
    rope = cfg.rope_parameters
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


def _phi3_header(w, cfg) -> None:
    """As llama.cpp's Phi-3 converter: the rotary dimensions, the original context, LongRoPE's
    attention factor, sliding_window 0 for none."""
    import math
    rope = cfg.rope_parameters
    w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * cfg.hidden_size) // cfg.num_attention_heads)
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    scale = cfg.max_position_embeddings / rope["original_max_position_embeddings"]
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(rope["original_max_position_embeddings"])))
    w.add_sliding_window(cfg.sliding_window or 0)


def _phi3_tensors(name: str, a):
    """Phi-3's fused tensors keep their HF layout under llama.cpp's names (ffn_up: gate and up)."""
    layer = name.removeprefix("model.").split(".")
    if name.endswith("self_attn.qkv_proj.weight"):
        return [(f"blk.{layer[1]}.attn_qkv.weight", a)]
    if name.endswith("mlp.gate_up_proj.weight"):
        return [(f"blk.{layer[1]}.ffn_up.weight", a)]
    return None


def _phi3_rope_factors(cfg) -> dict:
    rope = cfg.rope_parameters
    return {"rope_factors_long.weight": rope["long_factor"], "rope_factors_short.weight": rope["short_factor"]}


# variant -> how llama.cpp's converter writes it: (GGUF architecture, write_hf_model keywords)
GGUF_WRITERS = {
    "qwen3_untied": ("qwen3", dict(header=_qwen3_header)),
    "qwen3_tied": ("qwen3", dict(header=_qwen3_header)),
    "qwen3_yarn": ("qwen3", dict(header=_qwen3_yarn_header)),
    # Llama 3.1 / 3.2 / 3.3 files: q/k rows permuted, the scaling as a rope_freqs tensor.
    "llama3_rope": ("llama", dict(header=_llama_header, permute_qk=True)),
    "phi3_longrope": ("phi3", dict(header=_phi3_header, rename=_phi3_tensors)),
    # llama.cpp converts both as Llama (q/k rows permuted); SmolLM3's NoPE layers are its constant
    "smollm3_nope": ("smollm3", dict(header=_llama_header, permute_qk=True)),
    "granite_multipliers": ("granite", dict(header=lambda w, cfg: (
        _llama_header(w, cfg), w.add_attention_scale(cfg.attention_multiplier),
        w.add_embedding_scale(cfg.embedding_multiplier), w.add_residual_scale(cfg.residual_multiplier),
        w.add_logit_scale(cfg.logits_scaling)), permute_qk=True)),
}
EXTRA_TENSORS = {"llama3_rope": _llama3_rope_freqs, "phi3_longrope": _phi3_rope_factors}
# LongRoPE's long factors, chosen by a context past its original 32 tokens, are transformers' for
# sequences past that length: prompts longer than it.
LONG_PROMPTS = [PROMPTS[5], PROMPTS[5] + " " + PROMPTS[2], PROMPTS[2] + " " + PROMPTS[5]]


def _prompts(name: str) -> list[str]:
    return LONG_PROMPTS if name == "phi3_longrope" else PROMPTS[:3]


def _write(tm, name: str, path, qtype=None) -> dict:
    """Variant `name` written as llama.cpp writes its architecture (write_hf_model)."""
    arch, kwargs = GGUF_WRITERS[name]
    extra = EXTRA_TENSORS[name](tm.hf.config) if name in EXTRA_TENSORS else None
    return write_hf_model(tm.hf, path, arch, qtype=qtype, extra_tensors=extra, **kwargs)


def _oracle(tm, state: dict) -> torch.nn.Module:
    """The variant's transformers model with the weights as the file holds them."""
    hf = type(tm.hf)(tm.hf.config).float().eval()
    missing, _ = hf.load_state_dict(state, strict=False)
    assert all(n == "lm_head.weight" for n in missing), missing
    if tm.hf.config.tie_word_embeddings:
        hf.tie_weights()
    return hf


def _prompt_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return torch.tensor([out.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i > 0])


def _reference_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return ref[torch.arange(len(ids) - 1), ids[1:]]


@pytest.mark.parametrize("name", sorted(GGUF_WRITERS))
def test_gguf_as_llama_cpp_writes_it_matches_transformers(tiny_models, tmp_path, name):
    tm = tiny_models(name)
    arch, kwargs = GGUF_WRITERS[name]
    path = tmp_path / f"{name}.gguf"
    _write(tm, name, path)
    llm = LLM(str(path), tokenizer=tm.path, dtype="float32", num_gpu_blocks_override=64)
    assert llm.engine.model_args.architecture == architectures.by_gguf_name(arch).hf_architectures[0]
    for prompt in _prompts(name):
        ids = tm.tokenizer.encode(prompt)
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8, min_tokens=8),
                           use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(tm.hf, ids, 8), prompt
    ids = tm.tokenizer.encode(_prompts(name)[1] if name == "phi3_longrope" else TEXT)
    torch.testing.assert_close(_prompt_logprobs(llm, ids), _reference_logprobs(tm.hf, ids), atol=1e-4, rtol=1e-4)


def _phi3_split_qkv(cfg):
    """A Phi-3 file with attn_q / attn_k / attn_v instead of the fused attn_qkv (llama.cpp reads
    either): qkv_proj's rows cut at q_size and q_size + kv_size, the rest as _phi3_tensors."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim

    def rename(name: str, a):
        if name.endswith("self_attn.qkv_proj.weight"):
            i = name.removeprefix("model.").split(".")[1]
            return [(f"blk.{i}.attn_{n}.weight", part) for n, part in zip("qkv", (a[:q], a[q:q + kv], a[q + kv:]))]
        return _phi3_tensors(name, a)
    return rename


@pytest.mark.parametrize("qtype", [None, gguf.GGMLQuantizationType.Q8_0])
def test_phi3_gguf_with_separate_q_k_v_matches_transformers(tiny_models, tmp_path, qtype):
    """Phi-3 GGUF files whose attention holds attn_q, attn_k and attn_v (no attn_qkv): float32
    equals transformers' greedy tokens and prompt logprobs; Q8_0 leaves it only at near ties."""
    tm = tiny_models("phi3_longrope")
    cfg = tm.hf.config
    path = tmp_path / "phi3-split.gguf"
    state = write_hf_model(tm.hf, path, "phi3", header=_phi3_header, rename=_phi3_split_qkv(cfg), qtype=qtype,
                           extra_tensors=_phi3_rope_factors(cfg))
    assert {"blk.0.attn_q.weight", "blk.0.attn_v.weight"} <= {t.name for t in gguf.GGUFReader(path).tensors}
    llm = LLM(str(path), tokenizer=tm.path, dtype="float32", num_gpu_blocks_override=64)
    if qtype is not None:
        _check_near_ties(llm, _oracle(tm, state), tm, _prompts("phi3_longrope"), LONG_PROMPTS[1])
        return
    for prompt in _prompts("phi3_longrope"):
        ids = tm.tokenizer.encode(prompt)
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8, min_tokens=8),
                           use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(tm.hf, ids, 8), prompt
    ids = tm.tokenizer.encode(LONG_PROMPTS[1])
    torch.testing.assert_close(_prompt_logprobs(llm, ids), _reference_logprobs(tm.hf, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["qwen3_untied", "phi3_longrope", "smollm3_nope", "granite_multipliers"])
def test_native_q8_0_leaves_the_oracle_only_at_near_ties(tiny_models, tmp_path, name):
    """Q8_0 blocks run by the native kernels: each greedy token is the argmax of transformers on
    the file's (dequantized) weights up to MARGIN, prompt logprobs within LOGPROB_ATOL."""
    tm = tiny_models(name)
    path = tmp_path / f"{name}-q8_0.gguf"
    oracle = _oracle(tm, _write(tm, name, path, qtype=gguf.GGMLQuantizationType.Q8_0))
    llm = LLM(str(path), tokenizer=tm.path, dtype="float32", num_gpu_blocks_override=64)
    model = llm.engine.executor.worker.runner.model
    layer = model.layers[0]     # (q8_0, or its r8 layout where the loader repacks it)
    assert all(REPACKED.get(getattr(layer, n).qtype, "q8_0") == "q8_0" for n in ("qkv", "o", "gate_up", "down"))
    _check_near_ties(llm, oracle, tm, _prompts(name), _prompts(name)[1] if name == "phi3_longrope" else TEXT)


def _check_near_ties(llm: LLM, oracle, tm, prompts: list[str], text: str, max_tokens: int = 12) -> None:
    """Each greedy token is the oracle's argmax up to MARGIN; `text`'s prompt logprobs within LOGPROB_ATOL."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens)
    for out in llm.generate([{"prompt_token_ids": tm.tokenizer.encode(p)} for p in prompts], params, use_tqdm=False):
        ids, gen = out.prompt_token_ids, list(out.outputs[0].token_ids)
        with torch.no_grad():
            logits = oracle(torch.tensor([ids + gen])).logits[0].float()
        for i, t in enumerate(gen):
            row = logits[len(ids) + i - 1]
            assert row.max() - row[t] <= MARGIN, (i, float(row.max() - row[t]))
    ids = tm.tokenizer.encode(text)
    assert (_prompt_logprobs(llm, ids) - _reference_logprobs(oracle, ids)).abs().max() <= LOGPROB_ATOL


@pytest.mark.parametrize("name", ["phi3_longrope", "granite_multipliers"])
def test_quantize_at_load_leaves_the_oracle_only_at_near_ties(tiny_models, name):
    """An HF model quantized at load (q8_0; Phi-3's fused matrices whole): near-ties only against
    transformers on the quantized weights (the LM head at q8_0 too)."""
    from pagedserve.kernels import quant
    tm = tiny_models(name)
    llm = LLM(tm.path, dtype="float32", quantization="q8_0", num_gpu_blocks_override=64, max_model_len=32)
    assert quant.REPACKED.get(llm.engine.executor.worker.runner.model.layers[0].qkv.qtype, "q8_0") == "q8_0"
    state = {n: (quant.dequantize(quant.quantize(t.float(), "q8_0"), torch.float32)
                 if t.dim() == 2 and "embed_tokens" not in n else t.float()).clone()
             for n, t in tm.hf.state_dict().items()}
    _check_near_ties(llm, _oracle(tm, state), tm, PROMPTS[:3], PROMPTS[3], max_tokens=8)


def test_speculative_decoding_and_an_8_bit_kv_cache_run_the_architecture(tiny_models):
    """Qwen3 with n-gram drafts: exactly the tokens without them (float32); with an int8 KV
    cache, near-ties only against transformers."""
    tm = tiny_models("qwen3_untied")
    prompts = [tm.tokenizer.encode(p + " " + p) for p in PROMPTS[:3]]     # repeats: the n-grams find drafts
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    spec = LLM(tm.path, dtype="float32", num_gpu_blocks_override=64,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    outs = spec.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(tm.hf, p, 12) for p in prompts]
    assert spec.kv_cache_stats()["spec_decode_num_draft_tokens"] > 0
    kv8 = LLM(tm.path, dtype="float32", num_gpu_blocks_override=64, kv_cache_dtype="int8")
    _check_near_ties(kv8, tm.hf, tm, PROMPTS[:3], TEXT)


def test_every_architecture_is_found_by_its_names():
    for a in architectures.ARCHITECTURES:
        for n in a.hf_architectures + a.model_types:
            assert architectures.by_hf_name(n) is a
        if a.gguf_architecture:
            assert architectures.by_gguf_name(a.gguf_architecture) is a
    assert architectures.by_hf_name("GPT2LMHeadModel") is None


def test_longrope_takes_the_short_factors_in_a_context_within_the_original(tiny_models):
    """An engine whose context is at most LongRoPE's original length (32) runs the short factors:
    transformers' tokens for every sequence, which stays below the switch."""
    tm = tiny_models("phi3_longrope")
    short = LLM(tm.path, dtype="float32", num_gpu_blocks_override=64, max_model_len=32)
    long = LLM(tm.path, dtype="float32", num_gpu_blocks_override=64)
    prompts = [tm.tokenizer.encode(p) for p in PROMPTS[:4]]
    assert all(len(p) + 8 <= 32 for p in prompts)
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    outs = short.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(tm.hf, p, 8) for p in prompts]
    # and the long factors where the context is longer (not transformers' below the switch)
    assert [o.outputs[0].token_ids for o in long.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)] != [o.outputs[0].token_ids for o in outs]
    ids = tm.tokenizer.encode(LONG_PROMPTS[1])
    assert len(ids) > 32
    torch.testing.assert_close(_prompt_logprobs(long, ids), _reference_logprobs(tm.hf, ids), atol=1e-4, rtol=1e-4)


# A chat template in Qwen3's manner (written for this test): tools listed in the system turn, and
# with enable_thinking false an empty think block closed in the prompt.
QWEN3_STYLE_TEMPLATE = (
    "{% if tools %}<|system|>Tools:{% for t in tools %} {{ t.function.name }}{% endfor %};\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_the_gguf_chat_template_renders_tools_and_enable_thinking(tiny_models, tmp_path):
    """A GGUF file's tokenizer.chat_template is the chat template (no tokenizer directory given),
    with the request's tools and chat_template_kwargs (Qwen3's enable_thinking)."""
    tm = tiny_models("qwen3_tied")
    path = tmp_path / "qwen3-chat.gguf"
    write_hf_model(tm.hf, path, "qwen3", header=lambda w, cfg: (_qwen3_header(w, cfg), add_tokenizer(
        w, tm.tokenizer, QWEN3_STYLE_TEMPLATE)))
    llm = LLM(str(path), dtype="float32", num_gpu_blocks_override=64)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    params = SamplingParams(temperature=0, max_tokens=2)
    messages = [{"role": "user", "content": "Keys and values"}]
    for kwargs, thinks in ((None, False), ({"enable_thinking": False}, True)):
        out = llm.chat(messages, params, use_tqdm=False, tools=tools, chat_template_kwargs=kwargs)[0]
        prompt = llm.get_tokenizer().decode(out.prompt_token_ids)
        assert prompt.startswith("<|system|>Tools: get_weather;\n<|user|>Keys and values\n<|assistant|>"), prompt
        assert prompt.endswith("<think>\n\n</think>\n\n") == thinks, prompt
    assert out.prompt_token_ids == tm.tokenizer.encode(prompt)      # the file's tokenizer is the model's


@pytest.mark.parametrize("name, targets", [
    ("qwen3_untied", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ("phi3_longrope", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),     # Phi-3's fused modules
])
def test_lora_over_the_architecture_equals_peft(tiny_models, tmp_path, name, targets):
    """A PEFT adapter of the architecture's own module names: greedy tokens equal peft's (float32)."""
    from pagedserve import LoRARequest
    from tests.lora_utils import make_adapter, oracle_greedy
    tm = tiny_models(name)
    oracle = make_adapter(tm.hf, tmp_path / "adapter", seed=5, rank=4, alpha=8, targets=targets)
    # (LongRoPE: a context within its original length keeps transformers' short factors)
    llm = LLM(tm.path, dtype="float32", num_gpu_blocks_override=64, enable_lora=True, max_lora_rank=8,
              max_model_len=32)
    prompts = [tm.tokenizer.encode(p) for p in PROMPTS[:3]]
    lora = LoRARequest("a", 1, str(tmp_path / "adapter"))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False,
                        lora_request=lora)
    want = [oracle_greedy(oracle, p, 8) for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == want
    assert want != [oracle_greedy(tm.hf, p, 8) for p in prompts], "the adapter must change the tokens"


@pytest.mark.parametrize("name", ["phi3_longrope"])
def test_tensor_parallel_splits_the_architecture(tiny_models, name):
    """Two ranks: each reads its heads' rows of q/k/v (Phi-3: of the fused qkv_proj) and its part
    of gate/up (of gate_up_proj), with its q/k norms; greedy tokens as transformers'."""
    tm = tiny_models(name)
    llm = LLM(tm.path, dtype="float32", tensor_parallel_size=2, num_gpu_blocks_override=64, max_model_len=32)
    try:
        prompts = [tm.tokenizer.encode(p) for p in PROMPTS[:3]]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=8, min_tokens=8), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(tm.hf, p, 8) for p in prompts]
        assert llm.engine.runner.model.args.num_heads == tm.hf.config.num_attention_heads // 2
    finally:
        llm.shutdown()


def test_phi3_sliding_window_matches_transformers(tiny_root, tiny_tokenizer):
    """Phi-3-mini-4k's sliding window rides the window KV groups (kv/groups.py) as Mistral's does:
    prompts several windows long give transformers' tokens and logprobs."""
    import transformers
    from tests.conftest import CORPUS
    tok = tiny_tokenizer
    config = transformers.Phi3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.75,
                                     sliding_window=16, max_position_embeddings=512, rms_norm_eps=1e-5,
                                     initializer_range=0.1, bos_token_id=tok.bos_token_id,
                                     eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    torch.manual_seed(47)
    hf = transformers.Phi3ForCausalLM(config).float().eval()
    path = tiny_root / "phi3_window"
    hf.save_pretrained(path)
    tok.save_pretrained(path)
    llm = LLM(str(path), dtype="float32", block_size=4, num_gpu_blocks_override=256)
    assert llm.engine.model_args.windows() == [16, 16]
    ids = tok.encode(" ".join(CORPUS[:7]))[:80]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=10, min_tokens=10),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, ids, 10)
    torch.testing.assert_close(_prompt_logprobs(llm, ids), _reference_logprobs(hf, ids), atol=1e-4, rtol=1e-4)


def test_embeddings_of_the_architecture(tiny_models):
    """--runner pooling over Qwen3: the last token's final hidden state, normalised, as transformers'."""
    tm = tiny_models("qwen3_untied")
    llm = LLM(tm.path, dtype="float32", runner="pooling", num_gpu_blocks_override=64)
    ids = tm.tokenizer.encode(TEXT)
    emb = torch.tensor(llm.embed({"prompt_token_ids": ids}, use_tqdm=False)[0].outputs.embedding)
    with torch.no_grad():
        last = tm.hf.model(torch.tensor([ids])).last_hidden_state[0, -1]
    torch.testing.assert_close(emb, torch.nn.functional.normalize(last, dim=-1), atol=1e-5, rtol=1e-4)
