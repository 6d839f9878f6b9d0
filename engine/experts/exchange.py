"""Exchanges of hot RAM-homed experts with cold experts of the elastic tail.

``plan_swaps`` picks the pairs (plain Python over heats); ``Exchanges`` moves their bytes: on a
GPU on a side stream of its own while the next steps compute, through a buffer of device slots,
landing at the next safe point; elsewhere in stream order at once. It retags the slot table and
the host tier it is handed; the cache counts, checks and announces what landed.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import torch

from strata.engine.experts.host import HostTier
from strata.engine.experts.slots import ExpertKey, SlotTable

# A RAM-homed expert replaces a tail expert only when used more than this many times as often
# (decayed counts): two experts of about the same heat never trade places back and forth.
SWAP_MARGIN = 2.0


@dataclass(frozen=True)
class Swap:
    """One exchange: ``key`` leaves its RAM ``home`` for ``slot``, whose expert ``victim`` (None:
    the slot was empty) goes to ``new_home``."""

    key: ExpertKey
    home: int
    slot: int
    victim: ExpertKey | None
    new_home: int | None = None


@dataclass
class InFlight:
    """Exchanges whose copies were queued on the side stream; ``done`` follows them."""

    swaps: list[Swap]
    done: torch.cuda.Event


def plan_swaps(
    ram: Iterable[tuple[int, ExpertKey]],
    tail: Iterable[tuple[int, ExpertKey | None]],
    heat: Callable[[ExpertKey], float],
    max_swaps: int,
    margin: float = SWAP_MARGIN,
) -> list[Swap]:
    """Up to ``max_swaps`` pairs of a RAM-homed expert (``ram``: (home, key)), hottest first, and
    a tail slot (``tail``: (slot, its expert or None when empty)), coldest (empty) first. A pair
    swaps only when the promoted expert's heat is positive and more than ``margin`` times the
    victim's. Only the few hottest and coldest are ranked, not every one sorted: this runs on the
    host between steps, over thousands of experts."""
    if max_swaps <= 0:
        return []
    hot = heapq.nlargest(max_swaps, ((heat(k), h, k) for h, k in ram))
    cold = heapq.nsmallest(max_swaps, ((heat(k) if k is not None else -1.0, s, k) for s, k in tail))
    pairs = []
    for (h_heat, home, key), (v_heat, slot, victim) in zip(hot, cold, strict=False):
        if h_heat <= 0 or h_heat <= margin * max(v_heat, 0.0):
            break  # hotness only falls along `hot` and rises along `cold`
        pairs.append(Swap(key, home, slot, victim))
    return pairs


class Exchanges:
    """The device side of the exchanges: the buffer of device slots the promoted experts pass
    through, the side stream their copies run on, and the exchanges on their way there.
    ``slot_view(slot)`` is an arena slot's bytes."""

    def __init__(
        self, device: torch.device, slot_bytes: int, slot_view: Callable[[int], torch.Tensor]
    ) -> None:
        self.device, self.slot_bytes, self._slot_view = device, slot_bytes, slot_view
        self._buf: torch.Tensor | None = None  # device slots the exchanges pass through
        self._side: torch.cuda.Stream | None = None  # where exchanges copy while steps compute
        self._in_flight: InFlight | None = None  # exchanges whose copies run there

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    def buffer(self, n: int) -> torch.Tensor:
        """At least ``n`` device slots (kept, grown when a call asks for more)."""
        if self._buf is None or self._buf.numel() < n * self.slot_bytes:
            # a plain tensor even when made inside a request's inference mode: adaptation points
            # come in and outside it
            with torch.inference_mode(False):
                self._buf = torch.empty(n * self.slot_bytes, dtype=torch.uint8, device=self.device)
        return self._buf

    def _slot(self, buf: torch.Tensor, j: int) -> torch.Tensor:
        return buf[j * self.slot_bytes : (j + 1) * self.slot_bytes]

    def start(self, swaps: Sequence[Swap], free: Sequence[int], tier: HostTier) -> None:
        """Queue the exchanges' copies on the side stream, behind everything queued so far:
        each promoted expert up into its device slot of the buffer, each victim down into a free
        home (``free``, one per victim). Nothing is retagged until they land."""
        assert self._in_flight is None, "land the exchanges on their way first"
        buf = self.buffer(len(swaps))
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        side, rooms = self._side, iter(free)
        side.wait_stream(torch.cuda.current_stream(self.device))
        started = []
        with torch.cuda.stream(side):
            for j, p in enumerate(swaps):
                self._slot(buf, j).copy_(tier.view(p.home), non_blocking=True)
                if p.victim is not None:
                    p = replace(p, new_home=next(rooms))
                    tier.view(p.new_home).copy_(self._slot_view(p.slot), non_blocking=True)
                started.append(p)
            done = torch.cuda.Event()
            done.record(side)
        self._in_flight = InFlight(started, done)

    def land(self, tier: HostTier | None, table: SlotTable) -> list[Swap]:
        """At a safe point: the compute stream waits for the side stream's copies (nothing on
        the host does), the promoted experts go from the buffer into their slots in stream order
        behind the steps that still read the victims there, and the tags follow. Returns the
        exchanges that landed (none on their way: [])."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return []
        buf = self._buf
        assert tier is not None and buf is not None
        torch.cuda.current_stream(self.device).wait_event(flight.done)
        for j, p in enumerate(flight.swaps):
            self._slot_view(p.slot).copy_(self._slot(buf, j), non_blocking=True)
            table.assign(p.slot, p.key)
            tier.drop(p.key)  # the promoted expert's home becomes room
            if p.victim is not None:
                assert p.new_home is not None
                tier.assign(p.new_home, p.victim)
        return flight.swaps

    def in_stream(self, swaps: Sequence[Swap], tier: HostTier, table: SlotTable) -> list[Swap]:
        """The exchanges in stream order now, each victim into the home its promoted expert
        left, and the tags at once. Returns them with their victims' new homes."""
        buf = self.buffer(len(swaps))
        for j, p in enumerate(swaps):
            x = self._slot(buf, j)
            x.copy_(tier.view(p.home), non_blocking=True)  # the promoted expert, up
            if p.victim is not None:
                tier.view(p.home).copy_(self._slot_view(p.slot), non_blocking=True)  # down
            self._slot_view(p.slot).copy_(x, non_blocking=True)
            table.assign(p.slot, p.key)
            if p.victim is not None:
                tier.assign(p.home, p.victim)
            else:
                tier.drop(p.key)  # into an empty tail slot: the home becomes room
        return [replace(p, new_home=p.home) for p in swaps]

    def close(self) -> None:
        """Drop the buffer and the stream (land what is on its way first)."""
        self._buf = None
        self._side = None
