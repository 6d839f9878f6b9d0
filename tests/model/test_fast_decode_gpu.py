"""The fast decode path through ``Engine.load`` on a GPU: it is chosen, its logits stay within a
stated tolerance of the reference path's on every test file, and its text is the same with and
without CUDA graphs, at every cache size and across a shrink and a grow mid-generation.

Tolerance: one decode step's logits differ from the reference path's by at most 1e-4 of their
largest magnitude (float32 sums in another order, over the layers; measured near 1e-6), and the
top token is the same wherever the reference's top-2 margin exceeds twice that.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from fastpath import forced_logits

from strata.engine.experts.cache import ExpertCache
from strata.engine.generate import Engine
from strata.engine.options import EngineOptions
from strata.engine.params import SamplingParams
from strata.engine.sampling import Sampler

pytestmark = pytest.mark.gpu
MiB = 2**20
TOL = 1e-4
KINDS = ["F32", "Q8_0", "Q4_K_M", "Q6_K"]


@pytest.fixture(scope="module")
def cuda() -> str:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    return "cuda:0"


def load(path: Path, cuda: str, **kw) -> Engine:
    options = dict(device=cuda, kv_cache_type="f32", context_length=256, arena_chunk_mib=2,
                   cache_mib=0)  # fmt: skip
    options.update(kw)
    return Engine.load(path, EngineOptions(**options))  # type: ignore[arg-type]


def all_mib(path: Path, cuda: str) -> int:
    e = load(path, cuda, cache_mib=1 << 20)
    assert e.cache is not None and e.cache.n_slots == e.cache.max_slots
    mib = -(-e.cache.n_slots * e.cache.slot_bytes // MiB) + 2
    e.close()
    return mib


def test_the_gpu_takes_the_fast_path_and_says_so(tiny_models, cuda, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="strata.engine.generate"):
        e = load(tiny_models.path("qwen3moe", "Q4_K_M"), cuda, cache_mib=64)
    assert e.sequences.gpu is not None
    assert e.sequences.decode_path().startswith("fused Triton kernels, one CUDA graph per step")
    assert "GPU decode: fused Triton kernels, one CUDA graph per step" in caplog.text
    assert isinstance(e.cache, ExpertCache) and e.cache.kernel
    e.close()


@pytest.mark.parametrize("model", ["qwen3moe", "mixtral"])
@pytest.mark.parametrize("kind", KINDS)
def test_fast_logits_stay_within_tolerance_of_the_reference_path(
    tiny_models, cuda, model, kind
) -> None:
    path = tiny_models.path(model, kind)
    # the prompt through the reference path in both: this test bounds the decode steps alone
    fast = load(path, cuda, cache_mib=1 << 20, fast_prefill=False)
    ref = load(path, cuda, cache_mib=1 << 20, fast_decode=False)
    assert fast.sequences.gpu is not None and not ref.sequences.decodes_on_gpu
    prompt = [1, 50, 300, 7, 9, 2000, 31]
    a, b = forced_logits(ref, prompt, 24), forced_logits(fast, prompt, 24)
    worst = 0.0
    for la, lb in zip(a[1:], b[1:], strict=True):
        err = float((la - lb).abs().max() / la.abs().max())
        worst = max(worst, err)
        top2 = torch.topk(la, 2).values
        if float(top2[0] - top2[1]) > 2 * TOL * float(la.abs().max()):
            assert int(la.argmax()) == int(lb.argmax())
    print(f"\n{model} {kind}: worst relative logit difference {worst:.2e}")
    assert worst < TOL
    fast.close()
    ref.close()


def generate(e: Engine, params: SamplingParams, safe_point=None) -> list[int]:
    e.sequences.rewind(0)
    return e.generate([1, 2, 3, 4, 5, 6], params, safe_point=safe_point).tokens


GREEDY = SamplingParams(max_tokens=40, temperature=0.0)
SEEDED = SamplingParams(max_tokens=40, temperature=1.0, top_k=0, top_p=0.95, min_p=0.0, seed=5)
# every filter on, the repeat penalty's window and the log-probabilities too
CHAT = SamplingParams(max_tokens=40, temperature=0.7, top_k=40, top_p=0.95, min_p=0.05,
                      repeat_penalty=1.1, seed=6, logprobs=3)  # fmt: skip


@pytest.mark.parametrize("params", [GREEDY, SEEDED, CHAT], ids=["greedy", "seeded", "chat"])
def test_text_is_the_same_with_graphs_on_and_off(tiny_models, cuda, params) -> None:
    path = tiny_models.path("qwen3moe", "Q4_K_M")
    graph = load(path, cuda, cache_mib=1 << 20)
    eager = load(path, cuda, cache_mib=1 << 20, enforce_eager=True)
    assert graph.sequences.gpu.graph is not None and eager.sequences.gpu.graph is None
    how = eager.sequences.decode_path()
    assert how.startswith("fused Triton kernels, eager (enforce_eager is set)"), how
    a, b = forced_logits(graph, [4, 5], 8), forced_logits(eager, [4, 5], 8)
    for la, lb in zip(a, b, strict=True):
        assert torch.equal(la, lb)
    assert generate(graph, params) == generate(eager, params)
    graph.close()
    eager.close()


def test_greedy_look_ahead_matches_one_step_at_a_time(tiny_models, cuda) -> None:
    e = load(tiny_models.path("qwen3moe", "Q6_K"), cuda, cache_mib=1 << 20)
    assert e.sequences.can_look_ahead()
    ahead = generate(e, GREEDY)
    e.sequences.rewind(0)
    tok = int(torch.argmax(e.sequences.feed([1, 2, 3, 4, 5, 6])))
    one_by_one = [tok]
    while len(one_by_one) < GREEDY.max_tokens:
        tok = int(torch.argmax(e.sequences.feed([tok])))
        one_by_one.append(tok)
    assert ahead == one_by_one
    e.close()


def test_sampled_look_ahead_matches_the_host_sampler(tiny_models, cuda) -> None:
    # the sampler as a graph after each step run ahead, and eagerly after each host step: the
    # same tokens and log-probabilities
    e = load(tiny_models.path("qwen3moe", "Q6_K"), cuda, cache_mib=1 << 20)
    assert e.sequences.can_look_ahead()
    e.sequences.rewind(0)
    r = e.generate([1, 2, 3, 4, 5, 6], CHAT)
    e.sequences.rewind(0)
    host = Sampler(CHAT, [1, 2, 3, 4, 5, 6])
    tok, entry = host.choose(e.sequences.feed([1, 2, 3, 4, 5, 6]))
    tokens, entries = [tok], [entry]
    while len(tokens) < len(r.tokens):
        tok, entry = host.choose(e.sequences.feed([tok]))
        tokens.append(tok)
        entries.append(entry)
    assert r.tokens == tokens
    assert r.logprobs == entries
    e.close()


def test_a_seeded_request_is_the_same_across_a_shrink(tiny_models, cuda) -> None:
    path = tiny_models.path("qwen3moe", "Q4_K_M")
    e = load(path, cuda, cache_mib=all_mib(path, cuda), host_budget_mib=0)
    steady = generate(e, CHAT)
    cache = e.cache
    assert cache is not None
    calls = 0

    def resize() -> None:
        nonlocal calls
        calls += 1
        if calls == 6:  # the steps run ahead stop, the host's steps draw from the same state
            cache.resize(cache.sizes.core_slots)
        elif calls == 20:
            cache.resize(cache.max_slots)

    assert generate(e, CHAT, resize) == steady
    e.close()


def test_text_is_the_same_at_cache_all_half_and_none(tiny_models, cuda) -> None:
    path = tiny_models.path("mixtral", "Q4_K_M")
    full = all_mib(path, cuda)
    runs = {}
    for label, mib in (("all", full), ("half", full // 2), ("none", 0)):
        for host in (0, 256):  # misses staged from the file; read from host homes over PCIe
            e = load(path, cuda, cache_mib=mib, host_budget_mib=host)
            runs[label, host] = (generate(e, GREEDY), forced_logits(e, [9, 8, 7], 6))
            e.close()
    want = runs["all", 0]
    for key, (text, logits) in runs.items():
        assert text == want[0], key
        for a, b in zip(want[1], logits, strict=True):
            assert torch.equal(a, b), key


def test_a_shrink_and_a_grow_mid_generation_change_no_token(tiny_models, cuda) -> None:
    path = tiny_models.path("qwen3moe", "Q4_K_M")
    e = load(path, cuda, cache_mib=all_mib(path, cuda), host_budget_mib=0)  # misses staged
    steady = generate(e, GREEDY)
    cache = e.cache
    assert cache is not None
    calls = 0

    def resize() -> None:
        nonlocal calls
        calls += 1
        if calls == 6:
            cache.resize(cache.sizes.core_slots)
            assert not e.sequences.gpu.tables.plan.complete
        elif calls == 20:
            cache.resize(cache.max_slots)
            assert e.sequences.gpu.tables.plan.complete

    assert generate(e, GREEDY, resize) == steady
    assert calls > 20
    e.close()


def test_kernels_that_fail_to_build_leave_the_reference_path(
    tiny_models, cuda, caplog, monkeypatch
) -> None:
    from strata.engine.gpu.runner import GpuRunner

    def broken(self, on_layer=None, mode=None):
        raise RuntimeError("no compiler for this device\nsecond line")

    monkeypatch.setattr(GpuRunner, "warm_up", broken)
    path = tiny_models.path("qwen3moe", "Q8_0")
    with caplog.at_level(logging.WARNING, logger="strata.engine.generate"):
        e = load(path, cuda, cache_mib=64)
    assert not e.sequences.decodes_on_gpu and e.cache is not None and not e.cache.kernel
    assert "GPU decode kernels failed to build (RuntimeError: no compiler for this device)" in (
        caplog.text
    )
    assert len(generate(e, SamplingParams(max_tokens=4, temperature=0.0))) == 4
    e.close()


def test_a_step_that_cannot_be_captured_runs_eagerly(tiny_models, cuda, caplog, monkeypatch):
    class Refuses:
        def __init__(self, *a, **k) -> None:
            pass

        def __enter__(self):
            raise RuntimeError("operation not permitted when stream is capturing")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "graph", Refuses)
    path = tiny_models.path("qwen3moe", "Q8_0")
    with caplog.at_level(logging.WARNING, logger="strata.engine.gpu.runner"):
        e = load(path, cuda, cache_mib=64)
    monkeypatch.undo()
    assert e.sequences.gpu is not None and e.sequences.gpu.graph is None
    assert "decode steps run without a CUDA graph: capture failed (RuntimeError" in caplog.text
    assert len(generate(e, SamplingParams(max_tokens=4, temperature=0.0))) == 4
    e.close()


@pytest.mark.parametrize("mode", ["1", "2"], ids=["pdl", "pdl+prefetch"])
def test_logits_are_the_same_with_dependent_launches_on_and_off(tiny_models, cuda, monkeypatch,
                                                                mode):  # fmt: skip
    from strata.engine.kernels import pdl

    monkeypatch.setenv(pdl.PDL_ENV, mode)
    if not pdl.pdl_on(torch.device(cuda)):
        pytest.skip("no programmatic dependent launch here (it needs sm_90 and Triton 3.4)")
    path = tiny_models.path("qwen3moe", "Q4_K_M")
    on = load(path, cuda, cache_mib=1 << 20)
    assert ", launches overlapped (PDL)" in on.sequences.decode_path()
    assert ("prefetched ahead" in on.sequences.decode_path()) == (mode == "2")
    a = forced_logits(on, [4, 5], 8)
    on.close()
    monkeypatch.setenv(pdl.PDL_ENV, "0")
    off = load(path, cuda, cache_mib=1 << 20)
    assert not pdl.pdl_on(torch.device(cuda))
    assert ", launches not overlapped (STRATA_PDL=0)" in off.sequences.decode_path()
    b = forced_logits(off, [4, 5], 8)
    off.close()
    for la, lb in zip(a, b, strict=True):
        assert torch.equal(la, lb)
