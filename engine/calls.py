"""What a tool call is, apart from how any model writes one: the tool offered, the call read
back, and the events a call is streamed as. Plain Python: no torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call. ``parameters``: its JSON Schema (an object schema)."""

    name: str
    parameters: dict[str, Any]
    description: str | None = None
    strict: bool = False

    def openai(self) -> dict[str, Any]:
        """The tool as OpenAI's request carries it (what chat templates render)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass(frozen=True)
class CallStart:
    """A call's id and name are known (streamed first, as OpenAI does)."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


Event = str | CallStart | ArgumentsDelta  # a str is content


def merged(events: list[Event]) -> list[Event]:
    """Neighbouring pieces of content, or of one call's arguments, as one."""
    out: list[Event] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, str) and isinstance(last, str):
            out[-1] = last + e
        elif isinstance(e, ArgumentsDelta) and isinstance(last, ArgumentsDelta):
            if last.index == e.index:
                out[-1] = ArgumentsDelta(e.index, last.text + e.text)
                continue
            out.append(e)
        else:
            out.append(e)
    return out


class JsonWalk:
    """A walk through JSON text, character by character, that knows whether it is inside a
    string (and just after a backslash in one): where a bracket, comma or quote is the text's
    own structure and where it is a string's content."""

    def __init__(self, in_string: bool = False, escape: bool = False) -> None:
        self.in_string, self.escape = in_string, escape

    def step(self, c: str) -> bool:
        """Take ``c``; True where it stands outside every string (a quote that opens or closes
        one is a string's)."""
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
            return False
        if c == '"':
            self.in_string = True
            return False
        return True


def partial_object(text: str) -> dict[str, Any]:
    """A call's arguments as far as they were written, as an object: the JSON text of a call cut
    off mid-object (``max_tokens`` hit) with its open strings and containers closed and a member
    left without its value dropped — ``{"city": "Par`` reads ``{"city": "Par"}``, ``{"a": 1,
    "b": tr`` reads ``{"a": 1}``, an empty text ``{}``. For the APIs whose call input is an
    object (Anthropic's ``tool_use``, Ollama's ``arguments``), where OpenAI's carries the text;
    the reply's stop reason says it was cut off. Whole arguments read as ``json.loads`` does."""
    try:
        whole = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, dict):
        return whole
    cuts, stack, walk = [], [], JsonWalk()
    for i, ch in enumerate(text):
        if not walk.step(ch):
            continue
        if ch in "{[":
            stack.append("}" if ch == "{" else "]")
            cuts.append((i + 1, tuple(stack)))  # after an opening: an empty container
        elif ch in "}]" and stack:
            stack.pop()
            cuts.append((i + 1, tuple(stack)))  # after a closed container
        elif ch == ",":
            cuts.append((i, tuple(stack)))  # before a comma: the members before it
    if walk.escape:  # a dangling backslash: the escape it began is not written
        text = text[:-1]
    tail = ('"' if walk.in_string else "") + "".join(reversed(stack))
    for prefix, closers in [(text + tail, "")] + [(text[:i], "".join(reversed(s))) for i, s in
                                                  reversed(cuts)]:  # fmt: skip
        try:
            got = json.loads(prefix + closers)
        except json.JSONDecodeError:
            continue
        if isinstance(got, dict):
            return got
    return {}
