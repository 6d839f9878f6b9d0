"""The fields of OpenAI's chat and completion requests that the engine cannot honour: each is
refused, naming it and why, unless its value asks for nothing (``n = 1``, an empty
``logit_bias``, a penalty of 0, ...)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from strata.daemon.api.api_errors import unsupported
from strata.daemon.json_types import JSON, JSONObject


def _absent(v: Any) -> bool:
    return v is None


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {}


def _zero(v: Any) -> bool:
    return v is None or (type(v) in (int, float) and v == 0)


def _one(v: Any) -> bool:
    return v is None or (type(v) is int and v == 1)


def _falsy(v: Any) -> bool:
    return v is None or v is False or (type(v) is int and v == 0)


# field -> (does this value ask for nothing the engine lacks?, why it is refused otherwise)
Rule = tuple[Callable[[JSON], bool], str]
_COMMON_RULES: dict[str, Rule] = {
    "n": (_one, "only n = 1 is supported (one choice per request)"),
    "logit_bias": (_empty, "logit_bias is not supported"),
    "frequency_penalty": (
        _zero,
        "OpenAI's additive frequency penalty is not supported; use repeat_penalty "
        "(llama.cpp's multiplicative penalty) or leave it at 0",
    ),
    "presence_penalty": (
        _zero,
        "OpenAI's additive presence penalty is not supported; use repeat_penalty "
        "(llama.cpp's multiplicative penalty) or leave it at 0",
    ),
}
CHAT_RULES: dict[str, Rule] = {
    **_COMMON_RULES,
    "functions": (_empty, "the deprecated functions are not supported; use tools"),
    "function_call": (
        lambda v: v in (None, "none"),
        "the deprecated function_call is not supported; use tool_choice",
    ),
    "audio": (_absent, "audio output is not supported"),
    "modalities": (lambda v: v is None or v == ["text"], "only the text modality is supported"),
    "prediction": (_absent, "predicted outputs are not supported"),
    "web_search_options": (_absent, "web search is not supported"),
}
COMPLETION_RULES: dict[str, Rule] = {
    **_COMMON_RULES,
    "echo": (_falsy, "echo is not supported"),
    "best_of": (_one, "only best_of = 1 is supported"),
    "suffix": (lambda v: v is None or v == "", "suffix (insertion) is not supported"),
    # a raw prompt goes through no chat template: nothing could think or be steered
    **{
        name: (
            _absent,
            f"{name} applies to chat completions only (a raw prompt has no chat template)",
        )
        for name in ("chat_template_kwargs", "reasoning_format", "reasoning_effort", "think")
    },
}


def refuse_unsupported(raw: JSONObject, rules: dict[str, Rule]) -> None:
    for name, (harmless, why) in rules.items():
        if name in raw and not harmless(raw[name]):
            raise unsupported(name, f"{why} (got {json.dumps(raw[name])[:80]})")
