"""Multi-LoRA serving against the oracle: peft (float32) over a tiny random llama.

Three random adapters of different ranks, targets and scalings (one rsLoRA), and the base
model: greedy tokens of each alone and of batches mixing all four equal peft's, with fewer
slots than adapters (requests wait for a slot, adapters are reloaded from the host cache or
disk), under preemption (both modes), and with prefix caching (no block shared between
adapters). Breaking the delta or mixing up rows between adapters fails the comparison.
Bad adapters are refused with clear errors and the engine goes on serving.
"""
import json
import shutil
import threading

import pytest
import torch

from pagedserve import LLM, InvalidRequestError, LoRARequest, SamplingParams
from pagedserve.kv.block_pool import kv_salt, lookup_block_keys
from pagedserve.lora import weights as lora_weights
from tests.conftest import PROMPTS
from tests.lora_utils import make_adapter, oracle_greedy
from tests.test_preemption import host_bytes

MAX_TOKENS = 8
ADAPTERS = {   # name: (int id, seed, rank, alpha, targets, rslora)
    "all7": (1, 11, 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "attn": (2, 12, 4, 8, ["q_proj", "v_proj", "o_proj"], True),
    "mlp": (3, 13, 2, 4, ["k_proj", "up_proj", "down_proj"], False),
}


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):
    """The adapters on disk, their LoRARequests, the prompts and the oracle's tokens
    (name -> per prompt; None: the base model)."""
    root = tmp_path_factory.mktemp("loras")
    prompts = [tiny_llama.tokenizer.encode(p) for p in PROMPTS[:3]]
    requests, want = {None: None}, {None: [oracle_greedy(tiny_llama.hf, p, MAX_TOKENS) for p in prompts]}
    for name, (int_id, seed, rank, alpha, targets, rslora) in ADAPTERS.items():
        model = make_adapter(tiny_llama.hf, root / name, seed, rank, alpha, targets, rslora)
        requests[name] = LoRARequest(name, int_id, str(root / name))
        want[name] = [oracle_greedy(model, p, MAX_TOKENS) for p in prompts]
    assert len({tuple(w[0]) for w in want.values()}) == 4, "the adapters must change the tokens"
    return root, prompts, requests, want


