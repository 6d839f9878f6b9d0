"""VRAM monitors: what the device holds, what Strata holds, and what everyone else holds.

``VramMonitor`` is the protocol the daemon's control loop programs against. Three kinds, chosen by
configuration (``vram_monitor``) through ``create_monitor``, never by sniffing the machine:

* ``"nvml"`` (``vmm/nvml_monitor.py``): the real device through NVML (``pynvml``), its handle found
  from the CUDA device's UUID or PCI bus id, never by index;
* ``"simulated"`` (``vmm/simulated.py``): a device whose total and other tenants come from a small
  JSON file (``docs/simulated-vram.md``), for tests and GPU-less experiments;
* ``"none"`` (``NoneMonitor``, here): no GPU; ``sample()`` is always ``None``.

What counts as *ours* is never the monitor's guess and never the policy's target: the caller passes
``ours``, a callable returning the bytes Strata actually holds on the device right now (the arena's
mapped bytes plus the engine's own allocations). The policy reacts to ``tenants_bytes`` (used −
ours), so Strata's own activations and K/V never look like another program arriving.

Failure at run time is not an exception: a monitor whose source stops answering logs one warning,
sets ``healthy = False`` and from then on returns ``None`` from ``sample()``; the daemon then keeps
the cache at its size, shrinking it only for explicit requests. ``problem`` says why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from strata.vmm.errors import MonitorError

MONITOR_KINDS = ("nvml", "simulated", "none")

OursFn = Callable[[], int]
"""``ours()``: the bytes Strata itself holds on the device now (arena mapped + engine's own)."""


@dataclass(frozen=True)
class ProcessUsage:
    """One process's memory on the device, as the driver reports it."""

    pid: int
    used_bytes: int


@dataclass(frozen=True)
class VramSample:
    """One reading of the device.

    ``used_bytes`` is memory allocated by processes (Strata included); memory the driver or
    firmware keeps for itself is in neither ``used`` nor ``free``, so ``used + free <= total``.
    ``processes`` is ``None`` where the driver does not report per-process usage; otherwise one
    entry per PID (ours included), sorted by PID.
    """

    total_bytes: int
    free_bytes: int
    used_bytes: int
    ours_bytes: int
    processes: tuple[ProcessUsage, ...] | None

    @property
    def tenants_bytes(self) -> int:
        """What the device's other programs hold: used − ours, never negative (the two readings
        are not atomic, so a resize between them can make the difference dip below zero)."""
        return max(0, self.used_bytes - self.ours_bytes)

    def process_used(self, pid: int) -> int | None:
        """``pid``'s bytes in this sample: ``None`` where per-process usage is not reported, 0 for
        a PID the driver does not list."""
        if self.processes is None:
            return None
        return sum(p.used_bytes for p in self.processes if p.pid == pid)


@runtime_checkable
class VramMonitor(Protocol):
    kind: str
    """``"nvml"``, ``"simulated"`` or ``"none"``."""
    device_name: str
    """The device as the user knows it: ``"NVIDIA H200"``, ``"simulated"``, ``"none"``
    (``"unavailable"`` for an NVML monitor that could not find its device)."""
    healthy: bool
    """False once the monitor has failed; ``sample()`` then returns ``None`` for good."""
    problem: str | None
    """Why the monitor is unhealthy (the text of its one warning); ``None`` while healthy."""

    def sample(self) -> VramSample | None:
        """Read the device now; ``None`` for kind ``"none"`` and once unhealthy. Never raises for
        a driver or file problem at run time."""
        ...

    def process_used(self, pid: int) -> int | None:
        """``pid``'s bytes on the device now: ``None`` where not reported (or unhealthy), 0 for a
        process that holds nothing there."""
        ...

    def close(self) -> None:
        """Release the monitor's resources. Idempotent."""
        ...


class NoneMonitor:
    """The monitor of a machine without a GPU: reports nothing, fails never."""

    kind = "none"
    device_name = "none"

    def __init__(self) -> None:
        self.healthy = True
        self.problem: str | None = None

    def sample(self) -> VramSample | None:
        return None

    def process_used(self, pid: int) -> int | None:
        return None

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return "NoneMonitor()"


def read_ours(ours: OursFn) -> int:
    """Call ``ours`` and check it returned what it must: a non-negative int of bytes."""
    value = ours()
    # bool is an int in Python; a True here would be a bug upstream, not one byte.
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise MonitorError(f"ours() returned {value!r}; expected a non-negative int of bytes")
    return value


def create_monitor(
    kind: str,
    *,
    ours: OursFn,
    device_index: int = 0,
    simulated_file: Path | None = None,
) -> VramMonitor:
    """The VRAM monitor of the configured ``kind``.

    ``ours`` is read at every sample. ``device_index`` is the CUDA device (as PyTorch numbers it,
    after ``CUDA_VISIBLE_DEVICES``) that the ``nvml`` monitor watches; ``simulated_file`` is the
    ``simulated`` monitor's file. Raises ``MonitorError`` for an unknown kind, a ``simulated`` kind
    without a file, or a missing or malformed file. An ``nvml`` monitor never raises here: where
    NVML is absent or cannot find the device it logs one warning and comes back unhealthy.
    """
    if kind == "none":
        return NoneMonitor()
    if kind == "simulated":
        if simulated_file is None:
            raise MonitorError(
                "the simulated VRAM monitor needs a file (simulated_vram_file); none was given"
            )
        from strata.vmm.simulated import SimulatedMonitor

        return SimulatedMonitor(Path(simulated_file), ours)
    if kind == "nvml":
        from strata.vmm.nvml_monitor import NvmlMonitor

        return NvmlMonitor(ours, device_index)
    choices = ", ".join(repr(k) for k in MONITOR_KINDS)
    raise MonitorError(f"VRAM monitor {kind!r} is not one of {choices}")
