"""Host memory the GPU reads directly: anonymous pages, page-locked and mapped for the device.

``HostMemory`` is one private anonymous mapping. With a ``Pinner`` (CUDA: ``cuMemHostRegister``
with ``DEVICEMAP | PORTABLE``) it is page-locked and mapped into the device's address space in
pieces, and every byte of it has a device address the kernels may read over PCIe (zero-copy) and
copies may use at full speed. Registration is verified in full: a piece the driver refuses is a
:class:`PinError` that names the bytes asked for and the bytes obtained, after undoing what was
registered. A partly page-locked tier is never used: an upstream engine that tolerated a partial
registration computed with whatever the unregistered addresses held, and said nothing.

Without a pinner (no CUDA) it is plain memory the CPU reads; ``release`` then gives a range's
pages back to the system (``madvise(MADV_DONTNEED)``: they read as zeros afterwards). Page-locked
pages cannot be given back without unregistering, so there ``release`` keeps them: they are the
room the caller keeps for what comes back.

``cuda.bindings`` is imported when a CUDA pinner is made, so this module imports without it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from strata.vmm.errors import BackendUnavailable, CudaError, VmmError
from strata.vmm.libc import LIBC, MADV_DONTNEED, MADV_HUGEPAGE, MAP_FAILED

if TYPE_CHECKING:
    import torch

MiB = 2**20
PIECE_BYTES = 1 << 30  # registered one piece at a time: a refusal names how far it got
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_PRIVATE_ANON = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
# cuda.h: CU_MEMHOSTREGISTER_PORTABLE (every context sees it pinned), _DEVICEMAP (device address)
_REGISTER_PORTABLE, _REGISTER_DEVICEMAP = 0x01, 0x02


class PinError(VmmError):
    """Page-locking host memory came back partial or failed; the message names the bytes asked
    for, the bytes obtained and the driver's answer. Nothing stays registered."""

    def __init__(self, asked: int, obtained: int, reason: str) -> None:
        super().__init__(
            f"page-locking {asked / MiB:.0f} MiB of host memory for the host tier obtained "
            f"{obtained / MiB:.0f} MiB ({reason}); a partly page-locked tier is never used: "
            "lower host_budget_mib, or set it to 0 to read experts from the file"
        )
        self.asked, self.obtained, self.reason = asked, obtained, reason


class Pinner(Protocol):
    """Page-locks host ranges for one device."""

    def register(self, address: int, nbytes: int) -> int:
        """Page-lock and device-map ``[address, address + nbytes)``; the device address of
        ``address``. Raises :class:`PinRefused` when the driver says no."""
        ...

    def unregister(self, address: int) -> None: ...


class PinRefused(VmmError):
    """One registration the driver refused; ``HostMemory`` turns it into a :class:`PinError`."""


