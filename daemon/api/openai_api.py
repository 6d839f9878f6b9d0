"""The OpenAI request and response shapes: parsing, validation, the bodies and SSE chunks we send.

Plain data in, plain data out: no HTTP framework, no queue. A request that cannot be served as
asked is an :class:`ApiError` naming the field; fields the engine cannot honour yet are refused
(never ignored), unknown extra fields are ignored. Tools, ``response_format`` and log-probabilities
have their own module, ``openai_tools``.

Sampling defaults are the engine's (``SamplingParams``), not OpenAI's: a field left out means
"the daemon's default". ``max_tokens`` left out means the rest of the context window for chat and
16 for completions, as OpenAI does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from strata.daemon.api.api_errors import (  # ApiError and error_body: imported from here too
    ApiError,  # noqa: F401
    error_body,  # noqa: F401
    invalid,
    json_type,
    unsupported,
    wrong_type,
)
from strata.daemon.api.openai_messages import check_text as _check_text
from strata.daemon.api.openai_messages import parse_messages as _messages
from strata.daemon.api.openai_models import model_not_found  # noqa: F401 (imported from here too)
from strata.daemon.api.openai_reasoning import (
    ReasoningAsk,
    ReasoningDefaults,
    ReasoningPlan,
    parse_reasoning,
    plan_reasoning,
    template_variables,
)
from strata.daemon.api.openai_refused import CHAT_RULES, COMPLETION_RULES, refuse_unsupported
from strata.daemon.api.openai_reply import (  # the reply's pieces: imported from here too
    SSE_DONE,  # noqa: F401
    Reply,  # noqa: F401
    logprobs_json,  # noqa: F401
    retry_after_s,  # noqa: F401
    sse,  # noqa: F401
    usage,  # noqa: F401
)
from strata.daemon.api.openai_tools import (
    OutputPlan,
    ResponseFormat,
    ToolChoice,
    ToolContext,
    compile_output,
    parse_chat_logprobs,
    parse_completion_logprobs,
    parse_response_format,
    parse_tool_choice,
    parse_tools,
    plan_output,
)
from strata.daemon.json_types import JSONObject
from strata.engine.errors import ContextOverflow, EngineError, TokenizerError
from strata.engine.params import SamplingParams
from strata.engine.reasoning import family_for
from strata.engine.tool_calls import ToolSpec

if TYPE_CHECKING:
    from strata.engine.generate import Engine
    from strata.engine.grammar import Constraint

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


# -- request models -----------------------------------------------------------------------------


class _Strict(BaseModel):
    # strict: "0.5" is not a number and true is not 1; ints are accepted where floats are
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    response_format: Any = None  # checked by openai_tools (the errors name the inner fields)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # llama.cpp extension
    min_p: float | None = None  # llama.cpp extension
    repeat_penalty: float | None = None  # llama.cpp extension
    repeat_last_n: int | None = None  # llama.cpp extension
    ignore_eos: bool | None = None  # llama.cpp extension: never end at an end-of-generation token
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None


class ChatRequest(_Sampling):
    messages: list[Any]
    max_completion_tokens: int | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    logprobs: Any = None
    top_logprobs: Any = None
    # reasoning (checked by _reasoning_fields: the errors name the inner fields)
    chat_template_kwargs: Any = None
    reasoning_format: Any = None
    reasoning_effort: Any = None
    think: Any = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Any = None


_EXPECTED = {
    "stop": "a string or a list of strings",
    "prompt": "a string, a list of token ids, or a list holding one of those",
    "messages": "a list of messages",
    "stream_options": 'an object like {"include_usage": true}',
}


NO_TOOLS = ToolChoice("none")


@dataclass(frozen=True)
class Parsed:
    """A validated request: what to encode and how to sample, before the prompt is tokenised."""

    kind: Literal["chat", "completion"]
    model: str
    stream: bool
    include_usage: bool
    messages: list[JSONObject] = field(default_factory=list)  # chat
    text: str | None = None  # a completion prompt as text
    token_ids: list[int] | None = None  # a completion prompt as token ids
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"
    sampling: JSONObject = field(default_factory=dict)  # SamplingParams fields the client set
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = NO_TOOLS
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    reasoning: ReasoningAsk = field(default_factory=lambda: ReasoningAsk())


DEFAULT_MAX_STOP = 4  # OpenAI's limit (the option max_stop_sequences)


def parse_chat(body: bytes, max_stop: int = DEFAULT_MAX_STOP) -> Parsed:
    return chat_from(json_object(body), max_stop)


def chat_from(raw: JSONObject, max_stop: int = DEFAULT_MAX_STOP) -> Parsed:
    """A chat request from its JSON object (the other APIs build one and come through here)."""
    refuse_unsupported(raw, CHAT_RULES)
    req = _validate(ChatRequest, raw)
    messages = _messages(req.messages)
    tools = parse_tools(req.tools)
    sampling = _sampling_fields(req, max_stop)
    logprobs = parse_chat_logprobs(req.logprobs, req.top_logprobs)
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    max_tokens, which = req.max_tokens, "max_tokens"
    if req.max_completion_tokens is not None:
        if max_tokens is not None and max_tokens != req.max_completion_tokens:
            raise invalid(
                f"max_tokens ({max_tokens}) and max_completion_tokens "
                f"({req.max_completion_tokens}) disagree; give one of them",
                "max_tokens",
            )
        max_tokens, which = req.max_completion_tokens, "max_completion_tokens"
    return Parsed(
        "chat",
        req.model,
        bool(req.stream),
        _include_usage(req),
        messages=messages,
        max_tokens=max_tokens,
        max_tokens_param=which,
        sampling=sampling,
        tools=tools,
        tool_choice=parse_tool_choice(req.tool_choice, tools),
        parallel_tool_calls=req.parallel_tool_calls is not False,
        response_format=parse_response_format(req.response_format),
        reasoning=parse_reasoning(req),
    )


def parse_completion(body: bytes, max_stop: int = DEFAULT_MAX_STOP) -> Parsed:
    return completion_from(json_object(body), max_stop)


def completion_from(raw: JSONObject, max_stop: int = DEFAULT_MAX_STOP) -> Parsed:
    """A completion request from its JSON object."""
    refuse_unsupported(raw, COMPLETION_RULES)
    req = _validate(CompletionRequest, raw)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise unsupported("prompt", f"{len(prompt)} prompts in one request are not supported")
        prompt = prompt[0]
    text, ids = (prompt, None) if isinstance(prompt, str) else (None, list(prompt))
    if ids is not None and not ids:
        raise invalid("prompt: the prompt is empty", "prompt")
    if text is not None:
        _check_text(text, "prompt")
    sampling = _sampling_fields(req, max_stop)
    logprobs = parse_completion_logprobs(req.logprobs)
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    return Parsed(
        "completion",
        req.model,
        bool(req.stream),
        _include_usage(req),
        text=text,
        token_ids=ids,
        max_tokens=req.max_tokens,
        sampling=sampling,
        response_format=parse_response_format(req.response_format),
    )


def json_object(body: bytes) -> JSONObject:
    """A request body that must be a JSON object (every API's), or a 400 saying why not."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"the request body is not valid UTF-8 (byte {e.start})", None) from None
    try:
        raw = json.loads(text, parse_constant=_no_constant)
    except ValueError as e:
        raise invalid(f"the request body is not valid JSON: {e}", None) from None
    except RecursionError:
        raise invalid("the request body is not valid JSON: nested too deeply", None) from None
    if not isinstance(raw, dict):
        raise invalid(f"the request body must be a JSON object, not {json_type(raw)}", None)
    return raw


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _validate(model: type[_Sampling], raw: dict[str, Any]) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        loc = [p for p in first["loc"] if isinstance(p, int) or p in _field_names(model)]
        param = _param(loc)
        top = str(first["loc"][0]) if first["loc"] else ""
        if first["type"] == "missing":
            raise invalid(f"{param}: missing required field", param) from None
        expected = (
            _EXPECTED.get(param)
            or (_EXPECTED.get(top) if top in ("stop", "prompt") else None)
            or first["msg"].removeprefix("Input should be ")
        )
        raise wrong_type(param, expected, first.get("input")) from None


def _field_names(model: type[BaseModel]) -> set[str]:
    names = set(model.model_fields)
    names.update(StreamOptions.model_fields)
    return names


def _param(loc: Sequence[Any]) -> str:
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "body"


def _include_usage(req: _Sampling) -> bool:
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options: only allowed when stream is true", "stream_options")
    return bool(req.stream_options and req.stream_options.include_usage)


_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "repeat_last_n",
                    "seed", "ignore_eos")  # fmt: skip


