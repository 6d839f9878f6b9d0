"""Agents and structured output through the real daemon, with the official ``openai`` client.

Three daemons on the CPU: the built-in demo model (random weights, a Qwen3-style template that
renders tools: the ``hermes`` format), a tiny Mixtral-shaped model whose template is Mistral's
(``[TOOL_CALLS]`` a control token: the ``mistral`` format), and the tiny qwen3moe model whose
ChatML template knows no tools (the ``generic`` format, tools in a system message). The random
weights never choose a tool on their own, so every call here is made with ``tool_choice``
required or named: the grammar, not the model, makes the output a valid call (and a JSON
Schema's output valid), and that is what these tests hold it to, over many seeds.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from strata.engine import synth
from strata.engine.vocab import build_mistral_tools_vocab
from tests.integration.harness import StrataDaemon

LIST_FILES = {
    "type": "function",
    "function": {
        "name": "list_files",
        "description": "List the files of a directory",
        "parameters": {
            "type": "object",
            "properties": {"directory": {"type": "string", "enum": ["."]}},
            "required": ["directory"],
            "additionalProperties": False,
        },
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [LIST_FILES, WEATHER]
ASK = [{"role": "user", "content": "What is the weather in Paris this week?"}]
# nested objects and arrays, $ref, anyOf, enums, bounded numbers and strings, a pattern
SCHEMA = {
    "$defs": {
        "item": {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[a-z]{2}-[0-9]{2}$"},
                "kind": {"enum": ["file", "dir"]},
                "size": {
                    "anyOf": [{"type": "integer", "minimum": 0, "maximum": 9999}, {"type": "null"}]
                },
            },
            "required": ["id", "kind", "size"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 12},
        "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3},
        "done": {"type": "boolean"},
    },
    "required": ["title", "items", "done"],
    "additionalProperties": False,
}
SEEDS = range(16)


def _client(d: StrataDaemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StrataDaemon]:
    d = StrataDaemon(tmp_path_factory.mktemp("demo"), ["--device", "cpu"])  # the demo model
    yield d
    d.stop()


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StrataDaemon]:
    folder = tmp_path_factory.mktemp("mistral")
    path = synth.write_model(folder / "tiny-mistral-tools.gguf", synth.PRESETS["tiny-mixtral"],
                             build_mistral_tools_vocab(), synth.TypePlan(), 0)  # fmt: skip
    d = StrataDaemon(folder, ["--model", str(path), "--device", "cpu"])
    yield d
    d.stop()


@pytest.fixture(scope="module")
def generic(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StrataDaemon]:
    folder = tmp_path_factory.mktemp("generic")
    path = synth.ensure_synthetic("tiny-qwen3moe", folder)  # ChatML: no tools in the template
    d = StrataDaemon(folder, ["--model", str(path), "--device", "cpu"])
    yield d
    d.stop()


@pytest.fixture(autouse=True)
def _daemon_logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed > failed:
        for name in ("demo", "mistral", "generic"):
            if name in request.fixturenames:
                d = request.getfixturevalue(name)
                print(f"\n----- {name} daemon log (last 80 lines) -----")
                print("\n".join(d.log.splitlines()[-80:]))


def model_of(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def check_call(call: Any, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The call names one of ``tools`` and its arguments validate against its parameters."""
    assert call.type == "function" and call.id
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.function.name in by_name
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, by_name[call.function.name])
    return args


def follow_up(message: Any, results: dict[str, str]) -> list[dict[str, Any]]:
    """The assistant's message as the history carries it, then each call's result."""
    turn = [message.model_dump(exclude_none=True)]
    for call in message.tool_calls:
        turn.append({"role": "tool", "tool_call_id": call.id, "content": results[call.id]})
    return turn


def streamed(chunks: Any) -> tuple[str, dict[int, dict[str, Any]], str | None, list[Any]]:
    """(content, calls by index as the deltas built them, finish_reason, tool-call deltas)."""
    content, calls, finish, deltas = "", {}, None, []
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            deltas.append(d)
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                assert call["id"] is None, "an id is sent once, in the call's first delta"
                call["id"] = d.id
            if d.function and d.function.name:
                call["name"] = d.function.name
            if d.function and d.function.arguments:
                call["arguments"] += d.function.arguments
        finish = choice.finish_reason or finish
    return content, calls, finish, deltas


