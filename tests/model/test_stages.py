"""Two stages on the CPU (two "simulated devices": each with its own host arena, expert cache,
host tier share and K/V): the split, one home for every expert across both caches and the host
tier, the same logits and greedy tokens as one stage, bit for bit, per-stage budgets, the K/V
growing in each stage within that stage's budget, and bad options refused without a leak."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from strata.engine.errors import EngineError, ModelLoadError
from strata.engine.experts.cache import ExpertCache, ForeignLayer
from strata.engine.generate import Engine
from strata.engine.options import EngineOptions
from strata.engine.params import SamplingParams
from strata.vmm.arena import ElasticArena, create_arena
from strata.vmm.errors import VmmError

MiB = 2**20
GiB = 2**30
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
TWO = ("cpu", "cpu")


@pytest.fixture(scope="module")
def path(tiny_models) -> Path:
    return tiny_models.path("qwen3moe", "F16")  # 4 layers of 8 experts, 0.75 MiB a slot


def load(path: Path, **options) -> Engine:
    base = dict(kv_cache_type="f32", context_length=1024, arena_chunk_mib=1,
                host_budget_mib=64, cache_mib=8)  # fmt: skip
    extra = {k: options.pop(k) for k in ("arena_factory", "free_vram") if k in options}
    return Engine.load(path, EngineOptions(**{**base, **options}), **extra)


def words(engine: Engine, n: int, seed: int = 0) -> list[int]:
    eog = engine.tokenizer.eog_ids
    ids = [t for t in range(3, engine.tokenizer.vocab_size) if t not in eog]
    return [ids[(seed * 7919 + i * 131) % len(ids)] for i in range(n)]


def homes(cache: ExpertCache) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The experts in the cache's slots, and in its host homes."""
    slots = [t.key for _, t in cache.table]
    tier = [t.key for _, t in cache.tier.table] if cache.tier is not None else []
    return slots, tier


def check_one_home(engine: Engine) -> None:
    """Every expert of the model has exactly one home: a slot of the cache of the stage that
    owns its layer, or a host home of that stage's share of the tier (enough RAM for all)."""
    seen: list[tuple[int, int]] = []
    for stage in engine.stages:
        assert stage.cache is not None
        slots, tier = homes(stage.cache)
        for layer, _ in slots + tier:
            assert layer in stage.layers, f"{stage.describe()} holds an expert of layer {layer}"
        seen += slots + tier
    assert len(seen) == len(set(seen)), "an expert has two homes"
    assert sorted(seen) == sorted(engine.index.experts), "an expert has no home"


def test_two_stages_split_the_layers_and_each_owns_its_own(path: Path) -> None:
    e = load(path, devices=TWO, layer_split=(1, 3))
    try:
        assert [s.number for s in e.stages] == [0, 1]
        assert [s.layers for s in e.stages] == [range(0, 1), range(1, 4)]
        assert [s.device for s in e.stages] == [torch.device("cpu")] * 2
        a, b = e.stages
        assert a.kv is not b.kv and a.kv.n_layer == 1 and b.kv.n_layer == 3
        assert a.cache is not None and b.cache is not None and a.cache is not b.cache
        assert a.cache.arena is not b.cache.arena and a.kv.arena is not b.kv.arena
        assert a.cache.max_slots == 8 and b.cache.max_slots == 24  # only their layers' experts
        assert e.cache is a.cache and e.sequences.kv is a.kv  # old callers see stage 0
        assert e.sequences.stage_of(0) is a and e.sequences.stage_of(3) is b
        check_one_home(e)
    finally:
        e.close()
    assert a.kv.arena.closed and b.kv.arena.closed  # type: ignore[attr-defined]


def test_one_device_in_the_list_is_one_stage_over_every_layer(path: Path) -> None:
    plain, listed = load(path), load(path, devices=("cpu",))
    try:
        assert len(listed.stages) == 1 and listed.stages[0].layers == range(4)
        assert listed.cache is not None and listed.cache.layers == range(4)
        assert plain.cache is not None and plain.cache.layers is None
        ids = words(plain, 16)
        assert torch.equal(listed.sequences.logits_all(ids), plain.sequences.logits_all(ids))
    finally:
        plain.close()
        listed.close()


