"""A generation's reply in OpenAI's shapes: the whole body, or the SSE chunks as the text comes.

With tools, the text goes through the format's call parser (``engine.tool_calls``): content, and
``tool_calls`` (``message.tool_calls``, or in a stream per call a chunk with its id and name,
then chunks with pieces of its arguments, as OpenAI streams them); ``finish_reason`` is
``tool_calls`` when the reply holds calls and ended on its own. Log-probabilities go with the
text their tokens made. Plain data in, plain data out: the HTTP edge only sends what comes out.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from strata.daemon.api.openai_api import Prepared, Reply, logprobs_json
from strata.daemon.api.openai_tools import token_chars
from strata.daemon.json_types import JSONObject
from strata.engine.reasoning import Part, split
from strata.engine.tool_calls import ArgumentsDelta, CallStart, Event, ToolCall

if TYPE_CHECKING:
    from strata.daemon.api.generation import Piece
    from strata.engine.generation import GenerationResult, TokenLogprob
    from strata.engine.tokenizer import Tokenizer

log = logging.getLogger("strata.daemon.openai_stream")  # the name its log lines always had

Chunk = JSONObject


def reply_body(
    reply: Reply, r: GenerationResult, ready: Prepared, tokenizer: Tokenizer
) -> JSONObject:
    """The whole (non-streamed) reply."""
    text: str | None = r.text
    thought: str | None = None
    if ready.reasoning is not None:  # the thought first: calls and content are the answer's
        thought, text = split(r.text, ready.reasoning.splitter())
    calls: list[ToolCall] | None = None
    finish = r.finish_reason
    tools = ready.tools
    if tools is not None and text is not None:
        text, calls = tools.format.parse(text, tools.tools)
        if not tools.parallel and len(calls) > 1:
            log.info("%d calls while parallel_tool_calls is false: the first is kept", len(calls))
            calls = calls[:1]
        if calls and finish == "stop":
            finish = "tool_calls"
    lp = logprobs_json(reply.kind, r.logprobs, tokenizer)
    return reply.body(
        text, finish, r.prompt_tokens, r.completion_tokens, calls, lp, r.cached_tokens, thought
    )


class ReplyStream:
    """The chunks of one streamed reply: ``start()``, ``piece()`` per piece of text, ``end()``."""

    def __init__(self, reply: Reply, ready: Prepared, tokenizer: Tokenizer) -> None:
        self.reply = reply
        self.tokenizer = tokenizer
        self.tools = ready.tools
        self.parser = None
        if self.tools is not None:
            self.parser = self.tools.format.parser(self.tools.tools, self.tools.guaranteed)
        self.logprobs = ready.params.logprobs is not None
        self.splitter = ready.reasoning.splitter() if ready.reasoning is not None else None
        self._waiting: list[TokenLogprob] = []  # logprobs for the next chunk that goes out
        self._offset = 0  # the characters of the tokens sent so far (a completion's text_offset)

    def start(self) -> list[Chunk]:
        return [self.reply.chunk("", first=True)] if self.reply.kind == "chat" else []

    def piece(self, piece: Piece) -> list[Chunk]:
        self._waiting.extend(piece.logprobs)
        if self.splitter is not None:
            return self._parts(self.splitter.feed(piece.text))
        return self._answer(piece.text)

    def _answer(self, text: str) -> list[Chunk]:
        """Chunks of answer text (through the call parser, with tools)."""
        if self.parser is not None:
            return self._events(self.parser.feed(text))
        if not text and not self._waiting:
            return []
        return [self.reply.chunk(text, logprobs=self._take())]

    def _parts(self, parts: Sequence[Part]) -> list[Chunk]:
        """A thought's pieces as ``delta.reasoning_content``, the answer's as usual."""
        out: list[Chunk] = []
        for kind, text in parts:
            if kind == "reasoning":
                out.append(self.reply.chunk(None, reasoning=text, logprobs=self._take()))
            else:
                out += self._answer(text)
        return out

    def end(self, r: GenerationResult) -> list[Chunk]:
        """What is held back, the closing chunk (and the usage chunk, when asked for)."""
        out = self._parts(self.splitter.finish()) if self.splitter is not None else []
        out += self._events(self.parser.finish()) if self.parser is not None else []
        if self._waiting and self.logprobs:  # a stop string's tokens: no text went with them
            out.append(self.reply.chunk("" if self.reply.kind == "chat" else None,
                                        logprobs=self._take()))  # fmt: skip
        finish = r.finish_reason
        if self.parser is not None and self.parser.calls and finish == "stop":
            finish = "tool_calls"
        out.append(self.reply.chunk(None, finish))
        if self.reply.include_usage:
            out.append(
                self.reply.usage_chunk(r.prompt_tokens, r.completion_tokens, r.cached_tokens)
            )
        return out

    def _take(self) -> dict[str, Any] | None:
        """The waiting logprobs in the endpoint's shape (None when none were asked for)."""
        if not self.logprobs or not self._waiting:
            return None
        out = logprobs_json(self.reply.kind, self._waiting, self.tokenizer, self._offset)
        self._offset += token_chars(self._waiting, self.tokenizer)
        self._waiting = []
        return out

    def _events(self, events: Sequence[Event]) -> list[Chunk]:
        """Content joined in one chunk, then a chunk per call event (a second call when
        ``parallel_tool_calls`` is false is dropped); the first carries the waiting logprobs
        (with nothing to send, they wait for the next)."""
        assert self.tools is not None
        parallel = self.tools.parallel
        entries = []
        for e in events:
            if isinstance(e, CallStart) and (parallel or e.index == 0):
                entries.append({"index": e.index, "id": e.id, "type": "function",
                                "function": {"name": e.name, "arguments": ""}})  # fmt: skip
            elif isinstance(e, ArgumentsDelta) and (parallel or e.index == 0):
                entries.append({"index": e.index, "function": {"arguments": e.text}})
        content = "".join(e for e in events if isinstance(e, str))
        out = []
        if content:
            out.append(self.reply.chunk(content, logprobs=self._take()))
        for entry in entries:
            lp = self._take() if not out else None
            out.append(self.reply.chunk(None, tool_calls=[entry], logprobs=lp))
        return out
