"""Chat templates rendered as llama-cpp-python's Jinja2 formatter (HF's rules) renders them."""

from __future__ import annotations

import os

import pytest

from strata.engine.chat_template import ChatTemplate
from strata.engine.errors import TemplateError
from strata.engine.tokenizer import Tokenizer
from strata.engine.vocab import CHATML_TEMPLATE, INST_TEMPLATE, build_bpe_vocab


def _formatter_class() -> type:
    if os.environ.get("CI"):
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter  # in CI: must be there

        return Jinja2ChatFormatter
    fmt = pytest.importorskip(
        "llama_cpp.llama_chat_format",
        reason="llama-cpp-python is not installed: no reference chat formatter",
    )
    return fmt.Jinja2ChatFormatter


def reference_render(
    source: str, messages: list[dict], add_generation_prompt: bool, bos: str, eos: str
) -> str:
    formatter = _formatter_class()(
        template=source, eos_token=eos, bos_token=bos, add_generation_prompt=add_generation_prompt
    )
    return formatter(messages=messages).prompt


CONVERSATIONS = {
    "one_turn": [{"role": "user", "content": "Hello there!"}],
    "system_and_turns": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? 你好 🙂\nThanks."},
    ],
    "empty_content": [{"role": "user", "content": ""}],
}

# a template using both HF globals, loop controls and a filter
GLOBALS_TEMPLATE = """{{ bos_token }}Date: {{ strftime_now("%Y") }}
{% for m in messages %}
{% if m['role'] not in ['system', 'user', 'assistant'] %}
{{ raise_exception('bad role ' + m['role']) }}
{% endif %}
{% if m['content'] == 'STOP' %}{% break %}{% endif %}
[{{ m['role'] | upper }}] {{ m['content'] | trim }}
{% endfor %}
{% if add_generation_prompt %}[ASSISTANT]{% endif %}{{ eos_token }}"""


@pytest.mark.parametrize(
    ("source", "bos", "eos"),
    [
        (CHATML_TEMPLATE, "<|endoftext|>", "<|im_end|>"),
        (INST_TEMPLATE, "<s>", "</s>"),
        (GLOBALS_TEMPLATE, "<s>", "</s>"),
    ],
    ids=["chatml", "inst", "globals"],
)
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("gen", [True, False], ids=["gen", "nogen"])
def test_render_equals_llama_cpp_formatter(
    source: str, bos: str, eos: str, conversation: str, gen: bool
) -> None:
    messages = CONVERSATIONS[conversation]
    want = reference_render(source, messages, gen, bos, eos)
    got = ChatTemplate(source, bos_token=bos, eos_token=eos).render(
        messages, add_generation_prompt=gen
    )
    assert got == want


def test_inst_template_renders_mixtral_turns() -> None:
    text = ChatTemplate(INST_TEMPLATE, "<s>", "</s>").render(CONVERSATIONS["system_and_turns"])
    assert text == (
        "<s>[INST] You are terse.\n\nWhat is 2+2? [/INST]4</s>"
        "[INST] And 3+3? 你好 🙂\nThanks. [/INST]"
    )


def test_raise_exception_is_a_template_error_with_the_message() -> None:
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TemplateError, match="roles must alternate"):
        ChatTemplate(INST_TEMPLATE, "<s>", "</s>").render(bad)
    with pytest.raises(ValueError, match="roles must alternate"):  # the reference agrees
        reference_render(INST_TEMPLATE, bad, True, "<s>", "</s>")
    with pytest.raises(TemplateError, match="bad role tool"):
        ChatTemplate(GLOBALS_TEMPLATE).render([{"role": "tool", "content": "x"}])


def test_loop_controls_work() -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "STOP"}]
    assert "STOP" not in ChatTemplate(GLOBALS_TEMPLATE).render(messages)


@pytest.mark.parametrize(
    "source", ["{% for m in messages %}", "{{ messages[0]['content' }}", "{% endif %}"]
)
def test_syntax_error_is_a_template_error(source: str) -> None:
    with pytest.raises(TemplateError, match="does not parse"):
        ChatTemplate(source)


def test_render_failures_are_template_errors() -> None:
    with pytest.raises(TemplateError, match="has no attribute"):
        ChatTemplate("{{ messages[0].content.nope() }}").render([{"role": "user"}])
    with pytest.raises(TemplateError):  # the sandbox is immutable
        ChatTemplate("{{ messages.append(1) }}").render([])
    with pytest.raises(TemplateError, match="ZeroDivisionError"):
        ChatTemplate("{{ 1 // 0 }}").render([])


def test_tojson_writes_plain_json_and_extra_variables_reach_the_template() -> None:
    tools = [{"name": "lookup", "description": "a < b & c", "k": "é"}]
    text = ChatTemplate("{{ tools | tojson }}|{{ enable_thinking }}").render(
        [], tools=tools, enable_thinking=False
    )
    assert text == '[{"name": "lookup", "description": "a < b & c", "k": "é"}]|False'


def test_generation_tag_renders_its_body() -> None:
    source = "{% generation %}{{ messages[0]['content'] }}{% endgeneration %}!"
    assert ChatTemplate(source).render([{"role": "user", "content": "hi"}]) == "hi!"


def test_chatml_prompt_encodes_control_tokens_as_single_ids() -> None:
    vocab = build_bpe_vocab()
    tok = Tokenizer.from_vocab(vocab)
    prompt = ChatTemplate(vocab.chat_template or "").render(CONVERSATIONS["one_turn"])
    ids = tok.encode(prompt)
    im_start, im_end = (vocab.tokens.index(t) for t in ("<|im_start|>", "<|im_end|>"))
    assert ids.count(im_start) == 2 and ids.count(im_end) == 1
    assert tok.decode(ids) == prompt
