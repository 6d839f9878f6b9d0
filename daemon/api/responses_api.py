"""OpenAI's Responses API (``POST /v1/responses``) on the one generation path.

A request is checked here (errors name its fields, in OpenAI's error shape) and written as the
chat request it means: ``instructions`` as the first (system) message, ``input`` as a string or
as items (messages with text parts, ``function_call`` and ``function_call_output`` items,
``reasoning`` items as the next assistant turn's thought), the conversation of
``previous_response_id`` before it, function ``tools``, ``tool_choice``, ``text.format`` as the
``response_format``, ``reasoning.effort`` as ``reasoning_effort``, ``max_output_tokens`` as
``max_tokens``. The reply is the chat reply rewritten as output items (``reasoning`` with the
thought as ``reasoning_text`` content, ``message`` with ``output_text``, one ``function_call``
per call) and ``usage``; streamed as Responses events (``response.created``, per item
``output_item.added``, its deltas, ``output_item.done``, then ``response.completed`` or
``response.incomplete``; an error after the headers is an ``error`` event).

Responses are kept (``store``, true unless false) in memory for ``previous_response_id``: the
last ``kv_keep_conversations + 1`` of them, the conversations whose K/V the engine keeps and the
last request's, so that the next turn of a kept one computes only its new tokens. An id not
kept is a 400 naming it. What Strata cannot honour is refused: other tool types, images and
files, ``background``, ``conversation``, ``truncation: auto``, ``item_reference`` items.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from strata.daemon.api.api_errors import ApiError, invalid, unsupported, wrong_type
from strata.daemon.api.openai_api import chat_from, json_object
from strata.daemon.api.openai_stream import ReplyStream, reply_body
from strata.daemon.api.responses_items import (
    Shape,
    _new_id,
    call_item,
    message_item,
    output_as_messages,
    reasoning_item,
    response_json,
)
from strata.daemon.api.serving import Serving
from strata.daemon.json_types import JSON, JSONObject

PATHS = ("/v1/responses",)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# passed to the chat request as they are (the last four are llama.cpp's and OpenAI's extensions)
_PASSED = ("temperature", "top_p", "parallel_tool_calls", "stream", "top_k", "min_p",
           "repeat_penalty", "seed")  # fmt: skip
_REFUSED = {
    "background": "background responses are not supported",
    "conversation": "the Conversations API is not supported; use previous_response_id",
    "prompt": "stored prompt templates are not supported",
    "max_tool_calls": "max_tool_calls is not supported",
}
_INCLUDE = ("reasoning.encrypted_content",)  # answered without: the thought travels as text
_TEXT_PARTS = ("input_text", "output_text", "text")

Messages = list[JSONObject]


class ResponseStore:
    """The last ``size`` responses' conversations (chat messages, output included), by id."""

    def __init__(self, size: int) -> None:
        self.size = max(1, size)
        self._kept: OrderedDict[str, Messages] = OrderedDict()

    def get(self, response_id: str) -> Messages:
        try:
            return self._kept[response_id]
        except KeyError:
            shown = response_id if len(response_id) <= 80 else response_id[:80] + "…"
            raise ApiError(400, f"previous_response_id: no kept response {shown!r} (this server "
                           f"keeps its last {self.size} responses in memory, option "
                           "kv_keep_conversations, and none across restarts)",
                           "invalid_request_error", "previous_response_id",
                           "previous_response_not_found") from None  # fmt: skip

    def put(self, response_id: str, conversation: Messages) -> None:
        self._kept[response_id] = conversation
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)


# -- the request --------------------------------------------------------------------------------


