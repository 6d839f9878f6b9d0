"""Reasoning through the real daemon and the ``openai`` client: a model whose template thinks as
Qwen3.5's does (the generation prompt opens ``<think>``; ``enable_thinking: false`` writes an
empty thought instead), on the demo's random weights.

The output is meaningless, so the tests hold its shape: with thinking on, the reply of a few
tokens is all thought (``reasoning_content``, streamed as ``delta.reasoning_content``) and no
content; each way of turning thinking off (``chat_template_kwargs``, ``think``,
``reasoning_effort``, the daemon's option) changes the prompt and gives content and no thought;
``reasoning_format`` ``none`` leaves the text in ``content``; a grammar waits for the thought's
end. One daemon for the module, greedy decoding, small ``max_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest

from strata.engine import synth
from strata.engine.vocab import QWEN3_TEMPLATE
from tests.integration.harness import StrataDaemon

GENERATION_PROMPT = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
THINKING_PROMPT = (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)
ASK = [{"role": "user", "content": "Why is the sky blue?"}]
GREEDY: dict[str, Any] = {"max_tokens": 8, "temperature": 0}


def thinking_template() -> str:
    assert GENERATION_PROMPT in QWEN3_TEMPLATE
    return QWEN3_TEMPLATE.replace(GENERATION_PROMPT, THINKING_PROMPT)


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StrataDaemon]:
    folder = tmp_path_factory.mktemp("thinker")
    vocab = replace(synth.vocab_for("qwen3moe"), chat_template=thinking_template())
    path = synth.write_model(folder / "tiny-thinker.gguf", synth.PRESETS["tiny-qwen3moe"], vocab,
                             synth.TypePlan(), 0)  # fmt: skip
    d = StrataDaemon(folder, ["--model", str(path), "--device", "cpu"])
    yield d
    d.stop()


@pytest.fixture(scope="module")
def quiet(
    thinker: StrataDaemon, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StrataDaemon]:
    """The same model, with the daemon's defaults: no thinking, the text left as written."""
    (path,) = thinker.tmp.glob("*.gguf")
    d = StrataDaemon(tmp_path_factory.mktemp("quiet"), ["--model", str(path), "--device", "cpu",
                     "--no-enable-thinking", "--reasoning-format", "none"])  # fmt: skip
    yield d
    d.stop()


def _client(d: StrataDaemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0)


def _thought(message: Any) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def _streamed(chunks: Any) -> tuple[str, str, str | None]:
    """(thought, content, finish_reason) as the deltas built them."""
    thought, content, finish = "", "", None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        thought += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    return thought, content, finish


def test_the_thought_is_reasoning_content_whole_and_streamed(thinker: StrataDaemon) -> None:
    client = _client(thinker)
    r = client.chat.completions.create(model="", messages=ASK, **GREEDY)
    message = r.choices[0].message
    thought = _thought(message)
    assert isinstance(thought, str) and thought  # cut off inside the thought: all of it thought
    assert message.content == "" and r.choices[0].finish_reason == "length"
    streamed = _streamed(client.chat.completions.create(model="", messages=ASK, stream=True,
                                                        **GREEDY))  # fmt: skip
    assert streamed == (thought, "", "length")
    # reasoning_format none: the text as the model wrote it, in content
    none = {"reasoning_format": "none"}
    as_written = client.chat.completions.create(model="", messages=ASK, **GREEDY, extra_body=none)
    raw = as_written.choices[0].message
    assert _thought(raw) is None and raw.content and raw.content.strip() == thought
    # deepseek-legacy: both, content with the tag the template opened
    legacy = {"reasoning_format": "deepseek-legacy"}
    both = client.chat.completions.create(model="", messages=ASK, **GREEDY,
                                          extra_body=legacy).choices[0].message  # fmt: skip
    assert _thought(both) == thought and both.content.startswith("<think>")
    # the thought goes back into the history as the template writes it
    history = [*ASK, {"role": "assistant", "content": "Blue.", "reasoning_content": thought},
               {"role": "user", "content": "And at night?"}]  # fmt: skip
    again = client.chat.completions.create(model="", messages=history, **GREEDY)  # type: ignore[arg-type]
    assert _thought(again.choices[0].message)


@pytest.mark.parametrize(
    "off",
    [
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"think": False},
        {"reasoning_effort": "none"},
    ],
)
def test_each_way_of_turning_thinking_off_changes_the_prompt(
    thinker: StrataDaemon, off: dict[str, Any]
) -> None:
    client = _client(thinker)
    on = client.chat.completions.create(model="", messages=ASK, **GREEDY)
    r = client.chat.completions.create(model="", messages=ASK, extra_body=off, **GREEDY)
    assert r.usage is not None and on.usage is not None
    # "<think>\n" became "<think>\n\n</think>\n\n": the template saw the switch
    assert r.usage.prompt_tokens > on.usage.prompt_tokens
    message = r.choices[0].message
    assert _thought(message) is None and message.content


def test_a_grammar_applies_after_the_thought(thinker: StrataDaemon) -> None:
    client = _client(thinker)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "v", "schema": schema}}
    # thinking on: the thought is the model's own (no JSON forced into it)
    r = client.chat.completions.create(model="", messages=ASK, response_format=fmt, **GREEDY)
    assert _thought(r.choices[0].message) and r.choices[0].message.content == ""
    # thinking off: the answer is the object, and only the listed key
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    r = client.chat.completions.create(model="", messages=ASK, response_format=fmt,
                                       extra_body=off, max_tokens=20)  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    assert set(json.loads(r.choices[0].message.content)) == {"ok"}


def test_the_daemons_options_set_the_defaults_a_request_overrides(quiet: StrataDaemon) -> None:
    client = _client(quiet)
    r = client.chat.completions.create(model="", messages=ASK, **GREEDY)
    assert _thought(r.choices[0].message) is None and r.choices[0].message.content
    on = client.chat.completions.create(model="", messages=ASK, extra_body={"think": True},
                                        **GREEDY)  # fmt: skip
    assert on.usage is not None and r.usage is not None
    assert on.usage.prompt_tokens < r.usage.prompt_tokens  # the template opened a thought
    assert _thought(on.choices[0].message) is None  # reasoning_format none: left in content
    both = {"think": True, "reasoning_format": "auto"}
    split = client.chat.completions.create(model="", messages=ASK, **GREEDY, extra_body=both)
    assert _thought(split.choices[0].message) == on.choices[0].message.content.strip()


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"think": "yes"}, "think"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        ({"think": False, "chat_template_kwargs": {"enable_thinking": True}}, "think"),
    ],
)
def test_bad_reasoning_fields_are_a_400_naming_them(
    thinker: StrataDaemon, extra: dict[str, Any], param: str
) -> None:
    body = {"model": "", "messages": ASK, "max_tokens": 2, **extra}
    r = httpx.post(thinker.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_reasoning_fields_on_a_raw_completion_are_a_400(thinker: StrataDaemon) -> None:
    body = {"model": "", "prompt": "The sky", "max_tokens": 2, "think": False}
    r = httpx.post(thinker.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "think"
