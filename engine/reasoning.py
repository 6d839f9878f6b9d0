"""Reasoning in the model's own words: which chat templates think, how a request turns thinking
on or off, and the thought split from the answer (whole or streamed, one code path).

One small family per way of writing thoughts, chosen from the chat template, behind one
interface (as ``tool_calls`` does for calls):

- ``think`` (Qwen3, Qwen3.5/3.6, QwQ, DeepSeek-R1): ``<think>`` thought ``</think>`` answer. The
  template may open the block itself at the end of the prompt (Qwen3.5's and the 2507 "thinking"
  models' generation prompt ends with ``<think>``: the output starts inside the thought), switch
  it off with a variable (``enable_thinking``: Qwen3 then writes an empty block into the prompt),
  or leave it to the model (it writes ``<think>`` first, or not).

- ``harmony`` (gpt-oss, ``engine.harmony``): the reply is messages on channels, ``analysis``
  (the thought) before ``final`` (the answer); a subclass with its own splitter, which the
  reply always goes through (it is *framed*: even with ``reasoning_format`` ``none``, and a
  grammar of the answer wraps itself in the frame). It always thinks; ``reasoning_effort``
  (low, medium, high) says how much.

:func:`family_for` picks the family from the template's text.

The split follows llama-server's ``reasoning_format``: ``none`` leaves the text as the model
wrote it; ``deepseek`` (and ``auto``, the default) puts the thought in ``reasoning_content`` and
the rest in ``content``; ``deepseek-legacy`` does both (``content`` keeps the tags). Leading and
trailing blank space of a thought, and the blank space between it and the answer, belong to
neither. A thought cut off by ``max_tokens`` stays a thought. Plain Python: no torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from strata.engine.harmony import (
    CHANNEL,
    MESSAGE,
    HarmonyAnswer,
    HarmonySplitter,
    is_harmony_template,
)
from strata.engine.harmony import EFFORTS as HARMONY_EFFORTS

log = logging.getLogger(__name__)

ReasoningFormat = Literal["none", "auto", "deepseek", "deepseek-legacy"]
REASONING_FORMATS: tuple[str, ...] = ("none", "auto", "deepseek", "deepseek-legacy")
# OpenAI's reasoning_effort values ("none": no thinking at all)
EFFORTS: tuple[str, ...] = ("none", "minimal", "low", "medium", "high")

Kind = Literal["reasoning", "content"]
Part = tuple[Kind, str]  # a piece of the output and what it is


@dataclass(frozen=True)
class ReasoningFamily:
    """How one template family writes thoughts, and how its template is steered.

    ``switch``: the template variable that turns thinking off (``False``) or on, when the
    template reads it; ``effort``: whether the template reads ``reasoning_effort``;
    ``efforts``: the values it knows (None: any); ``framed``: the reply is read through the
    family's splitter whatever the ``reasoning_format``, and ``close`` is an
    :class:`~strata.engine.grammar.AnswerFrame` (harmony)."""

    name: str
    open: str
    close: str
    switch: str | None = None
    effort: bool = False
    efforts: tuple[str, ...] | None = None
    framed: bool = False

    def opened_by(self, prompt: str) -> bool:
        """Whether the rendered prompt ends inside an open thought (the template opened it:
        the output starts as a thought)."""
        text = prompt.rstrip()
        return text.endswith(self.open)

    def can_turn_off(self) -> bool:
        return self.switch is not None or self.effort

    def why_always_on(self) -> str:
        """Why thinking cannot be turned off (when ``can_turn_off`` is False)."""
        return "it reads neither enable_thinking nor reasoning_effort"

    def splitter(self, opened: bool, fmt: ReasoningFormat) -> ReasoningSplitter:
        """A splitter of one output; ``opened``: the prompt ended inside a thought."""
        return ReasoningSplitter(self, opened, fmt == "deepseek-legacy")


@dataclass(frozen=True)
class HarmonyFamily(ReasoningFamily):
    """gpt-oss (``engine.harmony``): it always thinks (``reasoning_effort`` low, medium or high
    says how much), and the prompt always leaves the reply before its answer (a thought may
    come first), whose frame ``close`` gives a grammar of the answer."""

    def opened_by(self, prompt: str) -> bool:
        return True

    def can_turn_off(self) -> bool:
        return False

    def why_always_on(self) -> str:
        return "gpt-oss always reasons, in harmony's analysis channel; the least is effort low"

    def splitter(self, opened: bool, fmt: ReasoningFormat) -> HarmonySplitter:  # type: ignore[override]
        return HarmonySplitter(fmt)


HARMONY = HarmonyFamily("harmony", CHANNEL + "analysis" + MESSAGE, HarmonyAnswer(CHANNEL + "final"),
                        None, True, HARMONY_EFFORTS, framed=True)  # fmt: skip


def family_for(template: str | None) -> ReasoningFamily | None:
    """The reasoning family of a chat template (None: its model does not think in a way this
    module knows)."""
    if not template:
        return None
    if is_harmony_template(template):
        return HARMONY
    if "<think>" in template or "</think>" in template:
        switch = "enable_thinking" if "enable_thinking" in template else None
        return ReasoningFamily("think", "<think>", "</think>", switch,
                               "reasoning_effort" in template)  # fmt: skip
    return None


class ReasoningSplitter:
    """Turns an output, fed as it comes, into parts: ("reasoning", text) and ("content", text).
    Text that may still be the start of a tag is held back until the next piece says what it
    is; ``finish()`` gives out what is held."""

    def __init__(self, family: ReasoningFamily, opened: bool, keep_tags: bool = False) -> None:
        self.family = family
        self.keep_tags = keep_tags
        self.opened = opened
        self.reasoning = ""  # the whole thought so far (stripped as it goes out)
        self._state: Literal["start", "thought", "answer"] = "thought" if opened else "start"
        self._held = ""  # text not given out yet
        self._lead = True  # at the start of the thought or of the answer: blank space is dropped
        self._raw_sent = not opened  # deepseek-legacy: the opening tag went out as content
        self.closed = False

    def feed(self, text: str) -> list[Part]:
        out: list[Part] = []
        if self.keep_tags and text:
            if not self._raw_sent:  # the template wrote the opening tag: content shows it
                self._raw_sent = True
                text_out = self.family.open + text
            else:
                text_out = text
            out.append(("content", text_out))
        self._held += text
        self._step(out, final=False)
        return _merged(out)

    def finish(self) -> list[Part]:
        out: list[Part] = []
        self._step(out, final=True)
        return _merged(out)

    def _step(self, out: list[Part], final: bool) -> None:
        while self._held:
            if self._state == "start":
                head = self._held.lstrip()
                if head.startswith(self.family.open):
                    self._held = head[len(self.family.open) :]
                    self._state, self._lead = "thought", True
                    continue
                if not final and self.family.open.startswith(head):
                    return  # blank space or the start of the tag: wait for more
                self._state, self._lead = "answer", False
                continue
            if self._state == "thought":
                if not self._thought(out, final):
                    return
                continue
            self._answer(out)

    def _thought(self, out: list[Part], final: bool) -> bool:
        """Gives out thought text; True when the thought closed (the rest is the answer)."""
        close = self.family.close
        at = self._held.find(close)
        if at >= 0:
            self._emit_thought(self._held[:at].rstrip(), out)
            self._held = self._held[at + len(close) :]
            self._state, self._lead, self.closed = "answer", True, True
            return True
        if final:
            self._emit_thought(self._held.rstrip(), out)
            self._held = ""
            return False
        # keep what may begin the closing tag, and blank space that may end the thought
        keep = _prefix_overlap(self._held, close)
        body = self._held[: len(self._held) - keep]
        sent = body.rstrip()
        self._emit_thought(sent, out)
        self._held = self._held[len(sent) :]
        return False

    def _emit_thought(self, text: str, out: list[Part]) -> None:
        if self._lead:
            text = text.lstrip()
        if text:
            self._lead = False
            self.reasoning += text
            out.append(("reasoning", text))

    def _answer(self, out: list[Part]) -> None:
        text, self._held = self._held, ""
        if self._lead:
            text = text.lstrip()
        if text:
            self._lead = False
            if not self.keep_tags:
                out.append(("content", text))


def split(text: str, splitter: ReasoningSplitter) -> tuple[str | None, str]:
    """(thought, answer) of a whole output, through a new ``splitter``; the thought None when
    there was none."""
    parts = splitter.feed(text) + splitter.finish()
    thought = "".join(t for kind, t in parts if kind == "reasoning")
    return (thought or None), "".join(t for kind, t in parts if kind == "content")


def _merged(parts: list[Part]) -> list[Part]:
    out: list[Part] = []
    for kind, text in parts:
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        elif text:
            out.append((kind, text))
    return out


def _prefix_overlap(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
