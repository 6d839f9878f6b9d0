"""The expert cache: routed experts in fixed-size slots of an elastic arena.

The first ``core_slots`` slots are the fixed core (never shrunk, never a relocation target); the
rest is the elastic tail. Each slot holds one expert's gate, up and down: the GGUF byte runs
verbatim, or (``kernel=True``, for the GPU decode kernels) the three matrices repacked into the
kernel layout, which dequantises to the same values bit for bit. Either way a hit is computed
with exactly the values a miss is: residency never changes the numbers. The slot table tags every
slot with (layer, expert, generation); a lookup whose tag does not match raises instead of
computing with the wrong expert.

Behind the slots stands the host tier (``host.HostTier``): RAM homes, in the same layout, for the
experts no slot holds, up to the RAM budget; what fits neither is read from the mapped file. Every
expert has one home. A shrink moves the evicted experts' bytes into free host slots before their
chunks are unmapped; a grow fills the new slots from their host homes (the file only for experts
that had none) and then frees those homes. Whenever bytes have been copied out of the file into
a slot or a home, the file's pages of those runs are given back (``GGUFIndex.release``), so RAM
holds each expert once.

Resizing happens only at safe points (between forward steps): ``resize`` grows by filling the new
tail slots with the hottest missing experts, and shrinks by first moving the hottest experts of the
removed slots into the coldest surviving ones, then unmapping. Whoever keeps device-side tables
of the slots (the GPU decoder's expert tables) registers a listener: it runs after every change of
the table, and for a shrink before the removed chunks are unmapped.

The cache owns the table, the arena and the tier and decides what lives where; helpers it owns,
none of which knows the cache, do the rest: ``copies`` (slot copies, the scratch ring),
``resize`` (grow and shrink), ``exchange`` (hot RAM experts for cold tail ones, on a side
stream), ``verify`` (checksums of copies), ``tierfill`` (the tier's fill, the file's pages).
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from strata.engine.devices import on_device
from strata.engine.experts.checksum import ExpertCorrupt
from strata.engine.experts.copies import SlotCopies, chunk_groups
from strata.engine.experts.exchange import SWAP_MARGIN, Exchanges, Swap, plan_swaps
from strata.engine.experts.host import HostTier, HostTierStats, tier_slots
from strata.engine.experts.profile import UsageProfile
from strata.engine.experts.provider import ExpertWeights, FileExpertProvider
from strata.engine.experts.resize import Resizer, ResizeResult
from strata.engine.experts.slots import (
    CacheSizes,
    ExpertKey,
    SlotTable,
    UsageCounts,
    plan_sizes,
)
from strata.engine.experts.tierfill import FilePages, Progress, fill_tier, log_tier
from strata.engine.experts.verify import Copy, Verifier
from strata.engine.gguf_index import ExpertBlob, GGUFIndex
from strata.engine.quant.expert_layout import (
    align,
    kernel_layout,
    kernel_slot_bytes_for,
    run_offsets,
    slot_bytes_for,
)
from strata.engine.weights import QWeight, RepackedWeight
from strata.vmm.arena import ElasticArena, create_arena
from strata.vmm.pinned import Pinner

log = logging.getLogger(__name__)

# moved to the modules of the cache's helpers; importable from here as before
__all__ = [
    "SWAP_MARGIN",
    "ExpertCache",
    "ForeignLayer",
    "ResizeResult",
    "chunk_groups",
    "model_key",
    "owned_keys",
]

MiB = 2**20


class ForeignLayer(LookupError):
    """An expert of a layer another stage owns was asked of this stage's cache: a wiring bug,
    never served (it would read another device's slots)."""

    def __init__(self, layer: int, layers: range | None) -> None:
        own = "every layer" if layers is None else f"layers {layers.start}-{layers.stop - 1}"
        super().__init__(f"layer {layer} is not this cache's: it serves {own}")


def owned_keys(index: GGUFIndex, layers: range | None) -> list[ExpertKey]:
    """The experts of ``layers`` (None: all of them), in (layer, expert) order."""
    return sorted(k for k in index.experts if layers is None or k[0] in layers)


def model_key(index: GGUFIndex) -> str:
    """Identity of a model for its usage profile: architecture, shape, size and file name (a
    split model's: all its parts' sizes, its first part's name)."""
    n_layer = len({layer for layer, _ in index.experts})
    n_expert = len(index.experts) // max(1, n_layer)
    size = index.file_bytes
    return f"{index.arch}:{n_layer}x{n_expert}:{size}:{index.path.name}"


class ExpertCache:
    """An :class:`ExpertProvider` that serves cached experts from arena slots, the rest from
    their host homes, and those beyond the RAM budget from the file.

    It owns the slot table and the arena, and decides what lives where; its helpers move the
    bytes (``copies.SlotCopies``), run the exchanges (``exchange.Exchanges``), keep the
    checksums (``verify.Verifier``) and give the file's pages back (``tierfill.FilePages``)."""

    def __init__(
        self,
        index: GGUFIndex,
        arena: ElasticArena,
        sizes: CacheSizes,
        slot_bytes: int,
        device: torch.device,
        order: Sequence[ExpertKey],
        kernel: bool = False,
        layers: range | None = None,
    ) -> None:
        self.index = index
        self.kernel = kernel  # slots hold the kernel layout, not the file's bytes
        # the layers whose experts this cache serves (a stage's; None: every layer): it never
        # holds, serves or plans an expert of another layer
        self.layers = layers
        self.keys = owned_keys(index, layers)
        self.arena = arena
        self.sizes = sizes
        self.slot_bytes = slot_bytes
        self.device = device
        self.file = FileExpertProvider(index, device)
        self.stats = self.file.stats
        self.stats.cached = True
        self.usage: UsageCounts = self.file.usage
        self.totals: Counter[ExpertKey] = self.file.totals
        self.table = SlotTable(sizes.core_slots, len(self.keys))
        # Fill order when nothing is hot yet: the profile's order, then (layer, expert).
        mine = [k for k in order if self.owns(k[0])]
        seen = set(mine)
        self.order = mine + sorted(k for k in self.keys if k not in seen)
        self.resizes = 0
        self.swaps = 0  # exchanges of a hot RAM-homed expert with a cold tail expert
        self.version = 0  # bumped at every change of which slot holds what
        # told after every change of the tables (before a shrink unmaps), with the experts whose
        # homes changed (None: any may have): device-side tables rewrite themselves
        self.listeners: list[Callable[[Sequence[ExpertKey] | None], None]] = []
        # run before each plan: lets the decoder hand over the expert use counted on the device
        self.before_plan: Callable[[], None] | None = None
        self.tier: HostTier | None = None  # RAM homes of the experts no slot holds
        self.copies = SlotCopies(index, self.file, arena, slot_bytes, device, kernel)
        self.exchanges = Exchanges(device, slot_bytes, self.copies.slot_view)
        # verify_experts: each expert's checksum from its first copy at load, checked after
        # every later fill and move (and on samples at use); copies that disagree are dropped
        self.verifier = Verifier()
        self.pages = FilePages(index)  # the file's pages given back once copied out
        self.resizer = Resizer(index, self.table, arena, self.copies, self.usage, self.order,
                               self.pages, self._verify, self._changed)  # fmt: skip

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
        host_budget_bytes: int = 0,
        pinner: Pinner | None = None,
        progress: Progress | None = None,
        verify: bool = False,
        layers: range | None = None,
    ) -> ExpertCache:
        """A cache of the most whole slots that fit ``budget_bytes`` (at most every expert),
        filled in the profile's order. The arena reserves room for every expert, so the cache can
        later grow to the whole set without its addresses moving. ``kernel``: slots hold the
        kernel layout of the GPU decode kernels.

        ``host_budget_bytes`` > 0: a host tier of at most that much holds the experts the slots
        do not (the hottest first), and keeps the rest of its room for what a shrink evicts;
        ``pinner`` page-locks it for the device (a partial registration is a ``PinError``).
        ``progress(done, total, what)`` hears of each layer of the tier's fill. ``verify``:
        checksum every expert at load and check it after every fill and move. ``layers``: the
        layers this cache serves (a stage's), None for all of them."""
        slot_bytes = kernel_slot_bytes_for(index) if kernel else slot_bytes_for(index)
        n_experts = len(owned_keys(index, layers))
        sizes = plan_sizes(budget_bytes, slot_bytes, n_experts, tail_bytes)
        reserved = max(align(n_experts * slot_bytes, chunk_bytes), chunk_bytes)
        backend = "cuda" if device.type == "cuda" else "host"
        if arena_factory is not None:  # e.g. a host arena guarded by a simulated device
            arena = arena_factory(reserved, chunk_bytes)
        else:
            arena = create_arena(backend, reserved, chunk_bytes, device.index or 0)
        order = profile.ranked() if profile else []
        cache = cls(index, arena, sizes, slot_bytes, device, order, kernel, layers)
        cache.verify = verify
        try:
            cache.resize(sizes.total_slots)
            n_host = tier_slots(host_budget_bytes, slot_bytes, n_experts, sizes.core_slots)
            if n_host:
                cache.tier = HostTier(n_host, slot_bytes, pinner)
                with on_device(device):  # (the tier's repack kernels: this stage's GPU)
                    cache._build_tier(progress)
            held = cache.table.cached_keys()
            cache.pages.sweep(held | (cache.tier.table.cached_keys() if cache.tier else set()))
        except BaseException:
            cache.close()
            raise
        _log_cache(cache, n_experts, backend, reserved)
        return cache

    def _build_tier(self, progress: Progress | None) -> None:
        """Fill the tier with the hottest experts no slot holds (see ``tierfill.fill_tier``)."""
        tier = self.tier
        assert tier is not None
        ranked = self.usage.ranked(self.order)
        want = [k for k in ranked if self.table.slot_of(k) is None][: tier.n_slots]
        write = functools.partial(self.copies.write_home, tier)
        fill_tier(tier, want, self.index, write, self.copies.sync, self._verify, self.pages,
                  progress)  # fmt: skip

    def tier_stats(self) -> HostTierStats | None:
        """The host tier's slots and homes, and the experts left on the file (None: no tier)."""
        if self.tier is None:
            return None
        return self.tier.stats(self.file_experts)

    @property
    def file_experts(self) -> int:
        """Experts with no home in VRAM or RAM: read from the mapped file when routed to."""
        held = len(self.table) + (len(self.tier.table) if self.tier is not None else 0)
        return len(self.keys) - held

    def owns(self, layer: int) -> bool:
        """Whether this cache serves ``layer``'s experts."""
        return self.layers is None or layer in self.layers

    # -- the provider protocol ------------------------------------------------------------------

    def step(self) -> None:
        self.file.step()

    def record_counts(self, counts: dict[ExpertKey, int]) -> None:
        if self.layers is not None:
            for layer, _ in counts:
                if layer not in self.layers:
                    raise ForeignLayer(layer, self.layers)
        self.file.record_counts(counts)

    def expert(self, layer: int, expert: int) -> ExpertWeights:
        key = (layer, expert)
        if not self.owns(layer):
            raise ForeignLayer(layer, self.layers)
        self.file.record(key)
        blob = self.index.expert(layer, expert)
        slot = self.table.slot_of(key)
        if slot is not None:
            self.table.check(slot, key)  # a wrong expert is an error, never a plausible answer
            self.stats.hits += 1
            self.stats.bytes_from_cache += blob.nbytes
            return _weights(self.kernel, blob, self.copies.slot_view(slot))
        home = self.tier.slot_of(key) if self.tier is not None else None
        if home is None:
            return self.file.from_file(blob)
        assert self.tier is not None
        self.tier.table.check(home, key)
        self.stats.misses += 1
        self.stats.bytes_from_ram += blob.nbytes
        data = self.tier.view(home, self.copies.expert_bytes(blob))
        if self.device.type != "cpu":  # the reference path on a GPU: one copy of the home
            data = data.to(self.device, non_blocking=True)
        return _weights(self.kernel, blob, data)

    # -- sizes ----------------------------------------------------------------------------------

    @property
    def n_slots(self) -> int:
        return self.table.n_slots

    def slot_address(self, slot: int) -> int:
        """The stable address of ``slot`` (the arena never moves)."""
        return self.arena.address(slot * self.slot_bytes)

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
    def core_mapped_bytes(self) -> int:
        """What the arena maps with the cache at its core (whole chunks): the least it can
        hold."""
        return self.mapped_bytes_for(self.sizes.core_slots)

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
        return self.resizer.mapped_bytes_for(n_slots)

    @property
    def released_bytes(self) -> int:
        """File pages given back after their runs were copied into a slot or a home."""
        return self.pages.released_bytes

    # -- exchanges ------------------------------------------------------------------------------

    def exchange(self, max_swaps: int) -> int:
        """Swap up to ``max_swaps`` experts whose home is in RAM, hottest first, with the
        coldest experts of the elastic tail (call at a safe point only): each promoted expert
        takes the victim's slot, and the victim a home in RAM, so every expert keeps exactly
        one home. A pair swaps only when the promoted expert's decayed use is more than
        ``SWAP_MARGIN`` times the victim's (no churn between equals). Exchanges started at an
        earlier safe point land first.

        On a GPU with free room in the tier, the copies run on a side stream while the next
        steps compute, through ``max_swaps`` device slots (the promoted experts up, the victims
        down into free homes), and land at the next safe point: until then every table still
        names the old homes, whose bytes stay as they are. Elsewhere (or with no room for the
        victims) they queue on the compute stream now, each victim into the home its promoted
        expert left, and the tables follow at once. Returns the exchanges started."""
        with on_device(self.device):  # (a later stage's cache: its own GPU)
            return self._exchange_homes(max_swaps)

    @property
    def exchanging(self) -> bool:
        """Exchanges are on their way (their copies on the side stream): ``land_exchanges``
        at the next safe point puts them into the tables."""
        return self.exchanges.in_flight

    def land_exchanges(self) -> int:
        """At a safe point: finish the exchanges whose copies ran on the side stream since the
        last one (the compute stream waits for them, nothing on the host does), retag, and let
        the tables follow. Returns the exchanges that landed."""
        if not self.exchanges.in_flight:
            return 0
        with on_device(self.device):
            return self._land()

    def _exchange_homes(self, max_swaps: int) -> int:
        if max_swaps < 0:
            raise ValueError(f"max_swaps={max_swaps} is negative")
        self._land()
        tier = self.tier
        if tier is None or max_swaps == 0 or not len(tier.table):
            return 0
        tail = ((s, t.key if (t := self.table.tag(s)) else None) for s in self.table.tail_slots())
        ram = ((s, t.key) for s, t in tier.table)
        pairs = plan_swaps(ram, tail, self.usage.count, max_swaps, SWAP_MARGIN)
        if not pairs:
            return 0
        for p in pairs:
            tier.table.check(p.home, p.key)
        if self.before_plan is not None:
            self.before_plan()  # uses so far are classified by the homes they ran under
        self.exchanges.buffer(max_swaps)  # (kept at the most any call asks for)
        if self.device.type == "cuda" and tier.pinned:
            victims = sum(p.victim is not None for p in pairs)
            free = tier.take(victims)
            if len(free) == victims:
                self.exchanges.start(pairs, free, tier)
                return len(pairs)
            log.debug("no free room in the host tier for %d victims: exchanges in stream order",
                      len(pairs))  # fmt: skip
        self._landed(self.exchanges.in_stream(pairs, tier, self.table))
        return len(pairs)

    def _land(self) -> int:
        swaps = self.exchanges.land(self.tier, self.table)
        if swaps:
            self._landed(swaps)
        return len(swaps)

    def _landed(self, swaps: Sequence[Swap]) -> None:
        """Count, check (with ``verify``) and announce exchanges whose bytes are in place."""
        self.swaps += len(swaps)
        moved: list[Copy] = [(p.key, "slot", p.slot) for p in swaps]
        moved += [(p.victim, "home", p.new_home) for p in swaps if p.victim is not None]  # type: ignore[misc]
        self._verify(moved)
        keys = [p.key for p in swaps] + [p.victim for p in swaps if p.victim is not None]
        self._changed(keys)

    # -- verify_experts -------------------------------------------------------------------------

    @property
    def verify(self) -> bool:
        """verify_experts: checksum every expert at load, check every later copy of it."""
        return self.verifier.enabled

    @verify.setter
    def verify(self, on: bool) -> None:
        self.verifier.enabled = on

    @property
    def sums(self) -> dict[ExpertKey, int]:
        """Each expert's checksum from its first copy (with ``verify``)."""
        return self.verifier.sums

    @property
    def corrupt(self) -> int:
        """Copies found not to match their expert's checksum (and dropped)."""
        return self.verifier.corrupt

    def _verify(self, copies: Sequence[Copy]) -> list[ExpertKey]:
        """With ``verify``: checksum each new copy (key, "slot" or "home", its slot) where it
        lies (``Verifier.check``); a copy that disagrees with the expert's first is dropped at
        once (its tag cleared: those bytes are never used). Returns the experts whose copy was
        dropped."""
        if not self.verifier.wants(copies):
            return []
        views = [self.copies.view_of(self.tier, w, s, self.index.expert(*k)) for k, w, s in copies]
        bad = self.verifier.check(copies, views)
        for key, where, slot in bad:
            if where == "slot":
                if self.table.slot_of(key) == slot:
                    self.table.clear(slot)
            elif self.tier is not None and self.tier.slot_of(key) == slot:
                self.tier.drop(key)
        return [key for key, _, _ in bad]

    def check_sample(self, keys: Sequence[ExpertKey]) -> None:
        """With ``verify``: check the copies the kernels read now for ``keys`` (sampled from
        recent use). A mismatch drops the copy and raises :class:`ExpertCorrupt` naming the
        expert: the bytes a step just read were wrong, so the request stops."""
        copies: list[Copy] = []
        for key in keys:
            if (slot := self.table.slot_of(key)) is not None:
                copies.append((key, "slot", slot))
            elif self.tier is not None and (home := self.tier.slot_of(key)) is not None:
                copies.append((key, "home", home))
        bad = self._verify(self.verifier.known(copies))
        if bad:
            self._changed()
            names = ", ".join(f"(layer {k[0]}, expert {k[1]})" for k in bad)
            raise ExpertCorrupt(
                f"expert bytes in use do not match their checksum from load: {names}; the "
                "copies are dropped and the experts are read from the file from now on"
            )

    # -- resize ---------------------------------------------------------------------------------

    def resize(self, n_slots: int, max_shrink: int | None = None) -> ResizeResult:
        """Grow or shrink to ``n_slots`` (call at a safe point only). A shrink removes at most
        ``max_shrink`` slots per call when given; a grow that cannot get all its memory stops at
        the slots it got; the cache never goes below its core."""
        with on_device(self.device):  # the repack kernels of a fill launch on the current GPU
            return self._resize(n_slots, max_shrink)

    def _resize(self, n_slots: int, max_shrink: int | None) -> ResizeResult:
        if not self.sizes.core_slots <= n_slots <= self.table.max_slots:
            raise ValueError(
                f"cache size of {n_slots} slots is outside [{self.sizes.core_slots} (the core), "
                f"{self.table.max_slots} (every expert)]"
            )
        if max_shrink is not None and max_shrink < 1:
            raise ValueError(f"max_shrink of {max_shrink} slots must be at least 1")
        t0 = time.perf_counter()
        self._land()  # exchanges on their way land first: a resize plans from settled homes
        if self.before_plan is not None:
            self.before_plan()
        before = self.table.n_slots
        if max_shrink is not None:
            n_slots = max(n_slots, before - max_shrink)
        to_host = to_file = from_host = 0
        phases: dict[str, float] = {}
        if n_slots > before or (n_slots == before and self.table.free_slots()):
            # (at creation with no elastic tail the core is the whole size: it fills here)
            copied, from_host = self.resizer.grow(n_slots, self.tier)
        else:
            copied, to_host, to_file = self.resizer.shrink(n_slots, self.tier, phases)
        result = ResizeResult(
            before, self.table.n_slots, copied, time.perf_counter() - t0, to_host, to_file,
            from_host, phases,
        )  # fmt: skip
        if result.from_slots != result.to_slots:
            self.resizes += 1
        return result

    def _changed(self, keys: Sequence[ExpertKey] | None = None) -> None:
        """Tell the listeners; ``keys``: the only experts whose homes changed (None: any)."""
        self.version += 1
        for listener in self.listeners:
            listener(keys)

    def close(self) -> None:
        self.land_exchanges()
        self.copies.sync()
        self.file.close()
        self.arena.close()
        self.exchanges.close()
        self.copies.close()
        self.verifier.close()
        if self.tier is not None:
            self.tier.close()
            self.tier = None


