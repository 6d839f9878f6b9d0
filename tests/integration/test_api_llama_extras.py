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