def make_llm(tm, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("num_gpu_blocks_override", 128)
    kw.setdefault("enable_lora", True)
    kw.setdefault("max_loras", 3)
    kw.setdefault("max_lora_rank", 8)
    return LLM(tm.path, **kw)


def run(llm, prompts, loras):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False,
                        lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


def mixed(setup):
    """Every (adapter or base, prompt) pair, interleaved: the batch mixes all four."""
    _, prompts, requests, want = setup
    pairs = [(name, i) for i in range(len(prompts)) for name in requests]
    return ([prompts[i] for _, i in pairs], [requests[n] for n, _ in pairs], [want[n][i] for n, i in pairs])


def assert_no_blocks_held(llm):
    stats = llm.kv_cache_stats()
    assert stats["num_used_blocks"] == 0
    llm.engine.check_paging_invariants()


def count_compiled_lora_steps(model) -> list[bool]:
    """Per call of the compiled layer loop: whether it ran a step with adapter rows, and whether
    that step had a prefill chunk (rows beyond its decodes)."""
    calls, inner = [], model.compiled_layers.forward

    def forward(*args):
        done = inner(*args)
        calls.append((len(args) > 6 and done, args[5].num_decodes < args[0].shape[0]))
        return done
    model.compiled_layers.forward = forward
    return calls


@pytest.mark.parametrize("loop", ["compiled", "python"])
def test_each_adapter_alone_and_a_mixed_batch_equal_peft(tiny_llama, setup, loop):
    """Both layer loops: the compiled one adds the deltas of steps with few rows (decodes),
    the Python one those of prefills (each adapter's rows gathered) and of everything without it."""
    _, prompts, requests, want = setup
    llm = make_llm(tiny_llama)
    model = llm.engine.runner.model
    if loop == "python":
        model.compiled_layers = None
    elif model.compiled_layers is None:
        pytest.skip("no compiled layer loop here (no CPU kernels)")
    else:
        calls = count_compiled_lora_steps(model)
    for name, lora in requests.items():
        assert run(llm, prompts, lora) == want[name], name
    batch_prompts, loras, expected = mixed(setup)
    assert run(llm, batch_prompts, loras) == expected
    assert_no_blocks_held(llm)
    if loop == "compiled":
        assert any(lora and prefill for lora, prefill in calls), "the compiled loop ran no prefill with adapters"
        assert any(lora and not prefill for lora, prefill in calls), "the compiled loop ran no decode with adapters"


def test_the_comparison_fails_without_the_delta_or_with_rows_mixed_up(tiny_llama, setup, monkeypatch):
    batch_prompts, loras, expected = mixed(setup)
    llm = make_llm(tiny_llama, enable_prefix_caching=False)
    init = lora_weights.LoRAStep.__post_init__

    def no_delta(self):
        init(self)
        self.targeted = dict.fromkeys(self.targeted, False)
    with monkeypatch.context() as m:     # no delta, in either layer loop
        m.setattr(lora_weights.LoRAStep, "__post_init__", no_delta)
        assert run(llm, batch_prompts, loras) != expected
    step = lora_weights.LoRAWeights.step
    with monkeypatch.context() as m:   # each adapter's rows get the next slot's weights
        m.setattr(lora_weights.LoRAWeights, "step",
                  lambda self, slots, counts: step(self, [(s + 1) % 3 if s >= 0 else s for s in slots], counts))
        assert run(llm, batch_prompts, loras) != expected
    assert run(llm, batch_prompts, loras) == expected


@pytest.mark.parametrize("max_loras,max_cpu_loras", [(1, 1), (2, 3)])
def test_fewer_slots_than_adapters(tiny_llama, setup, max_loras, max_cpu_loras):
    """Requests whose adapter has no slot wait (others go ahead); slots are refilled, from the
    host cache or, past max_cpu_loras, from disk again."""
    batch_prompts, loras, expected = mixed(setup)
    llm = make_llm(tiny_llama, max_loras=max_loras, max_cpu_loras=max_cpu_loras)
    loads = []
    weights = llm.engine.runner.lora
    original = weights.load
    weights.load = lambda load: (loads.append(load), original(load))[1]
    assert run(llm, batch_prompts, loras) == expected
    assert len(loads) >= 3 and max(load.slot for load in loads) == max_loras - 1
    assert len(weights.host) <= max_cpu_loras
    assert_no_blocks_held(llm)


def test_a_request_waiting_for_a_slot_holds_no_one_back(tiny_llama, setup):
    """One slot: the second adapter's request waits (keeping its place) while the base
    request and another of the first adapter behind it are admitted in the same step; it
    gets the slot once the first adapter's requests finish, and every output equals peft's."""
    _, prompts, requests, want = setup
    llm = make_llm(tiny_llama, max_loras=1)
    engine = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    order = [("all7", 0), ("attn", 0), (None, 1), ("all7", 2)]
    for n, (name, i) in enumerate(order):
        engine.add_request(str(n), {"prompt_token_ids": prompts[i]}, sp, lora_request=requests[name])
    done = {}
    for out in engine.step():
        done[out.request_id] = out
    running = sorted(r.request_id for r in engine.scheduler.running)
    assert running == ["0", "2", "3"], running                 # "attn" passed over, the rest admitted
    assert [r.request_id for r in engine.scheduler.waiting] == ["1"]
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    for n, (name, i) in enumerate(order):
        assert done[str(n)].outputs[0].token_ids == want[name][i], (n, name)
    assert_no_blocks_held(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_adapters(tiny_llama, setup, mode):
    batch_prompts, loras, expected = mixed(setup)
    kw = dict(preemption_mode=mode, swap_space=host_bytes(tiny_llama, 64) / 1024**3) if mode == "swap" else {}
    llm = make_llm(tiny_llama, block_size=2, num_gpu_blocks_override=24, enable_prefix_caching=False, **kw)
    assert run(llm, batch_prompts, loras) == expected
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert_no_blocks_held(llm)


def test_prefix_cache_blocks_are_never_shared_between_adapters(tiny_llama, setup):
    _, prompts, requests, want = setup
    long_prompt = prompts[2] * 3
    llm = make_llm(tiny_llama, block_size=4)
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def cached(lora):
        return llm.generate([{"prompt_token_ids": long_prompt}], sp, use_tqdm=False,
                            lora_request=lora)[0].num_cached_tokens
    assert cached(requests["all7"]) == 0
    assert cached(requests["attn"]) == 0 and cached(None) == 0      # other adapters: no hit
    assert cached(requests["all7"]) > 0 and cached(requests["attn"]) > 0 and cached(None) > 0   # same: hits
    # The keys (what KV events carry to a data-parallel router) differ by adapter, and no
    # client cache_salt can reach an adapter's.
    keys = {str(salt): lookup_block_keys(long_prompt, 4, salt)[0]
            for salt in (None, kv_salt(None, "a"), kv_salt(None, "b"), kv_salt("s", "a"), "s",
                         json.dumps(["lora", "a", None]))}
    assert len(set(keys.values())) == len(keys)
    assert run(llm, prompts, requests["mlp"]) == want["mlp"]


def test_bad_adapters_are_refused_clearly_and_the_engine_still_serves(tiny_llama, tiny_models, setup, tmp_path):
    root, prompts, requests, want = setup
    llm = make_llm(tiny_llama, max_lora_rank=4)
    other = tiny_models("llama_head64")          # hidden 192, not 64
    make_adapter(other.hf, tmp_path / "other", 5, rank=2, alpha=2)
    unknown = tmp_path / "unknown"
    shutil.copytree(root / "mlp", unknown)
    cfg = json.loads((unknown / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "embed_tokens"]
    (unknown / "adapter_config.json").write_text(json.dumps(cfg))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(root / "mlp" / "adapter_config.json", no_weights)
    cases = [(LoRARequest("big", 9, str(root / "all7")), "above max_lora_rank=4"),
             (LoRARequest("other", 10, str(tmp_path / "other")), "expected"),
             (LoRARequest("unknown", 11, str(unknown)), "embed_tokens"),
             (LoRARequest("empty", 12, str(no_weights)), "no adapter_model.safetensors"),
             (LoRARequest("missing", 13, str(tmp_path / "nowhere")), "not a directory"),
             (LoRARequest("again", 3, str(root / "attn")), "already adapter")]
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=1), use_tqdm=False,
                 lora_request=requests["mlp"])     # id 3 is taken by "mlp"
    for lora, words in cases:
        with pytest.raises(InvalidRequestError, match=words):
            run(llm, prompts, lora)
    assert run(llm, prompts, [requests["mlp"], None, requests["mlp"]]) == [want["mlp"][0], want[None][1],
                                                                          want["mlp"][2]]
    assert_no_blocks_held(llm)
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        run(make_llm(tiny_llama, enable_lora=False), prompts[:1], requests["mlp"])


def test_chat_with_an_adapter(tiny_llama, setup):
    _, _, requests, _ = setup
    llm = make_llm(tiny_llama)
    conv = [{"role": "user", "content": "The quick brown fox"}]
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = llm.chat(conv, sp, use_tqdm=False)[0].prompt_token_ids
    got = llm.chat(conv, sp, use_tqdm=False, lora_request=requests["attn"])[0].outputs[0].token_ids
    assert got == run(llm, [ids], requests["attn"])[0] != run(llm, [ids], None)[0]


def test_slots_reuse_the_least_recently_used_free_slot():
    from pagedserve.lora.slots import LoRASlots
    slots = LoRASlots(2)
    a, b, c = (LoRARequest(n, i, "/x") for i, n in enumerate("abc", 1))
    assert slots.acquire(a) == 0 and slots.acquire(b) == 1 and slots.acquire(a) == 0
    assert [(x.slot, x.lora_int_id) for x in slots.take_loads()] == [(0, 1), (1, 2)]
    assert not slots.can_acquire(c)            # both slots in use
    slots.release(1)
    assert slots.acquire(c) == 1 and slots.take_loads()[0].lora_int_id == 3   # b's slot, the free one
    slots.release(0), slots.release(0), slots.release(1)
    assert slots.acquire(b) == 0               # a's slot: used before c's
    assert slots.slot_of == {(2, "/x"): 0, (3, "/x"): 1}


@pytest.mark.parametrize("tp", [2, 4])   # 4: KV heads (2) < ranks, replicated
def test_tensor_parallel_shards_the_adapters(tiny_llama, setup, tp):
    """A and B sliced like the layers they adapt: the mixed batch equals peft's over tp ranks."""
    batch_prompts, loras, expected = mixed(setup)
    llm = make_llm(tiny_llama, tensor_parallel_size=tp)
    try:
        assert run(llm, batch_prompts, loras) == expected
    finally:
        llm.shutdown()


def test_unload_while_its_requests_run(tiny_llama, setup):
    """remove_lora while requests of the adapter run: they finish with it (tokens equal peft's);
    its slot is free again once they are done, and the adapter can come back."""
    _, prompts, requests, want = setup
    llm = make_llm(tiny_llama, max_loras=1)
    engine = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp, lora_request=requests["attn"])
    engine.step()
    assert engine.remove_lora(requests["attn"].lora_int_id) and not engine.remove_lora(99)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert [finals[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))] == want["attn"]
    assert finals["r0"].lora_request.lora_name == "attn"
    assert run(llm, prompts, requests["mlp"]) == want["mlp"]          # the one slot, refilled
    assert run(llm, prompts, requests["attn"]) == want["attn"]        # checked and loaded again
    engine.remove_lora(requests["attn"].lora_int_id)    # the same id, now another adapter
    again = LoRARequest("attn2", requests["attn"].lora_int_id, requests["mlp"].lora_path)
    assert run(llm, prompts, again) == want["mlp"]
    assert_no_blocks_held(llm)