class HostMemory:
    """``nbytes`` of anonymous host memory, page-locked in pieces of ``piece_bytes`` (a multiple
    of the page size) when a pinner is given."""

    def __init__(
        self, nbytes: int, pinner: Pinner | None = None, piece_bytes: int = PIECE_BYTES
    ) -> None:
        if nbytes <= 0:
            raise ValueError(f"host memory of {nbytes} bytes: must be positive")
        if piece_bytes <= 0 or piece_bytes % mmap.PAGESIZE:
            raise ValueError(f"piece of {piece_bytes} bytes is not a positive number of pages")
        self.nbytes = nbytes
        self.piece_bytes = piece_bytes
        addr = LIBC.mmap(None, nbytes, _PROT_RW, _MAP_PRIVATE_ANON, -1, 0)
        if addr in (None, MAP_FAILED):
            err = ctypes.get_errno()
            raise MemoryError(f"mmap of {nbytes} bytes for the host tier: {os.strerror(err)}")
        self.address = int(addr)
        self._buf = (ctypes.c_ubyte * nbytes).from_address(self.address)
        self._buf._owner = self  # a tensor over the bytes keeps them mapped
        self._pinner = pinner
        self._pieces: list[tuple[int, int, int]] = []  # (host address, bytes, device address)
        # Unregister before unmapping, whenever that happens: the driver keeps a registration
        # of memory unmapped under it, and refuses the next mapping that lands at its address.
        self._free = weakref.finalize(self, _unmap, pinner, self._pieces, self.address, nbytes)
        if pinner is not None:
            # fewer, larger pages: faster to register, fewer entries for the device to walk
            LIBC.madvise(self.address, nbytes, MADV_HUGEPAGE)
            self._pin(pinner)

    @property
    def pinned(self) -> bool:
        return bool(self._pieces)

    def _pin(self, pinner: Pinner) -> None:
        obtained = 0
        try:
            for start in range(0, self.nbytes, self.piece_bytes):
                n = min(self.piece_bytes, self.nbytes - start)
                dev = pinner.register(self.address + start, n)
                self._pieces.append((self.address + start, n, dev))
                obtained += n
        except PinRefused as e:
            self.close()
            raise PinError(self.nbytes, obtained, str(e)) from None
        if obtained != self.nbytes:  # a pinner that stopped early without saying so
            self.close()
            raise PinError(self.nbytes, obtained, "registration stopped short")

    def _check(self, offset: int, nbytes: int) -> None:
        if not self._free.alive:
            raise VmmError("host memory used after close")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"range [{offset}, {offset + nbytes}) is outside [0, {self.nbytes})")

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over ``[offset, offset + nbytes)`` (no copy)."""
        import torch

        self._check(offset, nbytes)
        return torch.frombuffer(self._buf, dtype=torch.uint8, count=nbytes, offset=offset)

    def host_minus_device(self) -> int | None:
        """The one number that turns a device address of this memory into its host address
        (0 where the driver maps page-locked memory at its host address, as on x86-64 with
        UVA); None where no piece is page-locked or the pieces differ."""
        deltas = {host - dev for host, _, dev in self._pieces}
        return deltas.pop() if len(deltas) == 1 else None

    def device_address(self, offset: int) -> int:
        """Where the device reads byte ``offset`` (page-locked memory only)."""
        self._check(offset, 0)
        for host, n, dev in self._pieces:
            if host <= self.address + offset < host + n:
                return dev + (self.address + offset - host)
        raise VmmError("host memory that is not page-locked has no device address")

    def device_view(self, offset: int, nbytes: int, device: int) -> torch.Tensor:
        """A uint8 CUDA tensor over ``[offset, offset + nbytes)``, read over PCIe (page-locked
        memory only; the range must lie in one registered piece)."""
        import torch

        from strata.vmm.cuda_arena import _CudaBytes

        self._check(offset, nbytes)
        dev = self.device_address(offset)
        if nbytes and self.device_address(offset + nbytes - 1) != dev + nbytes - 1:
            raise ValueError(f"range [{offset}, {offset + nbytes}) spans two registrations")
        return torch.as_tensor(_CudaBytes(dev, nbytes), device=torch.device("cuda", device))

    def release(self, offset: int, nbytes: int) -> None:
        """Give the whole pages of a range back to the system (not page-locked memory only:
        page-locked pages stay, as the room kept for later). They read as zeros afterwards."""
        self._check(offset, nbytes)
        if self.pinned:
            return
        lo = -(-(self.address + offset) // mmap.PAGESIZE) * mmap.PAGESIZE
        hi = (self.address + offset + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if hi > lo:
            LIBC.madvise(lo, hi - lo, MADV_DONTNEED)

    def close(self) -> None:
        """Unregister and unmap (views of the memory must be gone by now)."""
        self._free()


def _unmap(pinner: Pinner | None, pieces: list[tuple[int, int, int]], address: int, n: int) -> None:
    while pieces:
        host, _, _ = pieces.pop()
        assert pinner is not None
        pinner.unregister(host)
    LIBC.munmap(address, n)


# -- CUDA -------------------------------------------------------------------------------------


class CudaPinner:
    """``cuMemHostRegister`` on the device's primary context (the one PyTorch uses)."""

    def __init__(self, device: int = 0) -> None:
        try:
            from cuda.bindings import driver
        except ImportError as e:
            from strata.hints import install_hint

            raise BackendUnavailable(
                f"page-locked host memory needs the cuda-bindings package ({e}); "
                f"{install_hint('cuda-bindings')}"
            ) from e
        self._drv = drv = driver
        self._check("cuInit", drv.cuInit(0))
        self._dev = self._check("cuDeviceGet", drv.cuDeviceGet(device))
        self._ctx = self._check("cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(self._dev))
        self._flags = _REGISTER_PORTABLE | _REGISTER_DEVICEMAP

    def _check(self, call: str, result: tuple[Any, ...]) -> Any:
        err, *values = result
        if err != self._drv.CUresult.CUDA_SUCCESS:
            raise CudaError(call, getattr(err, "name", str(err)))
        return values[0] if len(values) == 1 else None

    @contextmanager
    def _current(self) -> Iterator[None]:
        self._check("cuCtxPushCurrent", self._drv.cuCtxPushCurrent(self._ctx))
        try:
            yield
        finally:
            self._check("cuCtxPopCurrent", self._drv.cuCtxPopCurrent())

    def register(self, address: int, nbytes: int) -> int:
        drv = self._drv
        with self._current():
            (err,) = drv.cuMemHostRegister(address, nbytes, self._flags)
            if err != drv.CUresult.CUDA_SUCCESS:
                raise PinRefused(f"cuMemHostRegister of {nbytes} bytes: {err.name}")
            err, dev = drv.cuMemHostGetDevicePointer(address, 0)
            if err != drv.CUresult.CUDA_SUCCESS:
                drv.cuMemHostUnregister(address)
                raise PinRefused(f"cuMemHostGetDevicePointer: {err.name}")
        return int(dev)

    def unregister(self, address: int) -> None:
        with self._current():
            self._check("cuMemHostUnregister", self._drv.cuMemHostUnregister(address))
