"""``/proc/cpuinfo`` parsed once for its three readers: the blocks, and the physical cores and CPU
name made from them."""

from __future__ import annotations

import os

from strata.bench import session
from strata.engine import cpuinfo

# two hyper-threads of one core, then a second core; the last block has no blank line after it
TEXT = """processor\t: 0
model name\t: Some CPU @ 3.00GHz
physical id\t: 0
core id\t\t: 0
flags\t\t: fpu  sse2 avx2

processor\t: 1
model name\t: Some CPU @ 3.00GHz
physical id\t: 0
core id\t\t: 0

processor\t: 2
Model Name\t: Some CPU @ 3.00GHz
physical id\t: 0
core id\t\t: 1
odd line without a colon"""


def test_each_processors_block_is_one_mapping(tmp_path) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(TEXT)
    blocks = cpuinfo.processors(path)
    assert [b["processor"] for b in blocks] == ["0", "1", "2"]
    assert blocks[0]["flags"] == "fpu sse2 avx2"  # white space made one space
    assert blocks[2]["model name"] == "Some CPU @ 3.00GHz"  # keys lower-cased
    assert "odd line without a colon" not in blocks[2]
    assert cpuinfo.processors(tmp_path / "missing") == []


def test_physical_cores_and_the_cpu_name_come_from_the_blocks(tmp_path, monkeypatch) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(TEXT)
    read = cpuinfo.processors
    monkeypatch.setattr(cpuinfo, "processors", lambda: read(path))  # this file, not the host's
    assert cpuinfo.physical_cores() == 2  # three threads, two (physical id, core id) pairs
    assert session._cpu_name() == "Some CPU @ 3.00GHz"
    path.write_text("processor\t: 0\n\nprocessor\t: 1\n")  # no topology: the logical count
    assert cpuinfo.physical_cores() == (os.cpu_count() or 1)
