"""The fuzz corpus: hostile request bodies replayed against one real daemon (``strata serve`` on
127.0.0.1, port 0, the tiny model, the default configuration but for a small
``max_requests_in_progress``). Every reply must be an OpenAI-shaped success or an OpenAI-shaped
JSON error of 4xx (or the in-progress cap's 503), never a 500, and the daemon's log must have no
traceback at the end. ``test_http_hostile.py`` covers the single cases with their exact messages
(origins, Host, the float edges, surrogates where docs/http.md names them, the stop limits); this
group is the breadth around them:

- every request field with values of every JSON type, numbers at and past every edge (2^63,
  2^64, 1e308, 5e-324, 1e999, 5000-digit integers, NaN and Infinity as JSON constants and as
  strings), lone and reversed surrogates, deeply nested arrays;
- messages and prompts of the wrong shapes (content parts, token id lists of junk);
- whole bodies that are not JSON objects: empty, truncated, BOM-prefixed, UTF-16, invalid UTF-8,
  100,000 open braces, duplicate keys;
- stop lists over the limits (count and length), with empty, null and nested entries;
- content types a web page can send without a preflight, and others; methods and paths that do
  not exist;
- requests in progress beyond ``max_requests_in_progress`` (uploads that never finish).

The daemon's context is short (``CONTEXT``): bodies without ``max_tokens`` generate to its end.

``TEST_FUZZ_RANDOM`` (default 60) adds that many random mutations of valid bodies (a fixed
seed) to the corpus; raise it to fuzz longer locally:

    TEST_FUZZ_RANDOM=5000 ./scripts/test -m fuzz
"""

from __future__ import annotations

import json
import os
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from strata.engine.synth import ensure_synthetic
from tests.integration.harness import StrataDaemon

pytestmark = pytest.mark.fuzz

RANDOM_CASES = int(os.environ.get("TEST_FUZZ_RANDOM", "60"))
SLOTS = 4  # max_requests_in_progress of the daemon under test
LONGEST_MESSAGE = 600  # an error message never echoes a large input back
CONTEXT = 256  # the daemon's context_length

CHAT, COMPLETIONS, VRAM = "/v1/chat/completions", "/v1/completions", "/v1/vram"
VALUES: list[Any] = [None, True, False, "x", "", [], {}, [1], {"a": 1}, 1.5, -1, 0, 10**30,
                     2**63, 2**64, -(2**63) - 1, 1e308, -1e308, 5e-324, "NaN", "inf", [None],
                     [[[]]], {"": None}]  # fmt: skip
RAW_VALUES = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" * 5000, "-" + "9" * 5000,
              "0.1e-99999", "1" * 400 + ".5", '"\\ud800"', '"\\udc00x\\ud800"',
              "[" * 2000 + "]" * 2000]  # fmt: skip
CHAT_FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
               "top_k", "min_p", "repeat_penalty", "repeat_last_n", "seed", "stop", "stream",
               "stream_options", "n", "logprobs", "tools", "response_format", "logit_bias",
               "user", "presence_penalty", "frequency_penalty", "tool_choice", "top_logprobs",
               "parallel_tool_calls", "chat_template_kwargs", "reasoning_format",
               "reasoning_effort", "think"]  # fmt: skip
COMPLETION_FIELDS = ["prompt", "echo", "best_of", "suffix", "logprobs", "max_tokens",
                     "temperature", "stop", "seed", "stream", "think"]  # fmt: skip
MESSAGE_KEYS = ["role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"]
CONTENT_TYPES = ["text/plain", "application/x-www-form-urlencoded",
                 "multipart/form-data; boundary=x", "application/xml", None,
                 "application/json; charset=latin-1",
                 "application/json; charset=utf-16"]  # fmt: skip
PLACEHOLDER = '"__RAW__"'

Case = tuple[str, str, bytes, str | None]  # (name, path, body, content type)


