"""The fast path over two stages, on the CPU in Triton's interpreter (the same kernels a GPU
compiles): each stage's GPU runner with its own tables, buffers and K/V over its layers, the
hidden state handed over. Its decode steps and prompt chunks give the same bits as one stage's, at
every residency (a cache per stage, host homes per stage), across a resize of one stage's
cache, and a stage's runner cannot be bound to another stage's cache.

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
from strata.engine.sequences import Sequences, new_kvs
from strata.engine.stages import layer_ranges

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed")
from fastpath import PROMPT, decode, fast_runner, share_cache

from strata.engine.gpu.runner import GpuRunner
from strata.engine.gpu.tables import FastPathError

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def staged_runner(
    path: Path,
    split: tuple[int, ...],
    cache_share: float | None = None,
    host: bool = False,
    prefill: bool = False,
) -> Sequences:
    """As ``fastpath.fast_runner``, with the layers split into stages (all on DEVICE): one GPU
    runner per stage, with one expert cache per stage over its layers, holding ``cache_share``
    of them."""
    index = GGUFIndex(path)
    split_on = [(span, DEVICE) for span in layer_ranges(split)]
    model = architecture_module(index.arch).Model(index, DEVICE, repack=True, split=split_on)
    kvs = new_kvs(model, 64, "f32")
    stages = [
        GpuRunner(model, i, kv, FileExpertProvider(index, DEVICE)) for i, kv in enumerate(kvs)
    ]
    for stage in stages:
        stage.warm_up()
        if not prefill:
            stage.prefill = None
        provider = stage.provider
        if cache_share is not None:
            provider = share_cache(index, cache_share, host, stage.layers)
        stage.set_prefetch(0)
        stage.bind(provider)
    return Sequences(stages, 64, 512)


def gpu_stages(runner: Sequences) -> list[GpuRunner]:
    """The runner's stages, each a GPU runner (several: no single ``gpu``)."""
    assert runner.gpu is None and runner.decodes_on_gpu
    stages = [s for s in runner.stages if isinstance(s, GpuRunner)]
    assert len(stages) == len(runner.stages) > 1
    return stages


@pytest.fixture(scope="module")
def q8(tiny_models) -> Path:
    return tiny_models.path("qwen3moe", "Q8_0")


@pytest.fixture(scope="module")
def one(q8: Path) -> Sequences:
    """One stage: half the experts in VRAM slots, the rest in host homes, prompts on the
    prefill path."""
    return fast_runner(q8, 0.5, host=True, prefill=True)


@pytest.fixture(scope="module")
def two(q8: Path) -> Sequences:
    """The same over two stages of 1 and 3 layers."""
    return staged_runner(q8, (1, 3), 0.5, host=True, prefill=True)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), f"step {i}: logits differ by {float((x - y).abs().max()):.2e}"


def test_staged_steps_and_prompts_are_one_stages_bit_for_bit(
    one: Sequences, two: Sequences
) -> None:
    same(decode(one, 2, 11), decode(two, 2, 11))
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    assert torch.equal(two.logits_all(ids, [4, 6]), one.logits_all(ids, [4, 6]))


def test_each_stage_runner_reads_its_own_cache_only(two: Sequences) -> None:
    a, b = gpu_stages(two)
    assert (a.layers.start, len(a.layers), b.layers.start, len(b.layers)) == (0, 1, 1, 3)
    # each runner is bound to its own stage's cache (the tables follow it), over its layers
    assert a.cache is not None and b.cache is not None and a.cache is not b.cache
    assert a.cache.layers == a.layers and b.cache.layers == b.layers
    assert a.on_cache_change in a.cache.listeners and b.on_cache_change in b.cache.listeners
    assert a.on_cache_change not in b.cache.listeners
    assert b.on_cache_change not in a.cache.listeners
    assert a.kv is not b.kv and a.kv.n_layer == 1 and b.kv.n_layer == 3
    # each table has its own layers' entries only, planned from its own cache and tier
    assert a.plan.n_layer == 1 and b.plan.n_layer == 3 and a.plan.complete and b.plan.complete
    assert a.tables.host_count + b.tables.host_count > 0
    decode(two, 1, 2)
    for stage in two.stages:
        assert stage.cache is not None and stage.cache.totals
        assert {k[0] for k in stage.cache.totals} <= set(stage.layers)
    # a runner of one stage bound to another's cache is refused, never a wrong read
    other = a.cache
    with pytest.raises(FastPathError, match="given the cache of layers 0-0"):
        b.bind(other)
    assert b.provider is b.cache and b.cache is not other
    assert b.on_cache_change not in other.listeners
    with pytest.raises(ForeignLayer):
        other.record_counts({(2, 0): 1})


def test_a_resize_of_one_stage_rebuilds_only_its_tables_and_keeps_the_numbers(
    one: Sequences, two: Sequences
) -> None:
    steady = decode(one, 3, 5)
    first, second = gpu_stages(two)
    cache = second.cache
    assert cache is not None
    n = cache.n_slots
    two.rewind(0)
    got = [two.feed(PROMPT).cpu()]
    tok = 5
    for i in range(3):
        got.append(two.feed([tok]).cpu())
        tok = (tok * 31 + 7) % 500
        if i == 0:
            plan0 = first.plan
            cache.resize(cache.sizes.core_slots)  # stage 1 down to its core: RAM homes
            assert first.plan is plan0  # stage 0's tables untouched
            assert second.tables.host_count > 0
        if i == 1:
            cache.resize(n)
    same(steady, got)


def test_engine_load_builds_a_gpu_runner_per_stage(q8: Path, monkeypatch) -> None:
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
        stages = gpu_stages(two.sequences)
        assert not two.sequences.can_look_ahead()
        assert two.sequences.decode_path() == (
            "fused Triton kernels over 2 stages, eager (CUDA graphs need a CUDA device)"
        )
        assert [s.layers for s in stages] == [range(0, 3), range(3, 4)]
        assert [s.kv.n_layer for s in stages] == [3, 1] and stages[0].kv is not stages[1].kv
        for stage in stages:
            # the runner's tables follow its own stage's cache (bound by the loader)
            assert stage.cache is not None and stage.on_cache_change in stage.cache.listeners
            assert stage.cache.kernel and stage.cache.layers == stage.layers
            assert stage.cache.tier is not None and stage.plan.complete
        greedy = SamplingParams(max_tokens=2, temperature=0.0)
        assert two.generate([1, 2, 3], greedy).tokens == one.generate([1, 2, 3], greedy).tokens
    finally:
        one.close()
        two.close()
    assert all(s.kv.arena.closed for s in two.stages)  # type: ignore[attr-defined]
