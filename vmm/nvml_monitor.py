"""The NVML VRAM monitor: free, total, used and per-process memory of one CUDA device.

Finding the device. CUDA numbers devices after ``CUDA_VISIBLE_DEVICES`` (``2,0`` makes physical
GPU 2 CUDA device 0); NVML always numbers all of them, in its own order. So an index never
crosses from one to the other: the monitor asks PyTorch for the CUDA device's UUID and PCI bus id,
lists every NVML device's UUID and PCI bus id, and ``find_nvml_index`` matches them (UUID first,
PCI bus id where the UUID is unknown or matches nothing, e.g. a MIG instance, whose memory is then
read for the whole GPU).

Memory. ``nvmlDeviceGetMemoryInfo`` version 2, where the driver and the binding have it: its
``used`` is what processes allocated and leaves out the memory the driver and firmware reserve for
themselves (``reserved``; version 1's ``used`` is ``total − free`` and counts it). The policy reads
``used − ours`` as other programs' memory, and the reserve is nobody's: counting it would make an
idle desktop look like a tenant of several hundred MiB. Where version 2 is missing (older driver
or binding) version 1 is used, said once in the log, and that constant sits in ``tenants_bytes``.
``free`` is the same in both.

Processes. ``nvmlDeviceGetComputeRunningProcesses`` and ``…GraphicsRunningProcesses``. Within one
list a PID's entries are summed (one per MIG instance); across the two lists a PID that has both
a compute and a graphics context is one process whose usage both report, so the larger is taken,
not the sum. Where the driver does not report per-process usage, ``processes`` is ``None``:
unknown is never read as zero. A call that is not supported (or not permitted) decides that for
the monitor's life; an entry whose ``usedGpuMemory`` is ``NVML_VALUE_NOT_AVAILABLE`` (which
pynvml turns into ``None``; Windows WDDM does this) decides it for that sample. NVML reports PIDs
of the host's PID namespace.

Failure. NVML absent (no ``nvidia-ml-py``, no driver library), failing to start, or not finding
the device at creation, or any NVML error at run time: one warning, ``healthy = False``, and
``sample()`` / ``process_used()`` return ``None`` from then on; the daemon keeps the cache at its
size, shrinking it only for explicit requests. No retry: a driver that failed once (GPU lost,
library mismatch after an upgrade) does not come back in the life of the process, and a monitor
that flickers would make the cache flicker with it.

``pynvml`` and ``torch`` are imported when a monitor is created, so this module imports without
them.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

from strata.vmm.errors import MonitorError, VmmError
from strata.vmm.monitor import OursFn, ProcessUsage, VramSample, read_ours

log = logging.getLogger(__name__)

NvmlDevice = tuple[str | None, str | None]
"""``(uuid, pci_bus_id)`` of one NVML device, as NVML writes them (``"GPU-…"``,
``"00000000:19:00.0"``); either may be ``None`` where unknown."""

IdentifyFn = Callable[[int], NvmlDevice]
"""``identify(cuda_index) -> (uuid, pci_bus_id)`` of a CUDA device."""

# NVML error codes (nvml.h) that mean "this driver does not offer the call", not "broken".
_NOT_SUPPORTED = 3
_NO_PERMISSION = 4
_FUNCTION_NOT_FOUND = 13
_ARGUMENT_VERSION_MISMATCH = 25

_PCI_RE = re.compile(
    r"^(?:(?P<domain>[0-9a-f]{1,8}):)?(?P<bus>[0-9a-f]{1,2}):(?P<device>[0-9a-f]{1,2})"
    r"(?:\.(?P<function>[0-9a-f]))?$"
)
_UUID_HEX_RE = re.compile(r"^[0-9a-f]{32}$")


# -- matching ------------------------------------------------------------------------------------


def normalize_uuid(uuid: str) -> str:
    """A device UUID as 32 lower-case hex digits: without NVML's ``GPU-``/``MIG-`` prefix, the
    dashes, or surrounding space. Raises ``MonitorError`` for anything else."""
    s = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if s.startswith(prefix):
            s = s[len(prefix) :]
    s = s.replace("-", "")
    if not _UUID_HEX_RE.match(s):
        raise MonitorError(f"device UUID {uuid!r} is not 32 hex digits (with or without 'GPU-')")
    return s


def normalize_pci(bus_id: str) -> tuple[int, int, int, int]:
    """A PCI bus id as ``(domain, bus, device, function)``. CUDA writes ``0000:19:00.0``, NVML
    ``00000000:19:00.0``, older tools ``19:00.0``; all name the same device."""
    m = _PCI_RE.match(bus_id.strip().lower())
    if m is None:
        raise MonitorError(
            f"PCI bus id {bus_id!r} is not of the form [domain:]bus:device[.function] in hex"
        )
    return (
        int(m["domain"] or "0", 16),
        int(m["bus"], 16),
        int(m["device"], 16),
        int(m["function"] or "0", 16),
    )


def find_nvml_index(
    cuda_uuid: str | None, cuda_pci: str | None, nvml_devices: Sequence[NvmlDevice]
) -> int:
    """The NVML index of the CUDA device whose UUID is ``cuda_uuid`` and PCI bus id ``cuda_pci``.

    ``nvml_devices`` is ``(uuid, pci_bus_id)`` per NVML index. The UUID decides where it matches;
    the PCI bus id is the fallback (unknown or unmatched UUID: a MIG instance has its own UUID
    and its GPU's bus id). Raises ``MonitorError`` naming what was looked for and listing every
    NVML device when nothing matches, or when a bus id matches more than one device.
    """
    if cuda_uuid is None and cuda_pci is None:
        raise MonitorError(
            "cannot find the CUDA device in NVML: neither its UUID nor its PCI bus id is known"
        )
    if cuda_uuid is not None:
        want = normalize_uuid(cuda_uuid)
        hits = [i for i, (u, _) in enumerate(nvml_devices) if u and normalize_uuid(u) == want]
        if len(hits) == 1:
            return hits[0]
        if hits:
            raise MonitorError(
                f"UUID {cuda_uuid} names NVML devices {hits}: {_describe(nvml_devices)}"
            )
    if cuda_pci is not None:
        want_pci = normalize_pci(cuda_pci)
        hits = [i for i, (_, p) in enumerate(nvml_devices) if p and normalize_pci(p) == want_pci]
        if len(hits) == 1:
            return hits[0]
        if hits:
            raise MonitorError(
                f"PCI bus id {cuda_pci} names NVML devices {hits}: {_describe(nvml_devices)}"
            )
    raise MonitorError(
        f"no NVML device has the CUDA device's UUID {cuda_uuid or '(unknown)'} or PCI bus id "
        f"{cuda_pci or '(unknown)'}; NVML has {_describe(nvml_devices)}"
    )


def _describe(devices: Sequence[NvmlDevice]) -> str:
    if not devices:
        return "no devices"
    return ", ".join(
        f"{i}: {u or '(no UUID)'} at {p or '(no bus id)'}" for i, (u, p) in enumerate(devices)
    )


# -- the CUDA side -------------------------------------------------------------------------------


def cuda_identity(device_index: int) -> NvmlDevice:
    """``(uuid, pci_bus_id)`` of CUDA device ``device_index`` as PyTorch numbers it (that is,
    after ``CUDA_VISIBLE_DEVICES``). UUID as ``GPU-…``; bus id as ``dddddddd:bb:dd.0``, from
    PyTorch's device properties or, where PyTorch lacks them, ``cuDeviceGetPCIBusId``."""
    import torch

    if not torch.cuda.is_available():
        raise MonitorError("no CUDA device: torch.cuda.is_available() is False")
    count = torch.cuda.device_count()
    if not 0 <= device_index < count:
        raise MonitorError(f"CUDA device {device_index} does not exist; there are {count}")
    props = torch.cuda.get_device_properties(device_index)
    raw_uuid = getattr(props, "uuid", None)
    uuid = None
    if raw_uuid is not None:
        uuid = str(raw_uuid)
        if not uuid.upper().startswith(("GPU-", "MIG-")):
            uuid = f"GPU-{uuid}"
    domain = getattr(props, "pci_domain_id", None)
    bus = getattr(props, "pci_bus_id", None)
    device = getattr(props, "pci_device_id", None)
    if None not in (domain, bus, device):
        pci: str | None = f"{domain:08x}:{bus:02x}:{device:02x}.0"
    else:
        pci = _driver_pci_bus_id(device_index)
    return uuid, pci


def _driver_pci_bus_id(device_index: int) -> str | None:
    """The bus id through ``cuda.bindings`` (its ordinals follow ``CUDA_VISIBLE_DEVICES`` like
    PyTorch's); ``None`` where that is not installed or fails: the UUID usually suffices."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    ok = driver.CUresult.CUDA_SUCCESS
    if driver.cuInit(0)[0] != ok:
        return None
    err, dev = driver.cuDeviceGet(device_index)
    if err != ok:
        return None
    err, bus_id = driver.cuDeviceGetPCIBusId(32, dev)
    if err != ok:
        return None
    return bytes(bus_id).split(b"\0", 1)[0].decode()


# -- the monitor ---------------------------------------------------------------------------------


class NvmlMonitor:
    """The ``VramMonitor`` of one CUDA device through NVML; see the module docstring.

    ``identify`` and ``nvml`` exist for tests (the CUDA side and the ``pynvml`` module); by default
    ``cuda_identity`` and ``import pynvml``.
    """

    kind = "nvml"

    def __init__(
        self,
        ours: OursFn,
        device_index: int = 0,
        *,
        identify: IdentifyFn | None = None,
        nvml: Any = None,
    ) -> None:
        self._ours = ours
        self.device_index = device_index
        self.device_name = "unavailable"
        self.uuid: str | None = None
        """NVML's UUID of the device watched (``GPU-…``); ``None`` where none was found."""
        self.memory_info_version = 2
        self.healthy = True
        self.problem: str | None = None
        self._nvml: Any = None
        self._errors: tuple[type[BaseException], ...] = ()
        self._handle: Any = None
        self._per_process = True
        self._said_unreported = False
        self._initialized = False
        self._lock = threading.Lock()
        where = f"CUDA device {device_index}"
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError as e:
                from strata.hints import install_hint

                self._fail(
                    f"VRAM monitor nvml on {where}: cannot import pynvml, from the nvidia-ml-py "
                    f"package ({e}); {install_hint('nvidia-ml-py')}"
                )
                return
        try:
            self._nvml = nvml
            self._errors = _nvml_errors(nvml)
            nvml.nvmlInit()
            self._initialized = True
            uuid, pci = (identify or cuda_identity)(device_index)
            devices = [_nvml_identity(nvml, i) for i in range(nvml.nvmlDeviceGetCount())]
            index = find_nvml_index(uuid, pci, devices)
            self._handle = nvml.nvmlDeviceGetHandleByIndex(index)
            self.uuid = devices[index][0]
            self.device_name = _text(nvml.nvmlDeviceGetName(self._handle))
            where = f"CUDA device {device_index} (NVML {index}, {self.uuid})"
            self._probe_memory_info()
        except (OSError, RuntimeError, VmmError, *self._errors) as e:
            # Never a crash (issue 5): without NVML the daemon runs with a fixed-size cache.
            self._fail(f"VRAM monitor nvml on {where}: {_error_text(e)}")
            return
        log.info(
            "VRAM monitor nvml: %s, %s, NVML memory info v%d",
            where,
            self.device_name,
            self.memory_info_version,
        )

    def sample(self) -> VramSample | None:
        if not self.healthy:
            return None
        try:
            mem = self._memory_info()
            ours = read_ours(self._ours)  # right after NVML's reading: the two are not atomic
            processes = self._processes()
        except self._errors as e:
            self._fail(f"VRAM monitor nvml on {self.device_name}: {_error_text(e)}")
            return None
        return VramSample(
            total_bytes=int(mem.total),
            free_bytes=int(mem.free),
            used_bytes=int(mem.used),
            ours_bytes=ours,
            processes=processes,
        )

    def process_used(self, pid: int) -> int | None:
        if not self.healthy:
            return None
        try:
            processes = self._processes()
        except self._errors as e:
            self._fail(f"VRAM monitor nvml on {self.device_name}: {_error_text(e)}")
            return None
        if processes is None:
            return None
        return sum(p.used_bytes for p in processes if p.pid == pid)

    def close(self) -> None:
        with self._lock:
            if not self._initialized:
                return
            self._initialized = False
            if self.healthy:
                self.healthy = False
                self.problem = "closed"
        try:
            self._nvml.nvmlShutdown()  # NVML counts inits, so other users in the process go on
        except self._errors as e:
            log.debug("nvmlShutdown: %s", _error_text(e))

    def __repr__(self) -> str:
        state = "healthy" if self.healthy else f"unhealthy: {self.problem}"
        return f"NvmlMonitor(cuda:{self.device_index}, {self.device_name}, {state})"

    # -- internals -------------------------------------------------------------------------------

    def _probe_memory_info(self) -> None:
        """Use version 2 where both the binding and the driver have it (see module docstring)."""
        nvml = self._nvml
        if not hasattr(nvml, "nvmlMemory_v2"):
            self._use_memory_v1("pynvml has no nvmlMemory_v2")
            return
        try:
            nvml.nvmlDeviceGetMemoryInfo(self._handle, version=nvml.nvmlMemory_v2)
        except TypeError as e:  # a binding whose nvmlDeviceGetMemoryInfo takes no version
            self._use_memory_v1(str(e))
        except self._errors as e:
            if _code(e) not in (_FUNCTION_NOT_FOUND, _NOT_SUPPORTED, _ARGUMENT_VERSION_MISMATCH):
                raise
            self._use_memory_v1(_error_text(e))

    def _use_memory_v1(self, why: str) -> None:
        self.memory_info_version = 1
        log.info(
            "NVML memory info v2 unavailable (%s): using v1, whose 'used' includes the driver's "
            "reserved memory",
            why,
        )

    def _memory_info(self) -> Any:
        if self.memory_info_version == 2:
            return self._nvml.nvmlDeviceGetMemoryInfo(
                self._handle, version=self._nvml.nvmlMemory_v2
            )
        return self._nvml.nvmlDeviceGetMemoryInfo(self._handle)

    def _processes(self) -> tuple[ProcessUsage, ...] | None:
        if not self._per_process:
            return None
        nvml = self._nvml
        merged: dict[int, int] = {}
        for call in (
            "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetGraphicsRunningProcesses",
        ):
            try:
                entries = getattr(nvml, call)(self._handle)
            except self._errors as e:
                if _code(e) in (_NOT_SUPPORTED, _NO_PERMISSION, _FUNCTION_NOT_FOUND) or (
                    _code(e) is None and type(e).__name__ == "NVMLLibraryMismatchError"
                ):
                    # The driver cannot do it, and will not in a second either: decided once.
                    self._per_process = False
                    return self._unreported(f"{call}: {_error_text(e)}")
                raise
            per_list: dict[int, int] = {}
            for entry in entries or ():
                used = entry.usedGpuMemory
                if used is None:
                    # This sample only: one process's usage unknown makes the whole list
                    # unreliable (its PID would read as holding nothing).
                    return self._unreported(f"{call}: no usedGpuMemory for PID {entry.pid}")
                per_list[int(entry.pid)] = per_list.get(int(entry.pid), 0) + int(used)
            for pid, used in per_list.items():
                merged[pid] = max(merged.get(pid, 0), used)
        return tuple(ProcessUsage(pid, used) for pid, used in sorted(merged.items()))

    def _unreported(self, why: str) -> None:
        if not self._said_unreported:
            self._said_unreported = True
            log.info(
                "NVML does not report per-process memory (%s); leases fall back to tenant growth",
                why,
            )
        return None

    def _fail(self, problem: str) -> None:
        with self._lock:
            if not self.healthy:
                return
            self.healthy = False
            self.problem = problem
        log.warning("%s; VRAM monitoring is off and the cache keeps its size", problem)


def _nvml_identity(nvml: Any, index: int) -> NvmlDevice:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    uuid = _text(nvml.nvmlDeviceGetUUID(handle))
    pci = _text(nvml.nvmlDeviceGetPciInfo(handle).busId)
    return uuid or None, pci or None


def _nvml_errors(nvml: Any) -> tuple[type[BaseException], ...]:
    """The exception classes NVML calls raise: ``NVMLError`` (and its per-code subclasses) and
    the unrelated ``NVMLLibraryMismatchError`` of unversioned calls on an older library."""
    names = ("NVMLError", "NVMLLibraryMismatchError")
    found = (getattr(nvml, n, None) for n in names)
    return tuple(c for c in found if isinstance(c, type) and issubclass(c, BaseException))


def _code(e: BaseException) -> int | None:
    value = getattr(e, "value", None)
    return value if isinstance(value, int) else None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _error_text(e: BaseException) -> str:
    code = _code(e)
    suffix = f" (NVML error {code})" if code is not None else ""
    return f"{type(e).__name__}: {e}{suffix}"
