"""The expert-cache bookkeeping: slot table, usage counts and cache sizes. Pure Python, no torch."""

from __future__ import annotations

import ast
import random
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from strata.engine.errors import EngineError
from strata.engine.experts import slots as slots_module
from strata.engine.experts.slots import (
    CacheSizes,
    ExpertKey,
    Fill,
    Move,
    SlotTable,
    SlotTableError,
    SlotTagMismatch,
    Tag,
    UsageCounts,
    plan_sizes,
)

GiB = 1 << 30
MiB = 1 << 20


def snapshot(table: SlotTable) -> tuple[object, ...]:
    tags = tuple(table.tag(s) for s in range(table.n_slots))
    where = {k: table.slot_of(k) for k in table.cached_keys()}
    return table.n_slots, table.core_slots, table.max_slots, tags, where, tuple(table.free_slots())


def filled(core: int, n: int, max_slots: int, keys: list[ExpertKey]) -> SlotTable:
    """A table of ``n`` slots (``core`` of them core) holding ``keys`` in slot order."""
    table = SlotTable(core, max_slots)
    table.plan_grow(n, [])
    for slot, key in enumerate(keys):
        table.assign(slot, key)
    return table


def execute(store: dict[int, ExpertKey], moves: list[Move]) -> None:
    """Run moves one after another on a simulated byte store (slot -> what its bytes are)."""
    for m in moves:
        assert store[m.src] == m.key, f"{m}: the source's bytes are {store.get(m.src)}"
        store[m.dst] = store[m.src]


