"""Grammar-constrained decoding on the GPU fast path: JSON Schema output and a required tool call,
through ``Engine.load`` and through the daemon with the ``openai`` client.

The model: tiny qwen3moe shapes in llama.cpp's Q4_K_M recipe (random blocks: no llama.cpp
needed), a vocabulary of Qwen3's size (151,936 tokens, so the mask is the real size) and the
Qwen3-style template that renders tools. Every decode step must be a replay of the one captured
CUDA graph, with the token mask applied on the device to the logits it leaves; the constrained
text must be the same with and without the graph (the same kernels). The mask's cost per token
is printed (run with ``-s``), never asserted: ``strata bench --grammar`` is the measurement.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from strata.bench.strata_run import BENCH_GRAMMAR
from strata.engine import synth
from strata.engine.generate import Engine
from strata.engine.grammar import GrammarSpec
from strata.engine.options import EngineOptions
from strata.engine.params import SamplingParams
from strata.engine.vocab import QWEN3_TEMPLATE
from tests.integration.harness import StrataDaemon

pytestmark = pytest.mark.gpu

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "days": {
            "type": "array",
            "items": {"type": "integer", "minimum": 1, "maximum": 31},
            "minItems": 1,
            "maxItems": 5,
        },
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "note": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]},
    },
    "required": ["city", "days", "unit", "note"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": SCHEMA,
    },
}
LIST_FILES = {
    "type": "function",
    "function": {
        "name": "list_files",
        "parameters": {
            "type": "object",
            "properties": {"directory": {"enum": [".", "src"]}},
            "required": ["directory"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Lyon?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, cuda_device: int) -> Path:
    spec = replace(synth.PRESETS["tiny-qwen3moe"], vocab_size=151_936)
    vocab = replace(synth.vocab_for("qwen3moe"), chat_template=QWEN3_TEMPLATE)
    path = tmp_path_factory.mktemp("gpu-grammar") / "qwen3-tools-q4km.gguf"
    return synth.write_model(path, spec, vocab, synth.Q4_K_M, 0)


def load(path: Path, **kw: Any) -> Engine:
    options = dict(device="cuda:0", context_length=1024, cache_mib=1 << 20)
    options.update(kw)
    return Engine.load(path, EngineOptions(**options))  # type: ignore[arg-type]


class CountedGraph:
    """The decoder's graph, counting its replays."""

    def __init__(self, graph: Any) -> None:
        self.graph = graph
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.graph.replay()


def test_json_schema_output_on_the_graph_path(model: Path) -> None:
    e = load(model)
    dec = e.sequences.gpu
    assert dec is not None and dec.plan.complete
    assert e.sequences.decode_path().startswith("fused Triton kernels, one CUDA graph per step")
    counted = CountedGraph(dec.graph)
    dec.graphs[dec.mode] = counted  # type: ignore[assignment]
    prompt = e.encode_chat([{"role": "user", "content": "The weather as JSON."}])
    steps = 0
    for seed in range(12):
        e.sequences.rewind(0)  # the whole prompt as a prefill (a cached one feeds its last token)
        c = e.grammars.compile(GrammarSpec.json(SCHEMA))
        r = e.generate(prompt, SamplingParams(max_tokens=400, seed=seed, temperature=1.0),
                       constraint=c)  # fmt: skip
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), SCHEMA)
        steps += len(r.tokens) - 1  # the first token comes from the prompt's logits
    # sampled under a grammar, the steps run one ahead of the host (``Sequences.ahead``): each
    # request's step after its stop token ran too, its token never taken
    assert counted.replays == steps + 12, "every constrained decode step is a graph replay"
    mask = e.sequences._token_mask
    assert mask is not None and mask.words.is_cuda and mask.word.numel() == 151_936
    # greedy under the grammar: the same tokens without the graph (the same kernels)
    greedy = SamplingParams(max_tokens=400, temperature=0)
    a = e.generate(prompt, greedy, constraint=e.grammars.compile(GrammarSpec.json(SCHEMA)))
    e.close()
    eager = load(model, enforce_eager=True)
    assert eager.sequences.gpu is not None and eager.sequences.gpu.graph is None
    b = eager.generate(prompt, greedy, constraint=eager.grammars.compile(GrammarSpec.json(SCHEMA)))
    assert a.tokens == b.tokens and a.finish_reason == b.finish_reason == "stop"
    eager.close()


def test_the_mask_cost_per_token_is_printed(model: Path) -> None:
    e = load(model)
    e.grammars.compile(BENCH_GRAMMAR)  # its tokenizer takes the end tokens before they go
    e.tokenizer.eog_ids = frozenset()  # as the bench: every run its full length
    prompt = e.encode_prompt("Once upon a time")
    greedy = SamplingParams(max_tokens=256, temperature=0)
    sampled = SamplingParams(max_tokens=256, temperature=0.8, seed=1)
    e.generate(prompt, greedy, constraint=e.grammars.compile(BENCH_GRAMMAR))  # warm
    timings = {}
    for label, params, grammar in (
        ("greedy (steps one ahead of the host)", greedy, False),
        ("sampled", sampled, False),
        ("greedy under the grammar", greedy, True),
        ("sampled under the grammar", sampled, True),
    ):
        c = e.grammars.compile(BENCH_GRAMMAR) if grammar else None
        r = e.generate(prompt, params, constraint=c)
        n = len(r.tokens)
        timings[label] = (r.decode_s / max(1, n - 1), r.mask_s / max(1, n))
    base = timings["sampled"][0]
    for label, (step, mask) in timings.items():
        print(f"\n{label}: {step * 1e6:,.0f} µs/token ({step / base - 1:+.1%} vs sampled), "
              f"mask {mask * 1e6:,.0f} µs/token on the host")  # fmt: skip
    e.close()


@pytest.fixture(scope="module")
def daemon(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StrataDaemon]:
    args = ["--model", str(model), "--device", "cuda:0", "--context-length", "2048",
            "--vram-monitor", "none"]  # fmt: skip
    d = StrataDaemon(tmp_path_factory.mktemp("daemon"), args)
    yield d
    if d.stop() != 0:
        print(d.log)


def test_required_tool_call_and_json_schema_through_the_daemon(daemon: StrataDaemon) -> None:
    assert "GPU decode: fused Triton kernels, one CUDA graph per step" in daemon.log
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    tools = [WEATHER, LIST_FILES]
    for seed in range(4):
        r = client.chat.completions.create(model=model, messages=ASK, tools=tools, seed=seed,
                                           tool_choice="required", parallel_tool_calls=False,
                                           max_tokens=300)  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message.content
        (call,) = choice.message.tool_calls
        params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    # streamed, a named function (parallel calls allowed, as by default): each call's id and
    # name first, then its arguments in pieces, under its own index
    calls: dict[int, list[Any]] = {}
    for chunk in client.chat.completions.create(
        model=model, messages=ASK, tools=tools, stream=True, max_tokens=300, seed=9,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ):  # fmt: skip
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            calls.setdefault(d.index, []).append(d)
    assert sorted(calls) == list(range(len(calls))) and calls, calls
    for deltas in calls.values():
        assert deltas[0].id and deltas[0].function.name == "get_weather"
        assert all(d.id is None and d.function.name is None for d in deltas[1:])
        args = "".join(d.function.arguments or "" for d in deltas)
        jsonschema.validate(json.loads(args), SCHEMA)
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    for seed in range(6):
        r = client.chat.completions.create(model=model, messages=ASK, response_format=fmt,
                                           seed=seed, max_tokens=400)  # fmt: skip
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
