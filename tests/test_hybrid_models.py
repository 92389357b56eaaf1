"""Models with sliding-window layers on the paged cache's KV groups (kv/groups.py): Gemma 2
(alternating window and full layers, soft-capping), Gemma 3 text (5:1-style pattern, local RoPE,
q/k norms) and Mistral (a window on every layer), tiny and random, with the window (16) far
shorter than the prompts (~100 tokens, block size 4), so the window really slides and its
blocks go back to the pool. transformers float32 is the oracle: greedy tokens and logprobs,
with prefix caching, preemption by recompute and by swap, n=3, beam search, and from GGUF files
written with llama.cpp's names."""
from __future__ import annotations

import json
import zlib

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.torch_backend import TorchAttention, attention_math
from pagedserve.kv.groups import window_bound
from pagedserve.server.metrics import PrometheusStatLogger
from tests.beam_reference import reference_beam_search
from tests.conftest import CORPUS, TinyModel, hf_greedy
from tests.gguf_utils import gemma_header, gemma_rename, write_hf_model

WINDOW, BLOCK = 16, 4
COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1, sliding_window=WINDOW)
# name: (config class, its own keywords). Soft-caps small enough to bite on tiny random weights.
HYBRID = {
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=4, query_pre_attn_scalar=16, attn_logit_softcapping=1.5,
                                    final_logit_softcapping=2.0, tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", dict(
        num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=16, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
    "mistral": ("MistralConfig", dict(num_hidden_layers=2, tie_word_embeddings=False)),
    # Gemma 3's own pattern (five window layers, then a full one), as its GGUF files assume.
    "gemma3_6": ("Gemma3TextConfig", dict(
        num_hidden_layers=6, query_pre_attn_scalar=16, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
}
_models: dict[str, TinyModel] = {}


@pytest.fixture
def hybrid(tiny_root, tiny_tokenizer, request) -> TinyModel:
    """The tiny model named by the test's parameter, built once per session (norms random, so
    that Gemma's (1 + w) counts)."""
    import transformers
    name = request.param
    if name not in _models:
        cls, extra = HYBRID[name]
        tok = tiny_tokenizer
        config = getattr(transformers, cls)(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                            eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                                            **COMMON, **extra)
        torch.manual_seed(zlib.crc32(name.encode()) % 1000)
        model_cls = getattr(transformers, cls.replace("TextConfig", "Config").replace("Config", "ForCausalLM"))
        hf = model_cls(config).float().eval()
        with torch.no_grad():
            for n, t in hf.named_parameters():
                if n.endswith("norm.weight"):
                    t.uniform_(-0.5, 0.5) if name.startswith("gemma") else t.uniform_(0.5, 1.5)
        path = tiny_root / f"hybrid_{name}"
        hf.save_pretrained(path)
        tok.save_pretrained(path)
        _models[name] = TinyModel(str(path), hf, tok, name)
    return _models[name]


def long_prompts(tm: TinyModel, n: int = 2) -> list[list[int]]:
    """~100-token prompts (several windows long), sharing a long prefix (prefix-cache hits)."""
    text = " ".join(CORPUS[:7])
    ids = tm.tokenizer.encode(text)
    return [ids[:96], ids[:80] + ids[120:130]][:n]


def reference_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return ref[torch.arange(len(ids) - 1), ids[1:]]


def prompt_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return torch.tensor([out.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i > 0])


def make(tm: TinyModel, **kw) -> LLM:
    kw = dict(dtype="float32", block_size=BLOCK, num_gpu_blocks_override=256, enable_prefix_caching=True) | kw
    return LLM(tm.path, **kw)


ALL = pytest.mark.parametrize("hybrid", ["gemma2", "gemma3", "mistral"], indirect=True)


@ALL
def test_greedy_tokens_and_logprobs_match_transformers_with_prefix_hits(hybrid):
    llm = make(hybrid)
    args = llm.engine.model_args
    assert any(w == WINDOW for w in args.windows())
    prompts = long_prompts(hybrid)
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    for _ in range(2):           # the second time from the prefix cache (per group)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for p, out in zip(prompts, outs):
            assert out.outputs[0].token_ids == hf_greedy(hybrid.hf, p, 12)
    stats = llm.kv_cache_stats()
    assert stats["prefix_cache_hits"] > 0 and stats["num_used_blocks"] == 0
    torch.testing.assert_close(prompt_logprobs(llm, prompts[0]), reference_logprobs(hybrid.hf, prompts[0]),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("hybrid", ["gemma2", "gemma3"], indirect=True)
def test_triton_backend_matches_transformers(hybrid):
    """The Triton kernels' window and soft-capping in the engine (interpreted on a CPU): greedy
    tokens and prompt logprobs as transformers', the window sliding over ~100-token prompts; the
    decode steps through the CUDA graphs' buffers (every KV group's slots and tables; on a CPU
    the padded buffers run eagerly)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = make(hybrid, attention_backend="triton", device=device, enable_prefix_caching=False)
    runner = llm.engine.runner
    assert runner.model.attention.name == "triton"
    if runner.decode_graphs is None:
        runner.capture_cuda_graphs([1, 4], llm.engine.max_model_len, capture=False)
    prompts = long_prompts(hybrid)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=6,
                                                                                   min_tokens=6), use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hybrid.hf, p, 6)
    assert runner.decode_graphs.steps_run >= 5
    torch.testing.assert_close(prompt_logprobs(llm, prompts[0]), reference_logprobs(hybrid.hf, prompts[0]),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("hybrid", ["gemma2"], indirect=True)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_n3_change_no_token(hybrid, mode):
    """A cache too small for the batch: preemptions (recompute or swap) while window blocks come
    and go; greedy n=3 requests all give transformers' tokens."""
    prompts = long_prompts(hybrid)
    llm = make(hybrid, num_gpu_blocks_override=74, preemption_mode=mode, max_num_seqs=12, admission_watermark=0.0,
               **({"swap_space": 0.01} if mode == "swap" else {}))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2],
                        SamplingParams(temperature=0, n=3, max_tokens=10, min_tokens=10), use_tqdm=False)
    for p, out in zip(prompts * 2, outs):
        ref = hf_greedy(hybrid.hf, p, 10)
        assert [o.token_ids for o in out.outputs] == [ref] * 3
    stats = llm.engine.scheduler.stats
    assert stats.num_preemptions > 0
    assert llm.kv_cache_stats()["num_used_blocks"] == 0


@pytest.mark.parametrize("hybrid", ["gemma3"], indirect=True)
def test_beam_search_matches_the_reference(hybrid):
    llm = make(hybrid)
    prompts = long_prompts(hybrid, 1)
    eos = hybrid.tokenizer.eos_token_id
    out = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                          __import__("pagedserve").BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
    (ref, gap), = reference_beam_search(hybrid.hf, prompts, 3, 6, eos, ignore_eos=True, num_threads=1)
    assert [s.tokens for s in out[0].sequences] == [t for t, _ in ref], gap


@pytest.mark.parametrize("hybrid", ["gemma3"], indirect=True)
def test_window_groups_stay_at_their_bound_while_the_full_group_grows(hybrid):
    """A long prompt decoded token by token: each window group's live blocks stay at
    ceil(W / B) + 1, the full group's grow with the sequence (kv_cache_stats per group)."""
    llm = make(hybrid, max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=False)
    prompt = long_prompts(hybrid, 1)[0]
    engine = llm.engine
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=40,
                                                                         min_tokens=40, ignore_eos=True))
    seen = []
    metrics = PrometheusStatLogger("m")
    while engine.has_unfinished_requests():
        engine.step()
        seen.append(llm.kv_cache_stats()["num_blocks_per_group"])
        if len(seen) == 10:          # /metrics: a series per group
            metrics.record(engine.scheduler_stats(), None)
            text = metrics.render().decode()
            for g, n in enumerate(seen[-1]):
                name = "full" if g == 0 else f"sliding_window={WINDOW}"
                assert f'kv_group_blocks{{kv_group="{g}:{name}",model_name="m"}} {float(n)}' in text, text
    stats = llm.kv_cache_stats()
    assert stats["kv_groups"] == ["full"] + [f"sliding_window={WINDOW}"] * 2 and stats["num_used_blocks"] == 0
    chunks = len(prompt) // 16                         # the prompt in steps of 16 tokens, then decodes
    full = [s[0] for s in seen[:-1]]
    assert full == sorted(full) and full[-1] == -(-(len(prompt) + 39) // BLOCK)
    assert all(n <= window_bound(WINDOW, BLOCK, 16) for s in seen[:chunks] for n in s[1:])
    decodes = [n for s in seen[chunks:-1] for n in s[1:]]
    assert decodes and all(WINDOW // BLOCK <= n <= window_bound(WINDOW, BLOCK) for n in decodes)


def test_sliding_window_reads_no_block_outside_the_window():
    """Blocks before a query's window hold NaN: the reference backend never reads them, and
    equals dense attention with the window's mask; soft-capping and sinks as their formulas."""
    torch.manual_seed(0)
    B, W, Hq, Hkv, D, L = 4, 6, 4, 2, 8, 23
    cache = torch.randn(2, 16, B, Hkv, D)
    table = list(range(1, 7))                    # positions 0..23 in blocks 1..6
    k, v = cache[0][table].flatten(0, 1)[:L], cache[1][table].flatten(0, 1)[:L]
    q = torch.randn(3, Hq, D)                   # the last 3 positions, a prefill chunk
    poisoned = cache.clone()
    first = (L - 3 - W + 1) // B
    poisoned[:, table[:first]] = float("nan")
    meta = AttentionMetadata(slot_mapping=torch.tensor([], dtype=torch.long), query_start_loc=torch.tensor([0, 3]),
                             seq_lens=torch.tensor([L]), block_tables=torch.tensor([[-1] * first + table[first:]]),
                             num_decodes=0, query_start_loc_cpu=[0, 3], seq_lens_cpu=[L], max_seq_len=L, window=W)
    sinks = torch.randn(Hq)
    out = TorchAttention()._reference(q, k, v, poisoned, meta, 0.3, softcap=2.0, sinks=sinks)
    qpos, kpos = torch.arange(L - 3, L)[:, None], torch.arange(L)
    allowed = (kpos <= qpos) & (kpos > qpos - W)
    ref = attention_math(q, k, v, 0.3, allowed, 2.0, sinks)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref)
    # attention_math itself: gpt-oss's sinks and Gemma 2's soft-cap against transformers' functions.
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager
    mask = torch.zeros(1, 1, 3, L).masked_fill(~allowed, float("-inf"))
    module = type("M", (), {"num_key_value_groups": Hq // Hkv, "training": False, "sinks": sinks,
                            "head_dim": D})()
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    sink_ref, _ = gpt_oss_eager(module, qt, kt, vt, mask, scaling=0.3, dropout=0.0)
    torch.testing.assert_close(attention_math(q, k, v, 0.3, allowed, 0.0, sinks), sink_ref[0], atol=1e-5, rtol=1e-5)
    cap_ref, _ = gemma2_eager(module, qt, kt, vt, mask, scaling=0.3, dropout=0.0, softcap=2.0)
    torch.testing.assert_close(attention_math(q, k, v, 0.3, allowed, 2.0), cap_ref[0], atol=1e-5, rtol=1e-5)


def _gemma_header(w, cfg) -> None:
    """What llama.cpp's converter writes for a Gemma beyond the shared header."""
    import gguf
    gemma_header(w, cfg.head_dim, cfg.sliding_window)
    if cfg.model_type == "gemma2":
        w.add_float32(f"{w.arch}.attn_logit_softcapping", cfg.attn_logit_softcapping)
        w.add_float32(f"{w.arch}.final_logit_softcapping", cfg.final_logit_softcapping)
    else:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_parameters["full_attention"]["factor"])


