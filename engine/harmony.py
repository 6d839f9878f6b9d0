"""gpt-oss's harmony format: the reply as messages on channels, read back into a thought, an
answer and tool calls; the grammars that keep a constrained reply inside the format.

A harmony reply is a run of messages, ``<|start|>ROLE HEADER<|message|>BODY<|end|>``; the
prompt already wrote the first ``<|start|>assistant``, and the reply ends at ``<|return|>``
(after an answer) or ``<|call|>`` (after a call), both end-of-generation tokens. The header
names the message's channel (``<|channel|>analysis``, ``commentary`` or ``final``) and, for a
call, its recipient (``to=functions.NAME``, after the role or after the channel), optionally the
arguments' type (``<|constrain|>json``). So:

- ``analysis`` is the thought (``reasoning_content``);
- ``final`` is the answer (``content``), and so is a ``commentary`` message to no one (a
  "preamble" the user sees before calls);
- a message to ``functions.NAME`` is a call of NAME, its body the JSON arguments.

The markers ``<|start|>``, ``<|channel|>``, ``<|message|>``, ``<|constrain|>`` and ``<|end|>`` are
rendered as text (the tokenizer types them so, as llama.cpp does), so the reply's text holds the
whole frame. :class:`HarmonyReader` cuts that text into headers, bodies and ends as it comes
(markers split across pieces are held back until they are whole; in a body that is JSON, a
call's arguments or a final message that starts as JSON, a marker inside a string is text).
Two readers sit on it: the reasoning family's :class:`HarmonySplitter` (thought apart from
answer, as ``engine.reasoning``'s families do) and the tool format's
:class:`HarmonyCallParser` (calls apart from content, as ``engine.tool_calls``'s formats do).
The splitter hands a call message on to the call parser as written, frame included;
anything that is not harmony-shaped (text before the first header, a stray marker inside a
body, a header that never ends) is content, never dropped.

Grammars (llguidance Lark): a required or named call lets the model write thoughts and
preambles first, then forces ``<|channel|>commentary to=functions.NAME <|constrain|>json
<|message|>`` and arguments that follow the tool's schema (either header order); a JSON answer
(``response_format``) lets thoughts come first, then forces the ``final`` message to be the JSON.
Plain Python: no torch.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from strata.engine.calls import (
    ArgumentsDelta,
    CallStart,
    Event,
    JsonWalk,
    ToolCall,
    ToolSpec,
    merged,
)
from strata.engine.grammar import AnswerFrame, GrammarSpec, json_schema_lark, lark_string

log = logging.getLogger(__name__)

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, CALL, RETURN = "<|constrain|>", "<|call|>", "<|return|>"
_BODY_ENDS = (END, START, CALL, RETURN)  # what ends a message's body
_HEADER_BREAKS = (END, CALL, RETURN, START)  # what a header cannot hold
MAX_HEADER = 256  # characters: a "header" longer than this is text that only looked like one
FUNCTIONS = "functions."
CALL_MARKER = " to=" + FUNCTIONS  # what starts a call, wherever its header puts it
EFFORTS = ("low", "medium", "high")  # the reasoning levels gpt-oss was trained on


def is_harmony_template(source: str | None) -> bool:
    """Whether a chat template writes harmony (llama.cpp's test: it names ``<|channel|>``)."""
    return bool(source) and CHANNEL in str(source)


# -- reading ---------------------------------------------------------------------------------------

_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([^\s<]+)")


@dataclass(frozen=True)
class Header:
    """A message's header. ``raw``: as written, from its ``<|start|>`` (none for the reply's
    first message, whose start the prompt wrote) to its ``<|message|>``; ``named``: the
    recipient's name is whole (more of the header follows it)."""

    raw: str
    channel: str | None
    recipient: str | None
    named: bool

    @property
    def addressed(self) -> bool:
        """Sent to a tool (a function, or a built-in such as ``browser.search``)."""
        return self.recipient is not None and self.recipient not in ("assistant", "user")

    @property
    def function(self) -> str | None:
        r = self.recipient
        return r[len(FUNCTIONS) :] if r is not None and r.startswith(FUNCTIONS) else None


def parse_header(raw: str, text: str) -> Header:
    """``text``: the header without its ``<|message|>``; the recipient is the first ``to=``,
    the channel the last ``<|channel|>`` (gpt-oss sometimes writes a stray
    ``<|channel|>commentary`` before the real one)."""
    m = _RECIPIENT.search(text)
    channels = _CHANNEL_NAME.findall(text)
    return Header(raw, channels[-1] if channels else None, m.group(1) if m else None,
                  m is not None and m.end() < len(text))  # fmt: skip


Part = tuple[str, str]  # ("reasoning" or "content", text), as engine.reasoning's splitters give
Kind = Literal["text", "header", "body", "end", "cut"]
Item = tuple[Kind, Any]  # ("text"|"body"|"end", str) or ("header"|"cut", Header)


class HarmonyReader:
    """Cuts a reply, fed as it comes, into items: ``("header", Header)``, ``("body", text)``,
    ``("end", marker)`` (the marker that ended the body; "" at the reply's end or where the
    next ``<|start|>`` ended it), ``("text", text)`` outside any message, and at the end
    ``("cut", Header)`` for a header the reply stopped inside. Joined in order, the raw pieces
    (headers' ``raw``, bodies, ends, texts) are the reply as written."""

    def __init__(self) -> None:
        self._state: Literal["start", "header", "body", "between", "text"] = "start"
        self._held = ""
        # the body is JSON (a call's arguments, a JSON answer): markers in its strings are text
        # (None: a final message whose first character will say)
        self._json: bool | None = False
        self._in_string = self._escape = False  # where in its JSON the body given out ended

    def feed(self, text: str) -> list[Item]:
        self._held += text
        out: list[Item] = []
        while getattr(self, "_" + self._state)(out, False):
            pass
        return out

    def finish(self) -> list[Item]:
        out: list[Item] = []
        while getattr(self, "_" + self._state)(out, True):
            pass
        return out

    # each state reads what is held: True when it moved on (run the next state), False when it
    # waits for more text

    def _start(self, out: list[Item], final: bool) -> bool:
        buf = self._held
        head = buf.lstrip()
        if head.startswith((START, CHANNEL)) or buf.startswith(" to="):
            self._state = "header"  # the reply's first message (its <|start|> was the prompt's)
            return True
        if not final and (START.startswith(head) or CHANNEL.startswith(head)
                          or " to=".startswith(buf)):  # fmt: skip
            return False
        self._state = "text"  # not harmony-shaped: the model wrote plain text
        return True

    def _header(self, out: list[Item], final: bool) -> bool:
        buf = self._held
        lead = len(buf) - len(buf.lstrip())
        own = lead + len(START) if buf.startswith(START, lead) else 0
        at = buf.find(MESSAGE, own)
        limit = at if at >= 0 else len(buf)
        breaks = [p for p in (buf.find(b, own, limit) for b in _HEADER_BREAKS) if p >= 0]
        if breaks or (at < 0 and len(buf) > MAX_HEADER):
            cut = min(breaks) if breaks else len(buf)  # not a header: text up to the break
            out.append(("text", buf[:cut]))
            self._held, self._state = buf[cut:], "text"
            return True
        if at >= 0:
            end = at + len(MESSAGE)
            header = parse_header(buf[:end], buf[own:at])
            out.append(("header", header))
            self._held, self._state = buf[end:], "body"
            self._json = True if header.addressed else None if header.channel == "final" else False
            return True
        if final and buf:
            out.append(("cut", parse_header(buf, buf[own:])))
            self._held = ""
        return False

    def _body(self, out: list[Item], final: bool) -> bool:
        buf = self._held
        if self._json is None and buf.strip():  # a final message: JSON when it starts as JSON
            self._json = buf.lstrip()[0] in "{["
        found = [(p, m) for m in _BODY_ENDS if (p := self._find(buf, m)) >= 0]
        if found:
            at, mark = min(found)
            self._in_string = self._escape = False
            if at:
                out.append(("body", buf[:at]))
            if mark == START:  # the next message began without an <|end|>
                out.append(("end", ""))
                self._held, self._state = buf[at:], "header"
            else:
                out.append(("end", mark))
                self._held, self._state = buf[at + len(mark) :], "between"
            return True
        string = self._json and _json_state(buf, self._in_string, self._escape)[0]
        keep = 0 if final or string else max(_overlap(buf, m) for m in _BODY_ENDS)
        if len(buf) > keep:
            if self._json:
                state = _json_state(buf[: len(buf) - keep], self._in_string, self._escape)
                self._in_string, self._escape = state
            out.append(("body", buf[: len(buf) - keep]))
            self._held = buf[len(buf) - keep :]
        if final:
            out.append(("end", ""))
            self._state = "between"
            self._in_string = self._escape = False
        return False

    def _find(self, buf: str, mark: str) -> int:
        """Where ``mark`` ends the body in ``buf`` (-1: it does not). A call's body is JSON: a
        marker inside one of its strings is text."""
        if not self._json:
            return buf.find(mark)
        at = buf.find(mark)
        while at >= 0:
            if not _json_state(buf[:at], self._in_string, self._escape)[0]:
                return at
            at = buf.find(mark, at + 1)
        return -1

    def _between(self, out: list[Item], final: bool) -> bool:
        buf = self._held
        head = buf.lstrip()
        if head.startswith(START):
            if len(buf) > len(head):
                out.append(("text", buf[: len(buf) - len(head)]))
            self._held, self._state = head, "header"
            return True
        if not final and START.startswith(head):
            return False
        self._state = "text"
        return True

    def _text(self, out: list[Item], final: bool) -> bool:
        buf = self._held
        at = buf.find(START)
        if at >= 0:
            if at:
                out.append(("text", buf[:at]))
            self._held, self._state = buf[at:], "header"
            return True
        keep = 0 if final else _overlap(buf, START)
        if len(buf) > keep:
            out.append(("text", buf[: len(buf) - keep]))
            self._held = buf[len(buf) - keep :]
        return False


def _json_state(text: str, in_string: bool, escape: bool) -> tuple[bool, bool]:
    """(inside a string, after its backslash) at the end of ``text``, a piece of JSON that
    started in the state given."""
    walk = JsonWalk(in_string, escape)
    for c in text:
        walk.step(c)
    return walk.in_string, walk.escape


def _overlap(text: str, mark: str) -> int:
    """The length of the longest end of ``text`` that begins ``mark``."""
    for n in range(min(len(text), len(mark) - 1), 0, -1):
        if mark.startswith(text[-n:]):
            return n
    return 0


# -- the thought and the answer ----------------------------------------------------------------


class HarmonySplitter:
    """The reasoning splitter of harmony (``ReasoningSplitter``'s interface): ``analysis``
    bodies are the thought, ``final`` and preamble bodies the answer, calls go on to the answer
    as written (for the call parser), text outside messages is answer. Blank space at either
    end of a thought, and leading blank space of an answer message, belong to neither; separate
    thoughts (or answer messages) are joined by a newline. ``reasoning_format`` ``none``: the
    reply as written, all answer; ``deepseek-legacy``: the answer is the reply as written and
    the thought is split out too."""

    def __init__(self, fmt: str) -> None:
        self.as_written = fmt == "none"
        self.keep_tags = fmt == "deepseek-legacy"
        self.reasoning = ""  # the whole thought so far
        self._reader = HarmonyReader()
        self._kind: Literal["thought", "answer", "call"] | None = None
        self._lead = True  # at a message's start: blank space is dropped
        self._blank = ""  # a thought's trailing blank space, held until more thought comes
        self._answered = False  # some answer text went out

    def feed(self, text: str) -> list[Part]:
        if self.as_written:
            return [("content", text)] if text else []
        out: list[Part] = [("content", text)] if self.keep_tags and text else []
        for item in self._reader.feed(text):
            self._item(item, out)
        return _joined(out)

    def finish(self) -> list[Part]:
        out: list[Part] = []
        if not self.as_written:
            for item in self._reader.finish():
                self._item(item, out)
        return _joined(out)

    def _item(self, item: Item, out: list[Part]) -> None:
        kind, value = item
        if kind == "header":
            self._lead, self._blank = True, ""
            if value.addressed:
                self._kind = "call"
                self._raw(value.raw, out)
            else:
                self._kind = "thought" if value.channel == "analysis" else "answer"
        elif kind == "body":
            if self._kind == "thought":
                self._thought(value, out)
            elif self._kind == "call":
                self._raw(value, out)
            else:
                self._answer(value, out)
        elif kind == "end":
            if self._kind == "call":
                self._raw(value, out)
            self._kind, self._lead, self._blank = None, True, ""
        elif kind == "text":  # blank space between messages goes as a message's lead would
            self._answer(value, out)
        elif value.addressed:  # "cut": a call's header the reply stopped inside
            self._raw(value.raw, out)
        else:
            log.debug("the reply ended inside a message header: %r", value.raw[:80])

    def _raw(self, text: str, out: list[Part]) -> None:
        if text and not self.keep_tags:
            out.append(("content", text))

    def _thought(self, text: str, out: list[Part]) -> None:
        text = self._blank + text
        if self._lead:
            text = text.lstrip()
        sent = text.rstrip()
        self._blank = text[len(sent) :]
        if sent:
            if self._lead and self.reasoning:
                sent = "\n" + sent
            self._lead = False
            self.reasoning += sent
            out.append(("reasoning", sent))

    def _answer(self, text: str, out: list[Part]) -> None:
        if self._lead:
            text = text.lstrip()
            if text and self._answered:
                text = "\n" + text
        if text:
            self._lead, self._answered = False, True
            if not self.keep_tags:
                out.append(("content", text))


def _joined(parts: list[Part]) -> list[Part]:
    out: list[Part] = []
    for kind, text in parts:
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        elif text:
            out.append((kind, text))
    return out


class HarmonyAnswer(AnswerFrame):
    """Where harmony's answer is: the ``final`` message after any thoughts. A JSON grammar of
    the answer becomes a grammar of the whole reply (thoughts, then the final message's header,
    then the JSON); a grammar of calls already is one."""

    def wrap(self, spec: GrammarSpec) -> GrammarSpec:
        if spec.kind != "json_schema" or spec.trigger is not None:
            return spec
        return GrammarSpec("lark", answer_grammar(spec.source))


# -- tool calls ------------------------------------------------------------------------------------


@dataclass
class _Open:
    """A call being read: its header, name, id (once it went out) and arguments so far."""

    header: Header
    name: str
    id: str | None = None
    body: str = ""


class HarmonyCallParser:
    """Calls out of a harmony reply (``CallParser``'s interface): a message to
    ``functions.NAME`` of a known tool is a call, its body the arguments; every other message,
    and text outside messages, is content as written. The call's id and name go out when its
    header is read and its arguments piece by piece when ``guaranteed`` (a grammar wrote them),
    else in one piece once the message ends as a JSON object. Cut off (``max_tokens``) after
    its name, a call is still a call, its arguments as far as they were written; a call of an
    unknown function, or whose arguments are not a JSON object, is content, and the log says
    why."""

    def __init__(self, fmt: Any, names: set[str], guaranteed: bool = False) -> None:
        self.fmt = fmt
        self.names = names
        self.guaranteed = guaranteed
        self.calls: list[ToolCall] = []
        self.problem: str | None = None
        self._reader = HarmonyReader()
        self._call: _Open | None = None

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        for item in self._reader.feed(text):
            self._item(item, out)
        return merged(out)

    def finish(self) -> list[Event]:
        out: list[Event] = []
        for item in self._reader.finish():
            self._item(item, out)
        return merged(out)

    def _item(self, item: Item, out: list[Event]) -> None:
        kind, value = item
        call = self._call
        if kind == "header":
            self._open(value, out)
        elif kind == "body":
            if call is None:
                out.append(value)
                return
            call.body += value
            if call.id is not None:
                out.append(ArgumentsDelta(len(self.calls), value))
        elif kind == "end":
            if call is None:
                out.append(value)
            else:
                self._close(call, value, out)
        elif kind == "text":
            out.append(value)
        else:  # "cut": the reply ended inside a header
            name = value.function
            if value.named and name in self.names:
                self._open(value, out)
                assert self._call is not None
                self._close(self._call, "", out)
            else:
                out.append(value.raw)

    def _open(self, header: Header, out: list[Event]) -> None:
        name = header.function
        if header.addressed and name in self.names:
            assert name is not None
            self._call = _Open(header, name)
            if self.guaranteed:
                self._call.id = self.fmt.new_id()
                out.append(CallStart(len(self.calls), self._call.id, name))
            return
        if header.addressed:
            self._fail(f"the model called {header.recipient!r}, which is not one of the tools")
        out.append(header.raw)

    def _close(self, call: _Open, end: str, out: list[Event]) -> None:
        self._call = None
        text = call.body.strip()
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        whole = isinstance(value, dict)
        cut = not whole and end == "" and _object_prefix(text)
        if not (whole or cut or call.id is not None):
            why = "not a JSON object" if text else "empty"
            self._fail(f"the arguments of {call.name!r} are {why}: {text[:80]!r}")
            out += [call.header.raw, call.body, end]
            return
        if call.id is None:
            call.id = self.fmt.new_id()
            out.append(CallStart(len(self.calls), call.id, call.name))
            if text:
                out.append(ArgumentsDelta(len(self.calls), text))
        if not whole:
            log.info("the output ended inside a call of %r: its arguments are cut off", call.name)
        self.calls.append(ToolCall(call.id, call.name, text))

    def _fail(self, why: str) -> None:
        self.problem = why
        log.info("model output not taken as a tool call (%s): kept as content", why)


def _object_prefix(text: str) -> bool:
    """Whether ``text`` is empty or the start of a JSON object that was never closed."""
    if not text:
        return True
    if not text.startswith("{"):
        return False
    depth, walk = 0, JsonWalk()
    for c in text:
        if not walk.step(c):
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return False  # closed, so not cut off (and not valid either)
    return True


def call_grammar(tools: Sequence[ToolSpec], lazy: bool) -> GrammarSpec:
    """A reply that is thoughts and preambles, then a call of one of ``tools`` (``lazy``: free
    text until the model writes ``to=functions.``, then the rest of a call)."""
    calls = [_call_rules(i, t, lazy) for i, t in enumerate(tools)]
    names = " | ".join(f"call_{i}" for i in range(len(tools)))
    if lazy:
        return GrammarSpec("lark", f"start: {names}\n" + "".join(calls) + _PIECES,
                           trigger=CALL_MARKER)  # fmt: skip
    return GrammarSpec("lark", f"start: (thought | preamble)* ({names})\n" + "".join(calls)
                       + _MESSAGES + _PIECES)  # fmt: skip


# the messages a grammar lets come first (each ends with the next message's start), and the
# pieces of a header, one lexeme each (llguidance's lexer is greedy: a literal that ran on past a
# shorter one could not give back); BODY_END: a body and its <|end|>, no <|start|> before it
_MESSAGES = (
    'thought: "<|channel|>" "analysis" "<|message|>" BODY_END "<|start|>assistant"\n'
    'preamble: "<|channel|>" "commentary" "<|message|>" BODY_END "<|start|>assistant"\n'
)
_PIECES = (
    "BODY_END: /(.|\\n)*<\\|end\\|>/ & ~/(.|\\n)*(<\\|end\\|>(.|\\n)+|<\\|start\\|>(.|\\n)*)/\n"
    'chan: "commentary" | "analysis"\n'
    "CONSTRAIN: / (<\\|constrain\\|>)?[A-Za-z0-9_-]{1,16}/\n"  # the type: "json"
)


def _call_rules(i: int, tool: ToolSpec, lazy: bool) -> str:
    """A call of ``tool``: its recipient after the channel or after the role, then an optional
    type, ``<|message|>`` and the arguments (``lazy``: from after ``to=functions.``)."""
    args = f"args_{i}: {json_schema_lark(tool.parameters)}\n"
    if lazy:
        rest = lark_string(tool.name)
        return f'call_{i}: {rest} ("<|channel|>" chan)? CONSTRAIN? "<|message|>" args_{i}\n' + args
    to = lark_string(" to=" + FUNCTIONS + tool.name)
    return (f'call_{i}: ("<|channel|>" chan {to} | {to} "<|channel|>" chan) CONSTRAIN? '
            f'"<|message|>" args_{i}\n' + args)  # fmt: skip


def answer_grammar(schema: dict[str, Any]) -> str:
    """A reply whose answer is JSON following ``schema``: thoughts, then the final message."""
    return (f'start: thought* "<|channel|>" "final" CONSTRAIN? "<|message|>" answer\n'
            f"answer: {json_schema_lark(schema)}\n" + _MESSAGES + _PIECES)  # fmt: skip


# -- the template's inputs -------------------------------------------------------------------------


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as gpt-oss's template reads them: an assistant turn's ``reasoning_content``
    as ``thinking``. The template takes a turn with calls with either a thought or content, not
    both: with a thought, such a turn's content is left out (as llama.cpp does; logged)."""
    out = []
    for m in messages:
        thought = m.get("reasoning_content")
        if m.get("role") == "assistant" and isinstance(thought, str) and "thinking" not in m:
            m = {**m, "thinking": thought}
            if m.get("tool_calls"):
                if m.get("content"):
                    log.info("an assistant turn with calls, a thought and content: gpt-oss's "
                             "template takes the thought, the content is left out")  # fmt: skip
                m.pop("content", None)
        out.append(m)
    return out
