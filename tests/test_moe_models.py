"""Mixture-of-experts models (Mixtral, OLMoE, Qwen3-MoE with a dense layer) against transformers float32 on tiny random
configs (8 experts, top-2): greedy tokens and prompt logprobs, from HF safetensors and from a GGUF
file with llama.cpp's stacked expert tensors; quantized experts (Q8_0, Q4_0) computed in their
blocks from slices of the 3-D tensors' bytes, memory-mapped (no dequantized copy); a decode step
reads only its top-k experts; decode batches, prefill chunks, speculative decoding and the 8-bit
KV cache run them."""
from __future__ import annotations

import os

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.kernels import quant
from pagedserve.models.moe import count_expert_reads
from pagedserve.models.quantized import model_weight_bytes
from tests.conftest import hf_greedy
from tests.gpt_oss_utils import tiny_gpt_oss
from tests.moe_utils import (MOE_VARIANTS, assert_compiled_loop_equals_python_loop, make_tiny_moe, oracle_model,
                             write_moe_gguf)
from tests.q8_oracle import integer_path_modules, q8_inputs

PROMPTS = ["The quick brown fox jumps", "Paged attention stores keys", "Once upon a time there was a tiny"]
NEW = 8


@pytest.fixture(scope="module")
def moe_models(tiny_tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_moe")
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            cache[name] = make_tiny_moe(root, name, tiny_tokenizer)
        return cache[name]
    return get


def _model_of(llm: LLM):
    return llm.engine.executor.worker.runner.model


def _check(llm: LLM, hf, tok, exact_tokens: bool = True, margin: float = 1e-3, atol: float = 1e-4) -> None:
    """Greedy tokens of a batch of prompts (decode batches, prefill chunks) as transformers' (or
    each within `margin` of the oracle's maximum, teacher-forced), prompt logprobs within atol."""
    params = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outs:
        ids, gen = out.prompt_token_ids, list(out.outputs[0].token_ids)
        if exact_tokens:
            assert gen == hf_greedy(hf, ids, NEW), out.prompt
        with torch.no_grad():
            logits = hf(torch.tensor([ids + gen])).logits[0].float()
        for i, t in enumerate(gen):
            row = logits[len(ids) + i - 1].clone()
            row[tok.eos_token_id] = float("-inf")        # banned by min_tokens, as in transformers' generate
            assert row.max() - row[t] <= margin, (out.prompt, i, float(row.max() - row[t]))
    ids = tok.encode(PROMPTS[2] + " model that liked to count")
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ours = torch.tensor([out.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i > 0])
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)[torch.arange(len(ids) - 1), ids[1:]]
    assert (ours - ref).abs().max() <= atol, float((ours - ref).abs().max())


@pytest.mark.parametrize("name", sorted(MOE_VARIANTS))
def test_hf_checkpoint_matches_transformers(moe_models, name):
    tm = moe_models(name)
    # chunks of 5 tokens: prompts in several prefill chunks beside other sequences' decodes
    llm = LLM(tm.path, dtype="float32", num_gpu_blocks_override=64, max_num_batched_tokens=16, max_num_seqs=4)
    model = _model_of(llm)
    spec = llm.engine.model_args.moe
    assert [w.moe is not None for w in model.layers] == [spec.is_sparse(i) for i in range(len(model.layers))]
    assert any(w.moe is not None for w in model.layers)
    assert model.compiled_layers is None         # the Python layer loop runs MoE layers
    _check(llm, tm.hf, tm.tokenizer)


