"""The other APIs' requests as the chat requests they mean, without a daemon: Anthropic's blocks
and tool results, the Responses API's items (a reasoning item and the calls after it make one
assistant turn), Ollama's options and ``keep_alive``, a pull's progress events, the errors per
API's shape, and the kept responses for ``previous_response_id``."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from strata.daemon.api import anthropic_api, ollama_api, ollama_pull, responses_api
from strata.daemon.api.api_errors import ApiError, invalid
from strata.daemon.api.api_shapes import api_of, error_json
from strata.daemon.api.openai_api import chat_from

HI = [{"role": "user", "content": "hi"}]


def test_anthropic_blocks_become_the_chat_they_mean() -> None:
    raw: dict[str, Any] = {
        "model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "A"},
                                                 {"type": "text", "text": "B"}],
        "stop_sequences": ["END"], "tool_choice": {"type": "any",
                                                   "disable_parallel_tool_use": True},
        "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {}}}],
        "thinking": {"type": "disabled"},
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": ""},
                {"type": "text", "text": "let me look"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "bad", "is_error": True},
                {"type": "text", "text": "and?"}]},
        ],
    }  # fmt: skip
    out = anthropic_api.to_openai(raw)
    assert out["messages"][0] == {"role": "system", "content": "A\n\nB"}
    assistant = out["messages"][2]
    assert assistant["reasoning_content"] == "hm" and assistant["content"] == "let me look"
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {"x": 1}
    assert out["messages"][3] == {"role": "tool", "tool_call_id": "t1", "content": "Error: bad"}
    assert out["messages"][4] == {"role": "user", "content": "and?"}
    assert out["tool_choice"] == "required" and out["parallel_tool_calls"] is False
    assert out["stop"] == ["END"] and out["think"] is False
    req = chat_from(out)  # and the chat parser takes it as it is
    assert req.max_tokens == 9 and req.tools[0].name == "f"


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ({"messages": []}, "max_tokens"),
        ({"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
         "messages[0].content[0].type"),
        ({"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "tool_use"}]}]},
         "messages[0].content[0].type"),
        ({"max_tokens": 2000, "messages": HI, "thinking": {"type": "enabled",
                                                            "budget_tokens": 2000}},
         "thinking.budget_tokens"),
        ({"max_tokens": 2, "messages": HI, "tools": [{"type": "bash_20250124", "name": "b"}]},
         "tools[0].type"),
        ({"max_tokens": 2, "messages": [], "mcp_servers": [{"url": "x"}]}, "mcp_servers"),
        ({"max_tokens": 2, "messages": [*HI, {"role": "assistant", "content": "The"}]},
         "messages[1].role"),
    ],
)  # fmt: skip
def test_anthropic_refusals_name_the_field(raw: dict[str, Any], named: str) -> None:
    with pytest.raises(ApiError) as e:
        anthropic_api.to_openai({"model": "m", **raw})
    assert e.value.param == named and e.value.status == 400


def test_responses_items_make_turns() -> None:
    store = responses_api.ResponseStore(2)
    raw: dict[str, Any] = {"model": "m", "instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
    ], "text": {"format": {"type": "json_object"}}, "max_output_tokens": 5}  # fmt: skip
    chat, conversation = responses_api.to_chat(raw, store)
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."}
    assert conversation[0] == {"role": "user", "content": "hi"}
    turn = conversation[1]
    assert turn["reasoning_content"] == "think"
    assert [c["id"] for c in turn["tool_calls"]] == ["c1", "c2"]
    assert conversation[2] == {"role": "tool", "tool_call_id": "c1", "content": "one"}
    assert chat["response_format"] == {"type": "json_object"} and chat["max_tokens"] == 5
    # kept: the next request continues it, without the instructions
    store.put("resp_a", conversation)
    nxt, _ = responses_api.to_chat({"model": "m", "input": "more",
                                    "previous_response_id": "resp_a"}, store)  # fmt: skip
    assert nxt["messages"] == [*conversation, {"role": "user", "content": "more"}]
    store.put("resp_b", [])
    store.put("resp_c", [])  # the store holds 2: resp_a is gone
    with pytest.raises(ApiError) as e:
        store.get("resp_a")
    assert e.value.param == "previous_response_id"


def test_responses_a_dangling_reasoning_item_is_an_error() -> None:
    item = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "x"}]}
    with pytest.raises(ApiError, match="reasoning item"):
        responses_api.to_chat({"model": "m", "input": [item]}, responses_api.ResponseStore(1))


def test_ollama_options_and_keep_alive() -> None:
    serving: Any = SimpleNamespace(config=SimpleNamespace(idle_release_s=300))
    options = {"num_predict": 7, "temperature": 0.2, "stop": ["x"], "num_ctx": 512}
    raw = {"model": "m", "messages": HI, "think": False, "format": {"type": "object"},
           "keep_alive": "5m", "options": options}  # fmt: skip
    out = ollama_api.chat_request(raw, serving, 4096)
    assert out["max_tokens"] == 7 and out["temperature"] == 0.2 and out["stop"] == ["x"]
    assert out["stream"] is True and out["think"] is False
    assert out["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert ollama_api.keep_alive_s("1h30m") == 5400 and ollama_api.keep_alive_s(-1) == -1
    ollama_api.check_keep_alive(300, 300)
    ollama_api.check_keep_alive("-1", 0)
    for value, idle in (("10m", 300), (0, 300), ("5m", 0)):
        with pytest.raises(ApiError, match="idle_release_s"):
            ollama_api.check_keep_alive(value, idle)
    with pytest.raises(ApiError) as e:
        ollama_api.chat_request({**raw, "options": {"num_thread": 4}}, serving, 4096)
    assert e.value.param == "options.num_thread"
    prefill = [*HI, {"role": "assistant", "content": "The"}]
    with pytest.raises(ApiError) as e:
        ollama_api.chat_request({**raw, "messages": prefill}, serving, 4096)
    assert e.value.param == "messages[1].role"
    # a tool result answers the earliest open call of its function
    msgs = ollama_api._messages([
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "f", "arguments": {}}},
            {"function": {"name": "g", "arguments": {}}}]},
        {"role": "tool", "tool_name": "g", "content": "G"},
        {"role": "tool", "tool_name": "f", "content": "F"}])  # fmt: skip
    ids = [c["id"] for c in msgs[0]["tool_calls"]]
    assert [m["tool_call_id"] for m in msgs[1:]] == [ids[1], ids[0]]


def test_pull_progress_per_file_about_every_percent() -> None:
    files = [SimpleNamespace(path="a/one.gguf", size=1000, sha256="ab"),
             SimpleNamespace(path="two.gguf", size=10, sha256=None)]  # fmt: skip
    events: list[dict[str, Any]] = []
    stop = threading.Event()
    progress = ollama_pull.FileProgress(files, events.append, stop)
    for _ in range(101):
        progress(10)
    shown = [(e["status"], e["completed"]) for e in events]
    assert shown[0] == ("pulling one.gguf", 10) and ("pulling one.gguf", 1000) in shown
    assert len([s for s in shown if s[0] == "pulling one.gguf"]) <= ollama_pull.STEPS + 1
    assert shown[-1] == ("pulling two.gguf", 10) and events[0]["digest"] == "sha256:ab"
    stop.set()
    with pytest.raises(ollama_pull.PullCancelled):
        progress(1)


def test_errors_take_the_shape_of_the_path() -> None:
    err = invalid("x: bad", "x")
    assert api_of("/v1/messages") == api_of("/v1/messages/count_tokens") == "anthropic"
    shaped = {"type": "error", "error": {"type": "invalid_request_error", "message": "x: bad"}}
    assert error_json(err, "anthropic") == shaped
    assert error_json(ApiError(503, "busy"), "anthropic")["error"]["type"] == "overloaded_error"
    assert api_of("/api/chat") == "ollama" and error_json(err, "ollama") == {"error": "x: bad"}
    assert api_of("/v1/responses") == api_of("/tokenize") == "openai"
    assert error_json(err, "openai") == err.body()


# -- the streams, from the chat chunks a reply with a thought, text and two calls makes ---------


def _chunk(**delta: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


CHUNKS = [
    _chunk(role="assistant", content=""),
    _chunk(reasoning_content="hm"),
    _chunk(reasoning_content="m"),
    _chunk(content="Sure."),
    _chunk(tool_calls=[{"index": 0, "id": "c0", "type": "function",
                        "function": {"name": "f", "arguments": ""}}]),
    _chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"a": '}}]),
    _chunk(tool_calls=[{"index": 0, "function": {"arguments": "1}"}}]),
    _chunk(tool_calls=[{"index": 1, "id": "c1", "type": "function",
                        "function": {"name": "g", "arguments": "{}"}}]),
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
]  # fmt: skip
RESULT: Any = SimpleNamespace(prompt_tokens=5, completion_tokens=9, cached_tokens=0,
                              prefill_s=0.1, decode_s=0.2)  # fmt: skip


def _sse(data: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for b in data:
        kind, payload = b.decode().strip().split("\n")
        obj = json.loads(payload.removeprefix("data: "))
        assert kind == f"event: {obj['type']}"
        out.append(obj)
    return out


def test_anthropic_events_from_chunks() -> None:
    s: Any = SimpleNamespace(ready=SimpleNamespace(prompt=[1, 2, 3]),
                             reply=SimpleNamespace(id="chatcmpl-x", model="m"))  # fmt: skip
    events = anthropic_api.MessageEvents(s)
    data = events.start() + [b for c in CHUNKS for b in events.chunk(c)]
    data += events.end("tool_calls", None, 9)
    got = _sse(data)
    kinds = [(e["type"], (e.get("content_block") or e.get("delta") or {}).get("type")) for e in got]
    assert kinds == [
        ("message_start", None),
        ("content_block_start", "thinking"), ("content_block_delta", "thinking_delta"),
        ("content_block_delta", "thinking_delta"), ("content_block_delta", "signature_delta"),
        ("content_block_stop", None),
        ("content_block_start", "text"), ("content_block_delta", "text_delta"),
        ("content_block_stop", None),
        ("content_block_start", "tool_use"), ("content_block_delta", "input_json_delta"),
        ("content_block_delta", "input_json_delta"), ("content_block_stop", None),
        ("content_block_start", "tool_use"), ("content_block_delta", "input_json_delta"),
        ("content_block_stop", None),
        ("message_delta", None), ("message_stop", None),
    ]  # fmt: skip
    assert [e["index"] for e in got if e["type"] == "content_block_start"] == [0, 1, 2, 3]
    assert got[0]["message"]["usage"]["input_tokens"] == 3
    assert got[-2]["delta"]["stop_reason"] == "tool_use"


def test_responses_events_from_chunks() -> None:
    shape: Any = SimpleNamespace(body=lambda items, status, usage=None: {
        "status": status, "output": list(items)})  # fmt: skip
    events = responses_api.ResponseEvents(shape)
    data = events.start() + [b for c in CHUNKS for b in events.chunk(c)]
    data += events.end("tool_calls", {})
    got = _sse(data)
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    added = [e["item"]["type"] for e in got if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call", "function_call"]
    final = got[-1]
    assert final["type"] == "response.completed"
    reasoning, message, f, g = final["response"]["output"]
    assert reasoning["content"][0]["text"] == "hmm" and message["content"][0]["text"] == "Sure."
    assert (f["name"], json.loads(f["arguments"]), g["call_id"]) == ("f", {"a": 1}, "c1")
    done = [e for e in got if e["type"] == "response.function_call_arguments.done"]
    assert [e["arguments"] for e in done] == ['{"a": 1}', "{}"]
    turn = responses_api.output_as_messages(final["response"]["output"])[0]
    assert turn["reasoning_content"] == "hmm" and len(turn["tool_calls"]) == 2


def test_ollama_lines_from_chunks() -> None:
    lines = ollama_api.NdjsonLines("chat", "m")
    data = [b for c in CHUNKS for b in lines.chunk(c)] + lines.end(RESULT, 0.0)
    got = [json.loads(b) for b in data]
    assert [g["done"] for g in got] == [False] * (len(got) - 1) + [True]
    assert "".join(g["message"].get("thinking", "") for g in got) == "hmm"
    assert "".join(g["message"]["content"] for g in got) == "Sure."
    (calls,) = [g["message"]["tool_calls"] for g in got if "tool_calls" in g["message"]]
    assert calls == [{"function": {"name": "f", "arguments": {"a": 1}}},
                     {"function": {"name": "g", "arguments": {}}}]  # fmt: skip
    assert got[-1]["done_reason"] == "stop" and got[-1]["eval_count"] == 9
    assert got[-1]["prompt_eval_duration"] == 100_000_000