# -- hermes (the demo model) --------------------------------------------------------------------


def test_required_tool_call_and_the_follow_up_turn(demo: StrataDaemon) -> None:
    client = _client(demo)
    model = model_of(client)
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=200, seed=3)  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    check_call(call, TOOLS)
    assert call.id.startswith("call_")
    # the follow-up turn: the result goes back through the template's <tool_response>
    history = ASK + follow_up(choice.message, {call.id: "Sunny, 21 degrees, all week."})
    again = client.chat.completions.create(model=model, messages=history, tools=TOOLS,
                                           max_tokens=12, temperature=0)  # fmt: skip
    assert again.choices[0].finish_reason in ("length", "stop")
    assert again.usage is not None and again.usage.prompt_tokens > r.usage.prompt_tokens
    assert isinstance(again.choices[0].message.content, str)


def test_streamed_tool_call_sends_id_and_name_first_then_arguments(demo: StrataDaemon) -> None:
    client = _client(demo)
    model = model_of(client)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    content, calls, finish, deltas = streamed(client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=200, seed=5,
        stream=True, parallel_tool_calls=False,
    ))  # fmt: skip
    assert finish == "tool_calls" and content == ""
    assert list(calls) == [0]
    first, rest = deltas[0], deltas[1:]
    assert first.id and first.type == "function" and first.function.name == "get_weather"
    assert first.function.arguments == ""
    assert rest and all(d.id is None and d.function.name is None for d in rest)
    assert len(rest) > 1, "the arguments arrive in pieces, as they are generated"
    args = json.loads(calls[0]["arguments"])
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    # the follow-up turn, streamed too: plain content
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0]["id"], "type": "function",
             "function": {"name": "get_weather", "arguments": calls[0]["arguments"]}}]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "Rain."},
    ]  # fmt: skip
    text, more, finish, _ = streamed(client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, tool_choice="none", max_tokens=10,
        stream=True,
    ))  # fmt: skip
    assert text and not more and finish == "length"


def test_named_tool_choice_calls_that_function_whatever_the_seed(demo: StrataDaemon) -> None:
    client = _client(demo)
    model = model_of(client)
    for seed in range(6):
        for name in ("list_files", "get_weather"):
            r = client.chat.completions.create(
                model=model, messages=ASK, tools=TOOLS, seed=seed, max_tokens=200,
                tool_choice={"type": "function", "function": {"name": name}},
                parallel_tool_calls=False, temperature=1.5,
            )  # fmt: skip
            (call,) = r.choices[0].message.tool_calls
            assert call.function.name == name
            check_call(call, TOOLS)


def test_max_tokens_before_a_calls_name_is_length_with_the_text_as_content(
    demo: StrataDaemon,
) -> None:
    # cut off after its name, a call is a call (test_clients); before it, nothing names one
    client = _client(demo)
    r = client.chat.completions.create(model=model_of(client), messages=ASK, tools=TOOLS,
                                       tool_choice="required", max_tokens=6)  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.tool_calls
    assert choice.message.content.startswith("<tool_call>")  # not a call: kept as content
    assert "not taken as a tool call" in demo.log


def test_json_schema_output_always_validates(demo: StrataDaemon) -> None:
    client = _client(demo)
    model = model_of(client)
    fmt = {"type": "json_schema", "json_schema": {"name": "listing", "strict": True,
                                                  "schema": SCHEMA}}  # fmt: skip
    for seed in SEEDS:
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "List the files as JSON."}],
            response_format=fmt, max_tokens=300, seed=seed, temperature=1.0,
        )  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (seed, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_mode_is_json_or_cut_by_max_tokens(demo: StrataDaemon) -> None:
    """Any JSON object: the grammar cannot bound a random model's strings, so an output either
    completes as an object or ends with ``length`` (as OpenAI's does)."""
    client = _client(demo)
    model = model_of(client)
    finished = 0
    for seed in SEEDS:
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Answer in JSON."}],
            response_format={"type": "json_object"}, max_tokens=60, seed=seed,
        )  # fmt: skip
        choice = r.choices[0]
        text = choice.message.content
        assert text.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
            finished += 1
        else:
            assert choice.finish_reason == "length"
            with pytest.raises(ValueError):
                json.loads(text)
    assert finished, "no seed completed an object"
    # streamed: the same text in pieces
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_object"}, max_tokens=60,
                                       seed=1)  # fmt: skip
    text, _, finish, _ = streamed(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "x"}], max_tokens=60, seed=1,
        response_format={"type": "json_object"}, stream=True,
    ))  # fmt: skip
    assert text == r.choices[0].message.content and finish == r.choices[0].finish_reason


