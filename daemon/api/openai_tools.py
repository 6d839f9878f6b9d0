"""OpenAI's tools, structured output and log-probabilities: the request fields parsed and
checked (every error names the field), the plan they make for one generation, and the response
pieces they add (``tool_calls``, ``logprobs``).

The plan (:func:`plan_output`): which tool-call format the model's template implies
(``engine.tool_calls``), what the template is given (the tools, or for a template that knows none
the generic system message), and which grammar, if any, constrains the output —
``response_format`` json_object/json_schema, ``tool_choice`` required or a named function (the
whole reply is calls), or ``auto`` with ``strict`` functions (a lazy grammar from the call marker
on). ``tool_choice`` ``none`` renders no tools and parses no calls.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from strata.daemon.api.api_errors import invalid, unsupported, wrong_type
from strata.daemon.json_types import JSON, JSONObject
from strata.engine.grammar import GrammarError, GrammarSpec, lark_string
from strata.engine.params import MAX_TOP_LOGPROBS
from strata.engine.tool_calls import ToolCall, ToolFormat, ToolSpec, format_for, generic_messages

if TYPE_CHECKING:
    from strata.engine.generate import Engine
    from strata.engine.generation import TokenLogprob
    from strata.engine.grammar import Constraint, Grammars
    from strata.engine.tokenizer import Tokenizer

FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
MAX_TOOLS = 128  # OpenAI's limit


# -- tools ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["auto", "none", "required", "function"]
    name: str | None = None


def parse_tools(raw: JSON) -> tuple[ToolSpec, ...]:
    """``tools``: a list of ``{"type": "function", "function": {"name", "description",
    "parameters", "strict"}}``."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise wrong_type("tools", "a list of tools", raw)
    if len(raw) > MAX_TOOLS:
        raise invalid(f"tools: {len(raw)} tools, at most {MAX_TOOLS} are allowed", "tools")
    out: list[ToolSpec] = []
    seen: set[str] = set()
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise wrong_type(where, 'a tool like {"type": "function", "function": {...}}', tool)
        kind = tool.get("type")
        if kind != "function":
            if kind is None:
                raise invalid(f"{where}.type: missing required field", f"{where}.type")
            raise unsupported(
                f"{where}.type", f"only tools of type 'function' are supported (got {kind!r})"
            )
        fn = tool.get("function")
        if fn is None:
            raise invalid(f"{where}.function: missing required field", f"{where}.function")
        if not isinstance(fn, dict):
            raise wrong_type(f"{where}.function", "an object", fn)
        spec = _function(fn, f"{where}.function")
        if spec.name in seen:
            raise invalid(
                f"{where}.function.name: {spec.name!r} is defined twice", f"{where}.function.name"
            )
        seen.add(spec.name)
        out.append(spec)
    return tuple(out)


def _function(fn: dict[str, Any], where: str) -> ToolSpec:
    name = fn.get("name")
    if name is None:
        raise invalid(f"{where}.name: missing required field", f"{where}.name")
    if not isinstance(name, str):
        raise wrong_type(f"{where}.name", "a string", name)
    if not FUNCTION_NAME.match(name):
        raise invalid(
            f"{where}.name: {name[:80]!r} is not a valid function name (1-64 letters, digits, "
            "_ and -)",
            f"{where}.name",
            "invalid_value",
        )
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise wrong_type(f"{where}.description", "a string", description)
    parameters = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise wrong_type(f"{where}.parameters", "a JSON Schema object", parameters)
    if parameters.get("type", "object") != "object":
        raise invalid(
            f"{where}.parameters: a function's parameters are an object schema "
            f'("type": "object"), not {json.dumps(parameters.get("type"))}',
            f"{where}.parameters",
            "invalid_value",
        )
    strict = fn.get("strict", False)
    if strict is None:
        strict = False
    if not isinstance(strict, bool):
        raise wrong_type(f"{where}.strict", "a boolean", strict)
    return ToolSpec(name, parameters, description, strict)


def parse_tool_choice(raw: JSON, tools: Sequence[ToolSpec]) -> ToolChoice:
    """``tool_choice``: "auto" (the default with tools), "none", "required", or
    ``{"type": "function", "function": {"name": ...}}``."""
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise invalid(
                f"tool_choice: {raw[:40]!r} is not one of 'auto', 'none', 'required' or a function",
                "tool_choice",
                "invalid_value",
            )
        if raw != "none" and not tools:
            raise invalid(f"tool_choice: {raw!r} needs tools", "tool_choice")
        return ToolChoice(raw)  # type: ignore[arg-type]
    if not isinstance(raw, dict):
        raise wrong_type("tool_choice", 'a string or {"type": "function", ...}', raw)
    if raw.get("type") != "function":
        raise invalid(
            "tool_choice.type: only 'function' can be named", "tool_choice.type", "invalid_value"
        )
    fn = raw.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise invalid(
            "tool_choice.function.name: missing required field", "tool_choice.function.name"
        )
    name = fn["name"]
    if name not in {t.name for t in tools}:
        raise invalid(
            f"tool_choice.function.name: {name[:80]!r} is not one of the tools",
            "tool_choice.function.name",
            "invalid_value",
        )
    return ToolChoice("function", name)


