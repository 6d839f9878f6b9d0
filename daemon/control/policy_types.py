"""The control plane's values: its configuration (:class:`PolicyConfig`, checked whole), what a
decision sees (:class:`DeviceView`, :class:`CacheView`, :class:`LeaseUsage`), the state one
decision hands the next (:class:`PolicyState`), and what it says (:class:`Budget`,
:class:`Decision`). Plain frozen dataclasses; ``daemon.policy`` decides with them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from strata.daemon.control.leases import is_int

ELASTIC_RESERVE = "elastic_reserve"


def _whole(owner: str, name: str, value: object, minimum: int) -> None:
    if not is_int(value):
        raise ValueError(f"{owner}{name}: expected a whole number, got {value!r}")
    if value < minimum:  # type: ignore[operator]
        raise ValueError(f"{owner}{name}: expected at least {minimum}, got {value!r}")


@dataclass(frozen=True)
class PolicyConfig:
    """The policy's knobs (the service builds this from ``StrataConfig``)."""

    elastic_reserve_mib: int = 1024
    elastic_stable_ms: int = 5000
    elastic_shrink_step_mib: int = 1024
    stable_backoff_reset_ms: int = 300_000
    vram_max_mib: int | None = None
    idle_release_ms: int = 0  # 0: never

    def __post_init__(self) -> None:
        _whole("", "elastic_reserve_mib", self.elastic_reserve_mib, 0)
        _whole("", "elastic_stable_ms", self.elastic_stable_ms, 0)
        _whole("", "elastic_shrink_step_mib", self.elastic_shrink_step_mib, 1)
        _whole("", "stable_backoff_reset_ms", self.stable_backoff_reset_ms, 0)
        _whole("", "idle_release_ms", self.idle_release_ms, 0)
        if self.vram_max_mib is not None:
            _whole("", "vram_max_mib", self.vram_max_mib, 1)

    @property
    def stable_max_ms(self) -> int:
        """Doubling stops here: beyond it the reset would come before the room could last."""
        return max(self.elastic_stable_ms, self.stable_backoff_reset_ms)


@dataclass(frozen=True)
class DeviceView:
    """One reading of the device (``vmm.monitor.VramSample`` in MiB). ``ours_mib``: the arena's
    mapped memory plus the engine's own allocations (what Strata really holds, never the policy's
    target). ``used_mib``: memory allocated by processes, Strata included; memory the driver keeps
    for itself is in neither used nor free. Without it, everything not free counts as used.
    ``settled``: false when a resize may have run between the readings of used and ours (then
    the tenants' growth is not trusted)."""

    total_mib: int
    free_mib: int
    ours_mib: int
    used_mib: int | None = None
    settled: bool = True  # no resize was under way while it was read

    def __post_init__(self) -> None:
        for name in ("total_mib", "free_mib", "ours_mib"):
            _whole("DeviceView.", name, getattr(self, name), 0)
        if self.used_mib is not None:
            _whole("DeviceView.", "used_mib", self.used_mib, 0)

    @property
    def usable_mib(self) -> int:
        """What processes can hold at all: used + free (the total less the driver's reserve)."""
        if self.used_mib is None:
            return self.total_mib
        return min(self.total_mib, self.used_mib + self.free_mib)

    @property
    def tenants_mib(self) -> int:
        """Other programs' usage: used - ours. Readings taken a moment apart can make it
        negative: 0."""
        used = self.total_mib - self.free_mib if self.used_mib is None else self.used_mib
        return max(0, used - self.ours_mib)


@dataclass(frozen=True)
class CacheView:
    """The expert cache: its current (mapped) size, fixed core, largest size (the whole expert
    set or the reservation), and the engine's own non-cache memory (weights outside the experts,
    K/V, workspaces; it is part of ``DeviceView.ours_mib``)."""

    size_mib: int
    core_mib: int
    max_mib: int
    fixed_mib: int

    def __post_init__(self) -> None:
        for name in ("size_mib", "core_mib", "max_mib", "fixed_mib"):
            _whole("CacheView.", name, getattr(self, name), 0)
        if self.core_mib > self.max_mib:
            raise ValueError(
                f"CacheView: core_mib {self.core_mib} is larger than max_mib {self.max_mib}"
            )