MAX_STOP_CHARS = 256  # longest stop string: the matcher's work per token grows with it


def _sampling_fields(req: _Sampling, max_stop: int) -> dict[str, Any]:
    out = {name: getattr(req, name) for name in _SAMPLING_FIELDS if getattr(req, name) is not None}
    if req.stop is not None:
        out["stop"] = _stops(req.stop, max_stop)
    return out


def _stops(stop: str | list[str], max_stop: int) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > max_stop:
        raise invalid(
            f"stop: {len(stops)} stop sequences, at most {max_stop} are allowed "
            "(max_stop_sequences)",
            "stop",
        )
    for i, s in enumerate(stops):
        where = "stop" if isinstance(stop, str) else f"stop[{i}]"
        if len(s) > MAX_STOP_CHARS:
            raise invalid(
                f"{where}: a stop sequence of {len(s)} characters, at most {MAX_STOP_CHARS} "
                "are allowed",
                where,
            )
        _check_text(s, where)
    return stops


# -- from a parsed request to the engine's inputs ------------------------------------------------


@dataclass(frozen=True)
class Prepared:
    """A request ready for the engine: the prompt, the sampling, the grammar that constrains the
    output (None: none), how to read calls out of the reply (None: no tools), the special
    tokens the output keeps as text (a call marker, a thought's tags), and how the reply's
    thought is split from its answer (None: it is not)."""

    prompt: list[int]
    params: SamplingParams
    constraint: Constraint | None = None
    tools: ToolContext | None = None
    show_special: frozenset[int] = frozenset()
    reasoning: ReasoningPlan | None = None