def assistant_tool_calls(raw: JSON, where: str) -> list[JSONObject]:
    """An assistant message's ``tool_calls`` as the templates take them: the arguments parsed
    into an object (as llama.cpp passes them; templates that want the text get it back with
    ``tojson``)."""
    if not isinstance(raw, list):
        raise wrong_type(where, "a list of tool calls", raw)
    out = []
    for j, call in enumerate(raw):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise wrong_type(at, "a tool call object", call)
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise invalid(f"{at}.id: missing required field", f"{at}.id")
        if call.get("type", "function") != "function":
            raise invalid(f"{at}.type: only 'function' calls are supported", f"{at}.type")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise invalid(f"{at}.function: missing required field", f"{at}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise invalid(f"{at}.function.name: missing required field", f"{at}.function.name")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as e:
                raise invalid(
                    f"{at}.function.arguments: not valid JSON ({e})", f"{at}.function.arguments"
                ) from None
        if not isinstance(args, dict):
            raise wrong_type(f"{at}.function.arguments", "a JSON object (as text)", args)
        out.append({"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": args}})  # fmt: skip
    return out


# -- structured output ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ResponseFormat:
    kind: Literal["json_object", "json_schema"]
    schema: JSONObject | None = None
    name: str | None = None
    strict: bool = False


def parse_response_format(raw: JSON) -> ResponseFormat | None:
    """``{"type": "text"}`` (None), ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}``."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise wrong_type("response_format", 'an object like {"type": "json_object"}', raw)
    kind = raw.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind != "json_schema":
        if kind is None:
            raise invalid("response_format.type: missing required field", "response_format.type")
        raise invalid(
            f"response_format.type: {str(kind)[:40]!r} is not one of 'text', 'json_object', "
            "'json_schema'",
            "response_format.type",
            "invalid_value",
        )
    spec = raw.get("json_schema")
    where = "response_format.json_schema"
    if spec is None:
        raise invalid(f"{where}: missing required field", where)
    if not isinstance(spec, dict):
        raise wrong_type(where, "an object", spec)
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise wrong_type(f"{where}.name", "a string", name)
    strict = spec.get("strict", False)
    if strict is not None and not isinstance(strict, bool):
        raise wrong_type(f"{where}.strict", "a boolean", strict)
    schema = spec.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise wrong_type(f"{where}.schema", "a JSON Schema object", schema)
    return ResponseFormat("json_schema", schema, name, bool(strict))


# -- log-probabilities -----------------------------------------------------------------------------


def parse_chat_logprobs(logprobs: JSON, top: JSON) -> int | None:
    """Chat: ``logprobs`` (a boolean) and ``top_logprobs`` (0-20, needs ``logprobs``)."""
    if logprobs is not None and not isinstance(logprobs, bool):
        raise wrong_type("logprobs", "a boolean", logprobs)
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int):
            raise wrong_type("top_logprobs", "an integer", top)
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise invalid(
                f"top_logprobs: invalid value {top} (expected an integer in [0, "
                f"{MAX_TOP_LOGPROBS}])",
                "top_logprobs",
                "invalid_value",
            )
        if not logprobs:
            raise invalid("top_logprobs: needs logprobs set to true", "top_logprobs")
    return (top or 0) if logprobs else None


def parse_completion_logprobs(value: JSON) -> int | None:
    """Completions: ``logprobs`` is the number of alternatives (0-20; OpenAI stops at 5)."""
    if value is None or value is False:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise wrong_type("logprobs", "an integer", value)
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise invalid(
            f"logprobs: invalid value {value} (expected an integer in [0, {MAX_TOP_LOGPROBS}])",
            "logprobs",
            "invalid_value",
        )
    return value


def token_chars(entries: Sequence[TokenLogprob], tokenizer: Tokenizer) -> int:
    """The characters of these tokens' texts (what ``text_offset`` advances by)."""
    return sum(len(_token_text(tokenizer, e.token)[0]) for e in entries)


def _token_text(tokenizer: Tokenizer, tid: int) -> tuple[str, list[int]]:
    raw = tokenizer.token_bytes(tid)
    return raw.decode("utf-8", "replace"), list(raw)