def test_the_dashboard_names_each_requests_adapter(tiny_llama, setup):
    from pagedserve.engine.kv_view import KVView, capture
    _, prompts, requests, _ = setup
    llm = make_llm(tiny_llama)
    engine = llm.engine
    sp = SamplingParams(max_tokens=2)
    engine.add_request("a", {"prompt_token_ids": prompts[0]}, sp, lora_request=requests["attn"])
    engine.add_request("b", {"prompt_token_ids": prompts[1]}, sp)
    engine.step()
    page = KVView(engine.decode_tokens).full(capture(engine))
    assert {r["id"]: r["lora"] for r in page["requests"]} == {"a": "attn", "b": None}
    while engine.has_unfinished_requests():
        engine.step()


def test_bf16_rank16_adapters_equal_the_float_run_and_keep_their_pairs(tiny_llama, setup):
    """bf16 with max_lora_rank 16 (the compiled loop's AMX tiles where the CPU has them): BT's
    rank pairs (LoRAWeights.BTP, made at load) stay BT's as slots are filled and replaced, and
    the mixed batch's tokens match the float32 run's on most prompts (bf16 rounding may flip a few)."""
    import torch
    from pagedserve.kernels import cpu
    batch_prompts, loras, expected = mixed(setup)
    llm = make_llm(tiny_llama, dtype="bfloat16", max_lora_rank=16, max_loras=2)
    got = run(llm, batch_prompts, loras)
    weights = llm.engine.runner.lora
    assert weights.pack and weights.BTP, "bf16 on the CPU keeps BT in rank pairs"
    for module, bt in weights.BT.items():
        assert torch.equal(weights.BTP[module], cpu.lora_pack_bt(bt)), module
    for slot in range(2):        # a range short of every slot (a view) still hands the kernel its pairs
        weights.last_range = (-1, -1)
        step = weights.step([slot], [1])
        table = cpu.LoraTable(weights.args.num_layers, step.compiled_key(),
                              *step.compiled_weights())
        assert (step.lo, step.hi) == (slot, slot) and table.ok
        assert all(table.rows[i].btp != 0 for i in range(len(table.rows)) if table.rows[i].a), slot
    same = sum(g[:2] == e[:2] for g, e in zip(got, expected))
    assert same >= len(expected) * 3 // 4, (same, len(expected))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_deltas_handed_to_the_quantized_base_product_change_nothing(tiny_llama, setup, dtype):
    """Quantized weights (q8_0 at load) with adapters, bf16 and float32 activations: the compiled loop hands each
    delta to the base product before it (cpu_kernels.cpp project_lora: its adapter weights
    fetched ahead, the delta run at the product's end in the same OpenMP meeting), on the
    integer dots (4 rows) and on the AMX tiles (12 rows: AMX-BF16 for bf16, AMX-INT8 for
    float32 where the CPU has them) alike. That changes no value:
    the tokens and every logprob equal those of the delta on its own, bit for bit; the adapters
    are there (the tokens differ from the base model's) and the Python loop agrees with the
    compiled one."""
    from pagedserve.kernels import cpu
    batch_prompts, loras, _ = mixed(setup)
    llm = make_llm(tiny_llama, dtype=dtype, quantization="q8_0", max_lora_rank=16, max_loras=3,
                   enable_prefix_caching=False)
    model = llm.engine.runner.model
    if model.compiled_layers is None or not model.compiled_layers.layers.quantized:
        pytest.skip("no compiled loop over quantized weights here")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1, prompt_logprobs=1)

    def outputs(prompts, lora_requests):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                            lora_request=lora_requests)
        return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs],
                 [sorted(d.items()) for d in o.prompt_logprobs[1:]]) for o in outs]

    for n in (4, len(batch_prompts)):        # decode batches of 4 rows (integer dots), 12 (AMX tiles)
        prompts, requests = batch_prompts[:n], loras[:n]
        outputs(prompts, requests)     # the adapters into their slots: every run after batches the same rows
        before = cpu.lora_handovers()
        fetched = outputs(prompts, requests)
        assert cpu.lora_handovers() > before, "no delta was handed to a base product"
        try:
            cpu.set_lora_handover(False)
            plain = outputs(prompts, requests)
        finally:
            cpu.set_lora_handover(True)
        assert fetched == plain
    base = outputs(batch_prompts, [None] * len(batch_prompts))
    assert sum(f[0] != b[0] for f, b in zip(fetched, base)) >= len(base) // 2, "the adapters must change the tokens"
    compiled = model.compiled_layers
    try:
        model.compiled_layers = None
        python_loop = outputs(batch_prompts, loras)
    finally:
        model.compiled_layers = compiled
    same = sum(f[0][:2] == p[0][:2] for f, p in zip(fetched, python_loop))
    assert same >= len(fetched) * 3 // 4, (same, len(fetched))
    assert_no_blocks_held(llm)