@pytest.mark.parametrize("name", sorted(MOE_VARIANTS))
def test_gguf_with_stacked_experts_matches_transformers(moe_models, name, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    tm = moe_models(name)
    path = tmp_path / f"{name}.gguf"
    write_moe_gguf(tm, path)
    llm = LLM(str(path), tokenizer=tm.path, dtype="float32", num_gpu_blocks_override=64)
    assert llm.engine.model_args.architecture == type(tm.hf).__name__
    _check(llm, tm.hf, tm.tokenizer)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("name", sorted(MOE_VARIANTS))
def test_quantized_experts_run_in_their_blocks(moe_models, name, qtype, tmp_path):
    import gguf
    tm = moe_models(name)
    path = tmp_path / f"{name}-{qtype}.gguf"
    oracle = oracle_model(tm, write_moe_gguf(tm, path, gguf.GGMLQuantizationType[qtype]))
    llm = LLM(str(path), tokenizer=tm.path, dtype="float32", num_gpu_blocks_override=64)
    model = _model_of(llm)
    for w in model.layers:          # each expert: quantized slices of one buffer per projection
        if w.moe is None:
            continue
        gates = [e.gate_up[0] for e in w.moe.experts]
        assert all(isinstance(g, quant.QuantizedWeight) and g.qtype.startswith(qtype.lower()) for g in gates)
        starts = [g.data.data_ptr() for g in gates]
        assert starts == [starts[0] + i * gates[0].nbytes for i in range(len(gates))]
    size = os.path.getsize(path)
    assert 0.8 * size <= model_weight_bytes(model) <= 1.02 * size, (model_weight_bytes(model), size)
    # the integer path quantizes activations to 8 bits: tokens within a margin of the oracle's (as
    # tests/test_quantized_models.py allows dense layers). Where the attention and LM head run on it in
    # every step, prefills too (r8 layouts on the 256-bit variants), the oracle's see the same 8-bit
    # inputs (tests/q8_oracle.py): with float ones, the prefill's 8-bit rounding moved this tiny random
    # model's routing past the margin (olmoe Q8_0). The experts' inputs stay float in the oracle.
    with q8_inputs(oracle, integer_path_modules(model)):
        _check(llm, oracle, tm.tokenizer, exact_tokens=False, margin=0.15, atol=0.15)


@pytest.mark.parametrize("name,dtype", [("olmoe", "float32"), ("qwen3_moe", "float32"), ("mixtral", "bfloat16")])
def test_the_compiled_loop_runs_quantized_experts_as_the_python_loop(moe_models, name, dtype, tmp_path):
    """GGUF experts in Q8_0 (r8 layouts on the 256-bit variants): the compiled layer loop (MoE block,
    OLMoE's all-head q/k norms and clip_qkv in C++) gives the Python loop's tokens and logprobs."""
    import gguf
    from pagedserve.kernels import moe as moe_kernels
    if not moe_kernels.runs_here():
        pytest.skip("quant_moe_experts does not run in this build")
    tm = moe_models(name)
    path = tmp_path / f"{name}-Q8_0.gguf"
    write_moe_gguf(tm, path, gguf.GGMLQuantizationType.Q8_0)
    llm = LLM(str(path), tokenizer=tm.path, dtype=dtype, num_gpu_blocks_override=64)
    model = _model_of(llm)
    assert model.compiled_layers is not None
    params = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, logprobs=0)
    assert_compiled_loop_equals_python_loop(llm, model, PROMPTS, params, dtype)


def test_a_decode_step_reads_only_its_top_k_experts(moe_models):
    tm = moe_models("olmoe")
    llm = LLM(tm.path, dtype="float32", num_gpu_blocks_override=64)
    model = _model_of(llm)
    ids = tm.tokenizer.encode(PROMPTS[0])
    with count_expert_reads() as reads:
        llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    k, layers = llm.engine.model_args.moe.top_k, len(model.layers)
    prefill, decodes = reads.calls[:layers], reads.calls[layers:]
    assert len(decodes) == 2 * layers
    for call in decodes:                         # one token: its k experts, one row each
        assert len(call) == k and all(rows == 1 for (_, _, rows) in call)
    assert all(sum(rows for (_, _, rows) in call) == k * len(ids) for call in prefill)


def test_speculative_decoding_and_8bit_kv(moe_models):
    tm = moe_models("mixtral")
    plain = LLM(tm.path, dtype="float32", num_gpu_blocks_override=64)
    spec = LLM(tm.path, dtype="float32", num_gpu_blocks_override=64,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    prompts = ["one two three one two three one two", PROMPTS[1]]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == want
    kv8 = LLM(tm.path, dtype="float32", num_gpu_blocks_override=64, kv_cache_dtype="int8")
    # 8-bit K/V moves the hidden states a little, and a router's near-tie may then pick another
    # expert: looser than the dense models' bound, far below what a broken cache gives (nats)
    _check(kv8, tm.hf, tm.tokenizer, exact_tokens=False, margin=0.3, atol=0.3)


def test_tensor_parallel_ranks_split_every_expert(moe_models):
    """Two ranks, each holding half of every expert's FFN: transformers' greedy tokens, one
    process's logprobs. OLMoE (q/k norms over all heads) is refused by name."""
    tm = moe_models("mixtral")
    params = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, logprobs=2)
    prompts = PROMPTS[:2]
    one = LLM(tm.path, dtype="float32", num_gpu_blocks_override=64).generate(prompts, params, use_tqdm=False)
    llm = LLM(tm.path, dtype="float32", num_gpu_blocks_override=64, tensor_parallel_size=2)
    try:
        for out, ref in zip(llm.generate(prompts, params, use_tqdm=False), one):
            assert list(out.outputs[0].token_ids) == hf_greedy(tm.hf, out.prompt_token_ids, NEW)
            for a, b in zip(ref.outputs[0].logprobs, out.outputs[0].logprobs):
                assert a.keys() == b.keys()
                assert [b[t].logprob for t in a] == pytest.approx([a[t].logprob for t in a], abs=1e-4)
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="q/k norms are over all heads"):
        LLM(moe_models("olmoe").path, dtype="float32", tensor_parallel_size=2)


