"""benchmarks/variant_ab.py: children alternate the quant variants on one file, and each reports the
variant it ran (so a result's label is the variant that ran, not the one a command line meant) and each
round's share of the bound its own read probe sets."""
import json
import sys
from pathlib import Path

import pytest

from pagedserve.kernels import quant
from pagedserve.models.loader import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import variant_ab  # noqa: E402


def test_tokenizer_dir_is_the_shape_folder_beside_the_file():
    assert variant_ab.tokenizer_dir("/f/gemma3-4b-shape-Q4_K_M-llama.gguf") == "/f/gemma3-4b-shape"
    assert variant_ab.tokenizer_dir("/f/smollm2-1.7b-shape-Q8_0.gguf") == "/f/smollm2-1.7b-shape"
    assert variant_ab.tokenizer_dir("/f/SmolLM2-135M-Instruct.Q4_1.gguf") is None
    assert variant_ab.summary([30.0, 10.0, 20.0], [0.5, 0.9, 0.7]) == dict(median_tok_s=50.0, best_tok_s=100.0,
                                                                           rounds=3, median_of_bound=0.7)
    assert variant_ab.summary([10.0], [])["median_of_bound"] is None


def test_each_child_runs_and_reports_its_variant(tmp_path, monkeypatch):
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    variants = quant.supported_variants()[:1]      # (one child: a few seconds)
    out = tmp_path / "ab.json"
    monkeypatch.setattr(sys, "argv", ["variant_ab.py", "--variants", ",".join(variants), "--pairs", "1",
                                      "--rounds", "1", "--decode-len", "3", "--json", str(out)])
    variant_ab.main()
    (row,) = json.loads(out.read_text())["results"]
    assert row["file"].endswith(".gguf")
    for v in variants:
        assert len(row["runs_ms"][v]) == 1 and row[v]["rounds"] == 1 and row[v]["median_tok_s"] > 0
        # the round's share of the bound: its weights a token at its own probe's rate (a fraction, not a guess)
        (share,) = row["of_bound"][v]
        assert 0.0 < share == row[v]["median_of_bound"] < 10      # (a unit slip would be 1000x)


def test_llama_bench_decodes_at_our_rounds_depth_and_prefills_from_empty(tmp_path):
    """llama-bench's -d applies to every test of a run, so the prefill (from an empty context, as ours)
    and the decode (after the 128-token prompt our rounds decode after) are runs of their own. A stand-in
    executable answers each run with the row llama-bench would print for its arguments."""
    import quantized
    exe = tmp_path / "llama-bench"
    exe.write_text(f"""#!{sys.executable}
import json, sys
a = sys.argv[1:]
arg = lambda flag, default=0: int(a[a.index(flag) + 1]) if flag in a else default
with open({str(tmp_path / 'calls')!r}, "a") as f:
    f.write(" ".join(a) + "\\n")
p, n, d = arg("-p"), arg("-n"), arg("-d")
print(json.dumps([dict(n_prompt=p, n_gen=n, n_depth=d, avg_ts=1000.0 / (p + n + d), samples_ts=[1.0, 2.0])]))
""")
    exe.chmod(0o755)
    out = quantized.llama_bench(str(exe), "m.gguf", 2, 512, 64)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls == ["-m m.gguf -t 2 -p 512 -n 0 -o json", "-m m.gguf -t 2 -p 0 -n 64 -d 128 -o json"]
    assert out["prefill_tok_s"] == 1000.0 / 512 and out["decode_tok_s"] == 1000.0 / (64 + 128)
    assert out["decode_depth"] == quantized.DECODE_PROMPT_LEN == 128
    (tmp_path / "calls").unlink()
    out = quantized.llama_bench(str(exe), "m.gguf", 2, 0, 16, repetitions=3)     # variant_ab's: decode alone
    assert (tmp_path / "calls").read_text().splitlines() == ["-m m.gguf -t 2 -p 0 -n 16 -d 128 -r 3 -o json"]
    assert "prefill_tok_s" not in out and out["decode_rounds_tok_s"] == [1.0, 2.0]
