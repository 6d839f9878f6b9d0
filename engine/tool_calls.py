"""Tool calls in the model's own words: one small format per model family, chosen from the chat
template, behind one interface.

A :class:`ToolFormat` knows how its family writes calls — to read them back out of the output
(``parser``: whole or streamed, one code path), to make the model write one (``grammar``:
``tool_choice`` required or named, and ``strict`` functions once the model starts a call), and
what id a call gets. The families:

- ``hermes`` (Qwen2.5/Qwen3, Hermes), one block per call:
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
- ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (and the newer
  ``[TOOL_CALLS]name[ARGS]{...}``);
- ``harmony`` (gpt-oss, ``engine.harmony``): a ``commentary`` message to ``functions.NAME``
  whose body is the arguments;
- ``generic``: a template that knows no tools. The tools go into a system message
  (:func:`generic_messages`, the documented format), and the model answers with one JSON object,
  ``{"tool_calls": [{"name": ..., "arguments": {...}}]}``.

Output that does not parse as calls is never an error: it stays content, and the log says why.
Plain Python: no torch.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import string
from collections.abc import Sequence
from typing import Any

from strata.engine.calls import ArgumentsDelta, CallStart, Event, ToolCall, ToolSpec, merged
from strata.engine.grammar import GrammarSpec, json_schema_lark, lark_string
from strata.engine.harmony import CALL_MARKER, HarmonyCallParser, call_grammar, is_harmony_template

log = logging.getLogger(__name__)


def call_schema(tool: ToolSpec) -> dict[str, Any]:
    """The JSON object a call of ``tool`` is: its name, then its arguments."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _calls_schema(tools: Sequence[ToolSpec]) -> dict[str, Any]:
    schemas = [call_schema(t) for t in tools]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