def to_chat(raw: JSONObject, store: ResponseStore) -> tuple[JSONObject, Messages]:
    """The chat request a Responses request means, and the conversation it continues with
    (without the instructions, which a later response does not inherit)."""
    for name, why in _REFUSED.items():
        if raw.get(name) not in (None, False):
            raise unsupported(name, why)
    if raw.get("truncation") not in (None, "disabled"):
        raise unsupported("truncation", "only 'disabled' is supported (a prompt longer than the "
                          "context is an error, never cut)")  # fmt: skip
    include = raw.get("include") or []
    if not isinstance(include, list):
        raise wrong_type("include", "a list of strings", include)
    for i, v in enumerate(include):
        if v not in _INCLUDE:
            raise unsupported(f"include[{i}]", f"{str(v)[:60]!r} is not supported")
    model = raw.get("model")
    if model is None:
        raise invalid("model: missing required field", "model")
    out: dict[str, Any] = {"model": model}
    for name in _PASSED:
        if raw.get(name) is not None:
            out[name] = raw[name]
    if raw.get("max_output_tokens") is not None:
        out["max_tokens"] = raw["max_output_tokens"]
    earlier: Messages = []
    prev = raw.get("previous_response_id")
    if prev is not None:
        if not isinstance(prev, str):
            raise wrong_type("previous_response_id", "a string", prev)
        earlier = store.get(prev)
    given = raw.get("input")
    if given is None:
        raise invalid("input: missing required field", "input")
    conversation = [*earlier, *_input(given)]
    instructions = raw.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise wrong_type("instructions", "a string", instructions)
    system = [{"role": "system", "content": instructions}] if instructions else []
    out["messages"] = [*system, *conversation]
    _tools(raw, out)
    _text(raw.get("text"), out)
    _reasoning(raw.get("reasoning"), out)
    return out, conversation


def _input(given: Any) -> Messages:
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list):
        raise wrong_type("input", "a string or a list of items", given)
    if not given:
        raise invalid("input: at least one item is needed", "input")
    out: Messages = []
    thought: str | None = None  # a reasoning item's text, for the assistant turn after it
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise wrong_type(where, "an item object", item)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            msg = {"role": role, "content": _parts(item.get("content"), f"{where}.content")}
            if role == "assistant" and thought is not None:
                msg["reasoning_content"], thought = thought, None
            out.append(msg)
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": _string(item, "arguments", where)}}  # fmt: skip
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and thought is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                if thought is not None:
                    msg["reasoning_content"], thought = thought, None
                out.append(msg)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _parts(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                        "content": text})  # fmt: skip
        elif kind == "reasoning":
            thought = (thought or "") + _thought(item, where)
        else:
            raise unsupported(f"{where}.type", f"input items of type {str(kind)[:40]!r} are not "
                              "supported (message, function_call, function_call_output and "
                              "reasoning are)")  # fmt: skip
    if thought is not None:
        raise invalid(f"input[{len(given) - 1}]: a reasoning item must come before the "
                      "assistant message or function call it belongs to", "input")  # fmt: skip
    return out


