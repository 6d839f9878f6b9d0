"""The cache-size policy with an injected clock: single decisions from a table, then minutes of
1-second checks against a tiny simulated device (free = total - tenants - cache - fixed)."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pytest

from strata.daemon.control.leases import BookView, Lease, LeaseBook
from strata.daemon.control.policy import (
    CacheView,
    Decision,
    DeviceView,
    LeaseUsage,
    PolicyConfig,
    PolicyState,
    decide,
    decide_unwatched,
    lease_allocations,
)

TOTAL, FIXED, CORE, MAX = 24_576, 2_048, 2_048, 30_000  # MAX: the expert set outgrows the GPU
FULL = TOTAL - FIXED - 500  # 22028: the cache with no tenants and a 500 MiB room
STEP = 1024
CFG = PolicyConfig(elastic_reserve_mib=500)  # the numbers below were worked out with 500


# --- a tiny simulated device and the service's loop around decide() --------------------------


@dataclass
class Sim:
    """The service in miniature: checks every second (and at each request), applies the target at
    once unless ``busy`` (then at the next ``safe_point()``), never maps memory that is not free."""

    cfg: PolicyConfig = CFG
    size: int = FULL
    core: int = CORE
    max: int = MAX
    now: int = 0
    busy: bool = False
    per_pid: bool = True
    tenants: dict[str, int] = field(default_factory=dict)
    book: LeaseBook = field(default_factory=LeaseBook)
    allocated: dict[int, int] = field(default_factory=dict)  # per-PID usage since Borrow
    state: PolicyState = field(default_factory=lambda: PolicyState.initial(CFG))
    log: list[tuple[int, int, Decision]] = field(default_factory=list)  # now, size seen, decision
    pending: int | None = None

    def __post_init__(self) -> None:
        self.state = PolicyState.initial(self.cfg)

    @property
    def free(self) -> int:
        return TOTAL - sum(self.tenants.values()) - self.size - FIXED

    def check(self) -> Decision:
        usage = [LeaseUsage(c, a if self.per_pid else None) for c, a in self.allocated.items()]
        d = decide(
            self.now,
            DeviceView(TOTAL, self.free, self.size + FIXED),
            CacheView(self.size, self.core, self.max, FIXED),
            self.book.view(),
            usage,
            self.cfg,
            self.state,
        )
        self.state = d.state
        self.log.append((self.now, self.size, d))
        self.pending = d.target_mib
        if not self.busy:
            self.safe_point()
        return d

    def safe_point(self) -> None:
        if self.pending is not None:
            self.size = self.pending
            assert self.free >= 0, f"grew into memory that is not free at {self.now} ms"
            self.pending = None

    def run(self, seconds: int, tick: Callable[[Sim], None] = lambda sim: None) -> None:
        for _ in range(seconds):
            self.now += 1000
            tick(self)
            self.check()

    # The service's request paths: change the book, then check at once.
    def borrow(self, mib: int) -> Lease:
        tenants = TOTAL - self.free - self.size - FIXED
        lease = self.book.add(":1.50", 4242, "app", "test", mib, self.now * 1000, tenants)
        self.allocated[lease.cookie] = 0
        self.check()
        return lease

    def give_back(self, lease: Lease) -> None:
        self.book.remove(lease.cookie, ":1.50")
        del self.allocated[lease.cookie]
        self.check()

    def allocate(self, name: str, mib: int, lease: Lease | None = None) -> None:
        """A program allocates; like a driver, refused (AssertionError) beyond free."""
        assert mib <= self.free, f"{name}: {mib} MiB asked, {self.free} free"
        self.tenants[name] = self.tenants.get(name, 0) + mib
        if lease is not None:
            self.allocated[lease.cookie] += mib

    def sizes(self) -> list[int]:
        return [d.target_mib for _, _, d in self.log]

    def reasons(self) -> list[str]:
        return [d.reason for _, _, d in self.log]


def hungry(name: str, want: int, piece: int = 256) -> Callable[[Sim], None]:
    """A tenant that grabs free VRAM in ``piece`` MiB allocations until it has ``want``."""

    def tick(sim: Sim) -> None:
        while sim.tenants.get(name, 0) + piece <= want and sim.free >= piece:
            sim.tenants[name] = sim.tenants.get(name, 0) + piece

    return tick


def drops(sim: Sim) -> list[int]:
    """How much each decision shrank the size it saw."""
    return [max(0, seen - d.target_mib) for _, seen, d in sim.log]


# --- defaults and single decisions ------------------------------------------------------------


def test_defaults() -> None:
    cfg = PolicyConfig()
    assert (cfg.elastic_reserve_mib, cfg.elastic_stable_ms, cfg.elastic_shrink_step_mib) == (
        1024,
        5000,
        1024,
    )
    assert (cfg.stable_backoff_reset_ms, cfg.vram_max_mib, cfg.idle_release_ms) == (
        300_000,
        None,
        0,
    )
    state = PolicyState.initial(cfg)
    assert state.stable_ms == 5000 and state.room_since_ms is None
    assert state.urgent_target_mib is None and state.base_room_mib == 1024  # sized for the default
    assert state.ahead_mib == 0 and state.tenants_mib is None


def _one(
    *,
    size: int = FULL,
    free: int | None = None,
    tenants: int = 0,
    reserve: int = 0,
    holds: dict[str, int] | None = None,
    leases: tuple[Lease, ...] = (),
    usage: tuple[LeaseUsage, ...] = (),
    cfg: PolicyConfig = CFG,
    now: int = 100_000,
    idle_since_ms: float | None = None,
    **state: object,
) -> Decision:
    free = TOTAL - tenants - size - FIXED if free is None else free
    st = replace(PolicyState.initial(cfg), **{"base_room_mib": 500, **state})
    book = BookView(reserve, holds or {}, leases)
    device = DeviceView(TOTAL, max(0, free), size + FIXED)
    cache = CacheView(size, CORE, MAX, FIXED)
    return decide(now, device, cache, book, list(usage), cfg, st, idle_since_ms=idle_since_ms)


def _lease(cookie: int, mib: int, at_borrow: int | None = 0) -> Lease:
    return Lease(cookie, ":1.9", 99, "app", "why", mib, 0, at_borrow)


# name, _one() arguments, (target, reason, urgent)
CASES = [
    ("steady at the goal", {}, (FULL, "steady", False)),
    ("a tenant took 300 of the room", {"tenants": 300}, (FULL - 300, "tenant", False)),
    (
        "a tenant took a 4000 MiB reserve: one step",
        {"reserve": 4000, "base_room_mib": 4000, "size": FULL - 3500, "free": 0},
        (FULL - 3500 - STEP, "tenant", False),
    ),
    ("room first seen", {"size": FULL - 3000}, (FULL - 3000, "waiting", False)),
    (
        "room 1 ms short of the stable time",
        {"size": FULL - 3000, "room_since_ms": 100_000 - 4_999},
        (FULL - 3000, "waiting", False),
    ),
    (
        "room lasted the stable time: grow to the goal at once",
        {"size": FULL - 3000, "room_since_ms": 100_000 - 5_000},
        (FULL, "room", False),
    ),
    ("reserve raised: the whole amount", {"reserve": 6000}, (FULL - 5500, "reserve", True)),
    (
        "reserve raised while a tenant took the room: all of it",
        {"reserve": 6000, "tenants": 3000, "size": FULL - 2500, "free": 0},
        (FULL - 2500 - 6000, "reserve", True),
    ),
    (
        "a hold above a reserve a tenant took: the hold's part at once, then one step",
        {
            "reserve": 4000,
            "base_room_mib": 4000,
            "holds": {"gamemode": 6000},
            "size": FULL - 3500,
            "free": 0,
        },
        (FULL - 3500 - 2000 - STEP, "gamemode", True),
    ),
    ("a reserve below the automatic one", {"reserve": 400}, (FULL, "steady", False)),
    ("a GameMode hold", {"holds": {"gamemode": 4000}}, (FULL - 3500, "gamemode", True)),
    ("a new lease", {"leases": (_lease(1, 5000),)}, (FULL - 5000, "lease", True)),
    (
        "a known lease whose borrower allocated it all",
        {"leases": (_lease(1, 5000),), "known_cookies": frozenset({1}), "size": FULL - 5000},
        (FULL - 5000, "steady", False),
    ),
    (
        "reserve above the device total: the core",
        {"reserve": TOTAL + 1000},
        (CORE, "reserve", True),
    ),
    (
        "a tenant larger than the tail, at the core",
        {"size": CORE, "tenants": 20_000},
        (CORE, "core", False),
    ),
    ("below the core: back to it at once", {"size": 1000}, (CORE, "core", False)),
    (
        "vram_max below the size",
        {"cfg": PolicyConfig(vram_max_mib=12_000)},
        (12_000 - FIXED, "vram_max", True),
    ),
    (
        "vram_max below core + fixed: the core",
        {"cfg": PolicyConfig(vram_max_mib=3000)},
        (CORE, "vram_max", True),
    ),
    (
        "above the largest size: down to it at once, one step toward the goal",
        {"size": MAX + 512, "free": 0},
        (MAX - STEP, "max", True),
    ),
    ("readings that overlap: tenants 0", {"free": TOTAL}, (FULL, "steady", False)),
]


@pytest.mark.parametrize(("args", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_single_decision(args: dict, want: tuple[int, str, bool]) -> None:
    d = _one(**args)
    assert (d.target_mib, d.reason, d.urgent) == want, d.explain
    assert CORE <= d.target_mib and d.room_kept_mib >= 0 and d.tenants_mib >= 0


def test_memory_the_driver_keeps_is_neither_a_tenant_nor_room() -> None:
    # NVML memory info v2: 300 MiB reserved by the driver, in neither used nor free.
    size, driver = FULL - 300, 300
    device = DeviceView(TOTAL, 500, size + FIXED, used_mib=TOTAL - driver - 500)
    assert (device.tenants_mib, device.usable_mib) == (0, TOTAL - driver)
    d = decide(
        0, device, CacheView(size, CORE, MAX, FIXED), BookView(), [], CFG, PolicyState.initial(CFG)
    )
    assert (d.target_mib, d.reason) == (size, "steady")  # free is exactly the 500 kept
    # Without used, the reserve would look like a 300 MiB tenant.
    assert DeviceView(TOTAL, 500, size + FIXED).tenants_mib == driver


def test_a_reserve_above_the_device_total_is_explained_not_a_crash() -> None:
    d = _one(reserve=TOTAL + 1000)
    assert d.target_mib == CORE and d.goal_mib == CORE
    assert f"reserve of {TOTAL + 1000} MiB cannot be met" in d.explain
    again = _one(reserve=TOTAL + 1000, size=CORE, base_room_mib=TOTAL + 1000)
    assert (again.target_mib, again.reason) == (CORE, "core")
    assert "cannot be met" in again.explain


def test_explain_says_what_and_why() -> None:
    d = _one(reserve=6000)
    assert "keep 6000 MiB free (reserve 6000)" in d.explain
    assert f"shrink {FULL} -> {FULL - 5500} MiB" in d.explain
    d = _one(leases=(_lease(3, 2000),), usage=(LeaseUsage(3, 500),), known_cookies={3})
    assert "lease 3: 1500 of 2000 not yet allocated" in d.explain
    assert "vram_max_mib 3000 is below" in _one(cfg=PolicyConfig(vram_max_mib=3000)).explain


def test_decide_is_pure(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_clock() -> float:
        raise AssertionError("the policy read the clock")

    for name in ("time", "monotonic", "perf_counter", "time_ns", "monotonic_ns"):
        monkeypatch.setattr(time, name, no_clock)
    args = {"reserve": 3000, "leases": (_lease(1, 2000, at_borrow=100),), "tenants": 600}
    assert _one(**args) == _one(**args)


def test_now_must_be_a_finite_number() -> None:
    for bad in (float("nan"), float("inf"), True, "5"):
        with pytest.raises(ValueError, match="now_ms"):
            _one(now=bad)  # type: ignore[arg-type]


def test_a_clock_that_went_back_restarts_the_wait() -> None:
    d = _one(size=FULL - 3000, room_since_ms=200_000, now=100_000)
    assert d.reason == "waiting" and d.state.room_since_ms == 100_000


# --- lease allocation estimates ---------------------------------------------------------------


def test_lease_allocations_measured_estimated_and_never_counted_twice() -> None:
    older, newer = _lease(1, 3000, at_borrow=1000), _lease(2, 2000, at_borrow=1500)
    # Tenants grew 1000 -> 4000: the newer borrower's 2000 (since 1500) comes first, the older
    # lease gets the remaining 1000 of its 3000 growth, not all 3000.
    assert lease_allocations([older, newer], [], 4000) == {1: 1000, 2: 2000}
    # Measured usage wins and is capped to the lease; a reading below the Borrow counts as 0.
    got = lease_allocations([older, newer], [LeaseUsage(1, 5000), LeaseUsage(2, None)], 1200)
    assert got == {1: 3000, 2: 0}
    assert lease_allocations([_lease(5, 800, at_borrow=None)], [], 9000) == {5: 0}


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field_name", "value", "fragment"),
    [
        ("elastic_reserve_mib", -1, "at least 0, got -1"),
        ("elastic_reserve_mib", 1.5, "whole number, got 1.5"),
        ("elastic_stable_ms", -5, "at least 0, got -5"),
        ("elastic_stable_ms", "5s", "whole number, got '5s'"),
        ("elastic_shrink_step_mib", 0, "at least 1, got 0"),
        ("elastic_shrink_step_mib", True, "whole number, got True"),
        ("stable_backoff_reset_ms", -300_000, "at least 0, got -300000"),
        ("vram_max_mib", 0, "at least 1, got 0"),
        ("vram_max_mib", -8000, "at least 1, got -8000"),
    ],
)
def test_config_errors_name_the_field_and_value(field_name, value, fragment) -> None:
    with pytest.raises(ValueError, match=rf"^{field_name}: .*{fragment}"):
        PolicyConfig(**{field_name: value})


def test_views_reject_nonsense() -> None:
    with pytest.raises(ValueError, match=r"DeviceView\.free_mib: .*-1"):
        DeviceView(100, -1, 0)
    with pytest.raises(ValueError, match=r"DeviceView\.used_mib: .*-2"):
        DeviceView(100, 1, 0, used_mib=-2)
    with pytest.raises(ValueError, match=r"CacheView\.core_mib: .*-1"):
        CacheView(0, -1, 10, 0)
    with pytest.raises(ValueError, match="core_mib 20 is larger than max_mib 10"):
        CacheView(10, 20, 10, 0)
    with pytest.raises(ValueError, match=r"LeaseUsage\.allocated_mib: .*-3"):
        LeaseUsage(1, -3)


def test_random_inputs_never_give_negative_or_out_of_bounds_numbers() -> None:
    rng = random.Random(5)
    for _ in range(3000):
        total = rng.choice([0, 1000, 8192, 24_576])
        core = rng.randrange(0, 4000)
        cache = CacheView(rng.randrange(0, 40_000), core, core + rng.randrange(0, 30_000), 500)
        used = rng.choice([None, rng.randrange(0, total + 1)])
        device = DeviceView(
            total, rng.randrange(0, total + 2), rng.randrange(0, 40_000), used,
            settled=rng.random() < 0.8,
        )  # fmt: skip
        leases = tuple(
            _lease(c, rng.randrange(1, 9000), rng.choice([None, rng.randrange(0, 9000)]))
            for c in range(1, rng.randrange(1, 4))
        )
        usage = [
            LeaseUsage(lease.cookie, rng.choice([None, rng.randrange(0, 9000)])) for lease in leases
        ]
        cfg = PolicyConfig(vram_max_mib=rng.choice([None, rng.randrange(1, 30_000)]))
        book = BookView(rng.randrange(0, 30_000), {"gamemode": rng.randrange(0, 9000)}, leases)
        state = PolicyState(
            stable_ms=5000,
            room_since_ms=rng.choice([None, 0]),
            last_growth_ms=rng.choice([None, 0]),
            base_room_mib=rng.choice([None, 0, 20_000]),
            urgent_target_mib=rng.choice([None, rng.randrange(0, 40_000)]),
            urgent_reason="lease",
            tenants_mib=rng.choice([None, rng.randrange(0, 30_000)]),
            ahead_mib=rng.randrange(0, 2 * STEP),
            ahead_at_ms=rng.choice([None, rng.randrange(0, 10**6)]),
        )
        cfg = replace(cfg, idle_release_ms=rng.choice([0, 1000]))
        idle = rng.choice([None, rng.randrange(0, 10**6)])
        d = decide(
            rng.randrange(0, 10**6), device, cache, book, usage, cfg, state, idle_since_ms=idle
        )
        assert 0 <= d.budget.ahead_mib <= max(STEP, state.ahead_mib)
        b = d.budget
        assert core <= d.target_mib, d.explain
        assert d.target_mib <= max(cache.size_mib, core, b.cap_mib), d.explain
        assert b.room_mib >= 0 and b.tenants_mib >= 0 and b.cap_mib >= 0
        assert all(0 <= b.owed_mib[lease.cookie] <= lease.mib for lease in leases)
        assert core <= d.goal_mib <= max(core, b.cap_mib)
        if d.target_mib < cache.size_mib and not d.urgent:
            assert cache.size_mib - d.target_mib <= STEP


# --- scenarios: minutes of 1-second checks ----------------------------------------------------


def test_oscillating_tenant_every_3_s_regrows_only_the_ahead_room_and_damped() -> None:
    sim = Sim()
    on = hungry("osc", 3072)

    def tick(sim: Sim) -> None:
        if (sim.now // 3000) % 2 == 0:
            on(sim)
        else:
            sim.tenants["osc"] = 0

    sim.run(180, tick)
    assert max(drops(sim)) <= STEP
    # It never takes the cache below its 3 GiB plus one step kept ahead for it...
    assert min(sim.sizes()) >= FULL - 3072 - STEP
    # ...and what it gives back is the room kept ahead once it stopped growing, with the stable
    # time doubling at each return: a few growths in three minutes, not one per cycle.
    grows = [t for t, _, d in sim.log if d.reason == "room"]
    assert 1 <= len(grows) <= 4, grows
    assert sim.state.stable_ms >= 8 * CFG.elastic_stable_ms


def test_stable_time_doubles_after_a_shrink_that_follows_a_growth_and_resets_after_5_min() -> None:
    sim = Sim()
    on = hungry("game", 3000)

    def tick(sim: Sim) -> None:  # 10 s on, 8 s off, four times; then gone for good
        if sim.now < 72_000 and (sim.now // 1000) % 18 < 10:
            on(sim)
        else:
            sim.tenants["game"] = 0

    sim.run(420, tick)
    grows = [t for t, _, d in sim.log if d.reason == "room"]
    stables = [(t, d.state.stable_ms) for t, _, d in sim.log]
    doubled = [t for (_, s0), (t, s) in itertools.pairwise(stables) if s > s0]
    reset = [t for (_, s0), (t, s) in itertools.pairwise(stables) if s < s0]

    assert grows[0] < 18_000  # the first 8 s gap: room lasted 5 s, the cache grew
    assert doubled[0] < 36_000  # the game came back: a shrink after a growth
    # each return within 5 minutes of a growth doubles it again
    assert [dict(stables)[t] for t in doubled] == [10_000 * 2**i for i in range(len(doubled))]
    assert len(doubled) >= 2
    # gone for good: the last growth, then 5 minutes without a shrink bring it back to 5 s
    assert reset and reset[0] - doubled[-1] in range(300_000, 301_000)
    assert dict(stables)[reset[0]] == 5_000
    assert sim.size == FULL and grows[-1] < reset[0]


def test_doubling_compounds_up_to_the_reset_time() -> None:
    state = {"stable_ms": 80_000, "last_growth_ms": 90_000}
    d = _one(tenants=300, **state)
    assert d.state.stable_ms == 160_000 and d.state.last_shrink_after_growth_ms == 100_000
    d = _one(tenants=300, **{**state, "stable_ms": 160_000})
    assert d.state.stable_ms == 300_000  # capped: beyond it the reset would come first
    # A shrink long after the growth is not an oscillation.
    d = _one(tenants=300, stable_ms=5000, last_growth_ms=100_000 - 300_000)
    assert d.state.stable_ms == 5000 and d.state.last_growth_ms is None


@pytest.mark.parametrize("reserve", [0, 4096])
def test_slow_tenant_grabs_256_mib_pieces_and_the_cache_gives_one_step_per_period(
    reserve: int,
) -> None:
    sim = Sim()
    if reserve:
        sim.book.set_reserve(reserve)
        sim.check()  # explicit: the whole amount at once
        assert sim.size == FULL + 500 - reserve
    sim.log.clear()
    start = sim.size
    sim.run(60, hungry("slow", 4096))
    assert sim.tenants["slow"] == 4096
    assert max(drops(sim)) <= STEP and not any(d.urgent for _, _, d in sim.log)
    # The room kept ahead of it (at most one step) comes back once it stopped growing...
    assert start - min(sim.sizes()) <= 4096 + STEP
    assert [d.reason for _, _, d in sim.log].count("room") <= 1
    assert sim.size == start - 4096 and sim.free == max(500, reserve)
    # ...and it had its 4 GiB within 8 s (one piece a second without the room kept ahead).
    reached = next(t for t, _, d in sim.log if d.tenants_mib >= 4096)
    assert reached <= (8_000 if not reserve else 2_000)


def test_tenant_larger_than_the_tail_stops_the_cache_at_its_core() -> None:
    sim = Sim()
    sim.run(120, hungry("huge", 30_000))
    assert sim.size == CORE and min(sim.sizes()) == CORE
    assert max(drops(sim)) <= STEP
    assert sim.log[-1][2].reason == "core" and "cannot be met" in sim.log[-1][2].explain
    sim.tenants["huge"] = 0  # it exits: regrow after the stable time, to the full size
    sim.run(4)
    assert sim.size == CORE
    sim.run(2)
    assert sim.size == FULL


@pytest.mark.parametrize("per_pid", [True, False], ids=["per-pid usage", "tenant growth"])
def test_borrower_allocating_its_lease_causes_no_second_shrink_and_regrowth_waits_for_return(
    per_pid: bool,
) -> None:
    sim = Sim(per_pid=per_pid)
    sim.allocate("desktop", 300)
    sim.run(10)
    assert sim.size == FULL - 300
    lease = sim.borrow(5000)  # larger than one step: answered by one decision
    assert sim.log[-1][2].urgent and sim.log[-1][2].reason == "lease"
    assert sim.size == FULL - 300 - 5000 and sim.free == 5500
    after_borrow = sim.size

    def alloc(sim: Sim) -> None:  # the borrower fills its lease 1000 MiB a second
        if sim.allocated[lease.cookie] < 5000:
            sim.allocate("borrower", 1000, lease)

    sim.run(30, alloc)
    assert set(sim.sizes()[-30:]) == {after_borrow}  # no further shrink, no growth
    assert sim.free == 500
    assert sim.log[-1][2].budget.owed_mib[lease.cookie] == 0

    sim.tenants["borrower"] = 0  # it frees its memory but still holds the lease
    sim.allocated[lease.cookie] = 0
    sim.run(30)
    assert set(sim.sizes()[-30:]) == {after_borrow} and sim.free == 5500

    sim.give_back(lease)
    sim.run(4)
    assert sim.size == after_borrow
    sim.run(1)
    assert sim.size == FULL - 300


def test_a_second_borrower_is_not_counted_against_the_first() -> None:
    sim = Sim(per_pid=False)
    first = sim.borrow(3000)
    sim.allocate("one", 3000, first)
    sim.run(3)
    second = sim.borrow(2000)
    assert sim.size == FULL - 5000
    sim.allocate("two", 1500, second)
    sim.run(3)
    owed = sim.log[-1][2].budget.owed_mib
    assert owed == {first.cookie: 0, second.cookie: 500}
    assert sim.size == FULL - 5000 and sim.free == 1000


def test_explicit_reserve_shrinks_the_whole_amount_at_the_next_safe_point() -> None:
    sim = Sim(busy=True)  # a generation is running: the resize waits for a safe point
    sim.book.set_reserve(8000)
    first = sim.check()
    assert (first.target_mib, first.urgent, first.reason) == (FULL - 7500, True, "reserve")
    sim.run(3)  # periodic checks before the safe point keep the whole urgent target
    assert [d.target_mib for _, _, d in sim.log[-3:]] == [FULL - 7500] * 3
    assert all(d.urgent for _, _, d in sim.log[-3:])
    sim.safe_point()
    assert sim.size == FULL - 7500 and sim.free == 8000
    sim.busy = False
    sim.run(2)
    assert sim.reasons()[-2:] == ["steady", "steady"] and sim.state.urgent_target_mib is None

    sim.book.set_reserve(0)  # lowered: grows back after the stable time, never at once
    assert sim.check().reason == "waiting"
    sim.run(4)
    assert sim.size == FULL - 7500
    sim.run(1)
    assert sim.size == FULL


def test_urgent_target_is_dropped_when_no_longer_needed() -> None:
    sim = Sim(busy=True)
    sim.book.set_reserve(8000)
    sim.check()
    sim.book.set_reserve(3000)  # lowered before the safe point: only what 3000 needs
    d = sim.check()
    assert (d.target_mib, d.urgent) == (FULL - 2500, True)
    sim.book.set_reserve(0)
    d = sim.check()
    assert (d.target_mib, d.urgent, d.state.urgent_target_mib) == (FULL, False, None)


def test_gamemode_hold_is_explicit_and_its_end_regrows() -> None:
    sim = Sim()
    sim.book.set_hold("gamemode", 6000)
    d = sim.check()
    assert (d.target_mib, d.reason, d.urgent) == (FULL - 5500, "gamemode", True)
    sim.book.clear_hold("gamemode")
    sim.run(6)
    assert sim.size == FULL


def test_vram_max_caps_strata_whatever_is_free() -> None:
    cfg = replace(CFG, vram_max_mib=12_000)
    sim = Sim(cfg=cfg)
    d = sim.check()
    assert (d.target_mib, d.reason, d.urgent) == (12_000 - FIXED, "vram_max", True)
    sim.run(120)
    assert max(sim.sizes()) == 12_000 - FIXED and sim.size + FIXED == 12_000
    assert sim.reasons()[-1] == "steady"
    sim.run(60, hungry("game", 14_336))  # still follows tenants below the cap
    assert sim.size == TOTAL - 14_336 - FIXED - 500 and sim.free == 500


def test_start_from_the_core_grows_after_the_stable_time() -> None:
    sim = Sim(size=CORE)
    sim.run(5)  # room first seen at the first check, at 1 s
    assert sim.size == CORE and sim.reasons() == ["waiting"] * 5
    sim.run(1)
    assert sim.size == FULL and sim.reasons()[-1] == "room"


def test_a_growth_the_busy_engine_has_not_applied_is_repeated_not_forgotten() -> None:
    sim = Sim(size=FULL - 4000, busy=True)
    sim.run(6)  # room seen at 1 s, lasted 5 s at 6 s
    assert sim.reasons()[-1] == "room" and sim.size == FULL - 4000  # decided, not applied yet
    sim.run(3)  # a long prefill: every check repeats the growth
    assert sim.reasons()[-3:] == ["room"] * 3 and sim.pending == FULL
    sim.safe_point()
    sim.run(1)
    assert sim.size == FULL and sim.reasons()[-1] == "steady"
    assert sim.state.room_since_ms is None


def test_the_worked_example_in_docs_policy_md() -> None:
    sim = Sim(cfg=PolicyConfig(), size=TOTAL - FIXED - 1024)  # the defaults

    def at(seconds: int) -> tuple[int, int, int]:
        sim.now = seconds * 1000
        d = sim.check()
        return d.room_kept_mib, sim.size, sim.free

    assert at(0) == (1024, 21_504, 1024)
    sim.book.set_reserve(6000)
    assert at(10) == (6000, 16_528, 6000)
    sim.now = 20_000
    lease = sim.borrow(3000)
    assert (sim.log[-1][2].room_kept_mib, sim.size, sim.free) == (9000, 13_528, 9000)
    for t in (21, 22, 23):
        sim.allocate("tool", 1000, lease)
        at(t)
    assert (sim.log[-1][2].room_kept_mib, sim.size, sim.free) == (6000, 13_528, 6000)
    sim.tenants["tool"] = sim.allocated[lease.cookie] = 0
    sim.now = 30_000
    sim.give_back(lease)
    assert (sim.size, sim.free, sim.reasons()[-1]) == (13_528, 9000, "waiting")
    for t in range(31, 35):
        at(t)
    assert at(35) == (6000, 16_528, 6000)
    sim.book.set_reserve(0)
    assert at(40) == (1024, 16_528, 6000) and sim.reasons()[-1] == "waiting"
    for t in range(41, 45):
        at(t)
    assert at(45) == (1024, 21_504, 1024)
    failed: list[int] = []
    game = stepper("game", 1024, 4096, failed)
    steps = []
    for t in range(50, 54):
        sim.now = t * 1000
        game(sim)
        d = sim.check()
        steps.append((d.room_kept_mib, sim.size, sim.free))
    assert steps == [(2048, 20_480, 1024), (2048, 19_456, 1024), (2048, 18_432, 1024),
                     (2048, 17_408, 1024)]  # fmt: skip
    assert not failed and sim.tenants["game"] == 4096
    assert at(54) == (1843, 16_589, 1843)
    for t in range(55, 65):
        at(t)
        assert sim.size == 16_589
    assert sim.state.stable_ms == 10_000  # the game's shrink came 9 s after the growth at 45 s
    assert at(65) == (1024, 17_408, 1024) and sim.reasons()[-1] == "room"


# --- a program that grows in steps larger than the room (its failed allocations unseen) -------


def stepper(name: str, step: int, want: int, failed: list[int]) -> Callable[[Sim], None]:
    """A program that allocates ``step`` MiB at a time, as games and image tools do; an
    allocation that does not fit fails, and nobody but the program knows (``failed`` counts)."""

    def tick(sim: Sim) -> None:
        if sim.tenants.get(name, 0) >= want:
            return
        if sim.free >= step:
            sim.tenants[name] = sim.tenants.get(name, 0) + step
        else:
            failed.append(sim.now)

    return tick


@pytest.mark.parametrize(
    ("reserve", "step"),
    [(100, 128), (500, 1024), (1024, 2048 - 1024 // 2)],
    ids=["128 MiB steps, 100 MiB room", "1 GiB steps, 500 MiB room", "1.5 GiB, 1 GiB room"],
)
def test_a_program_growing_in_steps_larger_than_the_room_gets_them_within_a_few_periods(
    reserve: int, step: int
) -> None:
    cfg = replace(CFG, elastic_reserve_mib=reserve)
    full = TOTAL - FIXED - reserve
    sim = Sim(cfg=cfg, size=full - step)  # room for its first step
    sim.check()
    assert sim.size == full - step and sim.free == reserve + step
    failed: list[int] = []
    sim.run(12, stepper("tool", step, 4 * step, failed))
    got = [t for t, _, d in sim.log if d.tenants_mib >= 4 * step]
    assert got and got[0] <= 8_000, f"4 steps only after {got[:1]} ms; failed at {failed}"
    assert max(drops(sim)) <= STEP
    # it stops growing; the room kept ahead fades and then the rest comes back; it exits and the
    # cache grows back to the full size
    sim.run(20)
    assert sim.size == full - 4 * step and sim.free == reserve
    sim.tenants["tool"] = 0
    sim.run(7)
    assert sim.size == full and sim.free == reserve


def test_without_a_growth_seen_a_step_larger_than_the_room_is_never_served() -> None:
    """What a failed allocation looks like to the policy: nothing. The first step must fit in
    the room (hence the default elastic_reserve_mib of 1024)."""
    sim = Sim()
    failed: list[int] = []
    sim.run(30, stepper("game", 1024, 4096, failed))
    assert "game" not in sim.tenants and len(failed) == 30
    assert set(sim.sizes()) == {FULL}


def test_the_room_kept_ahead_is_at_least_the_growth_at_most_a_step_and_fades() -> None:
    d = _one(tenants=300, free=200, tenants_mib=0)
    assert d.budget.ahead_mib == 300 and d.room_kept_mib == 800
    assert d.state.ahead_mib == 300 and d.state.ahead_at_ms == 100_000
    big = _one(size=TOTAL - FIXED - 5000, tenants=5000, tenants_mib=0)  # free: 0
    assert big.budget.ahead_mib == STEP and big.reason == "tenant"
    # it fades linearly over elastic_stable_ms after the last growth
    at = {"tenants": 300, "free": 500 + 300, "tenants_mib": 300, "ahead_mib": 400,
          "ahead_at_ms": 100_000}  # fmt: skip
    assert _one(now=100_000, **at).budget.ahead_mib == 400
    assert _one(now=102_500, **at).budget.ahead_mib == 200
    assert _one(now=105_000, **at).budget.ahead_mib == 0
    assert _one(now=105_000, **at).state.ahead_at_ms is None
    # a smaller growth does not lower what is kept ahead now
    assert _one(tenants=350, free=300, tenants_mib=300, ahead_mib=400, ahead_at_ms=100_000
                ).budget.ahead_mib == 400  # fmt: skip


def test_growth_within_free_memory_or_in_an_unsettled_reading_keeps_nothing_ahead() -> None:
    # other programs grew, but what is free is still above the room: they are not held back
    d = _one(tenants=300, free=2000, size=FULL - 1800, tenants_mib=0)
    assert d.budget.ahead_mib == 0 and d.state.tenants_mib == 300
    # a reading taken while a resize ran: used and ours may straddle it, so growth is not trusted
    size = FULL - 2000
    device = DeviceView(TOTAL, 0, size + FIXED, settled=False)  # looks like a 2500 MiB tenant
    st = replace(PolicyState.initial(CFG), tenants_mib=0)
    d = decide(100_000, device, CacheView(size, CORE, MAX, FIXED), BookView(), [], CFG, st)
    assert d.budget.ahead_mib == 0 and d.state.tenants_mib == 0
    assert d.reason == "tenant" and size - d.target_mib <= STEP


def test_a_borrower_filling_its_lease_is_not_a_program_held_back() -> None:
    lease = _lease(1, 3000, at_borrow=0)
    d = _one(tenants=2000, free=1500, leases=(lease,), known_cookies=frozenset({1}),
             usage=(LeaseUsage(1, 2000),), tenants_mib=0)  # fmt: skip
    assert d.budget.ahead_mib == 0 and d.state.tenants_mib == 0


def test_a_steady_desktop_leaves_the_cache_alone() -> None:
    sim = Sim()
    sim.allocate("desktop", 400)
    sim.run(2)
    start = sim.size
    sim.run(300)
    assert set(sim.sizes()[-300:]) == {start} and sim.free == 500
    assert all(d.budget.ahead_mib == 0 for _, _, d in sim.log[-300:])


# --- idle release ------------------------------------------------------------------------------


def test_idle_release_shrinks_to_the_core_and_the_next_request_grows_at_once() -> None:
    cfg = replace(CFG, idle_release_ms=300_000)
    st = replace(PolicyState.initial(cfg), base_room_mib=500)
    cache = CacheView(FULL, CORE, MAX, FIXED)

    def check(
        now: int, size: int, idle_since: int | None, state: PolicyState, tenants: int = 0
    ) -> Decision:
        device = DeviceView(TOTAL, max(0, TOTAL - tenants - size - FIXED), size + FIXED)
        view = replace(cache, size_mib=size)
        return decide(now, device, view, BookView(), [], cfg, state, idle_since_ms=idle_since)

    d = check(299_999, FULL, 0, st)
    assert (d.target_mib, d.reason) == (FULL, "steady")
    d = check(300_000, FULL, 0, d.state)
    assert (d.target_mib, d.reason, d.urgent) == (CORE, "idle", True)  # at once
    assert "no request for 300 s" in d.explain
    # what it gives back from a cache at its goal is room that has lasted
    assert d.state.room_since_ms == 300_000 - CFG.elastic_stable_ms
    d = check(301_000, CORE, 0, d.state)
    assert (d.target_mib, d.reason) == (CORE, "idle")
    # a request a moment later: the cache grows back at once, not 5 s later
    grown = check(301_100, CORE, None, d.state)
    assert (grown.target_mib, grown.reason) == (FULL, "room")
    # a program takes the room while nobody asks; when it leaves, that room waits as usual
    d = check(310_000, CORE, 0, d.state, tenants=TOTAL - FIXED - CORE)
    assert d.reason == "idle" and d.state.room_since_ms is None
    d = check(320_000, CORE, 0, d.state)
    assert d.state.room_since_ms == 320_000
    assert check(322_000, CORE, None, d.state).reason == "waiting"
    assert check(325_000, CORE, None, d.state).reason == "room"


def test_idle_release_off_and_while_a_request_runs() -> None:
    never = _one(now=10**9, idle_since_ms=0)
    assert never.reason == "steady"
    cfg = replace(CFG, idle_release_ms=1000)
    d = decide(
        10**9, DeviceView(TOTAL, 500, FULL + FIXED), CacheView(FULL, CORE, MAX, FIXED),
        BookView(), [], cfg, PolicyState.initial(cfg), idle_since_ms=None,
    )  # fmt: skip
    assert d.target_mib == FULL


# --- no monitor: a request shrinks the cache by its amount -------------------------------------


def test_unwatched_requests_shrink_by_exactly_their_amount_and_return_at_once() -> None:
    st = PolicyState.initial(CFG)
    cache = CacheView(10_000, CORE, MAX, FIXED)

    def step(book: BookView, size: int, state: PolicyState, **kw: object) -> Decision:
        return decide_unwatched(0, replace(cache, size_mib=size), book, CFG, state, **kw)

    d = step(BookView(), 10_000, st)
    assert (d.target_mib, d.reason) == (10_000, "steady")
    d = step(BookView(reserve_mib=3000), 10_000, d.state)
    assert (d.target_mib, d.reason, d.urgent) == (7000, "unwatched", True)
    assert "no monitor sees the device" in d.explain and d.room_kept_mib == 3000
    lease = _lease(1, 2000)
    d = step(BookView(reserve_mib=3000, leases=(lease,)), 7000, d.state)
    assert d.target_mib == 5000
    d = step(BookView(reserve_mib=3000, holds={"gamemode": 4000}, leases=(lease,)), 5000, d.state)
    assert d.target_mib == 4000  # the larger of the reserve and the hold, plus the lease
    d = step(BookView(), 4000, d.state)  # everything returned: back at once
    assert (d.target_mib, d.urgent) == (10_000, False)
    d = step(BookView(reserve_mib=20_000), 10_000, d.state)
    assert d.target_mib == CORE  # never below the core
    capped = replace(CFG, vram_max_mib=6000)
    d = decide_unwatched(0, cache, BookView(), capped, st)
    assert d.target_mib == 6000 - FIXED and d.budget.cap_reason == "vram_max"


def test_unwatched_base_counts_what_was_asked_when_the_monitor_failed() -> None:
    # the monitor failed while a 1000 MiB reserve was in force: the cache had already given it
    st = PolicyState.initial(CFG)
    d = decide_unwatched(0, CacheView(9000, CORE, MAX, FIXED), BookView(1000), CFG, st)
    assert d.target_mib == 9000 and d.state.unwatched_base_mib == 9000
    d = decide_unwatched(0, CacheView(9000, CORE, MAX, FIXED), BookView(0), CFG, d.state)
    assert d.target_mib == 10_000  # the reserve cleared: its 1000 MiB come back


def test_unwatched_idle_release() -> None:
    cfg = replace(CFG, idle_release_ms=60_000)
    cache = CacheView(10_000, CORE, MAX, FIXED)
    st = PolicyState.initial(cfg)
    d = decide_unwatched(60_000, cache, BookView(), cfg, st, idle_since_ms=0)
    assert (d.target_mib, d.reason) == (CORE, "idle")
    d = decide_unwatched(60_100, replace(cache, size_mib=CORE), BookView(), cfg, d.state)
    assert d.target_mib == 10_000
