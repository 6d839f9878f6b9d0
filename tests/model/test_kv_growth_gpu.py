"""The growing K/V on a GPU (CUDA VMM arenas, the fast decode and prefill paths, CUDA graphs):
the CI scenarios of ``test_kv_growth`` through ``Engine.load``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_kv_growth import MiB, gen, in_budget, second_turn, words

from strata.engine.generate import Engine
from strata.engine.options import EngineOptions

pytestmark = pytest.mark.gpu
CHUNK_MIB = 2  # CUDA's mapping granularity: eight of the tiny model's 256 KiB pages


@pytest.fixture(scope="module")
def path(tiny_models) -> Path:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    return tiny_models.path("qwen3moe", "F32")  # 1.5 MiB experts: a cache of tens of MiB


def load(path: Path, **options) -> Engine:
    base = dict(device="cuda:0", kv_cache_type="f32", context_length=2048,
                arena_chunk_mib=CHUNK_MIB, host_budget_mib=0, cache_mib=1 << 20)  # fmt: skip
    e = Engine.load(path, EngineOptions(**{**base, **options}))
    assert "CUDA graph" in e.sequences.decode_path(), e.sequences.decode_path()
    return e


def test_growing_and_fixed_kv_give_the_same_tokens_and_the_kv_trims(path: Path) -> None:
    fixed = load(path, kv_fixed=True)
    grow = load(path, kv_keep_conversations=0)
    try:
        kv = grow.sequences.kv
        first = kv.mapped_bytes
        assert first == CHUNK_MIB * MiB and kv.arena.device.startswith("cuda")
        for n, seed in ((1500, 0), (20, 1), (1700, 2)):
            p = words(grow, n, seed)
            assert gen(fixed, p).tokens == gen(grow, p).tokens
            if n == 20:
                assert kv.mapped_bytes == first, "the long conversation's pages were unmapped"
            else:
                assert kv.mapped_bytes >= kv.context_bytes(n)
    finally:
        fixed.close()
        grow.close()


def test_a_second_turn_reuses_the_first_and_matches_a_cold_run(path: Path) -> None:
    warm, cold = load(path), load(path)
    try:
        # The cache holds every expert and the budget is what was mapped at load: give the
        # budget room for both conversations' pages, or the second evicts the first (kept
        # conversations go first under pressure, before the cache's tail).
        assert warm.cache is not None and warm.sequences.budget is not None
        warm.cache.resize(warm.set_budget(warm.sequences.budget + 16 * MiB))
        p2 = second_turn(warm, cold, 900)
        r2 = gen(warm, p2)  # again: all but its last token is cached now
        a2 = words(warm, 300, seed=4)  # another conversation between: both are kept
        ra = gen(warm, a2)
        r3 = gen(warm, p2 + r2.tokens + [5])
        assert r3.cached_tokens == len(p2) + len(r2.tokens) - 1
        assert gen(warm, a2 + ra.tokens + [6]).cached_tokens == len(a2) + len(ra.tokens) - 1
    finally:
        warm.close()
        cold.close()


def test_the_kv_and_the_cache_share_one_budget_across_a_lease(path: Path) -> None:
    e = load(path, cache_mib=32, elastic_tail_mib=24)
    try:
        cache, r = e.cache, e.sequences
        assert cache is not None and r.budget is not None
        budget, full = r.budget, cache.n_slots
        p = words(e, 1800)
        want = gen(e, p).tokens  # about 8 MiB of K/V: the tail yields
        assert cache.n_slots < full
        in_budget(e)
        e.sequences.rewind(0)  # the same prompt again from nothing, while a lease of 8 MiB holds
        cache.resize(e.set_budget(budget - 8 * MiB))
        in_budget(e)
        assert gen(e, p).tokens == want
        in_budget(e)
        before = cache.n_slots
        cache.resize(e.set_budget(budget))  # returned: the tail refills
        in_budget(e)
        assert cache.n_slots > before
    finally:
        e.close()
