"""A drop-in for vLLM users (issue 23): flags generated from the config dataclasses, vLLM's units
and names, the LLM API's extra methods, SamplingParams' extra fields (against transformers),
generation_config defaults, chat templates, models by Hub id, threads."""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, RequestOutputKind, SamplingParams
from pagedserve.cli import add_config_args, build_parser, config_from_args, main
from pagedserve.config import EngineConfig, parse_size, setting
from pagedserve.server.config import ServerConfig

ROOT = Path(__file__).resolve().parents[1]


def make_llm(tm, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("num_gpu_blocks_override", 128)
    kw.setdefault("check_invariants", True)
    return LLM(tm.path, **kw)


# ---- flags ----------------------------------------------------------------------------------------
def serve_parser():
    parser = build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices["serve"]


def test_every_config_field_is_a_flag():
    flags = {opt for action in serve_parser()._actions for opt in action.option_strings}
    for cls in (EngineConfig, ServerConfig):
        for f in dataclasses.fields(cls):
            assert "--" + f.name.replace("_", "-") in flags, f.name
    assert {"--no-enable-prefix-caching", "--enable-prefix-caching", "--threads", "--kv-cache-memory-bytes",
            "--disable-log-requests", "--enable-log-requests"} <= flags
    text = serve_parser().format_help()
    assert "(default: 256)" in text and "(default: 127.0.0.1)" in text   # help shows defaults


def test_a_new_field_becomes_a_flag_with_no_other_edit():
    @dataclasses.dataclass
    class Config:
        plain: int = 3                                   # declared the old way: still a flag
        size: int | None = setting(None, "a size", parse=parse_size)
        on: bool = setting(True, "a switch")
        disable_thing: bool = setting(False, "turn it off")
        names: list[str] = setting(default_factory=list, help="names")
        mode: str = setting("a", "a mode", choices=("a", "b"))

    import argparse
    p = argparse.ArgumentParser()
    add_config_args(p, Config)
    assert config_from_args(Config, p.parse_args([])) == Config()
    got = config_from_args(Config, p.parse_args(["--plain", "5", "--size", "2KiB", "--no-on", "--disable-thing",
                                                 "--names", '["x", "y"]', "--mode", "b"]))
    assert got == Config(plain=5, size=2048, on=False, disable_thing=True, names=["x", "y"], mode="b")
    with pytest.raises(SystemExit):
        p.parse_args(["--mode", "c"])


def test_vllm_units_and_names():
    args = build_parser().parse_args([
        "serve", "org/model", "--kv-cache-memory", "4GiB", "--swap-space", "0.5", "--no-enable-prefix-caching",
        "--dtype", "half", "--allowed-origins", '["http://a.example"]', "--threads", "3",
        "--disable-log-requests", "--generation-config", "vllm", "--max-logprobs", "5", "--trust-remote-code",
        "--metrics-prefix", "vllm:", "--tokenizer", "org/tok", "--num-gpu-blocks-override", "7"])
    engine = config_from_args(EngineConfig, args, model=args.model_tag)
    server = config_from_args(ServerConfig, args)
    assert (engine.model, engine.kv_cache_memory, engine.swap_space_bytes) == ("org/model", 4 * 1024**3, 1024**3 // 2)
    assert not engine.enable_prefix_caching and engine.dtype == "half" and engine.num_threads == 3
    assert (engine.generation_config, engine.max_logprobs, engine.trust_remote_code) == ("vllm", 5, True)
    assert (engine.tokenizer, engine.num_gpu_blocks_override) == ("org/tok", 7)
    assert server.allowed_origins == ["http://a.example"] and server.disable_log_requests
    assert server.metrics_prefix == "vllm:" and server.host == "127.0.0.1"
    assert EngineConfig(kv_cache_memory="512MiB").kv_cache_memory == 512 * 1024**2   # LLM(...) takes sizes too


@pytest.mark.parametrize("text,value", [(1234, 1234), ("1234", 1234), ("4GiB", 4 * 1024**3), ("4gi", 4 * 1024**3),
                                        ("8GB", 8 * 10**9), ("1.5 MiB", 3 * 512 * 1024), ("2k", 2000)])
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_an_option_we_do_not_have_says_so(capsys):
    for flag, words in (("--limit-mm-per-prompt", "vLLM option"), ("--no-such-thing", "unknown option")):
        with pytest.raises(SystemExit) as e:
            main(["serve", flag, "x=y"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "not supported" in err and words in err and flag in err
        assert "unrecognized arguments" not in err


def test_version(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("pagedserve ")


# ---- the LLM API ----------------------------------------------------------------------------------
def test_llm_shows_its_parameters():
    params = inspect.signature(LLM).parameters
    assert list(params)[0] == "model"
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= set(params)
    assert params["block_size"].default == 16 and params["block_size"].kind == inspect.Parameter.KEYWORD_ONLY
    assert "num_threads:" in LLM.__init__.__doc__
    with pytest.raises(TypeError):
        LLM(no_such_setting=1)


def test_llm_engine_metrics_and_reset_prefix_cache(tiny_llama):
    llm = make_llm(tiny_llama, block_size=4)
    assert llm.llm_engine is llm.engine
    prompt = {"prompt_token_ids": list(range(5, 30))}
    params = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    metrics = {m.name: m.value for m in llm.get_metrics()}
    assert metrics["pagedserve:prefix_cache_hits"] == again.num_cached_tokens
    assert metrics["pagedserve:num_requests_running"] == 0 and "pagedserve:kv_cache_usage_perc" in metrics
    assert llm.reset_prefix_cache()
    after = llm.generate(prompt, params, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0 and after.outputs[0].token_ids == first.outputs[0].token_ids
    llm.engine.add_request("busy", prompt, params)
    assert not llm.reset_prefix_cache()          # not while a request runs
    llm.engine.abort_request("busy")


# ---- SamplingParams' extra fields, against transformers ---------------------------------------------
def hf_generate(tm, prompt_ids: list[int], n: int, **kw) -> list[int]:
    with torch.no_grad():
        out = tm.hf.generate(torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=tm.hf.config.eos_token_id, **kw)
    return out[0, len(prompt_ids):].tolist()


def test_allowed_token_ids_match_transformers(tiny_llama):
    ids = tiny_llama.tokenizer.encode("The quick brown fox")
    llm = make_llm(tiny_llama)
    plain = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8, min_tokens=8),
                         use_tqdm=False)[0].outputs[0].token_ids
    allowed = sorted({5, 17, 40, 77, 120, 250} - {plain[0]})
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8, min_tokens=8,
                                                                 allowed_token_ids=allowed),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert set(out) <= set(allowed) and out != plain
    assert out == hf_generate(tiny_llama, ids, 8, prefix_allowed_tokens_fn=lambda batch, sent: allowed)


def test_bad_words_match_transformers(tiny_llama):
    ids = tiny_llama.tokenizer.encode("Once upon a time")
    llm = make_llm(tiny_llama)
    plain = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8, min_tokens=8),
                         use_tqdm=False)[0].outputs[0].token_ids
    word = next(w for w in (tiny_llama.tokenizer.decode([t]).strip() for t in plain) if w)
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, bad_words=[word])
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids
    banned = params.bad_words_token_ids
    assert banned and out != plain
    assert out == hf_generate(tiny_llama, ids, 8, bad_words_ids=banned)


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny_llama):
    ids = list(range(10, 40))
    llm = make_llm(tiny_llama)
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6)
    cut = llm.generate({"prompt_token_ids": ids}, dataclasses.replace(params, truncate_prompt_tokens=7),
                       use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-7:]
    assert cut.outputs[0].token_ids == hf_generate(tiny_llama, ids[-7:], 6)