def test_imports_only_the_standard_library() -> None:
    # Bookkeeping must stay importable and testable without torch, numpy or CUDA.
    for module in ("slots.py", "profile.py"):
        tree = ast.parse((Path(slots_module.__file__).parent / module).read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                allowed = top in sys.stdlib_module_names or name in (
                    "strata.engine.errors",
                    "strata.engine.experts.slots",
                )
                assert allowed, f"{module} imports {name}"


# -- the table: assign, lookup, check ------------------------------------------------------------


def test_assign_lookup_and_check() -> None:
    table = SlotTable(core_slots=2, max_slots=8)
    assert table.n_slots == 2 and table.free_slots() == [0, 1]
    tag = table.assign(1, (3, 7))
    assert tag == Tag(3, 7, tag.generation) and tag.key == (3, 7)
    assert table.slot_of((3, 7)) == 1 and table.slot_of((3, 8)) is None
    assert table.tag(1) == tag and table.tag(0) is None
    assert table.check(1, (3, 7)) == tag
    assert table.check(1, (3, 7), generation=tag.generation) == tag
    assert table.cached_keys() == {(3, 7)} and table.free_slots() == [0]
    assert list(table) == [(1, tag)] and len(table) == 1


def test_mismatch_names_the_expert_asked_for_and_what_the_slot_holds() -> None:
    table = SlotTable(2, 4)
    tag = table.assign(0, (5, 9))
    with pytest.raises(SlotTagMismatch, match=r"\(layer 5, expert 10\).*\(layer 5, expert 9\)"):
        table.check(0, (5, 10))
    with pytest.raises(SlotTagMismatch, match=r"\(layer 2, expert 1\).*empty"):
        table.check(1, (2, 1))
    with pytest.raises(SlotTagMismatch, match=f"generation {tag.generation + 1}"):
        table.check(0, (5, 9), generation=tag.generation + 1)
    assert issubclass(SlotTagMismatch, EngineError)


def test_generations_are_never_reused() -> None:
    table = SlotTable(3, 3)
    seen = []
    for _ in range(4):
        for slot in range(3):
            seen.append(table.assign(slot, (0, slot)).generation)
            table.clear(slot)
    seen.append(table.assign(0, (0, 0)).generation)
    seen.append(table.assign(0, (1, 1)).generation)  # replacing the content is a new assignment
    assert len(set(seen)) == len(seen) and seen == sorted(seen)
    assert table.slot_of((0, 0)) is None  # replaced, no longer cached


def test_a_key_lives_in_one_slot_only() -> None:
    table = SlotTable(2, 2)
    table.assign(0, (1, 1))
    before = snapshot(table)
    with pytest.raises(SlotTableError, match=r"already in slot 0"):
        table.assign(1, (1, 1))
    assert snapshot(table) == before
    table.assign(0, (1, 1))  # re-assigning in place is allowed (a fresh copy of the same expert)


@pytest.mark.parametrize(
    "call",
    [
        lambda t: t.tag(4),
        lambda t: t.tag(-1),
        lambda t: t.assign(4, (0, 0)),
        lambda t: t.assign(-1, (0, 0)),
        lambda t: t.clear(4),
        lambda t: t.check(7, (0, 0)),
    ],
)
def test_slot_out_of_range_is_rejected_and_changes_nothing(call) -> None:
    table = filled(2, 4, 8, [(0, 0), (0, 1), (0, 2)])
    before = snapshot(table)
    with pytest.raises(SlotTableError, match=r"out of range \[0, n_slots=4\)") as info:
        call(table)
    assert isinstance(info.value, ValueError)
    assert snapshot(table) == before


def test_bad_construction_is_rejected() -> None:
    with pytest.raises(SlotTableError, match="core_slots=-1"):
        SlotTable(-1, 4)
    with pytest.raises(SlotTableError, match="max_slots=3 is below core_slots=4"):
        SlotTable(4, 3)


# -- fills -------------------------------------------------------------------------------------


def test_plan_fill_takes_the_first_ranked_missing_keys_and_changes_nothing() -> None:
    table = filled(3, 5, 5, [(0, 0)])
    table.clear(0)
    table.assign(2, (0, 1))
    before = snapshot(table)
    ranked = [(0, 1), (1, 4), (1, 4), (2, 2), (3, 3), (4, 4), (5, 5)]
    fills = table.plan_fill(ranked)
    assert fills == [Fill(0, (1, 4)), Fill(1, (2, 2)), Fill(3, (3, 3)), Fill(4, (4, 4))]
    assert snapshot(table) == before  # nothing claimed until the bytes are there
    for f in fills:
        table.assign(f.slot, f.key)
    assert table.free_slots() == [] and table.plan_fill(ranked) == []


def test_plan_fill_with_too_few_keys_leaves_slots_free() -> None:
    table = SlotTable(4, 4)
    assert table.plan_fill([(0, 0), (0, 1)]) == [Fill(0, (0, 0)), Fill(1, (0, 1))]


def test_plan_grow_fills_the_new_slots_with_the_best_ranked_missing() -> None:
    table = filled(2, 2, 6, [(0, 0)])  # slot 1 is free but is not a new slot
    ranked = [(0, 0), (9, 9), (8, 8), (7, 7), (6, 6), (5, 5)]
    fills = table.plan_grow(5, ranked)
    assert table.n_slots == 5
    assert fills == [Fill(2, (9, 9)), Fill(3, (8, 8)), Fill(4, (7, 7))]
    assert table.free_slots() == [1, 2, 3, 4]  # empty (misses) until assigned
    for f in fills:
        table.assign(f.slot, f.key)
    assert table.plan_fill(ranked) == [Fill(1, (6, 6))]
    assert table.plan_grow(5, ranked) == []  # growing to the same size is a no-op


@pytest.mark.parametrize(("new", "fragment"), [(7, "max_slots=6"), (2, "n_slots=3"), (-1, "-1")])
def test_rejected_grow_changes_nothing(new: int, fragment: str) -> None:
    table = filled(2, 3, 6, [(0, 0), (0, 1), (0, 2)])
    before = snapshot(table)
    with pytest.raises(SlotTableError, match=f"new_n_slots={new}") as info:
        table.plan_grow(new, [(1, 1)])
    assert fragment in str(info.value)
    assert snapshot(table) == before


# -- shrink ------------------------------------------------------------------------------------


def test_shrink_relocates_the_hottest_removed_into_the_coldest_tail_survivors() -> None:
    # core: slots 0-1; tail: 2-7; shrink to 5 removes slots 5, 6, 7.
    keys = [(0, 0), (0, 1), (1, 2), (1, 3), (1, 4), (2, 5), (2, 6), (2, 7)]
    table = filled(2, 8, 8, keys)
    core_tags = [table.tag(0), table.tag(1)]
    hot = {
        (0, 0): 0.0,  # core, coldest of all: never a destination
        (0, 1): 0.0,
        (1, 2): 9.0,  # survivor hotter than anything removed: kept
        (1, 3): 1.0,  # coldest tail survivor
        (1, 4): 4.0,
        (2, 5): 8.0,  # hottest removed -> slot 3
        (2, 6): 5.0,  # next -> slot 4 (5 > 4)
        (2, 7): 2.0,  # coldest removed: no survivor left colder -> dropped
    }
    moves = table.plan_shrink(5, hot)
    assert moves == [Move(5, 3, (2, 5)), Move(6, 4, (2, 6))]
    assert table.n_slots == 5
    assert [table.tag(s).key for s in range(5)] == [(0, 0), (0, 1), (1, 2), (2, 5), (2, 6)]
    assert [table.tag(0), table.tag(1)] == core_tags  # core untouched, generations too
    assert table.cached_keys() == {(0, 0), (0, 1), (1, 2), (2, 5), (2, 6)}
    assert table.slot_of((2, 7)) is None and table.slot_of((1, 3)) is None
    store = dict(enumerate(keys))
    execute(store, moves)
    assert all(store[s] == t.key for s, t in table)


def test_shrink_never_displaces_a_hotter_or_equally_hot_survivor() -> None:
    table = filled(1, 4, 4, [(0, 0), (0, 1), (0, 2), (0, 3)])
    moves = table.plan_shrink(2, {(0, 1): 5.0, (0, 2): 5.0, (0, 3): 1.0})
    assert moves == []
    assert table.cached_keys() == {(0, 0), (0, 1)}


def test_shrink_uses_empty_tail_slots_first_even_for_cold_experts() -> None:
    table = filled(1, 5, 5, [(0, 0), (0, 1)])  # slots 2, 3 empty; 4 gets a never-counted expert
    table.assign(4, (0, 4))
    moves = table.plan_shrink(4, {(0, 1): 3.0})
    assert moves == [Move(4, 2, (0, 4))]  # count 0 still beats an empty slot: never a flush
    assert table.free_slots() == [3]


def test_shrink_to_the_core_drops_the_tail_and_never_moves_into_the_core() -> None:
    table = filled(2, 5, 5, [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4)])
    table.clear(1)  # an empty core slot is still not a destination
    core_tag = table.tag(0)
    moves = table.plan_shrink(2, {(0, 3): 100.0})
    assert moves == []
    assert table.n_slots == 2 and table.tag(0) == core_tag and table.tag(1) is None
    assert table.cached_keys() == {(0, 0)}
    # the removed slots are empty when the table grows back
    assert table.plan_grow(5, []) == [] and table.free_slots() == [1, 2, 3, 4]


