"""The expert cache: routed experts in fixed-size slots of an elastic arena.

The first ``core_slots`` slots are the fixed core (never shrunk, never a relocation target); the
rest is the elastic tail. Each slot holds one expert's gate, up and down: the GGUF byte runs
verbatim, or (``kernel=True``, for the GPU decode kernels) the three matrices repacked into the
kernel layout, which dequantises to the same values bit for bit. Either way a hit is computed
with exactly the values a miss is: residency never changes the numbers. The slot table tags every
slot with (layer, expert, generation); a lookup whose tag does not match raises instead of
computing with the wrong expert.

Resizing happens only at safe points (between forward steps): ``resize`` grows by filling the new
tail slots with the hottest missing experts, and shrinks by first moving the hottest experts of the
removed slots into the coldest surviving ones, then unmapping. Whoever keeps device-side tables
of the slots (the GPU decoder's expert tables) registers a listener: it runs after every change of
the table, and for a shrink before the removed chunks are unmapped.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from strata.engine.experts.layout import (
    align,
    kernel_layout,
    kernel_slot_bytes_for,
    packed_bytes,
    run_offsets,
    slot_bytes_for,
)
from strata.engine.experts.profile import UsageProfile
from strata.engine.experts.provider import ExpertWeights, FileExpertProvider
from strata.engine.experts.slots import (
    CacheSizes,
    ExpertKey,
    Fill,
    SlotTable,
    UsageCounts,
    plan_sizes,
)
from strata.engine.gguf_index import ExpertBlob, GGUFIndex
from strata.engine.layers.weights import QWeight, RepackedWeight
from strata.vmm.arena import ElasticArena, create_arena

log = logging.getLogger(__name__)

MiB = 2**20


def model_key(index: GGUFIndex) -> str:
    """Identity of a model for its usage profile: architecture, shape, size and file name."""
    n_layer = len({layer for layer, _ in index.experts})
    n_expert = len(index.experts) // max(1, n_layer)
    size = index.path.stat().st_size
    return f"{index.arch}:{n_layer}x{n_expert}:{size}:{index.path.name}"


@dataclass(frozen=True)
class ResizeResult:
    """What one resize did: slot counts before and after, experts copied, and how long it took."""

    from_slots: int
    to_slots: int
    copied: int
    seconds: float


class ExpertCache:
    """An :class:`ExpertProvider` that serves cached experts from arena slots and the rest from
    the file (the RAM tier is the file's page cache for now)."""

    def __init__(
        self,
        index: GGUFIndex,
        arena: ElasticArena,
        sizes: CacheSizes,
        slot_bytes: int,
        device: torch.device,
        order: Sequence[ExpertKey],
        kernel: bool = False,
    ) -> None:
        self.index = index
        self.kernel = kernel  # slots hold the kernel layout, not the file's bytes
        self.arena = arena
        self.sizes = sizes
        self.slot_bytes = slot_bytes
        self.device = device
        self.file = FileExpertProvider(index, device)
        self.stats = self.file.stats
        self.stats.cached = True
        self.usage: UsageCounts = self.file.usage
        self.totals: Counter[ExpertKey] = self.file.totals
        self.table = SlotTable(sizes.core_slots, len(index.experts))
        # Fill order when nothing is hot yet: the profile's order, then (layer, expert).
        seen = set(order)
        self.order = list(order) + sorted(k for k in index.experts if k not in seen)
        self.resizes = 0
        self.version = 0  # bumped at every change of which slot holds what
        # run after each change (before a shrink unmaps): device-side tables rewrite themselves
        self.listeners: list[Callable[[], None]] = []
        # run before each plan: lets the decoder hand over the expert use counted on the device
        self.before_plan: Callable[[], None] | None = None

    # -- creation -------------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        index: GGUFIndex,
        device: torch.device,
        budget_bytes: int,
        tail_bytes: int | None,
        chunk_bytes: int,
        profile: UsageProfile | None = None,
        arena_factory: Callable[[int, int], ElasticArena] | None = None,
        kernel: bool = False,
    ) -> ExpertCache:
        """A cache of the most whole slots that fit ``budget_bytes`` (at most every expert),
        filled in the profile's order. The arena reserves room for every expert, so the cache can
        later grow to the whole set without its addresses moving. ``kernel``: slots hold the
        kernel layout of the GPU decode kernels."""
        slot_bytes = kernel_slot_bytes_for(index) if kernel else slot_bytes_for(index)
        sizes = plan_sizes(budget_bytes, slot_bytes, len(index.experts), tail_bytes)
        reserved = max(align(len(index.experts) * slot_bytes, chunk_bytes), chunk_bytes)
        backend = "cuda" if device.type == "cuda" else "host"
        if arena_factory is not None:  # e.g. a host arena guarded by a simulated device
            arena = arena_factory(reserved, chunk_bytes)
        else:
            arena = create_arena(backend, reserved, chunk_bytes, device.index or 0)
        order = profile.ranked() if profile else []
        cache = cls(index, arena, sizes, slot_bytes, device, order, kernel)
        cache.resize(sizes.total_slots)
        log.info(
            "expert cache: %d of %d experts (%.0f MiB; core %d slots, tail %d) of %.2f MiB each, "
            "%s arena of %.0f MiB reserved in %d MiB chunks%s",
            cache.table.n_slots,
            len(index.experts),
            cache.table.n_slots * slot_bytes / MiB,
            sizes.core_slots,
            sizes.tail_slots,
            slot_bytes / MiB,
            backend,
            reserved / MiB,
            chunk_bytes // MiB,
            ", kernel layout" if kernel else "",
        )
        return cache

    # -- the provider protocol ------------------------------------------------------------------

    def step(self) -> None:
        self.file.step()

    def record_counts(self, counts: dict[ExpertKey, int]) -> None:
        self.file.record_counts(counts)

    def expert(self, layer: int, expert: int) -> ExpertWeights:
        key = (layer, expert)
        self.file.record(key)
        blob = self.index.expert(layer, expert)
        slot = self.table.slot_of(key)
        if slot is None:
            return self.file.from_file(blob)
        self.table.check(slot, key)  # a wrong expert is an error, never a plausible answer
        self.stats.hits += 1
        self.stats.bytes_from_cache += blob.nbytes
        base = slot * self.slot_bytes
        if self.kernel:
            lay = kernel_layout(blob)
            gate, up, down = (
                RepackedWeight(self.arena.view(base + off, m.nbytes), m)
                for off, m in zip(lay.offsets, lay.layouts, strict=True)
            )
            return ExpertWeights(gate, up, down)
        gate, up, down = (
            QWeight.of_run(self.arena.view(base + off, run.nbytes), run)
            for off, run in zip(run_offsets(blob), blob.runs, strict=True)
        )
        return ExpertWeights(gate, up, down)

    # -- sizes ----------------------------------------------------------------------------------

    @property
    def n_slots(self) -> int:
        return self.table.n_slots

    def slot_address(self, slot: int) -> int:
        """The stable address of ``slot`` (the arena never moves)."""
        return self.arena.address(slot * self.slot_bytes)

    def _expert_bytes(self, blob: ExpertBlob) -> int:
        return kernel_layout(blob).nbytes if self.kernel else packed_bytes(blob)

    @property
    def cached_experts(self) -> int:
        """Experts whose bytes are in their slot (during a grow, the new slots fill one by one)."""
        return len(self.table)

    @property
    def size_bytes(self) -> int:
        return self.table.n_slots * self.slot_bytes

    @property
    def core_bytes(self) -> int:
        return self.sizes.core_slots * self.slot_bytes

    @property
    def max_slots(self) -> int:
        return self.table.max_slots

    def slots_for_bytes(self, nbytes: int) -> int:
        """The most whole slots whose mapping (whole chunks) fits ``nbytes``, between the core
        and the whole set."""
        usable = nbytes // self.arena.chunk_bytes * self.arena.chunk_bytes
        return max(self.sizes.core_slots, min(usable // self.slot_bytes, self.table.max_slots))

    def mapped_bytes_for(self, n_slots: int) -> int:
        """What the arena maps to hold ``n_slots`` slots (whole chunks)."""
        return align(n_slots * self.slot_bytes, self.arena.chunk_bytes) if n_slots else 0

    def resize(self, n_slots: int, max_shrink: int | None = None) -> ResizeResult:
        """Grow or shrink to ``n_slots`` (call at a safe point only). A shrink removes at most
        ``max_shrink`` slots per call when given; a grow that cannot get all its memory stops at
        the slots it got; the cache never goes below its core."""
        if not self.sizes.core_slots <= n_slots <= self.table.max_slots:
            raise ValueError(
                f"cache size of {n_slots} slots is outside [{self.sizes.core_slots} (the core), "
                f"{self.table.max_slots} (every expert)]"
            )
        if max_shrink is not None and max_shrink < 1:
            raise ValueError(f"max_shrink of {max_shrink} slots must be at least 1")
        t0 = time.perf_counter()
        if self.before_plan is not None:
            self.before_plan()
        before = self.table.n_slots
        if max_shrink is not None:
            n_slots = max(n_slots, before - max_shrink)
        copied = self._grow(n_slots) if n_slots > before else self._shrink(n_slots)
        result = ResizeResult(before, self.table.n_slots, copied, time.perf_counter() - t0)
        if result.from_slots != result.to_slots:
            self.resizes += 1
        return result

    def _grow(self, n_slots: int) -> int:
        self.arena.resize(max(self.arena.mapped_bytes, self.mapped_bytes_for(n_slots)))
        got = min(n_slots, self.arena.mapped_bytes // self.slot_bytes)
        if got < n_slots:
            log.warning("expert cache grow to %d slots got memory for %d only", n_slots, got)
        ranked = self.usage.ranked(self.order)
        # empty slots below the old top first (the core at creation), then the new tail slots;
        # one plan's fills are executed before the next plan is made
        copied = self._fill(self.table.plan_fill(ranked))
        copied += self._fill(self.table.plan_grow(got, self.usage.ranked(self.order)))
        self._sync()
        self._changed()
        return copied

    def _changed(self) -> None:
        self.version += 1
        for listener in self.listeners:
            listener()

    def _fill(self, fills: Sequence[Fill]) -> int:
        for fill in fills:
            # bytes first, then the tag: until assign() the slot is a miss, never a wrong expert
            self._copy_in(fill.slot, self.index.expert(*fill.key))
            self.table.assign(fill.slot, fill.key)
        return len(fills)

    def _shrink(self, n_slots: int) -> int:
        moves = self.table.plan_shrink(n_slots, self.usage.hotness)
        for move in moves:
            blob = self.index.expert(*move.key)
            n = self._expert_bytes(blob)
            src = self.arena.view(move.src * self.slot_bytes, n)
            self.arena.view(move.dst * self.slot_bytes, n).copy_(src)
        self._sync()  # every copy lands before a chunk goes away
        self._changed()  # and every device-side table is rewritten
        self._sync()
        self.arena.resize(self.mapped_bytes_for(n_slots))
        return len(moves)

    def _copy_in(self, slot: int, blob: ExpertBlob) -> None:
        base = slot * self.slot_bytes
        if self.kernel:
            self.file.upload_kernel(blob, self.arena.view(base, kernel_layout(blob).nbytes))
            return
        for off, run in zip(run_offsets(blob), blob.runs, strict=True):
            dst = self.arena.view(base + off, run.nbytes)
            dst.copy_(self.index.raw(run.offset, run.nbytes), non_blocking=False)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.file.close()
        self.arena.close()
