"""What the bench reads beside the engine: peak RSS, VRAM through NVML, and the two bandwidths
the memory roofline is drawn with (device memory and PCIe), measured with large torch copies."""

from __future__ import annotations

import logging
import resource
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from strata.vmm.monitor import VramMonitor

log = logging.getLogger(__name__)

MiB = 2**20
NVML_PERIOD_S = 0.01
DEVICE_COPY_BYTES = 1 << 30
PCIE_COPY_BYTES = 512 * MiB
COPY_REPS = 5


# -- RSS ---------------------------------------------------------------------------------------


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS; False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    """VmHWM from /proc/self/status, else getrusage's ru_maxrss (KiB on Linux)."""
    kib = _status_kib("VmHWM")
    if kib is None:
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024


def rss_parts() -> dict[str, int | None]:
    """Current anonymous and file-backed RSS: the mapped GGUF's pages count as RSS too."""
    anon, file = _status_kib("RssAnon"), _status_kib("RssFile")
    return {
        "rss_anon_bytes": None if anon is None else anon * 1024,
        "rss_file_bytes": None if file is None else file * 1024,
    }


# -- VRAM --------------------------------------------------------------------------------------


class VramPeak:
    """Polls a healthy NVML monitor in a thread and keeps the highest ``used`` seen since the
    last ``reset``. Device-wide: it assumes no other program changes its VRAM meanwhile."""

    def __init__(self, monitor: VramMonitor, period_s: float = NVML_PERIOD_S) -> None:
        self.monitor = monitor
        self.period_s = period_s
        self._peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="bench-nvml", daemon=True)
        self._thread.start()

    def used(self) -> int | None:
        s = self.monitor.sample()
        return None if s is None else s.used_bytes

    def free(self) -> int | None:
        s = self.monitor.sample()
        return None if s is None else s.free_bytes

    def reset(self) -> None:
        with self._lock:
            self._peak = self.used() or 0

    def peak(self) -> int | None:
        now = self.used()
        if now is None:
            return None
        with self._lock:
            self._peak = max(self._peak, now)
            return self._peak

    def _poll(self) -> None:
        while not self._stop.wait(self.period_s):
            now = self.used()
            if now is None:
                return
            with self._lock:
                self._peak = max(self._peak, now)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def open_nvml(device: torch.device) -> tuple[VramMonitor | None, str | None]:
    """An NVML monitor of ``device`` (found by UUID), or None and the reason."""
    if device.type != "cuda":
        return None, "CPU run: no VRAM"
    from strata.vmm.nvml_monitor import NvmlMonitor

    monitor = NvmlMonitor(lambda: 0, device.index or 0)
    if not monitor.healthy:
        return None, f"NVML unavailable: {monitor.problem}"
    return monitor, None


# -- bandwidths --------------------------------------------------------------------------------


def _timed_copies(dst: torch.Tensor, src: torch.Tensor, reps: int) -> list[float]:
    """Seconds of each of ``reps`` copies src -> dst (after one untimed), by CUDA events."""
    dst.copy_(src, non_blocking=True)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def measure_bandwidths(device: torch.device) -> dict[str, Any]:
    """Device-memory copy bandwidth (bytes read + written per second) and host-to-device
    bandwidth from pinned and from pageable memory, medians of ``COPY_REPS`` copies each; the
    raw seconds are kept. Null with the reason on a CPU."""
    if device.type != "cuda":
        return {"reason": "CPU run: no device memory and no PCIe transfers to measure"}
    out: dict[str, Any] = {"reps": COPY_REPS}
    src = torch.empty(DEVICE_COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = _timed_copies(dst, src, COPY_REPS)
    # a device-to-device copy reads and writes every byte
    out["device"] = {"bytes": 2 * DEVICE_COPY_BYTES, "seconds": times}
    out["device_bytes_per_s"] = 2 * DEVICE_COPY_BYTES / statistics.median(times)
    del src, dst
    dev = torch.empty(PCIE_COPY_BYTES, dtype=torch.uint8, device=device)
    pinned = torch.ones(PCIE_COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    times = _timed_copies(dev, pinned, COPY_REPS)
    out["pcie_pinned"] = {"bytes": PCIE_COPY_BYTES, "seconds": times}
    out["pcie_bytes_per_s"] = PCIE_COPY_BYTES / statistics.median(times)
    del pinned
    # what a miss costs today: the engine uploads from the mapped file (pageable memory)
    pageable = torch.ones(PCIE_COPY_BYTES, dtype=torch.uint8)
    t = []
    for _ in range(COPY_REPS):
        t0 = time.perf_counter()
        dev.copy_(pageable)
        torch.cuda.synchronize(device)
        t.append(time.perf_counter() - t0)
    out["pcie_pageable"] = {"bytes": PCIE_COPY_BYTES, "seconds": t}
    out["pcie_pageable_bytes_per_s"] = PCIE_COPY_BYTES / statistics.median(t)
    del pageable, dev
    torch.cuda.empty_cache()
    empty_host = getattr(torch._C, "_host_emptyCache", None)
    if empty_host is not None:
        empty_host()  # give the pinned buffer back to the OS, not to torch's host cache
    log.info(
        "bandwidths: device %.0f GB/s, PCIe pinned %.1f GB/s, pageable %.1f GB/s",
        out["device_bytes_per_s"] / 1e9,
        out["pcie_bytes_per_s"] / 1e9,
        out["pcie_pageable_bytes_per_s"] / 1e9,
    )
    return out
