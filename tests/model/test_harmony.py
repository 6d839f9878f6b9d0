"""Harmony, gpt-oss's format, in the engine: the tokenizer keeps the frame's markers in the
text, gpt-oss's own chat template renders (tools, ``reasoning_effort``, earlier turns), the
hand-written replies of ``harmony/transcripts.py`` read back the same whole and streamed in any
cut, and the grammars keep a constrained reply inside the format: what a grammar lets a model
write, the readers read back as the call or the JSON it must be.
"""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest
import torch

from strata.engine.chat_template import ChatTemplate
from strata.engine.grammar import Constraint, Grammars, GrammarSpec
from strata.engine.reasoning import HARMONY, family_for
from strata.engine.tokenizer import Tokenizer
from strata.engine.tool_calls import HarmonyFormat, ToolSpec, format_for
from tests.model.harmony.transcripts import TEMPLATE, TRANSCRIPTS, WEATHER, harmony_vocab

TOOLS = [ToolSpec("get_weather", WEATHER["function"]["parameters"])]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "why": {"type": "string", "maxLength": 8}},
    "required": ["ok", "why"],
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_vocab(harmony_vocab())


@pytest.fixture(scope="module")
def grammars(tok: Tokenizer) -> Grammars:
    return Grammars(tok, tok.vocab_size)


def read(text: str, pieces: list[str] | None = None, fmt: str = "auto") -> tuple[Any, ...]:
    """(thought, content, calls) of a reply fed in ``pieces`` (whole when None)."""
    splitter = HARMONY.splitter(True, fmt)  # type: ignore[arg-type]
    parser = HarmonyFormat().parser(TOOLS)
    thought, events = "", []
    for piece in [*(pieces if pieces is not None else [text]), None]:
        parts = splitter.feed(piece) if piece is not None else splitter.finish()
        for kind, t in parts:
            if kind == "reasoning":
                thought += t
            else:
                events += parser.feed(t)
    events += parser.finish()
    content = "".join(e for e in events if isinstance(e, str)).strip()
    calls = tuple((c.name, c.arguments) for c in parser.calls)
    return thought or None, content or None, calls


def test_the_frame_stays_in_the_text_and_end_closes_a_message_only(tok: Tokenizer) -> None:
    names = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|return|>",
             "<|call|>")  # fmt: skip
    ids = {t: tok.token_id(t) for t in names}
    for text in ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>"):
        assert not tok.is_special(ids[text]) and ids[text] not in tok.eog_ids, text
        assert tok.decode([ids[text]], skip_special=True) == text  # rendered, as llama.cpp
    assert {ids["<|return|>"], ids["<|call|>"]} <= tok.eog_ids  # these end the reply
    prompt = "<|start|>assistant<|channel|>final<|message|>Hi<|end|>"
    assert [i for i in tok.encode(prompt) if i in ids.values()] == [
        ids["<|start|>"], ids["<|channel|>"], ids["<|message|>"], ids["<|end|>"]]  # fmt: skip


def test_gpt_oss_template_renders_tools_effort_and_earlier_turns() -> None:
    assert family_for(TEMPLATE) is HARMONY
    assert isinstance(format_for(TEMPLATE, True), HarmonyFormat)
    template = ChatTemplate(TEMPLATE, bos_token="<|startoftext|>", eos_token="<|return|>")
    args = {"city": "Paris", "unit": "celsius"}
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": args}}  # fmt: skip
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Ask the tool.",
         "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
    ]  # fmt: skip
    text = template.render(messages, tools=[WEATHER], reasoning_effort="high")
    assert "Reasoning: high" in text
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in text
    assert "namespace functions {" in text and "type get_weather = (_: {" in text
    assert "city: string,\nunit: any,\n}) => any;" in text  # an enum without a type: any
    # an answered turn without its thought; the call's turn with its thought, then the call
    assert "<|start|>assistant<|channel|>final<|message|>Hello.<|end|>" in text
    assert "Greet back." not in text
    assert ("<|start|>assistant<|channel|>analysis<|message|>Ask the tool.<|end|>"
            "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
            '{"city": "Paris", "unit": "celsius"}<|call|>') in text  # fmt: skip
    result = '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"Sunny"'
    assert result in text
    assert text.endswith("<|start|>assistant")
    assert "Reasoning: medium" in template.render(messages[:2])  # the template's default
    # a turn with calls, a thought and content: the template takes one of the two (the thought)
    messages[4] = {**messages[4], "content": "Let me check."}
    both = template.render(messages, tools=[WEATHER])
    assert "Ask the tool." in both and "Let me check." not in both


