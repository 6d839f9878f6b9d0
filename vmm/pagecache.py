"""The page cache of a memory-mapped file: give back exactly the byte runs we copied elsewhere,
and count how much of a set of runs is resident.

Dropping a file's cached pages takes two calls on Linux. ``posix_fadvise(POSIX_FADV_DONTNEED)``
drops clean pages of the file that no process maps, but a page our own mapping has touched is
still mapped into this process, and fadvise leaves it alone. So ``release`` first unmaps the
range from our mapping (``madvise(MADV_DONTNEED)``: for a file mapping the page table entries go,
the next read faults the page back in from the page cache or the drive) and then fadvises it.

Only whole pages inside the given runs are released (runs are merged first where they touch), so
a page shared with a run that was not asked for is never dropped.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable
from pathlib import Path

from strata.vmm.libc import LIBC, MADV_DONTNEED, MAP_FAILED

PAGE = mmap.PAGESIZE

Run = tuple[int, int]  # (file offset, bytes)


def merged(runs: Iterable[Run]) -> list[Run]:
    """``runs`` sorted, with runs that touch or overlap joined into one."""
    out: list[list[int]] = []
    for offset, n in sorted((int(o), int(n)) for o, n in runs if n > 0):
        if offset < 0:
            raise ValueError(f"a byte run at offset {offset} is negative")
        if out and offset <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], offset + n - out[-1][0])
        else:
            out.append([offset, n])
    return [(o, n) for o, n in out]


def whole_pages(runs: Iterable[Run]) -> list[Run]:
    """The whole pages inside each merged run (a run's partial first and last pages dropped)."""
    pages = []
    for offset, n in merged(runs):
        lo = -(-offset // PAGE) * PAGE
        hi = (offset + n) // PAGE * PAGE
        if hi > lo:
            pages.append((lo, hi - lo))
    return pages


def release(path: Path, mapping_address: int, runs: Iterable[Run]) -> int:
    """Drop the whole pages of ``runs`` of the file ``path`` (mapped at ``mapping_address``,
    offset 0) from this process's mapping and from the page cache. Returns the bytes asked to go.
    Raises OSError naming the call when the kernel refuses."""
    if mapping_address % PAGE:
        raise ValueError(f"mapping address {mapping_address:#x} is not page-aligned")
    pages = whole_pages(runs)
    for offset, n in pages:
        if LIBC.madvise(mapping_address + offset, n, MADV_DONTNEED) != 0:
            err = ctypes.get_errno()
            raise OSError(
                err, f"madvise(MADV_DONTNEED) of {n} bytes at {offset}: {os.strerror(err)}"
            )
    if pages:
        fd = os.open(path, os.O_RDONLY)
        try:
            for offset, n in pages:
                os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return sum(n for _, n in pages)


def resident_bytes(path: Path, runs: Iterable[Run]) -> int:
    """Bytes of the pages touching ``runs`` that are in the page cache now (``mincore`` through a
    fresh read-only mapping of the file, which itself reads nothing)."""
    pages = merged(runs)
    if not pages:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        addr = LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {path} ({size} bytes): {os.strerror(err)}")
    finally:
        os.close(fd)
    try:
        total = 0
        for offset, n in pages:
            lo = offset // PAGE * PAGE
            hi = min(-(-(offset + n) // PAGE) * PAGE, -(-size // PAGE) * PAGE)
            if hi <= lo:
                continue
            vec = (ctypes.c_ubyte * ((hi - lo) // PAGE))()
            if LIBC.mincore(addr + lo, hi - lo, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mincore of {hi - lo} bytes at {lo}: {os.strerror(err)}")
            total += sum(b & 1 for b in vec) * PAGE
        return total
    finally:
        LIBC.munmap(addr, size)
