"""The hybrids (qwen35moe, qwen3next) through the real daemon and the ``openai`` client, on the
CPU's reference path: a chat answer whose thought is ``reasoning_content`` (the file's template
opens ``<think>`` as Qwen3.5's does), the same streamed, a request with tools, and a second turn
with the thought in its history. One daemon per architecture, greedy decoding, few tokens."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from strata.engine.synth_hybrid import HybridSpec, write_hybrid
from tests.integration.harness import StrataDaemon

ASK = [{"role": "user", "content": "Why is the sky blue?"}]
GREEDY: dict[str, Any] = {"max_tokens": 6, "temperature": 0}
TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]  # fmt: skip


@pytest.fixture(scope="module", params=["qwen35moe", "qwen3next"])
def daemon(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[StrataDaemon]:  # fmt: skip
    folder = tmp_path_factory.mktemp(request.param)
    spec = HybridSpec(request.param, n_ff_exp=256, n_ff_shexp=256)
    path = write_hybrid(folder / f"tiny-{request.param}.gguf", spec)
    d = StrataDaemon(folder, ["--model", str(path), "--device", "cpu", "--context-length", "512"])
    yield d
    d.stop()


def _thought(message: Any) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def test_a_hybrid_answers_chat_streamed_and_with_tools(daemon: StrataDaemon) -> None:
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model="", messages=ASK, **GREEDY)
    thought = _thought(r.choices[0].message)
    assert thought and r.choices[0].finish_reason == "length"
    streamed = ""
    for chunk in client.chat.completions.create(model="", messages=ASK, stream=True, **GREEDY):
        if chunk.choices:
            streamed += (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
    assert streamed == thought
    tooled = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, **GREEDY)  # type: ignore[arg-type]
    assert tooled.choices[0].finish_reason in ("length", "tool_calls")
    history = [*ASK, {"role": "assistant", "content": "Light.", "reasoning_content": thought},
               {"role": "user", "content": "And at night?"}]  # fmt: skip
    again = client.chat.completions.create(model="", messages=history, **GREEDY)  # type: ignore[arg-type]
    assert _thought(again.choices[0].message)
    # the K/V's share of the status counts the recurrent state (one layer's is 66 KiB here)
    status = httpx.get(daemon.url + "/v1/vram", timeout=10).json()
    assert status["kv_mib"] >= 1