@pytest.mark.parametrize("hybrid, arch, windows", [("gemma2", "gemma2", [WINDOW, None] * 2),
                                                   ("gemma3_6", "gemma3", [WINDOW] * 5 + [None])],
                         indirect=["hybrid"])
def test_gguf_as_llama_cpp_writes_gemma_matches_transformers(hybrid, arch, windows, tmp_path):
    """gemma2 / gemma3 GGUF files (llama.cpp's tensor names and metadata keys, its layer patterns,
    norms stored as 1 + w)."""
    path = tmp_path / f"{arch}.gguf"
    write_hf_model(hybrid.hf, path, arch, header=_gemma_header, rename=gemma_rename)
    llm = LLM(str(path), tokenizer=hybrid.path, dtype="float32", block_size=BLOCK, num_gpu_blocks_override=256)
    assert llm.engine.model_args.windows() == windows
    prompt = long_prompts(hybrid, 1)[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8, min_tokens=8),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hybrid.hf, prompt, 8)
    torch.testing.assert_close(prompt_logprobs(llm, prompt), reference_logprobs(hybrid.hf, prompt),
                               atol=1e-4, rtol=1e-4)


def test_config_without_layer_types_uses_the_pattern(tmp_path):
    """A transformers 4 Gemma 3 config (sliding_window_pattern, rope_local_base_freq, rope_scaling)."""
    from pagedserve.models.loader import args_from_hf_config
    cfg = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=10, hidden_size=64,
               intermediate_size=8, num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
               sliding_window=512, rope_theta=1e6, rope_local_base_freq=1e4, query_pre_attn_scalar=16,
               rope_scaling={"rope_type": "linear", "factor": 8.0}, hidden_activation="gelu_pytorch_tanh")
    args = args_from_hf_config(json.loads(json.dumps(cfg)))
    assert args.windows() == ([512] * 5 + [None]) * 2
    assert (args.rope_theta, args.local_rope_theta, args.rope_scaling["factor"]) == (1e6, 1e4, 8.0)
    assert not args.beyond_compiled_loop()     # windows, local RoPE, sandwich norms, GeGLU: all compiled


