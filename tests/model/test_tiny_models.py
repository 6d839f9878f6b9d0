"""The tiny test models' builder: `scripts/tiny-models DIR` builds every file the tests would need
llama-cpp-python for, and the ``tiny_models`` fixture takes them from TINY_MODELS_DIR as they are,
or says which file is missing and how to build it."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tiny_models import (
    COMMAND,
    ENV,
    KINDS,
    LLAMA_CPP_KINDS,
    MODELS,
    OFFERED,
    PREBUILT,
    SYNTH_KINDS,
    LlamaCppMissing,
    TinyModels,
    build,
    file_name,
)

TESTS = Path(__file__).parents[1]


def _literal(node: ast.expr, names: dict[str, ast.expr]) -> object:
    """``node``'s value where it is a literal, or a module-level name bound to one; else None."""
    if isinstance(node, ast.Name) and node.id in names:
        node = names[node.id]
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def _parametrized(func: ast.FunctionDef, names: dict[str, ast.expr]) -> dict[str, list[object]]:
    """{argument: its values} from ``func``'s literal ``pytest.mark.parametrize`` decorators."""
    found: dict[str, list[object]] = {}
    for d in func.decorator_list:
        if not (isinstance(d, ast.Call) and ast.unparse(d.func).endswith("parametrize")):
            continue
        argnames, values = _literal(d.args[0], names), _literal(d.args[1], names)
        if not isinstance(values, list | tuple):
            continue
        if isinstance(argnames, str) and "," not in argnames:
            found[argnames] = list(values)
        elif isinstance(argnames, str | list | tuple):
            keys = argnames.split(",") if isinstance(argnames, str) else argnames
            for i, key in enumerate(keys):
                found[key.strip()] = [v[i] for v in values]
    return found


def requested_files() -> Iterator[tuple[Path, int, list[object], list[object]]]:
    """Every ``tiny_models.path(model, kind)`` call under tests/: (file, line, the models, the
    kinds) it can ask for, read from literals and literal parametrisations (empty: unknown)."""
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        names = {
            t.id: n.value
            for n in tree.body
            if isinstance(n, ast.Assign)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef):
                continue
            params = _parametrized(func, names)
            for call in ast.walk(func):
                if not (
                    isinstance(call, ast.Call)
                    and ast.unparse(call.func) == "tiny_models.path"
                    and len(call.args) == 2
                ):
                    continue
                choices = []
                for arg in call.args:
                    value = _literal(arg, {})
                    if isinstance(arg, ast.Name) and arg.id in params:
                        choices.append(params[arg.id])
                    else:
                        choices.append([value] if value is not None else [])
                yield path, call.lineno, choices[0], choices[1]


def test_the_command_builds_every_file_a_test_needs_llama_cpp_for() -> None:
    calls = list(requested_files())
    assert calls, "the scan of tests/ found no tiny_models.path(...) call"
    unknown, unbuilt, seen = [], [], set()
    for path, line, models, kinds in calls:
        where = f"{path.relative_to(TESTS)}:{line}"
        unknown += [f"{where}: {m!r}" for m in models if m not in MODELS]
        unknown += [f"{where}: {k!r}" for k in kinds if k not in KINDS]
        unknown += [f"{where}: {m!r} in {k!r}" for m in models for k in kinds
                    if m in MODELS and k in KINDS and (m, k) not in OFFERED]  # fmt: skip
        for model in models:
            for kind in kinds:
                seen.add((model, kind))
                if kind in LLAMA_CPP_KINDS and (model, kind) not in PREBUILT:
                    unbuilt.append(f"{where}: {model}, {kind}")
    assert not unknown, "tiny_models.path asked for what the fixture has not:\n" + "\n".join(
        unknown
    )
    assert not unbuilt, f"{COMMAND} does not build:\n" + "\n".join(unbuilt)
    # the scan reads the parametrisations: every llama.cpp-made file is asked for somewhere
    assert set(PREBUILT) <= seen
    # and, whatever a future test asks for, the command builds all the fixture can hand out
    assert all(k in SYNTH_KINDS or (m, k) in PREBUILT for m, k in OFFERED)
    assert {k for _, k in OFFERED} == set(KINDS)


def test_a_folder_the_builder_wrote_is_used_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, llama_cpp_module: object
) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    one = (("qwen3moe", "Q6_K"),)
    [(path, fresh)] = build(out, one)
    assert fresh and path == out / file_name("qwen3moe", "Q6_K") and path.is_file()
    assert sorted(out.iterdir()) == [path], "the F32 source stays out of the folder"
    inode = path.stat().st_ino
    assert list(build(out, one)) == [(path, False)]
    assert path.stat().st_ino == inode, "a valid file is kept, not rewritten"

    # where llama-cpp-python is absent, the fixture takes the file and builds nothing
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    monkeypatch.setenv(ENV, str(out))
    work.mkdir()
    assert TinyModels.from_env(work).path("qwen3moe", "Q6_K") == path
    assert list(work.iterdir()) == []


def test_a_damaged_file_in_the_folder_is_built_again(
    tmp_path: Path, llama_cpp_module: object
) -> None:
    name = file_name("mixtral", "Q4_K_M")
    (tmp_path / name).write_bytes(b"GGUF truncated")
    [(path, fresh)] = build(tmp_path, (("mixtral", "Q4_K_M"),))
    assert fresh and path == tmp_path / name and path.stat().st_size > 1 << 20


def test_a_file_the_folder_lacks_names_itself_and_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_models: TinyModels
) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    stale = tmp_path / "tiny-qwen3moe-Q4_K_M-0123456789.gguf"
    stale.write_bytes(b"")
    models = TinyModels(tmp_path / "work", prebuilt=tmp_path)
    with pytest.raises(LlamaCppMissing) as e:
        models.path("qwen3moe", "Q4_K_M")
    message = str(e.value)
    for part in (file_name("qwen3moe", "Q4_K_M"), f"{ENV}={tmp_path}", stale.name, COMMAND):
        assert part in message

    # the fixture's own class turns it into a skip with that reason (a failure under CI)
    monkeypatch.delenv("CI", raising=False)
    skipping = type(tiny_models)(tmp_path / "work", prebuilt=tmp_path)
    with pytest.raises(pytest.skip.Exception, match=file_name("qwen3moe", "Q4_K_M")):
        skipping.path("qwen3moe", "Q4_K_M")


def test_without_the_folder_or_llama_cpp_the_reason_says_how_to_get_either(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(LlamaCppMissing, match=f"{COMMAND} DIR.*{ENV}=DIR"):
        TinyModels.from_env(tmp_path).path("mixtral", "Q6_K")
    with pytest.raises(LlamaCppMissing, match="llama-cpp-python is needed to build"):
        list(build(tmp_path / "out", (("mixtral", "Q6_K"),)))
    assert not (tmp_path / "out").exists()
