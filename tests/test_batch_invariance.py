"""Greedy output of the default model (in its GGUF blocks) does not depend on the batch, by
default: the same request alone, among other requests (chunked prefills sharing its decode
steps), after a prefix-cache hit and with n-gram or suffix speculation gives the same tokens and
logprobs, where its quantized products run in r8 layouts (the avx2 / avxvnni kernels: a row's
arithmetic does not depend on how many rows share the call; csrc/quant/dot_r8_256.h) and on the
avx512vnni variant (the files' layouts: one chain of sums per row, csrc/quant/dot_avx512vnni.h;
quant.INVARIANT_DOTS). Steps holding a greedy request are batch-invariant
(EngineConfig.batch_invariant "auto": prefill chunks take the decode rows' integer dots too);
steps of sampled requests only are not."""
import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.kernels import quant
from pagedserve.models.loader import default_model_path
from pagedserve.pooling_params import PoolingParams
from pagedserve.request import Request
from pagedserve.scheduler import Scheduler

# The r8 variants this CPU runs (an AVX-512 machine runs avx2 too): each runs the default model
# in r8 layouts. None (no AVX2): nothing to check.
R8_HERE = [v for v in quant.R8_VARIANTS if v in quant.supported_variants()]
# The variants whose integer dots keep a row's arithmetic in the files' layouts (avx512vnni).
DOTS_HERE = [v for v in quant.INVARIANT_DOTS if v in quant.supported_variants()]
needs_r8 = pytest.mark.parametrize("variant", R8_HERE + DOTS_HERE or [pytest.param(None, marks=pytest.mark.skip(
    reason="the batch-invariant kernels run on the avx2 / avxvnni / vnni256 / avx512vnni variants, which this CPU lacks"))])
needs_dots = pytest.mark.parametrize("variant", DOTS_HERE or [pytest.param(None, marks=pytest.mark.skip(
    reason="the avx512vnni variant's kernels need AVX-512 BW/VL and VNNI, which this CPU lacks"))])


def _check_layout(llm: LLM, variant: str) -> None:
    """The default model's projections as the variant loads them: q4_1r8 (on the 256-bit variants
    every step batch-invariant but for mxfp4r8; on avx512vnni, 512-bit dots, plain steps' prefill
    chunks take the tiles: the worker says they are batch-dependent)."""
    worker = llm.engine.executor.worker
    assert worker.runner.model.layers[0].qkv.qtype == "q4_1r8"
    assert worker.batch_dependent_steps == (variant not in quant.R8_VARIANTS)

PROMPT = "The capital of France is Paris. The capital of"
OTHERS = ["Once upon a time", "def fibonacci(n):", "Water boils at", "My favourite book is",
          "A long prompt, so that its prefill takes several chunks and shares steps with the others' decodes: "
          "the quick brown fox jumps over the lazy dog, again and again and again, until the budget runs out."]


