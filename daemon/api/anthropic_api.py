"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) on the
one generation path.

A request is checked here (every error names the Anthropic field) and written as the OpenAI chat
request it means — ``system`` as the first message, content blocks as text, an assistant's
``tool_use`` blocks as its ``tool_calls``, ``tool_result`` blocks as ``tool`` messages, a
``thinking`` block as the turn's ``reasoning_content``, ``tools`` with their ``input_schema``,
``tool_choice`` (``auto``, ``any``, ``tool``, ``none``), ``thinking`` as the template's switch,
``stop_sequences`` as ``stop`` — then parsed and prepared as any chat request. The reply is the
OpenAI reply (``openai_stream``) rewritten: content blocks (``thinking``, ``text``,
``tool_use``), ``stop_reason`` and ``stop_sequence``, ``usage``; a stream is Anthropic's event
sequence (``message_start``, per block ``content_block_start``/``_delta``/``_stop``,
``message_delta``, ``message_stop``; an error after the headers is an ``error`` event).

What Strata cannot honour is refused, never ignored: image and document blocks, server tools
(``web_search``, ``bash``, …), ``redacted_thinking``, MCP servers, containers. ``thinking``'s
``budget_tokens`` is checked as Anthropic checks it (at least 1024, below ``max_tokens``), and
the whole reply, thought included, is bounded by ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from strata.daemon.api.api_errors import invalid, unsupported, wrong_type
from strata.daemon.api.api_shapes import error_json
from strata.daemon.api.openai_api import Parsed, chat_from, chat_prompt_text, json_object
from strata.daemon.api.openai_stream import ReplyStream, reply_body
from strata.daemon.api.serving import Serving, Started
from strata.daemon.json_types import JSONObject
from strata.engine.calls import partial_object

PATHS = ("/v1/messages", "/v1/messages/count_tokens")
FIRST_VERSION = "2023-01-01"  # the first anthropic-version of the Messages API
VERSION = re.compile(r"\d{4}-\d{2}-\d{2}")
MIN_THINKING_BUDGET = 1024  # Anthropic's floor for thinking.budget_tokens
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_REFUSED = {
    "mcp_servers": "MCP servers are not supported",
    "container": "containers (code execution) are not supported",
}


# -- the request --------------------------------------------------------------------------------


def check_version(request: Request) -> None:
    """``anthropic-version``: optional (curl); when given, a date from the first version on
    (clients send newer dates as they come out: the shapes served are the ones they keep)."""
    version = request.headers.get("anthropic-version")
    if version is None:
        return
    if not VERSION.fullmatch(version) or version < FIRST_VERSION:
        raise invalid(f"anthropic-version: {version[:40]!r} is not a version this server speaks "
                      f"(a date like {FIRST_VERSION} or later)", "anthropic-version")  # fmt: skip


def to_openai(raw: JSONObject, counting: bool = False) -> JSONObject:
    """The OpenAI chat request an Anthropic one means. ``counting``: a ``count_tokens`` body
    (no ``max_tokens``, nothing generated)."""
    for name, why in _REFUSED.items():
        if raw.get(name) not in (None, [], {}):
            raise unsupported(name, why)
    model = raw.get("model")
    if model is None:
        raise invalid("model: missing required field", "model")
    out: dict[str, Any] = {"model": model}
    if not counting:
        max_tokens = raw.get("max_tokens")
        if max_tokens is None:
            raise invalid("max_tokens: missing required field", "max_tokens")
        if type(max_tokens) is not int:
            raise wrong_type("max_tokens", "an integer", max_tokens)
        out["max_tokens"] = max_tokens
        for name in ("temperature", "top_p", "top_k", "stream"):
            if raw.get(name) is not None:
                out[name] = raw[name]
        stops = raw.get("stop_sequences")
        if stops is not None:
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise wrong_type("stop_sequences", "a list of strings", stops)
            if stops:
                out["stop"] = stops
    messages = raw.get("messages")
    if messages is None:
        raise invalid("messages: missing required field", "messages")
    if not isinstance(messages, list):
        raise wrong_type("messages", "a list of messages", messages)
    if not messages:
        raise invalid("messages: at least one message is needed", "messages")
    out["messages"] = _system(raw.get("system")) + [
        m for i, msg in enumerate(messages) for m in _message(msg, f"messages[{i}]")
    ]
    if isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        # Anthropic continues a last assistant turn (a prefill); the template would close it
        # and start a new one instead, which is another answer: refused, never approximated
        where = f"messages[{len(messages) - 1}]"
        raise unsupported(f"{where}.role", "continuing a last assistant turn (a prefill) is "
                          "not supported; end with a user turn")  # fmt: skip
    tools = raw.get("tools")
    if tools not in (None, []):
        out["tools"] = _tools(tools)
    choice = raw.get("tool_choice")
    if choice is not None:
        out["tool_choice"], parallel = _tool_choice(choice)
        if parallel is not None:
            out["parallel_tool_calls"] = parallel
    think = _thinking(raw.get("thinking"), out.get("max_tokens"))
    if think is not None:
        out["think"] = think
    _output_config(raw.get("output_config"), out)
    return out