def test_output_kind_delta_and_final_only(tiny_llama, monkeypatch):
    """Slowed steps (tests/fault_server.py SLOW_STEPS: the engine thread sleeps 20 ms a step) let the
    caller take each delta as it comes, so that DELTA yields more than one, on any machine."""
    from pagedserve.engine.async_llm import AsyncLLM
    from tests import fault_server
    fault_server.install(monkeypatch.setattr)

    async def run():
        llm = AsyncLLM(EngineConfig(model=tiny_llama.path, dtype="float32", num_gpu_blocks_override=64),
                       log_interval=None)
        llm.start()
        await llm.wait_started()
        try:
            outs = {}
            for kind in RequestOutputKind:
                params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, output_kind=kind)
                outs[kind] = [o async for o in llm.generate(f"The quick brown fox {fault_server.SLOW_STEPS}", params,
                                                            kind.name)]
            return outs
        finally:
            await llm.shutdown()
    outs = asyncio.run(run())
    final = outs[RequestOutputKind.CUMULATIVE][-1].outputs[0]
    assert len(outs[RequestOutputKind.FINAL_ONLY]) == 1 and outs[RequestOutputKind.FINAL_ONLY][0].finished
    assert outs[RequestOutputKind.FINAL_ONLY][0].outputs[0].token_ids == final.token_ids
    deltas = [o.outputs[0] for o in outs[RequestOutputKind.DELTA]]
    assert len(deltas) > 1 and sum((d.token_ids for d in deltas), []) == final.token_ids
    assert "".join(d.text for d in deltas) == final.text


