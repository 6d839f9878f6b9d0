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

import asyncio
import datetime as dt
import hashlib
import json
import re
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from strata.daemon import library, ollama_pull
from strata.daemon.api_errors import invalid, unsupported, wrong_type
from strata.daemon.engine_setup import models_dir
from strata.daemon.openai_api import Parsed, chat_from, completion_from, json_object
from strata.daemon.openai_stream import ReplyStream, reply_body
from strata.daemon.serving import Serving, Started
from strata.engine.calls import partial_object
from strata.engine.generation import GenerationResult
from strata.engine.reasoning import family_for

if TYPE_CHECKING:
    from strata.engine.generate import Engine

PATHS = ("/api/chat", "/api/generate", "/api/tags", "/api/show", "/api/ps", "/api/version",
         *ollama_pull.PATHS)  # fmt: skip
# the Ollama release whose API this module follows (think, JSON Schema formats, tool calls):
# clients read it to know which fields they may send
OLLAMA_API_VERSION = "0.9.0"
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


def keep_alive_s(value: Any) -> float:
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


def check_keep_alive(value: Any, idle_release_s: int) -> None:
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


def chat_request(raw: dict[str, Any], serving: Serving, n_ctx: int) -> dict[str, Any]:
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


def generate_request(raw: dict[str, Any], serving: Serving, n_ctx: int) -> dict[str, Any] | None:
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


def reply_json(kind: str, model: str, body: dict[str, Any], r: GenerationResult,
               received: float) -> dict[str, Any]:  # fmt: skip
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


def line(obj: dict[str, Any]) -> bytes:
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

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
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


# -- the model ----------------------------------------------------------------------------------


def _details(engine: Any) -> dict[str, Any]:
    index = engine.index
    arch = str(index.metadata.get("general.architecture", ""))
    params = sum(_elements(t.shape) for t in index.tensors.values())
    ftype = index.metadata.get("general.file_type")
    return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
            "parameter_size": _size_words(params),
            "quantization_level": str(ftype) if ftype is not None else ""}  # fmt: skip


def _elements(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _size_words(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _entry(serving: Serving, engine: Any, name: str) -> dict[str, Any]:
    index = engine.index
    modified = dt.datetime.fromtimestamp(serving.created(), dt.UTC).isoformat()
    # an identity of the file as served (name, size, time), not a hash of its bytes
    ident = f"{index.name}\0{index.file_bytes}\0{serving.created()}".encode()
    return {"name": name, "model": name, "modified_at": modified.replace("+00:00", "Z"),
            "size": index.file_bytes, "digest": hashlib.sha256(ident).hexdigest(),
            "details": _details(engine)}  # fmt: skip


def show(serving: Serving, engine: Engine, name: str) -> dict[str, Any]:
    index = engine.index
    template = engine.template.source if engine.template is not None else ""
    caps = ["completion"]
    if engine.template is not None and engine.template_renders_tools:
        caps.append("tools")
    if family_for(template or None) is not None:
        caps.append("thinking")
    info = {k: v for k, v in index.metadata.items()
            if isinstance(v, int | float | str) and not k.startswith("tokenizer.")}  # fmt: skip
    entry = _entry(serving, engine, name)
    return {"modelfile": "", "parameters": "", "template": template, "details": entry["details"],
            "model_info": info, "capabilities": caps,
            "modified_at": entry["modified_at"]}  # fmt: skip


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

    _add_model_routes(app, serving)
    ollama_pull.add_routes(app, serving)


def _add_model_routes(app: FastAPI, serving: Serving) -> None:
    """The models served and on the shelf, one model's details, the loaded one, the version."""

    @app.get("/api/tags")
    async def api_tags() -> dict[str, Any]:
        eng = serving.engine()
        names = serving.names()
        served = [_entry(serving, eng, n) for n in (names.id, *names.aliases)]
        shelf = await asyncio.to_thread(
            _shelf, models_dir(serving.config), {e["name"] for e in served}
        )
        return {"models": served + shelf}

    @app.post("/api/show")
    async def api_show(request: Request) -> dict[str, Any]:
        raw = json_object(await request.body())
        name = raw.get("model", raw.get("name"))
        if name is None:
            raise invalid("model: missing required field", "model")
        if not isinstance(name, str):
            raise wrong_type("model", "a string", name)
        eng = serving.engine()
        serving.names().check(name)
        return show(serving, eng, name)

    @app.get("/api/ps")
    async def api_ps() -> dict[str, Any]:
        eng = serving.engine()
        names = serving.names()
        idle = serving.config.idle_release_s
        expires = (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=idle)) if idle else None
        vram = serving.daemon.read_status().cache_mib * 1024 * 1024
        until = expires.isoformat().replace("+00:00", "Z") if expires else None
        entry = {**_entry(serving, eng, names.id), "size_vram": vram, "expires_at": until}
        return {"models": [entry]}

    @app.get("/api/version")
    async def api_version() -> dict[str, str]:
        return {"version": OLLAMA_API_VERSION}


def _shelf(root: Any, served: set[str]) -> list[dict[str, Any]]:
    """The library's other models (``strata pull``'s), as ``/api/tags`` lists them; a library
    that cannot be read lists nothing (logged by ``library``)."""
    out = []
    for name, created in library.listed(root):
        m = library.find(root, name)
        if name in served or m is None:
            continue
        modified = dt.datetime.fromtimestamp(created, dt.UTC).isoformat().replace("+00:00", "Z")
        ident = f"{name}\0{m.size}\0{created}".encode()
        details = {"parent_model": "", "format": "gguf", "family": "", "families": [],
                   "parameter_size": "", "quantization_level": m.quant or ""}  # fmt: skip
        out.append({"name": name, "model": name, "modified_at": modified, "size": m.size,
                    "digest": hashlib.sha256(ident).hexdigest(), "details": details})  # fmt: skip
    return out