def chat(model_id: str, /, **extra: Any) -> dict[str, Any]:
    return {"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            **extra}  # fmt: skip


def completion(model_id: str, /, **extra: Any) -> dict[str, Any]:
    return {"model": model_id, "prompt": "hi", "max_tokens": 2, **extra}


def dumps(body: Any) -> bytes:
    return json.dumps(body).encode()


def raw(body: dict[str, Any], value: str) -> bytes:
    """``body`` with the placeholder string replaced by ``value`` as raw JSON text."""
    text = json.dumps(body)
    assert PLACEHOLDER in text
    return text.replace(PLACEHOLDER, value).encode()


def corpus(model: str) -> list[Case]:
    J = "application/json"
    out: list[Case] = []
    for f in CHAT_FIELDS:
        out += [(f"chat {f}={v!r:.40}", CHAT, dumps(chat(model, **{f: v})), J) for v in VALUES]
        out += [(f"chat {f}=raw {r:.40}", CHAT, raw(chat(model, **{f: "__RAW__"}), r), J)
                for r in RAW_VALUES]  # fmt: skip
    for f in COMPLETION_FIELDS:
        out += [(f"completion {f}={v!r:.40}", COMPLETIONS, dumps(completion(model, **{f: v})), J)
                for v in VALUES]  # fmt: skip
        out += [(f"completion {f}=raw {r:.40}", COMPLETIONS,
                 raw(completion(model, **{f: "__RAW__"}), r), J) for r in RAW_VALUES]  # fmt: skip
    for v in [*VALUES, "user"]:
        for key in MESSAGE_KEYS:
            message = {"role": "user", "content": "hi", key: v}
            out.append((f"message {key}={v!r:.40}", CHAT, dumps(chat(model, messages=[message])),
                        J))  # fmt: skip
        parts = [{"role": "user", "content": [{"type": "text", "text": v}]},
                 {"role": "user", "content": [v]}, v]  # fmt: skip
        out += [(f"message shape {i} {v!r:.40}", CHAT, dumps(chat(model, messages=[m])), J)
                for i, m in enumerate(parts)]  # fmt: skip
    for r in RAW_VALUES:
        for where, body in (
            ("content", chat(model, messages=[{"role": "user", "content": "__RAW__"}])),
            ("role", chat(model, messages=[{"role": "__RAW__", "content": "x"}])),
            ("prompt[0]", completion(model, prompt=["__RAW__"])),
            ("prompt[0][1]", completion(model, prompt=[[1, "__RAW__"]])),
        ):
            out.append((f"{where}=raw {r:.40}", CHAT if "messages" in body else COMPLETIONS,
                        raw(body, r), J))  # fmt: skip
    for ids in ([], [[]], [-1], [10**9], [2**63], [0.5], [[1, 2], [3]], [True], [[True]]):
        out.append((f"token ids {ids!r:.40}", COMPLETIONS, dumps(completion(model, prompt=ids)),
                    J))  # fmt: skip
    bodies = [b"", b"null", b"[]", b"1", b'"x"', b"{", b"\xff\xfe{}",
              b"\xef\xbb\xbf" + dumps(chat(model)), json.dumps(chat(model)).encode("utf-16"),
              b'{"model": "\xff"}', b'{"model": 1, "model": "' + model.encode() + b'"}',
              b"{" * 100_000, b"[" * 100_000]  # fmt: skip
    for path in (CHAT, COMPLETIONS, VRAM):
        out += [(f"body {b[:24]!r}", path, b, J) for b in bodies]
        for ctype in CONTENT_TYPES:
            body = b'{"reserve_mib": 0}' if path == VRAM else dumps(chat(model))
            out.append((f"content type {ctype}", path, body, ctype))
    out += [(f"reserve_mib={v!r:.40}", VRAM, dumps({"reserve_mib": v}), J) for v in VALUES]
    out += [(f"reserve_mib=raw {r:.40}", VRAM, raw({"reserve_mib": "__RAW__"}, r), J)
            for r in RAW_VALUES]  # fmt: skip
    stops: list[Any] = [["a"] * 5, ["a"] * 10_000, "x" * 257, ["x" * 256] * 4, [""], "",
                        ["a", None], [["a"]], [1], ["b"] * 65]  # fmt: skip
    out += [(f"stop {s!r:.40}", CHAT, dumps(chat(model, stop=s)), J) for s in stops]
    for extra in ({"stream": True}, {"stream": True, "stream_options": {"include_usage": True}},
                  {"stream": True, "max_tokens": 10**9}, {"stream": True, "temperature": "x"},
                  {"stream": True, "stop": ["\u00e9", "\u65e5\U0001f642"]}):  # fmt: skip
        out.append((f"stream {extra}", CHAT, dumps(chat(model, **extra)), J))
        out.append((f"stream {extra}", COMPLETIONS, dumps(completion(model, **extra)), J))
    return out + random_cases(model, RANDOM_CASES)


def junk(rng: random.Random, depth: int = 0) -> Any:
    pick = rng.randrange(9 if depth < 4 else 6)
    if pick < 6:
        return rng.choice(VALUES)
    if pick == 6:
        return "".join(rng.choice('aé日🙂\u0000\n"\\<|im_end|>') for _ in range(rng.randint(0, 40)))
    if pick == 7:
        return [junk(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["role", "content", "x", ""]): junk(rng, depth + 1)
            for _ in range(rng.randint(0, 4))}  # fmt: skip


def random_cases(model: str, n: int) -> list[Case]:
    """Valid bodies with one to three fields replaced, added or dropped at random."""
    rng = random.Random(1600)
    out: list[Case] = []
    for i in range(n):
        is_chat = rng.random() < 0.6
        body = chat(model) if is_chat else completion(model)
        fields = CHAT_FIELDS if is_chat else COMPLETION_FIELDS
        for _ in range(rng.randint(1, 3)):
            f = rng.choice(fields)
            if rng.random() < 0.15:
                body.pop(f, None)
            else:
                body[f] = junk(rng)
        if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
            body["max_tokens"] = min(body["max_tokens"], 8)  # failures, not long generations
        out.append((f"random {i}", CHAT if is_chat else COMPLETIONS, dumps(body),
                    "application/json"))  # fmt: skip
    return out


# -- the checks ----------------------------------------------------------------------------------


def check_error(r: httpx.Response, what: str) -> None:
    assert 400 <= r.status_code < 500 or r.status_code == 503, (what, r.status_code, r.text)
    assert r.headers.get("content-type", "").startswith("application/json"), (what, r.headers)
    check_error_body(r.json(), what)


def check_error_body(body: Any, what: str) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, (what, body)
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}, (what, err)
    assert isinstance(err["message"], str) and err["message"], (what, err)
    assert len(err["message"]) < LONGEST_MESSAGE, (what, len(err["message"]))
    assert isinstance(err["type"], str) and err["type"], (what, err)
    assert err["param"] is None or isinstance(err["param"], str), (what, err)
    assert err["code"] is None or isinstance(err["code"], str), (what, err)


