"""The lease book: every explicit claim on VRAM, in one place (architecture §3).

Three ways to ask Strata for VRAM end here:

* the **run-time reserve** (``strata-ctl reserve``, ``POST /v1/vram``, D-Bus ``SetReserve``);
* **leases** (D-Bus ``Borrow`` → cookie, ``Return``; ``Revoke`` for the user's own tools), each
  owned by a bus name (or ``"http"``) and returned when that owner vanishes;
* **holds** from other sources, by name (``"gamemode"`` while Feral GameMode reports a game).

The book is plain bookkeeping: ints and names, no clock reads (the caller passes ``since_us``), no
I/O, no locking (the service calls it from its one asyncio loop). ``daemon.policy`` reads it
through :meth:`LeaseBook.view`, an immutable snapshot.

Every error is a :class:`LeaseError` whose message names the values involved; each class carries
the D-Bus error name the ``ipc`` layer maps it to.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

# D-Bus carries cookies as uint32 ('u'), so the book never hands out a larger one.
COOKIE_MAX = 0xFFFF_FFFF
# Every size the book takes fits what the status carries (int64 sums of many of them) and is far
# beyond any device: 2^32 MiB = 4 PiB.
MAX_MIB = 2**32
MAX_TEXT = 256  # longest app id and reason, in characters (they travel in every status)
MAX_LEASES_PER_OWNER = 16
MAX_LEASES = 64


class LeaseError(Exception):
    """Base of every error the lease book (and the service's VRAM API) raises on purpose."""

    dbus_name = "org.strata.Error.Failed"


class InvalidArgument(LeaseError, ValueError):
    """A value the API rejects: zero, negative, not a whole number, an empty name."""

    dbus_name = "org.strata.Error.InvalidArgument"


class NotEnoughVram(LeaseError):
    """A request larger than Strata could ever free, whatever the other programs do."""

    dbus_name = "org.strata.Error.NotEnoughVram"

    def __init__(self, requested_mib: int, max_freeable_mib: int, why: str | None = None) -> None:
        why = why or "device total - the expert cache's core - the engine's own memory"
        super().__init__(
            f"cannot free {requested_mib} MiB: at most {max_freeable_mib} MiB can ever be freed "
            f"({why})"
        )
        self.requested_mib = requested_mib
        self.max_freeable_mib = max_freeable_mib


class NoDevice(LeaseError):
    """Nothing Strata could do would make VRAM free: it watches no GPU and holds no cache in
    one (the CPU, or a monitor that failed before the cache existed)."""

    dbus_name = "org.strata.Error.NoDevice"


class LeaseNotFound(LeaseError):
    """No lease with that cookie (never granted, already returned, or revoked)."""

    dbus_name = "org.strata.Error.LeaseNotFound"

    def __init__(self, cookie: object) -> None:
        super().__init__(f"no lease with cookie {cookie!r}")
        self.cookie = cookie


class NotOwner(LeaseError):
    """The lease exists but belongs to another owner; nothing was changed."""

    dbus_name = "org.strata.Error.NotOwner"

    def __init__(self, cookie: int, caller: str, owner: str) -> None:
        super().__init__(f"lease {cookie} belongs to {owner!r}, not to {caller!r}")
        self.cookie = cookie
        self.caller = caller
        self.owner = owner


class Timeout(LeaseError):
    """The room did not exist within the allowed time (raised by the service, not the book)."""

    dbus_name = "org.strata.Error.Timeout"


def is_int(value: object) -> bool:
    """A whole number that is not a bool (``True`` must never become 1 MiB)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _mib(name: str, value: Any, *, positive: bool) -> int:
    if not is_int(value) or value < (1 if positive else 0):
        need = "a positive" if positive else "a non-negative"
        raise InvalidArgument(f"{name}: expected {need} whole number of MiB, got {_shown(value)}")
    if value > MAX_MIB:
        raise InvalidArgument(f"{name}: {value} MiB is beyond the limit of {MAX_MIB} MiB")
    return value


def _shown(value: Any, limit: int = 60) -> str:
    """A caller's value in a message, cut: an error never echoes a large input back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{name}: expected text, got {_shown(value)}")
    if len(value) > MAX_TEXT:
        raise InvalidArgument(f"{name}: {len(value)} characters, at most {MAX_TEXT} are allowed")
    return value


@dataclass(frozen=True)
class Lease:
    """One granted lease. ``mib`` is what the borrower asked for, kept free for it until it
    returns the lease; ``tenant_used_at_borrow_mib`` (other programs' VRAM use when the lease was
    granted) lets the policy estimate the borrower's allocation where the driver reports no
    per-process usage."""

    cookie: int
    owner: str
    pid: int | None
    app_id: str
    reason: str
    mib: int
    since_us: int
    tenant_used_at_borrow_mib: int | None


@dataclass(frozen=True)
class BookView:
    """An immutable snapshot of the book, what ``daemon.policy.decide`` reads."""

    reserve_mib: int = 0
    holds: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    leases: tuple[Lease, ...] = ()

    @property
    def borrowed_mib(self) -> int:
        return sum(lease.mib for lease in self.leases)


class Cookies:
    """What the books of several devices share: one cookie sequence (a cookie names one lease
    of the daemon, whichever device it is on, so ``Return(cookie)`` needs no device) and the
    limits on leases, counted over every book (per caller and in all)."""

    def __init__(self) -> None:
        self.last = 0
        self.books: list[LeaseBook] = []

    def count(self, owner: str | None = None) -> int:
        """Leases held in all the books (``owner``'s only, when given)."""
        return sum(
            1
            for book in self.books
            for lease in book._leases.values()
            if owner is None or lease.owner == owner
        )


class LeaseBook:
    """The run-time reserve, the holds by source and the leases by cookie.

    Cookies start at 1, increase by one per lease and are never reused for the life of the
    book, so a stale cookie can never return somebody else's lease. Books of several devices
    share their :class:`Cookies` (pass the same one to each): the sequence and the limits are
    then the daemon's, not one device's.
    """

    def __init__(self, cookies: Cookies | None = None) -> None:
        self._reserve_mib = 0
        self._holds: dict[str, int] = {}
        self._leases: dict[int, Lease] = {}
        self._cookies = cookies if cookies is not None else Cookies()
        self._cookies.books.append(self)

    # --- the run-time reserve and holds -------------------------------------------------------

    @property
    def reserve_mib(self) -> int:
        return self._reserve_mib

    @property
    def holds(self) -> dict[str, int]:
        """A copy: change holds through :meth:`set_hold` and :meth:`clear_hold`."""
        return dict(self._holds)

    def set_reserve(self, mib: int) -> None:
        """Set the run-time reserve (0 clears it). Check it against the device with
        :meth:`check_request` first (``allow_zero=True``)."""
        self._reserve_mib = _mib("reserve", mib, positive=False)

    def set_hold(self, source: str, mib: int) -> None:
        """Hold ``mib`` free on behalf of ``source`` (e.g. ``"gamemode"``), replacing its hold."""
        if not isinstance(source, str) or not source:
            raise InvalidArgument(f"hold source: expected a non-empty name, got {_shown(source)}")
        self._holds[source] = _mib(f"hold {source!r}", mib, positive=False)

    def clear_hold(self, source: str) -> bool:
        """Drop the hold of ``source``; False if it held nothing (not an error: idempotent)."""
        return self._holds.pop(source, None) is not None

    # --- leases -------------------------------------------------------------------------------

    def add(
        self,
        owner: str,
        pid: int | None,
        app_id: str,
        reason: str,
        mib: int,
        since_us: int,
        tenant_used_mib: int | None,
    ) -> Lease:
        """Record a lease and return it with its new cookie."""
        _mib("lease size", mib, positive=True)
        if not isinstance(owner, str) or not owner:
            raise InvalidArgument(f"owner: expected a non-empty name, got {_shown(owner)}")
        if pid is not None and (not is_int(pid) or pid <= 0):
            raise InvalidArgument(f"pid: expected a positive process id or none, got {pid!r}")
        _text("app_id", app_id)
        _text("reason", reason)
        mine = self._cookies.count(owner)
        if mine >= MAX_LEASES_PER_OWNER:
            raise LeaseError(
                f"{owner} holds {mine} leases already, at most {MAX_LEASES_PER_OWNER} are "
                "allowed per caller: return one first"
            )
        held = self._cookies.count()
        if held >= MAX_LEASES:
            raise LeaseError(f"{held} leases are held, at most {MAX_LEASES} in all")
        if not is_int(since_us) or since_us < 0:
            raise InvalidArgument(f"since_us: expected Unix microseconds, got {since_us!r}")
        if tenant_used_mib is not None:
            _mib("tenant usage at borrow", tenant_used_mib, positive=False)
        if self._cookies.last >= COOKIE_MAX:
            raise LeaseError(f"all {COOKIE_MAX} lease cookies of this daemon's life are used")
        self._cookies.last += 1
        cookie = self._cookies.last
        lease = Lease(cookie, owner, pid, app_id, reason, mib, since_us, tenant_used_mib)
        self._leases[lease.cookie] = lease
        return lease

    def remove(self, cookie: int, owner: str | None) -> Lease:
        """Return (``owner`` given: only its own lease) or revoke (``owner`` None: any lease)."""
        if not is_int(cookie):
            raise InvalidArgument(f"cookie: expected a whole number, got {cookie!r}")
        lease = self._leases.get(cookie)
        if lease is None:
            raise LeaseNotFound(cookie)
        if owner is not None and owner != lease.owner:
            raise NotOwner(cookie, owner, lease.owner)
        del self._leases[cookie]
        return lease

    def owner_vanished(self, owner: str) -> list[Lease]:
        """Remove and return every lease of ``owner`` (its bus connection went away)."""
        gone = [lease for lease in self._leases.values() if lease.owner == owner]
        for lease in gone:
            del self._leases[lease.cookie]
        return gone

    def get(self, cookie: int) -> Lease | None:
        return self._leases.get(cookie)

    def leases(self) -> list[Lease]:
        """The leases in the order they were granted."""
        return sorted(self._leases.values(), key=lambda lease: lease.cookie)

    @property
    def borrowed_mib(self) -> int:
        return sum(lease.mib for lease in self._leases.values())

    def view(self) -> BookView:
        return BookView(
            self._reserve_mib, MappingProxyType(dict(self._holds)), tuple(self.leases())
        )

    # --- admission ----------------------------------------------------------------------------

    @staticmethod
    def check_request(mib: int, max_freeable_mib: int, *, allow_zero: bool = False) -> None:
        """Refuse a request (lease or reserve) that is not a positive whole number of MiB, or that
        is larger than Strata could ever free. ``allow_zero`` admits 0 (clearing the reserve).

        Each request is checked on its own: several leases that together exceed what can be
        freed are each admitted, and the later ones wait (and time out) until others return.
        """
        _mib("requested size", mib, positive=not allow_zero)
        if mib > max_freeable_mib:
            raise NotEnoughVram(mib, max_freeable_mib)


def max_freeable_mib(device_total_mib: int, core_mib: int, engine_fixed_mib: int) -> int:
    """The most Strata can ever free: device total - the cache's core - the engine's fixed memory
    (never negative). Other programs' usage does not count: they may exit. Pass as the total what
    processes can hold (NVML used + free), not the memory the driver keeps for itself."""
    for name, value in (
        ("device_total_mib", device_total_mib),
        ("core_mib", core_mib),
        ("engine_fixed_mib", engine_fixed_mib),
    ):
        if not is_int(value) or value < 0:
            raise ValueError(f"{name}: expected a non-negative whole number of MiB, got {value!r}")
    return max(0, device_total_mib - core_mib - engine_fixed_mib)
