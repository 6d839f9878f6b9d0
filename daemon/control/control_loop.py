"""The VRAM control plane's loop (``ControlLoop``): what Strata holds on its device, the
monitor's samples, the pure policy's decision at each check, and the resizes (or budgets) it asks
the engine thread for; events for the edges. ``control.VramController`` adds the requests (the
run-time reserve, leases) on top of it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from strata.daemon.control.leases import (
    Lease,
    LeaseBook,
)
from strata.daemon.control.policy import (
    CacheView,
    Decision,
    DeviceView,
    LeaseUsage,
    PolicyConfig,
    PolicyState,
    decide,
    decide_unwatched,
)
from strata.daemon.engine_port import CachePort, KvBytes
from strata.daemon.json_types import JSONObject
from strata.daemon.worker import EngineWorker
from strata.vmm.monitor import VramMonitor, VramSample

if TYPE_CHECKING:
    from strata.engine.experts.cache import ResizeResult

log = logging.getLogger("strata.daemon.control")  # the name its log lines always had

MiB = 2**20

# Events for the edges (D-Bus signals, metrics): (name, fields)
Listener = Callable[[str, JSONObject], None]


@dataclass(frozen=True)
class ControlConfig:
    period_ms: int = 1000
    borrow_timeout_ms: int = 10_000


def _mib(nbytes: int) -> int:
    return nbytes // MiB


def _core_mib(cache: CachePort) -> int:
    """The least the cache can hold, as its arena maps it (whole chunks), in whole MiB."""
    return -(-cache.core_mapped_bytes // MiB)


class ControlLoop:
    """One device's control loop (see ``control``'s module doc)."""

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

    def _cache(self) -> CachePort | None:
        """This stage's expert cache (None before the model is loaded, or without one)."""
        return self.worker.stage_cache(self.stage)

    def ours_bytes(self) -> int:
        """The arenas' mapped bytes (the cache's, the K/V's) plus the engine's own device
        memory: what we really hold."""
        cache = self._cache()
        mapped = cache.mapped_bytes if cache is not None and not _closed(cache) else 0
        return mapped + self._kv_bytes().mapped + self.fixed_bytes()

    def _kv_bytes(self) -> KvBytes:
        """The K/V's bytes where it shares the cache's budget (docs/policy.md), else zeros: the
        policy's size is the cache's and the K/V's."""
        port = self.worker.port
        return port.kv_bytes(self.stage) if port is not None else KvBytes()

    # -- events ---------------------------------------------------------------------------------

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.worker.on_resized[self.stage] = self._resized_in_engine

    def _emit(self, name: str, **fields: Any) -> None:
        fields["device"] = self.stage
        for listener in list(self.listeners):
            try:
                listener(name, fields)
            except Exception:
                log.exception("listener failed on %s", name)

    def _resized_in_engine(self, result: ResizeResult, reason: str) -> None:  # engine thread
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
    def slots_mib(self) -> int:
        """The cache's slots in MiB (slots × slot bytes; the arena maps whole chunks around
        them: :meth:`_mapped_mib`)."""
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
        loaded = self.worker.loaded
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
        budget_bytes = self._engine_budget()
        view = self._cache_view(cache, budget_bytes)
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
        self._ask(decision, cache, budget_bytes, why)
        return decision

    def _cache_view(self, cache: CachePort, budget_bytes: int | None) -> CacheView:
        """The cache as the policy sees it. One budget: where the K/V shares it, the policy's
        size is the cache's and the K/V's together, and its core the cache's core plus what the
        K/V cannot give back now."""
        kv = self._kv_bytes()
        kv_mapped, kv_floor, kv_max = kv.mapped, kv.floor, kv.reserved
        size_mib = self._policy_size_mib
        if budget_bytes is not None:
            if size_mib is None or size_mib * MiB != budget_bytes:
                size_mib = -(-(cache.mapped_bytes + kv_mapped) // MiB)
        elif size_mib is None or cache.slots_for_bytes(size_mib * MiB) != cache.n_slots:
            size_mib = -(-cache.mapped_bytes // MiB)
        core_mib = _core_mib(cache) + -(-kv_floor // MiB)
        return CacheView(
            size_mib=max(size_mib, core_mib),
            core_mib=core_mib,
            max_mib=-(-(cache.mapped_bytes_for(cache.max_slots) + kv_max) // MiB),
            fixed_mib=_mib(self.fixed_bytes()),
        )

    def _ask(
        self, decision: Decision, cache: CachePort, budget_bytes: int | None, why: str
    ) -> None:
        """Ask the worker for the decision's size: a budget where the K/V shares one, else a
        number of slots; nothing when the size is already that."""
        if budget_bytes is not None:
            if decision.target_mib * MiB != budget_bytes:
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
        port = self.worker.port
        return port.budget(self.stage) if port is not None and self._kv_bytes().reserved else None

    def _lease_usage(self, lease: Lease) -> LeaseUsage:
        if lease.pid is None:
            return LeaseUsage(lease.cookie, None)
        now = self.monitor.process_used(lease.pid)
        before = self._pid_used_at_borrow.get(lease.cookie)
        if now is None or before is None:
            return LeaseUsage(lease.cookie, None)
        return LeaseUsage(lease.cookie, max(0, _mib(now - before)))

    # -- requests -------------------------------------------------------------------------------

    def _mapped_mib(self) -> int:
        """The cache's memory now, as the status's ``cache_mib`` (whole arena chunks)."""
        cache = self._cache()
        return cache.mapped_bytes // MiB if cache is not None and not _closed(cache) else 0


def _closed(cache: CachePort) -> bool:
    return cache.closed
