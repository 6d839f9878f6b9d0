"""The built-in demo model through the endpoint: ``strata serve`` with no model, a streamed
64-token completion, its time to first token and tok/s printed (run with ``-s`` to see them)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.integration.harness import StrataDaemon

TOKENS = 64


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[StrataDaemon]:
    d = StrataDaemon(tmp_path, [])  # no --model: the demo, written to the private cache dir
    yield d
    if d.stop() != 0:
        print(d.log)


def streamed(client: openai.OpenAI, model: str) -> tuple[float, float, int]:
    """(time to first token, decode tok/s, tokens) of one streamed completion."""
    t0 = time.monotonic()
    stamps = []
    usage = None
    for chunk in client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ):  # fmt: skip
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.monotonic())
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None
    ttft = stamps[0] - t0
    # chunks carry text as it becomes final; tokens after the first over the time after it
    tok_s = (usage.completion_tokens - 1) / (stamps[-1] - stamps[0])
    return ttft, tok_s, usage.completion_tokens


def test_demo_model_time_to_first_token_and_tok_s(demo: StrataDaemon) -> None:
    client = openai.OpenAI(base_url=demo.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    assert model.startswith("strata-demo")
    device = demo.status()["compute_device"]
    for label in ("first request", "second request"):
        ttft, tok_s, n = streamed(client, model)
        assert n == TOKENS  # the demo's greedy text never ends early
        print(f"\ndemo model on {device}, {label}: time to first token {ttft * 1000:.0f} ms, "
              f"{tok_s:.1f} tok/s over {n} streamed tokens")  # fmt: skip
