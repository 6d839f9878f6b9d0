"""The expert tables the decode kernels read, planned from the slot table: every cached expert at
its slot's offset, every other one MISSING, and a slot whose tag disagrees is an error that names
the expert."""

from __future__ import annotations

import pytest

from strata.engine.experts.slots import SlotTable, SlotTagMismatch, Tag
from strata.engine.experts.table import (
    FILE,
    HOST,
    MISSING,
    VRAM,
    device_rows,
    plan_table,
    replan_entries,
)

SLOT = 4096


def table_with(keys: list[tuple[int, int]], core: int = 2) -> SlotTable:
    t = SlotTable(core, 16)
    t.plan_grow(max(core, len(keys)), [])
    for slot, key in enumerate(keys):
        t.assign(slot, key)
    return t


def test_no_cache_leaves_every_expert_missing() -> None:
    plan = plan_table(3, 4, None, lambda s: s * SLOT)
    assert plan.offsets == (MISSING,) * 12
    assert not plan.complete and plan.resident == 0


def test_cached_experts_point_at_their_slots() -> None:
    t = table_with([(0, 1), (2, 3), (1, 0)])
    plan = plan_table(3, 4, t, lambda s: 1000 + s * SLOT)
    assert plan.offsets[0 * 4 + 1] == 1000
    assert plan.offsets[2 * 4 + 3] == 1000 + SLOT
    assert plan.offsets[1 * 4 + 0] == 1000 + 2 * SLOT
    assert plan.resident == 3 and not plan.complete
    assert plan.is_resident(2, 3) and not plan.is_resident(2, 2)


def test_a_full_cache_gives_a_complete_table() -> None:
    keys = [(layer, e) for layer in range(2) for e in range(3)]
    plan = plan_table(2, 3, table_with(keys, core=6), lambda s: -s * SLOT - SLOT)  # below anchor
    assert plan.complete and plan.resident == 6
    assert sorted(plan.offsets) == sorted(-s * SLOT - SLOT for s in range(6))


def test_a_slot_whose_tag_disagrees_is_an_error_naming_the_expert() -> None:
    t = table_with([(0, 1), (1, 2)])
    t._tags[1] = Tag(1, 3, 99)  # the slot claims another expert than the one mapped to it
    with pytest.raises(SlotTagMismatch, match=r"\(layer 1, expert 2\)"):
        plan_table(2, 4, t, lambda s: s * SLOT)


def test_the_reserved_offset_and_an_empty_shape_are_rejected() -> None:
    t = table_with([(0, 0)])
    with pytest.raises(ValueError, match="reserved offset -1"):
        plan_table(1, 1, t, lambda s: MISSING)
    with pytest.raises(ValueError, match="0 layers x 4 experts"):
        plan_table(0, 4, None, lambda s: 0)


def test_replanned_entries_follow_an_exchange_and_keep_the_rest() -> None:
    vram = table_with([(0, 0), (0, 1), (1, 0)], core=3)
    ram = table_with([(0, 2), (1, 1), (1, 2)], core=4)  # home 3 is room
    slot_at, home_at = (lambda s: 1000 + s * SLOT), (lambda s: -(s + 1) * SLOT)
    plan = plan_table(2, 3, vram, slot_at, ram, home_at)
    assert plan.complete and plan.count(HOST) == 3
    # (1, 1) takes (0, 1)'s slot, (0, 1) the free home 3; (1, 1)'s home 1 becomes room
    vram.assign(1, (1, 1))
    ram.clear(1)
    ram.assign(3, (0, 1))
    new, changed = replan_entries(plan, [(1, 1), (0, 1)], vram, slot_at, ram, home_at)
    assert changed == {4: (1000 + SLOT, VRAM), 1: (-4 * SLOT, HOST)}
    assert new == plan_table(2, 3, vram, slot_at, ram, home_at)  # the same as planning it all
    assert [new.where[i] for i in range(6)] == [VRAM, HOST, HOST, VRAM, VRAM, HOST]
    ram.assign(1, (1, 1))  # now (1, 1) would have two homes
    with pytest.raises(ValueError, match=r"\(layer 1, expert 1\) has two homes"):
        replan_entries(plan, [(1, 1)], vram, slot_at, ram, home_at)
    with pytest.raises(ValueError, match=r"\(layer 2, expert 0\) is not in this table"):
        replan_entries(plan, [(2, 0)], vram, slot_at, ram, home_at)


def test_the_device_rows_split_the_homes_by_tier() -> None:
    """Every home in the first row; the second only the VRAM homes, the third only the RAM ones
    (a home below the anchor is a negative offset, never MISSING); the file's experts MISSING
    in all three."""
    entries = [(4096, VRAM), (-8192, HOST), (MISSING, FILE), (0, VRAM), (-256, HOST)]
    assert device_rows(entries) == (
        [4096, -8192, MISSING, 0, -256],
        [4096, MISSING, MISSING, 0, MISSING],
        [MISSING, -8192, MISSING, MISSING, -256],
    )
    assert device_rows([]) == ([], [], [])
