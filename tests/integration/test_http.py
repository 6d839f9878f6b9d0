"""The OpenAI-compatible endpoint of the real daemon, through the official ``openai`` client.

One daemon serves the whole module (tiny-qwen3moe on the CPU, port 0). Greedy texts are checked
against the engine's own output, computed in this process with the daemon's settings.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from strata.engine.generate import Engine
from strata.engine.options import EngineOptions
from strata.engine.params import SamplingParams
from strata.engine.synth import ensure_synthetic
from tests.integration.harness import StrataDaemon, wait_s

N = 16  # tokens per checked generation
LONG = 3500  # tokens of a generation that must still be running when the test acts
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me about the sea."},
]
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_synthetic("tiny-qwen3moe", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StrataDaemon]:
    # names are strict here: another model's name is a 404 (the default serves any name)
    args = ["--model", str(model), "--device", "cpu", "--no-serve-any-model-name"]
    d = StrataDaemon(tmp_path_factory.mktemp("daemon"), args)
    yield d
    d.stop()


@pytest.fixture(autouse=True)
def _daemon_log_on_failure(request: pytest.FixtureRequest, server: StrataDaemon) -> Iterator[None]:
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed > failed:
        print(f"\n----- daemon log {server.log_path} (last 200 lines) -----")
        print("\n".join(server.log.splitlines()[-200:]))


@pytest.fixture(scope="module")
def engine(model: Path) -> Engine:
    # the daemon's defaults: K/V f16, no expert cache on the CPU, the default thread count
    return Engine.load(model, EngineOptions(device="cpu", kv_cache_type="f16"))


@pytest.fixture(scope="module")
def client(server: StrataDaemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def greedy(engine: Engine, ids: list[int], n: int = N, **kw: Any) -> Any:
    return engine.generate(ids, SamplingParams(max_tokens=n, temperature=0.0, **kw))


def healthy(server: StrataDaemon) -> None:
    r = httpx.get(server.url + "/health", timeout=5)
    assert r.status_code == 200, r.text


def scrape(server: StrataDaemon) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = httpx.get(server.url + "/metrics", timeout=5)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for(server: StrataDaemon, predicate: Any, what: str, timeout: float = 10) -> dict:
    return server.wait_for(predicate, timeout, what)


# -- the happy paths ----------------------------------------------------------------------------


def test_models_lists_the_gguf_stem(client: openai.OpenAI, model: Path) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [model.stem]
    assert models.data[0].owned_by == "strata"
    assert client.models.retrieve(model.stem).id == model.stem
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_chat_is_the_engines_greedy_output(
    client: openai.OpenAI, engine: Engine, model: Path
) -> None:
    ids = engine.encode_chat(MESSAGES)
    want = greedy(engine, ids)
    r = client.chat.completions.create(
        model=model.stem, messages=MESSAGES, max_tokens=N, temperature=0
    )
    assert r.object == "chat.completion" and r.model == model.stem and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == want.text and len(want.tokens) == N
    assert choice.finish_reason == "length"
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), N)
    assert r.usage.total_tokens == len(ids) + N


def test_streaming_chat_equals_non_streaming(
    client: openai.OpenAI, engine: Engine, model: Path
) -> None:
    want = greedy(engine, engine.encode_chat(MESSAGES))
    chunks = list(
        client.chat.completions.create(
            model=model.stem, messages=MESSAGES, max_completion_tokens=N, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == N
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_completions_streamed_and_not_are_the_engines_greedy_output(
    client: openai.OpenAI, engine: Engine, model: Path
) -> None:
    ids = engine.encode_prompt(PROMPT)
    want = greedy(engine, ids)
    r = client.completions.create(model=model.stem, prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (
        len(ids),
        N,
    )
    stream = client.completions.create(
        model=model.stem, prompt=PROMPT, max_tokens=N, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"
    # the same prompt given as token ids
    by_ids = client.completions.create(model=model.stem, prompt=ids, max_tokens=N, temperature=0)
    assert by_ids.choices[0].text == want.text


def test_a_second_turn_reports_its_cached_prompt_tokens_and_the_kv_is_in_the_status(
    client: openai.OpenAI, server: StrataDaemon, engine: Engine, model: Path
) -> None:
    first = engine.encode_prompt("The harbour master counted the boats at dawn") * 3
    r1 = client.completions.create(model=model.stem, prompt=first, max_tokens=N, temperature=0)
    assert r1.usage is not None and r1.usage.prompt_tokens_details is not None
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    # another conversation between: the first one is kept
    client.completions.create(model=model.stem, prompt=[7, 8, 9], max_tokens=2, temperature=0)
    second = first + engine.encode_prompt(" and again at dusk")
    r2 = client.completions.create(model=model.stem, prompt=second, max_tokens=N, temperature=0)
    assert r2.usage is not None and r2.usage.prompt_tokens_details is not None
    assert r2.usage.prompt_tokens_details.cached_tokens == len(first)
    assert r2.choices[0].text == greedy(engine, second).text  # as a cold run
    status = server.status()
    # every generated token was fed but the last one of a reply cut by max_tokens
    fed = r2.usage.completion_tokens - (r2.choices[0].finish_reason == "length")
    assert status["kv_mib"] > 0 and status["kv_active_tokens"] == len(second) + fed
    # [7, 8, 9] and its first generated token (unless that one ended it)
    assert any(k["tokens"] in (3, 4) for k in status["kv_kept"]), status["kv_kept"]
    assert status["budget_mib"] is None  # no expert cache on the CPU: no budget to share
    samples = scrape(server)
    assert metric(samples, "strata_kv_mib") == status["kv_mib"]
    assert metric(samples, "strata_kv_kept_conversations") >= 1


def test_each_request_logs_one_line_with_its_tokens_speeds_and_time_to_first_token(
    client: openai.OpenAI, server: StrataDaemon, model: Path
) -> None:
    seen = len(server.log)
    prompt = "The keeper of the lighthouse counted the ships"
    for _ in range(2):  # the second reuses the first one's K/V for the prompt it shares
        client.completions.create(model=model.stem, prompt=prompt, max_tokens=8, temperature=0)
    pattern = (
        r"request (\d+): prompt (\d+) tokens \((\d+) cached(?:, [\d.]+ tok/s)?\), "
        r"(\d+) generated at [\d.]+ tok/s, first token after \d+ ms, finish length"
    )
    lines = re.findall(pattern, server.log[seen:])
    assert len(lines) == 2, server.log[seen:]
    (n1, p1, c1, g1), (n2, p2, c2, g2) = lines
    assert int(n2) == int(n1) + 1 and p1 == p2 and (g1, g2) == ("8", "8")
    assert int(c1) < int(p1) and 0 < int(c2) < int(p2), lines  # as llama-server's "cached"


def test_stop_sequences_cut_the_text(client: openai.OpenAI, engine: Engine, model: Path) -> None:
    ids = engine.encode_prompt(PROMPT)
    full = greedy(engine, ids, 32).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    want = greedy(engine, ids, 32, stop=(stop, "never-there"))
    assert want.finish_reason == "stop" and len(want.tokens) >= 8
    for stream in (False, True):
        r = client.completions.create(
            model=model.stem, prompt=PROMPT, max_tokens=32, temperature=0,
            stop=[stop, "never-there"], stream=stream,
        )  # fmt: skip
        chunks = list(r) if stream else [r]
        text = "".join(c.choices[0].text for c in chunks)
        assert text == want.text and stop not in text
        assert chunks[-1].choices[0].finish_reason == "stop"
    r = client.chat.completions.create(
        model=model.stem, messages=MESSAGES, max_tokens=32, temperature=0, stop=stop
    )
    assert stop not in (r.choices[0].message.content or "")


def test_sampling_fields_reach_the_engine(
    client: openai.OpenAI, engine: Engine, model: Path
) -> None:
    ids = engine.encode_prompt(PROMPT)
    knobs = {"temperature": 3.0, "top_p": 0.9, "seed": 1234}  # the tiny model is peaked
    extra = {"top_k": 20, "min_p": 0.0, "repeat_penalty": 1.1, "repeat_last_n": 32}
    want = engine.generate(ids, SamplingParams(max_tokens=N, **knobs, **extra))
    r = client.completions.create(model=model.stem, prompt=PROMPT, max_tokens=N, **knobs,
                                  extra_body=extra)  # fmt: skip
    assert r.choices[0].text == want.text
    other = client.completions.create(
        model=model.stem, prompt=PROMPT, max_tokens=N, **{**knobs, "seed": 4321}, extra_body=extra
    )
    assert other.choices[0].text != want.text
    # zero penalties ask for nothing: accepted, as are unknown extra fields
    same = client.completions.create(
        model=model.stem, prompt=PROMPT, max_tokens=N, **knobs, frequency_penalty=0,
        presence_penalty=0.0, user="me", extra_body={**extra, "no_such_field": [1, 2]},
    )  # fmt: skip
    assert same.choices[0].text == want.text


# -- errors -------------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MODEL = "@model"  # replaced by the served model id
USER = [{"role": "user", "content": "hi"}]


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, "max_tokens": 4, **fields}


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **fields}


BAD: list[tuple[str, str, Any, int, str | None]] = [
    # (name, endpoint, body (bytes as sent, or JSON), status, param)
    ("malformed JSON", CHAT, b'{"model": "x", "messages": [', 400, None),
    ("body not an object", CHAT, [1, 2], 400, None),
    ("NaN is not JSON", COMPLETIONS, b'{"model": "@model", "prompt": "hi", "temperature": NaN}',
     400, None),
    ("invalid UTF-8", COMPLETIONS, b'{"model": "@model", "prompt": "caf\xe9"}', 400, None),
    ("lone surrogate", COMPLETIONS, b'{"model": "@model", "prompt": "\\ud800"}', 400, "prompt"),
    ("missing model", CHAT, {"messages": USER}, 400, "model"),
    ("unknown model", CHAT, {**_chat(), "model": "gpt-4o"}, 404, "model"),
    ("model not a string", CHAT, {**_chat(), "model": 7}, 400, "model"),
    ("messages not a list", CHAT, _chat(messages="hi"), 400, "messages"),
    ("empty messages", CHAT, _chat(messages=[]), 400, "messages"),
    ("unknown role", CHAT, _chat(messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages[0].role"),
    ("missing role", CHAT, _chat(messages=[{"content": "x"}]), 400, "messages[0].role"),
    ("missing content", CHAT, _chat(messages=[{"role": "user"}]), 400, "messages[0].content"),
    ("content a number", CHAT, _chat(messages=[{"role": "user", "content": 3}]), 400,
     "messages[0].content"),
    ("image part", CHAT, _chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400,
     "messages[0].content[0].type"),
    ("tool result without its call id", CHAT, _chat(messages=[
        {"role": "tool", "content": "x"}]), 400, "messages[0].tool_call_id"),
    ("tool call arguments not JSON", CHAT, _chat(messages=[
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "f", "arguments": "{oops"}}]}]), 400,
     "messages[1].tool_calls[0].function.arguments"),
    ("max_tokens 0", CHAT, _chat(max_tokens=0), 400, "max_tokens"),
    ("max_tokens negative", COMPLETIONS, _completion(max_tokens=-5), 400, "max_tokens"),
    ("max_completion_tokens 0", CHAT, {**_chat(), "max_tokens": None,
                                       "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("max_tokens a string", CHAT, _chat(max_tokens="8"), 400, "max_tokens"),
    ("max_tokens beyond the context", CHAT, _chat(max_tokens=100_000), 400, "max_tokens"),
    ("prompt beyond the context", COMPLETIONS, {**_completion(prompt="sea " * 5000),
                                                "max_tokens": None}, 400, "prompt"),
    ("temperature a string", CHAT, _chat(temperature="hot"), 400, "temperature"),
    ("temperature negative", CHAT, _chat(temperature=-1), 400, "temperature"),
    ("top_p 0", COMPLETIONS, _completion(top_p=0), 400, "top_p"),
    ("seed negative", COMPLETIONS, _completion(seed=-1), 400, "seed"),
    ("stop not strings", COMPLETIONS, _completion(stop=[1]), 400, "stop"),
    ("stop empty string", COMPLETIONS, _completion(stop=[""]), 400, "stop"),
    ("stream not a bool", CHAT, _chat(stream="yes"), 400, "stream"),
    ("stream_options without stream", CHAT, _chat(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("n 2", CHAT, _chat(n=2), 400, "n"),
    ("tool without a type", CHAT, _chat(tools=[{"function": {"name": "f"}}]), 400,
     "tools[0].type"),
    ("tool of another type", CHAT, _chat(tools=[{"type": "retrieval"}]), 400, "tools[0].type"),
    ("tool without a name", CHAT, _chat(tools=[{"type": "function", "function": {}}]), 400,
     "tools[0].function.name"),
    ("tool name with a space", CHAT, _chat(tools=[{"type": "function",
     "function": {"name": "list files"}}]), 400, "tools[0].function.name"),
    ("tool defined twice", CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}},
     {"type": "function", "function": {"name": "f"}}]), 400, "tools[1].function.name"),
    ("tool parameters not a schema", CHAT, _chat(tools=[{"type": "function",
     "function": {"name": "f", "parameters": "a string"}}]), 400, "tools[0].function.parameters"),
    ("tool parameters with a bad type", CHAT, _chat(tools=[{"type": "function", "function": {
     "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}}]),
     400, "tools[0].function.parameters"),
    ("strict tool with an unsupported feature", CHAT, _chat(tools=[{"type": "function",
     "function": {"name": "f", "strict": True, "parameters": {"type": "object", "properties": {
     "a": {"type": "array", "uniqueItems": True}}}}}]), 400, "tools[0].function.parameters"),
    ("tool_choice without tools", CHAT, _chat(tool_choice="required"), 400, "tool_choice"),
    ("tool_choice an unknown word", CHAT, _chat(tool_choice="always", tools=[
     {"type": "function", "function": {"name": "f"}}]), 400, "tool_choice"),
    ("tool_choice an unknown function", CHAT, _chat(tool_choice={"type": "function",
     "function": {"name": "g"}}, tools=[{"type": "function", "function": {"name": "f"}}]), 400,
     "tool_choice.function.name"),
    ("functions", CHAT, _chat(functions=[{"name": "f"}]), 400, "functions"),
    ("logprobs a string", CHAT, _chat(logprobs="yes"), 400, "logprobs"),
    ("top_logprobs without logprobs", CHAT, _chat(top_logprobs=3), 400, "top_logprobs"),
    ("top_logprobs 21", CHAT, _chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("response_format of an unknown type", CHAT, _chat(response_format={"type": "yaml"}), 400,
     "response_format.type"),
    ("json_schema missing", CHAT, _chat(response_format={"type": "json_schema"}), 400,
     "response_format.json_schema"),
    ("json_schema schema not an object", CHAT, _chat(response_format={"type": "json_schema",
     "json_schema": {"name": "x", "schema": "a string"}}), 400,
     "response_format.json_schema.schema"),
    ("json_schema with an unsupported feature", CHAT, _chat(response_format={
     "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array",
     "uniqueItems": True}}}), 400, "response_format.json_schema.schema"),
    ("json_schema with tools", CHAT, _chat(response_format={"type": "json_object"}, tools=[
     {"type": "function", "function": {"name": "f"}}]), 400, "response_format"),
    ("logit_bias", CHAT, _chat(logit_bias={"42": 5}), 400, "logit_bias"),
    ("frequency_penalty", CHAT, _chat(frequency_penalty=0.5), 400, "frequency_penalty"),
    ("presence_penalty", COMPLETIONS, _completion(presence_penalty=1), 400, "presence_penalty"),
    ("completions echo", COMPLETIONS, _completion(echo=True), 400, "echo"),
    ("completions best_of", COMPLETIONS, _completion(best_of=3), 400, "best_of"),
    ("completions suffix", COMPLETIONS, _completion(suffix="end"), 400, "suffix"),
    ("completions logprobs 21", COMPLETIONS, _completion(logprobs=21), 400, "logprobs"),
    ("completions logprobs a string", COMPLETIONS, _completion(logprobs="2"), 400, "logprobs"),
    ("several prompts", COMPLETIONS, _completion(prompt=["a", "b"]), 400, "prompt"),
    ("token id out of range", COMPLETIONS, _completion(prompt=[1, 10**9]), 400, "prompt"),
    ("empty prompt", COMPLETIONS, _completion(prompt=[]), 400, "prompt"),
]  # fmt: skip


@pytest.mark.parametrize(("endpoint", "body", "status", "param"),
                         [b[1:] for b in BAD], ids=[b[0] for b in BAD])  # fmt: skip
def test_bad_request_gets_an_openai_error(
    server: StrataDaemon, model: Path, endpoint: str, body: Any, status: int, param: str | None
) -> None:
    if isinstance(body, bytes):
        content = body.replace(b"@model", model.stem.encode())
    else:
        content = json.dumps(body).replace(MODEL, model.stem).encode()
    r = httpx.post(server.url + endpoint, content=content,
                   headers={"Content-Type": "application/json"}, timeout=30)  # fmt: skip
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"] and error["type"]
    if param is not None and param not in ("stop",):
        assert param.split("[")[0].split(".")[0] in error["message"]
    healthy(server)


def test_context_errors_name_both_numbers(
    server: StrataDaemon, model: Path, engine: Engine
) -> None:
    r = httpx.post(server.url + CHAT, json={**_chat(), "model": model.stem, "max_tokens": 100_000})
    message = r.json()["error"]["message"]
    assert "100000" in message and "4096" in message, message
    r = httpx.post(server.url + COMPLETIONS,
                   json={"model": model.stem, "prompt": "sea " * 5000}, timeout=30)  # fmt: skip
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and "4096" in error["message"]
    assert f"{len(engine.encode_prompt('sea ' * 5000))} tokens" in error["message"], error


def test_the_official_client_raises_its_typed_errors(client: openai.OpenAI, model: Path) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model.stem, messages=USER, n=2)  # type: ignore[arg-type]
    assert e.value.param == "n"
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="gpt-4o", messages=USER)  # type: ignore[arg-type]
    assert nf.value.code == "model_not_found"


def test_unknown_endpoint_and_method_are_openai_errors(server: StrataDaemon) -> None:
    r = httpx.get(server.url + "/v1/nothing", timeout=5)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(server.url + CHAT, timeout=5)
    assert r.status_code == 405 and "GET" in r.json()["error"]["message"]


def test_cors_is_closed_by_default(server: StrataDaemon) -> None:
    ask = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
    pre = httpx.options(server.url + CHAT, headers=ask, timeout=5)
    assert "access-control-allow-origin" not in pre.headers
    r = httpx.get(server.url + "/v1/models", headers={"Origin": "http://evil.example"}, timeout=5)
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    assert r.json()["error"]["code"] == "origin_not_allowed"


# -- queueing and cancellation ------------------------------------------------------------------


def test_eight_streaming_clients_complete_in_arrival_order(
    server: StrataDaemon, client: openai.OpenAI, engine: Engine, model: Path
) -> None:
    want = greedy(engine, engine.encode_prompt(PROMPT), 64).text
    times: dict[int, list[float]] = {}
    texts: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            stream = client.completions.create(
                model=model.stem, prompt=PROMPT, temperature=0, stream=True,
                max_tokens=600 if i == 0 else 64,
            )  # fmt: skip
            stamps, text = [], ""
            for chunk in stream:
                if chunk.choices[0].text:
                    stamps.append(time.monotonic())
                    text += chunk.choices[0].text
            times[i], texts[i] = stamps, text
        except BaseException as e:
            errors.append(e)

    seen = len(server.log)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for i, t in enumerate(threads):
        t.start()
        # the next client arrives only once this one is running or queued behind the others
        wait_for(server, lambda s, i=i: s["busy"] and s["queued"] == i, f"client {i} queued")
    for t in threads:
        t.join(wait_s(60))
    assert not errors, errors
    assert sorted(times) == list(range(8))
    assert all(texts[i] == want for i in range(1, 8))
    # First come first served, one at a time (one engine thread): the daemon finished them in the
    # order it admitted them, client 0's 600 tokens first. Its own log says so; the clients'
    # clocks would also measure how their threads took turns reading their sockets.
    done = re.findall(r"request (\d+): prompt \d+ tokens .*?, (\d+) generated", server.log[seen:])
    assert [int(g) for _, g in done] == [600] + [64] * 7, done
    numbers = [int(n) for n, _ in done]
    assert numbers == sorted(numbers) and len(set(numbers)) == 8, numbers
    healthy(server)


def _open_stream(
    server: StrataDaemon, model: Path, max_tokens: int = LONG
) -> tuple[httpx.Client, httpx.Response]:
    http = httpx.Client(timeout=30)
    body = {"model": model.stem, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
            "temperature": 0}  # fmt: skip
    r = http.send(http.build_request("POST", server.url + COMPLETIONS, json=body), stream=True)
    assert r.status_code == 200
    return http, r


def _idle(server: StrataDaemon) -> dict:
    return wait_for(server, lambda s: not s["busy"] and s["queued"] == 0, "the engine idle")


def test_a_client_that_disconnects_stops_costing_engine_steps(
    server: StrataDaemon, model: Path
) -> None:
    _idle(server)
    before = scrape(server)
    http, r = _open_stream(server, model)
    lines = r.iter_lines()
    got = 0
    for line in lines:
        if line.startswith("data: {"):
            got += 1
            if got == 10:
                break
    at_close = metric(scrape(server), "strata_engine_steps_total")
    r.close()
    http.close()
    _idle(server)
    after = scrape(server)
    steps = metric(after, "strata_engine_steps_total")
    print(f"\nsteps: {at_close - metric(before, 'strata_engine_steps_total'):.0f} before the "
          f"disconnect, {steps - at_close:.0f} after it (of {LONG} asked)")  # fmt: skip
    assert steps - at_close < LONG - got, "the generation went on to its end after its client left"
    time.sleep(0.3)
    assert metric(scrape(server), "strata_engine_steps_total") == steps  # no more work
    cancelled = ("strata_generations_total", {"outcome": "cancelled"})
    assert (
        metric(after, cancelled[0], **cancelled[1])
        == metric(before, cancelled[0], **cancelled[1]) + 1
    )
    healthy(server)


def test_a_waiting_client_that_leaves_never_starts(server: StrataDaemon, model: Path) -> None:
    _idle(server)
    before = scrape(server)
    http_a, a = _open_stream(server, model)
    wait_for(server, lambda s: s["busy"], "the first generation running")
    http_b, b = _open_stream(server, model)
    wait_for(server, lambda s: s["queued"] == 1, "the second one queued")
    b.close()
    http_b.close()
    wait_for(server, lambda s: s["queued"] == 0, "the daemon seeing the waiting client leave")
    a.close()
    http_a.close()
    _idle(server)
    time.sleep(0.1)
    after = scrape(server)

    def delta(outcome: str) -> float:
        name = "strata_generations_total"
        return metric(after, name, outcome=outcome) - metric(before, name, outcome=outcome)

    assert delta("abandoned") == 1, "the waiting request ran"
    assert delta("cancelled") == 1
    healthy(server)


def test_non_streaming_clients_that_leave_are_cancelled_too(
    server: StrataDaemon, model: Path
) -> None:
    _idle(server)
    before = scrape(server)
    body = json.dumps({"model": model.stem, "prompt": PROMPT, "max_tokens": LONG,
                       "temperature": 0}).encode()  # fmt: skip

    def post() -> socket.socket:
        """A client that sends its request and waits for the whole answer (until closed)."""
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=30)
        head = (f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
        sock.sendall(head.encode() + body)
        return sock

    a = post()
    wait_for(server, lambda s: s["busy"], "the first generation running")
    b = post()
    wait_for(server, lambda s: s["queued"] == 1, "the second one waiting behind it")
    b.close()  # it gives up while it waits...
    wait_for(server, lambda s: s["queued"] == 0, "the daemon seeing it leave")
    a.close()  # ...and the first while it runs
    _idle(server)
    after = scrape(server)
    name = "strata_generations_total"
    for outcome in ("abandoned", "cancelled"):
        assert metric(after, name, outcome=outcome) == metric(before, name, outcome=outcome) + 1
    healthy(server)


def test_the_17th_waiting_request_gets_429(server: StrataDaemon, model: Path) -> None:
    _idle(server)
    body = {"model": model.stem, "prompt": PROMPT, "max_tokens": LONG, "stream": True}

    async def scenario() -> httpx.Response:
        limits = httpx.Limits(max_connections=40)
        async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=limits) as http:
            streams = []
            try:
                for i in range(17):  # one running, 16 waiting
                    req = http.build_request("POST", COMPLETIONS, json=body)
                    r = await http.send(req, stream=True)
                    assert r.status_code == 200, (i, await r.aread())
                    streams.append(r)
                    if i == 0:
                        await asyncio.to_thread(wait_for, server, lambda s: s["busy"], "running")
                return await http.post(COMPLETIONS, json={**body, "stream": False})
            finally:
                for r in streams:
                    await r.aclose()

    r = asyncio.run(scenario())
    assert r.status_code == 429, r.text
    assert int(r.headers["retry-after"]) >= 1
    error = r.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "16" in error["message"]
    _idle(server)
    ok = httpx.post(server.url + COMPLETIONS, json={**body, "stream": False, "max_tokens": 8},
                    timeout=30)  # fmt: skip
    assert ok.status_code == 200, ok.text


# -- metrics ------------------------------------------------------------------------------------


def test_metrics_count_the_requests_and_tokens_made(
    server: StrataDaemon, client: openai.OpenAI, model: Path
) -> None:
    _idle(server)
    before = scrape(server)
    chat = client.chat.completions.create(
        model=model.stem, messages=MESSAGES, max_tokens=8, temperature=0
    )
    streamed = list(
        client.completions.create(
            model=model.stem, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model.stem, prompt=PROMPT, max_tokens=0)
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert chat.usage is not None and streamed[-1].usage is not None
    usages = [chat.usage, streamed[-1].usage]
    req = "strata_http_requests_total"
    assert delta(req, endpoint="/v1/chat/completions", status="200") == 1
    assert delta(req, endpoint="/v1/completions", status="200") == 1
    assert delta(req, endpoint="/v1/completions", status="400") == 1
    assert delta(req, endpoint="/metrics", status="200") == 1  # the first scrape
    assert delta("strata_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("strata_completion_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("strata_generations_total", outcome="length") == 2
    assert delta("strata_time_to_first_token_seconds_count") == 2
    assert delta("strata_inter_token_latency_seconds_count") == (8 - 1) + (12 - 1)
    for gauge in ("strata_queue_length", "strata_cache_mib", "strata_busy"):
        assert (gauge, ()) in after
    assert ("strata_cache_resizes_total", ()) in after


# -- stopping -----------------------------------------------------------------------------------


def test_stopping_ends_streams_with_an_error_event_and_waiting_requests_with_503(
    model: Path, tmp_path: Path, daemons: list[StrataDaemon]
) -> None:
    d = StrataDaemon(tmp_path, ["--model", str(model), "--device", "cpu"])
    daemons.append(d)
    body = {"model": model.stem, "prompt": PROMPT, "max_tokens": LONG}
    out: dict[str, Any] = {}

    def stream() -> None:
        with httpx.stream("POST", d.url + COMPLETIONS, json={**body, "stream": True},
                          timeout=30) as r:  # fmt: skip
            out["stream"] = [line for line in r.iter_lines() if line]

    def waiting() -> None:
        out["waiting"] = httpx.post(d.url + COMPLETIONS, json=body, timeout=30)

    threads = [threading.Thread(target=stream), threading.Thread(target=waiting)]
    threads[0].start()
    d.wait_for(lambda s: s["busy"], 10, "the stream running")
    threads[1].start()
    d.wait_for(lambda s: s["queued"] == 1, 10, "the second request waiting")
    assert d.stop(signal.SIGTERM, timeout=60) == 0
    for t in threads:
        t.join(10)
    lines = out["stream"]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "stopping"
    assert out["waiting"].status_code == 503
    assert out["waiting"].json()["error"]["code"] == "stopping"
