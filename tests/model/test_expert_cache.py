"""The expert cache over the elastic arena, on a real model forward.

Every test runs on the host arena (CI) and, with the ``gpu`` marker, on CUDA VMM with the engine
computing on the GPU. The test model's experts span 24 chunks of 2 MiB.
"""

from __future__ import annotations

import pytest
import torch
from reference import RefModel

from strata.engine.experts.cache import ExpertCache
from strata.engine.experts.slots import SlotTagMismatch, Tag
from strata.engine.generate import Engine
from strata.engine.options import EngineOptions
from strata.engine.quant import repack
from strata.engine.quant.expert_layout import kernel_layout, run_offsets

MiB = 2**20
CHUNK_MIB = 2


@pytest.fixture(
    params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)],
    ids=["host", "cuda"],
    scope="module",
)
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    return request.param


@pytest.fixture(scope="module")
def model_path(tiny_models):
    return tiny_models.path("qwen3moe", "F16")


def load(
    model_path, device: str, cache_mib: int | None, tail_mib: int | None = None, fast: bool = True
) -> Engine:
    options = EngineOptions(
        fast_decode=fast,
        device=device,
        kv_cache_type="f32",
        cache_mib=cache_mib,
        elastic_tail_mib=tail_mib,
        arena_chunk_mib=CHUNK_MIB,
        context_length=512,
        host_budget_mib=0,  # the VRAM cache alone (test_host_tier tests the tier behind it)
    )
    return Engine.load(model_path, options)