def _output_config(config: Any, out: dict[str, Any]) -> None:
    """``output_config``: ``format`` (a JSON Schema the reply follows) and ``effort`` (the
    template's ``reasoning_effort``: low, medium, high)."""
    if config is None:
        return
    if not isinstance(config, dict):
        raise wrong_type("output_config", "an object", config)
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            raise invalid("output_config.format: expected {\"type\": \"json_schema\", "
                          "\"schema\": {...}}", "output_config.format")  # fmt: skip
        if not isinstance(fmt.get("schema"), dict):
            raise wrong_type("output_config.format.schema", "a JSON Schema object",
                             fmt.get("schema"))  # fmt: skip
        schema = {"name": "output", "schema": fmt["schema"]}
        out["response_format"] = {"type": "json_schema", "json_schema": schema}
    effort = config.get("effort")
    if effort is not None:
        if effort not in ("low", "medium", "high"):
            raise invalid(f"output_config.effort: {str(effort)[:40]!r} is not one this server "
                          "takes (low, medium, high)", "output_config.effort")  # fmt: skip
        out["reasoning_effort"] = effort


def _text_blocks(blocks: Any, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise wrong_type(where, "a string or a list of text blocks", blocks)
    texts = []
    for j, b in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind != "text":
            if isinstance(kind, str):
                raise unsupported(f"{at}.type", f"blocks of type {kind!r} are not supported here")
            raise wrong_type(at, 'a text block like {"type": "text", "text": "..."}', b)
        if not isinstance(b.get("text"), str):
            raise wrong_type(f"{at}.text", "a string", b.get("text"))
        texts.append(b["text"])
    return "\n\n".join(texts) if where == "system" else "".join(texts)


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    return [{"role": "system", "content": _text_blocks(system, "system")}]


def _message(m: Any, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI messages (a user turn's tool results are ``tool``
    messages of their own, before its text)."""
    if not isinstance(m, dict):
        raise wrong_type(where, "an object", m)
    role = m.get("role")
    if role not in ("user", "assistant"):
        if role is None:
            raise invalid(f"{where}.role: missing required field", f"{where}.role")
        raise invalid(f"{where}.role: {str(role)[:40]!r} is not 'user' or 'assistant'",
                      f"{where}.role", "invalid_value")  # fmt: skip
    content = m.get("content")
    if content is None:
        raise invalid(f"{where}.content: missing required field", f"{where}.content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise wrong_type(f"{where}.content", "a string or a list of content blocks", content)
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, b in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if not isinstance(kind, str):
            raise wrong_type(at, 'a content block like {"type": "text", "text": "..."}', b)
        if kind == "text":
            texts.append(_text_blocks([b], at))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(b, at))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(b, at))
        elif kind == "thinking" and role == "assistant":
            if not isinstance(b.get("thinking"), str):
                raise wrong_type(f"{at}.thinking", "a string", b.get("thinking"))
            thoughts.append(b["thinking"])
        elif kind in ("tool_use", "tool_result", "thinking"):
            raise invalid(f"{at}.type: a {kind} block cannot be in a {role} message",
                          f"{at}.type")  # fmt: skip
        else:
            raise unsupported(f"{at}.type", f"content blocks of type {kind!r} are not supported "
                              "(text, tool_use, tool_result and thinking are)")  # fmt: skip
    out = list(results)
    if role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if thoughts:
            msg["reasoning_content"] = "".join(thoughts)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    elif texts or not results:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _tool_use(b: dict[str, Any], at: str) -> dict[str, Any]:
    for name in ("id", "name"):
        if not isinstance(b.get(name), str):
            raise wrong_type(f"{at}.{name}", "a string", b.get(name))
    args = b.get("input", {})
    if not isinstance(args, dict):
        raise wrong_type(f"{at}.input", "an object", args)
    return {"id": b["id"], "type": "function",
            "function": {"name": b["name"], "arguments": json.dumps(args)}}  # fmt: skip


def _tool_result(b: dict[str, Any], at: str) -> dict[str, Any]:
    if not isinstance(b.get("tool_use_id"), str):
        raise wrong_type(f"{at}.tool_use_id", "a string", b.get("tool_use_id"))
    text = _text_blocks(b.get("content", ""), f"{at}.content")
    is_error = b.get("is_error", False)
    if not isinstance(is_error, bool):
        raise wrong_type(f"{at}.is_error", "a boolean", is_error)
    if is_error:  # the model must know the call failed: said in words, as the result's start
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": b["tool_use_id"], "content": text}


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise wrong_type("tools", "a list of tools", tools)
    out = []
    for i, t in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(t, dict):
            raise wrong_type(at, "a tool object", t)
        kind = t.get("type", "custom")
        if kind != "custom":
            why = f"tools of type {str(kind)[:40]!r} are not supported (custom tools are)"
            raise unsupported(f"{at}.type", why)
        if "input_schema" not in t:
            raise invalid(f"{at}.input_schema: missing required field", f"{at}.input_schema")
        fn = {"name": t.get("name"), "parameters": t["input_schema"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> tuple[Any, bool | None]:
    if not isinstance(choice, dict):
        raise wrong_type("tool_choice", 'an object like {"type": "auto"}', choice)
    kind = choice.get("type")
    no_parallel = choice.get("disable_parallel_tool_use")
    if no_parallel is not None and not isinstance(no_parallel, bool):
        raise wrong_type("tool_choice.disable_parallel_tool_use", "a boolean", no_parallel)
    parallel = None if no_parallel is None else not no_parallel
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise wrong_type("tool_choice.name", "a string", name)
        return {"type": "function", "function": {"name": name}}, parallel
    raise invalid(f"tool_choice.type: {str(kind)[:40]!r} is not one of auto, any, tool, none",
                  "tool_choice.type", "invalid_value")  # fmt: skip


def _thinking(thinking: Any, max_tokens: int | None) -> bool | None:
    """``thinking`` as the template's switch (None: the daemon's default)."""
    if thinking is None:
        return None
    if not isinstance(thinking, dict):
        raise wrong_type("thinking", 'an object like {"type": "enabled", "budget_tokens": N}',
                         thinking)  # fmt: skip
    kind = thinking.get("type")
    if thinking.get("display") not in (None, "summarized"):
        raise unsupported("thinking.display", "only the thought as written ('summarized') can be "
                          "returned (Strata signs no redacted thought)")  # fmt: skip
    if kind == "disabled":
        return False
    if kind == "adaptive":
        return True
    if kind != "enabled":
        raise invalid(f"thinking.type: {str(kind)[:40]!r} is not enabled, disabled or adaptive",
                      "thinking.type", "invalid_value")  # fmt: skip
    budget = thinking.get("budget_tokens")
    if type(budget) is not int:
        raise wrong_type("thinking.budget_tokens", "an integer", budget)
    if budget < MIN_THINKING_BUDGET or (max_tokens is not None and budget >= max_tokens):
        raise invalid(f"thinking.budget_tokens: {budget} must be at least {MIN_THINKING_BUDGET} "
                      "and less than max_tokens", "thinking.budget_tokens")  # fmt: skip
    return True


# -- the reply ----------------------------------------------------------------------------------


def stop_sequence(s: Started, tokens: list[int], finish: str) -> str | None:
    """The stop sequence that ended the reply: the one found first in the generated text (the
    emitter stops at the first; an end-of-generation token leaves none in it)."""
    stops = s.ready.params.stop
    if finish != "stop" or not stops:
        return None
    full = s.engine.tokenizer.decode(tokens, skip_special=True, continuation=True)
    found = [(full.find(x), x) for x in stops if x in full]
    return min(found)[1] if found else None


def _head(s: Started, msg_id: str) -> dict[str, Any]:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": s.reply.model}


def message_json(s: Started, body: JSONObject, stop: str | None) -> JSONObject:
    """The Messages reply from the OpenAI one."""
    choice = body["choices"][0]
    msg = choice["message"]
    content: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"],
                        "signature": ""})  # fmt: skip
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for c in msg.get("tool_calls") or ():
        content.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                        "input": partial_object(c["function"]["arguments"])})  # fmt: skip
    reason = "stop_sequence" if stop is not None else _STOP_REASONS[choice["finish_reason"]]
    usage = body["usage"]
    return {**_head(s, "msg_" + body["id"].removeprefix("chatcmpl-")), "content": content,
            "stop_reason": reason, "stop_sequence": stop,
            "usage": _usage(usage["prompt_tokens"], usage["completion_tokens"],
                            usage["prompt_tokens_details"]["cached_tokens"])}  # fmt: skip


def _usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    # Anthropic counts cache reads apart from input_tokens
    return {"input_tokens": prompt - cached, "output_tokens": completion,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}  # fmt: skip


def event(kind: str, data: JSONObject) -> bytes:
    text = json.dumps({"type": kind, **data}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {text}\n\n".encode()


class MessageEvents:
    """The OpenAI chunks of one streamed reply as Anthropic's events: a block opens when its
    kind of text starts (thinking, text, each call) and closes when another begins."""

    def __init__(self, s: Started) -> None:
        self.s = s
        self.index = -1
        self.open: str | None = None  # "thinking", "text", "tool_use"
        self.msg_id = "msg_" + s.reply.id.removeprefix("chatcmpl-")

    def start(self) -> list[bytes]:
        message = {**_head(self.s, self.msg_id), "content": [], "stop_reason": None,
                   "stop_sequence": None, "usage": _usage(len(self.s.ready.prompt), 0)}  # fmt: skip
        return [event("message_start", {"message": message})]

    def _block(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.open = kind
        return [*out, event("content_block_start", {"index": self.index, "content_block": block})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":  # Strata signs nothing: the signature is empty
            delta = {"type": "signature_delta", "signature": ""}
            out.append(event("content_block_delta", {"index": self.index, "delta": delta}))
        self.open = None
        return [*out, event("content_block_stop", {"index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def chunk(self, chunk: JSONObject) -> list[bytes]:
        out: list[bytes] = []
        for choice in chunk.get("choices", ()):
            d = choice["delta"]
            if d.get("reasoning_content"):
                if self.open != "thinking":
                    out += self._block("thinking", {"type": "thinking", "thinking": ""})
                out.append(self._delta({"type": "thinking_delta",
                                        "thinking": d["reasoning_content"]}))  # fmt: skip
            if d.get("content"):
                if self.open != "text":
                    out += self._block("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": d["content"]}))
            for call in d.get("tool_calls") or ():
                fn = call["function"]
                if "id" in call:
                    out += self._block("tool_use", {"type": "tool_use", "id": call["id"],
                                                    "name": fn["name"], "input": {}})  # fmt: skip
                if fn.get("arguments"):
                    out.append(self._delta({"type": "input_json_delta",
                                            "partial_json": fn["arguments"]}))  # fmt: skip
        return out

    def end(self, finish: str, stop: str | None, completion_tokens: int) -> list[bytes]:
        reason = "stop_sequence" if stop is not None else _STOP_REASONS[finish]
        delta = {"stop_reason": reason, "stop_sequence": stop}
        return [*self._close(),
                event("message_delta", {"delta": delta,
                                        "usage": {"output_tokens": completion_tokens}}),
                event("message_stop", {})]  # fmt: skip


async def _stream(serving: Serving, s: Started) -> AsyncIterator[bytes]:
    events = MessageEvents(s)
    openai = ReplyStream(s.reply, s.ready, s.engine.tokenizer)
    try:
        for b in events.start():
            yield b
        for chunk in openai.start():
            for b in events.chunk(chunk):
                yield b
        async for piece in s.gen.pieces():
            for chunk in openai.piece(piece):
                for b in events.chunk(chunk):
                    yield b
        r = s.gen.final()
    except Exception as e:  # the status line is sent: the error travels in the stream
        yield event("error", {"error": error_json(serving.error(e), "anthropic")["error"]})
        return
    finally:
        s.gen.close()
    finish = r.finish_reason
    for chunk in openai.end(r):
        for b in events.chunk(chunk):
            yield b
        for choice in chunk.get("choices", ()):
            finish = choice.get("finish_reason") or finish
    for b in events.end(finish, stop_sequence(s, r.tokens, finish), r.completion_tokens):
        yield b


def add_routes(app: FastAPI, serving: Serving) -> None:
    def parse(raw: dict[str, Any]) -> Parsed:
        return chat_from(to_openai(raw), serving.config.max_stop_sequences)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        received = time.monotonic()
        check_version(request)
        req = parse(json_object(await request.body()))
        s = await serving.start(request, req, received)
        if req.stream:
            return StreamingResponse(_stream(serving, s), media_type="text/event-stream",
                                     headers=SSE_HEADERS)  # fmt: skip
        r = await s.gen.result()
        body = reply_body(s.reply, r, s.ready, s.engine.tokenizer)
        finish = body["choices"][0]["finish_reason"]
        return JSONResponse(message_json(s, body, stop_sequence(s, r.tokens, finish)))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict[str, Any]:
        check_version(request)
        raw = json_object(await request.body())
        req = chat_from(to_openai(raw, counting=True), serving.config.max_stop_sequences)
        eng = serving.engine()
        serving.names().check(req.model)
        text = await asyncio.to_thread(chat_prompt_text, req, eng, serving.reasoning)
        return {"input_tokens": len(await asyncio.to_thread(eng.tokenizer.encode, text))}
