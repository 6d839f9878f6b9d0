"""No ``Any`` in a public signature of ``daemon/`` or ``ipc/``: payloads are JSON
(``daemon/json_types.py``: ``JSON``, ``JSONObject``), D-Bus values ``ipc.bus.DBusValue``, the rest
their own types. Read from the source with ``ast`` (annotations as written, string ones too):
every public function, every public method (and dunder) of a public class, every annotated field
of a public class (a dataclass's or model's constructor), and every public type alias.

``ALLOWED`` lists the exceptions left, each with why; it can only shrink: the test fails when an
entry is no longer needed."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("daemon", "ipc")

_REQUEST_MODEL = (
    "the OpenAI request model's fields pydantic takes as sent; openai_tools/openai_reasoning "
    "check them by hand, with errors that name the inner field (a JSON annotation would make "
    "pydantic validate the union first and change those errors)"
)
ALLOWED = {
    "daemon/api/openai_api.py:ChatRequest.messages": _REQUEST_MODEL,
    "daemon/api/openai_api.py:ChatRequest.tools": _REQUEST_MODEL,
    "daemon/api/openai_api.py:ChatRequest.tool_choice": _REQUEST_MODEL,
    "daemon/api/openai_api.py:ChatRequest.logprobs": _REQUEST_MODEL,
    "daemon/api/openai_api.py:ChatRequest.top_logprobs": _REQUEST_MODEL,
    "daemon/api/openai_api.py:ChatRequest.chat_template_kwargs": _REQUEST_MODEL,
    "daemon/api/openai_api.py:ChatRequest.reasoning_format": _REQUEST_MODEL,
    "daemon/api/openai_api.py:ChatRequest.reasoning_effort": _REQUEST_MODEL,
    "daemon/api/openai_api.py:ChatRequest.think": _REQUEST_MODEL,
    "daemon/api/openai_api.py:CompletionRequest.logprobs": _REQUEST_MODEL,
}


def _has_any(node: ast.expr | None) -> bool:
    if node is None:
        return False
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and n.id == "Any":
            return True
        if isinstance(n, ast.Attribute) and n.attr == "Any":
            return True
        if isinstance(n, ast.Constant) and isinstance(n.value, str):  # a string annotation
            try:
                inner = ast.parse(n.value, mode="eval").body
            except SyntaxError:
                continue
            if _has_any(inner):
                return True
    return False


def _public(name: str) -> bool:
    return not name.startswith("_") or (name.startswith("__") and name.endswith("__"))


def _function(f: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = f.args
    params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
    bad = [p.arg for p in params if _has_any(p.annotation)]
    return bad + (["return"] if _has_any(f.returns) else [])


def _class(where: str, node: ast.ClassDef) -> list[str]:
    found = []
    for m in node.body:
        if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and _public(m.name):
            if _function(m):
                found.append(f"{where}:{node.name}.{m.name}")
        elif isinstance(m, ast.AnnAssign) and isinstance(m.target, ast.Name):
            if not m.target.id.startswith("_") and _has_any(m.annotation):
                found.append(f"{where}:{node.name}.{m.target.id}")
    return found


def _alias(node: ast.stmt) -> tuple[str, ast.expr] | None:
    """A module-level public type alias (``Name = ...`` or ``Name: TypeAlias = ...``)."""
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        target, value = node.targets[0], node.value
    elif isinstance(node, ast.AnnAssign) and node.value is not None:
        target, value = node.target, node.value
    else:
        return None
    if isinstance(target, ast.Name) and target.id[:1].isupper():
        return target.id, value
    return None


def any_in_signatures(path: Path, where: str) -> list[str]:
    found = []
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _public(node.name):
            if _function(node):
                found.append(f"{where}:{node.name}")
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            found += _class(where, node)
        elif (alias := _alias(node)) is not None and _has_any(alias[1]):
            found.append(f"{where}:{alias[0]}")
    return found


def _found() -> set[str]:
    found: set[str] = set()
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found.update(any_in_signatures(path, path.relative_to(ROOT).as_posix()))
    return found


def test_no_any_in_a_public_signature_of_the_daemon_or_ipc() -> None:
    found = _found()
    assert sorted(found - ALLOWED.keys()) == [], "Any in a public signature: use a real type"
    assert sorted(ALLOWED.keys() - found) == [], "no longer needed: take it off ALLOWED"


def test_the_check_sees_any_where_it_hides(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import Any\nimport typing\n"
        "Payload = dict[str, Any]\n"
        "def f(x: 'list[Any]') -> int: ...\n"
        "async def g(*args: typing.Any) -> None: ...\n"
        "def _private(x: Any) -> Any: ...\n"
        "def h(x: int) -> dict[str, int]: ...\n"
        "class C:\n"
        "    field: Any\n"
        "    def m(self, **kw: Any) -> None: ...\n"
        "    def __init__(self, x: Any) -> None: ...\n"
        "    def _p(self, x: Any) -> None: ...\n"
        "class _Hidden:\n"
        "    def m(self, x: Any) -> None: ...\n"
    )
    assert sorted(any_in_signatures(source, "m.py")) == [
        "m.py:C.__init__", "m.py:C.field", "m.py:C.m", "m.py:Payload", "m.py:f", "m.py:g",
    ]  # fmt: skip
