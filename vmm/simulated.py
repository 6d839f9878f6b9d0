"""The simulated VRAM device: a ``VramMonitor`` whose total and other tenants come from a file.

For tests and GPU-less experiments: an integration test starts the daemon with
``vram_monitor = "simulated"`` and rewrites the file to make programs come and go. The format
(JSON; also in ``docs/simulated-vram.md``)::

    {
      "total_mib": 24576,
      "tenants": [{"pid": 4242, "name": "game", "mib": 6000}],
      "per_process": true,
      "failing": false
    }

* ``total_mib`` (required, > 0): the device's memory.
* ``tenants`` (default ``[]``): other programs; ``pid`` (int > 0) and ``mib`` (number >= 0)
  required, ``name`` optional. Several entries may share a PID (summed).
* ``per_process`` (default ``true``): ``false`` simulates a driver that does not report
  per-process usage (``processes`` and ``process_used`` are ``None``).
* ``failing`` (default ``false``): ``true`` simulates NVML failing: the monitor logs one warning,
  turns unhealthy and returns ``None`` from ``sample()`` for good, as the NVML monitor does.
* Any other key is an error (a misspelt key would otherwise be silently ignored).

Arithmetic, per sample: ``ours`` is the caller's callable (the arena's mapped bytes plus the
engine's own allocations); ``used = tenants + ours``; ``free = max(0, total − used)``. The file may
oversubscribe the device (tenants + ours > total): that models a program that took memory before
Strata gave it back; ``free`` is then 0. ``processes`` lists the tenants by PID plus this process
(``os.getpid()``) with ``ours``.

The file is re-read at every ``sample()``, ``process_used()`` and ``try_allocate()`` (it is a few
hundred bytes; comparing its bytes, rather than trusting its mtime, also catches two writes within
one timestamp tick). Write it atomically (a temporary file, then ``os.replace``) so that no reader
sees half of it. At creation a missing or malformed file raises ``MonitorError`` naming the file
and the problem; later, a file that disappears or becomes malformed logs one warning (until it is
good again) and the last good state stays in force.

Refusing allocations, like a driver: ``try_allocate(nbytes)`` says whether ``nbytes`` fit in the
simulated free memory now, and ``commit_guard()`` wraps the host arena's ``commit`` seam with it,
so a grow beyond simulated free stops short exactly as a CUDA arena's grow does on a full GPU::

    monitor = create_monitor("simulated", ours=lambda: arena.mapped_bytes + engine_bytes(), ...)
    arena = HostArena(reserved, chunk, commit=monitor.commit_guard())
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from strata.vmm.errors import MonitorError
from strata.vmm.host_arena import CommitFn
from strata.vmm.monitor import OursFn, ProcessUsage, VramSample, read_ours

log = logging.getLogger(__name__)

MiB = 1 << 20

_KEYS = {"total_mib", "tenants", "per_process", "failing"}
_TENANT_KEYS = {"pid", "name", "mib"}


@dataclass(frozen=True)
class Tenant:
    """Another program on the simulated device."""

    pid: int
    name: str
    used_bytes: int


@dataclass(frozen=True)
class SimulatedState:
    """One good reading of the file."""

    total_bytes: int
    tenants: tuple[Tenant, ...]
    per_process: bool
    failing: bool

    @property
    def tenants_bytes(self) -> int:
        return sum(t.used_bytes for t in self.tenants)


def parse_simulated_file(raw: bytes, path: Path) -> SimulatedState:
    """The state a file's bytes describe, or ``MonitorError`` naming ``path`` and the problem."""

    def bad(what: str) -> MonitorError:
        return MonitorError(f"simulated VRAM file {path}: {what}")

    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad(f"expected a JSON object at the top, got {type(data).__name__}")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise bad(f"unknown key(s) {', '.join(unknown)}; expected {', '.join(sorted(_KEYS))}")
    if "total_mib" not in data:
        raise bad("total_mib is missing")
    total = _mib(data["total_mib"], "total_mib", bad)
    if total <= 0:
        raise bad(f"total_mib must be positive, got {data['total_mib']!r}")
    tenants_raw = data.get("tenants", [])
    if not isinstance(tenants_raw, list):
        raise bad(f"tenants must be a list, got {type(tenants_raw).__name__}")
    tenants = []
    for i, t in enumerate(tenants_raw):
        where = f"tenants[{i}]"
        if not isinstance(t, dict):
            raise bad(f"{where} must be an object, got {type(t).__name__}")
        unknown = sorted(set(t) - _TENANT_KEYS)
        if unknown:
            raise bad(f"{where}: unknown key(s) {', '.join(unknown)}; expected pid, name, mib")
        for key in ("pid", "mib"):
            if key not in t:
                raise bad(f"{where}.{key} is missing")
        pid = t["pid"]
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise bad(f"{where}.pid must be a positive integer, got {pid!r}")
        name = t.get("name", "")
        if not isinstance(name, str):
            raise bad(f"{where}.name must be a string, got {name!r}")
        tenants.append(Tenant(pid, name, _mib(t["mib"], f"{where}.mib", bad)))
    flags = {}
    for key, default in (("per_process", True), ("failing", False)):
        value = data.get(key, default)
        if not isinstance(value, bool):
            raise bad(f"{key} must be true or false, got {value!r}")
        flags[key] = value
    return SimulatedState(total, tuple(tenants), flags["per_process"], flags["failing"])


def _mib(value: object, where: str, bad: Callable[[str], MonitorError]) -> int:
    """Bytes of a non-negative, finite number of MiB (fractions allowed: tests like odd sizes)."""
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise bad(f"{where} must be a non-negative number of MiB, got {value!r}")
    if not math.isfinite(value):
        raise bad(f"{where} must be a finite number of MiB, got {value!r}")
    return round(value * MiB)


