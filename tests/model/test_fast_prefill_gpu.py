"""The GPU prefill path through ``Engine.load``: it is chosen and logged, a prompt's logits stay
within a stated tolerance of the reference path's and of token-by-token decoding on every test
file, the numbers are the same at every cache size, a long prompt is cancelled between chunks,
and kernels that fail to build leave the reference prefill with one warning.

Tolerance: the products run in float16 with float32 sums, so a prompt's logits differ from the
reference path's by at most 1e-2 of their largest magnitude (``test_fast_prefill``'s bound), and
the top token is the same wherever the reference's top-2 margin exceeds twice that.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from fastpath import worst

from strata.engine.generate import Engine
from strata.engine.gpu.chunk import ChunkPath
from strata.engine.options import EngineOptions
from strata.engine.params import SamplingParams

pytestmark = pytest.mark.gpu
TOL = 1e-2
KINDS = ["F32", "Q8_0", "Q4_K_M", "Q6_K"]
PROMPT = [1, 50, 300, 7, 9, 2000, 31, 4, 88, 1200, 17, 640, 3, 3, 95, 41, 700, 12, 5, 260]


@pytest.fixture(scope="module")
def cuda() -> str:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    return "cuda:0"


def load(path: Path, cuda: str, **kw) -> Engine:
    options = dict(device=cuda, context_length=256, arena_chunk_mib=2, cache_mib=1 << 20)
    options.update(kw)
    return Engine.load(path, EngineOptions(**options))  # type: ignore[arg-type]


def test_the_gpu_prefills_on_tensor_cores_and_says_so(tiny_models, cuda, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="strata.engine.generate"):
        e = load(tiny_models.path("qwen3moe", "Q4_K_M"), cuda)
    assert e.sequences.gpu is not None and e.sequences.gpu.prefill is not None
    assert "GPU prefill: matrix products on tensor cores" in caplog.text
    e.close()


@pytest.mark.parametrize("model", ["qwen3moe", "mixtral"])
@pytest.mark.parametrize("kind", KINDS)
def test_prompt_logits_stay_within_tolerance_of_the_reference_path(
    tiny_models, cuda, model, kind
) -> None:
    path = tiny_models.path(model, kind)
    fast, ref = load(path, cuda), load(path, cuda, fast_decode=False)
    assert fast.sequences.gpu is not None and not ref.sequences.decodes_on_gpu
    a, b = ref.sequences.logits_all(PROMPT), fast.sequences.logits_all(PROMPT)
    err = worst(a, b, TOL)
    print(f"\n{model} {kind}: worst relative logit difference {err:.2e}")
    assert err < TOL
    chunked = fast.sequences.logits_all(PROMPT, chunks=[3, 9, 1, 7])
    assert worst(a, chunked, TOL) < TOL
    fast.close()
    ref.close()


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q8_0"])
def test_a_prefill_agrees_with_token_by_token_decoding(tiny_models, cuda, kind) -> None:
    e = load(tiny_models.path("qwen3moe", kind), cuda)
    chunk = e.sequences.logits_all(PROMPT)
    e.sequences.rewind(0)
    steps = torch.stack([e.sequences.feed([t]).cpu() for t in PROMPT])
    err = worst(steps, chunk, TOL)
    print(f"\n{kind}: prefill against decode steps {err:.2e}")
    assert err < TOL
    e.close()


def test_a_prompts_numbers_are_the_same_at_every_cache_size(tiny_models, cuda) -> None:
    path = tiny_models.path("qwen3moe", "Q4_K_M")
    every = load(path, cuda)
    assert every.cache is not None
    all_mib = -(-every.cache.n_slots * every.cache.slot_bytes // 2**20) + 2
    want = every.sequences.logits_all(PROMPT)
    every.close()
    for mib in (all_mib // 2, 0):
        for host in (0, 256):  # misses staged from the file; read from host homes over PCIe
            e = load(path, cuda, cache_mib=mib, host_budget_mib=host)
            assert e.sequences.gpu is not None
            assert e.sequences.gpu.plan.complete == (host > 0)
            got = e.sequences.logits_all(PROMPT)
            assert torch.equal(got, want), f"cache of {mib} MiB, host tier of {host} MiB"
            e.close()


def test_chunk_graphs_give_the_numbers_of_eager_chunks(tiny_models, cuda) -> None:
    path = tiny_models.path("qwen3moe", "Q4_K_M")
    graphs = load(path, cuda, prefill_chunk_tokens=8)
    eager = load(path, cuda, prefill_chunk_tokens=8, enforce_eager=True)
    g, n = graphs.sequences.gpu, eager.sequences.gpu
    assert g is not None and n is not None
    assert g.prefill is not None and n.prefill is not None
    assert set(g.prefill.graphs) == {8}
    assert not n.prefill.graphs
    for prompt in (PROMPT, PROMPT[:16], PROMPT[:5]):  # 8 + 8 + 4 (padded), 8 + 8, 5 (padded)
        graphs.sequences.rewind(0)
        eager.sequences.rewind(0)
        assert torch.equal(graphs.sequences.feed(prompt), eager.sequences.feed(prompt))
        greedy = SamplingParams(max_tokens=6, temperature=0.0)
        graphs.sequences.rewind(0)
        eager.sequences.rewind(0)
        assert graphs.generate(prompt, greedy).tokens == eager.generate(prompt, greedy).tokens
    graphs.close()
    eager.close()


def test_chunk_graphs_write_the_pages_the_kv_maps_after_their_capture(tiny_models, cuda) -> None:
    """The graphs are captured while the K/V holds its first chunk; a prompt that makes it map
    more puts pages beyond the ones that existed then in the block table, and the replayed
    chunks still write and read them (the pages are written between the segments, through the
    view the K/V has now)."""
    path = tiny_models.path("qwen3moe", "Q4_K_M")
    opts = dict(prefill_chunk_tokens=256, context_length=4096)
    graphs, eager = load(path, cuda, **opts), load(path, cuda, enforce_eager=True, **opts)
    try:
        kv = graphs.sequences.kv
        first = kv.mapped_bytes
        prompt = [(7 + 131 * i) % 2000 + 3 for i in range(1800)]  # 7 chunks and a padded one
        assert kv.context_bytes(len(prompt)) > first, "the prompt must outgrow the first chunk"
        assert torch.equal(graphs.sequences.feed(prompt), eager.sequences.feed(prompt))
        assert kv.mapped_bytes > first
        greedy = SamplingParams(max_tokens=6, temperature=0.0)
        graphs.sequences.rewind(0)
        eager.sequences.rewind(0)
        assert graphs.generate(prompt, greedy).tokens == eager.generate(prompt, greedy).tokens
    finally:
        graphs.close()
        eager.close()


def test_a_long_prompt_is_cancelled_between_chunks(tiny_models, cuda) -> None:
    e = load(tiny_models.path("qwen3moe", "Q4_K_M"), cuda, prefill_chunk_tokens=16)
    prompt = (PROMPT * 5)[:100]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    points: list[int] = []
    r = e.generate(
        prompt, greedy, cancelled=lambda: len(points) >= 2, safe_point=lambda: points.append(1)
    )
    assert r.finish_reason == "cancelled" and r.tokens == []
    assert e.sequences.tokens == prompt[:32]
    resumed = e.generate(prompt, greedy).tokens  # feeds the 68 tokens left
    e.sequences.rewind(0)
    assert resumed == e.generate(prompt, greedy).tokens
    e.close()


def test_prefill_kernels_that_fail_to_build_leave_the_reference_prefill(
    tiny_models, cuda, caplog, monkeypatch
) -> None:
    def broken(self) -> None:
        raise RuntimeError("no tensor-core compiler here")

    monkeypatch.setattr(ChunkPath, "warm_up", broken)
    with caplog.at_level(logging.WARNING):
        e = load(tiny_models.path("qwen3moe", "Q4_K_M"), cuda)
    assert e.sequences.gpu is not None and e.sequences.gpu.prefill is None
    warnings = [r for r in caplog.records if "prefill kernels failed to build" in r.getMessage()]
    assert len(warnings) == 1
    assert "RuntimeError: no tensor-core compiler here" in warnings[0].getMessage()
    assert e.sequences.prefill_path().startswith("reference path")
    assert len(e.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0.0)).tokens) == 4
    e.close()