def _weights(kernel: bool, blob: ExpertBlob, data: torch.Tensor) -> ExpertWeights:
    """The expert's three matrices over ``data``, its bytes in the slots' layout (``kernel``:
    the decode kernels', else the file's)."""
    if kernel:
        lay = kernel_layout(blob)
        gate, up, down = (
            RepackedWeight(data[off : off + m.nbytes], m)
            for off, m in zip(lay.offsets, lay.layouts, strict=True)
        )
        return ExpertWeights(gate, up, down)
    gate, up, down = (
        QWeight.of_run(data[off : off + run.nbytes], run)
        for off, run in zip(run_offsets(blob), blob.runs, strict=True)
    )
    return ExpertWeights(gate, up, down)


def _log_cache(cache: ExpertCache, n_experts: int, backend: str, reserved: int) -> None:
    sizes, slot_bytes, layers = cache.sizes, cache.slot_bytes, cache.layers
    log.info(
        "expert cache: %d of %d experts (%.0f MiB; core %d slots, tail %d) of %.2f MiB each, "
        "%s arena of %.0f MiB reserved in %d MiB chunks%s%s",
        cache.table.n_slots,
        n_experts,
        cache.table.n_slots * slot_bytes / MiB,
        sizes.core_slots,
        sizes.tail_slots,
        slot_bytes / MiB,
        backend,
        reserved / MiB,
        cache.arena.chunk_bytes // MiB,
        ", kernel layout" if cache.kernel else "",
        "" if layers is None else f", layers {layers.start}-{layers.stop - 1}",
    )
    pinned = cache.tier is not None and cache.tier.pinned
    log_tier(cache.tier_stats(), pinned, cache.file_experts, slot_bytes, cache.released_bytes)
