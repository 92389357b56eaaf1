"""benchmarks/r8_stream.py's builds: each --ab-source gets a column of its own (two checkouts' sources
once shared the label `kernels`, and one build's timings replaced the other's)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import r8_stream  # noqa: E402


def test_each_ab_source_is_labelled_by_its_checkout_and_labels_never_collide():
    trees = [f"/tmp/ab/{t}/pagedserve/kernels/csrc/quant_kernels.cpp" for t in ("base", "nta")]
    assert [r8_stream.ab_label(s, trees) for s in trees] == ["base", "nta"]
    loose = ["/tmp/base/quant_kernels.cpp", "/tmp/other/quant_kernels.cpp"]
    assert [r8_stream.ab_label(s, loose) for s in loose] == ["base", "other"]
    same = ["/a/x/quant_kernels.cpp", "/b/x/quant_kernels.cpp"]     # the same folder name: whole paths
    assert [r8_stream.ab_label(s, same) for s in same] == same