@pytest.mark.parametrize("head_dim", [16, 64])
def test_cpu_kernels_read_only_the_window(head_dim):
    """The CPU attention kernels with a sliding window (decodes, and prefill chunks through the
    per-token path) equal the torch reference; blocks before each window hold NaN and are never read."""
    from pagedserve.attention.cpu_backend import CpuAttention
    from pagedserve.kernels import cpu as cpu_kernels
    from pagedserve.worker.model_runner import prepare_batch
    from pagedserve.batch import ScheduledTokens
    torch.manual_seed(1)
    B, W, Hq, Hkv = 4, 10, 4, 2
    cache = torch.randn(2, 64, Hkv, B, head_dim).transpose(2, 3)       # head-major, as the CPU backend's
    seqs, poison = [], []
    for i, (length, new) in enumerate([(37, 1), (14, 1), (45, 7), (26, 26)]):      # two decodes, two chunks
        table = list(range(1 + 12 * i, 1 + 12 * i + -(-length // B)))
        first = max(0, length - new - W + 1) // B
        poison += table[:first]
        seqs.append(ScheduledTokens(i, [0] * new, length - new, [-1] * first + table[first:]))
    _, _, meta = prepare_batch(seqs, B, "cpu", windows=(W,))
    q = torch.randn(meta.query_start_loc_cpu[-1], Hq, head_dim)
    ref = TorchAttention()._reference(q, None, None, cache, meta, 0.25)
    cache[:, poison] = float("nan")
    out = cpu_kernels.paged_attention(q, cache, CpuAttention().kernel_rows(meta), 0.25)
    assert out is not None and not out.isnan().any()      # (None: the kernel did not run)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hybrid", ["gemma2", "gemma3", "mistral"], indirect=True)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_layer_loop_runs_window_models(hybrid, dtype):
    """The compiled CPU layer loop with each layer's window, KV group and cache slot, Gemma 3's
    local RoPE, sandwich norms, GeGLU and soft-capping as data: it runs every step (prompts
    prefilled in chunks of 16 through the tiled kernel with the window, blocks behind it released
    as they go, then decodes), and gives the Python loop's greedy tokens and (float32)
    transformers'."""
    llm = make(hybrid, dtype=dtype, max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=False)
    model = llm.engine.runner.model
    compiled = model.compiled_layers
    assert compiled is not None, "the compiled loop is off for a window model"
    ran, inner = [], compiled.forward
    compiled.forward = lambda *a: ran.append(inner(*a)) or ran[-1]
    prompts = long_prompts(hybrid)
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=10, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert ran and all(ran)
    model.compiled_layers = None
    python = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, fused, plain in zip(prompts, outs, python):
        assert fused.outputs[0].token_ids == plain.outputs[0].token_ids
        if dtype == "float32":
            assert fused.outputs[0].token_ids == hf_greedy(hybrid.hf, p, 10)
            torch.testing.assert_close(torch.tensor([next(iter(d.values())).logprob for d in fused.outputs[0].logprobs]),
                                       torch.tensor([next(iter(d.values())).logprob for d in plain.outputs[0].logprobs]),
                                       atol=1e-5, rtol=1e-5)
