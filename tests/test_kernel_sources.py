"""The C++ kernel sources (pagedserve/kernels/csrc): every room belongs to a library, each file is
small, and the build's cache key covers every file a library includes."""
import shutil
from pathlib import Path

from pagedserve.kernels import cpu, quant

LIBRARIES = (cpu.SOURCE, quant.SOURCE)


def test_every_room_is_built_into_a_library():
    included = {p for source in LIBRARIES for p in cpu.included_sources(source)}
    rooms = {p.resolve() for p in cpu.CSRC.rglob("*") if p.suffix in (".h", ".cpp")}
    assert rooms - included == set()
    assert included <= rooms


def test_shared_structs_are_written_once():
    handover = (cpu.CSRC / "common" / "handover.h").resolve()
    for source in LIBRARIES:
        assert handover in cpu.included_sources(source)
    for room in cpu.CSRC.rglob("*.h"):
        if room.resolve() != handover:
            assert "struct Handover {" not in room.read_text(), room


def test_every_source_file_is_small():
    for room in cpu.CSRC.rglob("*"):
        if room.is_file():
            assert len(room.read_text().splitlines()) < 1000, room


def test_editing_an_included_header_changes_the_cache_key(tmp_path):
    copy = tmp_path / "csrc"
    shutil.copytree(cpu.CSRC, copy)
    variant = cpu.VARIANTS[-1]
    for source in LIBRARIES:
        entry = copy / source.name
        before = cpu.library_path(variant, entry)
        assert before == cpu.library_path(variant, entry)      # stable
        header = copy / "common" / "convert.h"
        text = header.read_text()
        header.write_text(text + "\n// edited\n")
        assert cpu.library_path(variant, entry) != before
        header.write_text(text)
        assert cpu.library_path(variant, entry) == before
