"""Harmony (gpt-oss's format) through the daemon: the hand-written replies of
``tests/model/harmony/transcripts.py`` in OpenAI's, Anthropic's and Ollama's shapes, streamed
and not, and a real daemon on a model whose file carries gpt-oss's template and harmony's
tokens.

The shapes run the daemon's own code in-process: a request is planned by ``prepare`` (the
template renders, the tool format, the reasoning family and the grammar are chosen from the
file's template), the reply's tokens go through the tokenizer's stream decoder as a generation
gives them, and the OpenAI body and chunks are turned into Anthropic's and Ollama's as their
routes do. A random-weight model cannot write a transcript; the real daemon (tiny-qwen3moe's
random weights under gpt-oss's template) shows what its grammars make of it: a required call is
a valid call of the tool, a JSON answer is the JSON, in every API, and the reasoning fields
steer the template or are refused with the field named. Its requests are greedy or seeded: the
grammars let a model think first, and a random model that starts a thought never ends it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from strata.daemon.api import anthropic_api, ollama_api
from strata.daemon.api.generation import Piece
from strata.daemon.api.openai_api import Reply, parse_chat, prepare
from strata.daemon.api.openai_stream import ReplyStream, reply_body
from strata.engine import synth
from strata.engine.calls import partial_object
from strata.engine.chat_template import ChatTemplate
from strata.engine.generate import Engine
from strata.engine.generation import GenerationResult
from strata.engine.grammar import Grammars
from strata.engine.reasoning import HARMONY
from strata.engine.tokenizer import Tokenizer
from strata.engine.tool_calls import HarmonyFormat
from tests.integration.harness import StrataDaemon
from tests.model.harmony.transcripts import TRANSCRIPTS, WEATHER, Transcript, harmony_vocab

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PARAMS = WEATHER["function"]["parameters"]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


class TranscriptEngine(Engine):
    """The engine's prompt side on the harmony vocabulary and template, without weights: what
    ``prepare`` reads (the template, the tokenizer, the grammars)."""

    n_ctx = 4096  # type: ignore[assignment]

    def __init__(self) -> None:
        vocab = harmony_vocab()
        self.tokenizer = Tokenizer.from_vocab(vocab)
        assert vocab.chat_template is not None
        self.template = ChatTemplate(vocab.chat_template, eos_token="<|return|>")
        self.grammars = Grammars(self.tokenizer, self.tokenizer.vocab_size)
        self.index = SimpleNamespace(name="tiny-harmony")  # type: ignore[assignment]
        self._tools_rendered = None

    def check_fits(self, n_prompt: int, max_tokens: int) -> None:
        pass


@pytest.fixture(scope="module")
def engine() -> TranscriptEngine:
    return TranscriptEngine()


def shapes(engine: TranscriptEngine, t: Transcript, **fields: Any) -> dict[str, Any]:
    """The reply ``t`` in every API's shape: OpenAI's body and chunks, Anthropic's message and
    events, Ollama's object and lines."""
    raw = {"model": "m", "messages": ASK, "tools": [WEATHER], "max_tokens": 64, **fields}
    ready = prepare(parse_chat(json.dumps(raw).encode()), engine)
    assert ready.reasoning is not None and ready.reasoning.family is HARMONY
    assert ready.tools is not None and isinstance(ready.tools.format, HarmonyFormat)
    tok = engine.tokenizer
    tokens = tok.encode(t.text)
    decoder = tok.stream_decoder(keep=ready.show_special)
    pieces = [Piece(decoder.push(i)) for i in tokens]
    assert "".join(p.text for p in pieces) == t.text  # the frame survives the decoder
    r = GenerationResult(t.text, tokens, t.finish, len(ready.prompt))  # type: ignore[arg-type]
    reply = Reply("chat", "m", id="chatcmpl-1")
    body = reply_body(reply, r, ready, tok)
    stream = ReplyStream(reply, ready, tok)
    chunks = stream.start() + [c for p in pieces for c in stream.piece(p)] + stream.end(r)
    started: Any = SimpleNamespace(engine=engine, ready=ready, reply=reply)
    finish = body["choices"][0]["finish_reason"]
    out = {"openai": body, "chunks": chunks}
    out["anthropic"] = anthropic_api.message_json(started, body, None)
    events = anthropic_api.MessageEvents(started)
    data = events.start() + [b for c in chunks for b in events.chunk(c)]
    data += events.end(finish, None, len(tokens))
    out["events"] = [json.loads(b.decode().split("data: ", 1)[1]) for b in data]
    out["ollama"] = ollama_api.reply_json("chat", "m", body, r, 0.0)
    lines = ollama_api.NdjsonLines("chat", "m")
    out["lines"] = [json.loads(b) for b in [*(b for c in chunks for b in lines.chunk(c)),
                                            *lines.end(r, 0.0)]]  # fmt: skip
    return out


def openai_reading(body: dict[str, Any]) -> tuple[Any, ...]:
    m = body["choices"][0]["message"]
    calls = tuple((c["function"]["name"], c["function"]["arguments"])
                  for c in m.get("tool_calls") or ())  # fmt: skip
    return m.get("reasoning_content"), m["content"] or None, calls


