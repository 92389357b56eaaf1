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