def _default_model() -> None:
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def _run(llm: LLM, prompts: list[str], max_tokens: int = 24):
    """The first prompt's greedy tokens and their logprobs."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens, logprobs=1)
    out = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0]
    return out.token_ids, [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]


@needs_r8
def test_greedy_is_the_same_alone_batched_cached_and_speculated_by_default(variant):
    """The default settings (batch_invariant auto). A token budget of 32 puts prompts in chunks
    and the first prompt's decodes in steps with the others' prefill chunks (mixed steps: more
    than 16 rows, which took the dequantized tiles before)."""
    _default_model()
    small = dict(kv_cache_memory=64 * 1024**2, max_num_batched_tokens=32, max_num_seqs=8)
    with quant.using_variant(variant):
        llm = LLM(enable_prefix_caching=True, **small)
        assert llm.engine.config.batch_invariant == "auto"
        _check_layout(llm, variant)
        alone = _run(llm, [PROMPT])
        assert _run(llm, [PROMPT]) == alone                    # its prompt's full blocks now a prefix-cache hit
        assert _run(llm, [PROMPT] + OTHERS) == alone            # chunked prefills, mixed steps
        spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
        drafted = LLM(enable_prefix_caching=False, speculative_config=spec, **small)
        assert _run(drafted, [PROMPT]) == alone
        assert _run(drafted, [PROMPT] + OTHERS) == alone
        assert drafted.kv_cache_stats()["spec_decode_num_accepted_tokens"] > 0


def _step_flags(mode: str | None, temperatures: list[float], pooling: bool = False) -> list[bool]:
    sched = Scheduler(EngineConfig(block_size=4, batch_invariant=mode, enable_prefix_caching=False), 64)
    for i, t in enumerate(temperatures):
        sched.add_request(Request.create(str(i), None, [7] * 6, SamplingParams(temperature=t, max_tokens=4), 4,
                                         sched.new_seq_id()))
    if pooling:
        sched.add_request(Request.create("p", None, [7] * 6, PoolingParams(), 1, sched.new_seq_id(), pooling="LAST"))
    return [sched.schedule().batch.batch_invariant]


def test_the_step_is_batch_invariant_where_it_holds_a_greedy_request(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_BATCH_INVARIANT", raising=False)
    assert _step_flags(None, [0.0]) == [True]                 # default: auto
    assert _step_flags("auto", [1.0, 0.0]) == [True]          # one greedy request in the step
    assert _step_flags("auto", [1.0, 0.7]) == [False]         # sampled requests only: the faster tiles
    assert _step_flags("auto", [], pooling=True) == [False]   # embeddings: closer to the float model
    assert _step_flags("on", [], pooling=True) == [True]
    assert _step_flags("on", [1.0]) == [True]
    assert _step_flags("off", [0.0]) == [False]
    monkeypatch.setenv("PAGEDSERVE_BATCH_INVARIANT", "0")
    assert EngineConfig().batch_invariant == "off"
    monkeypatch.setenv("PAGEDSERVE_BATCH_INVARIANT", "1")
    assert EngineConfig().batch_invariant == "on"
    assert EngineConfig(batch_invariant="off").batch_invariant == "off"   # the argument wins
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(batch_invariant="sometimes")


# Prompts whose continuations repeat, so that the n-gram and suffix proposers draft often.
REPEATING = ["The capital of France is Paris. The capital of Germany is Berlin. The capital of",
             "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\ndef",
             "one two three four five six seven eight nine ten one two three four",
             "Write a list of fruits: apple, banana, cherry, apple, banana,"]


@pytest.mark.skipif(quant.variant() not in quant.R8_VARIANTS + quant.INVARIANT_DOTS,
                    reason="the batch-invariant kernels run on the avx2 / avxvnni / vnni256 / avx512vnni variants")
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_speculation_gives_plain_decodings_tokens_and_logprobs(method):
    """Verification rows attend one by one as decode rows (csrc/attention/paged_attention.h) and
    take the decode rows' products: drafted steps give plain decoding's tokens and logprobs, bit
    for bit, on the quantized default model, alone and four at a time. (Before, the verification
    chunk took the tiled prefill attention: the text changed from its 40th token.)"""
    _default_model()
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3} \
        if method == "ngram" else {"method": "suffix", "num_speculative_tokens": 4}
    params = SamplingParams(temperature=0, max_tokens=120, min_tokens=120, logprobs=1)

    def outputs(llm: LLM, prompts: list[str]) -> list:
        return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
                for o in llm.generate(prompts, params, use_tqdm=False)]
    plain = LLM(kv_cache_memory=64 * 1024**2)
    want_alone = [outputs(plain, [p])[0] for p in REPEATING]
    want_batched = outputs(plain, REPEATING)
    drafted = LLM(kv_cache_memory=64 * 1024**2, speculative_config=spec)
    assert [outputs(drafted, [p])[0] for p in REPEATING] == want_alone
    assert outputs(drafted, REPEATING) == want_batched
    assert drafted.kv_cache_stats()["spec_decode_num_accepted_tokens"] > 200


def _cached_after_sampled(mode: str, temperature: float) -> int:
    """Prompt tokens a request of `temperature` finds cached after a sampled request with its
    prompt ran alone (a step of sampled requests only: not batch-invariant under auto)."""
    sched = Scheduler(EngineConfig(block_size=4, batch_invariant=mode), 64)
    prompt = list(range(10, 23))                                  # three full blocks looked up
    sched.add_request(Request.create("s", None, prompt, SamplingParams(temperature=1.0, max_tokens=4), 4,
                                     sched.new_seq_id()))
    assert sched.schedule().batch.batch_invariant == (mode == "on")
    sched.add_request(Request.create("t", None, prompt, SamplingParams(temperature=temperature, max_tokens=4), 4,
                                     sched.new_seq_id()))
    out = sched.schedule()
    return next(s.start for s in out.scheduled if s.request.request_id == "t")


def test_a_greedy_request_under_auto_takes_no_prefix_a_sampled_only_step_computed():
    """Under auto a greedy request computes its prompt batch-invariantly; blocks a step of
    sampled requests only computed hold other K and V, so its prefix lookup passes them over
    (kv_cache_manager.py invariant_only). A sampled request takes them; under on every step is
    invariant, under off greedy output is not promised: both take them."""
    assert _cached_after_sampled("auto", 0.0) == 0
    assert _cached_after_sampled("auto", 0.8) == 12
    assert _cached_after_sampled("on", 0.0) == 12
    assert _cached_after_sampled("off", 0.0) == 12


@needs_r8
def test_greedy_after_a_sampled_request_with_its_prompt_gives_its_tokens_alone(variant):
    """The gap auto had: a sampled request alone computed a long prompt's prefill on the
    dequantized tiles; a greedy request with that prompt after it took those blocks from the
    prefix cache and its tokens changed. Now that prefill takes the integer GEMM as a greedy one
    does (q4_1r8), so the greedy request may take those blocks and gives its tokens alone (the
    paging invariants checked every step); a second greedy request takes its blocks."""
    _default_model()
    prompt = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 12)
    small = dict(kv_cache_memory=64 * 1024**2, check_invariants=True)
    with quant.using_variant(variant):
        alone = _run(LLM(enable_prefix_caching=False, **small), [prompt], max_tokens=32)
        llm = LLM(enable_prefix_caching=True, **small)
        _check_layout(llm, variant)
        sampled = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=2, seed=1), use_tqdm=False)[0]
        assert len(sampled.prompt_token_ids) > 64                 # a prefill chunk past the dots' 16 rows
        assert _run(llm, [prompt], max_tokens=32) == alone
        again = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
        assert again.num_cached_tokens > 0


def test_a_float_model_marks_no_block_so_greedy_after_sampled_takes_the_cached_prefix(tiny_llama):
    """Where a batch-invariant step computes as a plain one does (float weights: the worker reports
    it, ModelOps.invariance_changes), no block is marked batch-dependent: a greedy request after a
    sampled one with its long prompt takes the prompt's blocks from the prefix cache (before, it
    recomputed them) and gives its tokens alone."""
    prompt = {"prompt_token_ids": [(7 * i) % 200 + 3 for i in range(100)]}
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(dtype="float32", num_gpu_blocks_override=64, check_invariants=True)
    alone = LLM(tiny_llama.path, enable_prefix_caching=False, **kw).generate(prompt, greedy, use_tqdm=False)[0]
    llm = LLM(tiny_llama.path, enable_prefix_caching=True, **kw)
    assert llm.engine.config.batch_invariant == "auto" and not llm.engine.executor.worker.batch_dependent_steps
    llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=2, seed=1), use_tqdm=False)
    hits = llm.kv_cache_stats()["prefix_cache_hits"]
    out = llm.generate(prompt, greedy, use_tqdm=False)[0]
    assert out.num_cached_tokens == 96 and llm.kv_cache_stats()["prefix_cache_hits"] - hits == 96
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids


def test_only_r8_layouts_without_the_gemm_make_steps_batch_dependent():
    """The worker's report: torch's ops never (`invariant` changes nothing there); the CPU kernels
    on the avx2 / avxvnni variants only for r8 layouts without the integer GEMM (mxfp4r8: their dots
    then take prefill rows too); the others' prefill rows take the GEMM in every step."""
    from pagedserve.models.ops import TorchOps
    assert not TorchOps().invariance_changes({"q4_0r8", "q4_kr8"})
    for variant in R8_HERE:
        with quant.using_variant(variant):
            assert quant.invariance_changes({"mxfp4r8", "q8_0r8", "f16"})
            assert not quant.invariance_changes({"q4_0r8", "q8_0r8", "q4_kr8", "q6_kr8", "f16"})
            assert not quant.invariance_changes({"q4_0", "q6_k"}) and not quant.invariance_changes(set())
    for variant in DOTS_HERE:      # there every quantized product's plain steps take the tiles
        with quant.using_variant(variant):
            assert quant.invariance_changes({"q4_1", "f16"}) and quant.invariance_changes({"q4_0x8"})
            assert quant.invariance_changes({"q4_1r8"})
            assert not quant.invariance_changes({"f16"}) and not quant.invariance_changes(set())