class SimulatedMonitor:
    """The simulated device's ``VramMonitor``; see the module docstring."""

    kind = "simulated"
    device_name = "simulated"

    def __init__(self, path: Path, ours: OursFn, *, pid: int | None = None) -> None:
        self.path = Path(path)
        self._ours = ours
        self._pid = os.getpid() if pid is None else pid
        self.healthy = True
        self.problem: str | None = None
        self._lock = threading.Lock()
        try:
            raw = self.path.read_bytes()
        except OSError as e:
            raise MonitorError(
                f"simulated VRAM file {self.path}: cannot read it: {e.strerror or e}"
            ) from None
        self._state = parse_simulated_file(raw, self.path)
        self._raw = raw  # the bytes of the last good state
        self._bad: bytes | None = None  # the bytes of the current bad streak, if in one
        self._warned = False
        if self._state.failing:
            self._fail()

    @property
    def state(self) -> SimulatedState:
        """The last good state of the file (not re-read)."""
        return self._state

    def sample(self) -> VramSample | None:
        state = self._read()
        if not self.healthy:
            return None
        ours = read_ours(self._ours)
        used = state.tenants_bytes + ours
        return VramSample(
            total_bytes=state.total_bytes,
            free_bytes=max(0, state.total_bytes - used),
            used_bytes=used,
            ours_bytes=ours,
            processes=_processes(state, self._pid, ours) if state.per_process else None,
        )

    def process_used(self, pid: int) -> int | None:
        state = self._read()
        if not self.healthy or not state.per_process:
            return None
        ours = read_ours(self._ours) if pid == self._pid else 0
        return sum(t.used_bytes for t in state.tenants if t.pid == pid) + ours

    def free_bytes(self) -> int:
        """The simulated free memory now, from the file's last good state (also while unhealthy:
        a driver goes on allocating when its monitoring fails)."""
        state = self._read()
        return max(0, state.total_bytes - state.tenants_bytes - read_ours(self._ours))

    def try_allocate(self, nbytes: int) -> bool:
        """Whether an allocation of ``nbytes`` fits in the simulated free memory now, as a driver
        would answer. It reserves nothing: the bytes count once ``ours()`` includes them."""
        return nbytes <= self.free_bytes()

    def commit_guard(self, commit: CommitFn | None = None) -> CommitFn:
        """The host arena's ``commit`` seam, refusing with ``ENOMEM`` what does not fit in the
        simulated free memory, then committing through ``commit`` (``os.posix_fallocate``).
        The arena reads ``ENOMEM`` as "no memory for this chunk" and ends the grow short."""
        inner = commit or os.posix_fallocate

        def guarded(fd: int, offset: int, length: int) -> None:
            free = self.free_bytes()
            if length > free:
                raise OSError(
                    errno.ENOMEM,
                    f"simulated device {self.path}: {length} bytes asked, {free} free",
                )
            inner(fd, offset, length)

        return guarded

    def close(self) -> None:
        pass  # nothing held: the file is opened and closed at each read

    def __repr__(self) -> str:
        s = self._state
        return (
            f"SimulatedMonitor({self.path}, total {s.total_bytes // MiB} MiB, "
            f"{len(s.tenants)} tenants, {'healthy' if self.healthy else 'unhealthy'})"
        )

    # -- internals -------------------------------------------------------------------------------

    def _read(self) -> SimulatedState:
        # ours() is called outside the lock: it may take the arena's lock, which a grow holds
        # while it asks commit_guard for room.
        with self._lock:
            return self._refresh()

    def _refresh(self) -> SimulatedState:
        """Re-read the file; keep the last good state if it is unreadable or malformed."""
        raw: bytes | None
        try:
            raw = self.path.read_bytes()
        except OSError as e:
            raw = None
            problem = f"simulated VRAM file {self.path}: cannot read it: {e.strerror or e}"
        else:
            if raw == self._raw:
                self._back_to_good()
                return self._state
            if raw == self._bad:
                return self._state  # the same bad bytes as last time: already warned
            try:
                state = parse_simulated_file(raw, self.path)
            except MonitorError as e:
                problem = str(e)
            else:
                self._state, self._raw = state, raw
                self._back_to_good()
                if state.failing:
                    self._fail()
                return state
        self._bad = raw
        if not self._warned:
            self._warned = True
            s = self._state
            log.warning(
                "%s; keeping its last good state (total %d MiB, %d tenants holding %d MiB)",
                problem,
                s.total_bytes // MiB,
                len(s.tenants),
                s.tenants_bytes // MiB,
            )
        return self._state

    def _back_to_good(self) -> None:
        if self._warned:
            log.info("simulated VRAM file %s is readable again", self.path)
        self._warned = False
        self._bad = None

    def _fail(self) -> None:
        if not self.healthy:
            return
        self.healthy = False
        self.problem = f"simulated VRAM file {self.path} says the device is failing"
        log.warning("%s; VRAM monitoring is off and the cache keeps its size", self.problem)


def _processes(state: SimulatedState, own_pid: int, ours: int) -> tuple[ProcessUsage, ...]:
    """The tenants by PID, plus this process with ``ours``, sorted by PID."""
    per_pid: dict[int, int] = {}
    for t in state.tenants:
        per_pid[t.pid] = per_pid.get(t.pid, 0) + t.used_bytes
    if ours:
        per_pid[own_pid] = per_pid.get(own_pid, 0) + ours
    return tuple(ProcessUsage(pid, used) for pid, used in sorted(per_pid.items()))
