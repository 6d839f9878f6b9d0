"""OpenAI's Responses API through the real ``openai`` client (``responses.create``), on a model
whose template thinks as Qwen3.5's (the demo's random weights): input as a string and as items,
instructions, reasoning items, function calls and their outputs, ``text.format`` JSON Schema,
streaming events, ``previous_response_id``; bad input answered in OpenAI's error shape.

The output is meaningless: the tests hold the replies' shapes and the streams' event order,
never their content. One daemon for the module, small ``max_output_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest

from strata.engine import synth
from tests.integration.harness import StrataDaemon
from tests.integration.test_reasoning import thinking_template

OFF: Any = {"effort": "none"}
WEATHER: Any = {
    "type": "function", "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"], "additionalProperties": False},
    "strict": True,
}  # fmt: skip
SCHEMA: Any = {"type": "json_schema", "name": "verdict", "strict": True,
               "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                          "required": ["ok"], "additionalProperties": False}}  # fmt: skip


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StrataDaemon]:
    folder = tmp_path_factory.mktemp("responses")
    vocab = replace(synth.vocab_for("qwen3moe"), chat_template=thinking_template())
    path = synth.write_model(folder / "tiny-thinker.gguf", synth.PRESETS["tiny-qwen3moe"], vocab,
                             synth.TypePlan(), 0)  # fmt: skip
    d = StrataDaemon(folder, ["--model", str(path), "--device", "cpu"])
    yield d
    d.stop()


def _client(d: StrataDaemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0)


def test_string_input_thinks_in_a_reasoning_item(thinker: StrataDaemon) -> None:
    r = _client(thinker).responses.create(model="gpt-5", input="Why is the sky blue?",
                                          instructions="Be brief.", max_output_tokens=4,
                                          temperature=0)  # fmt: skip
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [i.type for i in r.output] == ["reasoning"]
    assert r.output[0].content[0].type == "reasoning_text" and r.output[0].content[0].text
    assert r.usage.input_tokens > 0 and r.usage.output_tokens == 4
    assert r.usage.output_tokens_details.reasoning_tokens == 4


def test_items_and_effort_none_give_a_message(thinker: StrataDaemon) -> None:
    items: Any = [{"role": "developer", "content": "Be brief."},
                  {"type": "message", "role": "user",
                   "content": [{"type": "input_text", "text": "Hello"}]}]  # fmt: skip
    r = _client(thinker).responses.create(model="m", input=items, reasoning=OFF,
                                          max_output_tokens=4)  # fmt: skip
    assert [i.type for i in r.output] in ([], ["message"])
    if r.output:
        assert r.output[0].content[0].type == "output_text"
        assert r.output_text == r.output[0].content[0].text


def _check_order(kinds: list[str]) -> None:
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    body = kinds[2:-1]
    while body:  # each item: added, its events, done
        assert body[0] == "response.output_item.added", kinds
        end = body.index("response.output_item.done")
        assert "response.output_item.added" not in body[1:end], kinds
        body = body[end + 1 :]


def test_streamed_events_in_order(thinker: StrataDaemon) -> None:
    client = _client(thinker)
    whole = client.responses.create(model="m", input="Hi", max_output_tokens=4, temperature=0)
    stream = client.responses.create(model="m", input="Hi", max_output_tokens=4, temperature=0,
                                     stream=True)  # fmt: skip
    events = list(stream)
    kinds = [e.type for e in events]
    _check_order(kinds)
    assert "response.reasoning_text.delta" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output[0].content[0].text == whole.output[0].content[0].text  # greedy


def test_function_call_then_its_output_by_previous_response_id(thinker: StrataDaemon) -> None:
    client = _client(thinker)
    r = client.responses.create(model="m", input="Weather in Paris?", tools=[WEATHER],
                                tool_choice="required", parallel_tool_calls=False,
                                reasoning=OFF, max_output_tokens=60)  # fmt: skip
    (call,) = [i for i in r.output if i.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    answer: Any = [{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}]
    again = client.responses.create(model="m", previous_response_id=r.id, input=answer,
                                    tools=[WEATHER], reasoning=OFF,
                                    max_output_tokens=3)  # fmt: skip
    assert again.previous_response_id == r.id
    assert again.usage.input_tokens_details.cached_tokens > 0  # the kept conversation went on
    # the same turn with the history as items (a client that keeps it itself)
    items: Any = [{"role": "user", "content": "Weather in Paris?"},
                  {"type": "function_call", "call_id": call.call_id, "name": call.name,
                   "arguments": call.arguments}, *answer]  # fmt: skip
    same = client.responses.create(model="m", input=items, tools=[WEATHER], reasoning=OFF,
                                   max_output_tokens=3)  # fmt: skip
    assert same.usage.input_tokens == again.usage.input_tokens


def test_function_call_streamed(thinker: StrataDaemon) -> None:
    stream = _client(thinker).responses.create(
        model="m", input="Weather in Paris?", tools=[WEATHER], reasoning=OFF, stream=True,
        tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
        max_output_tokens=60,
    )  # fmt: skip
    events = list(stream)
    kinds = [e.type for e in events]
    _check_order(kinds)
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert set(json.loads(done.arguments)) == {"city"}


def test_text_format_json_schema(thinker: StrataDaemon) -> None:
    r = _client(thinker).responses.create(
        model="m",
        input="Is it ok?",
        reasoning=OFF,
        text={"format": SCHEMA},
        max_output_tokens=40,
        extra_body={"seed": 1},
    )
    assert r.status == "completed"  # the schema closes the object within a few tokens
    assert set(json.loads(r.output_text)) == {"ok"}


def test_bad_input_is_an_openai_400(thinker: StrataDaemon) -> None:
    client = _client(thinker)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input="hi", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]
    unkept = client.responses.create(model="m", input="hi", store=False, max_output_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="m", input="hi", previous_response_id=unkept.id)
    bad: list[dict[str, Any]] = [
        {"input": "hi", "tools": [{"type": "web_search"}]},
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        {"input": [{"type": "item_reference", "id": "msg_1"}]},
        {"input": "hi", "truncation": "auto"},
        {"input": "hi", "background": True},
        {"input": 3},
    ]
    for body in bad:
        r = httpx.post(thinker.url + "/v1/responses", json={"model": "m", **body}, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
