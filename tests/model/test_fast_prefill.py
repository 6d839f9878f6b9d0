"""The GPU prefill path end to end, on the CPU in Triton's interpreter (CI) and compiled on a GPU:
a prompt's logits against the reference path's and against token-by-token decoding, the same
bits whatever the cache holds, chunked and one-shot prompts alike, and the expert uses it counts.

Tolerance: the products run in float16 with float32 sums (``kernels.gemm``), so a prompt's
logits differ from the reference path's (float32 throughout) by at most 1e-2 of their largest
magnitude over the test models' layers (measured near 2e-3), and the top token is the same
wherever the reference's top-2 margin exceeds twice that.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from strata.engine.sequences import Sequences

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed")
from fastpath import fast_runner, reference_runner, worst

TOL = 1e-2
PROMPT = [1, 5, 9, 100, 7, 300, 2, 44, 18, 260, 3, 77]


@pytest.fixture(scope="module")
def q8(tiny_models) -> Path:
    return tiny_models.path("qwen3moe", "Q8_0")


def step_by_step(runner: Sequences, ids: list[int]) -> torch.Tensor:
    runner.rewind(0)
    return torch.stack([runner.feed([t]).cpu() for t in ids])


@pytest.mark.parametrize(("model", "kind"), [("qwen3moe", "Q8_0"), ("mixtral", "F16")])
def test_prompt_logits_stay_within_tolerance_of_the_reference(tiny_models, model, kind) -> None:
    path = tiny_models.path(model, kind)
    fast = fast_runner(path, 1.0, prefill=True)
    assert fast.gpu is not None and fast.gpu.prefill is not None
    ref = reference_runner(path).logits_all(PROMPT)
    got = fast.logits_all(PROMPT)
    err = worst(ref, got, TOL)
    print(f"\n{model} {kind}: worst relative logit difference {err:.2e}")
    assert err < TOL


def test_a_prefill_agrees_with_token_by_token_decoding(q8: Path) -> None:
    fast = fast_runner(q8, 1.0, prefill=True)
    chunk = fast.logits_all(PROMPT)
    steps = step_by_step(fast, PROMPT)
    assert worst(steps, chunk, TOL) < TOL
    # and the decode steps after a prefill read the K/V it wrote
    fast.rewind(0)
    fast.feed(PROMPT[:8])
    after = torch.stack([fast.feed([t]).cpu() for t in PROMPT[8:]])
    assert worst(steps[8:], after, TOL) < TOL


def test_residency_never_changes_a_prompts_numbers(q8: Path) -> None:
    # every expert staged in rounds, half of them, none: the same kernels read them all
    none, half, every = (
        fast_runner(q8, s, prefill=True).logits_all(PROMPT) for s in (None, 0.5, 1.0)
    )
    for name, got in (("half", half), ("every", every)):
        diff = (got - none).abs()
        rows = (diff.amax(dim=1) > 0).nonzero().flatten().tolist()
        assert not rows, f"{name}: rows {rows} differ, by up to {float(diff.max()):.3e}"


def test_experts_in_ram_homes_give_a_prompt_the_same_numbers(q8: Path, monkeypatch) -> None:
    from strata.engine.gpu import chunk

    monkeypatch.setattr(chunk, "STAGE_SLOTS", 3)  # several rounds of copies per layer
    prompt = [(7 * i + 3) % 500 for i in range(chunk.STAGE_MIN_TOKENS + 4)]
    staged = fast_runner(q8, None, prefill=True)  # every expert staged from the file
    want, short = staged.logits_all(prompt), staged.logits_all(prompt[:12])
    for share in (0.5, 0.0):
        runner = fast_runner(q8, share, prefill=True, host=True)
        assert runner.gpu is not None and runner.gpu.plan.complete
        assert runner.gpu.tables.host_count > 0
        # long chunks copy their RAM homes into VRAM; short ones read them where they are
        assert torch.equal(runner.logits_all(prompt), want), f"cache share {share}"
        assert torch.equal(runner.logits_all(prompt[:12]), short), f"short, {share}"
        stats = runner.stages[0].provider.stats
        assert stats.bytes_from_ram > 0 and stats.bytes_from_file == 0


def test_uneven_chunks_agree_with_one_chunk(q8: Path) -> None:
    fast = fast_runner(q8, 1.0, prefill=True)
    one = fast.logits_all(PROMPT)
    uneven = fast.logits_all(PROMPT, chunks=[1, 4, 2, 5])
    assert worst(one, uneven, TOL) < TOL
    assert fast.kv.length == len(PROMPT) and fast.tokens == PROMPT


def test_a_prompts_expert_uses_reach_the_provider(q8: Path) -> None:
    fast = fast_runner(q8, 1.0, prefill=True)
    provider = fast.stages[0].provider
    totals, stats = provider.totals, provider.stats
    before, hits = sum(totals.values()), stats.hits
    fast.rewind(0)
    fast.feed(PROMPT)
    fast.flush_usage()
    shape = fast.model.shape
    n_layer, r = shape.n_layer, shape.routing
    assert sum(totals.values()) - before == len(PROMPT) * n_layer * r.n_used
    assert n_layer * r.n_used <= stats.hits - hits <= n_layer * r.n_expert
    assert stats.misses == 0