@dataclass(frozen=True)
class LeaseUsage:
    """What a lease's borrower has allocated *since its Borrow* (the service subtracts the PID's
    usage at Borrow time), from NVML's per-process usage; None where the driver does not say."""

    cookie: int
    allocated_mib: int | None

    def __post_init__(self) -> None:
        if self.allocated_mib is not None:
            _whole("LeaseUsage.", "allocated_mib", self.allocated_mib, 0)


@dataclass(frozen=True)
class PolicyState:
    """The policy's memory between decisions; start from :meth:`initial`.

    * ``stable_ms``: how long room must last before the cache grows (doubles, then resets);
    * ``room_since_ms``: when the current unbroken stretch of room began (None: no room now);
    * ``last_growth_ms``: the last growth not yet followed by a shrink (a shrink within
      ``stable_backoff_reset_ms`` of it doubles ``stable_ms``);
    * ``last_shrink_after_growth_ms``: when ``stable_ms`` last doubled (the reset counts from it);
    * ``base_room_mib``, ``known_cookies``: the base room and the leases of the last decision, to
      recognise new explicit demand (``initial`` starts from the automatic reserve; None: count
      nothing as new);
    * ``urgent_target_mib``, ``urgent_reason``: an explicit shrink the cache has not reached yet;
    * ``growing_to_mib``: a growth decided but not reached yet (repeated, not waited for again);
    * ``tenants_mib``: the tenants not accounted for by a lease at the last settled reading
      (their growth is measured from it);
    * ``ahead_mib``, ``ahead_at_ms``: the ahead room set at the last growth, and when (it fades
      from there over ``elastic_stable_ms``);
    * ``unwatched_base_mib``, ``unwatched_demand_mib``: with no monitor, the cache's size when
      that began and what the book asked for then (see :func:`decide_unwatched`).
    """

    stable_ms: float
    room_since_ms: float | None = None
    last_growth_ms: float | None = None
    last_shrink_after_growth_ms: float | None = None
    base_room_mib: int | None = None
    known_cookies: frozenset[int] = frozenset()
    urgent_target_mib: int | None = None
    urgent_reason: str | None = None
    growing_to_mib: int | None = None
    tenants_mib: int | None = None
    ahead_mib: int = 0
    ahead_at_ms: float | None = None
    unwatched_base_mib: int | None = None
    unwatched_demand_mib: int = 0

    @classmethod
    def initial(cls, cfg: PolicyConfig) -> PolicyState:
        # The automatic reserve is the room the cache was sized for before any request.
        return cls(stable_ms=cfg.elastic_stable_ms, base_room_mib=cfg.elastic_reserve_mib)


@dataclass(frozen=True)
class Budget:
    """The arithmetic behind a decision, for the log and the status.

    ``owed_mib``: per lease cookie, the part its borrower has not allocated yet (kept free);
    ``available_mib``: ``usable - tenants - fixed - room`` (may be negative); ``cap_mib``: the
    largest size allowed (``max_mib``, or ``vram_max_mib - fixed`` when that is lower, reason
    ``"vram_max"``); ``goal_mib``: ``available`` clamped to ``[core, cap]``, the core winning;
    ``ahead_mib``: the part of the room kept for a program that is growing (in ``room_mib``).
    """

    tenants_mib: int
    base_mib: int
    base_source: str
    owed_mib: Mapping[int, int]
    room_mib: int
    available_mib: int
    cap_mib: int
    cap_reason: str
    goal_mib: int
    ahead_mib: int = 0


@dataclass(frozen=True)
class Decision:
    """What the cache should be now; ``state`` goes into the next call."""

    target_mib: int
    reason: str
    urgent: bool
    state: PolicyState
    budget: Budget
    explain: str

    @property
    def room_kept_mib(self) -> int:
        return self.budget.room_mib

    @property
    def tenants_mib(self) -> int:
        return self.budget.tenants_mib

    @property
    def goal_mib(self) -> int:
        """Where the policy is heading: the target without the step limit or the stable wait."""
        return self.budget.goal_mib