def test_the_automatic_split_follows_each_devices_free_memory(path: Path, caplog) -> None:
    frees = [lambda: 3 * GiB, lambda: 1 * GiB]
    with caplog.at_level("INFO", logger="strata.engine.generate"):
        e = load(path, devices=TWO, free_vram=frees, cache_mib=None, reserve_mib=0)
    try:
        assert [s.layers for s in e.stages] == [range(0, 3), range(3, 4)]
        assert "layers 0-2 on cpu, 3 on cpu" in caplog.text
        # an automatic cache from each device's own reading: every expert of its layers fits
        assert [s.cache.n_slots for s in e.stages] == [24, 8]  # type: ignore[union-attr]
    finally:
        e.close()
    e = load(path, devices=TWO)  # nothing known: an equal split
    try:
        assert [s.layers for s in e.stages] == [range(0, 2), range(2, 4)]
    finally:
        e.close()


def test_logits_and_greedy_tokens_are_those_of_one_stage_bit_for_bit(path: Path) -> None:
    one = load(path)
    two = load(path, devices=TWO, layer_split=(3, 1))
    three = load(path, devices=("cpu",) * 3, layer_split=(1, 1, 2), cache_mib=0)
    try:
        ids = words(one, 40)
        want = one.sequences.logits_all(ids, [17, 23])
        assert torch.equal(two.sequences.logits_all(ids, [17, 23]), want)
        assert torch.equal(three.sequences.logits_all(ids, [17, 23]), want)
        prompt = words(one, 30, seed=1)
        tokens = one.generate(prompt, GREEDY).tokens
        assert len(tokens) == GREEDY.max_tokens
        assert two.generate(prompt, GREEDY).tokens == tokens
        assert three.generate(prompt, GREEDY).tokens == tokens
        check_one_home(two)
    finally:
        one.close()
        two.close()
        three.close()


def test_each_stage_reads_only_its_own_cache(path: Path) -> None:
    """The layer -> stage map is the only way to a cache: each stage's cache is asked for its
    own layers' experts only, and refuses another's (that would read another device's slots)."""
    e = load(path, devices=TWO, layer_split=(2, 2))
    asked: dict[int, set[int]] = {0: set(), 1: set()}
    try:
        for stage in e.stages:
            cache = stage.cache
            assert cache is not None
            served = cache.expert

            def spy(layer: int, expert: int, n=stage.number, served=served):  # type: ignore[no-untyped-def]
                asked[n].add(layer)
                return served(layer, expert)

            cache.expert = spy  # type: ignore[method-assign]
        e.generate(words(e, 20), GREEDY)
        assert asked == {0: {0, 1}, 1: {2, 3}}
        a, b = e.stages
        assert a.cache is not None and b.cache is not None
        with pytest.raises(ForeignLayer, match="layer 2 is not this cache's: it serves layers 0-1"):
            ExpertCache.expert(a.cache, 2, 0)
        with pytest.raises(ForeignLayer, match="layer 1 is not this cache's"):
            ExpertCache.expert(b.cache, 1, 0)
        with pytest.raises(ForeignLayer):
            b.cache.record_counts({(0, 3): 1})
        # the uses each stage counted are its own layers' only
        for stage in e.stages:
            assert stage.cache is not None
            assert {k[0] for k in stage.cache.totals} <= set(stage.layers)
    finally:
        e.close()


