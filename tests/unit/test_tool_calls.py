"""Tool-call formats: each family's output read back into calls, whole and streamed in every
split, malformed output kept as content, the generic format's messages, the choice of format
from the template, and the grammars they ask for. Plain Python: no model, no torch."""

from __future__ import annotations

import json
import random
import sys

import pytest

from strata.engine.tool_calls import (
    ArgumentsDelta,
    CallStart,
    HermesFormat,
    MistralFormat,
    ToolCall,
    ToolFormat,
    ToolSpec,
    format_for,
    generic_messages,
)
from strata.engine.vocab import CHATML_TEMPLATE, MISTRAL_TOOLS_TEMPLATE, QWEN3_TEMPLATE

TOOLS = [ToolSpec("list_files", {"type": "object"}), ToolSpec("read_file", {"type": "object"})]
H, M, G = HermesFormat(), MistralFormat(), ToolFormat()

CALLS = {
    "hermes": (H, 'Let me look.\n<tool_call>\n{"name": "list_files", "arguments": {"dir": "."}}\n'
                  '</tool_call>\n<tool_call>\n{"name": "read_file", "arguments": '
                  '{"path": "a}b\\"c"}}\n</tool_call>'),
    "mistral": (M, '[TOOL_CALLS] [{"name": "list_files", "arguments": {"dir": "."}, "id": '
                   '"abcdefghi"}, {"name": "read_file", "arguments": {"path": "a}b\\"c"}}]'),
    "generic": (G, '{"tool_calls": [{"name": "list_files", "arguments": {"dir": "."}}, '
                   '{"name": "read_file", "arguments": {"path": "a}b\\"c"}}]}'),
}  # fmt: skip


def streamed(fmt: ToolFormat, text: str, seed: int, guaranteed: bool) -> tuple[list, list]:
    p = fmt.parser(TOOLS, guaranteed)
    rng = random.Random(seed)
    events, at = [], 0
    while at < len(text):
        n = rng.randint(1, 6)
        events += p.feed(text[at : at + n])
        at += n
    return events + p.finish(), p.calls


def rebuilt(events: list) -> tuple[str, list[tuple[str, str, str]]]:
    """(content, [(id, name, arguments)]) as a client puts the deltas together."""
    content = "".join(e for e in events if isinstance(e, str))
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, CallStart):
            assert e.index not in calls, "a call starts once"
            calls[e.index] = [e.id, e.name, ""]
        elif isinstance(e, ArgumentsDelta):
            calls[e.index][2] += e.text
    return content, [tuple(c) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("family", list(CALLS))
def test_each_family_reads_back_its_calls(family: str) -> None:
    fmt, text = CALLS[family]
    content, calls = fmt.parse(text, TOOLS)
    assert [c.name for c in calls] == ["list_files", "read_file"]
    assert [json.loads(c.arguments) for c in calls] == [{"dir": "."}, {"path": 'a}b"c'}]
    assert content == ("Let me look." if family == "hermes" else None)
    if family == "mistral":
        assert calls[0].id == "abcdefghi", "an id the model wrote is kept"
        assert len(calls[1].id) == 9 and calls[1].id.isalnum()
    else:
        assert all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("guaranteed", [False, True])
@pytest.mark.parametrize("family", list(CALLS))
def test_streamed_in_any_split_gives_the_same_calls(family: str, guaranteed: bool) -> None:
    fmt, text = CALLS[family]
    _, whole = fmt.parse(text, TOOLS)
    for seed in range(20):
        events, calls = streamed(fmt, text, seed, guaranteed)
        content, deltas = rebuilt(events)
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole]
        assert [(n, a) for _, n, a in deltas] == [(c.name, c.arguments) for c in calls]
        assert [i for i, _, _ in deltas] == [c.id for c in calls]
        assert content.strip() == ("Let me look." if family == "hermes" else "")


def test_a_guaranteed_call_streams_its_arguments_as_they_come() -> None:
    p = H.parser(TOOLS, guaranteed=True)
    head = p.feed('<tool_call>\n{"name": "read_file", "arguments": {"pa')
    assert isinstance(head[0], CallStart) and head[0].name == "read_file"
    assert head[1:] == [ArgumentsDelta(0, '{"pa')]
    assert p.feed('th": "x"}') == [ArgumentsDelta(0, 'th": "x"}')]
    assert p.feed("}\n</tool_call>") == []
    assert p.calls == [ToolCall(head[0].id, "read_file", '{"path": "x"}')]
    # not guaranteed: nothing of a call goes out before it is complete and valid
    p = H.parser(TOOLS)
    assert p.feed('<tool_call>\n{"name": "read_file", "arguments": {"path": "x"') == []
    done = p.feed("}}\n</tool_call>")
    assert [type(e) for e in done] == [CallStart, ArgumentsDelta]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', "not one of the tools"),
        ('<tool_call>\n{"name": "read_f', "ended inside a call before its name"),
        ('<tool_call>\n{"name": "read_file", "arguments": [1]}\n</tool_call>', "not an object"),
        ("<tool_call>\n{name: read_file}\n</tool_call>", "not JSON"),
        ('<tool_call>\n{"arguments": {}}\n</tool_call>', "without a name"),
        ("<tool_call>\nnothing here\n", "no call"),
    ],
)
def test_malformed_output_stays_content_and_the_log_says_why(
    text: str, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="strata.engine.tool_calls")
    content, calls = H.parse("Sure. " + text, TOOLS)
    assert calls == [] and content == ("Sure. " + text).strip()
    assert why in caplog.text and "kept as content" in caplog.text