class ToolFormat:
    """How one model family writes tool calls. Subclasses set ``name`` and ``marker`` (the text
    that starts the calls; None: the whole output is the calls) and write ``grammar``."""

    name = "generic"
    marker: str | None = None

    def new_id(self) -> str:
        return "call_" + secrets.token_hex(12)

    def parser(self, tools: Sequence[ToolSpec], guaranteed: bool = False) -> CallParser:
        """A parser of one output. ``guaranteed``: a grammar made the model write the calls (so
        a call's parts can be streamed as they come, not only once the call is complete)."""
        return CallParser(self, {t.name for t in tools}, guaranteed)

    def parse(self, text: str, tools: Sequence[ToolSpec]) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output; content None when there is none."""
        p = self.parser(tools)
        events = p.feed(text) + p.finish()
        return _collect(events, p)

    def grammar(
        self, tools: Sequence[ToolSpec], parallel: bool, marker: str, lazy: bool = False
    ) -> GrammarSpec:
        """The grammar of a reply that is calls of ``tools`` (at least one; one when not
        ``parallel``). ``marker``: the Lark expression of ``self.marker`` for this vocabulary (a
        special token's ``<[id]>``, or the text). ``lazy``: free text until the model writes
        the marker, then the calls (a strict function in ``auto`` mode). The generic format
        has no marker: lazily, its grammar starts once the model opens the calls' object
        (``{"tool_calls"``), and takes the array and the closing brace."""
        if lazy:
            array = json_schema_lark(_array(tools, parallel))
            colon = "COLON: /[ \\t\\n]*:[ \\t\\n]*/\n"
            return GrammarSpec("lark", f'start: COLON {array} "}}"\n{colon}', GENERIC_OPENING)
        body = json_schema_lark(
            {
                "type": "object",
                "properties": {"tool_calls": _array(tools, parallel)},
                "required": ["tool_calls"],
                "additionalProperties": False,
            }
        )
        return GrammarSpec("lark", f"start: {body}\n")


GENERIC_OPENING = '{"tool_calls"'  # how an answer of generic calls starts (JSON_FORMAT)


def _array(tools: Sequence[ToolSpec], parallel: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "array", "items": _calls_schema(tools), "minItems": 1}
    if not parallel:
        out["maxItems"] = 1
    return out


class HermesFormat(ToolFormat):
    name = "hermes"
    marker = "<tool_call>"
    close = "</tool_call>"

    def grammar(
        self, tools: Sequence[ToolSpec], parallel: bool, marker: str, lazy: bool = False
    ) -> GrammarSpec:
        body = json_schema_lark(_calls_schema(tools))
        close = lark_string("\n" + self.close)
        more = f' ("\\n" {marker} "\\n" call_body {close})*' if parallel else ""
        if lazy:  # after the trigger (the marker itself): the rest of the first call, then more
            return GrammarSpec(
                "lark",
                f'start: "\\n" call_body {close}{more}\ncall_body: {body}\n',
                trigger=self.marker,
            )
        return GrammarSpec(
            "lark", f'start: {marker} "\\n" call_body {close}{more}\ncall_body: {body}\n'
        )


class MistralFormat(ToolFormat):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    _ALPHABET = string.ascii_letters + string.digits

    def new_id(self) -> str:
        # Mistral's templates insist on 9 letters and digits
        return "".join(secrets.choice(self._ALPHABET) for _ in range(9))

    def grammar(
        self, tools: Sequence[ToolSpec], parallel: bool, marker: str, lazy: bool = False
    ) -> GrammarSpec:
        body = json_schema_lark(_array(tools, parallel))
        if lazy:
            return GrammarSpec("lark", f'start: " "? {body}\n', trigger=self.marker)
        return GrammarSpec("lark", f'start: {marker} " "? {body}\n')


class HarmonyFormat(ToolFormat):
    """How gpt-oss writes calls (``engine.harmony``): a ``commentary`` message to
    ``functions.NAME`` (the template lists the tools as a TypeScript-like ``namespace
    functions`` in the developer message). The reply ends at ``<|call|>`` after a call: one
    call per reply, ``parallel`` or not."""

    name = "harmony"
    marker = CALL_MARKER

    def parser(self, tools: Sequence[ToolSpec], guaranteed: bool = False) -> HarmonyCallParser:  # type: ignore[override]
        return HarmonyCallParser(self, {t.name for t in tools}, guaranteed)

    def grammar(
        self, tools: Sequence[ToolSpec], parallel: bool, marker: str, lazy: bool = False
    ) -> GrammarSpec:
        """Thoughts and preambles first, then a call (``lazy``: free text until the model
        writes ``to=functions.``, then the rest of the call)."""
        return call_grammar(tools, lazy)


FORMATS: dict[str, type[ToolFormat]] = {
    "harmony": HarmonyFormat,
    "hermes": HermesFormat,
    "mistral": MistralFormat,
    "generic": ToolFormat,
}


def format_for(template: str | None, renders_tools: bool) -> ToolFormat:
    """The format of the model whose chat template is ``template``: its family when the template
    renders tools and writes a known call marker, else the generic one (tools in a system
    message, the template rendered without them)."""
    if template and renders_tools:
        if is_harmony_template(template):
            return HarmonyFormat()
        if HermesFormat.marker in template:
            return HermesFormat()
        if MistralFormat.marker in template:
            return MistralFormat()
    return ToolFormat()


# -- parsing, whole or streamed ------------------------------------------------------------------

# the start of a call object as JSON_FORMAT writes it (a grammar's calls always begin so)
_HEADER = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')
# the same, as any model may space it (a call cut off before it was complete)
_LOOSE_NAME = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_LOOSE_ARGS = re.compile(r'\s*,\s*"arguments"\s*:\s*')
_ARGS_NAME = re.compile(r"([A-Za-z0-9_.-]+)\[ARGS\]$")  # Mistral's newer name[ARGS]{...}


class CallParser:
    """Turns an output, fed as it comes, into content and calls (:data:`Event`). Content comes
    out as soon as it cannot be the start of the marker; once the marker is seen, every JSON
    object at the top of what follows is a call, ``{"name": ..., "arguments": {...}}``, whatever
    tags, brackets and commas lie between them. A call's id and name go out first, then its
    arguments: piece by piece as they come when ``guaranteed`` (a grammar wrote them), else in
    one piece once the call is complete and valid. Anything that is not a valid call of a known
    tool ends the calls: it comes out as content, and the log says why."""

    def __init__(self, fmt: ToolFormat, names: set[str], guaranteed: bool = False) -> None:
        self.fmt = fmt
        self.names = names
        self.guaranteed = guaranteed
        self.calls: list[ToolCall] = []
        self.problem: str | None = None
        self._held = ""  # text that may still become the marker (or the generic prefix)
        self._in_calls = False
        self._started = False  # generic: some text seen (only an output that starts so is calls)
        self._failed = False
        self._region = ""  # raw text since the marker not yet given out as calls
        self._obj: str | None = None  # the JSON object being read
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._between = ""  # text between objects (Mistral's "name[ARGS]")
        self._args_of: str | None = None  # the object being read is the arguments of this call
        self._sent: int | None = None  # streamed: how much of the object went out as arguments
        self._args_at: int | None = None  # streamed: where in the object the arguments start
        self._args_end: int | None = None  # streamed: and where they ended
        self._id: str | None = None
        self._name: str | None = None  # the name of the call being read, once known

    def feed(self, text: str) -> list[Event]:
        return merged(self._feed(text))

    def _feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        if self._failed:
            return [text] if text else []
        if not self._in_calls:
            text = self._look_for_marker(text, out)
        for i, c in enumerate(text):
            self._region += c
            self._char(c, out)
            if self._failed:
                rest = self._region + text[i + 1 :]
                self._region = ""
                if rest:
                    out.append(rest)
                break
        return out

    def finish(self) -> list[Event]:
        """The output is over: what was held back comes out. A call cut off after its name is
        a call with the arguments written so far; one cut off before is content."""
        if self._failed:
            return []
        if not self._in_calls:
            held, self._held = self._held, ""
            return [held] if held else []
        out: list[Event] = []
        if self._obj is not None:
            if self._cut_off(out):
                return merged(out)
            self._fail(f"the output ended inside a call before its name: {self._obj[:80]!r}")
        elif not self.calls:
            self._fail(f"no call after {self.fmt.marker or 'the opening'}")
        rest, self._region = self._region, ""
        return [rest] if self._failed and rest else []

    def _look_for_marker(self, text: str, out: list[Event]) -> str:
        """Content until the marker; returns what follows it, once it is seen."""
        buf = self._held + text
        self._held = ""
        marker = self.fmt.marker
        if marker is None:  # generic: the whole output is {"tool_calls": [...]}, or content
            if self._started:
                if buf:
                    out.append(buf)
                return ""
            head = "".join(buf.split())
            want = '{"tool_calls":'
            if len(head) < len(want) and want.startswith(head):
                self._held = buf
                return ""
            self._started = True
            if not head.startswith(want):
                out.append(buf)
                return ""
            self._in_calls = True
            at = buf.index(":") + 1
            self._region = buf[:at]
            return buf[at:]  # the array of calls (the outer } is ignored)
        at = buf.find(marker)
        if at >= 0:
            if at:
                out.append(buf[:at])
            self._in_calls = True
            self._region = marker
            return buf[at + len(marker) :]
        keep = _prefix_overlap(buf, marker)
        if len(buf) > keep:
            out.append(buf[: len(buf) - keep])
        self._held = buf[len(buf) - keep :]
        return ""

    def _char(self, c: str, out: list[Event]) -> None:
        if self._obj is None:
            if c == "{":
                self._obj, self._depth, self._sent = "{", 1, None
                named = _ARGS_NAME.search(self._between) if self.fmt.name == "mistral" else None
                self._args_of = named.group(1) if named else None
                self._between = ""
            elif not c.isspace():
                self._between = (self._between + c)[-200:]
            return
        self._obj += c
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
        elif c == '"':
            self._in_string = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
        if self._depth == 0:
            self._complete(out)
        elif self.guaranteed:
            self._stream(out)

    def _stream(self, out: list[Event]) -> None:
        """A grammar wrote this call: its id and name as soon as they are read, then each new
        piece of its arguments (the object's final brace is not theirs)."""
        obj = self._obj
        assert obj is not None
        if self._sent is None:
            if self._args_of is not None:
                name, at = self._args_of, 0
            else:
                m = _HEADER.match(obj)
                if m is None:
                    return
                name, at = json.loads(m.group(1)), m.end()
            if name not in self.names:
                return  # _complete says why
            self._id, self._name = self.fmt.new_id(), name
            out.append(CallStart(len(self.calls), self._id, name))
            self._sent = self._args_at = at
            self._args_end = None
        if self._args_end is None and len(obj) > self._sent:
            out.append(ArgumentsDelta(len(self.calls), obj[self._sent :]))
            self._sent = len(obj)
            if self._depth == 1 and self._args_of is None:  # the arguments' object closed
                self._args_end = len(obj)

    def _cut_off(self, out: list[Event]) -> bool:
        """The output ended inside a call (``max_tokens``): a call whose name was written is
        still a call, its arguments as far as they were written (the stream sent the same
        pieces; none when it ended before them); False when the name is not complete."""
        obj = self._obj
        assert obj is not None
        if self._sent is None:  # nothing of it went out: its name from what was written
            if self._args_of is not None:
                name, at = self._args_of, 0
            else:
                m = _LOOSE_NAME.match(obj)
                if m is None:
                    return False
                name = json.loads(m.group(1))
                args = _LOOSE_ARGS.match(obj, m.end())  # none yet: the arguments are empty
                at = args.end() if args is not None else len(obj)
            if name not in self.names:
                return False
            self._id = self.fmt.new_id()
            out.append(CallStart(len(self.calls), self._id, name))
            self._sent = self._args_at = at
            self._name = name
        end = self._args_end or len(obj)
        if end > self._sent:
            out.append(ArgumentsDelta(len(self.calls), obj[self._sent : end]))
        assert self._args_at is not None and self._id is not None and self._name is not None
        self.calls.append(ToolCall(self._id, self._name, obj[self._args_at : end].strip()))
        log.info("the output ended inside a call of %r: its arguments are cut off", self._name)
        self._obj, self._region = None, ""
        return True

    def _complete(self, out: list[Event]) -> None:
        obj, self._obj = self._obj, None
        args_of, self._args_of = self._args_of, None
        assert obj is not None
        try:
            value = json.loads(obj)
        except ValueError as e:
            self._fail(f"a call is not JSON ({e}): {obj[:80]!r}")
            return
        if args_of is not None:  # Mistral's name[ARGS]{...}: the object is the arguments
            name, args, call_id = args_of, value, None
        elif isinstance(value, dict):
            name, call_id = value.get("name"), value.get("id")
            args = value.get("arguments", value.get("parameters", {}))
            if isinstance(args, str):  # arguments as a JSON string that holds the JSON
                try:
                    args = json.loads(args)
                except ValueError:
                    pass
        else:
            self._fail(f"a call that is not an object: {obj[:80]!r}")
            return
        if not isinstance(name, str):
            self._fail(f"a call without a name: {obj[:80]!r}")
            return
        if name not in self.names:
            self._fail(f"the model called {name!r}, which is not one of the tools")
            return
        if not isinstance(args, dict):
            self._fail(f"the arguments of {name!r} are not an object: {obj[:80]!r}")
            return
        index = len(self.calls)
        if self._sent is not None:  # streamed: the rest of the arguments as written
            end = len(obj) if args_of is not None else (self._args_end or len(obj) - 1)
            if end > self._sent:
                out.append(ArgumentsDelta(index, obj[self._sent : end]))
            assert self._args_at is not None
            text, call_id = obj[self._args_at : end].strip(), self._id
        else:
            text = json.dumps(args, ensure_ascii=False)
            call_id = call_id if isinstance(call_id, str) and call_id else self.fmt.new_id()
            out.append(CallStart(index, call_id, name))
            out.append(ArgumentsDelta(index, text))
        assert call_id is not None
        self.calls.append(ToolCall(call_id, name, text))
        self._region = ""

    def _fail(self, why: str) -> None:
        if not self._failed:
            self._failed = True
            self.problem = why
            log.info("model output not taken as a tool call (%s): kept as content", why)


def _prefix_overlap(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _collect(events: Sequence[Event], parser: CallParser) -> tuple[str | None, list[ToolCall]]:
    content = "".join(e for e in events if isinstance(e, str)).strip()
    return (content or None), list(parser.calls)


# -- templates that know no tools: the generic format -------------------------------------------

GENERIC_INSTRUCTIONS = """You can call these tools (functions):

{tools}

To call tools, answer with one JSON object and nothing else:
{{"tool_calls": [{{"name": "<function name>", "arguments": {{<the arguments, as the function's \
parameters describe them>}}}}]}}
Otherwise answer as usual. A tool's result comes back in a message that starts with \
"Tool result"."""


def generic_messages(
    messages: Sequence[dict[str, Any]], tools: Sequence[ToolSpec]
) -> list[dict[str, Any]]:
    """``messages`` for a template that knows no tools: the tools described in the system
    message (one is added first where there is none), assistant calls written as the generic
    JSON object, and tool results as user messages (consecutive ones merged, so that templates
    that insist on alternating roles accept them)."""
    listed = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
    intro = GENERIC_INSTRUCTIONS.format(tools=listed) if tools else ""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m["role"]
        if role == "assistant" and m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in m["tool_calls"]]  # fmt: skip
            text = json.dumps({"tool_calls": calls}, ensure_ascii=False)
            content = m.get("content") or ""
            out.append({"role": "assistant", "content": f"{content}\n{text}" if content else text})
        elif role == "tool":
            name = m.get("name")
            head = (
                f"Tool result ({name}, call {m.get('tool_call_id')}):"
                if name
                else (f"Tool result (call {m.get('tool_call_id')}):")
            )
            piece = f"{head}\n{m['content']}"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n\n" + piece
            else:
                out.append({"role": "user", "content": piece, "_tool_results": True})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
    for m in out:
        m.pop("_tool_results", None)
    if intro:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{intro}"}
        else:
            out.insert(0, {"role": "system", "content": intro})
    return out