def test_a_cold_adapter_is_read_ahead_while_others_run(tiny_llama, setup):
    """A request whose adapter is in no slot and not in the host cache, arriving while others
    run: the next batch asks the worker to read it in the background (lora_reads), the request
    is admitted a step later, its load only copies, and every output equals peft's."""
    _, prompts, requests, want = setup
    llm = make_llm(tiny_llama)
    engine, weights = llm.engine, llm.engine.runner.lora
    reads, prepared_in = [], []
    prefetch, prepare = weights.prefetch, weights._prepare
    weights.prefetch = lambda i, p: (reads.append(i), prefetch(i, p))[1]
    weights._prepare = lambda key: (prepared_in.append((threading.current_thread().name, torch.get_num_threads())),
                                    prepare(key))[1]
    threads = torch.get_num_threads()
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request("base", {"prompt_token_ids": prompts[1]}, sp)
    engine.step()
    engine.add_request("cold", {"prompt_token_ids": prompts[0]}, sp, lora_request=requests["all7"])
    engine.step()
    assert [r.request_id for r in engine.scheduler.waiting] == ["cold"], "admitted once its read is under way"
    assert reads == [1]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["cold"].outputs[0].token_ids == want["all7"][0]
    assert done["base"].outputs[0].token_ids == want[None][1]
    # Read in the background on one OpenMP thread (more OpenMP threads than CPUs would slow every
    # later step); the engine's thread keeps its count.
    assert prepared_in and all(name.startswith("lora-read") and n == 1 for name, n in prepared_in), prepared_in
    assert torch.get_num_threads() == threads
    assert_no_blocks_held(llm)


def test_read_ahead_keeps_the_host_cache_bound_and_leaves_errors_to_the_load(tiny_llama, setup, tmp_path):
    root, _, requests, _ = setup
    llm = make_llm(tiny_llama, max_loras=1, max_cpu_loras=2)
    weights = llm.engine.runner.lora
    for lora in requests.values():
        if lora is not None:
            weights.prefetch(lora.lora_int_id, lora.lora_path)
    weights.prefetch(99, str(tmp_path / "nowhere"))      # a bad path: no error here
    for lora in requests.values():
        if lora is not None:
            weights.load(lora_weights.LoRALoad(0, lora.lora_int_id, lora.lora_path))
            assert len(weights.host) <= 2
    held = weights.held[0]
    with pytest.raises(InvalidRequestError, match="not a directory"):
        weights.load(lora_weights.LoRALoad(0, 99, str(tmp_path / "nowhere")))
    assert weights.held[0] == held          # the slot keeps what it held
