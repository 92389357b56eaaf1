"""The 8-bit KV cache end to end: quality against transformers' float32 oracle and the 16-bit
cache, capacity by real bytes per block, the compiled layer loop, preemption (both modes),
copy-on-write (n > 1), beam search and prefix caching under the invariant checker (conftest
turns it on), the KV dtype in prefix-cache keys, tensor parallelism, the Triton refusal."""
import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.attention.selector import make_attention_backend
from pagedserve.config import EngineConfig
from pagedserve.kv.block_pool import lookup_block_keys
from pagedserve.kv.kv_cache_manager import KVCacheManager
from pagedserve.sim.shapes import ModelShape
from pagedserve.worker.model_runner import kv_cache_bytes_per_block
from tests.conftest import PROMPTS, hf_greedy
from tests.test_engine import assert_no_blocks_held, make_llm
from tests.test_preemption import BLOCK_SIZE, TIGHT_BLOCKS, host_bytes, run_mix

FORMATS = ["fp8_e4m3", "fp8_e5m2", "int8"]
# The largest logit gap between transformers' token and ours where greedy decoding may part:
# tiny random models have near-flat logits, so a 8-bit cache's rounding flips near ties; int8
# (the finest of the three) must not part at all here.
TIE_MARGIN = {"fp8_e4m3": 0.35, "fp8_e5m2": 0.4, "int8": 0.0}
# Mean |logprob - the 16-bit cache's| over a 450-token prompt (measured: e4m3 0.085, e5m2 0.18,
# int8 0.021 on llama_head64); a wrong scale or code moves them by whole units.
LOGPROB_MAD = {"fp8_e4m3": 0.15, "fp8_e5m2": 0.3, "int8": 0.05}


@pytest.fixture(scope="module")
def head64(tiny_models):
    return tiny_models("llama_head64")      # head dim 64: the vectorised decode kernels


def test_settings():
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="triton"):
        make_attention_backend("triton", torch.device("cpu"), "fp8_e4m3")


@pytest.mark.parametrize("name", FORMATS)
def test_greedy_agrees_with_transformers_but_for_near_ties(head64, name):
    tok = head64.tokenizer
    llm = make_llm(head64, kv_cache_dtype=name)
    assert llm.engine.runner.model.compiled_layers is not None      # the compiled loop over 8-bit blocks
    prompts = [tok.encode(p) for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, min_tokens=12), use_tqdm=False)
    for p, out in zip(prompts, outs):
        ours, ref = out.outputs[0].token_ids, hf_greedy(head64.hf, p, 12)
        j = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        if j is not None:       # parted: only where transformers' own logits nearly tie
            with torch.no_grad():
                logits = head64.hf(torch.tensor([p + ref[:j]])).logits[0, -1]
            assert logits[ref[j]] - logits[ours[j]] <= TIE_MARGIN[name], (name, j)
    assert_no_blocks_held(llm)


def prompt_logprobs(llm, ids):
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return torch.tensor([out.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i > 0])


@pytest.fixture(scope="module")
def long_prompt(head64):
    return head64.tokenizer.encode(" ".join(PROMPTS) * 4)[:450]


@pytest.fixture(scope="module")
def logprobs_16bit(head64, long_prompt):
    return prompt_logprobs(make_llm(head64, dtype="bfloat16", enable_prefix_caching=False), long_prompt)


@pytest.mark.parametrize("name", FORMATS)
def test_logprobs_are_close_to_the_16bit_cache(head64, long_prompt, logprobs_16bit, name):
    """bf16 model, its 16-bit cache against each 8-bit one; and the compiled layer loop
    against the Python loop of per-layer kernels over the same 8-bit cache."""
    llm = make_llm(head64, dtype="bfloat16", kv_cache_dtype=name, enable_prefix_caching=False)
    ours = prompt_logprobs(llm, long_prompt)
    assert (ours - logprobs_16bit).abs().mean() < LOGPROB_MAD[name]
    model = llm.engine.runner.model
    compiled, model.compiled_layers = model.compiled_layers, None
    assert compiled is not None
    torch.testing.assert_close(prompt_logprobs(llm, long_prompt), ours, atol=2e-2, rtol=0)


