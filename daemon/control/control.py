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
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from strata.daemon.control.control_loop import (
    ControlConfig,
    ControlLoop,
    MiB,
    _closed,
    _core_mib,
    _mib,
)
from strata.daemon.control.leases import (
    Lease,
    LeaseBook,
    LeaseError,
    LeaseNotFound,
    NoDevice,
    NotEnoughVram,
    Timeout,
    max_freeable_mib,
)
from strata.daemon.control.policy import (
    Decision,
    base_room,
    unwatched_demand,
)
from strata.daemon.control.vram_request import BadVramRequest, parse_vram_request

if TYPE_CHECKING:
    from strata.daemon.engine_port import CachePort

log = logging.getLogger("strata.daemon.control")  # the name its log lines always had


@dataclass(frozen=True)
class Outcome:
    """How a VRAM request was carried out: ``how`` is ``room`` (free on the device, seen),
    ``shrink`` (no monitor: the cache shrank by the amount), ``pending`` (a reserve that is set
    and in force but not met yet) or ``none`` (nothing was asked: a reserve of 0 MiB);
    ``message`` says it in words, with the numbers."""

    how: str
    message: str
    mapped_mib: int  # the cache's mapped MiB after the request, as the status's cache_mib
    free_mib: int | None


class VramController(ControlLoop):
    """One device's control loop and its requests: the run-time reserve, holds and leases,
    each answered once it is carried out (module doc)."""

    def max_freeable_mib(self) -> int | None:
        """What a lease could ever get: usable VRAM − the core − the engine's own memory."""
        sample = self.last_sample or self.monitor.sample()
        if sample is None:
            return None
        cache = self._cache()
        core = _core_mib(cache) if cache is not None else 0
        core += -(-self._kv_bytes().floor // MiB)  # the K/V's pages in use stay
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
        allowed = base + at_base - _core_mib(cache) - -(-self._kv_bytes().floor // MiB)
        if demand_after > allowed:
            others = demand_after - mib
            raise NotEnoughVram(
                mib, max(0, allowed - others),
                f"{self.unwatched_why()}, so Strata can only shrink its cache: its elastic part "
                f"is {allowed} MiB, {min(allowed, others)} MiB of it already given to the "
                "reserve, holds and leases",
            )  # fmt: skip

    def _unwatched_base(self, cache: CachePort) -> tuple[int, int]:
        """The cache's size without requests, and what the book asked when it was that size."""
        if self.state.unwatched_base_mib is not None:
            return self.state.unwatched_base_mib, self.state.unwatched_demand_mib
        size = -(-cache.mapped_bytes // MiB)
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
            if not self.worker.loaded:
                return "pending", (
                    f"only {free} MiB free on {device}, {needed} MiB needed; the model is still "
                    "loading"
                )
            return "pending", (
                f"only {free} MiB free on {device}, {needed} MiB needed; Strata's cache is "
                f"shrinking ({self._mapped_mib()} MiB now)"
            )
        if not self.worker.loaded or cache is None or _closed(cache):
            return "pending", "the model is still loading; the cache shrinks once it exists"
        if decision is None:
            return "pending", "not checked yet"
        slots = cache.slots_for_bytes(decision.target_mib * MiB - self._kv_bytes().mapped)
        if cache.mapped_bytes <= cache.mapped_bytes_for(slots):
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
        core = _core_mib(cache) + -(-self._kv_bytes().floor // MiB)
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
                slots = cache.slots_for_bytes(decision.target_mib * MiB - self._kv_bytes().mapped)
                # unmapped, not only planned: the slots go first, the memory chunk by chunk
                if cache.mapped_bytes <= cache.mapped_bytes_for(slots):
                    return "shrink"
                free, needed = None, decision.room_kept_mib
            elif sample is not None:  # watched, no cache (yet): the room may exist anyway
                free, needed = _mib(sample.free_bytes), self._room_needed()
                if free >= needed:
                    return "room"
                if self.worker.loaded:  # loaded, and no cache to give back
                    raise NotEnoughVram(
                        needed, free, "Strata holds no expert cache to shrink: what is free now"
                    )
            else:
                if self.worker.loaded:
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
        if not self.worker.loaded:
            return Timeout(
                f"{what}: the model is still loading after {waited} ms; it is recorded "
                "and is carried out once the cache exists"
            )
        if free is None:
            target = decision.target_mib if decision is not None else None
            return Timeout(
                f"{what}: the cache has not reached {target} MiB after {waited} ms "
                f"({self.slots_mib} MiB now)"
            )
        explain = decision.explain if decision is not None else "no expert cache"
        return Timeout(
            f"{what}: only {free} MiB free after {waited} ms, {needed} MiB needed ({explain})"
        )

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
