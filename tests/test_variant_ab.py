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
