"""Parsing OpenAI requests: what is accepted, what is refused and how the error names the field;
and the app's answers while the model loads (a stand-in daemon, no engine)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from strata.daemon.api.http import create_app
from strata.daemon.api.openai_api import (
    ApiError,
    Reply,
    model_not_found,
    parse_chat,
    parse_completion,
    prepare,
)
from strata.daemon.config import StrataConfig


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


def refused(parse: Any, raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(raw)
    return e.value


def test_chat_request_becomes_messages_and_sampling_fields() -> None:
    req = parse_chat(body(
        messages=[{"role": "developer", "content": "be brief"},
                  {"role": "user", "content": [{"type": "text", "text": "a"},
                                               {"type": "text", "text": "b"}]},
                  {"role": "assistant", "content": None}],
        max_completion_tokens=5, temperature=0, stop="END", top_k=3, stream=True,
        stream_options={"include_usage": True}, n=1, tool_choice="none", logprobs=False,
        response_format={"type": "text"}, frequency_penalty=0, whatever={"x": 1},
    ))  # fmt: skip
    assert req.messages == [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": "ab"},
                            {"role": "assistant", "content": ""}]  # fmt: skip
    assert req.max_tokens == 5 and req.max_tokens_param == "max_completion_tokens"
    assert req.sampling == {"temperature": 0, "top_k": 3, "stop": ("END",)}
    assert req.stream and req.include_usage


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}], "n": True}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "tools[0].type"),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 3,
                "max_completion_tokens": 4,
            },
            "max_tokens",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": True}, "temperature"),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "stream_options": {"include_usage": 1},
                "stream": True,
            },
            "stream_options.include_usage",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "1"}]}]},
            "messages[0].tool_calls",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
        ),
        ({"messages": ["hi"]}, "messages[0]"),
    ],
)
def test_chat_fields_refused_name_the_field(fields: dict[str, Any], param: str) -> None:
    e = refused(parse_chat, body(**fields))
    assert e.status == 400 and e.param == param and param.split("[")[0] in e.message


def test_completion_prompt_forms() -> None:
    assert parse_completion(body(prompt="hi")).text == "hi"
    assert parse_completion(body(prompt=["hi"])).text == "hi"
    assert parse_completion(body(prompt=[1, 2, 3])).token_ids == [1, 2, 3]
    assert parse_completion(body(prompt=[[1, 2]])).token_ids == [1, 2]
    assert refused(parse_completion, body(prompt=[[1], [2]])).param == "prompt"
    assert refused(parse_completion, body(prompt=[1, "a"])).param.startswith("prompt")


class FakeEngine:
    n_ctx = 100
    fits = 100  # the tokens whose K/V the VRAM budget holds
    tokenizer = SimpleNamespace(vocab_size=50)

    def encode_prompt(self, text: str) -> list[int]:
        return [1] * len(text.split())

    def check_fits(self, n_prompt: int, max_tokens: int) -> None:
        from strata.engine.errors import ContextOverflow

        if n_prompt + max_tokens > self.n_ctx:
            raise ContextOverflow(f"{n_prompt} + {max_tokens} > {self.n_ctx}")
        if n_prompt + 1 > self.fits:
            raise ContextOverflow(f"prompt of {n_prompt} tokens: at most {self.fits - 1} fit")


def test_prepare_defaults_and_context_checks() -> None:
    eng = FakeEngine()
    ready = prepare(parse_completion(body(prompt="a b c")), eng)
    assert ready.prompt == [1, 1, 1] and ready.params.max_tokens == 16  # OpenAI's default
    assert ready.constraint is None and ready.tools is None
    e = refused(lambda raw: prepare(parse_completion(raw), eng), body(prompt="a", max_tokens=100))
    assert e.param == "max_tokens" and e.code == "context_length_exceeded"
    e = refused(lambda raw: prepare(parse_completion(raw), eng), body(prompt="a " * 100))
    assert e.param == "prompt" and "100 tokens" in e.message and "100" in e.message
    e = refused(lambda raw: prepare(parse_completion(raw), eng), body(prompt="a", top_p=2))
    assert e.param == "top_p" and "top_p: invalid value 2" in e.message
    e = refused(lambda raw: prepare(parse_completion(raw), eng), body(prompt=[49, 50]))
    assert e.param == "prompt" and "50" in e.message


def test_a_prompt_beyond_the_vram_budget_is_refused_without_max_tokens_too() -> None:
    eng = FakeEngine()
    eng.fits = 10
    e = refused(lambda raw: prepare(parse_completion(raw), eng), body(prompt="a " * 20))
    assert e.param == "prompt" and e.code == "context_length_exceeded"
    assert "at most 9 fit" in e.message
    eng.fits = 21
    assert prepare(parse_completion(body(prompt="a " * 20)), eng).prompt == [1] * 20


def test_a_context_overflow_from_the_engine_is_a_400() -> None:
    from strata.daemon.api.http import as_api_error
    from strata.engine.errors import ContextOverflow

    err = as_api_error(ContextOverflow("prompt of 9 tokens needs 12 MiB of K/V"))
    assert (err.status, err.code) == (400, "context_length_exceeded")
    assert "12 MiB of K/V" in err.message


def test_stream_chunks_have_the_openai_shape() -> None:
    req = parse_chat(body(messages=[{"role": "user", "content": "x"}], stream=True))
    reply = Reply.new(req, "m", "fp")
    first = reply.chunk("", first=True)
    assert first["object"] == "chat.completion.chunk" and "usage" not in first
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert reply.chunk(None, "stop")["choices"][0] == {
        "index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}  # fmt: skip


def test_usage_reports_the_cached_prompt_tokens_as_openai_does() -> None:
    req = parse_chat(body(messages=[{"role": "user", "content": "x"}], stream=True,
                          stream_options={"include_usage": True}))  # fmt: skip
    reply = Reply.new(req, "m", "fp")
    whole = reply.body("hi", "stop", 120, 5, cached_tokens=100)
    assert whole["usage"] == {"prompt_tokens": 120, "completion_tokens": 5, "total_tokens": 125,
                              "prompt_tokens_details": {"cached_tokens": 100}}  # fmt: skip
    assert reply.usage_chunk(120, 5, 100)["usage"] == whole["usage"]
    assert reply.body("hi", "stop", 3, 1)["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 0}  # fmt: skip


def loading_daemon(**config: Any) -> Any:
    status = {"state": "loading", "queued": 0, "busy": False, "cache_mib": 0, "hit_rate": None,
              "free_mib": None, "resizes": 0}  # fmt: skip
    return SimpleNamespace(
        config=StrataConfig(**config), state="loading", model_id="", model_path=None,
        device="cpu", started=0.0, status=lambda: status, sizes=lambda: [],
        worker=SimpleNamespace(engine=None, steps=0), controller=None, controls=None,
    )  # fmt: skip


def test_while_loading_generation_and_models_answer_503() -> None:
    client = TestClient(create_app(loading_daemon()), base_url="http://localhost")
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    for r in (client.post("/v1/chat/completions", json=chat),
              client.post("/v1/completions", json={"model": "m", "prompt": "x"}),
              client.get("/v1/models")):  # fmt: skip
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "model_loading" and r.headers["retry-after"] == "1"
    assert client.get("/health").status_code == 503
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and "strata_ready 0.0" in metrics.text


def test_an_unknown_model_of_any_length_is_named_but_not_echoed_whole() -> None:
    err = model_not_found("x" * 5000, "tiny")
    assert err.status == 404 and err.code == "model_not_found"
    assert "(5000 characters)" in err.message and len(err.message) < 300
    assert model_not_found("llama", "tiny").message == (
        "the model 'llama' does not exist; this server serves 'tiny'"
    )


class ByteTokenizer:
    """Token t is the one byte chr(t)."""

    def token_bytes(self, tid: int) -> bytes:
        return bytes([tid])


def test_reply_stream_sends_call_deltas_and_logprobs_with_their_text() -> None:
    from strata.daemon.api.generation import Piece
    from strata.daemon.api.openai_stream import ReplyStream
    from strata.daemon.api.openai_tools import ToolContext
    from strata.engine.generation import GenerationResult, TokenLogprob
    from strata.engine.params import SamplingParams
    from strata.engine.tool_calls import HermesFormat, ToolSpec

    req = parse_chat(body(messages=[{"role": "user", "content": "x"}], stream=True))
    reply = Reply.new(req, "m", "fp")
    tools = ToolContext(HermesFormat(), (ToolSpec("f", {"type": "object"}),), False, True)
    ready = SimpleNamespace(tools=tools, params=SamplingParams(logprobs=0), reasoning=None)
    stream = ReplyStream(reply, ready, ByteTokenizer())  # type: ignore[arg-type]
    assert stream.start()[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}

    def piece(text: str) -> Piece:
        return Piece(text, tuple(TokenLogprob(ord(c), -0.5) for c in text))

    out = stream.piece(piece("Hi <tool"))
    assert [c["choices"][0]["delta"] for c in out] == [{"content": "Hi "}]
    # "<tool" is held back: its logprobs wait for the chunk that sends it
    assert [e["token"] for e in out[0]["choices"][0]["logprobs"]["content"]] == list("Hi <tool")
    out = stream.piece(piece('_call>\n{"name": "f", "arguments": {"a"'))
    deltas = [c["choices"][0]["delta"]["tool_calls"][0] for c in out]
    assert deltas[0]["id"].startswith("call_") and deltas[0]["function"] == {
        "name": "f", "arguments": ""}  # fmt: skip
    assert deltas[1] == {"index": 0, "function": {"arguments": '{"a"'}}
    assert out[0]["choices"][0]["logprobs"] is not None and out[1]["choices"][0]["logprobs"] is None
    assert stream.piece(Piece(": 1}}\n</tool_call>"))[0]["choices"][0]["delta"]["tool_calls"] == [
        {"index": 0, "function": {"arguments": ": 1}"}}]  # fmt: skip
    end = stream.end(GenerationResult("", [], "stop", 3))
    assert end[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # a second call while parallel_tool_calls is false is dropped, the first is kept
    ready = SimpleNamespace(tools=tools, params=SamplingParams(), reasoning=None)
    stream = ReplyStream(reply, ready, ByteTokenizer())  # type: ignore[arg-type]
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>' * 2
    calls = [c for c in stream.piece(Piece(text)) if c["choices"][0]["delta"].get("tool_calls")]
    assert {c["choices"][0]["delta"]["tool_calls"][0]["index"] for c in calls} == {0}


def test_ignore_eos_reaches_the_sampler_and_a_wrong_type_is_refused() -> None:
    eng = FakeEngine()
    ready = prepare(parse_completion(body(prompt="a b", ignore_eos=True)), eng)
    assert ready.params.ignore_eos
    assert not prepare(parse_completion(body(prompt="a b")), eng).params.ignore_eos
    e = refused(parse_completion, body(prompt="a", ignore_eos="often"))
    assert e.param == "ignore_eos"