def test_lora_on_attention_only(moe_models, tmp_path):
    """An adapter on the attention projections gives PEFT's tokens; one on an expert is refused
    by name (experts and routers are never adapted)."""
    import json
    import shutil

    from safetensors.torch import save_file

    from pagedserve import LoRARequest
    from pagedserve.errors import InvalidRequestError
    from tests.lora_utils import make_adapter, oracle_greedy
    tm = moe_models("olmoe")
    peft = make_adapter(tm.hf, tmp_path / "attn", 3, rank=4, targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    llm = LLM(tm.path, dtype="float32", num_gpu_blocks_override=64, enable_lora=True, max_lora_rank=4)
    ids = tm.tokenizer.encode(PROMPTS[1])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False,
                       lora_request=LoRARequest("attn", 1, str(tmp_path / "attn")))[0]
    want = oracle_greedy(peft, ids, 6)
    assert list(out.outputs[0].token_ids) == want and want != oracle_greedy(tm.hf, ids, 6)
    expert = tmp_path / "expert"
    shutil.copytree(tmp_path / "attn", expert)
    cfg = json.loads((expert / "adapter_config.json").read_text())
    (expert / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["gate_proj"]}))
    key = "base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_{}.weight"
    save_file({key.format("A"): torch.zeros(4, 64), key.format("B"): torch.zeros(32, 4)},
              str(expert / "adapter_model.safetensors"))
    with pytest.raises(InvalidRequestError, match="mixture-of-experts block"):
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False,
                     lora_request=LoRARequest("expert", 2, str(expert)))


def test_the_start_log_says_weights_resident_and_read_per_token(moe_models, caplog):
    from pagedserve.models.quantized import model_read_bytes_per_token
    tm = moe_models("qwen3_moe")
    with caplog.at_level("INFO", logger="pagedserve.worker.worker"):
        llm = LLM(tm.path, dtype="float32", num_gpu_blocks_override=64)
    model = _model_of(llm)
    cfg = tm.hf.config
    h, e, k, f = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    # layer 1 is sparse: a token reads k of its e experts (3 h f float32 numbers each)
    unread = (e - k) * 3 * h * f * 4
    # (and the embedding table: a token reads one row of it)
    assert model_weight_bytes(model) - model_read_bytes_per_token(model) == unread + model.embed.numel() * 4
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("weights:"))
    assert f"read per token: {model_read_bytes_per_token(model) / 2**20:.1f} MiB ({k} of {e} experts)" in line


@pytest.mark.parametrize("name", sorted(MOE_VARIANTS))
def test_dummy_weights_of_an_moe_config(moe_models, name):
    """load_format='dummy' draws every expert of the config's shapes (a timing run of a model not here)."""
    tm = moe_models(name)
    llm = LLM(tm.path, load_format="dummy", dtype="float32", num_gpu_blocks_override=64)
    model = _model_of(llm)
    spec = llm.engine.model_args.moe
    assert [w.moe is not None and len(w.moe.experts) == spec.num_experts for w in model.layers] == \
        [spec.is_sparse(i) for i in range(len(model.layers))]
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize("backend", [None, "triton"])
def test_gpt_oss_matches_transformers(tiny_tokenizer, tmp_path, backend):
    """gpt-oss (4 experts, top-2 of the logits then softmax, clamped SwiGLU with biases, sinks, a
    sliding-window and a full layer): greedy tokens and prompt logprobs as transformers'; the
    same through the Triton kernels' window and sinks (interpreted on a CPU)."""
    hf = tiny_gpt_oss(tiny_tokenizer, tmp_path / "gpt-oss")
    device = "cuda" if torch.cuda.is_available() and backend == "triton" else "cpu"
    llm = LLM(str(tmp_path / "gpt-oss"), dtype="float32", num_gpu_blocks_override=64, attention_backend=backend,
              device=device)
    args = llm.engine.model_args
    assert args.moe.scoring == "topk_softmax" and args.attention_sinks and args.layer_windows == (4, None)
    assert llm.engine.runner.model.attention.name == (backend or "cpu")
    _check(llm, hf, tiny_tokenizer)


