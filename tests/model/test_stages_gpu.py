"""Two stages on one GPU through ``Engine.load``, on the fast path: the fused decode kernels with
one CUDA graph per stage, prompt chunks on tensor cores (captured per stage), each stage with its
own expert cache, host-tier share and K/V. The logits and the text are those of one stage, bit
for bit (the same kernels, each sum in one order, the hidden state copied exactly), at every
residency and across a resize of one stage's cache mid-generation.

Two stages on ``cuda:0`` exercise everything a stage owns; with two GPUs
(``STRATA_TEST_SECOND_GPU=cuda:1``) the second stage goes on the second card instead.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from fastpath import forced_logits

from strata.engine.experts.cache import ExpertCache
from strata.engine.generate import Engine
from strata.engine.gpu.runner import GpuRunner
from strata.engine.options import EngineOptions
from strata.engine.params import SamplingParams

pytestmark = pytest.mark.gpu
MiB = 2**20
GREEDY = SamplingParams(max_tokens=40, temperature=0.0)
SEEDED = SamplingParams(max_tokens=40, temperature=1.0, top_k=0, top_p=0.95, min_p=0.0, seed=5)


@pytest.fixture(scope="module")
def cuda() -> tuple[str, str]:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    return "cuda:0", os.environ.get("STRATA_TEST_SECOND_GPU", "cuda:0")


def load(path: Path, devices: tuple[str, ...] | None, **kw) -> Engine:
    # cpu_share 0: the CPU's sums round differently from the GPU's, and which experts sit in RAM
    # (a stage's resize, an automatic share timed per load) would change the logits' last bits
    options = dict(kv_cache_type="f32", context_length=256, arena_chunk_mib=2, cpu_share=0.0,
                   cache_mib=0)  # fmt: skip
    if devices is None:
        options["device"] = "cuda:0"
    else:
        options["devices"] = devices  # type: ignore[assignment]
    options.update(kw)
    return Engine.load(path, EngineOptions(**options))  # type: ignore[arg-type]


def generate(e: Engine, params: SamplingParams) -> list[int]:
    e.sequences.rewind(0)
    return e.generate([1, 2, 3, 4, 5, 6], params).tokens


def gpu_stages(e: Engine) -> list[GpuRunner]:
    """The engine's stages, each a GPU runner (several: no single ``gpu``)."""
    assert e.sequences.gpu is None and e.sequences.decodes_on_gpu
    stages = [s for s in e.stages if isinstance(s, GpuRunner)]
    assert len(stages) == len(e.stages) > 1
    return stages


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), f"step {i}: logits differ by {float((x - y).abs().max()):.2e}"


def test_two_stages_take_the_fast_path_with_a_graph_each(tiny_models, cuda, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="strata.engine.generate"):
        e = load(tiny_models.path("qwen3moe", "Q4_K_M"), cuda, layer_split=(1, 3), cache_mib=64)
    try:
        stages = gpu_stages(e)
        assert len(stages) == 2
        assert [s.device for s in stages] == [torch.device(c) for c in cuda]
        for stage in stages:
            assert stage.graph is not None and stage.kv.n_layer == len(stage.layers)
            assert stage.kv.device == stage.device
            assert stage.prefill is not None and stage.prefill.graphs  # captured chunk graphs
            assert isinstance(stage.cache, ExpertCache) and stage.cache.kernel
            assert stage.cache.layers == stage.layers
            assert stage.on_cache_change in stage.cache.listeners  # its tables follow its cache
        assert e.sequences.decode_path() == (
            "fused Triton kernels, one CUDA graph per stage per step (2 stages)"
        )
        assert e.sequences.prefill_path().startswith("matrix products on tensor cores")
        assert f"layers 0 on {cuda[0]}, 1-3 on {cuda[1]}" in caplog.text
    finally:
        e.close()


@pytest.mark.parametrize("model", ["qwen3moe", "mixtral"])
@pytest.mark.parametrize("residency", ["all", "half+host", "host"])
def test_two_stages_give_one_stages_logits_and_tokens(tiny_models, cuda, model, residency) -> None:
    path = tiny_models.path(model, "Q4_K_M")
    kw = {
        "all": dict(cache_mib=1 << 20, host_budget_mib=0),
        "half+host": dict(cache_mib=8, host_budget_mib=256),
        "host": dict(cache_mib=0, host_budget_mib=256),
    }[residency]
    one = load(path, None, **kw)
    two = load(path, cuda, layer_split=(2, 2), **kw)
    try:
        assert one.sequences.gpu is not None and len(gpu_stages(two)) == 2
        prompt = [1, 50, 300, 7, 9, 2000, 31] * 20  # 140 tokens: a prompt chunk on the GPU
        same(forced_logits(one, prompt, 12), forced_logits(two, prompt, 12))
        for params in (GREEDY, SEEDED):
            assert generate(two, params) == generate(one, params)
    finally:
        one.close()
        two.close()


def test_one_stages_budget_resizes_only_its_cache_mid_generation(tiny_models, cuda) -> None:
    path = tiny_models.path("qwen3moe", "Q4_K_M")
    kw = dict(cache_mib=1 << 20, host_budget_mib=256)
    one = load(path, None, **kw)
    two = load(path, cuda, layer_split=(2, 2), **kw)
    try:
        prompt = [4, 5, 6, 7]
        want = forced_logits(one, prompt, 10)
        a, b = gpu_stages(two)
        assert a.cache is not None and b.cache is not None
        full, slots_a, plan0 = b.cache.n_slots, a.cache.n_slots, a.plan
        two.sequences.rewind(0)
        got = [two.sequences.feed(prompt).cpu()]
        tok = 17
        for i in range(10):
            got.append(two.sequences.feed([tok]).cpu())
            tok = (tok * 131 + 3) % 2000
            if i == 2:  # stage 1 down to its core: its evicted experts move to its RAM homes
                small = b.kv.mapped_bytes + b.cache.mapped_bytes_for(b.cache.sizes.core_slots)
                b.cache.resize(two.set_budget(small, stage=1))
                assert b.cache.n_slots < full and b.budget == small
                assert b.tables.host_count > 0 and b.plan.complete
            if i == 6:  # and back
                b.cache.resize(two.set_budget(b.kv.mapped_bytes + 1024 * MiB, stage=1))
                assert b.cache.n_slots == full
        same(want, got)
        assert a.cache.n_slots == slots_a  # stage 0 never moved
        assert a.plan is plan0
    finally:
        one.close()
        two.close()
