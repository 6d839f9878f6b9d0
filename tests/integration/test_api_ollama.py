"""Ollama's API through the real ``ollama`` client, on a model whose template thinks as
Qwen3.5's (the demo's random weights): chat and generate, whole and streamed (NDJSON), ``think``,
``format`` as "json" and as a JSON Schema, tool calls, ``options``, ``keep_alive``; tags, show,
ps and version; pull from a stand-in Hugging Face Hub (test_pull's) with its progress events;
bad input answered in Ollama's error shape.

The output is meaningless: the tests hold the replies' shapes, never their content. One daemon
for the module, small ``num_predict``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from http.server import ThreadingHTTPServer
from typing import Any

import gguf
import httpx
import ollama
import pytest

from strata.engine import synth
from tests.integration.harness import StrataDaemon
from tests.integration.test_reasoning import thinking_template
from tests.unit.test_pull import SMALL, Hub, Repo, _handler

REPO = "someone/Tiny-Pull-GGUF"

ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
SHORT: Any = {"num_predict": 4, "temperature": 0}
WEATHER: Any = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather in a city",
                 "parameters": {"type": "object", "required": ["city"],
                                "properties": {"city": {"type": "string", "maxLength": 8}}}},
}  # fmt: skip
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    """A stand-in Hub holding one tiny model in one file."""
    folder = tmp_path_factory.mktemp("hub")
    plan = synth.TypePlan.uniform(gguf.GGMLQuantizationType.Q4_0)
    q4 = synth.write_model(folder / "q4.gguf", SMALL, synth.vocab_for("qwen3moe"), plan, seed=1)
    state = Hub(repos={REPO: Repo({"Tiny-Pull-Q4_0.gguf": q4.read_bytes()})})
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield state
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory, hub: Hub) -> Iterator[StrataDaemon]:
    folder = tmp_path_factory.mktemp("ollama")
    vocab = replace(synth.vocab_for("qwen3moe"), chat_template=thinking_template())
    path = synth.write_model(folder / "tiny-thinker.gguf", synth.PRESETS["tiny-qwen3moe"], vocab,
                             synth.TypePlan(), 0)  # fmt: skip
    env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_test_token", "HF_HUB_DISABLE_TELEMETRY": "1"}
    d = StrataDaemon(folder, ["--model", str(path), "--device", "cpu", "--models-dir",
                              str(folder / "library")], env=env)  # fmt: skip
    yield d
    d.stop()


def _client(d: StrataDaemon) -> ollama.Client:
    return ollama.Client(host=d.url)


def test_chat_thinking_whole_and_streamed(thinker: StrataDaemon) -> None:
    client = _client(thinker)
    r = client.chat(model="llama3.2:latest", messages=ASK, think=True, options=SHORT,
                    keep_alive="5m")  # fmt: skip
    assert r.done and r.done_reason == "length"
    assert r.message.role == "assistant" and r.message.thinking
    assert r.prompt_eval_count and r.eval_count == 4 and r.total_duration
    parts = list(client.chat(model="m", messages=ASK, think=True, options=SHORT, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.thinking or "" for p in parts) == r.message.thinking
    assert parts[-1].done_reason == "length" and parts[-1].eval_count == 4


def test_chat_without_thinking_and_format(thinker: StrataDaemon) -> None:
    client = _client(thinker)
    r = client.chat(model="m", messages=ASK, think=False, options=SHORT)
    assert r.message.thinking is None and r.done
    for fmt in ("json", SCHEMA):
        r = client.chat(model="m", messages=ASK, think=False, format=fmt,
                        options={"num_predict": 40, "seed": 1})  # fmt: skip
        if fmt == SCHEMA:  # the schema closes the object within a few tokens
            assert r.done_reason == "stop" and set(json.loads(r.message.content)) == {"ok"}
        elif r.done_reason == "stop":  # any object: it may run to num_predict
            assert isinstance(json.loads(r.message.content), dict)


def test_chat_tool_calls_whole_and_streamed(thinker: StrataDaemon) -> None:
    client = _client(thinker)
    r = client.chat(model="m", messages=ASK, tools=[WEATHER], think=False,
                    options={"num_predict": 40, "seed": 3})  # fmt: skip
    assert r.done
    parts = list(client.chat(model="m", messages=ASK, tools=[WEATHER], think=False, stream=True,
                             options={"num_predict": 40, "seed": 3}))  # fmt: skip
    calls = [c for p in parts for c in (p.message.tool_calls or [])]
    assert [c.function.name for c in calls] == [c.function.name for c in r.message.tool_calls or []]
    for c in calls:
        assert isinstance(c.function.arguments, dict)
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "Sunny"}]  # fmt: skip
    again = client.chat(model="m", messages=history, tools=[WEATHER], think=False, options=SHORT)
    assert again.done


def test_generate_whole_streamed_and_raw(thinker: StrataDaemon) -> None:
    client = _client(thinker)
    r = client.generate(model="m", prompt="Why is the sky blue?", system="Brief.", think=True,
                        options=SHORT)  # fmt: skip
    assert r.done and r.thinking and r.response == "" and r.done_reason == "length"
    parts = list(client.generate(model="m", prompt="Hello", raw=True, options=SHORT, stream=True))
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert parts[-1].eval_count == 4
    loaded = client.generate(model="m", prompt="")
    assert loaded.done and loaded.done_reason == "load"


def test_tags_show_ps_version(thinker: StrataDaemon) -> None:
    client = _client(thinker)
    (model,) = client.list().models
    assert model.model == "tiny-thinker" and model.size and model.details.format == "gguf"
    shown = client.show(model.model)
    assert shown.template and "completion" in (shown.capabilities or [])
    assert "thinking" in (shown.capabilities or [])
    assert shown.modelinfo and shown.modelinfo["general.architecture"] == "qwen3moe"
    (running,) = client.ps().models
    assert running.model == "tiny-thinker"
    assert httpx.get(thinker.url + "/api/version", timeout=10).json()["version"]


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"messages": ASK, "options": {"mirostat": 1}}, "options.mirostat"),
        ({"messages": ASK, "options": {"num_ctx": 10**7}}, "options.num_ctx"),
        ({"messages": ASK, "keep_alive": 0}, "keep_alive"),
        ({"messages": ASK, "keep_alive": "soon"}, "keep_alive"),
        ({"messages": ASK, "format": "yaml"}, "format"),
        ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, "images"),
    ],
)
def test_bad_chat_is_an_ollama_error_naming_it(
    thinker: StrataDaemon, body: dict[str, Any], named: str
) -> None:
    if named != "format":  # the client itself refuses a format other than "json" or a schema
        with pytest.raises(ollama.ResponseError) as e:
            _client(thinker).chat(model="m", **body)
        assert e.value.status_code == 400 and named in e.value.error
    r = httpx.post(thinker.url + "/api/chat", json={"model": "m", "stream": False, **body},
                   timeout=30)  # fmt: skip
    assert r.status_code == 400 and set(r.json()) == {"error"}


def test_pull_with_progress_then_listed(thinker: StrataDaemon) -> None:
    client = _client(thinker)
    events = list(client.pull(f"hf.co/{REPO}:Q4_0", stream=True))
    assert events[0].status == "pulling manifest" and events[-1].status == "success"
    steps = [e for e in events[1:-1]]
    assert steps and all(e.status == "pulling Tiny-Pull-Q4_0.gguf" for e in steps)
    done = [e.completed for e in steps]
    assert done == sorted(done) and done[-1] == steps[-1].total
    assert steps[-1].digest.startswith("sha256:")
    names = [m.model for m in client.list().models]
    assert names[0] == "tiny-thinker" and len(names) == 2 and "q4_0" in names[1].lower()
    again = client.pull(f"{REPO}:Q4_0", stream=False)  # up to date: nothing fetched
    assert again.status == "success"
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("llama3.2", stream=False)
    assert e.value.status_code == 400 and "repository" in e.value.error
    lines = httpx.post(thinker.url + "/api/pull", json={"model": "someone/Missing-GGUF"},
                       timeout=60).text.splitlines()  # fmt: skip
    assert json.loads(lines[0]) == {"status": "pulling manifest"}
    assert set(json.loads(lines[-1])) == {"error"}
