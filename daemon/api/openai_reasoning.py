"""Reasoning over the OpenAI API: the request fields that steer thinking, checked (every error
names the field), and what they make of one request — the chat template's extra variables and
how the reply is split (``engine.reasoning``).

The fields, as llama-server and Ollama take them:

- ``chat_template_kwargs``: an object whose members become variables of the chat template
  (``{"enable_thinking": false}`` for Qwen3);
- ``reasoning_format``: ``none`` (the text as the model wrote it, in ``content``), ``deepseek``
  or ``auto`` (the thought in ``reasoning_content``), ``deepseek-legacy`` (both);
- ``reasoning_effort`` (OpenAI's): passed to the template as ``reasoning_effort`` (gpt-oss reads
  it); ``none`` turns thinking off where the template has a switch;
- ``think`` (Ollama's): true or false (the template's switch), or an effort.

A field that asks for something the model's template cannot do (``think: true`` where the
template does not think, thinking off where it has no switch) is a 400 naming it, never a
silent no-op. The daemon's options give the defaults (``reasoning_format``, ``enable_thinking``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from strata.daemon.api.api_errors import invalid, unsupported, wrong_type
from strata.daemon.json_types import JSONObject
from strata.engine.reasoning import (
    EFFORTS,
    REASONING_FORMATS,
    ReasoningFamily,
    ReasoningFormat,
    ReasoningSplitter,
)

if TYPE_CHECKING:
    from strata.daemon.api.openai_api import ChatRequest

# variables the daemon itself gives the template: a request cannot replace them
_RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")
MAX_KWARGS_CHARS = 16_384  # of chat_template_kwargs as JSON: a template's switches, not a payload


@dataclass(frozen=True)
class ReasoningAsk:
    """What one request asked for (None: the field was absent)."""

    template_kwargs: JSONObject = field(default_factory=dict)
    format: ReasoningFormat | None = None
    effort: str | None = None
    think: bool | None = None


@dataclass(frozen=True)
class ReasoningDefaults:
    """The daemon's options: how a reply is split, and whether a template with a switch thinks
    when the request does not say."""

    format: ReasoningFormat = "auto"
    enable_thinking: bool = True


@dataclass(frozen=True)
class ReasoningPlan:
    """How one reply is read: the family's tags, and whether the prompt left a thought open."""

    family: ReasoningFamily
    opened: bool
    format: ReasoningFormat

    def splitter(self) -> ReasoningSplitter:
        return self.family.splitter(self.opened, self.format)  # harmony: HarmonySplitter


def parse_reasoning(req: ChatRequest) -> ReasoningAsk:
    """The reasoning fields of a chat request (``req``: its validated model)."""
    kwargs = req.chat_template_kwargs
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise wrong_type("chat_template_kwargs", "an object", kwargs)
    for name in _RESERVED:
        if name in kwargs:
            raise invalid(
                f"chat_template_kwargs.{name}: the daemon gives the template {name!r} itself",
                f"chat_template_kwargs.{name}",
            )
    try:
        size = len(json.dumps(kwargs, ensure_ascii=False))
    except RecursionError:
        raise invalid("chat_template_kwargs: nested too deeply", "chat_template_kwargs") from None
    if size > MAX_KWARGS_CHARS:
        raise invalid(f"chat_template_kwargs: more than {MAX_KWARGS_CHARS} characters as JSON",
                      "chat_template_kwargs")  # fmt: skip
    switch = kwargs.get("enable_thinking")
    if switch is not None and not isinstance(switch, bool):
        # llama-server refuses a string too: "false" would be true in the template
        raise wrong_type("chat_template_kwargs.enable_thinking", "a boolean", switch)
    fmt = req.reasoning_format
    if fmt is not None and fmt not in REASONING_FORMATS:
        if not isinstance(fmt, str):
            raise wrong_type("reasoning_format", "a string", fmt)
        raise invalid(
            f"reasoning_format: {fmt[:40]!r} is not one of {', '.join(REASONING_FORMATS)}",
            "reasoning_format",
            "invalid_value",
        )
    effort = _effort(req.reasoning_effort, "reasoning_effort")
    think = req.think
    if think is not None and not isinstance(think, bool):
        if not isinstance(think, str):
            raise wrong_type("think", "a boolean or an effort (low, medium, high)", think)
        if effort is not None and effort != think:
            raise invalid(f"think ({think!r}) and reasoning_effort ({effort!r}) disagree",
                          "think")  # fmt: skip
        effort, think = _effort(think, "think"), None
    if think is not None and switch is not None and think != switch:
        raise invalid(
            f"think ({json.dumps(think)}) and chat_template_kwargs.enable_thinking "
            f"({json.dumps(switch)}) disagree; give one of them",
            "think",
        )
    return ReasoningAsk(dict(kwargs), fmt, effort, think)


def _effort(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise wrong_type(where, "a string", value)
    if value not in EFFORTS:
        raise invalid(f"{where}: {value[:40]!r} is not one of {', '.join(EFFORTS)}", where,
                      "invalid_value")  # fmt: skip
    return value


def template_variables(
    ask: ReasoningAsk, family: ReasoningFamily | None, defaults: ReasoningDefaults
) -> JSONObject:
    """The template's extra variables for this request; a request the template cannot honour
    is an :class:`ApiError` naming the field."""
    out = dict(ask.template_kwargs)
    on, field_name = _asked(ask)  # True/False: the request says (in this field); None: not
    if ask.effort is not None:
        out.setdefault("reasoning_effort", ask.effort)
    if family is None:
        if on:
            raise unsupported(field_name, "this model's chat template does not think (there is "
                              "no reasoning to turn on)")  # fmt: skip
        return out
    if on is False and not family.can_turn_off():
        raise unsupported(field_name, "this model's chat template cannot turn its thinking off "
                          f"({family.why_always_on()})")  # fmt: skip
    if ask.effort is not None and family.efforts is not None and ask.effort not in family.efforts:
        raise invalid(f"reasoning_effort: {ask.effort!r} is not an effort this model knows "
                      f"({', '.join(family.efforts)})", "reasoning_effort",
                      "invalid_value")  # fmt: skip
    if family.switch is not None and family.switch not in out:
        out[family.switch] = defaults.enable_thinking if on is None else on
    return out


def _asked(ask: ReasoningAsk) -> tuple[bool | None, str]:
    if "enable_thinking" in ask.template_kwargs:
        return bool(ask.template_kwargs["enable_thinking"]), "chat_template_kwargs.enable_thinking"
    if ask.think is not None:
        return ask.think, "think"
    if ask.effort is not None:
        return ask.effort != "none", "reasoning_effort"
    return None, ""


def plan_reasoning(
    ask: ReasoningAsk,
    family: ReasoningFamily | None,
    prompt: str,
    defaults: ReasoningDefaults,
) -> ReasoningPlan | None:
    """How the reply is read (None: as the model wrote it, all content)."""
    fmt: ReasoningFormat = ask.format or defaults.format
    if family is None or (fmt == "none" and not family.framed):
        return None  # a framed family's splitter leaves the text as written itself
    return ReasoningPlan(family, family.opened_by(prompt), fmt)