def chunks_reading(chunks: list[dict[str, Any]]) -> tuple[Any, ...]:
    thought, content, calls, finish = "", "", {}, None
    for c in chunks:
        for choice in c["choices"]:
            d = choice["delta"]
            thought += d.get("reasoning_content") or ""
            content += d.get("content") or ""
            for call in d.get("tool_calls") or ():
                got = calls.setdefault(call["index"], ["", ""])
                got[0] += call["function"].get("name") or ""
                got[1] += call["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return thought or None, content or None, tuple(map(tuple, calls.values())), finish


def anthropic_reading(blocks: list[dict[str, Any]]) -> tuple[Any, ...]:
    thought = "".join(b["thinking"] for b in blocks if b["type"] == "thinking")
    text = "".join(b["text"] for b in blocks if b["type"] == "text")
    calls = tuple((b["name"], b["input"]) for b in blocks if b["type"] == "tool_use")
    return thought or None, text or None, calls


def events_blocks(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The message's content blocks as the events built them (input as parsed JSON)."""
    blocks: list[dict[str, Any]] = []
    for e in events:
        if e["type"] == "content_block_start":
            blocks.append({**e["content_block"], "partial": ""})
        elif e["type"] == "content_block_delta":
            d, b = e["delta"], blocks[e["index"]]
            if d["type"] == "thinking_delta":
                b["thinking"] += d["thinking"]
            elif d["type"] == "text_delta":
                b["text"] += d["text"]
            elif d["type"] == "input_json_delta":
                b["partial"] += d["partial_json"]
    for b in blocks:
        if b["type"] == "tool_use":
            b["input"] = partial_object(b["partial"])  # as the SDKs read partial JSON
    return blocks


@pytest.mark.parametrize("t", TRANSCRIPTS, ids=lambda t: t.name)
def test_transcripts_in_openais_shapes(engine: TranscriptEngine, t: Transcript) -> None:
    got = shapes(engine, t)
    want = (t.reasoning, t.content, t.calls)
    assert openai_reading(got["openai"]) == want
    finish = "tool_calls" if t.calls and t.finish == "stop" else t.finish
    assert got["openai"]["choices"][0]["finish_reason"] == finish
    assert chunks_reading(got["chunks"]) == (*want, finish)
    # streamed, a call's id and name come first, once
    starts = [d for c in got["chunks"] for ch in c["choices"]
              for d in ch["delta"].get("tool_calls") or () if "id" in d]  # fmt: skip
    assert [d["function"]["name"] for d in starts] == [name for name, _ in t.calls]


@pytest.mark.parametrize("t", TRANSCRIPTS, ids=lambda t: t.name)
def test_transcripts_in_anthropics_and_ollamas_shapes(engine: TranscriptEngine,
                                                      t: Transcript) -> None:  # fmt: skip
    got = shapes(engine, t)
    # a call cut off in its arguments carries what was written of them (``partial_object``)
    calls = tuple((name, partial_object(args)) for name, args in t.calls)
    want = (t.reasoning, t.content, calls)
    message = got["anthropic"]
    assert anthropic_reading(message["content"]) == want
    assert anthropic_reading(events_blocks(got["events"])) == want
    # thinking, then text, then each call: one block each, in that order
    kinds = [b["type"] for b in message["content"]]
    assert kinds == sorted(kinds, key=["thinking", "text", "tool_use"].index)
    assert [b["type"] for b in events_blocks(got["events"])] == kinds
    stop = {"stop": "tool_use" if calls else "end_turn", "length": "max_tokens"}[t.finish]
    assert message["stop_reason"] == got["events"][-2]["delta"]["stop_reason"] == stop
    o = got["ollama"]["message"]
    olla = (o.get("thinking"), o["content"] or None,
            tuple((c["function"]["name"], c["function"]["arguments"])
                  for c in o.get("tool_calls") or ()))  # fmt: skip
    assert olla == want
    lines = got["lines"]
    thought = "".join(x["message"].get("thinking", "") for x in lines)
    content = "".join(x["message"]["content"] for x in lines)
    streamed = tuple((c["function"]["name"], c["function"]["arguments"])
                     for x in lines for c in x["message"].get("tool_calls") or ())  # fmt: skip
    assert (thought or None, content or None, streamed) == want
    assert lines[-1]["done"] and lines[-1]["done_reason"] == ("length" if t.finish == "length"
                                                              else "stop")  # fmt: skip


def test_a_required_calls_grammar_takes_the_transcripts_call(engine: TranscriptEngine) -> None:
    """The grammar ``prepare`` compiles for ``tool_choice: required`` accepts a transcript's
    tokens (thought, then call) and then only the end; a call then streams as it comes."""
    t = next(t for t in TRANSCRIPTS if t.name == "thought then call")
    raw = {"model": "m", "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
           "max_tokens": 64}  # fmt: skip
    ready = prepare(parse_chat(json.dumps(raw).encode()), engine)
    assert ready.constraint is not None and ready.tools is not None and ready.tools.guaranteed
    for token in engine.tokenizer.encode(t.text):
        ready.constraint.accept(token)
        assert ready.constraint.error is None
    assert ready.constraint.done


# -- a real daemon -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StrataDaemon]:
    folder: Path = tmp_path_factory.mktemp("harmony")
    path = synth.write_model(folder / "tiny-harmony.gguf", synth.PRESETS["tiny-qwen3moe"],
                             harmony_vocab(), synth.TypePlan(), 0)  # fmt: skip
    d = StrataDaemon(folder, ["--model", str(path), "--device", "cpu"])
    yield d
    d.stop()


def _client(d: StrataDaemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0)


def test_the_files_template_renders_tools_effort_and_history(daemon: StrataDaemon) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    history = [*ASK, {"role": "assistant", "content": None, "reasoning_content": "Ask it.",
                      "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}]  # fmt: skip
    body = {"messages": history, "tools": [WEATHER], "reasoning_effort": "high"}
    prompt = httpx.post(daemon.url + "/apply-template", json=body, timeout=60).json()["prompt"]
    assert "Reasoning: high" in prompt and "namespace functions {" in prompt
    assert ("<|start|>assistant<|channel|>analysis<|message|>Ask it.<|end|><|start|>assistant "
            'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
            "<|call|>") in prompt  # fmt: skip
    assert prompt.endswith("<|start|>assistant")
    think = httpx.post(daemon.url + "/apply-template", json={"messages": ASK, "think": "low"},
                       timeout=60).json()["prompt"]  # fmt: skip
    assert "Reasoning: low" in think
    show = httpx.post(daemon.url + "/api/show", json={"model": "tiny-harmony"}, timeout=60).json()
    assert {"tools", "thinking"} <= set(show["capabilities"])


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"reasoning_effort": "none"}, "reasoning_effort"),
        ({"reasoning_effort": "minimal"}, "reasoning_effort"),
        ({"think": False}, "think"),
        (
            {"chat_template_kwargs": {"enable_thinking": False}},
            "chat_template_kwargs.enable_thinking",
        ),
    ],
)
def test_thinking_off_or_an_unknown_effort_is_a_400_naming_the_field(
    daemon: StrataDaemon, extra: dict[str, Any], param: str
) -> None:
    body = {"model": "", "messages": ASK, "max_tokens": 2, **extra}
    r = httpx.post(daemon.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_required_and_named_calls_are_valid_calls_in_every_api(daemon: StrataDaemon) -> None:
    client = _client(daemon)
    for seed in range(3):
        r = client.chat.completions.create(model="", messages=ASK, tools=[WEATHER], seed=seed,  # type: ignore[arg-type]
                                           tool_choice="required", max_tokens=80)  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), PARAMS)
    # streamed: the id and name first, then the arguments in pieces as the grammar wrote them
    named = {"type": "function", "function": {"name": "get_weather"}}
    deltas = [d for c in client.chat.completions.create(
        model="", messages=ASK, tools=[WEATHER], tool_choice=named, max_tokens=80, stream=True,  # type: ignore[arg-type]
        temperature=0,
    ) for d in (c.choices[0].delta.tool_calls or [] if c.choices else [])]  # fmt: skip
    assert deltas[0].id and deltas[0].function.name == "get_weather" and len(deltas) > 2
    args = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(args), PARAMS)
    # Anthropic: tool_choice any
    tool = {"name": "get_weather", "description": "The weather", "input_schema": PARAMS}
    body = {"model": "m", "max_tokens": 80, "messages": ASK, "tools": [tool],
            "tool_choice": {"type": "any"}, "temperature": 0}  # fmt: skip
    msg = httpx.post(daemon.url + "/v1/messages", json=body, timeout=120).json()
    assert msg["stop_reason"] == "tool_use", msg
    (use,) = [b for b in msg["content"] if b["type"] == "tool_use"]
    jsonschema.validate(use["input"], PARAMS)


def test_a_json_schema_answer_is_the_json_in_every_api(daemon: StrataDaemon) -> None:
    client = _client(daemon)
    fmt = {"type": "json_schema", "json_schema": {"name": "v", "schema": SCHEMA}}
    for fields in ({}, {"reasoning_format": "none"}):  # the frame is kept either way
        r = client.chat.completions.create(model="", messages=ASK, response_format=fmt,  # type: ignore[arg-type]
                                           max_tokens=40, temperature=0,
                                           extra_body=fields)  # fmt: skip
        assert r.choices[0].finish_reason == "stop"
        content = r.choices[0].message.content or ""
        if fields:  # as written: the frame, then the JSON
            assert content.startswith("<|channel|>")
            content = content.rsplit("<|message|>", 1)[1]
        assert set(json.loads(content)) == {"ok"}
    body = {"model": "m", "messages": ASK, "format": SCHEMA, "stream": False,
            "options": {"num_predict": 40, "temperature": 0}}  # fmt: skip
    o = httpx.post(daemon.url + "/api/chat", json=body, timeout=120).json()
    assert set(json.loads(o["message"]["content"])) == {"ok"}, o
