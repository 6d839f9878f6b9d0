"""The pure pieces of issue 35's items 1-3: the thought splitter (whole and streamed, at every
cut), the template families, the reasoning fields turned into template variables, schemas closed
as llama.cpp reads them, and the model names. Plain Python: no model."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from strata.daemon.api.api_errors import ApiError
from strata.daemon.api.openai_models import ModelNames
from strata.daemon.api.openai_reasoning import (
    ReasoningDefaults,
    parse_reasoning,
    template_variables,
)
from strata.engine.grammar import GrammarSpec, closed
from strata.engine.reasoning import family_for, split
from strata.engine.vocab import CHATML_TEMPLATE, QWEN3_TEMPLATE

THINK = family_for("{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}")
FORCED = family_for("{{- '<|im_start|>assistant\\n<think>\\n' }}")  # no switch (DeepSeek-R1)


def test_families_come_from_the_template() -> None:
    assert THINK is not None and THINK.switch == "enable_thinking" and THINK.can_turn_off()
    assert FORCED is not None and FORCED.switch is None and not FORCED.can_turn_off()
    assert family_for(CHATML_TEMPLATE) is None and family_for(QWEN3_TEMPLATE) is None
    assert family_for(None) is None
    assert THINK.opened_by("<|im_start|>assistant\n<think>\n")
    assert not THINK.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")


CASES = [
    # (opened, output, thought, answer)
    (True, "a thought \n</think>\n\nthe answer", "a thought", "the answer"),
    (False, "<think>\nhm</think>ok", "hm", "ok"),
    (False, "\n<think>hm\n\n</think>\n\n  ok <think>", "hm", "ok <think>"),
    (False, "plain text", None, "plain text"),
    (False, "  <thi", None, "  <thi"),  # only looked like the tag
    (True, "cut off inside the thought  \n", "cut off inside the thought", ""),
    (True, "</think>at once", None, "at once"),
    (True, "a < b </thin", "a < b </thin", ""),
]


@pytest.mark.parametrize(("opened", "text", "thought", "answer"), CASES)
def test_the_split_is_the_same_whole_and_streamed_at_every_cut(
    opened: bool, text: str, thought: str | None, answer: str
) -> None:
    assert THINK is not None
    assert split(text, THINK.splitter(opened, "auto")) == (thought, answer)
    for cut in range(len(text) + 1):
        s = THINK.splitter(opened, "auto")
        parts = s.feed(text[:cut]) + s.feed(text[cut:]) + s.finish()
        got = "".join(t for k, t in parts if k == "reasoning") or None
        assert (got, "".join(t for k, t in parts if k == "content")) == (thought, answer), cut
    s = THINK.splitter(opened, "auto")
    parts = [p for c in text for p in s.feed(c)] + s.finish()
    assert "".join(t for k, t in parts if k == "reasoning") == (thought or "")


def test_deepseek_legacy_keeps_the_text_in_content_too() -> None:
    assert THINK is not None
    text = "a thought</think>answer"
    thought, content = split(text, THINK.splitter(True, "deepseek-legacy"))
    assert thought == "a thought" and content == "<think>" + text


def _ask(**fields: Any) -> Any:
    names = ("chat_template_kwargs", "reasoning_format", "reasoning_effort", "think")
    return parse_reasoning(SimpleNamespace(**{n: fields.get(n) for n in names}))


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        ({}, {"enable_thinking": True}),
        ({"think": False}, {"enable_thinking": False}),
        ({"reasoning_effort": "none"}, {"enable_thinking": False, "reasoning_effort": "none"}),
        ({"think": "high"}, {"enable_thinking": True, "reasoning_effort": "high"}),
        ({"chat_template_kwargs": {"enable_thinking": False, "x": 1}},
         {"enable_thinking": False, "x": 1}),
    ],
)  # fmt: skip
def test_the_fields_become_template_variables(fields: dict[str, Any], want: dict) -> None:
    assert template_variables(_ask(**fields), THINK, ReasoningDefaults()) == want


def test_the_daemons_default_applies_when_the_request_is_silent() -> None:
    quiet = ReasoningDefaults(enable_thinking=False)
    assert template_variables(_ask(), THINK, quiet) == {"enable_thinking": False}
    assert template_variables(_ask(think=True), THINK, quiet) == {"enable_thinking": True}


@pytest.mark.parametrize(
    ("family", "fields", "param"),
    [
        (None, {"think": True}, "think"),
        (None, {"reasoning_effort": "low"}, "reasoning_effort"),
        (None, {"chat_template_kwargs": {"enable_thinking": True}},
         "chat_template_kwargs.enable_thinking"),
        (FORCED, {"think": False}, "think"),
        (FORCED, {"reasoning_effort": "none"}, "reasoning_effort"),
    ],
)  # fmt: skip
def test_what_a_template_cannot_do_is_refused_naming_the_field(
    family: Any, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(ApiError) as e:
        template_variables(_ask(**fields), family, ReasoningDefaults())
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
        ({"chat_template_kwargs": {"enable_thinking": 0}}, "chat_template_kwargs.enable_thinking"),
        ({"reasoning_format": "deepseek2"}, "reasoning_format"),
        ({"reasoning_effort": 3}, "reasoning_effort"),
        ({"think": 1}, "think"),
        ({"think": "low", "reasoning_effort": "high"}, "think"),
    ],
)
def test_bad_fields_name_themselves(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as e:
        _ask(**fields)
    assert e.value.status == 400 and e.value.param == param


def test_schemas_are_closed_as_llama_cpp_reads_them() -> None:
    item = {"type": "object", "properties": {"id": {"type": "string"}}}
    schema = {
        "type": "object",
        "properties": {"items": {"type": "array", "items": item}, "any": {"type": "object"}},
        "$defs": {"d": {"properties": {"x": {"const": {"properties": 1}}}}},
        "anyOf": [item, {"type": "null"}],
    }
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["items"]["items"]["additionalProperties"] is False
    assert out["anyOf"][0]["additionalProperties"] is False
    assert out["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["any"]  # no properties: any object
    assert out["$defs"]["d"]["properties"]["x"]["const"] == {"properties": 1}  # data untouched
    assert "additionalProperties" not in schema and "additionalProperties" not in item
    # what the schema says stays; allOf members are left open (closing them would clash)
    said = {"properties": {"a": {}}, "additionalProperties": {"type": "integer"}}
    assert closed(said) == said
    both = {"allOf": [item, {"properties": {"n": {}}}]}
    assert closed(both) == both


def test_a_grammar_after_a_thought_is_lazy_on_its_end() -> None:
    lazy = GrammarSpec.json({"type": "object"}).after("</think>")
    assert lazy.kind == "lark" and lazy.trigger == "</think>"
    assert lazy.source.startswith("start: BLANK? after_thought\n")
    calls = GrammarSpec("lark", "start: a\na: %json {}\n", trigger="<tool_call>")
    later = calls.after("</think>")  # a lazy grammar keeps its trigger, looked for after it
    assert (later.source, later.trigger, later.start_after) == (
        calls.source,
        "<tool_call>",
        "</think>",
    )


def test_model_names() -> None:
    names = ModelNames.of("strata-demo", "strata-demo.gguf", ["gpt-4o", "strata-demo"], False)
    assert names.aliases == ("gpt-4o",)
    for ok in ("strata-demo", "strata-demo.gguf", "gpt-4o"):
        names.check(ok)
    with pytest.raises(ApiError) as e:
        names.check("llama")
    assert e.value.status == 404 and "'strata-demo', 'gpt-4o'" in e.value.message
    with pytest.raises(ApiError):
        names.check("")
    ModelNames.of("m", "m.gguf", None, True).check("")  # serve any name
    listing = names.listing(0)["data"]
    assert [m["id"] for m in listing] == ["strata-demo", "gpt-4o"]


def test_a_name_no_model_can_have_is_a_400_even_when_any_name_is_served() -> None:
    from strata.daemon.api.api_errors import ApiError
    from strata.daemon.api.openai_models import ModelNames

    names = ModelNames.of("m", "m.gguf", None, serve_any=True)
    names.check("gpt-4o")  # any name is served
    for bad in ("\x00", "a\nb", "x" * 257):
        with pytest.raises(ApiError) as e:
            names.check(bad)
        assert e.value.status == 400 and e.value.param == "model"


def test_a_library_model_not_loaded_is_named_as_such_when_only_served_names_are_served() -> None:
    from strata.daemon.api.api_errors import ApiError
    from strata.daemon.api.openai_models import ModelNames

    shelf = {"qwen3.6-35b-a3b:ud-q4_k_m"}
    names = ModelNames.of("m", "m.gguf", None, serve_any=False, in_library=shelf.__contains__)
    with pytest.raises(ApiError) as e:
        names.check("qwen3.6-35b-a3b:ud-q4_k_m")
    assert e.value.status == 404 and "in the model library but not loaded" in str(e.value)
    assert "--model qwen3.6-35b-a3b:ud-q4_k_m" in str(e.value)
    with pytest.raises(ApiError) as e:
        names.check("gpt-4o")  # not in the library either: the plain 404
    assert "does not exist" in str(e.value)
    ModelNames.of("m", "m.gguf", None, True, shelf.__contains__).check("gpt-4o")  # any name