def test_chat_logprobs_have_openai_shapes_and_match_the_tokens(demo: StrataDaemon) -> None:
    client = _client(demo)
    model = model_of(client)
    msgs = [{"role": "user", "content": "Tell me about the sea."}]
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=12,
                                       temperature=0, logprobs=True, top_logprobs=3)  # fmt: skip
    choice = r.choices[0]
    entries = choice.logprobs.content
    assert r.usage is not None and len(entries) == r.usage.completion_tokens == 12
    raw = b"".join(bytes(e.bytes) for e in entries)
    assert raw.decode("utf-8", "ignore") == choice.message.content
    for e in entries:
        assert e.token == bytes(e.bytes).decode("utf-8", "replace")
        assert len(e.top_logprobs) == 3
        lps = [t.logprob for t in e.top_logprobs]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        # greedy: the sampled token is the most likely one
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
    # streamed, the same entries ride on the chunks of their text
    chunks = list(client.chat.completions.create(
        model=model, messages=msgs, max_tokens=12, temperature=0, logprobs=True,
        top_logprobs=3, stream=True,
    ))  # fmt: skip
    got = [e for c in chunks if c.choices and c.choices[0].logprobs
           for e in c.choices[0].logprobs.content]  # fmt: skip
    assert [e.token for e in got] == [e.token for e in entries]
    # (the second request reuses the cached prompt: its last position is summed in another order)
    assert [e.logprob for e in got] == pytest.approx([e.logprob for e in entries], abs=1e-4)
    # sampled, under a grammar: each token is one of the allowed, with a finite log-probability
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=300, seed=2,
                                       logprobs=True, response_format={"type": "json_schema",
                                       "json_schema": {"name": "s", "schema": SCHEMA}})  # fmt: skip
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    assert "".join(e.token for e in entries) == r.choices[0].message.content
    assert all(e.top_logprobs == [] and e.logprob <= 0 for e in entries)


def test_completion_logprobs_have_the_legacy_shape(demo: StrataDaemon) -> None:
    client = _client(demo)
    model = model_of(client)
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8,
                                  temperature=0, logprobs=2)  # fmt: skip
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert lp.text_offset[0] == 0
    for i in range(1, 8):
        assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 2 and max(top.values()) == logprob and top[token] == logprob
    chunks = list(client.completions.create(model=model, prompt="Once upon a time",
                                            max_tokens=8, temperature=0, logprobs=2,
                                            stream=True))  # fmt: skip
    streamed_tokens = [t for c in chunks if c.choices[0].logprobs
                       for t in c.choices[0].logprobs.tokens]  # fmt: skip
    offsets = [o for c in chunks if c.choices[0].logprobs
               for o in c.choices[0].logprobs.text_offset]  # fmt: skip
    assert streamed_tokens == lp.tokens and offsets == lp.text_offset


def test_bad_tools_and_schemas_are_400s_naming_the_field(demo: StrataDaemon) -> None:
    client = _client(demo)
    model = model_of(client)
    bad_tool = {
        "type": "function",
        "function": {
            "name": "f",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"tags": {"type": "array", "uniqueItems": True}},
            },
        },
    }
    cases = [
        (dict(tools=[{"type": "function", "function": {"description": "no name"}}]),
         "tools[0].function.name"),
        (dict(tools=[bad_tool], tool_choice="required"), "tools[0].function.parameters"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice.function.name"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}),
         "response_format.json_schema.schema"),
    ]  # fmt: skip
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=ASK, **fields)
        body = e.value.body
        assert isinstance(body, dict) and body["param"] == param, body
        assert param in body["message"]
    assert "uniqueItems" in _message(client, model, dict(tools=[bad_tool], tool_choice="required"))


