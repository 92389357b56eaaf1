"""Kernels built ahead (`pagedserve kernels`, scripts/setup.sh) and the log line of a build at run
time, over a tiny C++ library in a private cache (the real ones take a minute to compile)."""
import logging
from pathlib import Path

import pytest

from pagedserve import cli
from pagedserve.kernels import cpu, prebuild


@pytest.fixture
def tiny(tmp_path, monkeypatch) -> cpu.KernelLibrary:
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "csrc" / "common").mkdir(parents=True)
    (tmp_path / "csrc" / "common" / "answer.h").write_text("inline int answer_value() { return 42; }\n")
    source = tmp_path / "csrc" / "tiny.cpp"
    source.write_text('#include "common/answer.h"\n'
                      'extern "C" const char *tiny_variant() { return PAGEDSERVE_VARIANT; }\n'
                      'extern "C" int answer() { return answer_value(); }\n')
    return cpu.KernelLibrary(source, (cpu.Variant("scalar", (), ()),), "PAGEDSERVE_TINY", {"answer": []},
                             "tiny_variant", "tiny", logging.getLogger("tiny"), "tiny (%s) unavailable: %s",
                             build_seconds={"scalar": 7})


def test_a_build_at_run_time_says_so_once_with_an_estimate(tiny, caplog):
    with caplog.at_level(logging.INFO, logger="tiny"):
        assert tiny.load_variant("scalar").answer() == 42
    lines = [r for r in caplog.records if "compiling" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno >= logging.INFO
    assert "tiny.cpp" in lines[0].getMessage() and "about 7 s" in lines[0].getMessage()
    caplog.clear()
    again = cpu.KernelLibrary(tiny.source, tiny.variants, tiny.env_var, tiny.signatures, tiny.variant_symbol,
                              tiny.kind, tiny.log, tiny.unavailable)
    with caplog.at_level(logging.INFO, logger="tiny"):
        assert again.load_variant("scalar").answer() == 42      # cached: built once, no word about it
    assert not [r for r in caplog.records if "compiling" in r.getMessage()]


def test_prebuild_fills_the_cache_a_run_loads_from(tiny, caplog):
    first = prebuild.prebuild(libs=[tiny])
    assert [(b.library, b.variant, b.cached) for b in first] == [("tiny.cpp", "scalar", False)]
    assert first[0].path == cpu.library_path(tiny.by_name["scalar"], tiny.source) and first[0].path.exists()
    assert prebuild.prebuild(libs=[tiny])[0].cached
    with caplog.at_level(logging.INFO, logger="tiny"):
        assert tiny.load_variant("scalar").answer() == 42
    assert not [r for r in caplog.records if "compiling" in r.getMessage()]


def test_prebuild_reports_a_build_that_fails(tiny):
    tiny.source.write_text("this is not C++\n")
    [built] = prebuild.prebuild(libs=[tiny])
    assert built.path is None and "error" in built.error


def test_the_kernels_command(tiny, monkeypatch, capsys):
    monkeypatch.setattr(prebuild, "libraries", lambda: [tiny])
    assert cli.main(["kernels"]) == 0
    assert "tiny.cpp (scalar): built in" in capsys.readouterr().out
    assert cli.main(["kernels", "--all"]) == 0
    assert "tiny.cpp (scalar): cached" in capsys.readouterr().out


def test_setup_builds_the_kernels():
    setup = (Path(__file__).parents[1] / "scripts" / "setup.sh").read_text()
    assert ".venv/bin/pagedserve kernels" in setup
