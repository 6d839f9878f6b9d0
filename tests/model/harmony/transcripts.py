"""Test data for harmony (gpt-oss's format): a tiny vocabulary with harmony's special tokens and
gpt-oss's real chat template (``openai-gpt-oss.jinja``, see ``SOURCE.md``), and hand-written
replies that follow the format, each with what it must read back as.

The vocabulary is the tiny byte-level BPE of the test models with o200k_harmony's special
tokens added as the gpt-oss GGUF files type them (control tokens; ``<|return|>`` the end of
sequence), so the tokenizer's own handling of them is what the tests see.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from strata.engine import synth
from strata.engine.vocab import CONTROL, Vocab

TEMPLATE = (Path(__file__).parent / "openai-gpt-oss.jinja").read_text()
SPECIALS = ("<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>",
            "<|call|>")  # fmt: skip

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


@cache
def harmony_vocab() -> Vocab:
    base = synth.vocab_for("qwen3moe")
    first = len(base.tokens)
    return dataclasses.replace(
        base,
        tokens=[*base.tokens, *SPECIALS],
        token_types=[*base.token_types, *[CONTROL] * len(SPECIALS)],
        eos_id=first,  # <|return|>, as gpt-oss's files set it
        chat_template=TEMPLATE,
    )


@dataclass(frozen=True)
class Transcript:
    """A reply as the model writes it (the ``<|return|>`` or ``<|call|>`` that ends it is an
    end-of-generation token: not in the text), and what it reads back as: the thought, the
    content, and the calls as (name, arguments text)."""

    name: str
    text: str
    reasoning: str | None
    content: str | None
    calls: tuple[tuple[str, str], ...] = ()
    finish: str = "stop"  # the generation's own finish reason ("length": max_tokens hit)


ARGS = '{"city": "Paris", "unit": "celsius"}'
TRANSCRIPTS = (
    Transcript(
        "thought then answer",
        "<|channel|>analysis<|message|>The user asks why the sky is blue. Rayleigh scattering."
        "<|end|><|start|>assistant<|channel|>final<|message|>Because air scatters blue light "
        "more than red.",
        "The user asks why the sky is blue. Rayleigh scattering.",
        "Because air scatters blue light more than red.",
    ),
    Transcript(
        "thought then call",
        "<|channel|>analysis<|message|>Need the weather: call get_weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        f"<|message|>{ARGS}",
        "Need the weather: call get_weather.",
        None,
        (("get_weather", ARGS),),
    ),
    Transcript(
        "preamble, then a call addressed in the role",
        "<|channel|>analysis<|message|>I will check.<|end|><|start|>assistant<|channel|>"
        "commentary<|message|>Checking the weather first.<|end|><|start|>assistant "
        f"to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}",
        "I will check.",
        "Checking the weather first.",
        (("get_weather", ARGS),),
    ),
    Transcript(
        "a call cut off in its arguments",
        "<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Par',
        "Call it.",
        None,
        (("get_weather", '{"city": "Par'),),
        "length",
    ),
    Transcript(
        "a call cut off in its header, after its name",
        "<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.get_weather <|constr",
        "Call it.",
        None,
        (("get_weather", ""),),
        "length",
    ),
    Transcript(
        "a call cut off before its name is whole",
        "<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.get_wea",
        "Call it.",
        "<|start|>assistant<|channel|>commentary to=functions.get_wea",
        (),
        "length",
    ),
    Transcript(
        "a thought cut off",
        "<|channel|>analysis<|message|>Let me think about this  ",
        "Let me think about this",
        None,
        (),
        "length",
    ),
    Transcript(
        "stray markers in the answer's text",
        "<|channel|>analysis<|message|>Quote the markers.<|end|><|start|>assistant<|channel|>"
        "final<|message|>Write <|channel|> then <|message|>; to=functions.get_weather is text.",
        "Quote the markers.",
        "Write <|channel|> then <|message|>; to=functions.get_weather is text.",
    ),
    Transcript(
        "a stray commentary before the thought, no thought before the answer",
        "<|channel|>commentary<|channel|>analysis<|message|>Short.<|end|><|start|>assistant"
        "<|channel|>commentary<|channel|>final<|message|>Done.",
        "Short.",
        "Done.",
    ),
    Transcript(
        "markers inside the JSON strings of a call and of an answer",
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "a<|end|>b<|start|>", "unit": "celsius"}',
        None,
        None,
        (("get_weather", '{"city": "a<|end|>b<|start|>", "unit": "celsius"}'),),
    ),
    Transcript(
        "a JSON answer holding a marker in a string",
        '<|channel|>final<|message|>{"note": "ends with <|end|> here"}',
        None,
        '{"note": "ends with <|end|> here"}',
    ),
    Transcript(
        "plain text, no frame at all",
        "Hello <|end|> world",
        None,
        "Hello <|end|> world",
    ),
    Transcript(
        "an unknown function",
        "<|channel|>commentary to=functions.launch <|constrain|>json<|message|>{}",
        None,
        "<|channel|>commentary to=functions.launch <|constrain|>json<|message|>{}",
    ),
    Transcript(
        "a call whose arguments are not JSON",
        "<|channel|>commentary to=functions.get_weather<|message|>Paris please<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Sorry.",
        None,
        "<|channel|>commentary to=functions.get_weather<|message|>Paris please<|end|>Sorry.",
    ),
)
