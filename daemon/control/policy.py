"""The cache-size policy: a pure function from what the daemon sees to the size the cache should be.

``decide(now_ms, device, cache, book, lease_usage, cfg, state)`` reads no clock, touches no
device and keeps no hidden state: history lives in the immutable :class:`PolicyState` that each
:class:`Decision` carries forward. The service calls it every ``elastic_period_ms`` and at each
request's start, and applies ``target_mib`` at the next safe point (architecture §3).

The rules, all sizes in MiB:

* **Tenants** are the other programs on the GPU: ``used - ours`` (never negative), where
  *ours* is the arena's mapped memory plus the engine's own allocations. Strata's activations and
  K/V are in *ours*, so they never look like a tenant.
* **Room kept free** = ``max(elastic_reserve_mib, the run-time reserve, the largest hold)`` plus,
  for each lease, the part its borrower has not allocated yet (see :func:`lease_allocations`).
* **Goal** = ``usable - tenants - fixed - room`` (usable: used + free, the total less what the
  driver keeps for itself), clamped to ``[core, max]`` and to ``vram_max_mib - fixed`` when set;
  the core always wins (never below it, no negative numbers, whatever the reserve). At the goal,
  ``free == room`` exactly when ``ours == size + fixed``.
* **Shrink** (goal < size). An *explicit* request — a raised reserve or hold, a new lease, a
  ``vram_max_mib`` or ``max`` below the current size — shrinks by its whole amount in one
  decision (``urgent=True``). Everything else is *NVML-driven* (a tenant grew): at most
  ``elastic_shrink_step_mib`` below the current size per decision (``urgent=False``).
  Explicit is recognised from the history, not from a flag the caller passes: the state records
  the base room and the lease cookies of the previous decision, and a larger base room or an
  unseen cookie is new explicit demand. The urgent target then stays in the state until the cache
  has reached it (or it is no longer needed), so a periodic check that runs before the safe point
  can never turn it back into a one-step shrink.
* **Ahead of a growing program.** A failed allocation is invisible to the driver's counters, so a
  program that grows in steps larger than the room would wait for ever. When the tenants grew
  since the last settled reading and free VRAM is at (or below) the room, the room gains the
  *ahead* part: at least that growth, at most ``elastic_shrink_step_mib``. It fades linearly to
  nothing over ``elastic_stable_ms`` after the last such growth. Readings taken while a resize is
  under way (``DeviceView.settled`` false) are not compared: ``used`` and ``ours`` are not read
  atomically, and Strata's own unmapping would look like a tenant growing.
* **Idle release.** With ``idle_release_ms`` set (0: never), once no request has run for that long
  (``idle_since_ms``), the goal is the core (reason ``idle``). What it gives back from a cache at
  its goal counts as room that has lasted, so the next request grows it back at once; room that
  appears during the idle time (a program left) waits the stable time as usual.
* **Grow** (goal > size) only once the room has lasted the current stable time without a break,
  and then to the goal in one decision. A shrink that comes within ``stable_backoff_reset_ms`` of
  a growth doubles the stable time (oscillation damping, at most up to
  ``max(elastic_stable_ms, stable_backoff_reset_ms)``); ``stable_backoff_reset_ms`` without such
  a shrink brings it back to ``elastic_stable_ms``.

Reasons a decision gives: ``tenant`` (NVML-driven step), ``reserve``, ``lease``, a hold's source
name such as ``gamemode`` (explicit shrinks), ``vram_max`` / ``max`` (the size is above the cap),
``room`` (growth), ``waiting`` (room seen, not yet stable), ``core`` (held at the core: growing
back to it, or unable to go lower), ``idle`` (idle release), ``steady`` (no change).

Where no monitor sees the device (``vram_monitor = none``, or a monitor that failed),
:func:`decide_unwatched` takes over: the cache is its size when that began, less what the
reserve, the holds and the leases ask for since, so a request shrinks it by exactly its amount
(reason ``unwatched``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType

from strata.daemon.control.leases import BookView, Lease
from strata.daemon.control.policy_text import explain, unwatched_text
from strata.daemon.control.policy_types import (
    ELASTIC_RESERVE,
    Budget,
    CacheView,
    Decision,
    DeviceView,
    LeaseUsage,
    PolicyConfig,
    PolicyState,
)

# the values live in policy_types; their importers keep importing them from here
__all__ = [
    "ELASTIC_RESERVE",
    "Budget",
    "CacheView",
    "Decision",
    "DeviceView",
    "LeaseUsage",
    "PolicyConfig",
    "PolicyState",
    "base_room",
    "budget",
    "decide",
    "decide_unwatched",
    "faded_ahead",
    "lease_allocations",
    "unwatched_demand",
]


def base_room(cfg: PolicyConfig, reserve_mib: int, holds: Mapping[str, int]) -> tuple[int, str]:
    """``max(automatic reserve, run-time reserve, largest hold)`` and which of them it is."""
    return _largest(cfg.elastic_reserve_mib, ELASTIC_RESERVE, reserve_mib, holds)


def _largest(best: int, source: str, reserve_mib: int, holds: Mapping[str, int]) -> tuple[int, str]:
    if reserve_mib > best:
        best, source = reserve_mib, "reserve"
    for name, mib in sorted(holds.items()):
        if mib > best:
            best, source = mib, name
    return best, source


def lease_allocations(
    leases: Iterable[Lease], usage: Sequence[LeaseUsage], tenants_mib: int
) -> dict[int, int]:
    """How much of each lease its borrower has allocated, in ``[0, lease]``, by cookie.

    Measured per PID where ``usage`` has a number. Otherwise estimated as the growth of tenant
    usage since the Borrow, newest lease first, each lease taking only the growth the newer
    leases' borrowers have not already accounted for (their allocations happened after the older
    Borrow too), so one program's growth is never counted twice. The estimate cannot tell the
    borrower from another program that grows at the same time; both count as the borrower's.
    A lease with neither a measurement nor a tenant reading at Borrow counts as unallocated.
    """
    measured = {u.cookie: u.allocated_mib for u in usage}
    out: dict[int, int] = {}
    newer = 0
    for lease in sorted(leases, key=lambda lease: lease.cookie, reverse=True):
        got = measured.get(lease.cookie)
        if got is None:
            at_borrow = lease.tenant_used_at_borrow_mib
            got = 0 if at_borrow is None else tenants_mib - at_borrow - newer
        got = min(max(got, 0), lease.mib)
        out[lease.cookie] = got
        newer += got
    return out


def faded_ahead(cfg: PolicyConfig, state: PolicyState, now_ms: float) -> int:
    """The ahead room at ``now_ms``: as set at the last growth, fading linearly to 0 over
    ``elastic_stable_ms``."""
    if state.ahead_at_ms is None or state.ahead_mib <= 0:
        return 0
    since = max(0.0, now_ms - state.ahead_at_ms)
    if since >= cfg.elastic_stable_ms:
        return 0
    return int(state.ahead_mib * (1 - since / cfg.elastic_stable_ms))


def budget(
    device: DeviceView,
    cache: CacheView,
    book: BookView,
    lease_usage: Sequence[LeaseUsage],
    cfg: PolicyConfig,
    ahead_mib: int = 0,
) -> Budget:
    """The room to keep free and the size it leaves for the cache (steps 1 and 2 of the rules);
    ``ahead_mib`` is added to the room for a program that is growing."""
    tenants = device.tenants_mib
    base, base_source = base_room(cfg, book.reserve_mib, book.holds)
    allocated = lease_allocations(book.leases, lease_usage, tenants)
    owed = {lease.cookie: lease.mib - allocated[lease.cookie] for lease in book.leases}
    room = base + sum(owed.values()) + ahead_mib
    available = device.usable_mib - tenants - cache.fixed_mib - room
    cap, cap_reason = cache.max_mib, "max"
    if cfg.vram_max_mib is not None and cfg.vram_max_mib - cache.fixed_mib < cap:
        cap, cap_reason = max(0, cfg.vram_max_mib - cache.fixed_mib), "vram_max"
    goal = max(cache.core_mib, min(available, cap))
    return Budget(
        tenants, base, base_source, MappingProxyType(owed), room, available, cap, cap_reason, goal,
        ahead_mib,
    )  # fmt: skip


def _ahead(
    now_ms: float,
    device: DeviceView,
    cache: CacheView,
    book: BookView,
    lease_usage: Sequence[LeaseUsage],
    cfg: PolicyConfig,
    state: PolicyState,
) -> tuple[int, float | None, int | None]:
    """The ahead room for this decision: ``(ahead, ahead_at, unleased tenants seen)``.

    The tenants not accounted for by a lease (a borrower filling its lease is not a program
    starving: its room is kept already) grew since the last settled reading, and free VRAM is
    at or below the room: their growth took it. Keep at least that growth more, at most one
    shrink step, as of now.
    """
    faded = faded_ahead(cfg, state, now_ms)
    at = state.ahead_at_ms if faded else None
    if not device.settled:
        return faded, at, state.tenants_mib
    b = budget(device, cache, book, lease_usage, cfg, faded)
    leased = sum(lease.mib - b.owed_mib[lease.cookie] for lease in book.leases)
    unleased = max(0, b.tenants_mib - leased)
    growth = 0 if state.tenants_mib is None else unleased - state.tenants_mib
    if growth > 0 and device.free_mib <= b.room_mib:
        return min(cfg.elastic_shrink_step_mib, max(faded, growth)), now_ms, unleased
    return faded, at, unleased


def decide(
    now_ms: float,
    device: DeviceView,
    cache: CacheView,
    book: BookView,
    lease_usage: Sequence[LeaseUsage],
    cfg: PolicyConfig,
    state: PolicyState,
    *,
    idle_since_ms: float | None = None,
) -> Decision:
    """The cache size for this moment and the state for the next call (see the module doc).
    ``idle_since_ms``: since when no request has run (None: one runs now)."""
    _check_now(now_ms)
    ahead, ahead_at, tenants_seen = _ahead(now_ms, device, cache, book, lease_usage, cfg, state)
    b = budget(device, cache, book, lease_usage, cfg, ahead)
    size, core, goal = cache.size_mib, cache.core_mib, b.goal_mib
    idle = _idle(now_ms, cfg, idle_since_ms)

    # Oscillation damping: back to the base stable time after a quiet stretch.
    stable, damped_at = state.stable_ms, state.last_shrink_after_growth_ms
    if damped_at is not None and now_ms - damped_at >= cfg.stable_backoff_reset_ms:
        stable, damped_at = cfg.elastic_stable_ms, None
    urgent_target, urgent_reason = _urgent(size, core, b, book, state)
    c = _Course(size, "steady", False, urgent_target, urgent_reason, state.room_since_ms,
                state.last_growth_ms, stable, damped_at)  # fmt: skip
    if idle:
        _release(c, now_ms, size, core, goal)
    elif goal < size:
        _shrink(c, now_ms, size, goal, cfg)
    elif goal > size:
        _grow(c, now_ms, size, core, goal, state.growing_to_mib)
    else:
        c.room_since, c.urgent, c.target = None, False, size
        c.reason = "core" if size == core and b.available_mib < core else "steady"
    next_state = PolicyState(
        stable_ms=c.stable,
        room_since_ms=c.room_since,
        last_growth_ms=c.grown_at,
        last_shrink_after_growth_ms=c.damped_at,
        base_room_mib=b.base_mib,
        known_cookies=frozenset(lease.cookie for lease in book.leases),
        urgent_target_mib=c.urgent_target,
        urgent_reason=c.urgent_reason,
        growing_to_mib=c.growing_to,
        tenants_mib=tenants_seen,
        ahead_mib=ahead,
        ahead_at_ms=ahead_at,
    )
    target, reason, urgent = c.target, c.reason, c.urgent
    text = explain(now_ms, device, cache, cfg, book, b, target, reason, next_state)
    return Decision(target, reason, urgent, next_state, b, text)


@dataclass
class _Course:
    """What ``decide`` works out: the target and why, and the state it carries on."""

    target: int
    reason: str
    urgent: bool
    urgent_target: int | None
    urgent_reason: str | None
    room_since: float | None
    grown_at: float | None
    stable: float
    damped_at: float | None
    growing_to: int | None = None


def _release(c: _Course, now_ms: float, size: int, core: int, goal: int) -> None:
    """Idle: back to the core. Voluntary: neither an oscillation nor the end of the room. The
    room keeps being tracked as though the cache were at its core, so the next request grows
    at once."""
    c.target, c.reason, c.urgent = core, "idle", size > core
    c.urgent_target = c.urgent_reason = None
    if goal <= core:
        c.room_since = None
    elif c.room_since is None or c.room_since > now_ms:
        # What the release gives back from a cache at its goal is room that has lasted: the
        # next request grows it back at once. Room that appears later waits as usual.
        c.room_since = now_ms - c.stable if core < size <= goal else now_ms


def _shrink(c: _Course, now_ms: float, size: int, goal: int, cfg: PolicyConfig) -> None:
    """Less room than the cache: a request's part at once, a tenant's one step at a time; a
    shrink soon after a growth doubles the stable time (oscillation damping)."""
    c.room_since = None
    if c.urgent_target is not None:
        # The explicit part at once, plus at most one step for what the tenants did.
        target = max(goal, c.urgent_target - cfg.elastic_shrink_step_mib)
        c.target = c.urgent_target if goal == c.urgent_target else target
        c.reason, c.urgent = c.urgent_reason or "lease", True
    else:
        c.target = max(goal, size - cfg.elastic_shrink_step_mib)
        c.reason, c.urgent = "tenant", False
    if c.grown_at is not None:
        if now_ms - c.grown_at < cfg.stable_backoff_reset_ms:
            c.stable, c.damped_at = min(c.stable * 2, cfg.stable_max_ms), now_ms
        c.grown_at = None


def _grow(
    c: _Course, now_ms: float, size: int, core: int, goal: int, growing_to: int | None
) -> None:
    """More room than the cache: grow once the room has lasted the stable time."""
    c.urgent = False
    if growing_to is not None and size < growing_to:
        # Decided but not applied yet (a busy engine grows at its next safe point): repeat it
        # rather than restart the wait.
        c.target, c.reason, c.growing_to = goal, "room", goal
        return
    if c.room_since is None or c.room_since > now_ms:  # a clock that went back: restart
        c.room_since = now_ms
    if now_ms - c.room_since >= c.stable:
        c.target, c.reason, c.grown_at, c.room_since, c.growing_to = (
            goal,
            "room",
            now_ms,
            None,
            goal,
        )
    elif size < core:
        c.target, c.reason = core, "core"
    else:
        c.target, c.reason = size, "waiting"


def _check_now(now_ms: float) -> None:
    if isinstance(now_ms, bool) or not isinstance(now_ms, int | float) or not math.isfinite(now_ms):
        raise ValueError(f"now_ms: expected a finite number of milliseconds, got {now_ms!r}")


def _idle(now_ms: float, cfg: PolicyConfig, idle_since_ms: float | None) -> bool:
    return (
        cfg.idle_release_ms > 0
        and idle_since_ms is not None
        and now_ms - idle_since_ms >= cfg.idle_release_ms
    )


def unwatched_demand(book: BookView) -> int:
    """What the book asks of a cache no monitor watches: the largest of the run-time reserve and
    the holds, plus every lease (the automatic reserve was left free when the cache was sized)."""
    return _largest(0, ELASTIC_RESERVE, book.reserve_mib, book.holds)[0] + book.borrowed_mib


def decide_unwatched(
    now_ms: float,
    cache: CacheView,
    book: BookView,
    cfg: PolicyConfig,
    state: PolicyState,
    *,
    idle_since_ms: float | None = None,
) -> Decision:
    """The cache size where no monitor sees the device (``vram_monitor = none``, or a monitor
    that failed): what is free cannot be known, so a request is carried out by shrinking the
    cache by exactly its amount.

    The base is the cache's size at the first such decision and the book's demand then
    (:func:`unwatched_demand`); the target is ``base - (demand now - demand then)``, clamped to
    ``[core, cap]``, at once in both directions (there is no room to wait for). Idle release
    applies as in :func:`decide`.
    """
    _check_now(now_ms)
    size, core = cache.size_mib, cache.core_mib
    demand = unwatched_demand(book)
    base, at_base = state.unwatched_base_mib, state.unwatched_demand_mib
    if base is None:
        base, at_base = size, demand
    cap, cap_reason = cache.max_mib, "max"
    if cfg.vram_max_mib is not None and cfg.vram_max_mib - cache.fixed_mib < cap:
        cap, cap_reason = max(0, cfg.vram_max_mib - cache.fixed_mib), "vram_max"
    available = base + at_base - demand
    goal = max(core, min(available, cap))
    idle = _idle(now_ms, cfg, idle_since_ms)
    target = core if idle else goal
    reason = "idle" if idle and target != size else "unwatched" if target != size else "steady"
    asked, asked_source = _largest(0, ELASTIC_RESERVE, book.reserve_mib, book.holds)
    owed = MappingProxyType({lease.cookie: lease.mib for lease in book.leases})
    b = Budget(0, asked, asked_source, owed, demand, available, cap, cap_reason, goal)
    next_state = replace(
        state,
        base_room_mib=base_room(cfg, book.reserve_mib, book.holds)[0],
        known_cookies=frozenset(lease.cookie for lease in book.leases),
        urgent_target_mib=None,
        urgent_reason=None,
        growing_to_mib=None,
        room_since_ms=None,
        tenants_mib=None,
        ahead_mib=0,
        ahead_at_ms=None,
        unwatched_base_mib=base,
        unwatched_demand_mib=at_base,
    )
    idle_s = (now_ms - (idle_since_ms or now_ms)) / 1000 if idle else None
    text = unwatched_text(book, base + at_base, demand, core, idle_s, size, target)
    return Decision(target, reason, target < size, next_state, b, text)


def _urgent(
    size: int, core: int, b: Budget, book: BookView, state: PolicyState
) -> tuple[int | None, str | None]:
    """The explicit shrink still owed: the previous one if the cache has not reached it, lowered
    by new demand (a larger base room, leases not seen before) and by a cap below the size; never
    lower than the goal (the room no longer needs it) and None once the size is at or below it."""
    target, reason = state.urgent_target_mib, state.urgent_reason
    if target is not None and size <= target:
        target = reason = None
    new_base = 0 if state.base_room_mib is None else max(0, b.base_mib - state.base_room_mib)
    new_leases = sum(lease.mib for lease in book.leases if lease.cookie not in state.known_cookies)
    if new_base or new_leases:
        start = size if target is None else min(size, target)
        target = start - new_base - new_leases
        reason = b.base_source if new_base >= new_leases else "lease"
    ceiling = max(core, b.cap_mib)
    if size > ceiling and (target is None or target > ceiling):
        target, reason = ceiling, b.cap_reason
    if target is not None:
        target = max(target, b.goal_mib)
        if target >= size:
            target = reason = None
    return target, reason