def test_same_memory_holds_twice_the_blocks(head64):
    """Blocks from the real bytes per block: 64-dim rows of 66 bytes (e4m3, int8) or 64 (e5m2)
    against 128 (bf16) and 256 (float32); the stats report the dtype and bytes per token."""
    memory = 4 * 1024**2
    blocks = {}
    for dtype, kv in [("bfloat16", "auto"), ("float32", "auto"), ("float32", "fp8"), ("bfloat16", "fp8_e5m2"),
                      ("bfloat16", "int8")]:
        llm = LLM(head64.path, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=memory)
        stats = llm.kv_cache_stats()
        blocks[dtype, kv] = stats["num_blocks"]
        a = head64.hf.config
        row = {"auto": 64 * getattr(torch, dtype).itemsize, "fp8_e5m2": 64}.get(kv, 66)     # bytes per (token, head)
        assert stats["kv_bytes_per_token"] == a.num_hidden_layers * 2 * a.num_key_value_heads * row
        assert stats["kv_cache_dtype"] == (dtype if kv == "auto" else {"fp8": "fp8_e4m3"}.get(kv, kv))
        assert stats["num_blocks"] == memory // (16 * stats["kv_bytes_per_token"])
        assert llm.engine.runner.kv_cache.untyped_storage().nbytes() <= memory
        counters = llm.kv_snapshot()["counters"]          # what the dashboard shows
        assert (counters["kv_cache_dtype"], counters["kv_bytes_per_token"]) == \
            (stats["kv_cache_dtype"], stats["kv_bytes_per_token"])
    bf16 = blocks["bfloat16", "auto"]
    assert blocks["float32", "fp8"] >= 1.9 * bf16 and blocks["bfloat16", "int8"] >= 1.9 * bf16
    assert blocks["bfloat16", "fp8_e5m2"] == 2 * bf16
    assert blocks["float32", "fp8"] >= 3.8 * blocks["float32", "auto"]
    # SmolLM2-1.7B's shape (32 KV heads x 64 dims x 24 layers): 196 KB per token in bf16.
    assert kv_cache_bytes_per_block(24, 1, 32, 64, torch.bfloat16) == 196608
    assert kv_cache_bytes_per_block(24, 1, 32, 64, torch.bfloat16, "fp8") == 101376
    # The simulator's memory model counts the same bytes.
    shape = ModelShape.preset("smollm2-135m")
    for kv in ["auto", "fp8_e4m3", "fp8_e5m2", "int8"]:
        sim = ModelShape.preset("smollm2-135m", kv_cache_dtype=kv).kv_bytes_per_token
        assert sim == kv_cache_bytes_per_block(shape.num_layers, 1, shape.num_kv_heads, shape.head_dim,
                                               torch.bfloat16, kv)


@pytest.fixture(scope="module")
def mix_prompts(tiny_llama):
    return [tiny_llama.tokenizer.encode(p) for p in PROMPTS]


