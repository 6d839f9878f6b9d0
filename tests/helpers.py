"""Small helpers shared by the test folders."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def in_ci() -> bool:
    return bool(os.environ.get("CI"))


def require_tool(name: str) -> str:
    """The path of a command-line tool the test needs; skip (failing in CI) when it is absent."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed")
    return path


def run_strata(
    *argv: str, tmp: Path, stdin: str | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``python -m strata ARGV`` with its own XDG folders under ``tmp`` and no STRATA_* variables
    of the caller's, so the test sees only what it gives."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    env.update(
        XDG_CACHE_HOME=str(tmp / "cache"),
        XDG_CONFIG_HOME=str(tmp / "config"),
        XDG_STATE_HOME=str(tmp / "state"),
    )
    return subprocess.run(
        [sys.executable, "-m", "strata", *argv],
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