@pytest.mark.parametrize(("new", "fragment"), [(1, "core_slots=2"), (6, "n_slots=5"), (-3, "")])
def test_rejected_shrink_changes_nothing(new: int, fragment: str) -> None:
    table = filled(2, 5, 8, [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4)])
    before = snapshot(table)
    with pytest.raises(SlotTableError, match=f"new_n_slots={new}") as info:
        table.plan_shrink(new, {})
    assert fragment in str(info.value)
    assert snapshot(table) == before


def test_moved_experts_get_a_fresh_generation() -> None:
    table = filled(0, 2, 2, [(0, 0), (0, 1)])
    old = table.tag(1)
    (move,) = table.plan_shrink(1, {(0, 0): 1.0, (0, 1): 2.0})
    new = table.check(0, (0, 1))
    assert move == Move(1, 0, (0, 1)) and new.generation > old.generation
    with pytest.raises(SlotTagMismatch):
        table.check(0, (0, 1), generation=old.generation)


@pytest.mark.parametrize("seed", range(200))
def test_shrink_moves_replayed_on_a_byte_store_give_the_table(seed: int) -> None:
    rng = random.Random(seed)
    max_slots = rng.randint(1, 24)
    core = rng.randint(0, max_slots)
    n = rng.randint(core, max_slots)
    table = SlotTable(core, max_slots)
    table.plan_grow(n, [])
    universe = [(layer, e) for layer in range(4) for e in range(16)]
    rng.shuffle(universe)
    store: dict[int, ExpertKey] = {}
    for slot in range(n):
        if rng.random() < 0.8:
            store[slot] = universe.pop()
            table.assign(slot, store[slot])
    hot = {k: float(rng.randint(0, 6)) for k in store.values() if rng.random() < 0.9}
    before = {s: table.tag(s) for s in range(n)}
    new = rng.randint(core, n)

    moves = table.plan_shrink(new, hot)

    # sources are removed slots, destinations surviving tail slots: no move reads a written slot
    assert all(new <= m.src < n and core <= m.dst < new for m in moves)
    assert len({m.dst for m in moves}) == len(moves) == len({m.src for m in moves})
    # executed one after another (in the given order, or any other) the bytes match the table
    for order in (moves, moves[::-1]):
        replay = dict(store)
        execute(replay, order)
        for slot, tag in table:
            assert replay[slot] == tag.key, (slot, tag)
    assert table.n_slots == new
    assert all(table.tag(s) == before[s] for s in range(core))  # core: same tags, same generations
    heat = lambda k: hot.get(k, 0.0)  # noqa: E731
    kept = table.cached_keys()
    removed = [before[s].key for s in range(new, n) if before[s]]
    dropped = [before[s].key for s in range(core, n) if before[s] and before[s].key not in kept]
    # every removed expert found a slot while an empty tail slot was left ...
    if table.free_slots() and any(s >= core for s in table.free_slots()):
        assert all(k in kept for k in removed)
    # ... and nothing dropped is hotter than any tail expert that stayed
    tail_kept = [table.tag(s).key for s in range(core, new) if table.tag(s)]
    if dropped and tail_kept:
        assert max(map(heat, dropped)) <= min(map(heat, tail_kept))
    # a surviving tail expert only made way for a strictly hotter one
    for m in moves:
        if before[m.dst] is not None:
            assert heat(m.key) > heat(before[m.dst].key)


