"""Grammars as llama.cpp reads schemas, checked with llguidance's matcher on the tiny byte-level
vocabulary: a schema without ``additionalProperties`` admits no other key, a grammar after an
open thought waits for its end, and a strict function in ``auto`` mode is enforced in the
generic format too (once the model opens its calls' object)."""

from __future__ import annotations

import pytest

from strata.engine import synth
from strata.engine.grammar import Grammars, GrammarSpec
from strata.engine.tokenizer import Tokenizer
from strata.engine.tool_calls import HermesFormat, ToolFormat, ToolSpec

OPEN = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    tok = Tokenizer.from_vocab(synth.vocab_for("qwen3moe"))
    return Grammars(tok, tok.vocab_size)


def matches(grammars: Grammars, spec: GrammarSpec, text: str) -> bool:
    """Whether ``text`` is allowed to the end (the constraint never failed)."""
    c = grammars.compile(spec)
    for token in grammars.ll.tokenize_str(text):
        c.accept(token)
    return c.error is None


def test_a_schema_without_additional_properties_admits_no_other_key(grammars: Grammars) -> None:
    spec = GrammarSpec.json(OPEN)
    assert matches(grammars, spec, '{"a": 1}')
    assert not matches(grammars, spec, '{"a": 1, "b": 2}')
    loose = GrammarSpec.json({**OPEN, "additionalProperties": True})
    assert matches(grammars, loose, '{"a": 1, "b": 2}')
    # the same inside a call's arguments
    call = HermesFormat().grammar([ToolSpec("f", OPEN)], False, '"<tool_call>"')
    assert matches(
        grammars, call, '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    )
    assert not matches(grammars, call, '<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": 0}}')


def test_a_grammar_after_a_thought_starts_at_its_end(grammars: Grammars) -> None:
    spec = GrammarSpec.json(OPEN).after("</think>")
    assert matches(grammars, spec, 'free { text "b" </think>\n\n{"a": 1}')
    assert not matches(grammars, spec, 'free text</think>{"a": 1, "b": 2}')
    assert not matches(grammars, spec, "free text</think>not json")
    # a strict function in auto mode: a marker inside the thought starts nothing
    lazy = HermesFormat().grammar([ToolSpec("f", OPEN, strict=True)], True, '"<tool_call>"', True)
    spec = lazy.after("</think>")
    assert matches(grammars, spec, "<tool_call> is how I call</think>Hello")
    assert matches(grammars, spec, 'hm</think>Hi <tool_call>\n{"name": "f", "arguments": {"a": 1}}')
    assert not matches(grammars, spec, 'hm</think><tool_call>\n{"name": "f", "arguments": {}}')


def test_a_strict_function_in_auto_mode_is_enforced_in_the_generic_format(
    grammars: Grammars,
) -> None:
    spec = ToolFormat().grammar([ToolSpec("f", OPEN, strict=True)], True, "", lazy=True)
    assert matches(grammars, spec, 'Sure: {"tool_calls": [{"name": "f", "arguments": {"a": 1}}]}')
    assert matches(grammars, spec, "no call at all")
    assert not matches(grammars, spec, '{"tool_calls":[{"name": "f", "arguments": {"a": "x"}}]}')
