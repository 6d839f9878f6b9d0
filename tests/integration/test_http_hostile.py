"""What a hostile web page and a fuzzer send, through the real daemon (default configuration: no
key, loopback, CORS closed): cross-origin requests a page may send without a preflight, a
rebound ``Host``, float fields at the edge of the representable, surrogates, and stop lists
beyond the limit. Each is refused with one clear error (or served, for the floats a sampler can
take), none changes anything, and none reaches a traceback.

One daemon for the module.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from strata.engine.synth import ensure_synthetic
from tests.integration.harness import StrataDaemon

EVIL = "http://evil.example"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_synthetic("tiny-qwen3moe", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StrataDaemon]:
    d = StrataDaemon(tmp_path_factory.mktemp("daemon"), ["--model", str(model), "--device", "cpu"])
    yield d
    d.stop()


@pytest.fixture(autouse=True)
def _daemon_log_on_failure(request: pytest.FixtureRequest, server: StrataDaemon) -> Iterator[None]:
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed > failed:
        print(f"\n----- daemon log {server.log_path} -----\n{server.log}")


def port(server: StrataDaemon) -> int:
    return int(server.url.rsplit(":", 1)[1])


def chat(model: Path, **extra: object) -> dict[str, object]:
    return {"model": model.stem, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, **extra}  # fmt: skip


def error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["code"] == code, body
    return body["message"]


# -- web pages ---------------------------------------------------------------------------------

SIMPLE_BODIES = [  # what a page may POST cross-origin with no preflight
    ("text/plain", '{"reserve_mib": 1234}'),
    ("application/x-www-form-urlencoded", '{"reserve_mib": 1234}'),
    ("multipart/form-data; boundary=x", '--x\r\nContent-Disposition: form-data; name="a"\r\n\r\n'
     '{"reserve_mib": 1234}\r\n--x--\r\n'),
]  # fmt: skip


@pytest.mark.parametrize(("ctype", "body"), SIMPLE_BODIES, ids=lambda v: v.split(";")[0][:24])
def test_a_cross_origin_page_cannot_change_the_reserve_or_run_a_chat(
    server: StrataDaemon, model: Path, ctype: str, body: str
) -> None:
    before = server.status()["reserve_mib"]
    for origin in (EVIL, "null", f"http://localhost:{port(server) + 1}"):
        headers = {"Origin": origin, "Content-Type": ctype}
        r = httpx.post(server.url + "/v1/vram", content=body, headers=headers, timeout=5)
        message = error(r, 403, "origin_not_allowed")
        assert origin in message and "cors_allow_origins" in message
        r = httpx.post(server.url + "/v1/chat/completions", content=json.dumps(chat(model)),
                       headers=headers, timeout=5)  # fmt: skip
        error(r, 403, "origin_not_allowed")
        assert "access-control-allow-origin" not in r.headers
    assert server.status()["reserve_mib"] == before


def test_the_daemons_own_origin_and_no_origin_are_served(server: StrataDaemon) -> None:
    own = f"http://127.0.0.1:{port(server)}"
    r = httpx.get(server.url + "/v1/vram", headers={"Origin": own}, timeout=5)
    assert r.status_code == 200, r.text
    assert httpx.get(server.url + "/v1/vram", timeout=5).status_code == 200  # curl, scripts


def test_a_host_header_of_another_name_is_refused(server: StrataDaemon, model: Path) -> None:
    for host in ("attacker.example", f"attacker.example:{port(server)}", "evil.localhost.test"):
        r = httpx.get(server.url + "/v1/vram", headers={"Host": host}, timeout=5)
        message = error(r, 400, "host_not_allowed")
        assert host in message and "allowed_hosts" in message
        r = httpx.post(server.url + "/v1/chat/completions", json=chat(model),
                       headers={"Host": host}, timeout=5)  # fmt: skip
        error(r, 400, "host_not_allowed")
    for host in (f"localhost:{port(server)}", f"127.0.0.1:{port(server)}", f"[::1]:{port(server)}",
                 "LOCALHOST"):  # fmt: skip
        r = httpx.get(server.url + "/v1/vram", headers={"Host": host}, timeout=5)
        assert r.status_code == 200, (host, r.text)


def test_a_huge_origin_is_not_echoed(server: StrataDaemon) -> None:
    r = httpx.get(server.url + "/v1/vram", headers={"Origin": "http://" + "a" * 20000}, timeout=5)
    message = error(r, 403, "origin_not_allowed")
    assert len(message) < 300


# -- numbers and text --------------------------------------------------------------------------

TINY = [1e-40, 1e-300, 5e-324]


@pytest.mark.parametrize("value", TINY, ids=str)
def test_tiny_temperatures_and_top_p_are_served(
    server: StrataDaemon, model: Path, value: float
) -> None:
    for field in ("temperature", "top_p", "min_p"):
        r = httpx.post(server.url + "/v1/chat/completions", json=chat(model, **{field: value}),
                       timeout=60)  # fmt: skip
        assert r.status_code == 200, (field, value, r.text)
        assert r.json()["usage"]["completion_tokens"] >= 1


def test_a_repeat_penalty_outside_its_range_is_a_400(server: StrataDaemon, model: Path) -> None:
    for value in (*TINY, 0.001, 1000.0):
        r = httpx.post(server.url + "/v1/chat/completions",
                       json=chat(model, repeat_penalty=value), timeout=10)  # fmt: skip
        message = error(r, 400, "invalid_value")
        assert "repeat_penalty" in message and "[0.01, 100]" in message, message


def test_no_request_above_ended_in_a_traceback(server: StrataDaemon) -> None:
    assert "Traceback" not in server.log
    metrics = httpx.get(server.url + "/metrics", timeout=5).text
    assert 'status="500"' not in metrics


@pytest.mark.parametrize(
    ("where", "payload"),
    [
        ("stop[0]", '"stop": ["\\ud800"]'),
        ("stop", '"stop": "a\\udc00\\ud800b"'),
        ("messages[0].name", '"messages": [{"role": "user", "content": "hi", "name": "\\udc00"}]'),
    ],
)
def test_surrogates_are_refused_where_docs_say(
    server: StrataDaemon, model: Path, where: str, payload: str
) -> None:
    base = f'"model": "{model.stem}", "max_tokens": 2'
    messages = "" if "messages" in payload else ', "messages": [{"role": "user", "content": "x"}]'
    raw = "{" + base + messages + ", " + payload + "}"
    r = httpx.post(server.url + "/v1/chat/completions", content=raw,
                   headers={"Content-Type": "application/json"}, timeout=10)  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == where
    assert "surrogate" in r.json()["error"]["message"]


def test_stop_lists_are_limited(server: StrataDaemon, model: Path) -> None:
    r = httpx.post(server.url + "/v1/chat/completions",
                   json=chat(model, stop=["a", "b", "c", "d", "e"]), timeout=10)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
    assert "at most 4" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"model": model.stem, "prompt": "x",
                   "max_tokens": 2, "stop": ["z" * 300]}, timeout=10)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop[0]", r.text
    assert "at most 256" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions",
                   json=chat(model, stop=["a", "b", "c", "d" * 256]), timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text


def test_a_reserve_beyond_any_device_is_refused_and_changes_nothing(server: StrataDaemon) -> None:
    before = server.status()["reserve_mib"]
    for mib in (10**30, 2**64 - 1, 2**32 + 1):
        r = httpx.post(server.url + "/v1/vram", json={"reserve_mib": mib}, timeout=5)
        assert r.status_code == 400, r.text
        assert str(mib) in r.json()["error"]["message"]
        assert "limit of 4294967296 MiB" in r.json()["error"]["message"]
    assert server.status()["reserve_mib"] == before


def test_a_client_gone_mid_upload_is_counted_not_an_error(server: StrataDaemon) -> None:
    host, port_ = server.url.removeprefix("http://").rsplit(":", 1)
    for _ in range(3):
        with socket.create_connection((host, int(port_)), timeout=5) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
                      b'{"model": "x", "messages": [')  # fmt: skip

    def counted() -> bool:
        metrics = httpx.get(server.url + "/metrics", timeout=5).text
        return 'endpoint="/v1/chat/completions",status="499"} 3.0' in metrics

    deadline = time.monotonic() + 30
    while not counted():
        assert time.monotonic() < deadline, "the abandoned uploads were never counted"
        time.sleep(0.1)
    assert "unexpected error" not in server.log and "Traceback" not in server.log