# -- steady-state swap -------------------------------------------------------------------------


def test_evict_for_swaps_into_the_coldest_tail_slot_only_when_hotter() -> None:
    table = filled(2, 4, 4, [(0, 0), (0, 1), (0, 2), (0, 3)])
    hot: Mapping[ExpertKey, float] = {(0, 0): 0.0, (0, 1): 0.0, (0, 2): 3.0, (0, 3): 1.0}
    before = snapshot(table)
    assert table.evict_for((0, 1), {**hot, (0, 1): 50.0}) is None  # already cached
    assert table.evict_for((9, 9), {**hot, (9, 9): 1.0}) is None  # not hotter than (0, 3)
    assert snapshot(table) == before
    fill = table.evict_for((9, 9), {**hot, (9, 9): 2.0})
    assert fill == Fill(3, (9, 9))  # never the colder core slots
    assert table.tag(3) is None and table.slot_of((0, 3)) is None  # emptied while copying
    table.assign(fill.slot, fill.key)
    assert table.check(3, (9, 9))


def test_evict_for_prefers_an_empty_tail_slot_and_needs_a_tail() -> None:
    table = filled(1, 3, 3, [(0, 0), (0, 1)])
    assert table.evict_for((5, 5), {}) == Fill(2, (5, 5))
    assert table.cached_keys() == {(0, 0), (0, 1)}
    assert SlotTable(2, 2).evict_for((5, 5), {(5, 5): 9.0}) is None