def check_success(r: httpx.Response, path: str, what: str) -> None:
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", (what, r.text[-300:])
        for event in events[:-1]:
            chunk = json.loads(event)
            if "error" in chunk:  # an error after the stream began
                check_error_body(chunk, what)
            else:
                kind = "chat.completion.chunk" if path == CHAT else "text_completion"
                assert chunk["object"] == kind and isinstance(chunk["choices"], list), (what, chunk)
        return
    body = r.json()
    if path == VRAM:
        assert isinstance(body, dict) and body["state"] == "ready", (what, body)
        return
    kind = "chat.completion" if path == CHAT else "text_completion"
    assert body["object"] == kind and len(body["choices"]) == 1, (what, body)
    choice = body["choices"][0]
    text = choice["message"]["content"] if path == CHAT else choice["text"]
    assert isinstance(text, str) and choice["finish_reason"] in ("stop", "length"), (what, body)
    assert isinstance(body["usage"]["completion_tokens"], int), (what, body)


def check(r: httpx.Response, path: str, what: str) -> None:
    if r.status_code == 200:
        check_success(r, path, what)
    else:
        check_error(r, what)


# -- the daemon ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_synthetic("tiny-qwen3moe", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StrataDaemon]:
    # a short context: a body without max_tokens generates to the context's end (three of the
    # corpus's do), which at the model's own context took half a minute each on CI's cores
    d = StrataDaemon(tmp_path_factory.mktemp("daemon"),
                     ["--model", str(model), "--device", "cpu", "--host", "127.0.0.1",
                      "--max-requests-in-progress", str(SLOTS),
                      "--context-length", str(CONTEXT)])  # fmt: skip
    yield d
    d.stop()


