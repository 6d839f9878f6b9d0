"""The hybrids (qwen35moe, qwen3next) on the GPU runner: DeltaNet layers, gated attention with
partial/sectioned RoPE and the shared expert through the fast operations (``gpu.delta``),
against the reference path on tiny Q8_0 files.

Tolerances: decode steps (after a prompt read by the reference operations) within 1e-5 of the
reference's logits, relative to the largest (float32 throughout: the same arithmetic in
another order); prompt chunks within 1e-2 (their products take float16 inputs on tensor cores,
as every architecture's chunks do: ``test_fast_prefill``). Residency never changes a step's
numbers (every expert staged, half cached, all cached: the same bits). A look-ahead stopped
with a step run ahead leaves the state to be restored from its checkpoint, never trusted.

On the CPU in Triton's interpreter (CI) on small shapes; the ``gpu`` test runs the same on the
device with the prompt chunks' graphs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata.engine.synth_hybrid import ARCHS, HybridSpec, write_hybrid

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed")
from fastpath import PROMPT, decode, fast_runner, reference_runner, worst

TOL = 1e-5
CHUNK_TOL = 1e-2
# small enough for the interpreter: 2 DeltaNet and 2 gated-attention layers, 2 k / 4 v heads
SMALL = dict(n_embd=128, n_ff_exp=64, n_ff_shexp=64)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid-fast")
    return {
        arch: write_hybrid(root / f"{arch}.gguf", HybridSpec(arch, **SMALL), Q.Q8_0)
        for arch in ARCHS
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_fast_steps_and_chunks_agree_with_the_reference_path(arch: str, files) -> None:
    path = files[arch]
    ref = decode(reference_runner(path), 3, 11)
    fast = decode(fast_runner(path, 1.0), 3, 11)
    assert torch.equal(ref[0], fast[0]), "the prompt takes the reference path"
    for a, b in zip(ref[1:], fast[1:], strict=True):
        assert worst(a[None], b[None], TOL) < TOL
    chunks = decode(fast_runner(path, 1.0, prefill=True), 3, 11)
    for a, b in zip(ref, chunks, strict=True):
        assert worst(a[None], b[None], CHUNK_TOL) < CHUNK_TOL


def test_residency_never_changes_the_numbers(files) -> None:
    path = files["qwen35moe"]
    none, half, every = (decode(fast_runner(path, s), 2, 23) for s in (None, 0.5, 1.0))
    for a, b, c in zip(none[1:], half[1:], every[1:], strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_a_look_ahead_stopped_early_leaves_a_state_restored_from_its_checkpoint(files) -> None:
    path = files["qwen3next"]
    fast = fast_runner(path, 1.0)
    fast.rewind(0)
    fast.feed(PROMPT)
    run = fast.ahead(3, 10)
    got = [next(run)[0] for _ in range(3)]  # the fourth step already runs ahead
    run.close()
    state = fast.states[0]
    assert state.dirty, "the state holds a step whose token was never committed"
    n = len(fast.tokens)
    fast.rewind(n)  # from the prompt's checkpoint, the fed tokens read again
    assert not state.dirty and len(state.tokens) == n
    after = fast.feed([got[-1]]).cpu()
    ref = reference_runner(path)
    ref.rewind(0)
    ref.feed(PROMPT)
    for t in [3, *got[:-1]]:
        ref.feed([t])
    want = ref.feed([got[-1]]).cpu()
    assert worst(want[None], after[None], TOL) < TOL
    # stopped early again, then fed on at once (a grammar that failed after the step ran
    # ahead): the runner itself goes back to the checkpoint and reads the tokens again
    fast.rewind(len(PROMPT))
    run = fast.ahead(3, 10)
    assert [next(run)[0] for _ in range(3)] == got
    run.close()
    assert state.dirty
    assert worst(want[None], fast.feed([got[-1]]).cpu()[None], TOL) < TOL


def test_the_gpu_path_takes_the_hybrids(files) -> None:
    from strata.engine.fast_path import fast_path_unavailable
    from strata.engine.gguf_index import GGUFIndex
    from strata.engine.options import EngineOptions

    for arch in ARCHS:
        index = GGUFIndex(files[arch])
        assert fast_path_unavailable(index, torch.device("cuda"), EngineOptions()) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ARCHS)
def test_on_the_device_with_graphs(arch: str, files) -> None:
    path = files[arch]
    ref = decode(reference_runner(path), 6, 11)
    fast = fast_runner(path, 1.0, prefill=True)
    fast.gpu.capture()
    fast.gpu.capture_chunks(64)
    got = decode(fast, 6, 11)
    for a, b in zip(ref, got, strict=True):
        assert worst(a[None], b[None], CHUNK_TOL) < CHUNK_TOL
    steps = decode(fast_runner(path, 1.0), 6, 11)
    for a, b in zip(ref[1:], steps[1:], strict=True):
        assert worst(a[None], b[None], TOL) < TOL


def _load(path: Path, **kw):
    from strata.engine.generate import Engine
    from strata.engine.options import EngineOptions

    options = dict(device="cuda:0", kv_cache_type="f32", context_length=512, arena_chunk_mib=2,
                   cache_mib=1 << 20, cpu_share=0.0)  # fmt: skip
    options.update(kw)
    return Engine.load(path, EngineOptions(**options))  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ARCHS)
def test_through_the_engine_on_the_device(arch: str, files) -> None:
    from fastpath import forced_logits

    from strata.engine.params import SamplingParams

    path = files[arch]
    fast = _load(path, fast_prefill=False)
    ref = _load(path, fast_decode=False)
    assert fast.sequences.gpu is not None and fast.sequences.gpu.graph is not None
    prompt = [1, 50, 300, 7, 9, 2000, 31]
    for a, b in zip(forced_logits(ref, prompt, 24)[1:], forced_logits(fast, prompt, 24)[1:],
                    strict=True):  # fmt: skip
        assert worst(a[None], b[None], TOL) < TOL
    # graphs on and off, greedy (run ahead) and sampled: the same text
    eager = _load(path, enforce_eager=True, fast_prefill=False)
    chat = SamplingParams(max_tokens=40, temperature=0.7, top_k=40, top_p=0.95, seed=6)
    for params in (SamplingParams(max_tokens=40, temperature=0.0), chat):
        texts = []
        for e in (fast, eager):
            e.sequences.rewind(0)
            texts.append(e.generate(prompt, params).tokens)
        assert texts[0] == texts[1]
    # residency: every expert cached, half, none (cpu_share 0) give the same bits
    steps = [forced_logits(_load(path, cache_mib=mib, fast_prefill=False), prompt, 8)
             for mib in (1 << 20, 1, 0)]  # fmt: skip
    for a, b, c in zip(*steps, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def _across_a_shrink(e, prompt: list[int], params) -> tuple[list[int], list[int], int]:
    """The tokens of ``params`` steady, then with the cache shrunk to its core at the 6th safe
    point and grown back at the 20th: (steady, resized, safe points)."""
    cache = e.cache
    assert cache is not None and cache.n_slots == cache.max_slots
    e.sequences.rewind(0)
    steady = e.generate(prompt, params).tokens
    calls = 0

    def resize() -> None:
        nonlocal calls
        calls += 1
        if calls == 6:
            cache.resize(cache.sizes.core_slots)
            assert not e.sequences.gpu.tables.plan.complete, "the shrink left no miss"
        elif calls == 20:
            cache.resize(cache.max_slots)
            assert e.sequences.gpu.tables.plan.complete

    e.sequences.rewind(0)
    return steady, e.generate(prompt, params, safe_point=resize).tokens, calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_shrink_and_a_grow_mid_generation_change_no_token(tmp_path: Path) -> None:
    from strata.engine.params import SamplingParams

    # experts that fill ~50 MiB of slots (the small files' fit in one arena chunk: a shrink to
    # the core would keep them all), misses staged from the file
    spec = HybridSpec("qwen35moe", n_ff_exp=1024, n_expert=16, n_expert_used=4)
    path = write_hybrid(tmp_path / "wide.gguf", spec, Q.Q8_0)
    e = _load(path, host_budget_mib=0, fast_prefill=False)
    try:
        for params in (
            SamplingParams(max_tokens=40, temperature=0.0),
            SamplingParams(max_tokens=40, temperature=0.7, top_k=40, top_p=0.95, seed=6),
        ):
            steady, resized, calls = _across_a_shrink(e, [1, 50, 300, 7, 9, 2000, 31], params)
            assert resized == steady and calls > 20
    finally:
        e.close()