@pytest.mark.parametrize("guaranteed", [False, True])
def test_a_call_cut_off_after_its_name_is_a_call_whole_or_streamed(guaranteed: bool) -> None:
    text = 'Sure. <tool_call>\n{"name": "read_file", "arguments": {"path": "/et'
    content, calls = H.parse(text, TOOLS)
    assert content == "Sure." and [(c.name, c.arguments) for c in calls] == [
        ("read_file", '{"path": "/et')
    ]
    p = H.parser(TOOLS, guaranteed)
    events = [e for i in range(0, len(text), 5) for e in p.feed(text[i : i + 5])] + p.finish()
    starts = [e for e in events if isinstance(e, CallStart)]
    args = "".join(e.text for e in events if isinstance(e, ArgumentsDelta))
    assert [s.name for s in starts] == ["read_file"] and args == '{"path": "/et'
    assert [c.arguments for c in p.calls] == [args] and p.calls[0].id == starts[0].id
    assert "".join(e for e in events if isinstance(e, str)).strip() == "Sure."


def test_text_that_only_looks_like_a_marker_is_content() -> None:
    p = H.parser(TOOLS)
    assert p.feed("a <tool") == ["a "]
    assert p.feed("box> b") == ["<toolbox> b"]
    assert p.finish() == []
    assert G.parse('{"answer": 42}', TOOLS) == ('{"answer": 42}', [])
    assert G.parse('Here: {"tool_calls": []}', TOOLS) == ('Here: {"tool_calls": []}', [])
    assert G.parse("  ", TOOLS) == (None, [])


def test_other_shapes_models_write() -> None:
    # arguments as a JSON string, "parameters" for "arguments", Mistral's name[ARGS]{...}
    _, calls = H.parse('<tool_call>{"name": "read_file", "arguments": "{\\"path\\": 1}"}'
                       "</tool_call>", TOOLS)  # fmt: skip
    assert calls[0].arguments == '{"path": 1}'
    _, calls = H.parse('<tool_call>{"name": "list_files", "parameters": {"d": 2}}</tool_call>',
                       TOOLS)  # fmt: skip
    assert json.loads(calls[0].arguments) == {"d": 2}
    _, calls = M.parse('[TOOL_CALLS]read_file[ARGS]{"path": "x"}', TOOLS)
    assert [(c.name, c.arguments) for c in calls] == [("read_file", '{"path": "x"}')]


def test_the_format_comes_from_the_template() -> None:
    assert isinstance(format_for(QWEN3_TEMPLATE, True), HermesFormat)
    assert isinstance(format_for(MISTRAL_TOOLS_TEMPLATE, True), MistralFormat)
    assert type(format_for(CHATML_TEMPLATE, False)) is ToolFormat
    # a template that writes the marker but renders no tools: generic
    assert type(format_for(QWEN3_TEMPLATE, False)) is ToolFormat
    assert type(format_for(None, False)) is ToolFormat


def test_generic_messages_describe_the_tools_and_carry_the_history() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Read a."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read_file",
                                                          "arguments": {"path": "a"}}},
            {"id": "c2", "type": "function", "function": {"name": "list_files",
                                                          "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "read_file", "content": "AAA"},
        {"role": "tool", "tool_call_id": "c2", "content": "a b"},
    ]  # fmt: skip
    out = generic_messages(messages, TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\nYou can call these tools")
    assert '"name": "read_file"' in out[0]["content"] and '{"tool_calls": [' in out[0]["content"]
    assert json.loads(out[2]["content"]) == {"tool_calls": [
        {"name": "read_file", "arguments": {"path": "a"}},
        {"name": "list_files", "arguments": {}}]}  # fmt: skip
    assert out[3]["content"] == (
        "Tool result (read_file, call c1):\nAAA\n\nTool result (call c2):\na b"
    )
    assert all("tool_calls" not in m for m in out)
    # no tools (tool_choice none): the history only, no system message added
    plain = generic_messages(messages[1:], ())
    assert plain[0] == {"role": "user", "content": "Read a."}


def test_the_grammars_the_formats_ask_for() -> None:
    weather = ToolSpec("w", {"type": "object", "properties": {"c": {"type": "string"}}})
    spec = H.grammar([weather], parallel=False, marker='"<tool_call>"')
    assert spec.kind == "lark" and spec.trigger is None
    assert spec.source.startswith('start: "<tool_call>" "\\n" call_body')
    assert '"const": "w"' in spec.source and '"whitespace_flexible": false' in spec.source
    assert ")*" in H.grammar([weather], True, '"<tool_call>"').source, "parallel: more calls"
    lazy = H.grammar([weather], False, '"<tool_call>"', lazy=True)
    assert lazy.trigger == "<tool_call>" and lazy.source.startswith('start: "\\n" call_body')
    mistral = M.grammar([weather], False, "<[7]>")
    assert mistral.source.startswith("start: <[7]>") and '"maxItems": 1' in mistral.source
    generic = G.grammar(TOOLS, True, "")
    assert '"tool_calls"' in generic.source and '"maxItems"' not in generic.source


def test_the_formats_import_no_torch() -> None:
    import subprocess

    code = "import sys, strata.engine.tool_calls; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
