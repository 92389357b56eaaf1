"""LoRA adapters that change (issue 51): prefix-cache blocks are keyed by the adapter's id and a
fingerprint of its files, never its name (offline and in the data-parallel router's keys); an
adapter whose files are truncated after it was checked fails its own requests only, not the
other requests of its step nor the engine; adapter configs of the wrong types are refused with
a clear error; a name cannot forge a log line."""
from __future__ import annotations

import json
import shutil

import pytest

from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.engine.llm_engine import RequestsFailed
from pagedserve.lora.adapter import LoRAAdapterError, read_adapter
from tests.lora_utils import make_adapter, oracle_greedy

MAX_TOKENS = 6
# Long enough for several full 16-token blocks, so a second request could take them from the cache.
TEXT = ("Paged attention stores keys and values in fixed-size blocks, so continuous batching can schedule "
        "every running sequence at each iteration without copying its cache around.")


@pytest.fixture(scope="module")
def two(tiny_llama, tmp_path_factory):
    """Two different adapters on disk, the prompt and each one's oracle tokens."""
    root = tmp_path_factory.mktemp("lora_changes")
    prompt = tiny_llama.tokenizer.encode(TEXT)
    want = {}
    for seed, name in enumerate(("a", "b")):
        want[name] = oracle_greedy(make_adapter(tiny_llama.hf, root / name, seed + 40, rank=4, alpha=8), prompt,
                                   MAX_TOKENS)
    assert want["a"] != want["b"]
    return root, prompt, want


def make_llm(tm, **kw) -> LLM:
    return LLM(tm.path, dtype="float32", num_gpu_blocks_override=64, enable_lora=True, max_lora_rank=8,
               enable_prefix_caching=True, **kw)


def greedy(llm, prompt, lora):
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                      ignore_eos=True),
                       use_tqdm=False, lora_request=lora)
    return out[0].outputs[0].token_ids


def test_one_name_with_other_ids_or_files_shares_no_block(tiny_llama, two):
    """The issue's garbage: the same name, another id and other files, took the first one's
    cached prompt blocks. Now it computes its own (no prefix hit) and gives its own tokens."""
    root, prompt, want = two
    llm = make_llm(tiny_llama, max_loras=2)
    assert greedy(llm, prompt, LoRARequest("reused", 1, str(root / "a"))) == want["a"]
    hits = llm.kv_cache_stats()["prefix_cache_hits"]
    assert greedy(llm, prompt, LoRARequest("reused", 2, str(root / "b"))) == want["b"]
    assert llm.kv_cache_stats()["prefix_cache_hits"] == hits
    # The same adapter (id and files) again: its blocks are found.
    assert greedy(llm, prompt, LoRARequest("reused", 2, str(root / "b"))) == want["b"]
    assert llm.kv_cache_stats()["prefix_cache_hits"] > hits


def test_the_router_keys_by_id_and_content_as_the_engine_does(two, tmp_path):
    """cluster/client.py's prompt salt: another id or other files are other keys, one name
    is not a key; equal to the engine's LoRARequest.cache_key for the checked adapter."""
    from pagedserve.cluster.client import _prompt_ids
    from pagedserve.lora.adapter import adapter_fingerprint
    root, prompt, _ = two
    shutil.copytree(root / "a", tmp_path / "a")
    salt = lambda lora: _prompt_ids({"prompt_token_ids": prompt, "lora_request": lora}, None)[1]  # noqa: E731
    first = salt(LoRARequest("reused", 1, str(tmp_path / "a")))
    assert salt(LoRARequest("reused", 2, str(root / "b"))) != first
    assert salt(LoRARequest("other", 1, str(tmp_path / "a"))) == first       # the name is no part of it
    checked = LoRARequest("reused", 1, str(tmp_path / "a"), fingerprint=adapter_fingerprint(str(tmp_path / "a")))
    assert first == ("lora", checked.cache_key, None)


def _step_until_done(engine) -> tuple[dict, dict]:
    """Step the engine until idle, as AsyncLLM does: failed requests collected, the rest's outputs."""
    done, failed = {}, {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        try:
            outs = engine.step()
        except RequestsFailed as e:
            assert engine.recover(e).fatal is None
            failed.update(e.failures)
            outs = e.outputs
        done.update({o.request_id: o for o in outs if o.finished})
    return done, failed


def test_an_adapter_truncated_on_disk_fails_only_its_own_requests(tiny_llama, two, tmp_path):
    """One slot and one host-cache entry: adapter a is pushed out by b, then truncated on disk (an
    rsync in progress); its next read happens in a step where a base request runs too. Only a's
    request fails, naming the adapter; the base request's tokens are right; later steps go on."""
    root, prompt, want = two
    for name in ("a", "b"):
        shutil.copytree(root / name, tmp_path / name)
    a, b = LoRARequest("a", 1, str(tmp_path / "a")), LoRARequest("b", 2, str(tmp_path / "b"))
    llm = make_llm(tiny_llama, max_loras=1, max_cpu_loras=1)
    assert greedy(llm, prompt, a) == want["a"]
    assert greedy(llm, prompt, b) == want["b"]
    weights = tmp_path / "a" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request("base", {"prompt_token_ids": prompt}, params)
    engine.add_request("of_a", {"prompt_token_ids": prompt}, params, lora_request=a)
    done, failed = _step_until_done(engine)
    assert set(failed) == {"of_a"} and "LoRA adapter 1" in str(failed["of_a"]), failed
    assert done["base"].outputs[0].token_ids == greedy(make_llm(tiny_llama, max_loras=1), prompt, None)
    # The adapter is checked again at its next request: its files are broken, so it is refused.
    with pytest.raises(LoRAAdapterError, match="adapter_model.safetensors cannot be read"):
        greedy(llm, prompt, a)
    assert greedy(llm, prompt, b) == want["b"]


@pytest.mark.parametrize("config, why", [
    ([1, 2], "must hold a JSON object"),
    (None, "must hold a JSON object"),
    ({"r": 4, "lora_alpha": "x"}, "lora_alpha must be a number"),
    ({"r": 4, "lora_alpha": None}, "lora_alpha must be a number"),
    ({"r": 4, "target_modules": [5]}, "target_modules must be a string or a list of strings"),
    ({"r": True}, "r must be an int"),
    ({"r": 4, "use_rslora": "yes"}, "use_rslora must be true or false"),
])
def test_adapter_configs_of_the_wrong_types_are_refused(tiny_llama, two, tmp_path, config, why):
    root, _, _ = two
    shutil.copytree(root / "a", tmp_path / "a")
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config))
    from pagedserve.models.loader import args_from_hf_config, read_hf_config
    with pytest.raises(LoRAAdapterError, match=why):
        read_adapter(str(tmp_path / "a"), "bad", args_from_hf_config(read_hf_config(tiny_llama.path)), 8)


def test_a_name_with_a_control_character_is_refused():
    for name in ("evil\nERROR forged", "tab\there", "nul\0"):
        with pytest.raises(ValueError, match="printable"):
            LoRARequest(name, 1, "/x")
