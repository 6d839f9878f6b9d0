"""The VRAM control plane: samples the monitor, asks the pure policy for a size, hands resizes to
the engine thread, and answers reserve and borrow requests once they are carried out.

Runs on the asyncio loop and never waits on compute: a resize is a request to the engine thread,
applied at once when idle and at the next safe point otherwise.

How a request is carried out (``VramController.requests``, the status's ``vram_requests``):

* ``room``: a monitor sees the device; the request returns once the room is free on it;
* ``shrink``: no monitor sees the device (``vram_monitor = none`` on a GPU, or a monitor that
  failed); the request returns once the cache has shrunk by its amount, which is all Strata can
  know, and the answer says so;
* ``refused``: Strata watches no GPU and holds no VRAM (the CPU): a request for more than 0 MiB
  is refused with :class:`NoDevice`. Never a success that changed nothing.

The run-time reserve is a standing request ("keep N MiB free"), so it has two outcomes besides a
refusal (:meth:`VramController.reserve_state`, the status's ``reserve_state``):

* ``met``: the room is free (``room``), or the cache shrank by the amount (``shrink``);
* ``pending``: the reserve is set and in force, but the room is not free yet: other programs hold
  more than Strata can give back (known at once: even at its core the cache leaves too little),
  the cache is still shrinking after ``borrow_timeout_ms``, or the model is still loading. The
  answer says so at once, with the numbers, and the reserve is met once the room exists.

A reserve that is refused (``NoDevice``, ``NotEnoughVram``) is never left in force: the one before
it is restored. A lease, by contrast, is granted or not at all (``Timeout``, no lease left).

A model split over several devices (``devices``) has one controller per device: its own monitor,
policy state, lease book and reserve, steering that device's stage (its cache and K/V). The books
share one cookie sequence (a cookie names one lease of the daemon) and the controllers one list of
listeners, whose events carry ``device``, the stage's number.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from strata.daemon.leases import (
    InvalidArgument,
    Lease,
    LeaseBook,
    LeaseError,
    LeaseNotFound,
    NoDevice,
    NotEnoughVram,
    Timeout,
    is_int,
    max_freeable_mib,
)
from strata.daemon.policy import (
    CacheView,
    Decision,
    DeviceView,
    LeaseUsage,
    PolicyConfig,
    PolicyState,
    base_room,
    decide,
    decide_unwatched,
    unwatched_demand,
)
from strata.daemon.worker import EngineWorker
from strata.vmm.monitor import VramMonitor, VramSample

if TYPE_CHECKING:
    from strata.engine.experts.cache import ExpertCache
    from strata.engine.step import StageRunner

log = logging.getLogger(__name__)

MiB = 2**20

# Events for the edges (D-Bus signals, metrics): (name, fields)
Listener = Callable[[str, dict[str, Any]], None]


@dataclass(frozen=True)
class ControlConfig:
    period_ms: int = 1000
    borrow_timeout_ms: int = 10_000


@dataclass(frozen=True)
class Outcome:
    """How a VRAM request was carried out: ``how`` is ``room`` (free on the device, seen),
    ``shrink`` (no monitor: the cache shrank by the amount), ``pending`` (a reserve that is set
    and in force but not met yet) or ``none`` (nothing was asked: a reserve of 0 MiB);
    ``message`` says it in words, with the numbers."""

    how: str
    message: str
    cache_mib: int
    free_mib: int | None


def _mib(nbytes: int) -> int:
    return nbytes // MiB


def _core_mib(cache: Any) -> int:
    """The least the cache can hold, as its arena maps it (whole chunks), in whole MiB."""
    return -(-cache.core_mapped_bytes // MiB)


class VramController:
    def __init__(
        self,
        worker: EngineWorker,
        monitor: VramMonitor,
        policy: PolicyConfig,
        control: ControlConfig,
        fixed_bytes: Callable[[], int] = lambda: 0,
        clock: Callable[[], float] = time.monotonic,
        on_gpu: bool = False,
        stage: int = 0,
        book: LeaseBook | None = None,
        listeners: list[Listener] | None = None,
    ) -> None:
        self.worker = worker
        self.monitor = monitor
        self.policy = policy
        self.control = control
        self.fixed_bytes = fixed_bytes
        self.clock = clock
        self.on_gpu = on_gpu  # the engine computes on a CUDA device
        self.stage = stage  # the stage (and device) this controller steers: 0 with one device
        # how messages name the device where there are several ("device 1, cuda:1"); None: one
        self.where: str | None = None
        self.book = book if book is not None else LeaseBook()
        self.state = PolicyState.initial(policy)
        self.last_sample: VramSample | None = None
        self.last_decision: Decision | None = None
        self.resizes = 0
        self.listeners: list[Listener] = listeners if listeners is not None else []
        self._pid_used_at_borrow: dict[int, int | None] = {}
        self._policy_size_mib: int | None = None  # the size the policy last reached, in its MiB
        self._active = 0  # requests in progress (generations admitted and not finished)
        self._idle_since: float | None = clock()  # clock seconds; None while a request runs
        self._changed = asyncio.Event()
        self._check_lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- what Strata holds ----------------------------------------------------------------------

    def _cache(self) -> ExpertCache | None:
        """This stage's expert cache (None before the model is loaded, or without one)."""
        return self.worker.stage_cache(self.stage)

    def _stage(self) -> StageRunner | None:
        """This stage's runner, which holds its K/V and budget (None before the model is
        loaded); device 0's is the first stage, as any other."""
        engine = self.worker.engine
        return engine.stages[self.stage] if engine is not None else None

    def ours_bytes(self) -> int:
        """The arenas' mapped bytes (the cache's, the K/V's) plus the engine's own device
        memory: what we really hold."""
        cache = self._cache()
        mapped = cache.arena.mapped_bytes if cache is not None and not _closed(cache) else 0
        return mapped + self._kv_bytes()[0] + self.fixed_bytes()

    def _kv_bytes(self) -> tuple[int, int, int]:
        """The K/V's (mapped, floor, reservation) bytes where it shares the cache's budget
        (docs/policy.md), else zeros: the policy's size is the cache's and the K/V's."""
        runner = self._stage()
        if runner is None or runner.budget is None or runner.kv.arena.closed:
            return 0, 0, 0
        kv = runner.kv
        return kv.mapped_bytes, kv.floor_bytes(), kv.arena.reserved_bytes

    # -- events ---------------------------------------------------------------------------------

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        if self.stage == 0:
            self.worker.on_resized = self._resized_in_engine
        else:
            self.worker.on_stage_resized[self.stage] = self._resized_in_engine

    def _emit(self, name: str, **fields: Any) -> None:
        fields["device"] = self.stage
        for listener in list(self.listeners):
            try:
                listener(name, fields)
            except Exception:
                log.exception("listener failed on %s", name)

    def _resized_in_engine(self, result: Any, reason: str) -> None:  # engine thread
        if self._loop is not None and result.from_slots != result.to_slots:
            self._loop.call_soon_threadsafe(self._after_resize)

    def _after_resize(self) -> None:
        self.resizes += 1
        sample = self.monitor.sample()
        self.last_sample = sample or self.last_sample
        self._changed.set()
        self._emit(
            "cache_resized",
            cache_mib=self._mapped_mib(),  # as the status's cache_mib and CacheMiB say it
            free_mib=_mib(sample.free_bytes) if sample else 0,
        )

    @property
    def cache_mib(self) -> int:
        cache = self._cache()
        return _mib(cache.size_bytes) if cache is not None else 0

    @property
    def watched(self) -> bool:
        """A monitor sees the device (not ``none``, not failed)."""
        return self.monitor.kind != "none" and self.monitor.healthy

    @property
    def requests(self) -> str:
        """How VRAM requests are carried out now: ``room``, ``shrink`` or ``refused`` (module
        docstring)."""
        if self.watched:
            return "room"
        if self.monitor.kind == "none" and not self.on_gpu:
            return "refused"
        cache = self._cache()
        loaded = self.worker.engine is not None
        if loaded and (cache is None or _closed(cache)):
            return "refused"
        return "shrink"

    def unwatched_why(self) -> str:
        if self.monitor.kind == "none":
            return "vram_monitor is none"
        return f"the VRAM monitor failed: {self.monitor.problem}"

    # -- requests in progress (idle release) ----------------------------------------------------

    def request_began(self) -> None:
        self._active += 1
        self._idle_since = None

    def request_ended(self) -> None:
        self._active = max(0, self._active - 1)
        if self._active == 0:
            self._idle_since = self.clock()

    # -- the periodic check ---------------------------------------------------------------------

    async def run(self) -> None:
        period = self.control.period_ms / 1000
        if self._active == 0:  # idle from when the model is ready, not from the start of loading
            self._idle_since = self.clock()
        while True:
            try:
                await self.check("period")
            except Exception:
                log.exception("VRAM check failed")
            await asyncio.sleep(period)

    async def check(self, why: str = "request") -> Decision | None:
        """Sample, decide, and ask the engine for the new size; None when there is nothing to
        steer (no device monitor, a failed one, or no cache)."""
        async with self._check_lock:
            return self._check(why)

    def _check(self, why: str) -> Decision | None:
        cache = self._cache()
        epoch = self.worker.resize_epoch
        sample = self.monitor.sample()
        settled = epoch % 2 == 0 and self.worker.resize_epoch == epoch
        if sample is not None:
            self.last_sample = sample
        if cache is None or _closed(cache):
            return None
        budget = self._engine_budget()
        view = self._cache_view(cache, budget)
        now_ms = self.clock() * 1000
        idle = None if self._idle_since is None else self._idle_since * 1000
        if sample is None:
            if self.state.unwatched_base_mib is None and self.last_decision is None:
                # Unwatched from the start: every request so far is still to be carried out.
                self.state = replace(self.state, unwatched_base_mib=view.size_mib)
            decision = decide_unwatched(
                now_ms, view, self.book.view(), self.policy, self.state, idle_since_ms=idle
            )
        else:
            device = DeviceView(
                total_mib=_mib(sample.total_bytes),
                free_mib=_mib(sample.free_bytes),
                ours_mib=-(-sample.ours_bytes // MiB),
                used_mib=-(-sample.used_bytes // MiB),
                settled=settled,
            )
            usage = [self._lease_usage(lease) for lease in self.book.leases()]
            decision = decide(
                now_ms, device, view, self.book.view(), usage, self.policy, self.state,
                idle_since_ms=idle,
            )  # fmt: skip
        self.state = decision.state
        self.last_decision = decision
        self._policy_size_mib = decision.target_mib
        self._ask(decision, cache, budget, why)
        return decision

    def _cache_view(self, cache: ExpertCache, budget: int | None) -> CacheView:
        """The cache as the policy sees it. One budget: where the K/V shares it, the policy's
        size is the cache's and the K/V's together, and its core the cache's core plus what the
        K/V cannot give back now."""
        kv_mapped, kv_floor, kv_max = self._kv_bytes()
        size_mib = self._policy_size_mib
        if budget is not None:
            if size_mib is None or size_mib * MiB != budget:
                size_mib = -(-(cache.arena.mapped_bytes + kv_mapped) // MiB)
        elif size_mib is None or cache.slots_for_bytes(size_mib * MiB) != cache.n_slots:
            size_mib = -(-cache.arena.mapped_bytes // MiB)
        core_mib = _core_mib(cache) + -(-kv_floor // MiB)
        return CacheView(
            size_mib=max(size_mib, core_mib),
            core_mib=core_mib,
            max_mib=-(-(cache.mapped_bytes_for(cache.max_slots) + kv_max) // MiB),
            fixed_mib=_mib(self.fixed_bytes()),
        )

    def _ask(self, decision: Decision, cache: ExpertCache, budget: int | None, why: str) -> None:
        """Ask the worker for the decision's size: a budget where the K/V shares one, else a
        number of slots; nothing when the size is already that."""
        if budget is not None:
            if decision.target_mib * MiB != budget:
                log.debug("budget %d MiB (%s, %s): %s", decision.target_mib, decision.reason,
                          why, decision.explain)  # fmt: skip
                self.worker.request_budget(
                    decision.target_mib * MiB, f"{decision.reason} ({why})", stage=self.stage
                )
            return
        slots = cache.slots_for_bytes(decision.target_mib * MiB)
        if slots != cache.n_slots:
            log.debug("resize to %d slots (%s, %s): %s", slots, decision.reason, why,
                      decision.explain)  # fmt: skip
            self.worker.request_resize(slots, None, f"{decision.reason} ({why})", stage=self.stage)

    def _engine_budget(self) -> int | None:
        """The engine's budget for the cache and the K/V (None: the cache alone is steered)."""
        runner = self._stage()
        return runner.budget if runner is not None and self._kv_bytes()[2] else None

    def _lease_usage(self, lease: Lease) -> LeaseUsage:
        if lease.pid is None:
            return LeaseUsage(lease.cookie, None)
        now = self.monitor.process_used(lease.pid)
        before = self._pid_used_at_borrow.get(lease.cookie)
        if now is None or before is None:
            return LeaseUsage(lease.cookie, None)
        return LeaseUsage(lease.cookie, max(0, _mib(now - before)))

    # -- requests -------------------------------------------------------------------------------

    def max_freeable_mib(self) -> int | None:
        """What a lease could ever get: usable VRAM − the core − the engine's own memory."""
        sample = self.last_sample or self.monitor.sample()
        if sample is None:
            return None
        cache = self._cache()
        core = _core_mib(cache) if cache is not None else 0
        core += -(-self._kv_bytes()[1] // MiB)  # the K/V's pages in use stay
        usable = _mib(sample.used_bytes + sample.free_bytes)
        return max_freeable_mib(usable, core, _mib(self.fixed_bytes()))

    def _admit(self, mib: int, demand_after: int, room_after: int, what: str) -> None:
        """Refuse, before anything is recorded, a request that could not be carried out: no GPU
        (:class:`NoDevice`), or more than Strata could free (:class:`NotEnoughVram`).
        ``demand_after``: what the book asks of a cache nothing watches once the request is in;
        ``room_after``: the room a watched device must then have free (the base room, every
        lease), which must fit what Strata could ever free."""
        if mib == 0:
            return
        mode = self.requests
        if mode == "refused":
            raise NoDevice(f"cannot free {mib} MiB for {what}: {self._no_device_text()}")
        if mode == "room":
            limit = self.max_freeable_mib()
            if limit is not None and room_after > limit:
                others = room_after - mib
                if not others:
                    raise NotEnoughVram(mib, limit)
                raise NotEnoughVram(
                    mib, max(0, limit - others),
                    "device total - the expert cache's core - the engine's own memory: "
                    f"{limit} MiB, of which {min(limit, others)} MiB is already the room kept "
                    "free for the automatic or run-time reserve, the holds and the leases",
                )  # fmt: skip
            return
        cache = self._cache()
        if cache is None or _closed(cache):
            return  # still loading: the request waits for the cache (or times out)
        base, at_base = self._unwatched_base(cache)
        # what the cache's core and the K/V's pages in use keep can never be given
        allowed = base + at_base - _core_mib(cache) - -(-self._kv_bytes()[1] // MiB)
        if demand_after > allowed:
            others = demand_after - mib
            raise NotEnoughVram(
                mib, max(0, allowed - others),
                f"{self.unwatched_why()}, so Strata can only shrink its cache: its elastic part "
                f"is {allowed} MiB, {min(allowed, others)} MiB of it already given to the "
                "reserve, holds and leases",
            )  # fmt: skip

    def _unwatched_base(self, cache: Any) -> tuple[int, int]:
        """The cache's size without requests, and what the book asked when it was that size."""
        if self.state.unwatched_base_mib is not None:
            return self.state.unwatched_base_mib, self.state.unwatched_demand_mib
        size = -(-cache.arena.mapped_bytes // MiB)
        if self.last_decision is None:  # unwatched from the start: nothing given yet
            return size, 0
        return size, unwatched_demand(self.book.view())

    def _no_device_text(self) -> str:
        if self.monitor.kind == "none" and not self.on_gpu:
            return (
                "Strata watches no GPU (vram_monitor none, computing on the CPU) and holds no "
                "VRAM, so there is nothing it could free"
            )
        if not self.monitor.healthy:
            return (
                f"the VRAM monitor failed ({self.monitor.problem}) and Strata holds no expert "
                "cache it could shrink"
            )
        return "Strata holds no expert cache it could shrink"

    async def set_reserve(self, mib: int) -> Outcome:
        """The run-time reserve; returns once it is met, at once when it is known that it
        cannot be met now, or after ``borrow_timeout_ms``: then ``how`` is ``pending`` and the
        reserve stays in force (module docstring). A refused reserve leaves the one before."""
        LeaseBook.check_request(mib, mib, allow_zero=True)
        view = self.book.view()
        holds = max([0, *view.holds.values()])
        room = base_room(self.policy, mib, view.holds)[0] + view.borrowed_mib
        self._admit(mib, max(mib, holds) + view.borrowed_mib, room, f"a reserve of {mib} MiB")
        before = self._mapped_mib()
        previous = self.book.reserve_mib
        self.book.set_reserve(mib)
        log.info("run-time reserve set to %d MiB", mib)
        self._emit("status_changed")
        if mib == 0:  # nothing asked: nothing to wait for (the cache grows back as room lasts)
            await self.check("request")
            return self._outcome("none", "a reserve of 0 MiB", before)
        what = f"a reserve of {mib} MiB"
        try:
            how = await self._carry_out(f"reserve of {mib} MiB", reserve=True)
        except Timeout:
            how = "pending"
        except BaseException:
            # refused after all (no cache to give back, no device): not left in force
            self.book.set_reserve(previous)
            log.info("run-time reserve back to %d MiB: %d MiB refused", previous, mib)
            self._emit("status_changed")
            self._kick()
            raise
        if how == "pending" and self.reserve_state()[0] == "met":  # met since, after all
            how = "room" if self.watched else "shrink"
        outcome = self._outcome(how, what, before)
        if how == "pending":
            log.info("%s", outcome.message)
        return outcome

    def reserve_state(self) -> tuple[str, str | None]:
        """Whether the run-time reserve is met now: ``("none", None)`` without one, else
        ``("met" | "pending", words with the numbers)`` (the status's ``reserve_state`` and
        ``reserve_message``)."""
        mib = self.book.reserve_mib
        if mib == 0:
            return "none", None
        cache = self._cache()
        decision = self.last_decision
        sample = self.last_sample if self.watched else None
        if sample is not None:
            needed = self._explicit_room()
            free = _mib(sample.free_bytes)
            device = self._device_words()
            if free >= needed:
                return "met", f"{free} MiB free on {device}, {needed} MiB asked"
            best = self._best_free_mib()
            if best is not None and best < needed:
                tenants = _mib(sample.tenants_bytes)
                return "pending", (
                    f"only {free} MiB free on {device}, {needed} MiB needed: other programs hold "
                    f"{tenants} MiB and Strata's cache cannot go below its core, so it is met "
                    f"once they free {needed - best} MiB"
                )
            if self.worker.engine is None:
                return "pending", (
                    f"only {free} MiB free on {device}, {needed} MiB needed; the model is still "
                    "loading"
                )
            return "pending", (
                f"only {free} MiB free on {device}, {needed} MiB needed; Strata's cache is "
                f"shrinking ({self._mapped_mib()} MiB now)"
            )
        if self.worker.engine is None or cache is None or _closed(cache):
            return "pending", "the model is still loading; the cache shrinks once it exists"
        if decision is None:
            return "pending", "not checked yet"
        slots = cache.slots_for_bytes(decision.target_mib * MiB - self._kv_bytes()[0])
        if cache.arena.mapped_bytes <= cache.mapped_bytes_for(slots):
            return "met", (
                f"no monitor sees the device ({self.unwatched_why()}): the cache shrank by what "
                "is asked; whether that memory is free on the GPU is not checked"
            )
        return "pending", (
            f"no monitor sees the device ({self.unwatched_why()}): the cache is shrinking "
            f"({self._mapped_mib()} MiB now, {decision.target_mib} MiB to reach)"
        )

    def _explicit_room(self) -> int:
        """What the reserve, the holds and the leases ask to be free (the automatic reserve
        aside: a reserve below it asks nothing more and is met once its own room is free)."""
        view = self.book.view()
        decision = self.last_decision
        owed = sum(decision.budget.owed_mib.values()) if decision is not None else None
        return max([view.reserve_mib, *view.holds.values()]) + (
            owed if owed is not None else view.borrowed_mib
        )

    def _best_free_mib(self) -> int | None:
        """What would be free on the device with the cache and the K/V at their least, as the
        last decision saw the other programs (None: no decision yet)."""
        decision = self.last_decision
        cache = self._cache()
        if decision is None or cache is None or _closed(cache):
            return None
        core = _core_mib(cache) + -(-self._kv_bytes()[1] // MiB)
        b = decision.budget
        return b.available_mib + b.room_mib - core  # usable - tenants - fixed - core

    def _device_words(self) -> str:
        device = self.monitor.device_name
        return f"{device} ({self.where})" if self.where is not None else device

    async def set_hold(self, source: str, mib: int | None) -> None:
        """A hold from another source (GameMode); None clears it."""
        if mib is None:
            self.book.clear_hold(source)
        else:
            self.book.set_hold(source, mib)
        self._emit("status_changed")
        await self.check(source)

    async def borrow(
        self, mib: int, owner: str, pid: int | None, app_id: str, reason: str
    ) -> Lease:
        """A lease of ``mib`` MiB; returns once it is carried out (Timeout after
        ``borrow_timeout_ms``, leaving no lease behind)."""
        LeaseBook.check_request(mib, mib)
        demand = unwatched_demand(self.book.view()) + mib
        self._admit(mib, demand, self._room_needed() + mib, f"a lease of {mib} MiB")
        before = self._mapped_mib()
        sample = self.last_sample
        lease = self.book.add(
            owner,
            pid,
            app_id,
            reason,
            mib,
            int(time.time() * 1e6),
            _mib(sample.tenants_bytes) if sample else None,
        )
        self._pid_used_at_borrow[lease.cookie] = (
            self.monitor.process_used(pid) if pid is not None else None
        )
        log.info("lease %d: %d MiB for %s (%s), pid %s", lease.cookie, mib, app_id, reason, pid)
        try:
            how = await self._carry_out(f"lease {lease.cookie} of {mib} MiB")
        except BaseException:
            self._drop(lease.cookie, None, "failed")
            raise
        outcome = self._outcome(how, f"lease {lease.cookie} of {mib} MiB", before)
        log.info("%s", outcome.message)
        self._emit("status_changed")
        return lease

    def return_lease(self, cookie: int, owner: str | None, why: str = "returned") -> Lease:
        lease = self._drop(cookie, owner, why)
        return lease

    def owner_vanished(self, owner: str) -> list[Lease]:
        gone = self.book.owner_vanished(owner)
        for lease in gone:
            self._pid_used_at_borrow.pop(lease.cookie, None)
            log.info("lease %d returned: its owner %s left the bus", lease.cookie, owner)
            self._emit("lease_returned", cookie=lease.cookie, why="vanished")
        if gone:
            self._emit("status_changed")
            self._kick()
        return gone

    def _drop(self, cookie: int, owner: str | None, why: str) -> Lease:
        lease = self.book.remove(cookie, owner)
        self._pid_used_at_borrow.pop(cookie, None)
        log.info("lease %d %s (%d MiB)", cookie, why, lease.mib)
        self._emit("lease_returned", cookie=cookie, why=why)
        self._emit("status_changed")
        self._kick()
        return lease

    def _kick(self) -> None:
        if self._loop is not None:
            self._loop.create_task(self.check("lease returned"))

    def _room_needed(self) -> int:
        """The room the book asks for, every lease counted as not yet allocated (for a device
        watched while no cache exists, and for admitting a lease)."""
        view = self.book.view()
        return base_room(self.policy, view.reserve_mib, view.holds)[0] + view.borrowed_mib

    async def _carry_out(self, what: str, reserve: bool = False) -> str:
        """Wait until the book's demand is carried out: the room free on a watched device
        (``room``), or the cache at its target where nothing watches (``shrink``). Timeout
        after ``borrow_timeout_ms``; NoDevice / NotEnoughVram where it never can be. With
        ``reserve``: the room the reserve, holds and leases ask (:meth:`_explicit_room`) is
        enough, and ``pending`` at once where even the cache's core leaves too little."""
        timeout = self.control.borrow_timeout_ms / 1000
        deadline = self.clock() + timeout
        while True:
            decision = await self.check("request")
            cache = self._cache()
            sample = self.last_sample if self.watched else None
            if decision is not None and sample is not None:
                free, needed = _mib(sample.free_bytes), decision.room_kept_mib
                if reserve:
                    needed = self._explicit_room()
                if free >= needed:
                    return "room"
                best = self._best_free_mib()
                if reserve and best is not None and best < needed:
                    return "pending"  # known now: the other programs hold too much
            elif decision is not None:  # unwatched: the cache at its target is all there is
                assert cache is not None
                slots = cache.slots_for_bytes(decision.target_mib * MiB - self._kv_bytes()[0])
                # unmapped, not only planned: the slots go first, the memory chunk by chunk
                if cache.arena.mapped_bytes <= cache.mapped_bytes_for(slots):
                    return "shrink"
                free, needed = None, decision.room_kept_mib
            elif sample is not None:  # watched, no cache (yet): the room may exist anyway
                free, needed = _mib(sample.free_bytes), self._room_needed()
                if free >= needed:
                    return "room"
                if self.worker.engine is not None:  # loaded, and no cache to give back
                    raise NotEnoughVram(
                        needed, free, "Strata holds no expert cache to shrink: what is free now"
                    )
            else:
                if self.worker.engine is not None:
                    raise NoDevice(f"cannot carry out the {what}: {self._no_device_text()}")
                free, needed = None, None  # loading, no monitor: wait for the cache
            left = deadline - self.clock()
            if left <= 0:
                raise self._timed_out(what, decision, free, needed)
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(left, 0.05))
            except TimeoutError:
                pass

    def _timed_out(
        self, what: str, decision: Decision | None, free: int | None, needed: int | None
    ) -> Timeout:
        """Why a request was not carried out within ``borrow_timeout_ms``."""
        waited = self.control.borrow_timeout_ms
        if self.worker.engine is None:
            return Timeout(
                f"{what}: the model is still loading after {waited} ms; it is recorded "
                "and is carried out once the cache exists"
            )
        if free is None:
            target = decision.target_mib if decision is not None else None
            return Timeout(
                f"{what}: the cache has not reached {target} MiB after {waited} ms "
                f"({self.cache_mib} MiB now)"
            )
        explain = decision.explain if decision is not None else "no expert cache"
        return Timeout(
            f"{what}: only {free} MiB free after {waited} ms, {needed} MiB needed ({explain})"
        )

    def _mapped_mib(self) -> int:
        """The cache's memory now, as the status's ``cache_mib`` (whole arena chunks)."""
        cache = self._cache()
        return cache.arena.mapped_bytes // MiB if cache is not None and not _closed(cache) else 0

    def _outcome(self, how: str, what: str, before_mib: int) -> Outcome:
        after = self._mapped_mib()
        sample = self.last_sample if self.watched else None
        free = _mib(sample.free_bytes) if sample is not None else None
        cache = f"the cache {before_mib} -> {after} MiB" if after != before_mib else (
            f"the cache stays at {after} MiB"
        )  # fmt: skip
        if how == "none":
            text = f"the run-time reserve is cleared ({cache}; it grows back as room lasts)"
        elif how == "pending":
            text = (
                f"{what} is set but not met yet: {self.reserve_state()[1]}; it stays in force "
                f"until changed ({cache})"
            )
        elif how == "room":
            device = self.monitor.device_name
            if self.where is not None:
                device += f" ({self.where})"
            text = f"{what}: {free} MiB are free on {device} ({cache})"
        else:
            text = (
                f"{what}: no monitor sees the device ({self.unwatched_why()}), so Strata shrank "
                f"its cache by what is asked ({cache}); whether that memory is free on the GPU "
                "is not checked"
            )
        return Outcome(how, text, after, free)


class ControlGroup:
    """The controllers of every device, as the generations see them: a request's start and end
    (idle release) and the check at its start reach each device; the check's answer is device
    0's, as with one device."""

    def __init__(self, controllers: list[VramController]) -> None:
        self.controllers = controllers

    def request_began(self) -> None:
        for c in self.controllers:
            c.request_began()

    def request_ended(self) -> None:
        for c in self.controllers:
            c.request_ended()

    async def check(self, why: str = "request") -> Decision | None:
        decisions = [await c.check(why) for c in self.controllers]
        return decisions[0]


class BadVramRequest(InvalidArgument):
    """A ``POST /v1/vram`` body that is not ``{"reserve_mib": N[, "device": D]}``; ``param``
    names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def parse_vram_request(raw: bytes) -> tuple[int, int | None]:
    """``(reserve_mib, device)`` from a ``POST /v1/vram`` body, or :class:`BadVramRequest`
    saying what is wrong in words (never a parser's own text)."""
    example = '{"reserve_mib": 4000}'
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise BadVramRequest(f"the body is not JSON: expected {example}", "reserve_mib") from None
    except RecursionError:
        raise BadVramRequest(
            f"the body is not JSON this daemon reads: nested too deeply; expected {example}",
            "reserve_mib",
        ) from None
    if not isinstance(body, dict):
        raise BadVramRequest(
            f"expected a JSON object such as {example}, got {type(body).__name__}", "reserve_mib"
        )
    for key in body:
        if key not in ("reserve_mib", "device"):
            raise BadVramRequest(
                f"unknown field {key!r}: the body takes reserve_mib and device", str(key)
            )
    if "reserve_mib" not in body:
        raise BadVramRequest(
            "reserve_mib is missing: the MiB to keep free (0 clears the reserve)", "reserve_mib"
        )
    mib = body["reserve_mib"]
    if not is_int(mib) or mib < 0:  # too large: the book's limit names it
        raise BadVramRequest(
            "reserve_mib: expected a whole number of MiB, 0 or more (0 clears the reserve), "
            f"got {json.dumps(mib)}",
            "reserve_mib",
        )
    device = body.get("device")
    if device is not None and not is_int(device):  # a number the daemon lacks: named there
        raise BadVramRequest(
            f"device: expected a device number (0, 1, …), got {json.dumps(device)}", "device"
        )
    return mib, device


def _closed(cache: ExpertCache) -> bool:
    return cache.arena.closed


__all__ = [
    "BadVramRequest",
    "ControlConfig",
    "ControlGroup",
    "LeaseError",
    "LeaseNotFound",
    "Outcome",
    "VramController",
    "parse_vram_request",
]