@pytest.fixture(autouse=True)
def _daemon_log_on_failure(request: pytest.FixtureRequest, server: StrataDaemon) -> Iterator[None]:
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed > failed:
        print(f"\n----- daemon log {server.log_path} -----\n{server.log[-20000:]}")


def test_every_hostile_body_gets_a_well_formed_answer(server: StrataDaemon, model: Path) -> None:
    cases = corpus(model.stem)
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for what, path, body, ctype in cases:
            headers = {"Content-Type": ctype} if ctype else {}
            r = client.post(path, content=body, headers=headers)
            check(r, path, what)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        for method, path in (("GET", CHAT), ("PUT", VRAM), ("DELETE", "/v1/models"),
                             ("GET", "/v1/models/%00"), ("GET", "/v1/models/" + "x" * 5000),
                             ("GET", "/" + "a" * 10_000), ("POST", "/metrics"),
                             ("PATCH", "/health")):  # fmt: skip
            r = client.request(method, path)
            check_error(r, f"{method} {path[:40]}")
        # and a plain chat still works
        r = client.post(CHAT, json=chat(model.stem))
        check_success(r, CHAT, "a plain chat after the corpus")
    print(f"\n{len(cases)} hostile bodies: statuses {dict(sorted(statuses.items()))}")
    assert 200 in statuses and 400 in statuses  # the corpus reaches both sides


def test_requests_beyond_the_cap_in_progress_get_a_503_and_monitoring_still_answers(
    server: StrataDaemon, model: Path
) -> None:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps(chat(model.stem)).encode()
    uploads = []
    try:
        for _ in range(SLOTS):  # uploads that never finish: each holds a slot
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                      % (len(body) + 10) + body)  # fmt: skip
            uploads.append(s)
        wait_metric(server, "strata_http_requests_in_progress", SLOTS)
        r = httpx.post(server.url + CHAT, json=chat(model.stem), timeout=30)
        check_error(r, "one request beyond the cap")
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "too_many_requests_in_progress"
        assert "max_requests_in_progress" in r.json()["error"]["message"]
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        assert f"strata_http_requests_in_progress_limit {float(SLOTS)}" in metrics
        assert "strata_http_body_bytes " in metrics
    finally:
        for s in uploads:
            s.close()
    wait_metric(server, "strata_http_requests_in_progress", 0)
    r = httpx.post(server.url + CHAT, json=chat(model.stem), timeout=120)
    check_success(r, CHAT, "a chat once the uploads are gone")


def wait_metric(server: StrataDaemon, name: str, value: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        if f"\n{name} {float(value)}\n" in text:
            return
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.05)


def test_nothing_above_reached_a_traceback_or_a_500(server: StrataDaemon) -> None:
    log = server.log
    assert "Traceback" not in log and "unexpected error" not in log, log[-5000:]
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    for line in metrics.splitlines():
        if line.startswith("strata_http_requests_total"):
            assert 'status="5' not in line or 'status="503"' in line, line
