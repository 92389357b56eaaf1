"""benchmarks/gpu_check.py --dry-run: every section end to end with tiny shapes (on the CPU
here: the Triton kernels interpreted), so that the GPU run's script does not rot."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def test_dry_run_runs_every_section(tmp_path):
    out = tmp_path / "gpu_check.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--json", str(out)], capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["dry_run"] and set(r["seconds"]) == {"kernels", "decode", "engine", "model_8b", "paper"}
    kernels = r["kernels"]["rows"]
    assert kernels and all(k["ok"] for k in kernels)
    assert {k["dtype"] for k in kernels} >= {"bfloat16", "float16"} and {k["block_size"] for k in kernels} == {16, 32}
    assert r["decode"]["rows"] and all("contiguous_us" in row for row in r["decode"]["rows"])
    assert r["engine"]["float32_equal"] and set(r["engine"]["runs"]) == {"float32 graphs", "float32 eager"}
    assert r["engine"]["graph_steps"]["float32"] > 0       # the padded buffers ran the decode steps
    tp = r["model_8b"]["eager"]["throughput"]
    assert tp["completed"] and tp["requests_finished"] == r["model_8b"]["trace"]["num_requests"]
    paper = r["paper"]["allocators"]
    assert set(paper) == {"paged", "oracle", "max"} and all(a["steps"] == 20 for a in paper.values())
    assert paper["max"]["avg_batch"] <= 4 < paper["paged"]["avg_batch"]   # Orca-Max: 4 max-length reservations
    for title in ("-- 1.", "-- 2.", "-- 3.", "-- 4.", "-- 5."):
        assert title in res.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU this would start the full run")
def test_without_a_gpu_only_the_dry_run_runs():
    res = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--dry-run" in res.stderr


def test_time_boxes_shrink_to_fit_the_budget():
    from benchmarks import gpu_check as gc
    plan, res = gc.full_plan(), {}
    gc.fit_time_boxes(plan, "model_8b", 1000.0, list(gc.SECTIONS), res)      # time enough: unchanged
    assert plan.throughput_seconds == 60 and not res
    paper_need = gc.PAPER_OVERHEAD + 3 * (plan.paper_warmup_seconds + plan.paper_seconds)
    gc.fit_time_boxes(plan, "model_8b", paper_need + gc.MODEL_8B_OVERHEAD + 2 * 30, list(gc.SECTIONS), res)
    assert plan.throughput_seconds == 30 and res["time_boxes_shortened"]["throughput_seconds"] == [60, 30]
    gc.fit_time_boxes(plan, "paper", gc.PAPER_OVERHEAD + 3 * (plan.paper_warmup_seconds + 10), list(gc.SECTIONS), res)
    assert plan.paper_seconds == 10