def prepare(req: Parsed, engine: Engine, defaults: ReasoningDefaults | None = None) -> Prepared:
    """Token ids, sampling parameters and the output's plan; may take a while for a long prompt
    or a large schema (run it off the loop). ``defaults``: the daemon's reasoning options.
    Raises :class:`ApiError` naming the field."""
    defaults = defaults or ReasoningDefaults()
    plan = OutputPlan(req.messages, None, None, None, frozenset())
    reasoning: ReasoningPlan | None = None
    if req.kind == "chat":
        plan = plan_output(engine, req.messages, req.tools, req.tool_choice,
                           req.parallel_tool_calls, req.response_format)  # fmt: skip
        prompt, reasoning = _chat_ids(req.reasoning, engine, plan, defaults)
    else:
        if req.response_format is not None:
            plan = plan_output(engine, [], (), req.tool_choice, True, req.response_format)
        prompt = _prompt_ids(req, engine)
    if plan.spec is not None:  # after an open thought, the grammar waits for its end
        opened = reasoning is not None and reasoning.opened
        plan = compile_output(engine.grammars, plan, reasoning.family.close if opened else None)
    show = plan.show_special
    if reasoning is not None:  # a tag that is a special token must still reach the splitter
        show |= _special_ids(engine, (reasoning.family.open, reasoning.family.close))
    where = "messages" if req.kind == "chat" else "prompt"
    if not prompt:
        raise invalid(f"{where}: the prompt is empty", where)
    max_tokens = req.max_tokens
    if max_tokens is None:
        room = engine.n_ctx - len(prompt)
        if room <= 0:
            raise invalid(
                f"{where}: the prompt of {len(prompt)} tokens leaves no room in the context "
                f"length of {engine.n_ctx} tokens",
                where,
                "context_length_exceeded",
            )
        max_tokens = room if req.kind == "chat" else min(room, COMPLETIONS_DEFAULT_MAX_TOKENS)
        try:  # the prompt's K/V must fit the VRAM budget too (tokens beyond it end as "length")
            engine.check_fits(len(prompt), 1)
        except ContextOverflow as e:
            raise invalid(str(e), where, "context_length_exceeded") from None
    elif max_tokens <= 0:
        raise invalid(
            f"{req.max_tokens_param}: invalid value {max_tokens} (expected an integer >= 1)",
            req.max_tokens_param,
            "invalid_value",
        )
    else:
        try:
            engine.check_fits(len(prompt), max_tokens)
        except ContextOverflow as e:
            raise invalid(str(e), req.max_tokens_param, "context_length_exceeded") from None
    try:
        params = SamplingParams(max_tokens=max_tokens, **req.sampling)
    except ValueError as e:
        name = str(e).partition(":")[0]
        param = req.max_tokens_param if name == "max_tokens" else name
        raise invalid(str(e).replace(name, param, 1), param, "invalid_value") from None
    return Prepared(prompt, params, plan.constraint, plan.tools, show, reasoning)