# -- usage counts ------------------------------------------------------------------------------


def test_usage_counts_record_and_halve_every_half_life() -> None:
    usage = UsageCounts(half_life=4)
    usage.record([(0, 1), (0, 1), (2, 3)])
    assert usage.count((0, 1)) == 2.0 and usage.hotness[(2, 3)] == 1.0
    for _ in range(4):
        usage.tick()
    assert usage.count((0, 1)) == pytest.approx(1.0)
    usage.record([(2, 3)])
    assert usage.count((2, 3)) == pytest.approx(1.5)
    assert usage.count((7, 7)) == 0.0 and (7, 7) not in usage.hotness
    usage.decay(0.5)
    assert usage.as_dict() == pytest.approx({(0, 1): 0.5, (2, 3): 0.75})


def test_usage_counts_stay_exact_across_renormalisation() -> None:
    rng = random.Random(1)
    usage = UsageCounts(half_life=1.5)
    naive: dict[ExpertKey, float] = {}
    factor = 0.5 ** (1 / 1.5)
    for _ in range(400):  # the scale passes 2**64 many times
        keys = [(rng.randint(0, 2), rng.randint(0, 3)) for _ in range(rng.randint(0, 5))]
        usage.record(keys)
        for k in keys:
            naive[k] = naive.get(k, 0.0) + 1.0
        usage.tick()
        naive = {k: v * factor for k, v in naive.items()}
    assert usage._scale < 2.0**64 + 1
    for k, v in naive.items():
        assert usage.count(k) == pytest.approx(v, rel=1e-9, abs=1e-300)


def test_usage_ranked_is_descending_with_ties_in_the_given_order() -> None:
    usage = UsageCounts(half_life=100)
    usage.record([(1, 0), (1, 0), (0, 5), (0, 2)])
    all_keys = sorted([(0, 2), (0, 5), (1, 0), (0, 0), (2, 2)])
    assert usage.ranked(all_keys) == [(1, 0), (0, 2), (0, 5), (0, 0), (2, 2)]
    # "most used, then the profile's order": pass the profile's order as the tie order
    profile_order = [(2, 2), (0, 5), (0, 0), (0, 2), (1, 0)]
    assert usage.ranked(profile_order) == [(1, 0), (0, 5), (0, 2), (2, 2), (0, 0)]


def test_usage_hotness_drives_a_shrink() -> None:
    usage = UsageCounts(half_life=10)
    usage.record([(0, 3)] * 5 + [(0, 2)])
    table = filled(1, 4, 4, [(0, 0), (0, 1), (0, 2), (0, 3)])
    assert table.plan_shrink(3, usage.hotness) == [Move(3, 1, (0, 3))]


def test_usage_rejects_bad_parameters() -> None:
    for bad in (0, -1, float("nan")):
        with pytest.raises(ValueError, match="half_life"):
            UsageCounts(bad)
    usage = UsageCounts(float("inf"))  # no decay
    usage.record([(0, 0)])
    usage.tick()
    assert usage.count((0, 0)) == 1.0
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="factor"):
            usage.decay(bad)
    usage.decay(0.0)
    assert usage.as_dict() == {}


# -- sizes -------------------------------------------------------------------------------------


def test_sizes_zero_budget_or_less_than_a_slot_gives_no_cache() -> None:
    assert plan_sizes(0, 3 * MiB, 100) == CacheSizes(0, 0, 0, 0)
    assert plan_sizes(3 * MiB - 1, 3 * MiB, 100) == CacheSizes(0, 0, 0, 0)
    assert plan_sizes(10 * MiB, 3 * MiB, 0) == CacheSizes(0, 0, 0, 0)


