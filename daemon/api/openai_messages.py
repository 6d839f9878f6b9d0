"""A chat request's ``messages``, checked (every error names the message and the field) and
turned into what chat templates take: roles (``developer`` is ``system``), content as one text,
an assistant's ``tool_calls`` with their arguments parsed, its ``reasoning_content`` (templates
that think write it back), a tool result's ``tool_call_id`` and function name."""

from __future__ import annotations

from typing import Any

from strata.daemon.api.api_errors import invalid, unsupported, wrong_type
from strata.daemon.api.openai_tools import assistant_tool_calls
from strata.daemon.json_types import JSON, JSONObject

ROLES = ("system", "developer", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {}


def parse_messages(items: list[JSON]) -> list[JSONObject]:
    if not items:
        raise invalid("messages: at least one message is needed", "messages")
    out = [_message(m, f"messages[{i}]") for i, m in enumerate(items)]
    names = {c["id"]: c["function"]["name"] for m in out for c in m.get("tool_calls", ())}
    for m in out:  # a tool result names its function where the client left that out
        if m["role"] == "tool" and "name" not in m and m["tool_call_id"] in names:
            m["name"] = names[m["tool_call_id"]]
    return out


def _message(m: Any, where: str) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise wrong_type(where, "an object", m)
    role = m.get("role")
    if role is None:
        raise invalid(f"{where}.role: missing required field", f"{where}.role")
    if not isinstance(role, str):
        raise wrong_type(f"{where}.role", "a string", role)
    if role == "function":
        raise unsupported(f"{where}.role", "the deprecated role 'function' is not supported; "
                          "use 'tool'")  # fmt: skip
    if role not in ROLES:
        raise invalid(
            f"{where}.role: unknown role {role!r} (expected one of {', '.join(ROLES)})",
            f"{where}.role",
            "invalid_value",
        )
    for name in ("function_call", "audio"):
        if not _empty(m.get(name)):
            raise unsupported(f"{where}.{name}", f"{name} in messages are not supported")
    calls = m.get("tool_calls")
    if not _empty(calls) and role != "assistant":
        raise invalid(f"{where}.tool_calls: only assistant messages have tool calls",
                      f"{where}.tool_calls")  # fmt: skip
    has_calls = not _empty(calls)
    content = _content(m.get("content", ...), role, f"{where}.content", has_calls)
    out: dict[str, Any] = {"role": ROLE_ALIASES.get(role, role), "content": content}
    thought = m.get("reasoning_content")
    if thought is not None and role == "assistant":  # templates that think write it back
        if not isinstance(thought, str):
            raise wrong_type(f"{where}.reasoning_content", "a string", thought)
        check_text(thought, f"{where}.reasoning_content")
        out["reasoning_content"] = thought
    if has_calls:
        out["tool_calls"] = assistant_tool_calls(calls, f"{where}.tool_calls")
    if role == "tool":
        call_id = m.get("tool_call_id")
        if call_id is None:
            raise invalid(f"{where}.tool_call_id: missing required field", f"{where}.tool_call_id")
        if not isinstance(call_id, str):
            raise wrong_type(f"{where}.tool_call_id", "a string", call_id)
        out["tool_call_id"] = call_id
    name = m.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise wrong_type(f"{where}.name", "a string", name)
        check_text(name, f"{where}.name")
        out["name"] = name
    return out


def _content(content: Any, role: str, where: str, calls: bool = False) -> str:
    if calls and content is ...:
        content = None
    if content is ... or (content is None and role != "assistant"):
        raise invalid(f"{where}: missing required field", where)
    if content is None:
        return ""
    if isinstance(content, str):
        check_text(content, where)
        return content
    if not isinstance(content, list):
        raise wrong_type(where, "a string or a list of content parts", content)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            if isinstance(kind, str):
                raise unsupported(f"{at}.type", f"content parts of type {kind!r} are not supported")
            raise wrong_type(at, 'a content part like {"type": "text", "text": "..."}', part)
        text = part.get("text")
        if not isinstance(text, str):
            raise wrong_type(f"{at}.text", "a string", text)
        check_text(text, f"{at}.text")
        texts.append(text)
    return "".join(texts)


def check_text(text: str, where: str) -> None:
    # JSON may carry lone surrogates ("\ud800"): valid JSON, but not Unicode text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise invalid(
            f"{where}: not valid Unicode text (a lone surrogate at character {e.start})", where
        ) from None
