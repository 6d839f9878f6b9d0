"""The daemon's and the edges' code stays small enough to read at once: no file in ``daemon/``,
``ipc/`` or the composition root (``strata/``) over 500 lines, no function there over 60 (nested
ones counted on their own and within the function that holds them)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("daemon", "ipc", "strata")
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 500


def _long_functions(source: str, name: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                out.append(f"{name}:{node.lineno} {node.name}: {lines} lines")
    return out


def test_no_function_over_60_lines() -> None:
    long = [
        f
        for folder in FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        for f in _long_functions(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert long == []


def test_no_file_over_500_lines() -> None:
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for folder in FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_FILE_LINES
    ]
    assert long == []


def test_the_check_counts_a_long_function() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert _long_functions(f"def f():\n{body}\n", "m.py") == ["m.py:1 f: 61 lines"]
    short = "\n".join(body.splitlines()[1:])
    assert _long_functions(f"async def g():\n{short}\n", "m.py") == []
