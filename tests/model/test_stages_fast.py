"""The fast path over two stages, on the CPU in Triton's interpreter (the same kernels a GPU
compiles): each stage's decoder with its own tables, buffers and K/V over its layers, the hidden
state handed over. Its decode steps and prompt chunks give the same bits as one stage's, at
every residency (a cache per stage, host homes per stage), across a resize of one stage's
cache, and a stage's decoder cannot be bound to another stage's cache.

``tests/model/test_stages_gpu.py`` runs the same through ``Engine.load`` on a GPU, with CUDA
graphs per stage."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from strata.engine.experts.cache import ForeignLayer
from strata.engine.experts.provider import FileExpertProvider
from strata.engine.gguf_index import GGUFIndex
from strata.engine.models import architecture_module
from strata.engine.sequences import Runner
from strata.engine.stages import layer_ranges

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed")
from fastpath import PROMPT, decode, fast_runner, share_cache

from strata.engine.fast_decode import FastPathError
from strata.engine.fast_stages import StagedDecoder

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def staged_runner(
    path: Path,
    split: tuple[int, ...],
    cache_share: float | None = None,
    host: bool = False,
    prefill: bool = False,
) -> Runner:
    """As ``fastpath.fast_runner``, with the layers split into stages (all on DEVICE): one
    expert cache per stage over its layers, holding ``cache_share`` of them."""
    index = GGUFIndex(path)
    spans = layer_ranges(split)
    files = [FileExpertProvider(index, DEVICE) for _ in spans]
    stages = [(span, DEVICE) for span in spans]
    model = architecture_module(index.arch).Model(index, files[0], DEVICE, True, stages, files)
    runner = Runner(model, 64, "f32", 512)
    decoder = StagedDecoder(model, runner.stages)
    decoder.warm_up()
    if not prefill:
        decoder.prefill = None
    if cache_share is not None:
        for stage in runner.stages:
            model.providers[stage.number] = share_cache(index, cache_share, host, stage.layers)
    decoder.set_prefetch(0)
    decoder.bind_stages()
    runner.decoder = decoder  # type: ignore[assignment]
    return runner


@pytest.fixture(scope="module")
def q8(tiny_models) -> Path:
    return tiny_models.path("qwen3moe", "Q8_0")


@pytest.fixture(scope="module")
def one(q8: Path) -> Runner:
    """One stage: half the experts in VRAM slots, the rest in host homes, prompts on the
    prefill path."""
    return fast_runner(q8, 0.5, host=True, prefill=True)


@pytest.fixture(scope="module")
def two(q8: Path) -> Runner:
    """The same over two stages of 1 and 3 layers."""
    return staged_runner(q8, (1, 3), 0.5, host=True, prefill=True)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), f"step {i}: logits differ by {float((x - y).abs().max()):.2e}"


def test_staged_steps_and_prompts_are_one_stages_bit_for_bit(one: Runner, two: Runner) -> None:
    same(decode(one, 2, 11), decode(two, 2, 11))
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    assert torch.equal(two.logits_all(ids, [4, 6]), one.logits_all(ids, [4, 6]))


def test_each_stage_decoder_reads_its_own_cache_only(two: Runner) -> None:
    dec = two.decoder
    assert isinstance(dec, StagedDecoder)
    a, b = dec.parts
    assert (a.first, len(a.layers), b.first, len(b.layers)) == (0, 1, 1, 3)
    assert a.provider is two.stages[0].cache and b.provider is two.stages[1].cache
    assert a.kv is two.stages[0].kv and b.kv is two.stages[1].kv
    # each table has its own layers' entries only, planned from its own cache and tier
    assert a.plan.n_layer == 1 and b.plan.n_layer == 3 and a.plan.complete and b.plan.complete
    assert a.host_count + b.host_count > 0
    decode(two, 1, 2)
    for stage in two.stages:
        assert stage.cache is not None and stage.cache.totals
        assert {k[0] for k in stage.cache.totals} <= set(stage.layers)
    # a decoder of one stage bound to another's cache is refused, never a wrong read
    other = two.stages[0].cache
    assert other is not None
    with pytest.raises(FastPathError, match="given the cache of layers 0-0"):
        b.bind(other)
    assert b.provider is two.stages[1].cache
    with pytest.raises(ForeignLayer):
        other.record_counts({(2, 0): 1})


def test_a_resize_of_one_stage_rebuilds_only_its_tables_and_keeps_the_numbers(
    one: Runner, two: Runner
) -> None:
    steady = decode(one, 3, 5)
    dec = two.decoder
    assert isinstance(dec, StagedDecoder)
    cache = two.stages[1].cache
    assert cache is not None
    n = cache.n_slots
    two.rewind(0)
    got = [two.feed(PROMPT).cpu()]
    tok = 5
    for i in range(3):
        got.append(two.feed([tok]).cpu())
        tok = (tok * 31 + 7) % 500
        if i == 0:
            plan0 = dec.parts[0].plan
            cache.resize(cache.sizes.core_slots)  # stage 1 down to its core: RAM homes
            assert dec.parts[0].plan is plan0  # stage 0's tables untouched
            assert dec.parts[1].host_count > 0
        if i == 1:
            cache.resize(n)
    same(steady, got)


def test_engine_load_builds_a_decoder_per_stage(q8: Path, monkeypatch) -> None:
    """``Engine.load``'s wiring of the staged fast path (the GPU test's, without a GPU: the
    interpreter runs the kernels, and steps run eagerly as graphs need CUDA; prompts take the
    reference path here, ``test_staged_steps_and_prompts…`` covers the staged prefill)."""
    from strata.engine import loader
    from strata.engine.generate import Engine
    from strata.engine.options import EngineOptions
    from strata.engine.params import SamplingParams

    monkeypatch.setattr(loader, "unavailable_on_all", lambda index, devices, options: None)
    base = dict(kv_cache_type="f32", context_length=128, arena_chunk_mib=2, cache_mib=2,
                host_budget_mib=64, fast_prefill=False)  # fmt: skip
    one = Engine.load(q8, EngineOptions(**base))  # type: ignore[arg-type]
    two = Engine.load(q8, EngineOptions(**base, devices=("cpu", "cpu"), layer_split=(3, 1)))  # type: ignore[arg-type]
    try:
        dec = two.sequences.decoder
        assert isinstance(dec, StagedDecoder) and not two.sequences.can_look_ahead()
        assert two.sequences.decode_path() == (
            "fused Triton kernels over 2 stages, eager (CUDA graphs need a CUDA device)"
        )
        for part, stage in zip(dec.parts, two.stages, strict=True):
            assert part.provider is stage.cache and part.kv is stage.kv
            assert stage.cache is not None and stage.cache.kernel
            assert stage.cache.layers == stage.layers
            assert stage.cache.tier is not None and part.plan.complete
        greedy = SamplingParams(max_tokens=2, temperature=0.0)
        assert two.generate([1, 2, 3], greedy).tokens == one.generate([1, 2, 3], greedy).tokens
    finally:
        one.close()
        two.close()
    assert all(s.kv.arena.closed for s in two.stages)  # type: ignore[attr-defined]
