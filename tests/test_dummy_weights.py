"""load_format="dummy": random weights of a model's shapes, presets by config only, EOS ignored."""
import json

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.models.dummy import DummyWeights, weight_shapes
from pagedserve.models.loader import args_from_hf_config, load_model
from pagedserve.models.presets import PRESETS

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
            max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, torch_dtype="float32")


@pytest.fixture
def tiny_config_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return str(tmp_path)


# Dummy weights are for the Llama family; the OPT presets are shapes for the simulator (sim/).
LLAMA_FAMILY_PRESETS = sorted(n for n, cfg in PRESETS.items() if cfg["model_type"] != "opt")


def test_opt_presets_refuse_dummy_weights():
    with pytest.raises(ValueError, match="Llama family"):
        LLM("opt-13b", load_format="dummy")


@pytest.mark.parametrize("name", LLAMA_FAMILY_PRESETS)
def test_preset_shapes_are_the_transformers_models(name):
    """Each preset's dummy tensors have exactly the names and shapes of the checkpoint
    transformers would build from that config (on the meta device: nothing allocated)."""
    import transformers
    cfg = dict(PRESETS[name])
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    expected = {k.removeprefix("model."): tuple(v.shape) for k, v in hf.state_dict().items()}
    args = args_from_hf_config(PRESETS[name])
    if args.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert weight_shapes(args) == expected


def test_preset_sizes_are_the_models_sizes():
    def billions(name):
        args = args_from_hf_config(PRESETS[name])
        return sum(torch.Size(s).numel() for s in weight_shapes(args).values()) / 1e9
    assert 8.0 < billions("llama-3-8b") < 8.1          # 8.03B
    assert 13.0 < billions("llama-2-13b") < 13.1       # 13.02B
    assert 1.09 < billions("tinyllama-1.1b") < 1.11    # 1.10B


def test_dummy_weights_are_seeded_made_where_asked_and_shaped():
    args = args_from_hf_config(TINY)
    a, b = DummyWeights(args, torch.bfloat16, "cpu", seed=1), DummyWeights(args, torch.bfloat16, "cpu", seed=1)
    w = a["layers.1.mlp.down_proj.weight"]
    assert w.dtype == torch.bfloat16 and w.shape == (64, 128)
    assert torch.equal(w, b["layers.1.mlp.down_proj.weight"])
    assert 0.015 < w.float().std().item() < 0.025
    assert torch.equal(a["norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    assert not torch.equal(DummyWeights(args, torch.bfloat16, "cpu", seed=2)["layers.1.mlp.down_proj.weight"], w)
    model, _, dtype = load_model("tinyllama-1.1b", "float32", attention=None, load_format="dummy",
                                 device="meta")   # shapes only: the 1.1B model allocates nothing here
    assert dtype == torch.float32 and model.embed.device.type == "meta"
    assert model.layers[0].qkv.shape == (2048 + 2 * 256, 2048) and len(model.layers) == 22


def test_dummy_engine_ignores_eos_and_runs_a_config_dir(tiny_config_dir):
    """A config.json directory without weights or tokenizer: random weights, a stand-in
    tokenizer over the vocabulary, and EOS never ends a sequence (here it is the only
    token the model may pick)."""
    llm = LLM(tiny_config_dir, load_format="dummy", num_gpu_blocks_override=32)
    eos = 2
    bias = SamplingParams(temperature=0, max_tokens=6, logit_bias={eos: 100.0})
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}, "<9> <10>"], bias, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [[eos] * 6] * 2
    assert out[1].prompt_token_ids == [9, 10]
    assert all(o.outputs[0].finish_reason == "length" for o in out)
    greedy = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=6),
                          use_tqdm=False)
    again = LLM(tiny_config_dir, load_format="dummy", num_gpu_blocks_override=32).generate(
        [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert greedy[0].outputs[0].token_ids == again[0].outputs[0].token_ids   # seeded: the same weights


def test_dummy_keeps_a_real_models_config_and_tokenizer(tiny_llama):
    llm = LLM(tiny_llama.path, load_format="dummy", dtype="float32", num_gpu_blocks_override=32)
    assert llm.get_tokenizer().get_vocab() == tiny_llama.tokenizer.get_vocab()
    real = LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=32)
    assert llm.engine.model_args == real.engine.model_args
    assert not torch.equal(llm.engine.runner.model.embed, real.engine.runner.model.embed)


def test_presets_need_the_dummy_format_and_unknown_names_are_refused():
    with pytest.raises(ValueError, match="load_format='dummy'"):
        LLM("llama-3-8b")
    with pytest.raises(FileNotFoundError, match="llama-3-8b"):   # the error lists the presets
        LLM("llama-9-8b", load_format="dummy")
    with pytest.raises(ValueError, match="load_format"):
        LLM("llama-3-8b", load_format="pt")


def test_cli_flags_reach_the_engine_config():
    import argparse
    from pagedserve.cli import add_config_args, engine_config
    from pagedserve.config import EngineConfig
    p = argparse.ArgumentParser()
    add_config_args(p, EngineConfig)
    config = engine_config(p.parse_args(["--load-format", "dummy", "--enforce-eager"]), model="llama-3-8b")
    assert config.load_format == "dummy" and config.enforce_eager
    defaults = engine_config(p.parse_args([]))
    assert defaults.load_format == "auto" and not defaults.enforce_eager


def test_serve_a_preset_with_dummy_weights_starts_offline(tmp_path):
    """`pagedserve serve <preset> --load-format dummy` needs no files and no network: the engine
    and the front end both take the stand-in tokenizer (engine/tokenizer.py), and the text the
    server returns is the engine's."""
    import httpx

    from pagedserve.server.launcher import launch_server
    server = launch_server("smollm2-135m", ["--load-format", "dummy", "--dtype", "float32", "--max-model-len", "128",
                                            "--kv-cache-memory", str(4 << 20), "--disable-uvicorn-access-log"],
                           tmp_path / "server.log", env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            ids = http.post("/tokenize", json={"prompt": "<5> <6> <7>"}).json()["tokens"]
            assert ids[-3:] == [5, 6, 7]
            body = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 4, "temperature": 0,
                                                      "logprobs": 1}).json()
            choice = body["choices"][0]
            assert body["usage"]["completion_tokens"] == 4
            tokens = choice["logprobs"]["tokens"]
            assert len(tokens) == 4 and all(t.startswith("<") for t in tokens)   # the stand-in's words
            assert choice["text"].split() == [t.strip() for t in tokens]
    finally:
        server.stop()
