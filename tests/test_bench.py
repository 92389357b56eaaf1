"""`pagedserve bench latency | throughput | serve` on a tiny random model: each prints its table
and writes JSON whose counts match the requests it was asked for."""
import json

from pagedserve import cli
from pagedserve.bench import datasets, report


def test_datasets_give_the_asked_lengths():
    trace = datasets.dataset_trace("random", 5, 7, 3, seed=1, vocab_size=400)
    assert [(len(r.prompt_token_ids), r.output_len) for r in trace] == [(7, 3)] * 5
    assert all(0 <= t < 400 for r in trace for t in r.prompt_token_ids)
    alpaca = datasets.dataset_trace("alpaca-like", 64, 0, 0, seed=1, vocab_size=49152)
    assert 10 < sum(len(r.prompt_token_ids) for r in alpaca) / 64 < 30      # the paper's mean 19
    assert report.percentiles([1.0, 2.0, 3.0], [50])["p50"] == 2.0


def test_bench_latency(tiny_llama, tmp_path, capsys):
    out = tmp_path / "latency.json"
    assert cli.main(["bench", "latency", "--model", tiny_llama.path, "--dtype", "float32", "--input-len", "8",
                     "--output-len", "4", "--batch-size", "2", "--num-iters-warmup", "1", "--num-iters", "2",
                     "--output-json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Latency Benchmark Result" in text and "Avg latency (s)" in text and "P99 latency (s)" in text
    result = json.loads(out.read_text())
    assert len(result["latencies"]) == 2 and result["avg_latency"] > 0
    assert result["config"]["batch_size"] == 2 and "cpu_flags" in result["machine"]


def test_bench_throughput(tiny_llama, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    assert cli.main(["bench", "throughput", "--model", tiny_llama.path, "--dtype", "float32", "--num-prompts", "5",
                     "--input-len", "8", "--output-len", "6", "--output-json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Throughput Benchmark Result" in text and "Output token throughput (tok/s)" in text
    result = json.loads(out.read_text())
    assert result["pagedserve"]["output_tokens"] == 30 and result["pagedserve"]["prompt_tokens"] == 40
    assert result["requests_per_s"] > 0


def test_bench_serve(tiny_llama, tmp_path, capsys):
    out = tmp_path / "serve.json"
    assert cli.main(["bench", "serve", "--model", tiny_llama.path, "--server-args", "--dtype float32",
                     "--num-prompts", "4", "--input-len", "8", "--output-len", "5",
                     "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                     "--output-json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Serving Benchmark Result" in text and "Mean TTFT (ms)" in text and "P99 E2EL (ms)" in text
    run = json.loads(out.read_text())["runs"]["continuous"]
    assert run["completed"] == 4 and run["failed"] == 0 and run["total_output_tokens"] == 20
    assert run["total_input_tokens"] == 32 and run["p50_tpot_ms"] > 0