def test_set_budget_of_one_stage_resizes_only_that_stage(path: Path) -> None:
    e = load(path, devices=TWO, layer_split=(2, 2), cache_mib=24, kv_keep_conversations=0)
    try:
        a, b = e.stages
        assert a.cache is not None and b.cache is not None
        e.generate(words(e, 20), GREEDY)
        before_a = (a.cache.n_slots, [(s, t.key) for s, t in a.cache.table], a.budget)
        full = b.cache.n_slots
        assert b.budget is not None
        small = b.kv.mapped_bytes + b.cache.mapped_bytes_for(full // 2)
        b.cache.resize(e.set_budget(small, stage=1))
        assert b.budget == small and b.cache.n_slots < full
        assert b.cache.arena.mapped_bytes + b.kv.mapped_bytes <= small
        assert (a.cache.n_slots, [(s, t.key) for s, t in a.cache.table], a.budget) == before_a
        check_one_home(e)
        big = b.kv.mapped_bytes + b.cache.mapped_bytes_for(full)
        b.cache.resize(e.set_budget(big, stage=1))
        assert b.cache.n_slots == full
        assert (a.cache.n_slots, [(s, t.key) for s, t in a.cache.table], a.budget) == before_a
        check_one_home(e)
        # stage 0 through the old call, stage 1 untouched
        n_b = b.cache.n_slots
        a.cache.resize(e.set_budget(a.kv.mapped_bytes + a.cache.mapped_bytes_for(2)))
        assert a.cache.n_slots < before_a[0] and b.cache.n_slots == n_b
        assert e.kv_status(1)["budget_bytes"] == big and e.kv_status()["budget_bytes"] == a.budget
        with pytest.raises(EngineError, match="stage=2: the engine has stages 0 to 1"):
            e.set_budget(small, stage=2)
        with pytest.raises(EngineError, match="stage=-1"):
            e.kv_status(-1)
    finally:
        e.close()


def test_the_kv_grows_in_each_stage_within_that_stages_budget(path: Path) -> None:
    opts = dict(cache_mib=12, kv_keep_conversations=0, context_length=2048)
    e = load(path, devices=TWO, layer_split=(1, 3), **opts)

    def in_budget() -> None:
        for stage in e.stages:
            cache = stage.cache
            held = (cache.arena.mapped_bytes if cache else 0) + stage.kv.mapped_bytes
            assert stage.budget is not None and held <= stage.budget, stage.describe()
            stage.kv.book.check()

    try:
        a, b = e.stages
        assert a.cache is not None and b.cache is not None
        first = [a.kv.mapped_bytes, b.kv.mapped_bytes]
        slots = [a.cache.n_slots, b.cache.n_slots]
        told: dict[int, list[tuple[int, int, str]]] = {0: [], 1: []}
        for stage in e.stages:
            stage.on_cache_resized = lambda r, why, n=stage.number: told[n].append(
                (r.from_slots, r.to_slots, why)
            )
        assert e.sequences.on_cache_resized is a.on_cache_resized  # the old name: stage 0's
        out = e.generate(words(e, 1100), GREEDY, safe_point=in_budget)
        assert len(out.tokens) == GREEDY.max_tokens
        # both K/Vs grew (1100 positions: 18 pages of 64, and the sink), each in its own
        # budget: the tail of its own cache yielded the room
        assert a.kv.mapped_bytes > first[0] and b.kv.mapped_bytes > first[1]
        assert a.cache.n_slots < slots[0] and b.cache.n_slots < slots[1]
        # each stage's listener hears of its own cache's resizes only
        assert told[0] and told[0][-1][1] == a.cache.n_slots
        assert told[1] and told[1][-1][1] == b.cache.n_slots
        assert {why for calls in told.values() for _, _, why in calls} == {"K/V growth"}
        assert len(a.kv.book.active.pages) == len(b.kv.book.active.pages) >= 18
        in_budget()
        check_one_home(e)
        # the same tokens as one stage
        one = load(path, **opts)
        try:
            assert one.generate(words(one, 1100), GREEDY).tokens == out.tokens
        finally:
            one.close()
        # after the request each stage gives its K/V's free chunks back, its cache refills
        e.generate(words(e, 10, seed=3), GREEDY, safe_point=in_budget)
        assert [a.cache.n_slots, b.cache.n_slots] == slots
        in_budget()
    finally:
        e.close()


class Recorder:
    """Arena factories that keep what they made (to check that nothing is left open)."""

    def __init__(self) -> None:
        self.made: list[ElasticArena] = []

    def factory(self, fail: bool = False) -> Callable[[int, int], ElasticArena]:
        def make(reserved: int, chunk: int) -> ElasticArena:
            if fail and self.made:  # the K/V's arena, then the cache's refused
                raise VmmError("simulated device: no address range left")
            arena = create_arena("host", reserved, chunk)
            self.made.append(arena)
            return arena

        return make

    def all_closed(self) -> bool:
        return all(a.closed for a in self.made)  # type: ignore[attr-defined]


BAD = [
    (dict(devices=TWO, layer_split=(2, 1)),
     "layer_split=\\[2, 1\\]: the counts add up to 3, but the model has 4 layers"),
    (dict(devices=TWO, layer_split=(4,)),
     "layer_split=\\[4\\]: needs one count per device \\(2 devices\\), the model has 4 layers"),
    (dict(devices=TWO, layer_split=(0, 4)), "layer_split=\\[0, 4\\].*got 0.*4 layers"),
    (dict(layer_split=(2, 2)), "layer_split=\\[2, 2\\]: needs devices"),
    (dict(devices=()), "devices=\\(\\): expected a list of at least one device"),
    (dict(devices=("cpu", "gpu:1")), "device 'gpu:1' is not cpu, cuda or cuda:N"),
    (dict(devices=("cpu",) * 5), "5 devices for a model of 4 layers"),
]  # fmt: skip


@pytest.mark.parametrize(("options", "message"), BAD)
def test_bad_split_options_are_clear_errors_and_leak_nothing(
    path: Path, options: dict, message: str
) -> None:
    rec = Recorder()
    with pytest.raises(EngineError, match=message):
        load(path, arena_factory=rec.factory(), **options)
    assert rec.all_closed()


def test_per_device_callables_are_checked_and_a_failure_midway_leaks_nothing(path: Path) -> None:
    rec = Recorder()
    with pytest.raises(EngineError, match="arena_factory: 3 given, but there are 2 devices"):
        load(path, devices=TWO, arena_factory=[rec.factory()] * 3)
    with pytest.raises(EngineError, match="free_vram: 1 given, but there are 2 devices"):
        load(path, devices=TWO, free_vram=[lambda: GiB])
    assert not rec.made
    # the second stage's device refuses its cache's arena: everything made so far goes
    first, second = Recorder(), Recorder()
    with pytest.raises(ModelLoadError, match="no address range left"):
        load(path, devices=TWO, arena_factory=[first.factory(), second.factory(fail=True)])
    assert len(first.made) == 2 and len(second.made) == 1  # K/V, cache; K/V
    assert first.all_closed() and second.all_closed()
    # each stage's arenas come from its own factory
    first, second = Recorder(), Recorder()
    e = load(path, devices=TWO, arena_factory=[first.factory(), second.factory()])
    try:
        assert e.stages[0].kv.arena is first.made[0] and e.stages[0].cache.arena is first.made[1]  # type: ignore[union-attr]
        assert e.stages[1].kv.arena is second.made[0] and e.stages[1].cache.arena is second.made[1]  # type: ignore[union-attr]
    finally:
        e.close()
    assert first.all_closed() and second.all_closed()


def test_the_host_tier_is_one_ram_budget_shared_by_the_stages(path: Path) -> None:
    e = load(path, devices=TWO, layer_split=(2, 2), cache_mib=2, host_budget_mib=9)
    try:
        tiers = [s.cache.tier for s in e.stages]  # type: ignore[union-attr]
        assert all(t is not None for t in tiers)
        # shared in proportion to what each stage's VRAM core cannot hold: never beyond it
        total = sum(t.n_slots * t.slot_bytes for t in tiers)  # type: ignore[union-attr]
        assert 0 < total <= 9 * MiB
        assert abs(tiers[0].n_slots - tiers[1].n_slots) <= 1  # type: ignore[union-attr]
        check_one_home_or_file(e)
        # what fits in neither is read from the file, each stage's from its own layers
        for stage in e.stages:
            assert stage.cache is not None and stage.cache.file_experts > 0
        ids = words(e, 12)
        one = load(path, cache_mib=2, host_budget_mib=9)
        try:
            assert torch.equal(e.sequences.logits_all(ids), one.sequences.logits_all(ids))
        finally:
            one.close()
    finally:
        e.close()


def check_one_home_or_file(engine: Engine) -> None:
    """As ``check_one_home``, with the experts beyond the RAM budget left to the file."""
    seen: list[tuple[int, int]] = []
    for stage in engine.stages:
        assert stage.cache is not None
        slots, tier = homes(stage.cache)
        assert all(layer in stage.layers for layer, _ in slots + tier)
        seen += slots + tier
        assert stage.cache.file_experts == len(stage.cache.keys) - len(slots) - len(tier)
    assert len(seen) == len(set(seen)), "an expert has two homes"
