"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/tags``, ``/api/show``, ``/api/ps``,
``/api/version``) on the one generation path.

``/api/chat`` is written as the OpenAI chat request it means and ``/api/generate`` as a chat of
one user turn (with ``system``), or with ``raw`` as a plain completion; then prepared and queued
as every request is. The reply is the OpenAI reply rewritten: ``message`` (``content``,
``thinking``, ``tool_calls`` with their arguments as objects) or ``response``, ``done_reason``,
the counts and durations in nanoseconds; streamed (Ollama's default) as NDJSON, one object per
piece of text and a last one with ``done: true`` (an error after the headers is an
``{"error": ...}`` line).

Fields map onto Strata's, or are refused naming them, never ignored: ``think`` is the template's
switch (or an effort); ``format`` is ``"json"`` or a JSON Schema; each key of ``options`` is one
of Strata's sampling fields (``num_predict`` is ``max_tokens``; ``num_ctx`` is accepted up to
the context Strata serves), any other is an error naming it; ``keep_alive`` must agree with the
daemon's ``idle_release_s`` (the one idle release that exists: the cache shrinks to its core
after that long without a request); ``images``, ``suffix``, ``template`` and ``context`` are
refused. ``/api/tags`` lists the model served and the library's others; ``/api/pull`` is the
library's pull (``ollama_pull``).
"""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from strata.daemon.api import ollama_pull
from strata.daemon.api.api_errors import invalid, unsupported, wrong_type
from strata.daemon.api.ollama_models import add_model_routes
from strata.daemon.api.openai_api import Parsed, chat_from, completion_from, json_object
from strata.daemon.api.openai_stream import ReplyStream, reply_body
from strata.daemon.api.serving import Serving, Started
from strata.daemon.json_types import JSON, JSONObject
from strata.engine.calls import partial_object
from strata.engine.generation import GenerationResult

if TYPE_CHECKING:
    pass

PATHS = ("/api/chat", "/api/generate", "/api/tags", "/api/show", "/api/ps", "/api/version",
         *ollama_pull.PATHS)  # fmt: skip
# the Ollama release whose API this module follows (think, JSON Schema formats, tool calls):
# clients read it to know which fields they may send
NDJSON = "application/x-ndjson"
# options: Ollama's name -> the OpenAI request's field
_OPTIONS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
            "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n",
            "seed": "seed", "stop": "stop", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty"}  # fmt: skip
_GENERATE_REFUSED = {
    "suffix": "insertion (suffix) is not supported",
    "template": "a request's own template is not supported (the model's is used)",
    "context": "context (earlier token ids) is not supported; send the text again, or use "
    "/api/chat (a kept conversation's K/V is reused)",
    "images": "images are not supported (the model served reads text only)",
}
_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


# -- the request --------------------------------------------------------------------------------


def _options(options: Any, out: dict[str, Any], n_ctx: int) -> None:
    if options is None:
        return
    if not isinstance(options, dict):
        raise wrong_type("options", "an object", options)
    for name, value in options.items():
        where = f"options.{name}"
        if name == "num_predict":
            if type(value) is not int:
                raise wrong_type(where, "an integer", value)
            if value == 0 or value < -2:
                raise invalid(f"{where}: {value} (expected a count >= 1, or -1 or -2 for the "
                              "rest of the context)", where, "invalid_value")  # fmt: skip
            if value > 0:
                out["max_tokens"] = value
        elif name == "num_ctx":
            if type(value) is not int or value < 1:
                raise wrong_type(where, "an integer >= 1", value)
            if value > n_ctx:
                raise invalid(f"{where}: {value} is more than the {n_ctx} tokens of context this "
                              "server was started with (option n_ctx)", where)  # fmt: skip
        elif name in _OPTIONS:
            out[_OPTIONS[name]] = value
        else:
            raise unsupported(where, f"Strata has no option {name!r} (it takes num_predict, "
                              f"num_ctx and {', '.join(_OPTIONS)})")  # fmt: skip


def keep_alive_s(value: JSON) -> float:
    """``keep_alive`` in seconds (negative: forever), from a number or a duration string."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, str):
        raise wrong_type("keep_alive", 'a duration like "5m" or a number of seconds', value)
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise invalid(f"keep_alive: {value[:40]!r} is not a duration (like 5m, 1h30m, 300, -1)",
                      "keep_alive")  # fmt: skip
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


