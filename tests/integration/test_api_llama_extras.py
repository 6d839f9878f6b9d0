"""llama-server's extras on the demo model: ``/tokenize`` and ``/detokenize`` round-trip (with
pieces, with and without special parsing), ``/apply-template`` gives the prompt a chat request
starts from, ``/props`` describes the model; bad input gets an OpenAI-shaped 400 naming the
field. One daemon for the module."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.integration.harness import StrataDaemon


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StrataDaemon]:
    d = StrataDaemon(tmp_path_factory.mktemp("extras"), ["--device", "cpu"])
    yield d
    d.stop()


def _post(d: StrataDaemon, path: str, body: object) -> httpx.Response:
    return httpx.post(d.url + path, json=body, timeout=60)


def test_tokenize_detokenize_round_trip(demo: StrataDaemon) -> None:
    text = "Hello world, á!"
    ids = _post(demo, "/tokenize", {"content": text}).json()["tokens"]
    assert ids and all(isinstance(t, int) for t in ids)
    assert _post(demo, "/detokenize", {"tokens": ids}).json() == {"content": text}
    pieces = _post(demo, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    assert all(isinstance(p["piece"], str | list) for p in pieces)
    joined = b"".join(
        p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces
    )
    assert joined.decode() == text


def test_tokenize_special_tokens_parsed_or_plain(demo: StrataDaemon) -> None:
    marker = "<|im_start|>"
    parsed = _post(demo, "/tokenize", {"content": marker}).json()["tokens"]
    plain = _post(demo, "/tokenize", {"content": marker, "parse_special": False}).json()["tokens"]
    assert len(parsed) == 1 and len(plain) > 1


def test_apply_template_is_the_chat_prompt(demo: StrataDaemon) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    prompt = _post(demo, "/apply-template", {"messages": msgs}).json()["prompt"]
    assert "Be brief." in prompt and "Hi there" in prompt
    # the chat request's prompt is exactly that text's tokens
    ids = _post(demo, "/tokenize", {"content": prompt, "add_special": True}).json()["tokens"]
    r = _post(demo, "/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_props(demo: StrataDaemon) -> None:
    props = httpx.get(demo.url + "/props", timeout=30).json()
    assert props["default_generation_settings"]["n_ctx"] > 0
    assert props["total_slots"] == 1
    assert props["chat_template"]
    assert props["modalities"]["vision"] is False


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "content"),
        ("/tokenize", {"content": 3}, "content"),
        ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
        ("/detokenize", {"tokens": [1, "a"]}, "tokens[1]"),
        ("/detokenize", {"tokens": [10**9]}, "tokens[0]"),
        ("/apply-template", {"messages": []}, "messages"),
    ],
)
def test_bad_input_is_an_openai_400_naming_the_field(
    demo: StrataDaemon, path: str, body: object, param: str
) -> None:
    r = _post(demo, path, body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]


# every path of the other APIs, on hostile bodies: a 400 in the shape of the path's API
POSTS = ("/tokenize", "/detokenize", "/apply-template", "/v1/messages",
         "/v1/messages/count_tokens", "/v1/responses", "/api/chat", "/api/generate", "/api/show",
         "/api/pull")  # fmt: skip
HOSTILE = (
    b"",
    b"null",
    b"[]",
    b"1",
    b"{",
    b"\xff{}",
    b"[" * 100_000,
    b"{" * 100_000,
    b'{"model": 1}',
)
# well-formed enough for the paths that only read a model name or a text: for the generation ones
GENERATING = ("/v1/messages", "/v1/responses", "/api/chat")
BAD_REQUESTS = (b'{"model": "m", "messages": "x", "input": {}, "prompt": 2}',
                b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}], '
                b'"max_tokens": 1, "input": [{"role": "user", "content": [null]}]}',
                b'{"model": "m", "max_tokens": -1, "messages": [{"role": "user", "content": '
                b'"hi"}], "input": "hi", "max_output_tokens": -1, '
                b'"options": {"num_predict": "x"}}')  # fmt: skip


def test_hostile_bodies_get_a_400_in_each_apis_shape(demo: StrataDaemon) -> None:
    cases = [(p, b) for p in POSTS for b in HOSTILE]
    cases += [(p, b) for p in GENERATING for b in BAD_REQUESTS]
    with httpx.Client(base_url=demo.url, timeout=60) as client:
        for path, body in cases:
            r = client.post(path, content=body, headers={"Content-Type": "application/json"})
            what = (path, body[:40], r.text[:200])
            assert r.status_code == 400, what
            err = r.json()
            if path.startswith("/v1/messages"):
                assert err["type"] == "error" and err["error"]["message"], what
            elif path.startswith("/api/"):
                assert set(err) == {"error"} and err["error"], what
            else:
                assert err["error"]["type"] == "invalid_request_error", what
        assert client.get("/health").status_code == 200
