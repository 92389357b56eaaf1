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
    assert r["dry_run"] and set(r["seconds"]) == {"basics", "kernels", "decode", "engine", "model_8b", "paper"}
    assert set(r["peak_memory_gib"]) == set(r["seconds"])
    assert sum(r["seconds"].values()) < 540 and not r["time_boxes_shortened"]   # within the default budget
    basics = r["basics"]
    assert basics["ok"] and basics["copy_on_write_past_2_31"]["elements"] > 2**31
    assert basics["attention_past_2_31"]["largest_offset"] > 2**31
    for key in r["seconds"]:                       # a verdict line per section, as it ends
        assert f"[gpu_check] {key}: ok in" in res.stdout
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
    assert r["engine"]["runs"]["float32 eager"]["equal_to_first_near_tie"] == r["engine"]["prompts"]
    for title in ("-- 0.", "-- 1.", "-- 2.", "-- 3.", "-- 4.", "-- 5."):
        assert title in res.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU this would start the full run")
def test_without_a_gpu_only_the_dry_run_runs():
    res = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--dry-run" in res.stderr


def test_time_boxes_shrink_to_what_is_left_with_measured_overheads(monkeypatch):
    """Each time box is fit when it starts, from the budget left and the overheads measured
    so far: section 4's load (with CUDA graph capture) stands in, scaled by the weights, for
    section 5's until that one is loaded and measured. The clock stands still (a loaded
    machine's pause between two lines would otherwise spend the budget)."""
    import types

    from benchmarks import gpu_check as gc
    monkeypatch.setattr(gc, "time", types.SimpleNamespace(perf_counter=lambda: 1000.0))
    plan = gc.full_plan()
    paper_boxes = 3 * (plan.paper_warmup_seconds + plan.paper_seconds)
    budget = gc.Budget(1000.0, start=gc.time.perf_counter())
    assert budget.throughput_box(plan, 2, True) == 60 and not budget.shortened      # time enough
    budget = gc.Budget(gc.PAPER_OVERHEAD_GUESS + paper_boxes + 2 * 30 + 1, start=gc.time.perf_counter())
    assert 29 < budget.throughput_box(plan, 2, True) < 31                             # nothing measured: the guess
    budget.measured["model_8b_load"] = 80.0                                           # a slow load, measured
    box = budget.throughput_box(plan, 2, True)
    assert box == 10.0 and budget.shortened["throughput_seconds"] == [60, 10.0]      # floor: 10 s
    budget = gc.Budget(300.0, start=gc.time.perf_counter(), measured={"model_8b_load": 40.0})
    need = budget.paper_need(plan)
    assert abs(need - (40.0 * gc.PAPER_OVER_8B_LOAD + paper_boxes)) < 1e-9
    budget.measured["paper_load"] = 20.0
    assert budget.paper_need(plan) == 20.0 + paper_boxes
    budget = gc.Budget(3 * (plan.paper_warmup_seconds + 10) + 0.5, start=gc.time.perf_counter())
    assert 9.5 < budget.paper_window(plan) <= 10.2
    dry = gc.Budget(1.0, enabled=False)
    assert dry.throughput_box(plan, 1, True) == 60 and dry.paper_window(plan) == plan.paper_seconds


def test_greedy_agreement_stops_at_the_first_near_tie():
    from benchmarks import gpu_check as gc
    ref = [[5, 6, 7, 8], [1, 2, 3, 4]]
    gaps = [[2.0, 1e-4, 3.0, 3.0], [2.0, 2.0, 2.0, 2.0]]
    other = [[5, 6, 9, 9], [1, 2, 3, 4]]       # parts after prompt 0's near tie at step 1
    a = gc.agreement(ref, other, gaps)
    assert a["prompts_equal"] == 1 and a["equal_to_first_near_tie"] == 2 and a["first_near_tie_steps"] == [1, 4]
    assert gc.agreement(ref, [[5, 7, 7, 8], [1, 2, 3, 4]], gaps)["equal_to_first_near_tie"] == 2   # the tie itself
    assert gc.agreement(ref, [[4, 6, 7, 8], [1, 2, 3, 4]], gaps)["equal_to_first_near_tie"] == 1   # before it: wrong
    assert gc.agreement(ref, [[5, 6, 7, 8], [1, 2, 0, 4]], gaps)["equal_to_first_near_tie"] == 1   # no tie: all
