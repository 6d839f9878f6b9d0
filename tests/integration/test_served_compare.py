"""``scripts/served-compare``'s checks of its arguments: each bad one is named, with exit status
2, before any server starts (the script's measurements run on a GPU machine with a real
llama-server: ``docs/benchmarks.md``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "scripts" / "served-compare"


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def test_a_bad_model_server_or_run_count_is_named(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    r = _run("--model", str(model), "--llama-server", "/bin/true")
    assert r.returncode == 2 and f"--model {model}: no such file" in r.stderr, r.stderr
    model.write_bytes(b"GGUF")
    r = _run("--model", str(model), "--llama-server", str(tmp_path / "nothing"))
    assert r.returncode == 2 and "--llama-server" in r.stderr and "not an executable" in r.stderr
    r = _run("--model", str(model), "--llama-server", "/bin/true", "--runs", "0")
    assert r.returncode == 2 and "--runs must be at least 1" in r.stderr, r.stderr


def test_a_logs_folder_that_cannot_be_made_is_named(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = _run("--model", str(model), "--llama-server", "/bin/true", "--logs", str(blocker / "x"))
    assert r.returncode == 2, r.stderr
    assert f"--logs {blocker / 'x'}: cannot make the folder" in r.stderr, r.stderr
    assert "strata serve" not in r.stderr + r.stdout  # no server was started
