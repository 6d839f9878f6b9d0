"""What a tool call is, apart from how any model writes one: the tool offered, the call read
back, and the events a call is streamed as. Plain Python: no torch."""

from __future__ import annotations

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