def test_sizes_take_whole_slots_capped_at_the_expert_set() -> None:
    s = plan_sizes(100 * MiB + 5, 3 * MiB, 1000)
    assert s.total_slots == 33 and s.effective_bytes == 99 * MiB
    s = plan_sizes(64 * GiB, 3 * MiB, 48)  # budget beyond the whole set
    assert s.total_slots == 48 and s.effective_bytes == 144 * MiB
    assert s.core_slots + s.tail_slots == 48 and s.tail_slots == 36


def test_sizes_default_core_is_at_most_a_quarter() -> None:
    assert plan_sizes(10 * MiB, MiB, 100) == CacheSizes(10, 2, 8, 10 * MiB)
    assert plan_sizes(7 * 2 * MiB, 2 * MiB, 100) == CacheSizes(7, 1, 6, 14 * MiB)
    assert plan_sizes(20 * GiB, GiB, 100) == CacheSizes(20, 5, 15, 20 * GiB)
    assert plan_sizes(3 * MiB, MiB, 100) == CacheSizes(3, 0, 3, 3 * MiB)
    # Qwen3-30B-A3B (Q4_K_M) on a 24 GiB card: ~19 GiB of 2.96 MiB slots; at least 12 GiB lendable
    s = plan_sizes(19 * GiB, int(2.96 * MiB), 6144)
    assert s.tail_slots * int(2.96 * MiB) >= 12 * GiB and s.core_slots <= s.total_slots / 4
    # a cap, when given, is hard: 6 GiB holds one 5 GiB slot
    assert plan_sizes(40 * GiB, 5 * GiB, 100, max_tail_bytes=6 * GiB) == CacheSizes(
        8, 7, 1, 40 * GiB
    )
    assert plan_sizes(16 * MiB, MiB, 100, max_tail_bytes=4 * MiB).tail_slots == 4


def test_sizes_explicit_tail() -> None:
    assert plan_sizes(10 * MiB, MiB, 100, tail_bytes=3 * MiB) == CacheSizes(10, 7, 3, 10 * MiB)
    assert plan_sizes(10 * MiB, 2 * MiB, 100, tail_bytes=5 * MiB).tail_slots == 3  # rounded up
    assert plan_sizes(10 * MiB, MiB, 100, tail_bytes=0) == CacheSizes(10, 10, 0, 10 * MiB)
    assert plan_sizes(10 * MiB, MiB, 4, tail_bytes=8 * MiB) == CacheSizes(4, 0, 4, 4 * MiB)
    assert plan_sizes(20 * GiB, GiB, 100, tail_bytes=10 * GiB).tail_slots == 10


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ((-1, MiB, 10, None), "budget_bytes=-1"),
        ((MiB, 0, 10, None), "slot_bytes=0"),
        ((MiB, MiB, -2, None), "n_experts=-2"),
        ((MiB, MiB, 10, -5), "tail_bytes=-5"),
        ((MiB, MiB, 10, 2 * MiB), f"tail_bytes={2 * MiB} is larger than .*budget_bytes={MiB}"),
    ],
)
def test_sizes_reject_bad_values_naming_them(args: tuple, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        plan_sizes(*args)
    with pytest.raises(ValueError, match="max_tail_bytes=-1"):
        plan_sizes(MiB, MiB, 1, max_tail_bytes=-1)


def test_record_counts_equals_recording_each_use() -> None:
    a, b = UsageCounts(half_life=4), UsageCounts(half_life=4)
    a.record([(0, 1)] * 3 + [(2, 5)])
    a.tick()
    b.record_counts({(0, 1): 3, (2, 5): 1})
    b.tick()
    assert a.as_dict() == pytest.approx(b.as_dict())


def test_record_counts_rejects_a_bad_count_and_changes_nothing() -> None:
    u = UsageCounts(half_life=4)
    u.record([(0, 0)])
    for bad in (-1, float("nan"), True, "3"):
        with pytest.raises(ValueError, match="not a non-negative number"):
            u.record_counts({(1, 1): 2, (0, 0): bad})
        assert u.as_dict() == {(0, 0): 1.0}
