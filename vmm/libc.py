"""The libc calls ``strata.vmm`` makes through ctypes (Python's ``mmap`` module cannot map at a
fixed address, advise a range or ask what is resident), with their prototypes, in one place."""

from __future__ import annotations

import ctypes

MAP_FAILED = ctypes.c_void_p(-1).value
MADV_DONTNEED = 4
MADV_HUGEPAGE = 14

_c_void_p, _c_size_t, _c_int, _c_long = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_long,
)


def _load() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    prototypes = {
        "mmap": (_c_void_p, [_c_void_p, _c_size_t, _c_int, _c_int, _c_int, _c_long]),
        "munmap": (_c_int, [_c_void_p, _c_size_t]),
        "madvise": (_c_int, [_c_void_p, _c_size_t, _c_int]),
        "mincore": (_c_int, [_c_void_p, _c_size_t, _c_void_p]),
        "fallocate": (_c_int, [_c_int, _c_int, _c_long, _c_long]),
    }
    for name, (restype, argtypes) in prototypes.items():
        fn = getattr(libc, name)
        fn.restype, fn.argtypes = restype, argtypes
    return libc


LIBC = _load()