@needs_r8
def test_greedy_with_a_draft_model_gives_its_tokens_alone(variant):
    """The issue's last speculation case: a draft model (here the default model drafting for
    itself, method draft_model) changed the default model's greedy text. Its verification rows are
    decode rows: tokens and logprobs equal plain decoding's, alone and among other requests."""
    _default_model()
    small = dict(kv_cache_memory=64 * 1024**2, max_num_batched_tokens=32, max_num_seqs=8, enable_prefix_caching=False)
    with quant.using_variant(variant):
        alone = _run(LLM(**small), [PROMPT])
        drafted = LLM(speculative_config={"model": default_model_path(), "num_speculative_tokens": 3}, **small)
        assert _run(drafted, [PROMPT]) == alone
        assert _run(drafted, [PROMPT] + OTHERS) == alone
        assert drafted.kv_cache_stats()["spec_decode_num_accepted_tokens"] > 0



@needs_r8
def test_an_embedding_alone_equals_it_among_others_with_batch_invariant_on(variant):
    """The issue's embedding case (alone vs in a batch of 600: cosine 0.99928). Under auto a
    pooling step is not batch-invariant (its prefill on the tiles, closer to the float model);
    `on` makes it so: the same prompt's embedding alone and among others in one step, bit for bit.
    (A prompt split over prefill chunks: test_an_embedding_does_not_depend_on_how_its_prompt_is_split.)"""
    _default_model()
    with quant.using_variant(variant):
        llm = LLM(runner="pooling", batch_invariant="on", kv_cache_memory=64 * 1024**2, max_num_batched_tokens=2048,
                  max_num_seqs=16, enable_prefix_caching=False)
        alone = llm.embed([PROMPT], use_tqdm=False)[0].outputs.embedding
        prompts = OTHERS * 3 + [PROMPT] + OTHERS * 3
        assert llm.embed(prompts, use_tqdm=False)[len(OTHERS) * 3].outputs.embedding == alone


