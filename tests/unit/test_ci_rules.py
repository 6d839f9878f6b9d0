"""The CI rule itself: under CI a skip fails the run, unless the test is marked gpu or isa."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).parents[1] / "conftest.py"

SAMPLE = """
import pytest

def test_plain_skip():
    pytest.skip("some tool is missing")

@pytest.mark.gpu
def test_gpu_skip():
    pytest.skip("no CUDA device")

@pytest.mark.isa
def test_isa_skip():
    pytest.skip("this CPU cannot run -march=cascadelake code")
"""


def _run(tmp_path: Path, ci: bool) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text(CONFTEST.read_text())
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    gpu: needs a GPU\n    isa: needs x86 instructions\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-ra", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_skip_outside_ci_passes_and_prints_the_reason(tmp_path: Path) -> None:
    proc = _run(tmp_path, ci=False)
    assert proc.returncode == 0, proc.stdout
    assert "3 skipped" in proc.stdout
    assert "some tool is missing" in proc.stdout


def test_non_gpu_skip_fails_under_ci_but_gpu_and_isa_skips_do_not(tmp_path: Path) -> None:
    proc = _run(tmp_path, ci=True)
    assert proc.returncode == 1, proc.stdout
    assert "1 failed" in proc.stdout and "2 skipped" in proc.stdout
    assert "skipped in CI" in proc.stdout and "no CUDA device" in proc.stdout
    assert "cannot run -march=cascadelake" in proc.stdout