def all_mib(engine_or_path, kernel: bool = False) -> int:
    """MiB for every expert: in the kernel layout on a GPU (the fast decode path's slots)."""
    e = engine_or_path
    cache = ExpertCache.create(
        e.index, torch.device("cpu"), 1 << 40, None, CHUNK_MIB * MiB, kernel=kernel
    )  # probe the slot size
    total = cache.max_slots * cache.slot_bytes
    cache.close()
    return -(-total // MiB)


def all_mib_on(probe: Engine, device: str) -> int:
    return all_mib(probe, kernel=device == "cuda")


@pytest.fixture(scope="module")
def tokens(model_path) -> list[int]:
    return RefModel(model_path).test_sequence(48)


@pytest.fixture(scope="module")
def baseline(model_path, device, tokens) -> torch.Tensor:
    e = load(model_path, device, 0)
    assert e.cache is None
    out = e.sequences.logits_all(tokens)
    e.close()
    return out


def slot_bytes_of(cache: ExpertCache, slot: int) -> bytes:
    return bytes(cache.arena.view(slot * cache.slot_bytes, cache.slot_bytes).cpu().numpy())


def expected_slot_bytes(cache: ExpertCache, key: tuple[int, int]) -> bytes:
    """The file's runs in the slot layout, or the kernel layout of each (the torch twin)."""
    blob = cache.index.expert(*key)
    out = bytearray(cache.slot_bytes)
    if cache.kernel:
        lay = kernel_layout(blob)
        for off, m, run in zip(lay.offsets, lay.layouts, blob.runs, strict=True):
            raw = cache.index.raw(run.offset, run.nbytes)
            out[off : off + m.nbytes] = bytes(repack.repack(raw, run.qtype, run.shape).numpy())
        return bytes(out)
    for off, run in zip(run_offsets(blob), blob.runs, strict=True):
        out[off : off + run.nbytes] = bytes(cache.index.raw(run.offset, run.nbytes).numpy())
    return bytes(out)


def test_experts_span_at_least_eight_chunks(model_path) -> None:
    e = load(model_path, "cpu", 0)
    assert e.index.expert_bytes >= 8 * CHUNK_MIB * MiB


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_logits_are_bit_identical_with_the_cache_at_none_half_and_all(
    model_path, device, tokens, baseline, fraction: float
) -> None:
    probe = load(model_path, "cpu", 0)
    e = load(model_path, device, int(all_mib_on(probe, device) * fraction))
    assert e.cache is not None and e.cache.n_slots > 0
    assert torch.equal(e.sequences.logits_all(tokens), baseline)
    if fraction == 1.0:
        assert e.cache.n_slots == e.cache.max_slots
        e.provider.stats.bytes_from_file = 0
        e.sequences.logits_all(tokens)
        assert e.provider.stats.bytes_from_file == 0, "a full cache must read no expert from file"
        assert e.provider.stats.hit_rate == 1.0
    e.close()


def test_overwriting_a_cached_slot_changes_the_output(model_path, device, tokens, baseline) -> None:
    probe = load(model_path, "cpu", 0)
    e = load(model_path, device, all_mib_on(probe, device))
    cache = e.cache
    # the expert routed most in the sequence, so the garbage is certainly read
    e.sequences.logits_all(tokens)
    hot = max(cache.totals, key=cache.totals.__getitem__)
    slot = cache.table.slot_of(hot)
    blob = cache.index.expert(*hot)
    cache.arena.view(slot * cache.slot_bytes, blob.gate.nbytes).fill_(0x3C)
    try:
        changed = e.sequences.logits_all(tokens)
    except Exception:  # a garbage block may also raise; either way it is never silent
        e.close()
        return
    assert not torch.equal(changed, baseline)
    e.close()


def test_a_tag_mismatch_behind_the_table_makes_a_forward_raise(model_path, device, tokens) -> None:
    # the reference path asks the cache for every expert it reads, so every forward checks the
    # tags (the fast path checks them whenever it plans its tables: test_fast_decode)
    probe = load(model_path, "cpu", 0)
    e = load(model_path, device, all_mib_on(probe, device), fast=False)
    table = e.cache.table
    e.sequences.logits_all(tokens[:8])
    key = next(iter(e.cache.totals))
    slot = table.slot_of(key)
    # plant a stale tag: the slot claims to hold another expert of the same layer
    other = (key[0], (key[1] + 1) % 8)
    table._tags[slot] = Tag(other[0], other[1], 999)
    with pytest.raises(SlotTagMismatch, match=rf"\(layer {key[0]}, expert {key[1]}\)"):
        e.sequences.logits_all(tokens)
    e.close()


def test_grow_shrink_regrow_keeps_addresses_bytes_and_the_core(model_path, device, tokens) -> None:
    probe = load(model_path, "cpu", 0)
    full = all_mib_on(probe, device)
    e = load(model_path, device, full // 2, tail_mib=full // 4)
    cache = e.cache
    arena = cache.arena
    base = arena.base
    core = range(cache.sizes.core_slots)
    core_before = {s: (cache.table.tag(s), slot_bytes_of(cache, s)) for s in core}
    addresses = {s: arena.address(s * cache.slot_bytes) for s in range(cache.max_slots)}
    e.sequences.logits_all(tokens)  # make some experts hot

    start, resizes = cache.n_slots, cache.resizes
    cache.resize(cache.max_slots)  # grow to everything
    assert cache.n_slots == cache.max_slots
    cache.resize(cache.sizes.core_slots)  # shrink to the core
    assert cache.n_slots == cache.sizes.core_slots
    cache.resize(start)  # regrow
    assert cache.n_slots == start

    assert arena.base == base
    assert {s: arena.address(s * cache.slot_bytes) for s in addresses} == addresses
    assert {s: (cache.table.tag(s), slot_bytes_of(cache, s)) for s in core} == core_before
    for slot, tag in cache.table:  # every cached expert's bytes are the file's bytes
        assert slot_bytes_of(cache, slot) == expected_slot_bytes(cache, tag.key)
    assert cache.resizes == resizes + 3
    e.close()


def test_new_slots_are_zero_until_filled(model_path, device) -> None:
    probe = load(model_path, "cpu", 0)
    e = load(model_path, device, all_mib_on(probe, device) // 2)
    cache = e.cache
    end = cache.n_slots * cache.slot_bytes
    rest = cache.arena.mapped_bytes - end  # mapped, past the last slot: never written
    if rest:
        assert int(cache.arena.view(end, rest).count_nonzero()) == 0
    e.close()


def test_shrink_moves_the_hottest_tail_experts_into_the_coldest_survivors(
    model_path, device
) -> None:
    probe = load(model_path, "cpu", 0)
    full = all_mib_on(probe, device)
    e = load(model_path, device, full // 2, tail_mib=full // 4)
    cache = e.cache
    n = cache.n_slots
    top = cache.table.tag(n - 1).key  # the expert in the highest slot: removed by the shrink
    cache.usage.record([top] * 50)  # make it the hottest
    cache.resize(n - 2)
    slot = cache.table.slot_of(top)
    assert slot is not None and cache.sizes.core_slots <= slot < n - 2
    assert slot_bytes_of(cache, slot) == expected_slot_bytes(cache, top)
    e.close()


def test_shrink_removes_at_most_the_step_per_call(model_path, device) -> None:
    probe = load(model_path, "cpu", 0)
    e = load(model_path, device, all_mib_on(probe, device))
    cache = e.cache
    start = cache.n_slots
    steps = []
    while cache.n_slots > cache.sizes.core_slots:
        r = cache.resize(cache.sizes.core_slots, max_shrink=3)
        steps.append(r.from_slots - r.to_slots)
    assert all(1 <= s <= 3 for s in steps) and sum(steps) == start - cache.sizes.core_slots
    with pytest.raises(ValueError, match="max_shrink of 0"):
        cache.resize(cache.sizes.core_slots, max_shrink=0)
    e.close()


def test_shrink_returns_host_memory(model_path) -> None:
    probe = load(model_path, "cpu", 0)
    e = load(model_path, "cpu", all_mib(probe))
    arena = e.cache.arena
    before = arena.committed_bytes
    e.cache.resize(e.cache.sizes.core_slots)
    assert arena.committed_bytes < before
    assert arena.committed_bytes == arena.mapped_bytes
    e.close()


def test_rejected_resizes_change_nothing(model_path, device) -> None:
    probe = load(model_path, "cpu", 0)
    e = load(model_path, device, all_mib_on(probe, device) // 2)
    cache = e.cache
    snapshot = (cache.n_slots, cache.arena.mapped_bytes, dict(iter(cache.table)))
    for bad in (cache.sizes.core_slots - 1, cache.max_slots + 1, -3):
        with pytest.raises(ValueError, match=str(bad)):
            cache.resize(bad)
        assert (cache.n_slots, cache.arena.mapped_bytes, dict(iter(cache.table))) == snapshot
    e.close()


def test_cache_budget_takes_whole_slots_and_zero_means_none(model_path) -> None:
    probe = load(model_path, "cpu", 0)
    e = load(model_path, "cpu", 7)  # not a multiple of the slot size
    assert e.cache.size_bytes <= 7 * MiB
    assert e.cache.size_bytes + e.cache.slot_bytes > 7 * MiB
    e.close()
    huge = load(model_path, "cpu", 100 * all_mib(probe))
    assert huge.cache.n_slots == huge.cache.max_slots  # capped at the whole set
    huge.close()
    assert load(model_path, "cpu", 0).cache is None


def test_profile_orders_the_next_start(model_path, tokens, tmp_path) -> None:
    options = EngineOptions(kv_cache_type="f32", cache_mib=0, arena_chunk_mib=CHUNK_MIB)
    first = Engine.load(model_path, options, state_dir=tmp_path)
    first.sequences.logits_all(tokens)
    hottest = [k for k, _ in first.provider.totals.most_common(3)]
    first.save_profile()
    assert list((tmp_path / "profiles").glob("*.json"))
    slot_mib = -(-load(model_path, "cpu", 1).cache.slot_bytes // MiB)
    options = EngineOptions(kv_cache_type="f32", cache_mib=3 * slot_mib, arena_chunk_mib=CHUNK_MIB)
    second = Engine.load(model_path, options, state_dir=tmp_path)
    assert set(hottest) <= second.cache.table.cached_keys()
    second.close()