@needs_r8
@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_an_embedding_does_not_depend_on_how_its_prompt_is_split(variant, pooling):
    """The issue's other embedding case: the default model's embedding of a prompt split over
    prefill chunks equals it in one chunk, bit for bit, under batch_invariant on. PROMPT is 10
    tokens: budgets 9 and 3 leave a last chunk of 1 token, which was attended as a decode row
    (another attention kernel: 5.3e-3 apart, LAST); MEAN adds its chunks' sums (in float64)."""
    _default_model()

    def embedding(budget: int) -> list[float]:
        llm = LLM(runner="pooling", batch_invariant="on", kv_cache_memory=64 * 1024**2, max_num_batched_tokens=budget,
                  max_num_seqs=2, enable_prefix_caching=False, pooler_config={"pooling_type": pooling})
        out = llm.embed([PROMPT], use_tqdm=False)[0]
        assert len(out.prompt_token_ids) == 10
        return out.outputs.embedding

    with quant.using_variant(variant):
        whole = embedding(2048)
        for budget in (9, 5, 3):
            assert embedding(budget) == whole, budget



# Kernel level: each type in the layout the variant loads it in (q4_0 of whole 256-element units:
# q4_0x8), rows of K that take every pass of the dots: 32-element types 19 blocks (a group of 16, a
# pair, an odd block), super-block types 3 super-blocks; 37 weight rows (two-row passes at T = 1 and
# a single row, split over the threads).
KERNEL_CASES = [(q, 608) for q in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "mxfp4")] + \
    [(q, 768) for q in ("q4_k", "q5_k", "q6_k")] + [("q4_0", 512)]