def check_keep_alive(value: JSON, idle_release_s: int) -> None:
    """``keep_alive`` must say what the daemon does: release the cache after
    ``idle_release_s`` without a request (0: never, which a negative keep_alive says)."""
    if value is None:
        return
    seconds = keep_alive_s(value)
    if (seconds < 0 and idle_release_s == 0) or seconds == idle_release_s > 0:
        return
    does = (f"releases its cache after {idle_release_s} s without a request"
            if idle_release_s else "never releases its cache")  # fmt: skip
    raise unsupported("keep_alive", f"{json.dumps(value)} cannot be honoured per request: this "
                      f"server {does} (option idle_release_s); send that, or leave keep_alive "
                      "out")  # fmt: skip


def _format(fmt: Any, out: dict[str, Any]) -> None:
    if fmt is None or fmt == "":
        return
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "format", "schema": fmt}}  # fmt: skip
    else:
        raise invalid(f"format: expected \"json\" or a JSON Schema object, got "
                      f"{json.dumps(fmt)[:40]}", "format", "invalid_value")  # fmt: skip


def _common(raw: dict[str, Any], out: dict[str, Any], serving: Serving, n_ctx: int) -> None:
    model = raw.get("model")
    if model is None:
        raise invalid("model: missing required field", "model")
    if not isinstance(model, str):
        raise wrong_type("model", "a string", model)
    out["model"] = model
    stream = raw.get("stream", True)  # Ollama streams unless told not to
    if not isinstance(stream, bool):
        raise wrong_type("stream", "a boolean", stream)
    out["stream"] = stream
    if raw.get("think") is not None:
        out["think"] = raw["think"]
    _format(raw.get("format"), out)
    _options(raw.get("options"), out, n_ctx)
    check_keep_alive(raw.get("keep_alive"), serving.config.idle_release_s)


def chat_request(raw: JSONObject, serving: Serving, n_ctx: int) -> JSONObject:
    out: dict[str, Any] = {}
    _common(raw, out, serving, n_ctx)
    messages = raw.get("messages")
    if messages is None:
        raise invalid("messages: missing required field", "messages")
    if not isinstance(messages, list):
        raise wrong_type("messages", "a list of messages", messages)
    out["messages"] = _messages(messages)
    if out["messages"] and out["messages"][-1].get("role") == "assistant":
        # Ollama continues a last assistant message; the template would close it and start a
        # new turn instead, which is another answer: refused, never approximated
        raise unsupported(f"messages[{len(messages) - 1}].role", "continuing a last assistant "
                          "message is not supported; end with a user or tool message")  # fmt: skip
    if raw.get("tools") not in (None, []):
        out["tools"] = raw["tools"]
    return out


