"""The HTTP endpoint's guards, configured: a bearer API key, CORS for one origin, a body limit.

One daemon for the module, started with ``--api-key``, ``--cors-allow-origins`` and
``--max-request-kib 4``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from strata.engine.synth import ensure_synthetic
from tests.integration.harness import StatusEvents, StrataDaemon

KEY = "sk-local-test-key"
ORIGIN = "http://app.example"
LIMIT = 4 * 1024


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_synthetic("tiny-qwen3moe", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StrataDaemon]:
    args = ["--model", str(model), "--device", "cpu", "--max-request-kib", "4",
            "--cors-allow-origins", f"{ORIGIN}, http://other.example"]  # fmt: skip
    # the key through the environment, as a user would keep it out of the process list
    d = StrataDaemon(tmp_path_factory.mktemp("daemon"), args, env={"STRATA_API_KEY": KEY})
    yield d
    d.stop()


@pytest.fixture(autouse=True)
def _daemon_log_on_failure(request: pytest.FixtureRequest, server: StrataDaemon) -> Iterator[None]:
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed > failed:
        print(f"\n----- daemon log {server.log_path} -----\n{server.log}")


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_api_key_is_required_except_for_health(server: StrataDaemon, model: Path) -> None:
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    body = {"model": model.stem, "prompt": "hi", "max_tokens": 8}
    for headers in ({}, auth("wrong"), {"Authorization": KEY}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                             ("GET", "/metrics"), ("GET", "/v1/vram")):  # fmt: skip
            r = httpx.request(method, server.url + path, json=body, headers=headers, timeout=5)
            assert r.status_code == 401, (headers, path, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
            error = r.json()["error"]
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
            assert set(error) == {"message", "type", "param", "code"}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=auth(), timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def test_the_page_is_open_but_its_calls_and_the_status_stream_need_the_key(
    server: StrataDaemon,
) -> None:
    for path in ("/", "/page.js", "/page.css", "/favicon.svg"):
        r = httpx.get(server.url + path, timeout=5)
        assert r.status_code == 200, (path, r.text)
        assert KEY not in r.text  # the page holds no secret
    r = httpx.get(server.url + "/v1/vram/events", timeout=5)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    events = StatusEvents(server.url, auth())
    try:
        assert events.next()[0] == "history" and events.status_code == 200
        assert events.next()[0] == "status"
    finally:
        events.close()
    # a page of another origin cannot read the stream, key or not
    r = httpx.get(server.url + "/v1/vram/events", headers={"Origin": "http://evil.example",
                  **auth()}, timeout=5)  # fmt: skip
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"


def test_the_official_client_sends_the_key(server: StrataDaemon, model: Path) -> None:
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    r = good.chat.completions.create(
        model=model.stem, messages=[{"role": "user", "content": "hi"}], max_tokens=8
    )
    assert r.usage is not None and r.usage.completion_tokens == 8
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_cors_answers_the_configured_origins_only(server: StrataDaemon) -> None:
    ask = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
    pre = httpx.options(server.url + "/v1/chat/completions", headers={"Origin": ORIGIN, **ask})
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in pre.headers["access-control-allow-methods"]
    other = httpx.options(server.url + "/v1/chat/completions",
                          headers={"Origin": "http://evil.example", **ask})  # fmt: skip
    assert "access-control-allow-origin" not in other.headers
    r = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN, **auth()}, timeout=5)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    # an error a page must be able to read carries the header too
    r = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN}, timeout=5)
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN


def test_bodies_over_the_limit_get_413(server: StrataDaemon, model: Path) -> None:
    big = {"model": model.stem, "prompt": "x" * (LIMIT + 10), "max_tokens": 4}
    r = httpx.post(server.url + "/v1/completions", json=big, headers=auth(), timeout=10)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"
    assert str(LIMIT) in r.json()["error"]["message"]

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit applies as it arrives
        yield b'{"model": "x", "prompt": "'
        for _ in range(10):
            yield b"y" * 1024
        yield b'"}'

    r = httpx.post(server.url + "/v1/completions", content=chunked(), timeout=10,
                   headers={**auth(), "Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"
    small = {"model": model.stem, "prompt": "x" * 100, "max_tokens": 4}
    r = httpx.post(server.url + "/v1/completions", json=small, headers=auth(), timeout=30)
    assert r.status_code == 200, r.text
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
