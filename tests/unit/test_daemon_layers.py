"""Imports point down: ``vmm`` < ``engine`` < ``bench`` < ``daemon`` < ``ipc`` < the composition
root (``strata.cli``, ``strata.serve``: start-up wiring and the command line). The leaf modules of
the top package (``strata.paths``, ``strata.hints``, ``strata.errors``: exit codes both the daemon
and its edges raise) sit below them all. Every import counts, those inside functions too (a
lazy import that runs back up is still a dependency that does); the engine's own circles are
tests/unit/test_engine_shape.py's.

Inside ``daemon/`` the groups keep an order too: the core (``daemon/*.py``: the service, the
worker, the engine port, the status, the configuration, the model library) and the control plane
(``daemon/control/``) import neither the HTTP edge (``daemon/api/``) nor the commands
(``daemon/commands/``), and those two import each other in no direction. The core and the control
plane may import each other (the service holds the controllers; the control loop drives the
worker).

The one exception is a re-export shim kept for importers of an old path outside the daemon's
files (``strata.daemon.cli``); a shim may hold nothing but its re-export."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("vmm", "engine", "bench", "daemon", "ipc", "strata")
BASE = {"strata", "strata.paths", "strata.hints", "strata.errors"}
RANK = {"vmm": 1, "engine": 2, "bench": 3, "daemon": 4, "ipc": 5}
ROOT_RANK = 6
SHIMS = {"strata.daemon.cli": "strata.cli"}
# the daemon's groups (a module of ``daemon/`` outside these sub-packages is the core) and the
# groups each may not import
GROUPS = ("api", "commands", "control")
CORE = "core"
NOT_IMPORTED_BY = {
    CORE: {"api", "commands"},
    "control": {"api", "commands"},
    "api": {"commands"},
    "commands": {"api"},
}


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] != "strata":
        parts.insert(0, "strata")
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module(p): p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))}


def _rank(module: str) -> int:
    if module in BASE:
        return 0
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in RANK:
        return RANK[parts[1]]
    return ROOT_RANK  # strata.cli, strata.serve, strata.__main__


def _imports(module: str, path: Path, known: set[str]) -> list[tuple[int, str]]:
    """(line, module) of every strata module ``path`` imports, wherever the import stands."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("strata")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            if not base.startswith("strata"):
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.append((node.lineno, full if full in known else base))
    return out


def _upward() -> list[str]:
    modules = _modules()
    bad = []
    for module, path in modules.items():
        if module in SHIMS:
            continue
        for line, target in _imports(module, path, set(modules)):
            if _rank(target) > _rank(module):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {module} imports {target}")
    return bad


def _group(module: str) -> str | None:
    """The daemon group ``module`` belongs to, or None outside ``strata.daemon``."""
    parts = module.split(".")
    if parts[:2] != ["strata", "daemon"]:
        return None
    return parts[2] if len(parts) >= 3 and parts[2] in GROUPS else CORE


def _across_groups() -> list[str]:
    modules = _modules()
    bad = []
    for module, path in modules.items():
        group = _group(module)
        if group is None or module in SHIMS:
            continue
        for line, target in _imports(module, path, set(modules)):
            if _group(target) in NOT_IMPORTED_BY[group]:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {module} imports {target}")
    return bad


def test_no_import_runs_back_up_the_layers() -> None:
    assert _upward() == []


def test_the_check_sees_an_import_that_runs_back_up(tmp_path: Path) -> None:
    """The walker resolves absolute, relative and lazy imports to their modules."""
    source = (
        "from __future__ import annotations\n"
        "from . import leases\n"
        "def f():\n"
        "    from strata.ipc.dbus import start_dbus\n"
        "    import strata.serve\n"
    )
    path = tmp_path / "daemon" / "thing.py"
    path.parent.mkdir()
    path.write_text(source)
    known = {"strata.daemon.leases", "strata.ipc.dbus", "strata.serve"}
    got = _imports("strata.daemon.thing", path, known)
    assert got == [(2, "strata.daemon.leases"), (4, "strata.ipc.dbus"), (5, "strata.serve")]
    ranks = [_rank(m) > _rank("strata.daemon.thing") for _, m in got]
    assert ranks == [False, True, True]


@pytest.mark.parametrize("shim", sorted(SHIMS))
def test_a_shim_holds_only_its_re_export(shim: str) -> None:
    path = _modules()[shim]
    tree = ast.parse(path.read_text())
    body = [
        n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
    ]
    imports = [n for n in body if isinstance(n, ast.ImportFrom)]
    others = [n for n in body if not isinstance(n, ast.ImportFrom)]
    assert [n.module for n in imports] == [SHIMS[shim]], ast.dump(tree)
    assert all(isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "__all__" for n in others)


def test_the_daemons_groups_keep_their_order() -> None:
    assert _across_groups() == []


def test_every_daemon_module_has_a_group() -> None:
    """A sub-package of ``daemon/`` the check does not know would escape it."""
    folders = {p.name for p in (ROOT / "daemon").iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(GROUPS)


def test_the_group_check_sees_the_control_plane_import_the_edge() -> None:
    assert _group("strata.daemon.control.policy") == "control"
    assert _group("strata.daemon.service") == CORE
    assert _group("strata.daemon.api") == "api"  # ``from strata.daemon import api`` counts too
    assert _group("strata.ipc.dbus") is None
    assert _group("strata.daemon.api.http") in NOT_IMPORTED_BY["control"]
    assert _group("strata.daemon.api.http") in NOT_IMPORTED_BY[CORE]
    assert _group("strata.daemon.control.leases") not in NOT_IMPORTED_BY["api"]