def _string(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if value is None:
        raise invalid(f"{where}.{name}: missing required field", f"{where}.{name}")
    if not isinstance(value, str):
        raise wrong_type(f"{where}.{name}", "a string", value)
    return value


def _parts(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise wrong_type(where, "a string or a list of content parts", content)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            if isinstance(kind, str):
                raise unsupported(f"{at}.type", f"content parts of type {kind[:40]!r} are not "
                                  "supported (input_text and output_text are)")  # fmt: skip
            raise wrong_type(at, 'a part like {"type": "input_text", "text": "..."}', part)
        if not isinstance(part.get("text"), str):
            raise wrong_type(f"{at}.text", "a string", part.get("text"))
        texts.append(part["text"])
    return "".join(texts)


def _thought(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its ``reasoning_text`` content, else its summary."""
    for name, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(name)
        if parts:
            if not isinstance(parts, list):
                raise wrong_type(f"{where}.{name}", "a list of parts", parts)
            texts = []
            for j, p in enumerate(parts):
                if not isinstance(p, dict) or p.get("type") != kind:
                    raise wrong_type(f"{where}.{name}[{j}]", f"a {kind} part", p)
                texts.append(_string(p, "text", f"{where}.{name}[{j}]"))
            return "".join(texts)
    return ""


def _tools(raw: dict[str, Any], out: dict[str, Any]) -> None:
    tools = raw.get("tools")
    if tools not in (None, []):
        if not isinstance(tools, list):
            raise wrong_type("tools", "a list of tools", tools)
        chat_tools = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict):
                raise wrong_type(f"tools[{i}]", "a tool object", t)
            if t.get("type") != "function":
                raise unsupported(f"tools[{i}].type", f"tools of type {str(t.get('type'))[:40]!r}"
                                  " are not supported (function tools are)")  # fmt: skip
            fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
            chat_tools.append({"type": "function", "function": fn})
        out["tools"] = chat_tools
    choice = raw.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise unsupported("tool_choice.type", f"{str(choice.get('type'))[:40]!r} is not "
                              "supported (auto, none, required or a function)")  # fmt: skip
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        out["tool_choice"] = choice


def _text(text: Any, out: dict[str, Any]) -> None:
    if text is None:
        return
    if not isinstance(text, dict):
        raise wrong_type("text", "an object", text)
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return
    if not isinstance(fmt, dict):
        raise wrong_type("text.format", "an object", fmt)
    if fmt.get("type") == "json_object":
        out["response_format"] = {"type": "json_object"}
    elif fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        out["response_format"] = {"type": "json_schema", "json_schema": spec}
    else:
        raise invalid(f"text.format.type: {str(fmt.get('type'))[:40]!r} is not text, "
                      "json_object or json_schema", "text.format.type")  # fmt: skip


def _reasoning(reasoning: Any, out: dict[str, Any]) -> None:
    if reasoning is None:
        return
    if not isinstance(reasoning, dict):
        raise wrong_type("reasoning", "an object", reasoning)
    if reasoning.get("effort") is not None:
        out["reasoning_effort"] = reasoning["effort"]
    summary = reasoning.get("summary", reasoning.get("generate_summary"))
    if summary not in (None, "auto", "concise", "detailed"):
        raise invalid(f"reasoning.summary: {str(summary)[:40]!r} is not auto, concise or "
                      "detailed", "reasoning.summary")  # fmt: skip


# -- the reply ----------------------------------------------------------------------------------


class ResponseEvents:
    """The chat chunks of one streamed reply as Responses events: an output item opens when
    its kind of text starts (reasoning, message, each call) and is done when another begins."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None

    def event(self, kind: str, **data: JSON) -> bytes:
        obj = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {text}\n\n".encode()

    def start(self) -> list[bytes]:
        body = self.shape.body([], "in_progress")
        return [self.event("response.created", response=body),
                self.event("response.in_progress", response=body)]  # fmt: skip

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _open(self, item: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.items.append(item)
        self.open = item
        shown = {**item, "status": "in_progress"}
        if item["type"] != "function_call":
            shown["content"] = []
        out.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                              item=shown))  # fmt: skip
        if item["type"] != "function_call":
            part = {**item["content"][0], "text": ""}
            out.append(self.event("response.content_part.added", **self._where(),
                                  content_index=0, part=part))  # fmt: skip
        return out

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        out = []
        if item["type"] == "function_call":
            out.append(self.event("response.function_call_arguments.done", **where,
                                  name=item["name"], arguments=item["arguments"]))  # fmt: skip
        else:
            part = item["content"][0]
            if item["type"] == "reasoning":
                out.append(self.event("response.reasoning_text.done", **where, content_index=0,
                                      text=part["text"]))  # fmt: skip
            else:
                out.append(self.event("response.output_text.done", **where, content_index=0,
                                      text=part["text"], logprobs=[]))  # fmt: skip
            out.append(self.event("response.content_part.done", **where, content_index=0,
                                  part=part))  # fmt: skip
        out.append(self.event("response.output_item.done", output_index=where["output_index"],
                              item=item))  # fmt: skip
        return out

    def chunk(self, chunk: JSONObject) -> list[bytes]:
        out: list[bytes] = []
        for choice in chunk.get("choices", ()):
            d = choice["delta"]
            thought, text = d.get("reasoning_content"), d.get("content")
            if thought:
                if self.open is None or self.open["type"] != "reasoning":
                    out += self._open(reasoning_item(_new_id("rs"), ""))
                assert self.open is not None
                self.open["content"][0]["text"] += thought
                out.append(self.event("response.reasoning_text.delta", **self._where(),
                                      content_index=0, delta=thought))  # fmt: skip
            if text:
                if self.open is None or self.open["type"] != "message":
                    out += self._open(message_item(_new_id("msg"), ""))
                assert self.open is not None
                self.open["content"][0]["text"] += text
                out.append(self.event("response.output_text.delta", **self._where(),
                                      content_index=0, delta=text, logprobs=[]))  # fmt: skip
            for call in d.get("tool_calls") or ():
                fn = call["function"]
                if "id" in call:
                    out += self._open(call_item(_new_id("fc"), call["id"], fn["name"], ""))
                if fn.get("arguments") and self.open is not None:
                    self.open["arguments"] += fn["arguments"]
                    out.append(self.event("response.function_call_arguments.delta",
                                          **self._where(), delta=fn["arguments"]))  # fmt: skip
        return out

    def end(self, finish: str, usage: JSONObject) -> list[bytes]:
        out = self._close()
        status = "incomplete" if finish == "length" else "completed"
        body = self.shape.body(self.items, status, usage)
        return [*out, self.event(f"response.{status}", response=body)]


async def _stream(serving: Serving, shape: Shape, store: ResponseStore | None,
                  conversation: Messages) -> AsyncIterator[bytes]:  # fmt: skip
    s = shape.s
    events = ResponseEvents(shape)
    chat = ReplyStream(s.reply, s.ready, s.engine.tokenizer)
    finish = "stop"
    try:
        for b in events.start():
            yield b
        for chunk in chat.start():
            for b in events.chunk(chunk):
                yield b
        async for piece in s.gen.pieces():
            for chunk in chat.piece(piece):
                for b in events.chunk(chunk):
                    yield b
        r = s.gen.final()
        for chunk in chat.end(r):
            for choice in chunk.get("choices", ()):
                finish = choice.get("finish_reason") or finish
            for b in events.chunk(chunk):
                yield b
    except Exception as e:  # the status line is sent: the error travels in the stream
        err = serving.error(e)
        yield events.event("error", code=err.code, message=err.message, param=err.param)
        return
    finally:
        s.gen.close()
    thought = next(
        (i["content"][0]["text"] for i in events.items if i["type"] == "reasoning"), None
    )
    usage = shape.usage(r.prompt_tokens, r.completion_tokens, r.cached_tokens, thought)
    tail = events.end(finish, usage)
    if store is not None:
        store.put(shape.id, [*conversation, *output_as_messages(events.items)])
    for b in tail:
        yield b


def add_routes(app: FastAPI, serving: Serving) -> None:
    store = ResponseStore(serving.config.kv_keep_conversations + 1)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        received = time.monotonic()
        raw = json_object(await request.body())
        chat, conversation = to_chat(raw, store)
        keep = raw.get("store", True)
        if not isinstance(keep, bool):
            raise wrong_type("store", "a boolean", keep)
        req = chat_from(chat, serving.config.max_stop_sequences)
        s = await serving.start(request, req, received)
        shape = Shape(s, raw, _new_id("resp"))
        if req.stream:
            events = _stream(serving, shape, store if keep else None, conversation)
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        r = await s.gen.result()
        body, items = response_json(shape, reply_body(s.reply, r, s.ready, s.engine.tokenizer))
        if keep:
            store.put(shape.id, [*conversation, *output_as_messages(items)])
        return JSONResponse(body)
