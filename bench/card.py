"""``strata bench --card-gib N``: emulate a smaller card on a large GPU by filling the rest.

:class:`CardFiller` allocates the device's free memory less N GiB, in a few chunks it keeps, so
that what loads after it (Strata's engine, then the separate ``llama-bench`` processes) sees N
GiB free. Free memory is measured *after* filling (Strata's CUDA context and any allocator
overhead count as used): a fill that lands more than ``TOLERANCE`` away from N is corrected once,
by a top-up chunk (too much free) or by shrinking the last chunks (too little). Capacity only:
the host's PCIe link and RAM stay the real machine's.

The filler's memory comes from the CUDA driver (``cuMemAlloc`` on the primary context, the one
torch uses), not from torch's caching allocator: so torch's own counters, which the bench reports
as Strata's peak (``torch_peak_allocated_bytes``), never include it, and ``empty_cache`` never
touches it. The device is behind :class:`DeviceMemory`, so tests inject a fake one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from strata.bench.settings import BenchError, GiB, MiB

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

TOLERANCE = 256 * MiB  # how far the free memory after filling may be from N GiB
CHUNK = 16 * GiB  # the filler's largest single allocation
ALIGN = 2 * MiB  # chunk sizes are multiples of this (the driver's page size for large blocks)
FLAG = "--card-gib"


class DeviceMemory(Protocol):
    """What the filler needs of a device: its free and total bytes, and byte blocks."""

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the whole device, as the driver sees them now."""
        ...

    def alloc(self, nbytes: int) -> object:
        """A block of ``nbytes``; raises ``MemoryError`` when the device has not that much."""
        ...

    def free(self, block: object) -> None:
        """Give ``block`` back to the device."""
        ...


def _align_down(n: int) -> int:
    return max(0, n) // ALIGN * ALIGN