@pytest.mark.parametrize("name,mode", [("fp8_e4m3", "recompute"), ("int8", "swap"), ("fp8_e5m2", "swap")])
def test_preemption_cow_beams_and_prefix_hits_change_no_output(tiny_llama, mix_prompts, name, mode):
    """run_mix (greedy, n = 2 sharing its prompt's blocks until copy-on-write, beam search;
    rounds whose prefixes hit the cache) with room, then with hundreds of preemptions: swap
    moves the 8-bit blocks (codes and scales) to host blocks of the same format and back."""
    ample = make_llm(tiny_llama, block_size=BLOCK_SIZE, num_gpu_blocks_override=2048, kv_cache_dtype=name)
    want, preempted = run_mix(ample, mix_prompts)
    assert not preempted and ample.kv_cache_stats()["prefix_cache_hits"] > 0
    kw = dict(preemption_mode=mode)
    if mode == "swap":
        kw["num_host_blocks_override"] = 64
        kw["swap_space"] = host_bytes(tiny_llama, 64) / 1024**3
    tight = make_llm(tiny_llama, block_size=BLOCK_SIZE, num_gpu_blocks_override=TIGHT_BLOCKS, kv_cache_dtype=name,
                     **kw)
    if mode == "swap":
        host = tight.engine.runner.host_cache
        assert host.dtype == torch.uint8 and host.shape[2] == 64 and host.shape[-1] == 16 + (name != "fp8_e5m2") * 2
    outs, preempted = run_mix(tight, mix_prompts)
    assert outs == want and preempted == {"g", "n", "b"}
    stats = tight.kv_cache_stats()
    assert stats["num_preemptions"] >= 50
    assert (stats["num_swapped_out_blocks"] > 0) == (mode == "swap")
    assert_no_blocks_held(tight)


def test_the_kv_dtype_is_in_prefix_cache_keys():
    """The same tokens key differently in an 8-bit and a 16-bit cache (and in two 8-bit
    formats), so blocks of one are never found by a lookup of another; auto keeps its keys."""
    tokens = list(range(40))
    keys = {kv: lookup_block_keys(tokens, 16, None, kv) for kv in ["auto", "fp8_e4m3", "fp8_e5m2", "int8"]}
    assert keys["auto"] == lookup_block_keys(tokens, 16)
    assert len({k[0] for k in keys.values()}) == 4 and len({k[1] for k in keys.values()}) == 4
    assert lookup_block_keys(tokens, 16, "salt", "int8") != keys["int8"]
    kv8 = KVCacheManager(8, 16, kv_cache_dtype="fp8_e4m3")
    kv8.admit(1, tokens, 48)
    assert kv8.allocate_slots([(1, tokens, 0, 40)]) == []
    assert set(kv8.pool.cached) == set(keys["fp8_e4m3"][:2])
    assert not set(kv8.pool.cached) & set(keys["auto"])


def test_tensor_parallel_ranks_each_hold_8bit_blocks(tiny_llama):
    """Two ranks (one KV head each), every rank's cache in int8: the tokens of one process."""
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=10)
    prompts = PROMPTS[:3]
    one = make_llm(tiny_llama, kv_cache_dtype="int8", num_gpu_blocks_override=64)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    llm = make_llm(tiny_llama, kv_cache_dtype="int8", num_gpu_blocks_override=64, tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
        stats = llm.kv_cache_stats()
        assert stats["kv_cache_dtype"] == "int8" and stats["kv_bytes_per_token"] == 2 * 2 * 1 * (16 + 2)
    finally:
        llm.shutdown()


def test_structured_output_over_an_8bit_cache(tiny_llama):
    """A regex constraint, sampled, n = 2 (the pair shares its prompt's 8-bit blocks)."""
    import re
    from pagedserve import StructuredOutputsParams
    llm = make_llm(tiny_llama, kv_cache_dtype="fp8")
    pattern = r"[a-z]{2,5}-[0-9]{2,3}"
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=16,
                            structured_outputs=StructuredOutputsParams(regex=pattern))
    out = llm.generate(["A code:"], params, use_tqdm=False)[0]
    assert len(out.outputs) == 2 and all(re.fullmatch(pattern, c.text) for c in out.outputs)
    assert_no_blocks_held(llm)



@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_the_commands_take_the_flag(command):
    from pagedserve.cli import build_parser, engine_config
    args = build_parser().parse_args([command, "--kv-cache-dtype", "fp8"])
    assert engine_config(args).kv_cache_dtype == "fp8_e4m3"
