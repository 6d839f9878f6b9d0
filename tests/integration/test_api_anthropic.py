"""Anthropic's Messages API through the real ``anthropic`` client, on a model whose template
thinks as Qwen3.5's (the demo's random weights): plain and streamed messages, thinking blocks,
tool use and tool results, stop sequences, ``count_tokens``, the API key as ``x-api-key``, and
bad input answered in Anthropic's error shape.

The output is meaningless: the tests hold the replies' shapes and the streams' event order,
never their content. One daemon for the module, small ``max_tokens``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import anthropic
import httpx
import pytest

from strata.engine import synth
from tests.integration.harness import StrataDaemon
from tests.integration.test_reasoning import thinking_template

KEY = "sk-anthropic-test"
GREEDY: Any = {"temperature": 0}  # older clients send it; this SDK has no argument for it
OFF: Any = {"type": "disabled"}
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER: Any = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                     "required": ["city"], "additionalProperties": False},
}  # fmt: skip


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StrataDaemon]:
    folder = tmp_path_factory.mktemp("anthropic")
    vocab = replace(synth.vocab_for("qwen3moe"), chat_template=thinking_template())
    path = synth.write_model(folder / "tiny-thinker.gguf", synth.PRESETS["tiny-qwen3moe"], vocab,
                             synth.TypePlan(), 0)  # fmt: skip
    d = StrataDaemon(folder, ["--model", str(path), "--device", "cpu"], env={"STRATA_API_KEY": KEY})
    yield d
    d.stop()


def _client(d: StrataDaemon, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=d.url, api_key=key, max_retries=0)


def _kinds(message: Any) -> list[str]:
    return [b.type for b in message.content]


def _blocks(kinds: list[str]) -> int:
    """Checks Anthropic's event order; returns the number of content blocks."""
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    blocks, n = kinds[1:-2], 0  # each block: start, deltas, stop
    while blocks:
        assert blocks[0] == "content_block_start", kinds
        end = blocks.index("content_block_stop")
        assert set(blocks[1:end]) <= {"content_block_delta"}, kinds
        blocks, n = blocks[end + 1 :], n + 1
    return n


def test_message_with_system_and_thinking_off(thinker: StrataDaemon) -> None:
    m = _client(thinker).messages.create(model="claude-sonnet-4-5", max_tokens=4, system="Brief.",
                                         messages=ASK, thinking=OFF, extra_body=GREEDY)  # fmt: skip
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert _kinds(m) in ([], ["text"])
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= 4


def test_thinking_blocks_whole_and_streamed(thinker: StrataDaemon) -> None:
    client = _client(thinker)
    on: Any = {"type": "adaptive"}
    m = client.messages.create(
        model="m", max_tokens=4, messages=ASK, thinking=on, extra_body=GREEDY
    )
    assert _kinds(m)[0] == "thinking" and m.content[0].thinking
    assert m.stop_reason == "max_tokens"
    with client.messages.stream(model="m", max_tokens=4, messages=ASK, extra_body=GREEDY) as stream:
        events = [
            e.type
            for e in stream
            if not e.type.startswith(("text", "thinking", "input", "signature"))
        ]
        final = stream.get_final_message()
    assert _blocks(events) == 1
    assert final.content[0].type == "thinking"
    assert final.content[0].thinking == m.content[0].thinking  # greedy: the same thought


def test_streamed_event_order_by_raw_events(thinker: StrataDaemon) -> None:
    stream = _client(thinker).messages.create(model="m", max_tokens=4, messages=ASK, stream=True,
                                              thinking=OFF)  # fmt: skip
    _blocks([e.type for e in stream])


def test_tool_use_then_tool_result(thinker: StrataDaemon) -> None:
    client = _client(thinker)
    one: Any = {"type": "any", "disable_parallel_tool_use": True}
    m = client.messages.create(model="m", max_tokens=60, messages=ASK, tools=[WEATHER],
                               tool_choice=one, thinking=OFF)  # fmt: skip
    assert m.stop_reason == "tool_use", m
    call = next(b for b in m.content if b.type == "tool_use")
    assert call.name == "get_weather" and set(call.input) == {"city"}
    result: Any = {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}
    history: Any = [*ASK, {"role": "assistant", "content": m.content},
                    {"role": "user", "content": [result]}]  # fmt: skip
    again = client.messages.create(model="m", max_tokens=3, messages=history, tools=[WEATHER],
                                   thinking=OFF)  # fmt: skip
    assert again.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = client.messages.count_tokens(model="m", messages=history, tools=[WEATHER],
                                           thinking=OFF)  # fmt: skip
    used = again.usage
    assert counted.input_tokens == used.input_tokens + (used.cache_read_input_tokens or 0)


def test_tool_use_streamed_as_input_json(thinker: StrataDaemon) -> None:
    with _client(thinker).messages.stream(
        model="m", max_tokens=60, messages=ASK, tools=[WEATHER], thinking=OFF,
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    ) as stream:  # fmt: skip
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content][-1] == "tool_use"
    assert set(final.content[-1].input) == {"city"}


def test_stop_sequence_is_named(thinker: StrataDaemon) -> None:
    client = _client(thinker)
    run_on = {**GREEDY, "ignore_eos": True}  # six tokens of text, whatever they are
    plain = client.messages.create(model="m", max_tokens=6, messages=ASK, extra_body=run_on,
                                   thinking=OFF)  # fmt: skip
    assert plain.stop_reason == "max_tokens" and plain.stop_sequence is None
    text = "".join(b.text for b in plain.content if b.type == "text")
    assert len(text) >= 3, text
    stop = text[1:3]
    m = client.messages.create(model="m", max_tokens=6, messages=ASK, extra_body=run_on,
                               thinking=OFF, stop_sequences=["never written", stop])  # fmt: skip
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop


def test_key_in_x_api_key_and_errors_in_anthropic_shape(thinker: StrataDaemon) -> None:
    with pytest.raises(anthropic.AuthenticationError) as e:
        _client(thinker, "wrong").messages.create(model="m", max_tokens=2, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    bad: list[dict[str, Any]] = [
        {"messages": ASK},  # no max_tokens
        {"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
        {"max_tokens": 2, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 5}},
        {"max_tokens": 2, "messages": ASK, "tools": [{"type": "web_search_20250305"}]},
        {"max_tokens": 2, "messages": [{"role": "robot", "content": "hi"}]},
    ]
    for body in bad:
        r = httpx.post(thinker.url + "/v1/messages", json={"model": "m", **body}, timeout=30,
                       headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"})  # fmt: skip
        assert r.status_code == 400, (body, r.text)
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert err["error"]["message"]
    r = httpx.post(thinker.url + "/v1/messages", json={"model": "m", "max_tokens": 2,
                   "messages": ASK}, headers={"x-api-key": KEY, "anthropic-version": "latest"},
                   timeout=30)  # fmt: skip
    assert r.status_code == 400 and "anthropic-version" in r.json()["error"]["message"]
