"""Third-party clients as a new user runs them against the demo model: the ``openai`` client's
``parse()`` and tools whose schemas say nothing of ``additionalProperties``, LangChain's
``ChatOpenAI`` (``bind_tools`` with ``tool_choice="required"``, ``with_structured_output`` in its
three methods), and the model names clients send (``gpt-4o``, ``""``, an alias).

The demo model's weights are random: these tests hold the replies' shapes (calls in
``tool_calls``, objects that validate, no key the schema did not list), never their content.
One daemon for the module, small ``max_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.integration.harness import StrataDaemon

ALIAS = "my-demo"
SWITCH = "chat_template_kwargs.enable_thinking"

# LangChain and most clients send schemas without "additionalProperties": no other key allowed
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Verdict(BaseModel):
    """A verdict on the question."""

    ok: bool
    kind: Literal["yes", "no"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StrataDaemon]:
    d = StrataDaemon(tmp_path_factory.mktemp("clients"),
                     ["--device", "cpu", "--model-alias", ALIAS])  # fmt: skip
    yield d
    d.stop()


def _client(d: StrataDaemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0)


# -- model names ----------------------------------------------------------------------------------


def test_any_name_alias_and_file_name_select_the_one_model(demo: StrataDaemon) -> None:
    client = _client(demo)
    listed = [m.id for m in client.models.list().data]
    model_id = listed[0]
    assert listed == [model_id, ALIAS]
    file_name = model_id + ".gguf"
    for name in (model_id, ALIAS, file_name, "gpt-4o", ""):
        r = client.chat.completions.create(model=name, messages=ASK, max_tokens=2)
        assert r.choices[0].finish_reason == "length", name
        assert r.model == model_id
    assert client.models.retrieve(ALIAS).id == ALIAS
    assert client.models.retrieve("gpt-4o").id == model_id


# -- the openai client ----------------------------------------------------------------------------


def test_tool_arguments_hold_only_the_listed_keys(demo: StrataDaemon) -> None:
    client = _client(demo)
    for seed in range(4):
        r = client.chat.completions.create(
            model="gpt-4o", messages=ASK, tools=[WEATHER], tool_choice="required",
            parallel_tool_calls=False, max_tokens=60, seed=seed, temperature=1.5,
        )  # fmt: skip
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        assert set(json.loads(call.function.arguments)) <= {"city"}, call.function.arguments


def test_json_schema_without_additional_properties_admits_no_other_key(
    demo: StrataDaemon,
) -> None:
    client = _client(demo)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "v", "schema": schema}}
    for seed in range(4):
        r = client.chat.completions.create(model="gpt-4o", messages=ASK, response_format=fmt,
                                           max_tokens=40, seed=seed, temperature=1.5)  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "stop"
        assert set(json.loads(choice.message.content)) <= {"ok"}, choice.message.content


def test_parse_returns_the_pydantic_object(demo: StrataDaemon) -> None:
    client = _client(demo)
    # chat.completions.parse since openai 1.92; before, under beta
    completions = getattr(client.chat.completions, "parse", None) and client.chat.completions
    parse = (completions or client.beta.chat.completions).parse  # type: ignore[attr-defined]
    r = parse(model="gpt-4o", messages=ASK, response_format=Verdict, max_tokens=40)
    assert isinstance(r.choices[0].message.parsed, Verdict)
    tool = openai.pydantic_function_tool(Verdict)
    r = parse(model="gpt-4o", messages=ASK, tools=[tool], tool_choice="required", max_tokens=60)
    (call,) = r.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Verdict)


def test_a_call_cut_off_by_max_tokens_is_in_tool_calls_streamed_or_not(
    demo: StrataDaemon,
) -> None:
    client = _client(demo)
    ask = dict(model="gpt-4o", messages=ASK, tools=[WEATHER], tool_choice="required",
               max_tokens=14)  # fmt: skip
    r = client.chat.completions.create(**ask)  # type: ignore[call-overload]
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    assert not choice.message.content  # no markup left behind
    args, names = "", []
    for chunk in client.chat.completions.create(**ask, stream=True):  # type: ignore[call-overload]
        for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            names += [d.function.name] if d.function and d.function.name else []
            args += d.function.arguments or "" if d.function else ""
        assert not (chunk.choices and chunk.choices[0].delta.content)
    assert names == ["get_weather"] and args == call.function.arguments


# -- fields a template cannot honour are refused, naming them --------------------------------------


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"think": True}, "think"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"chat_template_kwargs": {"enable_thinking": True}}, SWITCH),
        ({"chat_template_kwargs": {"enable_thinking": "false"}}, SWITCH),
        ({"reasoning_format": "yes"}, "reasoning_format"),
    ],
)  # fmt: skip
def test_thinking_asked_of_a_template_that_does_not_think_is_a_400(
    demo: StrataDaemon, extra: dict[str, object], param: str
) -> None:
    body = {"model": "", "messages": ASK, "max_tokens": 2, **extra}
    r = httpx.post(demo.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    # asking for no thinking where there is none asks for nothing
    off = {"think": False, "chat_template_kwargs": {"enable_thinking": False}}
    ok = {"model": "", "messages": ASK, "max_tokens": 2, "reasoning_format": "none", **off}
    assert httpx.post(demo.url + "/v1/chat/completions", json=ok, timeout=30).status_code == 200


# -- LangChain ------------------------------------------------------------------------------------


def _chat(d: StrataDaemon, max_tokens: int) -> object:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=d.url + "/v1", api_key="unused", model="gpt-4o-mini",  # type: ignore[arg-type]
                      max_tokens=max_tokens, max_retries=0, temperature=0)  # type: ignore[call-arg]  # fmt: skip


def get_weather(city: Literal["Paris", "Rome"], metric: bool) -> str:
    """The weather in a city."""
    return "sunny"


def describe_city(city: str) -> str:
    """A description of a city."""
    return "old"


def test_langchain_bind_tools_required_gives_tool_calls(demo: StrataDaemon) -> None:
    llm = _chat(demo, 60).bind_tools([get_weather], tool_choice="required")  # type: ignore[attr-defined]
    message = llm.invoke("What is the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    assert set(call["args"]) <= {"city", "metric"}
    # a string the random model never closes: cut off by max_tokens, still a call of the tool
    # (LangChain files it under invalid_tool_calls: its arguments are not complete JSON)
    llm = _chat(demo, 30).bind_tools([describe_city], tool_choice="required")  # type: ignore[attr-defined]
    message = llm.invoke("Describe Paris.")
    assert message.response_metadata["finish_reason"] == "length"
    (cut,) = message.tool_calls + message.invalid_tool_calls
    assert cut["name"] == "describe_city" and not message.content


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output_returns_the_object(demo: StrataDaemon, method: str) -> None:
    llm = _chat(demo, 60).with_structured_output(Verdict, method=method)  # type: ignore[attr-defined]
    assert isinstance(llm.invoke("Is Paris in France?"), Verdict)


def test_langchain_json_mode_ends_as_an_object_or_the_clients_own_length_error(
    demo: StrataDaemon,
) -> None:
    from langchain_core.exceptions import OutputParserException

    llm = _chat(demo, 24).with_structured_output(Verdict, method="json_mode")  # type: ignore[attr-defined]
    # json_object constrains the syntax, not the keys: the random demo writes an object that
    # is not a Verdict (or is cut off); the client's own error says so, never an HTTP error
    try:
        out = llm.invoke("Is Paris in France? Answer in JSON.")
    except (OutputParserException, openai.LengthFinishReasonError):
        return
    assert isinstance(out, Verdict)
