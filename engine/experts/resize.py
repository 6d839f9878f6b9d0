"""The expert cache's grow and shrink: the slot table's plans carried out over the arena, with
the evicted experts copied out into host homes and the new slots filled from theirs.

Resizing happens only at safe points (between forward steps): a grow fills the new tail slots
with the hottest missing experts; a shrink first moves the hottest experts of the removed slots
into the coldest surviving ones, copies the rest out into free host homes, then unmaps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from strata.engine.experts.copies import SlotCopies
from strata.engine.experts.host import HostTier
from strata.engine.experts.slots import ExpertKey, Fill, SlotTable, UsageCounts
from strata.engine.experts.tierfill import FilePages
from strata.engine.experts.verify import Copy
from strata.engine.gguf_index import GGUFIndex
from strata.engine.quant.expert_layout import align
from strata.vmm.arena import ElasticArena

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResizeResult:
    """What one resize did: slot counts before and after, experts copied, and how long it took."""

    from_slots: int
    to_slots: int
    copied: int
    seconds: float
    to_host: int = 0  # experts a shrink moved into host homes
    to_file: int = 0  # experts a shrink left with no home but the file (the host tier was full)
    from_host: int = 0  # experts a grow filled from their host homes
    # a shrink's seconds by phase: plan, copy_out (queued), tables, unmap (waiting for each
    # chunk's copies), wait (the last table copies)
    phases: dict[str, float] = field(default_factory=dict)


class _Clock:
    """Seconds since the previous mark, by phase name."""

    def __init__(self, into: dict[str, float]) -> None:
        self.into, self.t = into, time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.into[phase] = self.into.get(phase, 0.0) + now - self.t
        self.t = now


def by_layer(fills: Sequence[Fill]) -> list[tuple[int, list[Fill]]]:
    """Fills grouped by layer, layers ascending (each group's file pages go back together)."""
    groups: dict[int, list[Fill]] = {}
    for f in fills:
        groups.setdefault(f.key[0], []).append(f)
    return sorted(groups.items())


def homes_for(
    leaving: dict[ExpertKey, int], free: Sequence[int], hotness: Mapping[ExpertKey, float]
) -> dict[ExpertKey, int]:
    """The evicted experts (key -> the removed slot that holds it) paired with ``free`` host
    slots, the hottest first where there is not room for all: key -> home, in slot order."""
    keys = list(leaving)
    if len(free) < len(keys):
        keys.sort(key=lambda k: -float(hotness.get(k, 0.0)))
    keys = sorted(keys[: len(free)], key=lambda k: leaving[k])  # slot order: runs coalesce
    return dict(zip(keys, free, strict=True))


class Resizer:
    """Carries out one cache's resizes over its table and arena. ``verify(copies)`` checks new
    copies (dropping wrong ones); ``changed()`` tells whoever keeps device tables of the slots.
    The host tier is passed to each call (it comes and goes with the cache's load and close)."""

    def __init__(
        self,
        index: GGUFIndex,
        table: SlotTable,
        arena: ElasticArena,
        copies: SlotCopies,
        usage: UsageCounts,
        order: Sequence[ExpertKey],
        pages: FilePages,
        verify: Callable[[Sequence[Copy]], object],
        changed: Callable[[], None],
    ) -> None:
        self.index, self.table, self.arena, self.copies = index, table, arena, copies
        self.usage, self.order, self.pages = usage, order, pages
        self.verify, self.changed = verify, changed
        self.slot_bytes = copies.slot_bytes

    def mapped_bytes_for(self, n_slots: int) -> int:
        """What the arena maps to hold ``n_slots`` slots (whole chunks)."""
        return align(n_slots * self.slot_bytes, self.arena.chunk_bytes) if n_slots else 0

    def grow(self, n_slots: int, tier: HostTier | None) -> tuple[int, int]:
        """Map and fill up to ``n_slots`` (and any empty slots below). Returns (fills, fills
        from host homes)."""
        self.arena.resize(max(self.arena.mapped_bytes, self.mapped_bytes_for(n_slots)))
        got = min(n_slots, self.arena.mapped_bytes // self.slot_bytes)
        if got < n_slots:
            log.warning("expert cache grow to %d slots got memory for %d only", n_slots, got)
        ranked = self.usage.ranked(self.order)
        # empty slots below the old top first (the core at creation), then the new tail slots;
        # one plan's fills are executed before the next plan is made
        copied, from_host = self.fill(self.table.plan_fill(ranked), tier)
        more, more_host = self.fill(self.table.plan_grow(got, self.usage.ranked(self.order)), tier)
        self.copies.sync()
        self.changed()
        return copied + more, from_host + more_host

    def fill(self, fills: Sequence[Fill], tier: HostTier | None) -> tuple[int, int]:
        """Copy each fill's expert into its slot: from its host home (one copy over PCIe, then
        the home is freed) or from the file (then the file's pages of it are given back).
        Returns (fills, fills from host homes)."""
        homed = [f for f in fills if tier is not None and tier.slot_of(f.key) is not None]
        from_file = [f for f in fills if tier is None or tier.slot_of(f.key) is None]
        if homed:
            assert tier is not None
            pairs = []
            for f in homed:
                home = tier.slot_of(f.key)
                assert home is not None
                tier.table.check(home, f.key)
                pairs.append((home, f.slot))
            copies = self.copies
            copies.copy_slots(pairs, tier.view, copies.slot_view, src_piece=tier.piece_slots)
            copies.sync()  # the bytes are in the slots before the homes go
            for f in homed:
                self.table.assign(f.slot, f.key)
                tier.drop(f.key)
            self.verify([(f.key, "slot", f.slot) for f in homed])
        for _, group in by_layer(from_file):
            for fill in group:
                # bytes first, then the tag: until assign() the slot is a miss, never a wrong one
                self.copies.copy_in(fill.slot, self.index.expert(*fill.key))
                self.table.assign(fill.slot, fill.key)
            self.verify([(f.key, "slot", f.slot) for f in group])
            self.pages.release([f.key for f in group])  # read already: staging copies synchronously
        return len(fills), len(homed)

    def shrink(
        self, n_slots: int, tier: HostTier | None, phases: dict[str, float]
    ) -> tuple[int, int, int]:
        """Returns (moves within VRAM, experts moved into host homes, experts left to the file).

        Stream order: the survivors' evicted experts are copied out first (the moves overwrite
        them), then the moves, then the removed slots' experts, the top chunk's first with an
        event behind each chunk's copies; the device tables are planned while those copies run,
        and each chunk is unmapped as soon as its own copies are done, so the top of the arena
        goes back to the system while the rest is still on its way over PCIe."""
        clock = _Clock(phases)
        copies = self.copies
        copies.sync()  # from here only this stream's copies touch the arena (copy_out_top_down)
        before = {t.key: s for s, t in self.table}
        moves = self.table.plan_shrink(n_slots, self.usage.hotness)
        kept = self.table.cached_keys()
        leaving = {k: s for k, s in before.items() if k not in kept}
        homes: dict[ExpertKey, int] = {}
        if tier is not None and leaving:
            homes = homes_for(leaving, tier.take(len(leaving)), self.usage.hotness)
        clock.mark("plan")
        low = [(leaving[k], h) for k, h in homes.items() if leaving[k] < n_slots]
        high = [(leaving[k], h) for k, h in homes.items() if leaving[k] >= n_slots]
        error = copies.copy_out(tier, low)
        for move in moves:
            n = copies.expert_bytes(self.index.expert(*move.key))
            copies.slot_view(move.dst, n).copy_(copies.slot_view(move.src, n))
        ready = None
        if error is None:
            ready, error = copies.copy_out_top_down(tier, high)
        if error is not None:  # a copy the driver refused: they all stay with the file
            copies.sync()
            log.warning("could not copy %d evicted experts into the host tier (%s): they are "
                        "read from the file", len(homes), error)  # fmt: skip
            homes = {}
        for key, home in homes.items():
            assert tier is not None
            tier.assign(home, key)
        clock.mark("copy_out")
        checked: list[Copy] = [(m.key, "slot", m.dst) for m in moves]
        checked += [(k, "home", h) for k, h in homes.items()]
        self.verify(checked)
        # The device-side tables are rewritten in stream order behind the copies (the host
        # plans them while the copies run); nothing reads them before the next step.
        self.changed()
        clock.mark("tables")
        self.arena.shrink(self.arena.mapped_bytes - self.mapped_bytes_for(n_slots), ready)
        clock.mark("unmap")
        copies.sync()  # the table copies have landed when the call returns
        clock.mark("wait")
        to_file = len(leaving) - len(homes)
        if to_file:
            log.info(
                "%d evicted experts have no room in the host tier: they are read from the file",
                to_file,
            )
        return len(moves), len(homes), to_file