def _mxfp4_hf(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[E, out, in] float -> gpt-oss's (blocks [E, out, in / 32, 16], scales [E, out, in / 32]) as
    the gguf package quantizes it, and the numbers they hold."""
    import gguf
    e, out, cols = w.shape
    raw = gguf.quants.quantize(w.reshape(-1, cols).numpy(), gguf.GGMLQuantizationType.MXFP4)
    blocks = torch.from_numpy(raw.copy()).view(e, out, cols // 32, 17)
    qs = blocks[..., 1:].to(torch.int64)
    codes = torch.cat([qs & 15, qs >> 4], dim=-1)                    # element order
    hf_blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    from pagedserve import mxfp4
    return hf_blocks, blocks[..., 0].contiguous(), mxfp4.dequantize_hf(hf_blocks, blocks[..., 0].contiguous())


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tiny_tokenizer, tmp_path_factory):
    """A gpt-oss checkpoint whose experts are MXFP4 (`*_blocks`, `*_scales`), and transformers
    over the numbers the blocks hold."""
    from safetensors.torch import load_file, save_file
    root = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    hf = tiny_gpt_oss(tiny_tokenizer, root)
    state = load_file(str(root / "model.safetensors"))
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales, values = _mxfp4_hf(state.pop(key).float().transpose(1, 2).contiguous())
        state[key + "_blocks"], state[key + "_scales"] = blocks, scales
        with torch.no_grad():
            hf.get_parameter(key.removeprefix("model.") if key.startswith("lm_head") else key).copy_(
                values.transpose(1, 2))
    save_file(state, str(root / "model.safetensors"))
    return root, hf


def _experts_of(llm: LLM) -> list:
    return [e.gate_up for layer in _model_of(llm).layers for e in layer.moe.experts] + \
        [e.down for layer in _model_of(llm).layers for e in layer.moe.experts]


def test_gpt_oss_mxfp4_experts_exact_in_their_blocks(gpt_oss_mxfp4, tiny_tokenizer, monkeypatch):
    """The experts stay MXFP4 in memory; through plain torch ops (their blocks dequantized exactly
    per product) the same tokens and logprobs as transformers over the blocks' numbers."""
    from pagedserve.models.ops import TorchOps
    from pagedserve.worker import worker
    monkeypatch.setattr(worker, "make_ops", lambda device, attention=None: TorchOps())
    root, hf = gpt_oss_mxfp4
    llm = LLM(str(root), dtype="float32", num_gpu_blocks_override=64)
    assert {(w.qtype, type(w).__name__) for w in _experts_of(llm)} == {("mxfp4", "QuantizedWeight")}
    _check(llm, hf, tiny_tokenizer)


def test_gpt_oss_mxfp4_experts_on_the_mxfp4_kernels(gpt_oss_mxfp4, tiny_tokenizer):
    """The CPU ops' MXFP4 kernels (csrc/quant/mxfp4.h: q8 activations, integer dots): transformers'
    greedy tokens; prompt logprobs within the 8-bit activations' error; the experts resident in
    MXFP4 (17 bytes per 32 weights, not 4 bytes a weight; mxfp4r8 on avx2 / avxvnni: dot_mxfp4_r8_256.h)."""
    root, hf = gpt_oss_mxfp4
    llm = LLM(str(root), dtype="float32", num_gpu_blocks_override=64)
    experts = _experts_of(llm)
    # (the 256-bit variants repack them at load: 8 rows interleaved, the same bytes)
    assert {w.qtype for w in experts} == {"mxfp4r8" if quant.variant() in quant.EXPERT_R8_VARIANTS else "mxfp4"}
    assert sum(w.nbytes for w in experts) == sum(w.shape[0] * w.shape[1] // 32 * 17 for w in experts)
    _check(llm, hf, tiny_tokenizer, atol=0.1)


def test_a_checkpoint_without_its_experts_is_refused_by_name(moe_models):
    from pagedserve.models.loader import DictSource, MatrixBuilder
    from pagedserve.models.moe_weights import build_moe
    tm = moe_models("olmoe")
    args = LLM(tm.path, dtype="float32", num_gpu_blocks_override=64).engine.model_args
    source = DictSource({"layers.0.mlp.gate.weight": torch.zeros(8, 64)})
    with pytest.raises(ValueError, match="no experts in the checkpoint.*ffn_\\*_exps"):
        build_moe(MatrixBuilder(source, torch.float32, None), source, 0, args.moe)
