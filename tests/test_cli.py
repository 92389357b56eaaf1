"""The command line, run as a user would (a subprocess), on a tiny model."""
import subprocess
import sys


def run_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


def test_generate_prints_the_completion(tiny_llama):
    from pagedserve import LLM, SamplingParams
    expected = LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=64).generate(
        "The quick brown fox", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].text
    res = run_cli("generate", "--model", tiny_llama.path, "--dtype", "float32", "--prompt", "The quick brown fox",
                  "--max-tokens", "8")
    assert res.returncode == 0, res.stderr
    assert "--- prompt: 'The quick brown fox'" in res.stdout
    assert expected in res.stdout


def test_chat_answers_each_message(tiny_llama):
    res = run_cli("chat", "--model", tiny_llama.path, "--max-tokens", "5", stdin="hello\nhow are you\n")
    assert res.returncode == 0, res.stderr
    replies = [line for line in res.stdout.split("\n") if line.startswith("> ") and line[2:].strip()]
    assert len(replies) == 2       # one reply per message, then the prompt again at end of input


def test_the_data_parallel_settings_are_the_servers_and_llm_still_takes_them(caplog):
    """data_parallel_size, routing_policy, ray_address: ServerConfig's (the same serve flags);
    LLM accepts them as vLLM's does and runs one engine."""
    import dataclasses

    import pytest

    from pagedserve.cli import build_parser, config_from_args
    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm import _drop_serving_topology
    from pagedserve.server.config import ServerConfig
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert not {"data_parallel_size", "routing_policy", "ray_address"} & engine_fields
    args = build_parser().parse_args(["serve", "m", "-dp", "2", "--routing-policy", "least_loaded"])
    s = config_from_args(ServerConfig, args)
    assert (s.data_parallel_size, s.routing_policy, s.ray_address) == (2, "least_loaded", None)
    with pytest.raises(ValueError, match="routing_policy"):
        ServerConfig(routing_policy="nope")
    kwargs = {"data_parallel_size": 2, "routing_policy": "kv_aware", "dtype": "float32"}
    _drop_serving_topology(kwargs)
    assert kwargs == {"dtype": "float32"} and "ignored here" in caplog.text