# Both sides of each threshold: one- and two-row passes (Act::start), 8-row passes and their tails,
# AMX-INT8's first row (8), SMALL_BATCH_ROWS (16), DECODE_BATCH_ROWS (32), up to 65 rows.
ROW_COUNTS = (2, 3, 4, 7, 8, 9, 10, 11, 15, 16, 17, 31, 32, 33, 64, 65)


@needs_dots
@pytest.mark.parametrize("qtype,cols", KERNEL_CASES)
def test_a_row_alone_equals_it_among_2_to_65_rows_in_invariant_products(variant, qtype, cols):
    """quant.linear(invariant=True) on the avx512vnni variant: each activation row's output alone
    equals it among 2-65 rows, bit for bit, float32 and bf16 x, decode or prefill rows, out
    float32 or bf16 (before: two-row passes, the dots' chains of sums by rows a pass, and from 17
    rows the dequantized tiles gave other bits)."""
    from tests.test_quant_kernels import weight
    with quant.using_variant(variant):
        w = quant.repack(weight(qtype, rows=37, cols=cols)[0])
        assert w.qtype == ("q4_0x8" if (qtype, cols) == ("q4_0", 512) else w.qtype)
        x = torch.randn(65, cols, generator=torch.Generator().manual_seed(1))
        for dtype in (torch.float32, torch.bfloat16):
            xs = x.to(dtype)
            alone = torch.cat([quant.linear(xs[t:t + 1], w, out_dtype=torch.float32, invariant=True) for t in range(65)])
            for n in ROW_COUNTS:
                for decode in (False, True):
                    y = quant.linear(xs[:n], w, decode=decode, out_dtype=torch.float32, invariant=True)
                    assert torch.equal(y, alone[:n]), (dtype, n, decode)
            y16 = quant.linear(xs[:33], w, out_dtype=torch.bfloat16, invariant=True)
            assert torch.equal(y16, alone[:33].bfloat16())


@needs_dots
def test_invariant_products_take_the_integer_dots_at_any_rows_and_no_amx_tiles(variant, monkeypatch):
    """The dispatch on avx512vnni with the AMX paths forced on (as on a CPU with AMX): a plain call
    of 20 bf16 rows takes the dequantized tiles (AMX-BF16 weights as A tiles from 8 rows), an
    invariant one (or any under set_batch_invariant) the integer dots and tells them to keep
    vpdpbusd (quant_linear_small's `invariant`: no AMX-INT8 tiles from 8 rows)."""
    from tests.test_quant_kernels import weight
    with quant.using_variant(variant):
        monkeypatch.setattr(quant, "amxw_in_use", lambda: True)
        monkeypatch.setattr(quant, "amx_int8_in_use", lambda: True)
        calls = []
        monkeypatch.setattr(quant, "_linear_small", lambda x, parts, bias, lib, out_dtype=None, invariant=False:
                            calls.append(("dots", x.shape[0], invariant)) or torch.zeros(x.shape[0], 64))
        monkeypatch.setattr(quant, "_linear_tiles", lambda x, parts, bias, lib:
                            calls.append(("tiles", x.shape[0], False)) or torch.zeros(x.shape[0], 64))
        w = weight("q4_1", rows=64, cols=256)[0]
        x = torch.randn(20, 256).bfloat16()
        assert quant.batch_rows(False, bf16=True) == quant.amxw_rows()[0] - 1
        assert quant.batch_rows(False, bf16=True, invariant=True) == quant.R8_ALL_ROWS
        assert quant.batch_rows(True, invariant=True) == quant.R8_ALL_ROWS
        quant.linear(x, w)
        quant.linear(x[:4], w)
        quant.linear(x, w, invariant=True)
        quant.linear(x, w, decode=True, invariant=True)
        quant.set_batch_invariant(True)
        try:
            quant.linear(x, w)
        finally:
            quant.set_batch_invariant(False)
        assert calls == [("tiles", 20, False), ("dots", 4, False), ("dots", 20, True), ("dots", 20, True),
                         ("dots", 20, True)]
