"""The engine's shape, checked on its source (docs/architecture.md): no import circle among its
modules or packages, no arrow from the engine to the daemon or the IPC layer, no file over 700
lines, no class over 500, and the architecture's arguments read only by the model files.

Plain ``ast`` over the files: nothing is imported, so a circle hidden by a function-level import
counts too (it is still a circle at run time)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "engine"
MAX_FILE_LINES = 700
MAX_CLASS_LINES = 500


def _module(path: Path) -> str:
    parts = ["strata", "engine", *path.relative_to(ENGINE).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _files() -> list[Path]:
    return sorted(p for p in ENGINE.rglob("*.py") if "__pycache__" not in p.parts)


def _imports(path: Path) -> Iterator[str]:
    """The ``strata.*`` modules ``path`` imports, anywhere in the file (type-checking-only imports
    excluded: they never run)."""
    tree = ast.parse(path.read_text(), str(path))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("strata"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            if not base.startswith("strata"):
                continue
            for a in node.names:  # `from pkg import mod` names a module where one exists
                yield f"{base}.{a.name}" if f"{base}.{a.name}" in _MODULES else base


_MODULES = {_module(p) for p in _files()}


def _graph(level: str) -> dict[str, set[str]]:
    """Module -> modules it imports (``level="module"``), or package -> packages."""

    def key(name: str) -> str:
        # at the package level a module of a sub-package is that sub-package (its first level
        # under the engine); a module of the engine's top level stands for itself
        parts = name.split(".")
        if level == "module" or len(parts) <= 3 or f"{'.'.join(parts[:3])}" not in _PACKAGES:
            return name
        return ".".join(parts[:3])

    graph: dict[str, set[str]] = {}
    for path in _files():
        src = key(_module(path))
        for dst in _imports(path):
            while dst not in _MODULES and "." in dst:  # `import strata.engine.x.y` -> a module
                dst = dst.rpartition(".")[0]
            if dst in _MODULES and key(dst) != src:
                graph.setdefault(src, set()).add(key(dst))
    return graph


_PACKAGES = {_module(p) for p in _files() if p.name == "__init__.py"}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("level", ["module", "package"])
def test_no_import_circle_among_the_engines_modules(level: str) -> None:
    graph = _graph(level)
    assert _cycles(graph) == [], f"import circles ({level} level)"


def test_the_engine_imports_nothing_of_the_daemon_or_ipc() -> None:
    wrong = [
        f"{_module(p)} -> {name}"
        for p in _files()
        for name in _imports(p)
        if name.startswith(("strata.daemon", "strata.ipc"))
    ]
    assert wrong == []


def test_no_engine_file_or_class_is_too_long() -> None:
    long_files = []
    long_classes = []
    for path in _files():
        text = path.read_text()
        if text.count("\n") > MAX_FILE_LINES:
            long_files.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_CLASS_LINES:
                    long_classes.append(f"{path.relative_to(ROOT)}:{node.name}: {n} lines")
    assert long_files == [], f"over {MAX_FILE_LINES} lines"
    assert long_classes == [], f"over {MAX_CLASS_LINES} lines"


def test_the_architectures_arguments_are_read_only_by_the_model_files() -> None:
    """``ModelArgs`` (an architecture's hyper-parameters) is read in ``engine/models/`` only:
    runners and kernels take shapes and specs, never the architecture's own fields."""
    readers = []
    for path in _files():
        if ENGINE / "models" in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "args":
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert readers == []
