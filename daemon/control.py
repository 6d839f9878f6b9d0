"""The VRAM control plane: samples the monitor, asks the pure policy for a size, hands resizes to
the engine thread, and answers reserve and borrow requests once their room exists.

Runs on the asyncio loop and never waits on compute: a resize is a request to the engine thread,
applied at once when idle and at the next safe point otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from strata.daemon.leases import (
    Lease,
    LeaseBook,
    LeaseError,
    LeaseNotFound,
    Timeout,
    max_freeable_mib,
)
from strata.daemon.policy import (
    CacheView,
    Decision,
    DeviceView,
    LeaseUsage,
    PolicyConfig,
    PolicyState,
    decide,
)
from strata.daemon.worker import EngineWorker
from strata.vmm.monitor import VramMonitor, VramSample

log = logging.getLogger(__name__)

MiB = 2**20

# Events for the edges (D-Bus signals, metrics): (name, fields)
Listener = Callable[[str, dict[str, Any]], None]


@dataclass(frozen=True)
class ControlConfig:
    period_ms: int = 1000
    borrow_timeout_ms: int = 10_000


def _mib(nbytes: int) -> int:
    return nbytes // MiB


class VramController:
    def __init__(
        self,
        worker: EngineWorker,
        monitor: VramMonitor,
        policy: PolicyConfig,
        control: ControlConfig,
        fixed_bytes: Callable[[], int] = lambda: 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.worker = worker
        self.monitor = monitor
        self.policy = policy
        self.control = control
        self.fixed_bytes = fixed_bytes
        self.clock = clock
        self.book = LeaseBook()
        self.state = PolicyState.initial(policy)
        self.last_sample: VramSample | None = None
        self.last_decision: Decision | None = None
        self.resizes = 0
        self.listeners: list[Listener] = []
        self._pid_used_at_borrow: dict[int, int | None] = {}
        self._policy_size_mib: int | None = None  # the size the policy last reached, in its MiB
        self._changed = asyncio.Event()
        self._check_lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- what Strata holds ----------------------------------------------------------------------

    def ours_bytes(self) -> int:
        """The arena's mapped bytes plus the engine's own device memory: what we really hold."""
        cache = self.worker.cache
        mapped = cache.arena.mapped_bytes if cache is not None and not _closed(cache) else 0
        return mapped + self.fixed_bytes()

    # -- events ---------------------------------------------------------------------------------

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.worker.on_resized = self._resized_in_engine

    def _emit(self, name: str, **fields: Any) -> None:
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
            cache_mib=self.cache_mib,
            free_mib=_mib(sample.free_bytes) if sample else 0,
        )

    @property
    def cache_mib(self) -> int:
        cache = self.worker.cache
        return _mib(cache.size_bytes) if cache is not None else 0

    # -- the periodic check ---------------------------------------------------------------------

    async def run(self) -> None:
        period = self.control.period_ms / 1000
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
        cache = self.worker.cache
        sample = self.monitor.sample()
        if sample is not None:
            self.last_sample = sample
        if sample is None or cache is None or _closed(cache):
            return None
        fixed = _mib(self.fixed_bytes())
        device = DeviceView(
            total_mib=_mib(sample.total_bytes),
            free_mib=_mib(sample.free_bytes),
            ours_mib=-(-sample.ours_bytes // MiB),
            used_mib=-(-sample.used_bytes // MiB),
        )
        size_mib = self._policy_size_mib
        if size_mib is None or cache.slots_for_bytes(size_mib * MiB) != cache.n_slots:
            size_mib = -(-cache.arena.mapped_bytes // MiB)
        view = CacheView(
            size_mib=max(size_mib, _mib(cache.core_bytes)),
            core_mib=_mib(cache.core_bytes),
            max_mib=-(-cache.mapped_bytes_for(cache.max_slots) // MiB),
            fixed_mib=fixed,
        )
        usage = [self._lease_usage(lease) for lease in self.book.leases()]
        decision = decide(
            self.clock() * 1000, device, view, self.book.view(), usage, self.policy, self.state
        )
        self.state = decision.state
        self.last_decision = decision
        slots = cache.slots_for_bytes(decision.target_mib * MiB)
        if slots == cache.n_slots:
            self._policy_size_mib = decision.target_mib
        else:
            log.debug("resize to %d slots (%s, %s): %s", slots, decision.reason, why,
                      decision.explain)  # fmt: skip
            self._policy_size_mib = decision.target_mib
            self.worker.request_resize(slots, None, f"{decision.reason} ({why})")
        return decision

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
        cache = self.worker.cache
        core = _mib(cache.core_bytes) if cache is not None else 0
        usable = _mib(sample.used_bytes + sample.free_bytes)
        return max_freeable_mib(usable, core, _mib(self.fixed_bytes()))

    async def set_reserve(self, mib: int) -> None:
        """The run-time reserve; returns once the room exists (Timeout otherwise; the reserve
        stays set either way)."""
        limit = self.max_freeable_mib()
        LeaseBook.check_request(mib, limit if limit is not None else mib, allow_zero=True)
        self.book.set_reserve(mib)
        log.info("run-time reserve set to %d MiB", mib)
        self._emit("status_changed")
        await self._wait_for_room(f"reserve of {mib} MiB")

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
        """A lease of ``mib`` MiB; returns once they are free on the device (Timeout after
        ``borrow_timeout_ms``, leaving no lease behind)."""
        limit = self.max_freeable_mib()
        LeaseBook.check_request(mib, limit if limit is not None else mib)
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
            await self._wait_for_room(f"lease {lease.cookie} of {mib} MiB")
        except BaseException:
            self._drop(lease.cookie, None, "failed")
            raise
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

    async def _wait_for_room(self, what: str) -> None:
        timeout = self.control.borrow_timeout_ms / 1000
        deadline = self.clock() + timeout
        while True:
            decision = await self.check("request")
            if decision is None:
                return  # nothing to steer: no monitor (a granted request) or no cache
            sample = self.last_sample
            assert sample is not None
            free = _mib(sample.free_bytes)
            if free >= decision.room_kept_mib:
                return
            left = deadline - self.clock()
            if left <= 0:
                raise Timeout(
                    f"{what}: only {free} MiB free after {self.control.borrow_timeout_ms} ms, "
                    f"{decision.room_kept_mib} MiB needed ({decision.explain})"
                )
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(left, 0.05))
            except TimeoutError:
                pass


def _closed(cache: Any) -> bool:
    return bool(getattr(cache.arena, "closed", False))


__all__ = ["ControlConfig", "LeaseError", "LeaseNotFound", "VramController"]