def _align_up(n: int) -> int:
    return -(-max(0, n) // ALIGN) * ALIGN


class CardFiller:
    """Holds the device's free memory less ``gib`` GiB from :meth:`fill` until :meth:`release`
    (or the end of its ``with`` block); :meth:`report` is what the bench records."""

    def __init__(self, gib: float, memory: DeviceMemory) -> None:
        if not gib > 0:
            raise BenchError(f"{FLAG}: invalid value {gib!r} (expected GiB > 0)")
        self.gib = gib
        self.target = int(gib * GiB)  # the free bytes asked for
        self.memory = memory
        self._blocks: list[tuple[int, object]] = []  # (bytes, block), in allocation order
        self.free_before: int | None = None
        self.total: int | None = None
        self.free_after: int | None = None
        self.adjusted: str | None = None  # "grew" or "shrank" when the one correction ran
        self._refused: str | None = None  # the device's last refusal of a chunk

    @property
    def held_bytes(self) -> int:
        return sum(n for n, _ in self._blocks)

    def __enter__(self) -> CardFiller:
        self.fill()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def fill(self) -> None:
        """Allocate free − N GiB, measure, correct once. Raises ``BenchError`` (holding
        nothing) when N is more than the device has free now, or when the free memory is still
        outside the tolerance after the correction (the device refused the allocations)."""
        assert not self._blocks, "fill() twice"
        free, total = self.memory.mem_get_info()
        self.free_before, self.total = free, total
        if self.target > free:
            raise BenchError(
                f"{FLAG}: invalid value {self.gib:g}: {self.gib:g} GiB is more than the device's "
                f"free memory now ({free / GiB:.2f} GiB free of {total / GiB:.2f} GiB)"
            )
        try:
            self._take(_align_down(free - self.target))
            self.free_after, self.adjusted = self._correct()
            if abs(self.free_after - self.target) > TOLERANCE:
                why = f": {self._refused}" if self._refused else ""
                raise BenchError(
                    f"{FLAG}: invalid value {self.gib:g}: cannot leave {self.gib:g} GiB free: "
                    f"{self.free_after / GiB:.2f} GiB free after filling "
                    f"{self.held_bytes / GiB:.2f} GiB and correcting once{why}"
                )
        except BaseException:
            self.release()
            raise
        log.info(
            "card of %g GiB: the filler holds %.2f GiB, %.2f GiB free (of %.2f GiB)",
            self.gib, self.held_bytes / GiB, self.free_after / GiB, total / GiB,
        )  # fmt: skip

    def recheck(self) -> dict[str, Any]:
        """Correct the fill once more (before llama-bench: Strata's engine may have left some
        memory taken, or freed some of its context's); what it found, for the report."""
        out: dict[str, Any] = {"error": None}
        try:
            out["free_bytes"], out["adjusted"] = self._correct()
        except BenchError as e:  # the fill stays as it was: say so, keep the measurements
            log.warning("%s", e)
            out["free_bytes"], out["adjusted"] = self.memory.mem_get_info()[0], None
            out["error"] = str(e)
        out["filler_bytes"] = self.held_bytes
        out["within_tolerance"] = abs(out["free_bytes"] - self.target) <= TOLERANCE
        return out

    def _correct(self) -> tuple[int, str | None]:
        """Measure the free memory and bring it within ``TOLERANCE`` of N GiB, once: grow by a
        top-up chunk, or shrink the last chunks. Returns the free bytes measured after and what
        was done; a result still outside the tolerance is logged (the report says so too)."""
        free, _ = self.memory.mem_get_info()
        if free > self.target + TOLERANCE:
            self._take(_align_down(free - self.target))
            adjusted = "grew"
        elif free < self.target - TOLERANCE:
            self._give(_align_up(self.target - free))
            adjusted = "shrank"
        else:
            return free, None
        free, _ = self.memory.mem_get_info()
        if abs(free - self.target) > TOLERANCE:
            log.warning(
                "%s %g: %.2f GiB free after one correction (the filler holds %.2f GiB)",
                FLAG, self.gib, free / GiB, self.held_bytes / GiB,
            )  # fmt: skip
        return free, adjusted

    def _take(self, nbytes: int) -> None:
        """Allocate up to ``nbytes`` more in chunks, none larger than ``CHUNK`` nor than what is
        free beyond N GiB right then (so memory taken meanwhile is not overshot). A chunk the
        device refuses is tried again at half its size, down to the tolerance."""
        cap = CHUNK
        while nbytes > 0:
            n = min(cap, nbytes, _align_down(self.memory.mem_get_info()[0] - self.target))
            if n <= 0:
                return
            try:
                block = self.memory.alloc(n)
            except MemoryError as e:
                self._refused = f"{n / MiB:,.0f} MiB refused ({e})"
                if n <= TOLERANCE:
                    return  # the caller measures how far from N GiB that leaves
                cap = _align_down(n // 2)
                continue
            self._blocks.append((n, block))
            nbytes -= n

    def _give(self, nbytes: int) -> None:
        """Free ``nbytes`` from the end: whole chunks, then the last one re-allocated smaller."""
        while nbytes > 0 and self._blocks:
            n, block = self._blocks.pop()
            self.memory.free(block)
            del block
            if n > nbytes:
                self._take(n - nbytes)
            nbytes -= n

    def release(self) -> None:
        """Give every chunk back (idempotent)."""
        while self._blocks:
            _, block = self._blocks.pop()
            self.memory.free(block)

    def report(self) -> dict[str, Any]:
        """The JSON of ``device.card``."""
        free = self.free_after
        return {
            "gib": self.gib,
            "target_free_bytes": self.target,
            "filler_bytes": self.held_bytes,
            "free_bytes": free,
            "free_before_bytes": self.free_before,
            "total_bytes": self.total,
            "adjusted": self.adjusted,
            "tolerance_bytes": TOLERANCE,
            "within_tolerance": None if free is None else abs(free - self.target) <= TOLERANCE,
        }


class CudaDriverMemory:
    """:class:`DeviceMemory` of a CUDA device: ``cuMemAlloc``/``cuMemFree`` on its primary
    context, free memory from ``torch.cuda.mem_get_info`` (the driver's count)."""

    def __init__(self, device: torch.device) -> None:
        import torch

        # the same driver handle and error mapping as the VMM arena
        from strata.vmm.cuda_arena import _check, _driver

        self._torch, self._check = torch, _check
        self.device = device
        self._drv = drv = _driver()
        torch.cuda.init()
        _check(drv, "cuInit", drv.cuInit(0))
        self._dev = _check(drv, "cuDeviceGet", drv.cuDeviceGet(device.index or 0))
        self._ctx = _check(drv, "cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(self._dev))

    def close(self) -> None:
        if self._ctx is not None:
            self._drv.cuDevicePrimaryCtxRelease(self._dev)
            self._ctx = None

    @contextmanager
    def _current(self) -> Iterator[None]:
        drv = self._drv
        self._check(drv, "cuCtxPushCurrent", drv.cuCtxPushCurrent(self._ctx))
        try:
            yield
        finally:
            self._check(drv, "cuCtxPopCurrent", drv.cuCtxPopCurrent())

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self._torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def alloc(self, nbytes: int) -> object:
        drv = self._drv
        with self._current():
            err, ptr = drv.cuMemAlloc(nbytes)
        if err == drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            raise MemoryError(f"cuMemAlloc({nbytes}): CUDA_ERROR_OUT_OF_MEMORY")
        self._check(drv, "cuMemAlloc", (err, ptr))
        return ptr

    def free(self, block: object) -> None:
        with self._current():
            self._check(self._drv, "cuMemFree", self._drv.cuMemFree(block))


@contextmanager
def emulated_card(gib: float, device: torch.device) -> Iterator[CardFiller]:
    """The filler of a real CUDA device, filled on entry and released on exit. Raises
    ``BenchError`` naming the option when the device cannot be filled as asked."""
    import torch

    from strata.vmm.errors import VmmError

    if device.type != "cuda":
        raise BenchError(f"{FLAG} {gib:g}: needs a CUDA device, not {str(device)!r}")
    try:
        memory = CudaDriverMemory(device)
    except VmmError as e:
        raise BenchError(f"{FLAG} {gib:g}: cannot fill {device}: {e}") from None
    try:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # torch's cached blocks would count as taken, yet be reused
        filler = CardFiller(gib, memory)
        try:
            filler.fill()  # releases what it took when it fails
        except VmmError as e:  # a driver error other than a lack of memory
            raise BenchError(f"{FLAG} {gib:g}: cannot fill {device}: {e}") from None
        try:
            yield filler
        finally:
            filler.release()
    finally:
        memory.close()
