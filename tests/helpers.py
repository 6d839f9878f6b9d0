"""Small helpers shared by the test folders."""

from __future__ import annotations

import os
import shutil

import pytest


def in_ci() -> bool:
    return bool(os.environ.get("CI"))


def require_tool(name: str) -> str:
    """The path of a command-line tool the test needs; skip (failing in CI) when it is absent."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed")
    return path