def chat_logprobs(entries: Sequence[TokenLogprob], tokenizer: Tokenizer) -> JSONObject:
    """``choices[].logprobs`` of a chat completion (or of one chunk)."""
    content = []
    for e in entries:
        text, raw = _token_text(tokenizer, e.token)
        top = []
        for tid, lp in e.top:
            t, b = _token_text(tokenizer, tid)
            top.append({"token": t, "logprob": lp, "bytes": b})
        content.append({"token": text, "logprob": e.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(
    entries: Sequence[TokenLogprob], tokenizer: Tokenizer, offset: int = 0
) -> JSONObject:
    """``choices[].logprobs`` of a (legacy) completion; ``offset``: the characters of the tokens
    before these (``text_offset`` counts each token's text from the completion's start)."""
    tokens, lps, tops, offsets = [], [], [], []
    at = offset
    for e in entries:
        text, _ = _token_text(tokenizer, e.token)
        tokens.append(text)
        lps.append(e.logprob)
        tops.append({_token_text(tokenizer, tid)[0]: lp for tid, lp in e.top})
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def tool_calls_json(calls: Sequence[ToolCall]) -> list[JSONObject]:
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]  # fmt: skip


# -- the plan -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolContext:
    """What reading the reply needs: the format, the tools it may call, and whether a grammar
    wrote the calls (then their pieces stream as they come)."""

    format: ToolFormat
    tools: tuple[ToolSpec, ...]
    parallel: bool
    guaranteed: bool


@dataclass(frozen=True)
class OutputPlan:
    messages: list[JSONObject]  # what the template gets
    template_tools: list[JSONObject] | None  # the tools it gets (None: none)
    constraint: Constraint | None  # set by compile_output
    tools: ToolContext | None  # None: no calls are parsed
    show_special: frozenset[int]
    spec: GrammarSpec | None = None  # the grammar, before compile_output
    spec_param: str = "tools"  # the field an error in it names


def compile_output(grammars: Grammars, plan: OutputPlan, after: str | None = None) -> OutputPlan:
    """The plan with its grammar compiled. ``after``: the prompt left a thought open that this
    text closes; the grammar applies from there on (the thought is the model's own), and calls
    then stream once complete (nothing guarantees them before)."""
    spec = plan.spec
    if spec is None:
        return plan
    if after is not None:
        spec = spec.after(after)
    tools = plan.tools
    if tools is not None and spec.trigger is not None:
        tools = replace(tools, guaranteed=False)
    return replace(plan, constraint=_compile(grammars, spec, plan.spec_param), tools=tools)


def plan_output(
    engine: Engine,
    messages: list[JSONObject],
    tools: tuple[ToolSpec, ...],
    choice: ToolChoice,
    parallel: bool,
    response_format: ResponseFormat | None,
) -> OutputPlan:
    """The template's inputs, the grammar and the reply's reader for one request; raises
    :class:`ApiError` naming the field whose schema cannot be used."""
    grammars = engine.grammars
    use_tools = bool(tools) and choice.mode != "none"
    if use_tools and response_format is not None:
        raise unsupported(
            "response_format",
            "a JSON response_format together with tools is not supported: use tool_choice "
            "'none', or a tool whose parameters are the schema",
        )
    if not use_tools:
        # earlier calls and results in the history still need a template that can write them
        rendered = messages
        if _has_tool_turns(messages) and not engine.template_renders_tools:
            rendered = generic_messages(messages, ())
        spec = _format_spec(response_format) if response_format is not None else None
        return OutputPlan(rendered, None, None, None, frozenset(), spec,
                          "response_format.json_schema.schema")  # fmt: skip
    fmt = format_for(engine.template.source if engine.template else None,
                     engine.template_renders_tools)  # fmt: skip
    for i, t in enumerate(tools):  # a broken schema is refused even where nothing enforces it
        enforced = choice.mode != "auto" or t.strict
        try:
            grammars.check_schema(t.parameters, enforced)
        except GrammarError as e:
            where = f"tools[{i}].function.parameters"
            raise invalid(f"{where}: {e}", where, "invalid_schema") from None
    if fmt.marker is None:
        rendered, template_tools = generic_messages(messages, tools), None
    else:
        rendered, template_tools = messages, [t.openai() for t in tools]
    marker, show = "", frozenset[int]()
    if fmt.marker is not None:  # a special token is named by id and kept in the text
        special = grammars.special_token(fmt.marker)
        marker = special or lark_string(fmt.marker)
        if special is not None:
            show = frozenset({int(special[2:-2])})
    spec: GrammarSpec | None = None
    if choice.mode == "required":
        spec = fmt.grammar(tools, parallel, marker)
    elif choice.mode == "function":
        spec = fmt.grammar([t for t in tools if t.name == choice.name], parallel, marker)
    elif any(t.strict for t in tools):
        # auto with strict functions: free text until the model writes the marker (the generic
        # format: opens its calls' object), then a call (the arguments of a strict function as
        # its schema says, of another any object)
        loose = [t if t.strict else replace(t, parameters={"type": "object"}) for t in tools]
        spec = fmt.grammar(loose, parallel, marker, lazy=True)
    guaranteed = spec is not None and spec.trigger is None
    return OutputPlan(rendered, template_tools, None,
                      ToolContext(fmt, tools, parallel, guaranteed), show, spec)  # fmt: skip


def _has_tool_turns(messages: Sequence[dict[str, Any]]) -> bool:
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def _format_spec(rf: ResponseFormat) -> GrammarSpec:
    if rf.kind == "json_object" or rf.schema is None:
        return GrammarSpec.json({"type": "object"})
    return GrammarSpec.json(rf.schema)


def _compile(grammars: Grammars, spec: GrammarSpec, param: str) -> Constraint:
    try:
        return grammars.compile(spec)
    except GrammarError as e:
        raise invalid(f"{param}: {e}", param, "invalid_schema") from None