def _messages(messages: list[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    calls: list[tuple[str, str]] = []  # (id, name) of the calls made so far, for the results
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise wrong_type(where, "an object", m)
        if m.get("images") not in (None, []):
            raise unsupported(f"{where}.images", "images are not supported (the model served "
                              "reads text only)")  # fmt: skip
        msg = {k: v for k, v in m.items() if k in ("role", "content")}
        if m.get("thinking") is not None and m.get("role") == "assistant":
            msg["reasoning_content"] = m["thinking"]
        if m.get("tool_calls") not in (None, []):
            msg["tool_calls"] = _calls(m["tool_calls"], f"{where}.tool_calls", len(calls))
            calls += [(c["id"], c["function"]["name"]) for c in msg["tool_calls"]]
        if m.get("role") == "tool":
            name = m.get("tool_name") or m.get("name")
            if name is not None and not isinstance(name, str):
                raise wrong_type(f"{where}.tool_name", "a string", name)
            # Ollama names the function a result answers; the earliest open call of that name
            # (or the earliest open call) is the one it answers
            match = [c for c in calls if name is None or c[1] == name]
            call_id = match[0][0] if match else f"call_{i}"
            if match:
                calls.remove(match[0])
            msg["tool_call_id"] = call_id
            if name is not None:
                msg["name"] = name
        out.append(msg)
    return out


def _calls(raw: Any, where: str, first: int) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise wrong_type(where, "a list of tool calls", raw)
    out = []
    for j, c in enumerate(raw):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict):
            raise wrong_type(f"{where}[{j}].function", "an object", fn)
        args = fn.get("arguments", {})
        if not isinstance(args, dict):
            raise wrong_type(f"{where}[{j}].function.arguments", "an object", args)
        call = {"name": fn.get("name"), "arguments": json.dumps(args)}
        out.append({"id": f"call_{first + j}", "type": "function", "function": call})
    return out


def generate_request(raw: JSONObject, serving: Serving, n_ctx: int) -> JSONObject | None:
    """The OpenAI request of a ``/api/generate``; None: no prompt (Ollama's way to load)."""
    for name in ("suffix", "template", "context", "images"):
        if raw.get(name) not in (None, "", []):
            raise unsupported(name, _GENERATE_REFUSED[name])
    out: dict[str, Any] = {}
    _common(raw, out, serving, n_ctx)
    prompt = raw.get("prompt", "")
    if not isinstance(prompt, str):
        raise wrong_type("prompt", "a string", prompt)
    system = raw.get("system")
    if system is not None and not isinstance(system, str):
        raise wrong_type("system", "a string", system)
    is_raw = raw.get("raw", False)
    if not isinstance(is_raw, bool):
        raise wrong_type("raw", "a boolean", is_raw)
    if not prompt:
        return None
    if is_raw:
        if system:
            raise invalid("system: a raw prompt goes through no template to carry it", "system")
        out["prompt"] = prompt
        return out
    system_turn = [{"role": "system", "content": system}] if system else []
    out["messages"] = [*system_turn, {"role": "user", "content": prompt}]
    return out


# -- the reply ----------------------------------------------------------------------------------


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z")


def _counts(r: GenerationResult, received: float) -> dict[str, Any]:
    ns = 1_000_000_000
    return {"total_duration": int((time.monotonic() - received) * ns), "load_duration": 0,
            "prompt_eval_count": r.prompt_tokens, "prompt_eval_duration": int(r.prefill_s * ns),
            "eval_count": r.completion_tokens, "eval_duration": int(r.decode_s * ns)}  # fmt: skip


def _ollama_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"function": {"name": c["function"]["name"],
                          "arguments": partial_object(c["function"]["arguments"])}}
            for c in calls]  # fmt: skip


def _done_reason(finish: str) -> str:
    return "length" if finish == "length" else "stop"


def reply_json(kind: str, model: str, body: JSONObject, r: GenerationResult,
               received: float) -> JSONObject:  # fmt: skip
    choice = body["choices"][0]
    out: dict[str, Any] = {"model": model, "created_at": _now()}
    if kind == "chat":
        msg = choice["message"]
        message: dict[str, Any] = {"role": "assistant", "content": msg.get("content") or ""}
        if msg.get("reasoning_content"):
            message["thinking"] = msg["reasoning_content"]
        if msg.get("tool_calls"):
            message["tool_calls"] = _ollama_calls(msg["tool_calls"])
        out["message"] = message
    else:
        text = choice["message"].get("content") if "message" in choice else choice["text"]
        out["response"] = text or ""
        thought = choice.get("message", {}).get("reasoning_content")
        if thought:
            out["thinking"] = thought
    return {**out, "done": True, "done_reason": _done_reason(choice["finish_reason"]),
            **_counts(r, received)}  # fmt: skip


def line(obj: JSONObject) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