# ---- the model's generation config, chat templates -------------------------------------------------------
@pytest.fixture
def model_copy(tiny_llama, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(tiny_llama.path, path)
    return path


def test_generation_config_gives_the_defaults(tiny_llama, model_copy):
    (model_copy / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5,
                                                                   "eos_token_id": 10**6}))
    ids = tiny_llama.tokenizer.encode("Paged attention stores")
    llm = LLM(str(model_copy), dtype="float32", num_gpu_blocks_override=64)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
    out = llm.generate({"prompt_token_ids": ids}, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == hf_generate(tiny_llama, ids, 5)
    plain = LLM(str(model_copy), dtype="float32", num_gpu_blocks_override=64, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()


def test_chat_template_from_a_string_or_a_file(tiny_llama, tmp_path):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}" \
               "{% if add_generation_prompt %}[assistant]{% endif %}{{ extra or '' }}"
    file = tmp_path / "template.jinja"
    file.write_text(template)
    tok = tiny_llama.tokenizer
    conv = [{"role": "user", "content": "hello there"}]
    llm = make_llm(tiny_llama, chat_template=str(file))   # the engine's template, from a file
    params = SamplingParams(temperature=0, max_tokens=2)
    out = llm.chat(conv, params, use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.encode("[user] hello there\n[assistant]", add_special_tokens=False)
    out = llm.chat(conv, params, use_tqdm=False, chat_template=template.replace("] {{", "]: {{"),
                   chat_template_kwargs={"extra": " ok"})[0]
    assert out.prompt_token_ids == tok.encode("[user]: hello there\n[assistant] ok", add_special_tokens=False)
    out = llm.chat(conv + [{"role": "assistant", "content": "I am"}], params, use_tqdm=False,
                   add_generation_prompt=False, continue_final_message=True)[0]
    assert tok.decode(out.prompt_token_ids).rstrip().endswith("[assistant] I am")


# ---- models by name ------------------------------------------------------------------------------------
def hub_cache(tiny_llama, root: Path, repo: str) -> Path:
    """A Hugging Face cache holding `repo` as huggingface_hub lays it out."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = root / "hub" / ("models--" + repo.replace("/", "--"))
    shutil.copytree(tiny_llama.path, repo_dir / "snapshots" / commit)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    return root


def run_cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})


def test_a_model_by_hub_id_from_the_cache_offline(tiny_llama, tmp_path):
    home = hub_cache(tiny_llama, tmp_path / "hf", "tiny-org/tiny-llama")
    env = {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    expected = make_llm(tiny_llama).generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=6),
                                             use_tqdm=False)[0].outputs[0].text
    res = run_cli("generate", "--model", "tiny-org/tiny-llama", "--dtype", "float32", "--prompt",
                  "The quick brown fox", "--max-tokens", "6", env=env)
    assert res.returncode == 0, res.stderr
    assert expected in res.stdout
    for model, words in (("tiny-org/missing", "not in the Hugging Face cache"),
                         (str(tmp_path / "nowhere"), "no such file or directory"),
                         (str(tmp_path), "a directory without config.json")):
        res = run_cli("serve", model, env=env)
        assert res.returncode == 2 and words in res.stderr and "Traceback" not in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr


# ---- threads --------------------------------------------------------------------------------------------
def test_cpu_limit_from_the_cgroup_quota(tmp_path):
    from pagedserve.kernels.threads import cgroup_cpu_limit
    proc = tmp_path / "cgroup"
    proc.write_text("0::/box/inner\n")
    (tmp_path / "fs" / "box" / "inner").mkdir(parents=True)
    (tmp_path / "fs" / "box" / "inner" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path / "fs", proc) is None
    (tmp_path / "fs" / "box" / "cpu.max").write_text("150000 100000\n")   # a parent's quota counts too
    assert cgroup_cpu_limit(tmp_path / "fs", proc) == 1.5
    proc.write_text("4:cpu,cpuacct:/job\n")                                # cgroup v1
    (tmp_path / "v1" / "cpu,cpuacct" / "job").mkdir(parents=True)
    (tmp_path / "v1" / "cpu,cpuacct" / "job" / "cpu.cfs_quota_us").write_text("200000\n")
    (tmp_path / "v1" / "cpu,cpuacct" / "job" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(tmp_path / "v1", proc) == 2.0


def test_openmp_defaults_are_set_before_torch_loads():
    code = "import os, pagedserve, torch; print(os.environ.get('GOMP_SPINCOUNT'), os.environ['OMP_NUM_THREADS'], " \
           "torch.get_num_threads())"
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    # The CPUs this process may use: its affinity mask capped by its cgroup quota (a container given
    # 2 CPUs of a larger host has more in its mask).
    from pagedserve.kernels.threads import available_cpus
    cpus = str(available_cpus())
    out = subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["10000", cpus, cpus]
    # What the user set wins.
    out = subprocess.run([sys.executable, "-c", code], env={**clean, "OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, check=True).stdout
    assert out.split() == ["None", "1", "1"]


def test_threads_benchmark_smoke(tiny_llama, tmp_path):
    out = tmp_path / "threads.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "threads.py"), "--quick", "--model",
                          tiny_llama.path, "--dtypes", "float32", "--competitors", "0", "--budget", "0.2",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["setting"], r["competitors"]) for r in rows] == [("old", 0), ("new", 0)]
    assert rows[0]["GOMP_SPINCOUNT"] is None and rows[1]["GOMP_SPINCOUNT"] == "10000"
    assert all(r["tokens"] > 0 and r["ms_per_token"] > 0 for r in rows)
    assert "| float32 | new |" in res.stdout
