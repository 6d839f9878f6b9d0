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
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from strata.engine.devices import on_device
from strata.engine.experts.checksum import ExpertCorrupt, checksums
from strata.engine.experts.host import HostTier, HostTierStats, tier_slots
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
from strata.engine.quant.expert_layout import (
    align,
    kernel_layout,
    kernel_slot_bytes_for,
    packed_bytes,
    run_offsets,
    slot_bytes_for,
)
from strata.engine.weights import QWeight, RepackedWeight
from strata.vmm.arena import ElasticArena, create_arena
from strata.vmm.pinned import Pinner

Progress = Callable[[int, int, str], None]  # (done, total, what)

log = logging.getLogger(__name__)

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
    to_host: int = 0  # experts a shrink moved into host homes
    to_file: int = 0  # experts a shrink left with no home but the file (the host tier was full)
    from_host: int = 0  # experts a grow filled from their host homes
    # a shrink's seconds by phase: plan, copy_out (queued), tables, unmap (waiting for each
    # chunk's copies), wait (the last table copies)
    phases: dict[str, float] = field(default_factory=dict)


def chunk_groups(
    pairs: Sequence[tuple[int, int]], slot_bytes: int, chunk_bytes: int
) -> tuple[dict[int, list[tuple[int, int]]], dict[int, int]]:
    """Group (slot, home) copies by the arena chunk each slot starts in; with each chunk that
    any of those slots covers, the lowest group reading it (copies queued top group first, so
    that group's copies are the chunk's last)."""
    groups: dict[int, list[tuple[int, int]]] = {}
    last: dict[int, int] = {}
    for slot, home in pairs:
        first = slot * slot_bytes // chunk_bytes
        groups.setdefault(first, []).append((slot, home))
        for c in range(first, ((slot + 1) * slot_bytes - 1) // chunk_bytes + 1):
            last[c] = min(last.get(c, first), first)
    return groups, last


@dataclass(frozen=True)
class _Swap:
    """One exchange: ``key`` leaves its RAM ``home`` for ``slot``, whose expert ``victim`` (None:
    the slot was empty) goes to ``new_home``."""

    key: ExpertKey
    home: int
    slot: int
    victim: ExpertKey | None
    new_home: int | None = None


@dataclass
class _InFlight:
    """Exchanges whose copies were queued on the side stream; ``done`` follows them."""

    swaps: list[_Swap]
    done: torch.cuda.Event


class _Clock:
    """Seconds since the previous mark, by phase name."""

    def __init__(self, into: dict[str, float]) -> None:
        self.into, self.t = into, time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.into[phase] = self.into.get(phase, 0.0) + now - self.t
        self.t = now


class ExpertCache:
    """An :class:`ExpertProvider` that serves cached experts from arena slots, the rest from
    their host homes, and those beyond the RAM budget from the file."""

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
        # verify_experts: each expert's checksum from its first copy at load, checked after
        # every later fill and move (and on samples at use); copies that disagree are dropped
        self.verify = False
        self.sums: dict[ExpertKey, int] = {}
        self.corrupt = 0
        self._exchange: torch.Tensor | None = None  # device slots the exchanges pass through
        self._side: torch.cuda.Stream | None = None  # where exchanges copy while steps compute
        self._in_flight: _InFlight | None = None  # exchanges whose copies run there
        self.version = 0  # bumped at every change of which slot holds what
        # run after each change (before a shrink unmaps): device-side tables rewrite themselves
        # told after every change of the tables, with the experts whose homes changed (None:
        # any may have)
        self.listeners: list[Callable[[Sequence[ExpertKey] | None], None]] = []
        # run before each plan: lets the decoder hand over the expert use counted on the device
        self.before_plan: Callable[[], None] | None = None
        self.tier: HostTier | None = None  # RAM homes of the experts no slot holds
        self.released_bytes = 0  # file pages given back after their runs were copied
        self._scratch: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._next_scratch = 0

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
            cache._sweep_readahead()
        except BaseException:
            cache.close()
            raise
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
            chunk_bytes // MiB,
            ", kernel layout" if kernel else "",
            "" if layers is None else f", layers {layers.start}-{layers.stop - 1}",
        )
        cache._log_tier()
        return cache

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

    def _log_tier(self) -> None:
        t = self.tier_stats()
        if t is None:
            log.info("no host tier: the %d experts no slot holds are read from the file",
                     self.file_experts)  # fmt: skip
            return
        log.info(
            "host tier: %d experts in RAM (%.0f MiB%s), room for %d more (%.0f MiB); %d experts "
            "(%.0f MiB) beyond the RAM budget are read from the file; %.0f MiB of file pages "
            "given back",
            t.experts,
            t.expert_bytes / MiB,
            ", page-locked for the GPU" if self.tier is not None and self.tier.pinned else "",
            t.slots - t.experts,
            (t.slots - t.experts) * t.slot_bytes / MiB,
            t.file_experts,
            t.file_experts * self.slot_bytes / MiB,
            self.released_bytes / MiB,
        )

    def _build_tier(self, progress: Progress | None) -> None:
        """Fill the tier with the hottest experts no slot holds, layer by layer, giving the
        file's pages of each layer back once its experts are copied."""
        tier = self.tier
        assert tier is not None
        ranked = self.usage.ranked(self.order)
        want = [k for k in ranked if self.table.slot_of(k) is None][: tier.n_slots]
        by_layer: dict[int, list[ExpertKey]] = {}
        for key in want:
            by_layer.setdefault(key[0], []).append(key)
        slots = tier.take(len(want))
        n_layers = len(by_layer)
        i = 0
        for n, layer in enumerate(sorted(by_layer), 1):
            keys = sorted(by_layer[layer])
            for key in keys:
                self._write_home(slots[i], self.index.expert(*key))
                i += 1
            self._sync()  # every byte is in its home before its tag says so
            for j, key in enumerate(keys):
                tier.assign(slots[i - len(keys) + j], key)
            self._verify([(k, "home", slots[i - len(keys) + j]) for j, k in enumerate(keys)])
            self._release(keys)
            if progress is not None:
                progress(n, n_layers, f"host tier: layer {n} of {n_layers}")

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
            return self._weights(blob, self.arena.view(slot * self.slot_bytes, self.slot_bytes))
        home = self.tier.slot_of(key) if self.tier is not None else None
        if home is None:
            return self.file.from_file(blob)
        assert self.tier is not None
        self.tier.table.check(home, key)
        self.stats.misses += 1
        self.stats.bytes_from_ram += blob.nbytes
        data = self.tier.view(home, self._expert_bytes(blob))
        if self.device.type != "cpu":  # the reference path on a GPU: one copy of the home
            data = data.to(self.device, non_blocking=True)
        return self._weights(blob, data)

    def _weights(self, blob: ExpertBlob, data: torch.Tensor) -> ExpertWeights:
        """The expert's three matrices over ``data``, its bytes in this cache's layout."""
        if self.kernel:
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
        return align(n_slots * self.slot_bytes, self.arena.chunk_bytes) if n_slots else 0

    def exchange(self, max_swaps: int) -> int:
        with on_device(self.device):  # (a later stage's cache: its own GPU)
            return self._exchange_homes(max_swaps)

    @property
    def exchanging(self) -> bool:
        """Exchanges are on their way (their copies on the side stream): ``land_exchanges``
        at the next safe point puts them into the tables."""
        return self._in_flight is not None

    def land_exchanges(self) -> int:
        """At a safe point: finish the exchanges whose copies ran on the side stream since the
        last one (the compute stream waits for them, nothing on the host does), retag, and let
        the tables follow. Returns the exchanges that landed."""
        if self._in_flight is None:
            return 0
        with on_device(self.device):
            return self._land()

    def _exchange_homes(self, max_swaps: int) -> int:
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
        if max_swaps < 0:
            raise ValueError(f"max_swaps={max_swaps} is negative")
        self._land()
        tier = self.tier
        if tier is None or max_swaps == 0 or not len(tier.table):
            return 0
        # the few hottest RAM experts and coldest tail slots, not every one sorted: this runs on
        # the host between steps, over thousands of experts
        heat = self.usage.count
        hot = heapq.nlargest(max_swaps, ((heat(t.key), s, t.key) for s, t in tier.table))
        cold = heapq.nsmallest(
            max_swaps,
            (
                (heat(t.key) if (t := self.table.tag(s)) else -1.0, s)
                for s in self.table.tail_slots()
            ),
        )
        pairs = []
        for (h_heat, home, key), (v_heat, slot) in zip(hot, cold, strict=False):
            if h_heat <= 0 or h_heat <= SWAP_MARGIN * max(v_heat, 0.0):
                break  # hotness only falls along `hot` and rises along `cold`
            tier.table.check(home, key)
            tag = self.table.tag(slot)
            pairs.append(_Swap(key, home, slot, None if tag is None else tag.key))
        if not pairs:
            return 0
        if self.before_plan is not None:
            self.before_plan()  # uses so far are classified by the homes they ran under
        buf = self._exchange_slots(max_swaps)
        n = self.slot_bytes
        if self.device.type == "cuda" and tier.pinned:
            victims = sum(p.victim is not None for p in pairs)
            free = tier.take(victims)
            if len(free) == victims:
                self._start(pairs, free, buf)
                return len(pairs)
            log.debug("no free room in the host tier for %d victims: exchanges in stream order",
                      len(pairs))  # fmt: skip
        for j, p in enumerate(pairs):
            x = buf[j * n : (j + 1) * n]
            x.copy_(tier.view(p.home), non_blocking=True)  # the promoted expert, up
            if p.victim is not None:
                tier.view(p.home).copy_(self._slot_view(p.slot), non_blocking=True)  # down
            self._slot_view(p.slot).copy_(x, non_blocking=True)
            self.table.assign(p.slot, p.key)
            if p.victim is not None:
                tier.assign(p.home, p.victim)
            else:
                tier.drop(p.key)  # into an empty tail slot: the home becomes room
        self._landed([replace(p, new_home=p.home) for p in pairs])
        return len(pairs)

    def _start(self, pairs: list[_Swap], free: list[int], buf: torch.Tensor) -> None:
        """Queue the exchanges' copies on the side stream, behind everything queued so far:
        each promoted expert up into its device slot of ``buf``, each victim down into a free
        home (``free``, one per victim). Nothing is retagged until they land."""
        tier = self.tier
        assert tier is not None
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        side, n, rooms = self._side, self.slot_bytes, iter(free)
        side.wait_stream(torch.cuda.current_stream(self.device))
        swaps = []
        with torch.cuda.stream(side):
            for j, p in enumerate(pairs):
                buf[j * n : (j + 1) * n].copy_(tier.view(p.home), non_blocking=True)
                if p.victim is not None:
                    p = replace(p, new_home=next(rooms))
                    tier.view(p.new_home).copy_(self._slot_view(p.slot), non_blocking=True)
                swaps.append(p)
            done = torch.cuda.Event()
            done.record(side)
        self._in_flight = _InFlight(swaps, done)

    def _land(self) -> int:
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return 0
        tier, buf, n = self.tier, self._exchange, self.slot_bytes
        assert tier is not None and buf is not None
        torch.cuda.current_stream(self.device).wait_event(flight.done)
        for j, p in enumerate(flight.swaps):
            # in stream order behind the steps that still read the victim where it was
            self._slot_view(p.slot).copy_(buf[j * n : (j + 1) * n], non_blocking=True)
            self.table.assign(p.slot, p.key)
            tier.drop(p.key)  # the promoted expert's home becomes room
            if p.victim is not None:
                assert p.new_home is not None
                tier.assign(p.new_home, p.victim)
        self._landed(flight.swaps)
        return len(flight.swaps)

    def _landed(self, swaps: Sequence[_Swap]) -> None:
        """Count, check (with ``verify``) and announce exchanges whose bytes are in place."""
        self.swaps += len(swaps)
        moved = [(p.key, "slot", p.slot) for p in swaps]
        moved += [(p.victim, "home", p.new_home) for p in swaps if p.victim is not None]
        self._verify(moved)  # type: ignore[arg-type]
        keys = [p.key for p in swaps] + [p.victim for p in swaps if p.victim is not None]
        self._changed(keys)

    # -- verify_experts -------------------------------------------------------------------------

    def _home_view(self, home: int, nbytes: int) -> torch.Tensor:
        """A host home's bytes where the compute device reads them (over PCIe on a GPU)."""
        tier = self.tier
        assert tier is not None
        if tier.pinned and self.device.type == "cuda":
            return tier.memory.device_view(home * tier.slot_bytes, nbytes, self.device.index or 0)
        return tier.view(home, nbytes)

    def _verify(self, copies: Sequence[tuple[ExpertKey, str, int]]) -> list[ExpertKey]:
        """With ``verify``: checksum each new copy (key, "slot" or "home", its slot) where it
        lies; the first copy of an expert records its sum, a later one that disagrees is
        dropped at once (its tag cleared: those bytes are never used) and logged, naming the
        expert. Returns the experts whose copy was dropped."""
        if not self.verify or not copies:
            return []
        views = []
        for key, where, slot in copies:
            n = self._expert_bytes(self.index.expert(*key))
            views.append(self._slot_view(slot, n) if where == "slot" else self._home_view(slot, n))
        bad = []
        for (key, where, slot), got in zip(copies, checksums(views), strict=True):
            want = self.sums.setdefault(key, got)
            if got == want:
                continue
            bad.append(key)
            self.corrupt += 1
            if where == "slot":
                if self.table.slot_of(key) == slot:
                    self.table.clear(slot)
            elif self.tier is not None and self.tier.slot_of(key) == slot:
                self.tier.drop(key)
            log.error(
                "(layer %d, expert %d): its bytes in %s %d do not match its checksum from load; "
                "that copy is dropped and never used, the expert is read from the file",
                key[0], key[1], "VRAM slot" if where == "slot" else "host slot", slot,
            )  # fmt: skip
        return bad

    def check_sample(self, keys: Sequence[ExpertKey]) -> None:
        """With ``verify``: check the copies the kernels read now for ``keys`` (sampled from
        recent use). A mismatch drops the copy and raises :class:`ExpertCorrupt` naming the
        expert: the bytes a step just read were wrong, so the request stops."""
        copies = []
        for key in keys:
            if (slot := self.table.slot_of(key)) is not None:
                copies.append((key, "slot", slot))
            elif self.tier is not None and (home := self.tier.slot_of(key)) is not None:
                copies.append((key, "home", home))
        copies = [c for c in copies if c[0] in self.sums]
        bad = self._verify(copies)
        if bad:
            self._changed()
            names = ", ".join(f"(layer {k[0]}, expert {k[1]})" for k in bad)
            raise ExpertCorrupt(
                f"expert bytes in use do not match their checksum from load: {names}; the "
                "copies are dropped and the experts are read from the file from now on"
            )

    def _exchange_slots(self, n: int) -> torch.Tensor:
        if self._exchange is None or self._exchange.numel() < n * self.slot_bytes:
            # a plain tensor even when made inside a request's inference mode: adaptation points
            # come in and outside it
            with torch.inference_mode(False):
                self._exchange = torch.empty(
                    n * self.slot_bytes, dtype=torch.uint8, device=self.device
                )
        return self._exchange

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
            copied, from_host = self._grow(n_slots)
        else:
            copied, to_host, to_file = self._shrink(n_slots, phases)
        result = ResizeResult(
            before, self.table.n_slots, copied, time.perf_counter() - t0, to_host, to_file,
            from_host, phases,
        )  # fmt: skip
        if result.from_slots != result.to_slots:
            self.resizes += 1
        return result

    def _grow(self, n_slots: int) -> tuple[int, int]:
        self.arena.resize(max(self.arena.mapped_bytes, self.mapped_bytes_for(n_slots)))
        got = min(n_slots, self.arena.mapped_bytes // self.slot_bytes)
        if got < n_slots:
            log.warning("expert cache grow to %d slots got memory for %d only", n_slots, got)
        ranked = self.usage.ranked(self.order)
        # empty slots below the old top first (the core at creation), then the new tail slots;
        # one plan's fills are executed before the next plan is made
        copied, from_host = self._fill(self.table.plan_fill(ranked))
        more, more_host = self._fill(self.table.plan_grow(got, self.usage.ranked(self.order)))
        self._sync()
        self._changed()
        return copied + more, from_host + more_host

    def _changed(self, keys: Sequence[ExpertKey] | None = None) -> None:
        """Tell the listeners; ``keys``: the only experts whose homes changed (None: any)."""
        self.version += 1
        for listener in self.listeners:
            listener(keys)

    def _fill(self, fills: Sequence[Fill]) -> tuple[int, int]:
        """Copy each fill's expert into its slot: from its host home (one copy over PCIe, then
        the home is freed) or from the file (then the file's pages of it are given back).
        Returns (fills, fills from host homes)."""
        tier = self.tier
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
            self._copy_slots(pairs, tier.view, self._slot_view, src_piece=tier.piece_slots)
            self._sync()  # the bytes are in the slots before the homes go
            for f in homed:
                self.table.assign(f.slot, f.key)
                tier.drop(f.key)
            self._verify([(f.key, "slot", f.slot) for f in homed])
        for _, group in _by_layer(from_file):
            for fill in group:
                # bytes first, then the tag: until assign() the slot is a miss, never a wrong one
                self._copy_in(fill.slot, self.index.expert(*fill.key))
                self.table.assign(fill.slot, fill.key)
            self._verify([(f.key, "slot", f.slot) for f in group])
            self._release([f.key for f in group])  # read already: staging copies synchronously
        return len(fills), len(homed)

    def _shrink(self, n_slots: int, phases: dict[str, float]) -> tuple[int, int, int]:
        """Returns (moves within VRAM, experts moved into host homes, experts left to the file).

        Stream order: the survivors' evicted experts are copied out first (the moves overwrite
        them), then the moves, then the removed slots' experts, the top chunk's first with an
        event behind each chunk's copies; the device tables are planned while those copies run,
        and each chunk is unmapped as soon as its own copies are done, so the top of the arena
        goes back to the system while the rest is still on its way over PCIe."""
        clock = _Clock(phases)
        self._sync()  # from here only this stream's copies touch the arena (see _copy_out_top_down)
        before = {t.key: s for s, t in self.table}
        moves = self.table.plan_shrink(n_slots, self.usage.hotness)
        kept = self.table.cached_keys()
        leaving = {k: s for k, s in before.items() if k not in kept}
        homes = self._homes_for(leaving)
        clock.mark("plan")
        low = [(leaving[k], h) for k, h in homes.items() if leaving[k] < n_slots]
        high = [(leaving[k], h) for k, h in homes.items() if leaving[k] >= n_slots]
        error = self._copy_out(low)
        for move in moves:
            blob = self.index.expert(*move.key)
            n = self._expert_bytes(blob)
            src = self.arena.view(move.src * self.slot_bytes, n)
            self.arena.view(move.dst * self.slot_bytes, n).copy_(src)
        ready = None
        if error is None:
            ready, error = self._copy_out_top_down(high)
        if error is not None:  # a copy the driver refused: they all stay with the file
            self._sync()
            log.warning("could not copy %d evicted experts into the host tier (%s): they are "
                        "read from the file", len(homes), error)  # fmt: skip
            homes = {}
        to_host = len(homes)
        tier = self.tier
        for key, home in homes.items():
            assert tier is not None
            tier.assign(home, key)
        clock.mark("copy_out")
        checked = [(m.key, "slot", m.dst) for m in moves]
        checked += [(k, "home", h) for k, h in homes.items()]
        self._verify(checked)
        # The device-side tables are rewritten in stream order behind the copies (the host
        # plans them while the copies run); nothing reads them before the next step.
        self._changed()
        clock.mark("tables")
        target = self.mapped_bytes_for(n_slots)
        self.arena.shrink(self.arena.mapped_bytes - target, ready)
        clock.mark("unmap")
        self._sync()  # the table copies have landed when the call returns
        clock.mark("wait")
        to_file = len(leaving) - to_host
        if to_file:
            log.info(
                "%d evicted experts have no room in the host tier: they are read from the file",
                to_file,
            )
        return len(moves), to_host, to_file

    def _homes_for(self, leaving: dict[ExpertKey, int]) -> dict[ExpertKey, int]:
        """Free host slots for the evicted experts (key -> the removed slot that holds it), the
        hottest first where there is not room for all: key -> home, in slot order."""
        tier = self.tier
        if tier is None or not leaving:
            return {}
        free = tier.take(len(leaving))
        keys = list(leaving)
        if len(free) < len(keys):
            heat = self.usage.hotness
            keys.sort(key=lambda k: -float(heat.get(k, 0.0)))
        keys = sorted(keys[: len(free)], key=lambda k: leaving[k])  # slot order: runs coalesce
        return dict(zip(keys, free, strict=True))

    def _copy_out(self, pairs: Sequence[tuple[int, int]]) -> str | None:
        """Queue the copies of (VRAM slot, host home) pairs; the driver's error when it refused
        one (the caller then leaves every evicted expert to the file)."""
        if not pairs:
            return None
        tier = self.tier
        assert tier is not None
        try:
            self._copy_slots(pairs, self._slot_view, tier.view, dst_piece=tier.piece_slots)
        except RuntimeError as e:
            return str(e).splitlines()[0]
        return None

    def _copy_out_top_down(
        self, pairs: Sequence[tuple[int, int]]
    ) -> tuple[Callable[[int], None] | None, str | None]:
        """Queue the copies of the removed slots' (slot, home) pairs, grouped by the chunk each
        slot starts in, the top group first, an event behind each group. Returns the arena's
        ``ready`` for the unmap (on a GPU: it waits for the event behind the last copy that
        reads the chunk, or behind the moves for a chunk no copy reads) and the driver's error
        when it refused a copy (then no ``ready``: the arena synchronises the device)."""
        if self.device.type != "cuda":
            return None, self._copy_out(pairs)  # (copies on the CPU are done when queued)
        C = self.arena.chunk_bytes
        groups, last = chunk_groups(pairs, self.slot_bytes, C)
        moved = torch.cuda.Event()
        moved.record()  # behind the survivors' copies and the moves
        events: dict[int, torch.cuda.Event] = {}
        for first in sorted(groups, reverse=True):
            error = self._copy_out(groups[first])
            if error is not None:
                return None, error
            events[first] = torch.cuda.Event()
            events[first].record()

        def ready(offset: int) -> None:
            group = last.get(offset // C)
            (moved if group is None else events[group]).synchronize()

        return ready, None

    def _slot_view(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        n = self.slot_bytes if nbytes is None else nbytes
        return self.arena.view(slot * self.slot_bytes, n)

    def _copy_slots(
        self,
        pairs: Sequence[tuple[int, int]],
        src: Callable[[int, int], torch.Tensor],
        dst: Callable[[int, int], torch.Tensor],
        src_piece: int = 0,
        dst_piece: int = 0,
    ) -> None:
        """Copy whole slots (src slot, dst slot), asynchronously where the device allows; runs
        of consecutive slots on both sides go as one copy, unless a run would cross a boundary
        of ``src_piece`` (``dst_piece``) slots on its side (separately page-locked pieces)."""
        pairs = sorted(pairs)
        i = 0
        while i < len(pairs):
            j = i + 1
            while (
                j < len(pairs)
                and pairs[j] == (pairs[i][0] + j - i, pairs[i][1] + j - i)
                and not (src_piece and pairs[j][0] % src_piece == 0)
                and not (dst_piece and pairs[j][1] % dst_piece == 0)
            ):
                j += 1
            n = (j - i) * self.slot_bytes
            dst(pairs[i][1], n).copy_(src(pairs[i][0], n), non_blocking=True)
            i = j

    def _copy_in(self, slot: int, blob: ExpertBlob) -> None:
        base = slot * self.slot_bytes
        if self.kernel:
            self.file.upload_kernel(blob, self.arena.view(base, kernel_layout(blob).nbytes))
            return
        for off, run in zip(run_offsets(blob), blob.runs, strict=True):
            dst = self.arena.view(base + off, run.nbytes)
            dst.copy_(self.index.raw(run.offset, run.nbytes), non_blocking=False)

    def _write_home(self, home: int, blob: ExpertBlob) -> None:
        """Write ``blob`` from the file into host slot ``home``, in this cache's layout."""
        tier = self.tier
        assert tier is not None
        n = self._expert_bytes(blob)
        if not self.kernel:
            dst = tier.view(home, n)
            for off, run in zip(run_offsets(blob), blob.runs, strict=True):
                dst[off : off + run.nbytes].copy_(self.index.raw(run.offset, run.nbytes))
            return
        if self.device.type == "cpu":
            self.file.upload_kernel(blob, tier.view(home, n))
            return
        # repacked on the device (one launch per matrix), then copied down into the home
        scratch, done = self._scratch_slot()
        self.file.upload_kernel(blob, scratch)
        tier.view(home, n).copy_(scratch[:n], non_blocking=True)
        if done is not None:
            done.record()

    def _scratch_slot(self) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """One of a ring of device slots the tier's fill repacks into; waits for the copy that
        last read it."""
        if not self._scratch:
            with torch.inference_mode(False):  # (as _exchange_slots)
                self._scratch = [
                    (torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device),
                     torch.cuda.Event())
                    for _ in range(SCRATCH_SLOTS)
                ]  # fmt: skip
        slot, done = self._scratch[self._next_scratch]
        self._next_scratch = (self._next_scratch + 1) % len(self._scratch)
        if done is not None:
            done.synchronize()
        return slot, done

    def _release(self, keys: Sequence[ExpertKey]) -> None:
        """Give back the file's pages of these experts' runs (their bytes are in a slot or a
        home now). A refusal is logged, never fatal: the pages are only cache."""
        runs = [(r.offset, r.nbytes) for k in keys for r in self.index.expert(*k).runs]
        try:
            self.released_bytes += self.index.release(runs)
        except OSError as e:
            log.warning("could not give back the file pages of %d experts: %s", len(keys), e)

    def _sweep_readahead(self) -> None:
        """Once the load has copied every expert it could: give back the file pages of all the
        experts that have a home again. Each copy's pages went back after it, but the kernel's
        readahead for later copies brings back pages of runs already given back (measured:
        3-13 MiB of 192 MiB on a test file, varying run to run). Not counted in
        ``released_bytes``: these are the same runs."""
        held = self.table.cached_keys() | (self.tier.table.cached_keys() if self.tier else set())
        runs = [(r.offset, r.nbytes) for k in held for r in self.index.expert(*k).runs]
        try:
            self.index.release(runs)
        except OSError as e:
            log.warning("could not give back the file pages read ahead at load: %s", e)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.land_exchanges()
        self._sync()
        self.file.close()
        self.arena.close()
        self._scratch = []
        if self.tier is not None:
            self.tier.close()
            self.tier = None


SCRATCH_SLOTS = 4  # device slots the tier's fill repacks into, used in turn
# A RAM-homed expert replaces a tail expert only when used more than this many times as often
# (decayed counts): two experts of about the same heat never trade places back and forth.
SWAP_MARGIN = 2.0


def _by_layer(fills: Sequence[Fill]) -> list[tuple[int, list[Fill]]]:
    """Fills grouped by layer, layers ascending (each group's file pages go back together)."""
    groups: dict[int, list[Fill]] = {}
    for f in fills:
        groups.setdefault(f.key[0], []).append(f)
    return sorted(groups.items())