def _chat_ids(
    ask: ReasoningAsk, engine: Any, plan: OutputPlan, defaults: ReasoningDefaults
) -> tuple[list[int], ReasoningPlan | None]:
    text = _render(ask, engine, plan, defaults)
    family = family_for(engine.template.source if engine.template is not None else None)
    # The template writes BOS itself where the model wants one; encode never doubles it.
    return engine.tokenizer.encode(text), plan_reasoning(ask, family, text, defaults)


def chat_prompt_text(req: Parsed, engine: Engine, defaults: ReasoningDefaults | None = None) -> str:
    """A chat request's prompt as the template writes it, without generating (llama-server's
    ``/apply-template``, the token counts of Anthropic's ``count_tokens``)."""
    plan = plan_output(engine, req.messages, req.tools, req.tool_choice,
                       req.parallel_tool_calls, req.response_format)  # fmt: skip
    return _render(req.reasoning, engine, plan, defaults or ReasoningDefaults())


def _render(ask: ReasoningAsk, engine: Any, plan: OutputPlan, defaults: ReasoningDefaults) -> str:
    template = engine.template
    family = family_for(template.source if template is not None else None)
    variables = template_variables(ask, family, defaults)
    try:
        return str(engine.render_chat(plan.messages, plan.template_tools, variables))
    except EngineError as e:  # the template refused the messages, or the file has none
        raise invalid(f"messages: {e}", "messages") from None


def _special_ids(engine: Any, texts: Sequence[str]) -> frozenset[int]:
    tok = engine.tokenizer
    ids = (tok.token_id(t) for t in texts)
    return frozenset(i for i in ids if i is not None and tok.is_special(i))


def _prompt_ids(req: Parsed, engine: Any) -> list[int]:
    if req.token_ids is not None:
        size = engine.tokenizer.vocab_size
        for i, t in enumerate(req.token_ids):
            if not 0 <= t < size:
                raise invalid(
                    f"prompt[{i}]: token id {t} is outside the {size}-token vocabulary",
                    "prompt",
                    "invalid_value",
                )
        return list(req.token_ids)
    assert req.text is not None
    try:
        return engine.encode_prompt(req.text)
    except TokenizerError as e:
        raise invalid(f"prompt: {e}", "prompt") from None
