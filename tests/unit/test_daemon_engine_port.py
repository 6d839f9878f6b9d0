"""The worker and the control plane reach the engine only through ``daemon/engine_port.py``:
no attribute chain into the engine's parts (its stages and sequences, a cache's arena, a stage's
K/V or runner) and no ``getattr``/``hasattr`` guessing at what an object has. The port itself is
the one module that reads those parts. The API edges and the commands hold the engine itself
(its tokenizer, templates, fit check and status) and read nothing past it: no runner, K/V, arena
or provider, none of its first-stage forwarders, and not the worker's port."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# the modules that drive the engine (the engine thread, the control plane, the status, metrics)
CALLERS = (
    "worker.py",
    "control/control.py",
    "control/control_loop.py",
    "service.py",
    "describe.py",
    "api/metrics.py",
)
# the engine and its parts: reading past one of these (``x.arena.mapped_bytes``,
# ``engine.stages[0].cache``, ``worker.engine.status()``) is reaching past the port; the typed
# status the port returns (``EngineStatus``) is plain data and may be read
PARTS = {"engine", "sequences", "arena", "kv", "runner", "decoder", "provider"}
HOOKS = {"on_cache_resized", "settle_grows"}  # the engine's hooks: the port sets them
GUESSES = {"getattr", "hasattr"}


def _part(node: ast.expr) -> str | None:
    """The part ``node`` reads (through subscripts), if it is one."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and node.attr in PARTS:
        return node.attr
    if isinstance(node, ast.Name) and node.id == "engine":
        return node.id
    return None


def _reaches(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute):
            part = _part(node.value)
            if part is not None or node.attr in HOOKS:
                found.append(f"{path.name}:{node.lineno}: {part or ''}.{node.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in GUESSES:
                found.append(f"{path.name}:{node.lineno}: {node.func.id}()")
    return found


# the API edges and the commands (``port.engine`` is theirs: the Engine, not its parts)
EDGES = tuple(
    p.relative_to(ROOT / "daemon").as_posix()
    for group in ("api", "commands")
    for p in sorted((ROOT / "daemon" / group).glob("*.py"))
)
PAST_THE_ENGINE = {"sequences", "arena", "kv", "runner", "decoder", "provider"}
FIRST_STAGE = {"cache", "provider"}  # Engine's forwarders to its first stage


def _past_the_engine(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        value = node.value
        engine = isinstance(value, ast.Name) and value.id in ("engine", "eng")
        port = node.attr == "port" and isinstance(value, ast.Attribute) and value.attr == "worker"
        if node.attr in PAST_THE_ENGINE or port or (engine and node.attr in FIRST_STAGE):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("name", EDGES)
def test_the_edges_read_nothing_past_the_engine(name: str) -> None:
    assert _past_the_engine(ROOT / "daemon" / name) == []


def test_the_edge_check_sees_a_reach_past_the_engine(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("a = engine.provider.stats\n"
                   "b = eng.cache\n"
                   "c = daemon.worker.port\n"
                   "d = engine.status().stages[0].cache\n"
                   "e = engine.tokenizer\n")  # fmt: skip
    assert sorted(_past_the_engine(bad)) == [
        "bad.py:1: engine.provider",
        "bad.py:2: eng.cache",
        "bad.py:3: daemon.worker.port",
    ]


@pytest.mark.parametrize("name", CALLERS)
def test_the_daemon_reaches_the_engine_only_through_its_port(name: str) -> None:
    assert _reaches(ROOT / "daemon" / name) == []


def test_the_check_sees_a_reach_past_the_port(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("x = engine.stages[0].cache.arena.mapped_bytes\n"
                   "y = getattr(w, 'steps', 0)\n"
                   "w.engine.sequences.settle_grows = False\n"
                   "z = status.stages[0].cache.arena\n")  # fmt: skip
    assert sorted(_reaches(bad)) == [
        "bad.py:1: arena.mapped_bytes",
        "bad.py:1: engine.stages",
        "bad.py:2: getattr()",
        "bad.py:3: engine.sequences",
        "bad.py:3: sequences.settle_grows",
    ]


def test_the_port_names_a_stage_out_of_range() -> None:
    from types import SimpleNamespace

    from strata.daemon.engine_port import LoadedEngine

    stages = [SimpleNamespace(cache=None, budget=None)]
    port = LoadedEngine(SimpleNamespace(stages=stages))  # type: ignore[arg-type]
    assert port.stage_count() == 1 and port.cache(0) is None and port.budget(0) is None
    for bad in (1, -1, True):
        with pytest.raises(ValueError, match=f"stage={bad!r}: the engine has stages 0 to 0"):
            port.cache(bad)
