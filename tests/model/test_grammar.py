"""Grammar-constrained generation in the engine: the token mask against a plain reference, the
vocabulary as llguidance sees it, grammars refused with the reason, a grammar that completes
ending the generation, ``max_tokens`` before that, lazy grammars started by their trigger,
log-probabilities, and the mask on the fast decode path (Triton's interpreter on the CPU).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

# Triton's interpreter on the CPU, set before any kernel module is imported (whichever imports
# Triton first decides; the reference path's steps may import it before the fast-path test runs)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from strata.engine import synth
from strata.engine.generate import Engine
from strata.engine.grammar import GrammarError, GrammarSpec, TokenMask
from strata.engine.options import EngineOptions
from strata.engine.params import SamplingParams
from strata.engine.tool_calls import HermesFormat, MistralFormat, ToolFormat, ToolSpec
from strata.engine.vocab import QWEN3_TEMPLATE, build_mistral_tools_vocab

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
WEATHER = ToolSpec(
    "get_weather",
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """tiny-qwen3moe with the Qwen3-style template (tools rendered: the hermes format)."""
    vocab = replace(synth.vocab_for("qwen3moe"), chat_template=QWEN3_TEMPLATE)
    folder = tmp_path_factory.mktemp("g")
    path = synth.write_model(
        folder / "qwen3-tools.gguf", synth.PRESETS["tiny-qwen3moe"], vocab, synth.TypePlan(), 0
    )
    return Engine.load(path, EngineOptions(kv_cache_type="f32", context_length=512))


@pytest.fixture(scope="module")
def prompt(engine: Engine) -> list[int]:
    return engine.encode_chat([{"role": "user", "content": "Some JSON, please."}])


def allowed(words: torch.Tensor, n: int) -> list[int]:
    """The token ids whose bit is set, read bit by bit (the reference of ``TokenMask``)."""
    return [t for t in range(n) if (int(words[t // 32]) >> (t % 32)) & 1]


@pytest.mark.parametrize("n_vocab", [1, 31, 32, 33, 1000, 4099])
def test_token_mask_sets_exactly_the_cleared_bits_to_minus_infinity(n_vocab: int) -> None:
    rng = random.Random(n_vocab)
    mask = TokenMask(n_vocab, torch.device("cpu"))
    words = [rng.getrandbits(32) for _ in range(mask.host.numel())]
    words[0] |= 1 << 31  # the sign bit of an int32 word is a token too
    mask.host.copy_(torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words],
                                 dtype=torch.int32))  # fmt: skip
    logits = torch.randn(n_vocab)
    want = logits.clone()
    keep = set(allowed(mask.host, n_vocab))
    for t in range(n_vocab):
        if t not in keep:
            want[t] = float("-inf")
    assert torch.equal(mask.apply(logits), want)


def test_the_grammar_vocabulary_spells_every_token_and_hides_the_specials(engine: Engine) -> None:
    ll = engine.grammars.ll
    tok = engine.tokenizer
    assert ll.vocab_size == engine.sequences.model.shape.vocab_size
    # every end-of-generation token ends a grammar (llguidance 1.6 takes one: the turn's end)
    ends = set(getattr(ll, "eos_tokens", [ll.eos_token]))
    assert ends == set(tok.eog_ids) or ends == {tok.token_id("<|im_end|>")}
    for tid in range(0, tok.vocab_size, 97):
        if not tok.is_special(tid):
            assert ll.decode_bytes([tid]) == tok.token_bytes(tid)
    im_start = tok.token_id("<|im_start|>")
    assert im_start is not None and ll.is_special_token(im_start)
    # <tool_call> is text to the model (a user-defined token), and so to the grammar
    call = tok.token_id("<tool_call>")
    assert call is not None and not ll.is_special_token(call)
    assert engine.grammars.special_token("<tool_call>") is None
    assert engine.grammars.special_token("<|im_start|>") == f"<[{im_start}]>"


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "properties": {"a": {"not": {}}}}, "not"),
        ({"type": "strin"}, "strin"),
        ({"type": "object", "required": "a"}, "required"),
        ([1, 2], "not list"),
    ],
)
def test_a_schema_that_cannot_be_enforced_is_refused_naming_why(
    engine: Engine, schema: object, says: str
) -> None:
    with pytest.raises(GrammarError) as e:
        engine.grammars.compile(GrammarSpec("json_schema", schema))
    assert says.split()[-1] in str(e.value)


def test_check_only_schemas_pass_features_nothing_enforces(engine: Engine) -> None:
    loose = {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}
    engine.grammars.check_schema(loose, enforced=False)
    with pytest.raises(GrammarError, match="uniqueItems"):
        engine.grammars.check_schema(loose, enforced=True)
    with pytest.raises(GrammarError, match="Invalid type"):
        engine.grammars.check_schema({"type": "strin"}, enforced=False)


def test_schema_output_validates_and_ends_when_the_grammar_does(
    engine: Engine, prompt: list[int]
) -> None:
    for seed in range(8):
        c = engine.grammars.compile(GrammarSpec.json(SCHEMA))
        r = engine.generate(prompt, SamplingParams(max_tokens=200, seed=seed), constraint=c)
        jsonschema.validate(json.loads(r.text), SCHEMA)
        assert r.finish_reason == "stop" and c.done
        # the last token closed the object: no end token was sampled, no step after it ran
        assert r.text.endswith("}") and c.masks == len(r.tokens)
        assert r.mask_s > 0


def test_max_tokens_before_the_grammar_completes_is_length(
    engine: Engine, prompt: list[int]
) -> None:
    c = engine.grammars.compile(GrammarSpec.json(SCHEMA))
    r = engine.generate(prompt, SamplingParams(max_tokens=5, seed=1), constraint=c)
    assert r.finish_reason == "length" and len(r.tokens) == 5 and not c.done
    assert r.text.startswith('{"name": ')


def test_the_greedy_choice_under_a_mask_is_the_best_allowed_token(
    engine: Engine, prompt: list[int]
) -> None:
    c = engine.grammars.compile(GrammarSpec.json(SCHEMA))
    r = engine.generate(prompt, SamplingParams(max_tokens=200, temperature=0, logprobs=3),
                        constraint=c)  # fmt: skip
    assert r.logprobs is not None and len(r.logprobs) == len(r.tokens)
    for e, token in zip(r.logprobs, r.tokens, strict=True):
        assert e.token == token and e.top and e.top[0] == (token, e.logprob)
        assert all(lp > float("-inf") for _, lp in e.top), "a masked token is never listed"
    # the first token is forced ({): every other token is masked, so it holds all the mass
    assert r.logprobs[0].logprob == pytest.approx(0.0, abs=1e-6)
    assert len(r.logprobs[0].top) == 1


def test_unconstrained_logprobs_match_the_logits(engine: Engine, prompt: list[int]) -> None:
    r = engine.generate(prompt, SamplingParams(max_tokens=4, seed=3, logprobs=2))
    assert r.logprobs is not None
    engine.sequences.rewind(0)
    logits = engine.sequences.feed(prompt)
    lp = torch.log_softmax(logits.float(), -1)
    first = r.logprobs[0]
    assert first.logprob == pytest.approx(float(lp[first.token]), abs=1e-5)
    assert [t for t, _ in first.top] == torch.topk(lp, 2).indices.tolist()


def test_streamed_logprobs_come_before_their_text(engine: Engine, prompt: list[int]) -> None:
    events: list[tuple[str, object]] = []
    r = engine.generate(
        prompt, SamplingParams(max_tokens=12, seed=4, logprobs=0, stop=("zzzq",)),
        on_text=lambda t: events.append(("text", t)),
        on_logprobs=lambda e: events.append(("logprobs", len(e))),
    )  # fmt: skip
    assert sum(n for kind, n in events if kind == "logprobs") == len(r.tokens)
    assert "".join(t for kind, t in events if kind == "text") == r.text
    assert events[0][0] == "logprobs"


def test_a_lazy_grammar_starts_at_its_trigger(engine: Engine) -> None:
    spec = HermesFormat().grammar([WEATHER], False, '"<tool_call>"', lazy=True)
    assert spec.trigger == "<tool_call>"
    c = engine.grammars.compile(spec)
    words = torch.zeros((engine.grammars.n_vocab + 31) // 32, dtype=torch.int32)
    tok = engine.tokenizer
    for t in tok.encode("Let me look. <tool", add_bos=False):
        assert not c.fill(words), "free text before the trigger"
        c.accept(t)
    assert not c.active
    for t in tok.encode('_call>\n{"name"', add_bos=False):  # the trigger completes mid-piece
        c.accept(t)
    assert c.active and c.error is None
    assert c.fill(words)
    ok = allowed(words, engine.grammars.n_vocab)
    assert ok and all(tok.token_bytes(t).startswith(b":") for t in ok)


def test_a_required_call_in_each_format_parses_back(engine: Engine, prompt: list[int]) -> None:
    for fmt in (HermesFormat(), ToolFormat()):
        marker = '"<tool_call>"' if fmt.marker else ""
        c = engine.grammars.compile(fmt.grammar([WEATHER], False, marker))
        r = engine.generate(prompt, SamplingParams(max_tokens=120, seed=2), constraint=c)
        content, calls = fmt.parse(r.text, [WEATHER])
        assert r.finish_reason == "stop" and content is None, r.text
        (call,) = calls
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER.parameters)


def test_a_special_marker_is_kept_in_the_text(tmp_path: Path) -> None:
    path = synth.write_model(tmp_path / "mistral.gguf", synth.PRESETS["tiny-mixtral"],
                             build_mistral_tools_vocab(), synth.TypePlan(), 0)  # fmt: skip
    e = Engine.load(path, EngineOptions(kv_cache_type="f32", context_length=512))
    tid = e.tokenizer.token_id("[TOOL_CALLS]")
    assert tid is not None and e.tokenizer.is_special(tid)
    marker = e.grammars.special_token("[TOOL_CALLS]")
    assert marker == f"<[{tid}]>"
    fmt = MistralFormat()
    c = e.grammars.compile(fmt.grammar([WEATHER], True, marker))
    ids = e.encode_chat([{"role": "user", "content": "hi"}], [WEATHER.openai()])
    r = e.generate(ids, SamplingParams(max_tokens=80, seed=2), constraint=c,
                   show_special=frozenset({tid}))  # fmt: skip
    assert r.tokens[0] == tid and r.text.startswith("[TOOL_CALLS]")
    content, calls = fmt.parse(r.text, [WEATHER])
    assert calls and content is None
    hidden = e.generate(
        ids,
        SamplingParams(max_tokens=80, seed=2),
        constraint=e.grammars.compile(fmt.grammar([WEATHER], True, marker)),
    )
    assert not hidden.text.startswith("[TOOL_CALLS]"), "special tokens are hidden otherwise"


def test_the_mask_applies_on_the_fast_decode_path(tiny_models) -> None:
    """The same constrained tokens from the fused kernels (Triton's interpreter on the CPU) as
    from the reference path: the mask goes onto the logits the decode step leaves, and a masked
    greedy run still steps ahead of the host (``Sequences.ahead`` with the constraint)."""
    pytest.importorskip("triton", reason="Triton is not installed")
    from fastpath import fast_runner, reference_runner

    path = tiny_models.path("qwen3moe", "Q8_0")
    base = Engine.load(path, EngineOptions(kv_cache_type="f32", context_length=64))
    schema = {"enum": ["yes", "no", "maybe so"]}
    out, ahead = [], []
    for runner in (reference_runner(path), fast_runner(path, 1.0)):
        e = Engine(base.index, base.tokenizer, base.template, runner)
        if runner.decodes_on_gpu:
            run_ahead = runner.ahead

            def counted(*args, run_ahead=run_ahead):  # the run ahead, seen taking the constraint
                ahead.append(args[3])
                yield from run_ahead(*args)

            runner.ahead = counted  # type: ignore[method-assign]
        c = e.grammars.compile(GrammarSpec.json(schema))
        r = e.generate([1, 5, 9, 100, 7], SamplingParams(max_tokens=8, temperature=0),
                       constraint=c)  # fmt: skip
        assert r.finish_reason == "stop" and json.loads(r.text) in schema["enum"]
        out.append(r.tokens)
        assert runner._token_mask is not None
    assert out[0] == out[1]
    assert ahead and all(a is not None for a in ahead)
    # a sampled constrained request first (its sampler runs after each step run ahead), then a
    # greedy one that runs ahead with the same mask (on a GPU, writing the mask's device
    # words outside inference mode failed): the same tokens as before
    e.sequences._token_mask = None
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=3)
    e.generate([1, 5, 9, 100, 7], sampled, constraint=e.grammars.compile(GrammarSpec.json(schema)))
    again = e.generate([1, 5, 9, 100, 7], SamplingParams(max_tokens=8, temperature=0),
                       constraint=e.grammars.compile(GrammarSpec.json(schema)))  # fmt: skip
    assert again.tokens == out[1]
    # unconstrained, the same prompt picks other tokens: the mask did choose them
    free = e.generate([1, 5, 9, 100, 7], SamplingParams(max_tokens=8, temperature=0))
    assert free.tokens[: len(out[1])] != out[1]


def test_the_output_plan_for_each_tool_choice(engine: Engine, tiny_models) -> None:
    from strata.daemon.api.api_errors import ApiError
    from strata.daemon.api.openai_tools import ResponseFormat, ToolChoice, compile_output
    from strata.daemon.api.openai_tools import plan_output as plan_only

    def plan_output(eng: Engine, *args: Any) -> Any:  # the plan with its grammar compiled
        return compile_output(eng.grammars, plan_only(eng, *args))

    msgs = [{"role": "user", "content": "weather?"}]
    strict = replace(WEATHER, strict=True)
    plan = plan_output(engine, msgs, (WEATHER,), ToolChoice("required"), False, None)
    assert plan.constraint is not None and plan.constraint.active
    assert plan.tools is not None and plan.tools.guaranteed and plan.tools.format.name == "hermes"
    assert plan.template_tools == [WEATHER.openai()] and plan.messages == msgs
    plan = plan_output(engine, msgs, (strict,), ToolChoice("auto"), True, None)
    assert plan.constraint is not None and not plan.constraint.active  # until <tool_call>
    assert plan.tools is not None and not plan.tools.guaranteed
    plan = plan_output(engine, msgs, (WEATHER,), ToolChoice("auto"), True, None)
    assert plan.constraint is None and plan.tools is not None
    plan = plan_output(engine, msgs, (WEATHER,), ToolChoice("none"), True, None)
    assert plan.constraint is None and plan.tools is None and plan.template_tools is None
    plan = plan_output(engine, msgs, (), ToolChoice("none"), True, ResponseFormat("json_object"))
    assert plan.constraint is not None and plan.tools is None
    with pytest.raises(ApiError) as e:
        plan_output(engine, msgs, (WEATHER,), ToolChoice("required"), True,
                    ResponseFormat("json_object"))  # fmt: skip
    assert e.value.param == "response_format"
    # a template that knows no tools: the generic format, the tools in a system message
    chatml = Engine.load(tiny_models.path("qwen3moe", "F32"), EngineOptions(context_length=256))
    assert not chatml.template_renders_tools and engine.template_renders_tools
    plan = plan_output(chatml, msgs, (WEATHER,), ToolChoice("required"), False, None)
    assert plan.tools is not None and plan.tools.format.name == "generic"
    assert plan.template_tools is None and plan.messages[0]["role"] == "system"
    assert "get_weather" in plan.messages[0]["content"]