@pytest.mark.parametrize("t", TRANSCRIPTS, ids=lambda t: t.name)
def test_transcripts_read_back_whole_and_streamed(t: Any, tok: Tokenizer) -> None:
    want = (t.reasoning, t.content, t.calls)
    assert read(t.text) == want
    assert read(t.text, list(t.text)) == want  # one character at a time: every marker split
    decoder = tok.stream_decoder()
    pieces = [decoder.push(i) for i in tok.encode(t.text)]  # as the generation gives them
    assert "".join(pieces) == t.text
    assert read(t.text, pieces) == want
    # reasoning_format none: the text as written; deepseek-legacy: that and the thought
    assert read(t.text, fmt="none")[:2] == (None, _without_calls(t))
    legacy = read(t.text, list(t.text), "deepseek-legacy")
    assert legacy == (t.reasoning, _without_calls(t), t.calls)


def _without_calls(t: Any) -> str:
    """The reply as written, less its call messages (what the call parser takes out)."""
    if not t.calls:
        return t.text.strip()
    at = max(t.text.rfind("<|start|>assistant"), 0)
    return t.text[:at].strip() or None  # type: ignore[return-value]


def walk(constraint: Constraint, tok: Tokenizer, seed: int, steps: int = 300) -> str:
    """A random reply the grammar allows: uniform over the allowed tokens, but <|end|> and the
    end of the reply taken at once when allowed (else a thought never ends)."""
    rng = random.Random(seed)
    words = torch.zeros((tok.vocab_size + 31) // 32, dtype=torch.int32)
    ends = {tok.token_id("<|end|>"), *tok.eog_ids}
    out: list[int] = []
    for _ in range(steps):
        assert constraint.fill(words)
        bits = ((words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
        allowed = torch.nonzero(bits[: tok.vocab_size]).flatten().tolist()
        assert allowed, "the grammar allows nothing"
        ending = [i for i in allowed if i in ends]
        token = rng.choice(ending) if ending and rng.random() < 0.5 else rng.choice(allowed)
        if token in tok.eog_ids:
            return tok.decode(out, continuation=True)
        constraint.accept(token)
        assert constraint.error is None
        out.append(token)
    raise AssertionError(f"no end after {steps} tokens: {tok.decode(out)[-200:]!r}")


@pytest.mark.parametrize("seed", range(12))
def test_a_required_call_is_what_the_grammar_allows(grammars: Grammars, tok: Tokenizer,
                                                    seed: int) -> None:  # fmt: skip
    spec = HarmonyFormat().grammar(TOOLS, False, "")
    text = walk(grammars.compile(spec), tok, seed)
    _, _, calls = read(text)
    ((name, args),) = calls
    assert name == "get_weather"
    jsonschema.validate(json.loads(args), TOOLS[0].parameters)


@pytest.mark.parametrize("seed", range(12))
def test_a_json_answer_is_the_final_message(grammars: Grammars, tok: Tokenizer, seed: int) -> None:
    spec = GrammarSpec.json(SCHEMA).after(HARMONY.close)  # what the daemon's plan does
    text = walk(grammars.compile(spec), tok, seed)
    _, content, calls = read(text)
    assert not calls and content is not None
    assert set(json.loads(content)) == {"ok", "why"}  # closed: no other key


def accepts(constraint: Constraint, tok: Tokenizer, text: str) -> bool:
    words = torch.zeros((tok.vocab_size + 31) // 32, dtype=torch.int32)
    for token in tok.encode(text):
        if constraint.fill(words) and not (int(words[token // 32]) >> (token % 32)) & 1:
            return False
        constraint.accept(token)
    return constraint.error is None


def test_the_grammars_take_the_formats_forms_and_nothing_else(
    grammars: Grammars, tok: Tokenizer
) -> None:
    call = HarmonyFormat().grammar(TOOLS, False, "")
    by_name = {t.name: t.text for t in TRANSCRIPTS}
    for name in ("thought then call", "preamble, then a call addressed in the role"):
        assert accepts(grammars.compile(call), tok, by_name[name]), name
    assert not accepts(grammars.compile(call), tok, by_name["thought then answer"])
    assert not accepts(grammars.compile(call), tok, '{"city": "Paris", "unit": "celsius"}')
    answer = GrammarSpec.json(SCHEMA).after(HARMONY.close)
    ok = '{"ok": true, "why": "x"}'
    assert accepts(grammars.compile(answer), tok, f"<|channel|>final<|message|>{ok}")
    assert accepts(grammars.compile(answer), tok,
                   f"<|channel|>final <|constrain|>json<|message|>{ok}")  # fmt: skip
    assert not accepts(grammars.compile(answer), tok, ok)  # the frame first
    assert not accepts(grammars.compile(answer), tok, "<|channel|>final<|message|>{}")
    # a thought holding <|start|> is no thought: the reader would end it there
    stray = f"<|channel|>analysis<|message|>a<|start|>b<|end|><|start|>assistant{ok}"
    assert not accepts(grammars.compile(answer), tok, stray)
    # auto with a strict function: free until "to=functions.", then the rest of a call
    lazy = HarmonyFormat().grammar(TOOLS, False, "", lazy=True)
    free = by_name["thought then call"]
    assert accepts(grammars.compile(lazy), tok, "any text, even <|end|>, first. " + free)
    bad = free.replace('"celsius"', '"kelvin"')
    assert not accepts(grammars.compile(lazy), tok, bad)
