"""The host backend of the elastic arena: an mmap reservation with memfd chunks mapped into it.

Used on machines without a GPU and in CI, with the CUDA backend's semantics:

* The reservation is one ``mmap(PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)`` of the
  whole range: address space only, no memory.
* The memory is one memfd per arena, ``ftruncate``'d to the reservation's size (a sparse file:
  no memory yet). Growing by a chunk commits that chunk's pages in the file
  (``posix_fallocate``: a lack of memory shows up here, at grow time, and not later as a SIGBUS)
  and maps them ``MAP_SHARED | MAP_FIXED`` at the chunk's address. Contiguous chunks of one file
  merge into one kernel mapping, so the arena costs one fd and a handful of VMAs at any size.
* Shrinking a chunk maps the range back to ``PROT_NONE`` (``MAP_FIXED`` anonymous) and punches
  the chunk's pages out of the file (``fallocate(PUNCH_HOLE)``): the memory goes back to the
  system at once, and ``committed_bytes`` (from the file's allocated blocks) shows it.
* Fresh and punched-then-refilled pages of a memfd read as zeros, so new chunks need no memset.

One memfd per arena rather than one per chunk: a kept-open fd per chunk reaches the usual 1024-fd
soft limit at 2 GiB of 2 MiB chunks and costs one VMA per chunk, while one file's block count
gives an exact, per-arena measure of the memory held.

Python's ``mmap`` module cannot map at a fixed address, so ``mmap``/``munmap``/``fallocate`` go
through ctypes on libc.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from strata.vmm.arena import ArenaBase, ChunkUnavailable
from strata.vmm.errors import BackendError, BackendUnavailable
from strata.vmm.libc import LIBC, MAP_FAILED

if TYPE_CHECKING:
    import torch

# Linux values, the same on every architecture Strata runs on.
_PROT_NONE = 0x0
_MAP_FIXED = 0x10
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # in the mmap module from Python 3.13
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
# errnos that mean "no memory for this chunk right now", as opposed to a broken call.
_NO_MEMORY = frozenset({errno.ENOMEM, errno.ENOSPC})

CommitFn = Callable[[int, int, int], None]
"""``commit(fd, offset, length)``: give the file real pages for that range (``os.posix_fallocate``
by default); raises ``OSError`` on failure. The seam through which tests inject failures."""


class HostArena(ArenaBase):
    """An elastic arena in host memory (``device == "cpu"``); see the module docstring."""

    def __init__(
        self, reserved_bytes: int, chunk_bytes: int, *, commit: CommitFn | None = None
    ) -> None:
        super().__init__(reserved_bytes, chunk_bytes, "cpu", mmap.PAGESIZE)
        if not hasattr(os, "memfd_create"):
            raise BackendUnavailable("the host arena needs os.memfd_create (Linux)")
        self._commit = commit or os.posix_fallocate
        self._libc = LIBC
        self._reserve_flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        addr = self._libc.mmap(None, reserved_bytes, _PROT_NONE, self._reserve_flags, -1, 0)
        if addr in (None, MAP_FAILED):
            raise BackendError(f"mmap reservation of {reserved_bytes} bytes: {_errno_text()}")
        self.base = addr
        try:
            self._fd = os.memfd_create("strata-arena", os.MFD_CLOEXEC)
            os.ftruncate(self._fd, reserved_bytes)
        except OSError as e:
            self._libc.munmap(addr, reserved_bytes)
            raise BackendError(f"memfd for {reserved_bytes} bytes: {e}") from e

    @property
    def committed_bytes(self) -> int:
        """Bytes of memory the arena's file holds now, from its allocated blocks."""
        self._check_open("committed_bytes")
        return os.fstat(self._fd).st_blocks * 512

    def _map_chunk(self, offset: int) -> None:
        size = self.chunk_bytes
        try:
            self._commit(self._fd, offset, size)
        except OSError as e:
            self._punch(offset)  # a commit that failed halfway may have left some pages
            if e.errno in _NO_MEMORY:
                raise ChunkUnavailable(f"commit of {size} bytes at offset {offset}: {e}") from e
            raise BackendError(f"commit of {size} bytes at offset {offset}: {e}") from e
        flags = mmap.MAP_SHARED | _MAP_FIXED
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        addr = self._libc.mmap(self.base + offset, size, prot, flags, self._fd, offset)
        if addr != self.base + offset:
            err = ctypes.get_errno()
            # A failed MAP_FIXED may have unmapped the old range: put the reservation back.
            self._protect_none(offset)
            self._punch(offset)
            text = f"mmap of {size} bytes at offset {offset}: {os.strerror(err)}"
            if err == errno.ENOMEM:  # out of mappings (vm.max_map_count) counts as no memory
                raise ChunkUnavailable(text)
            raise BackendError(text)

    def _unmap_chunk(self, offset: int) -> None:
        self._protect_none(offset)
        self._punch(offset)

    def _zero(self, offset: int, nbytes: int) -> None:
        pass  # fresh memfd pages, and pages punched out and committed again, read as zeros

    def _before_unmap(self) -> None:
        pass  # host code that used a view has finished with it by the time it returns

    def _view_bytes(self, address: int, nbytes: int) -> torch.Tensor:
        import torch

        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        buf = (ctypes.c_uint8 * nbytes).from_address(address)
        return torch.frombuffer(buf, dtype=torch.uint8)

    def _release(self) -> None:
        if self._libc.munmap(self.base, self.reserved_bytes) != 0:
            raise BackendError(f"munmap of the reservation at {self.base:#x}: {_errno_text()}")
        os.close(self._fd)

    def _protect_none(self, offset: int) -> None:
        flags = self._reserve_flags | _MAP_FIXED
        addr = self._libc.mmap(self.base + offset, self.chunk_bytes, _PROT_NONE, flags, -1, 0)
        if addr != self.base + offset:
            raise BackendError(
                f"mmap(PROT_NONE) of {self.chunk_bytes} bytes at offset {offset}: {_errno_text()}"
            )

    def _punch(self, offset: int) -> None:
        mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
        if self._libc.fallocate(self._fd, mode, offset, self.chunk_bytes) != 0:
            raise BackendError(
                f"fallocate(PUNCH_HOLE) of {self.chunk_bytes} bytes at offset {offset}: "
                f"{_errno_text()}"
            )


def _errno_text() -> str:
    err = ctypes.get_errno()
    return f"{errno.errorcode.get(err, err)} ({os.strerror(err)})"