def _message(client: openai.OpenAI, model: str, fields: dict[str, Any]) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, **fields)
    assert isinstance(e.value.body, dict)
    return e.value.body["message"]


def test_agent_loop_lists_files_reads_one_and_answers(demo: StrataDaemon, tmp_path: Path) -> None:
    """An agent with two tools: each tool step with ``tool_choice`` required, the answer without.
    ``read_file`` is offered once a listing told the agent which files there are."""
    root = tmp_path / "project"
    root.mkdir()
    files = {"README.md": "A tiny project.\n", "notes.txt": "Buy milk.\n", "main.py": "print(1)\n"}
    for name, text in files.items():
        (root / name).write_text(text)
    client = _client(demo)
    model = model_of(client)
    listed: list[str] = []
    read: list[str] = []

    def tools() -> list[dict[str, Any]]:
        out = [LIST_FILES]
        if listed:
            out.append({"type": "function", "function": {
                "name": "read_file", "description": "Read a file of the directory",
                "parameters": {"type": "object", "properties": {
                    "path": {"type": "string", "enum": listed}},
                    "required": ["path"], "additionalProperties": False}}})  # fmt: skip
        return out

    def run(call: Any) -> str:
        args = check_call(call, tools())
        if call.function.name == "list_files":
            listed[:] = sorted(p.name for p in (root / args["directory"]).iterdir())
            return "\n".join(listed)
        read.append(args["path"])
        return (root / args["path"]).read_text()

    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Use the tools."},
        {"role": "user", "content": "What does notes.txt say?"},
    ]
    answer = None
    for step in range(8):
        r = client.chat.completions.create(
            model=model, messages=messages, tools=tools(), max_tokens=120, seed=step,
            tool_choice="auto" if read else "required", parallel_tool_calls=False,
        )  # fmt: skip
        message = r.choices[0].message
        if not message.tool_calls:
            answer = message.content
            break
        assert r.choices[0].finish_reason == "tool_calls"
        results = {c.id: run(c) for c in message.tool_calls}
        messages += follow_up(message, results)
    assert listed == sorted(files), "the agent listed the directory first"
    assert read and read[0] in files, "then read a file it had listed"
    assert isinstance(answer, str) and answer, "and answered"
    assert [m["role"] for m in messages[2:]].count("tool") >= 2


# -- mistral --------------------------------------------------------------------------------------


def test_mistral_format_tool_call_stream_and_follow_up(mistral: StrataDaemon) -> None:
    client = _client(mistral)
    model = model_of(client)
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, seed=1,
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=200)  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    check_call(call, TOOLS)
    assert len(call.id) == 9 and call.id.isalnum(), "Mistral's templates want 9 characters"
    history = ASK + follow_up(choice.message, {call.id: "Sunny."})
    again = client.chat.completions.create(model=model, messages=history, tools=TOOLS,
                                           max_tokens=8, temperature=0)  # fmt: skip
    assert again.usage.prompt_tokens > r.usage.prompt_tokens
    _, calls, finish, deltas = streamed(client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, seed=2, stream=True, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ))  # fmt: skip
    assert finish == "tool_calls" and deltas[0].function.name == "get_weather"
    for c in calls.values():
        jsonschema.validate(json.loads(c["arguments"]), WEATHER["function"]["parameters"])


# -- generic: a template that knows no tools ------------------------------------------------------


def test_generic_format_for_a_template_without_tools(generic: StrataDaemon) -> None:
    client = _client(generic)
    model = model_of(client)
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, seed=4,
                                       tool_choice="required", max_tokens=300)  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_call(call, TOOLS)
    history = ASK + follow_up(choice.message, {c.id: "18 C" for c in choice.message.tool_calls})
    again = client.chat.completions.create(model=model, messages=history, tools=TOOLS,
                                           tool_choice="none", max_tokens=8)  # fmt: skip
    assert again.choices[0].finish_reason == "length" and again.choices[0].message.content