class NdjsonLines:
    """The chat chunks of one streamed reply as Ollama's NDJSON objects: one per piece of text
    (``message.content``/``thinking``, or ``response``/``thinking``); a call goes out whole,
    once its arguments are complete, just before the last object (``done: true``)."""

    def __init__(self, kind: str, model: str) -> None:
        self.kind = kind
        self.model = model
        self.calls: list[dict[str, Any]] = []
        self.finish = "stop"

    def _head(self) -> dict[str, Any]:
        return {"model": self.model, "created_at": _now()}

    def chunk(self, chunk: JSONObject) -> list[bytes]:
        out = []
        for choice in chunk.get("choices", ()):
            self.finish = choice.get("finish_reason") or self.finish
            d = choice.get("delta") or {"content": choice.get("text")}
            text, thought = d.get("content") or "", d.get("reasoning_content") or ""
            for c in d.get("tool_calls") or ():
                if "id" in c:
                    self.calls.append({"function": {"name": c["function"]["name"],
                                                    "arguments": ""}})  # fmt: skip
                self.calls[-1]["function"]["arguments"] += c["function"].get("arguments") or ""
            if not text and not thought:
                continue
            if self.kind == "chat":
                message = {"role": "assistant", "content": text}
                if thought:
                    message["thinking"] = thought
                out.append(line({**self._head(), "message": message, "done": False}))
            else:
                extra = {"thinking": thought} if thought else {}
                out.append(line({**self._head(), "response": text, **extra, "done": False}))
        return out

    def end(self, r: GenerationResult, received: float) -> list[bytes]:
        out = []
        if self.calls and self.kind == "chat":
            message = {"role": "assistant", "content": "", "tool_calls": _ollama_calls(self.calls)}
            out.append(line({**self._head(), "message": message, "done": False}))
        last: dict[str, Any] = (
            {"message": {"role": "assistant", "content": ""}} if self.kind == "chat"
            else {"response": ""}
        )  # fmt: skip
        done = {"done": True, "done_reason": _done_reason(self.finish), **_counts(r, received)}
        out.append(line({**self._head(), **last, **done}))
        return out


async def _stream(serving: Serving, s: Started, kind: str, model: str,
                  received: float) -> AsyncIterator[bytes]:  # fmt: skip
    openai = ReplyStream(s.reply, s.ready, s.engine.tokenizer)
    lines = NdjsonLines(kind, model)
    try:
        for chunk in openai.start():
            for b in lines.chunk(chunk):
                yield b
        async for piece in s.gen.pieces():
            for chunk in openai.piece(piece):
                for b in lines.chunk(chunk):
                    yield b
        r = s.gen.final()
        for chunk in openai.end(r):
            for b in lines.chunk(chunk):
                yield b
    except Exception as e:  # the status line is sent: the error travels in the stream
        yield line({"error": serving.error(e).message})
        return
    finally:
        s.gen.close()
    for b in lines.end(r, received):
        yield b


def add_routes(app: FastAPI, serving: Serving) -> None:
    async def run(request: Request, req: Parsed, received: float, kind: str) -> Response:
        s = await serving.start(request, req, received)
        if req.stream:
            return StreamingResponse(_stream(serving, s, kind, req.model, received),
                                     media_type=NDJSON)  # fmt: skip
        r = await s.gen.result()
        body = reply_body(s.reply, r, s.ready, s.engine.tokenizer)
        return JSONResponse(reply_json(kind, req.model, body, r, received))

    @app.post("/api/chat")
    async def api_chat(request: Request) -> Response:
        received = time.monotonic()
        raw = json_object(await request.body())
        eng = serving.engine()
        req = chat_from(chat_request(raw, serving, eng.n_ctx), serving.config.max_stop_sequences)
        return await run(request, req, received, "chat")

    @app.post("/api/generate")
    async def api_generate(request: Request) -> Response:
        received = time.monotonic()
        raw = json_object(await request.body())
        eng = serving.engine()
        out = generate_request(raw, serving, eng.n_ctx)
        if out is None:  # nothing to generate: the model is loaded (it always is, once ready)
            serving.names().check(raw["model"])
            return JSONResponse({"model": raw["model"], "created_at": _now(), "response": "",
                                 "done": True, "done_reason": "load"})  # fmt: skip
        max_stop = serving.config.max_stop_sequences
        req = completion_from(out, max_stop) if "prompt" in out else chat_from(out, max_stop)
        return await run(request, req, received, "generate")

    add_model_routes(app, serving)
    ollama_pull.add_routes(app, serving)
