"""Exchanges of hot RAM-homed experts with cold tail experts: the pair picking (plain Python over
heats) and the in-stream exchange on the CPU over a host tier and a slot table."""

from __future__ import annotations

import torch

from strata.engine.experts.exchange import Exchanges, Swap, plan_swaps
from strata.engine.experts.host import HostTier
from strata.engine.experts.slots import SlotTable

SLOT = 64


def heat_of(heats: dict[tuple[int, int], float]):
    return lambda key: heats.get(key, 0.0)


def test_the_hottest_ram_experts_meet_the_coldest_tail_slots_empty_first() -> None:
    heats = {(0, 1): 9.0, (0, 2): 5.0, (0, 3): 0.5, (1, 0): 1.0, (1, 1): 0.1}
    ram = [(0, (0, 3)), (1, (0, 1)), (2, (0, 2))]
    tail = [(4, (1, 0)), (5, None), (6, (1, 1))]
    got = plan_swaps(ram, tail, heat_of(heats), max_swaps=3)
    assert got == [Swap((0, 1), 1, 5, None), Swap((0, 2), 2, 6, (1, 1))]
    # (0, 3) at 0.5 is not more than twice (1, 0)'s 1.0: no third swap


def test_no_swap_between_equals_or_for_an_unused_expert() -> None:
    heats = {(0, 1): 3.0, (1, 0): 2.0}
    assert plan_swaps([(0, (0, 1))], [(4, (1, 0))], heat_of(heats), 4) == []  # 3 <= 2 x 2
    assert plan_swaps([(0, (0, 1))], [(4, (1, 0))], heat_of(heats), 4, margin=1.0) == [
        Swap((0, 1), 0, 4, (1, 0))
    ]
    assert plan_swaps([(0, (0, 9))], [(4, None)], heat_of(heats), 4) == []  # never used


def test_max_swaps_bounds_the_pairs() -> None:
    heats = {(0, e): 10.0 + e for e in range(5)}
    ram = [(e, (0, e)) for e in range(5)]
    tail = [(10 + s, None) for s in range(5)]
    got = plan_swaps(ram, tail, heat_of(heats), max_swaps=2)
    assert [p.key for p in got] == [(0, 4), (0, 3)] and [p.slot for p in got] == [10, 11]
    assert plan_swaps(ram, tail, heat_of(heats), max_swaps=0) == []


def test_an_exchange_in_stream_swaps_bytes_and_homes() -> None:
    arena = torch.zeros(4 * SLOT, dtype=torch.uint8)
    table = SlotTable(1, 8)
    table.plan_grow(4, [])
    tier = HostTier(2, SLOT)
    try:
        table.assign(2, (1, 0))  # the victim, in VRAM slot 2
        arena[2 * SLOT : 3 * SLOT] = 2
        (home,) = tier.take(1)
        tier.assign(home, (0, 1))  # the promoted expert, in RAM
        tier.view(home).fill_(7)
        ex = Exchanges(torch.device("cpu"), SLOT, lambda s: arena[s * SLOT : (s + 1) * SLOT])
        done = ex.in_stream([Swap((0, 1), home, 2, (1, 0))], tier, table)
        assert done == [Swap((0, 1), home, 2, (1, 0), new_home=home)]
        assert table.slot_of((0, 1)) == 2 and tier.slot_of((1, 0)) == home
        assert bool((arena[2 * SLOT : 3 * SLOT] == 7).all())
        assert bool((tier.view(home) == 2).all())
        assert not ex.in_flight and ex.land(tier, table) == []  # nothing on the side stream
        ex.close()
    finally:
        tier.close()
