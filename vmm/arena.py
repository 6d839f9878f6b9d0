"""The elastic arena: one virtual range reserved for life, physical chunks mapped from the bottom.

``ElasticArena`` is the protocol the expert cache programs against; ``HostArena``
(``vmm/host_arena.py``, mmap + memfd) and ``CudaArena`` (``vmm/cuda_arena.py``, CUDA VMM) are its
two backends, chosen by configuration through ``create_arena``. ``ArenaBase`` holds everything the
two share: validation, the mapped-size bookkeeping, the grow/shrink loops and their failure
policy. It is plain Python (no torch, no CUDA); backends supply five small per-chunk hooks.

Invariants (architecture §1, §2):

* ``base`` never changes for the life of the object, so addresses handed to kernels, CUDA graphs
  and device-side tables stay valid while the arena grows and shrinks.
* ``[0, mapped_bytes)`` is backed by memory; bytes of chunks that stay mapped are preserved by
  every resize; newly mapped chunks read as zeros.
* A rejected request raises ``ArenaRequestError`` and changes nothing.
* Views alias the arena (no copy). A view of a range that is later unmapped must not be used:
  the caller rewrites its tables before it shrinks (architecture §1, invariant 4).
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from strata.vmm.errors import ArenaRequestError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MiB = 1 << 20
# From the H200 measurements in vmm/bench_arena.py's docstring: the per-chunk driver cost
# (about 55 us to map, 45-70 us to unmap) dominates up to 32 MiB, where 4 GiB maps in 7 ms and
# unmaps in 8 ms (2 MiB: 112 and 88 ms). 64 MiB saves under 2x more but halves how finely the
# cache can follow free VRAM. Configurable per arena.
DEFAULT_CHUNK_BYTES = 32 * MiB


@runtime_checkable
class ElasticArena(Protocol):
    chunk_bytes: int
    reserved_bytes: int
    mapped_bytes: int
    base: int
    device: str

    def grow(self, nbytes: int) -> int: ...
    def shrink(self, nbytes: int, ready: Callable[[int], None] | None = None) -> int: ...
    def resize(self, target_bytes: int) -> int: ...
    def view(self, offset: int, nbytes: int, dtype: torch.dtype | None = None) -> torch.Tensor: ...
    def address(self, offset: int) -> int: ...
    def close(self) -> None: ...
    def __enter__(self) -> ElasticArena: ...
    def __exit__(self, *exc: object) -> None: ...


class ChunkUnavailable(Exception):
    """Raised by a backend's ``_map_chunk`` when the system has no memory for one more chunk.

    Internal to the package: ``grow`` turns it into a short return, never into an exception."""


class ArenaBase(ABC):
    """Validation, bookkeeping and the grow/shrink policy shared by every backend.

    A subclass calls ``super().__init__`` (which validates the sizes), reserves its range, sets
    ``self.base`` and implements the per-chunk hooks below. All mutations run under one lock, so
    the engine thread and the control loop may both call in.
    """

    def __init__(
        self, reserved_bytes: int, chunk_bytes: int, device: str, granularity: int
    ) -> None:
        _require_int("chunk_bytes", chunk_bytes)
        _require_int("reserved_bytes", reserved_bytes)
        if chunk_bytes <= 0 or chunk_bytes % granularity:
            raise ArenaRequestError(
                f"chunk_bytes {chunk_bytes} must be a positive multiple of the {device} "
                f"mapping granularity {granularity}"
            )
        if reserved_bytes <= 0 or reserved_bytes % chunk_bytes:
            raise ArenaRequestError(
                f"reserved_bytes {reserved_bytes} must be a positive multiple of "
                f"chunk_bytes {chunk_bytes}"
            )
        self.chunk_bytes = chunk_bytes
        self.reserved_bytes = reserved_bytes
        self.mapped_bytes = 0
        self.base = 0
        self.device = device
        self.granularity = granularity
        self.closed = False
        self._lock = threading.RLock()

    # -- backend hooks ---------------------------------------------------------------------------

    @abstractmethod
    def _map_chunk(self, offset: int) -> None:
        """Back ``[offset, offset + chunk_bytes)`` with fresh memory, or raise ``ChunkUnavailable``
        (no memory) or ``BackendError`` (anything else), leaving nothing half-mapped either way."""

    @abstractmethod
    def _unmap_chunk(self, offset: int) -> None:
        """Unmap the chunk at ``offset`` and give its memory back to the system."""

    @abstractmethod
    def _zero(self, offset: int, nbytes: int) -> None:
        """Make ``[offset, offset + nbytes)``, just mapped, read as zeros (and be done with it)."""

    @abstractmethod
    def _before_unmap(self) -> None:
        """Called once before a shrink unmaps anything (CUDA: synchronise the device)."""

    @abstractmethod
    def _view_bytes(self, address: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor aliasing ``nbytes`` at ``address`` (inside the mapped part)."""

    @abstractmethod
    def _release(self) -> None:
        """Release the reservation itself (everything is already unmapped)."""

    # -- the protocol ----------------------------------------------------------------------------

    def grow(self, nbytes: int) -> int:
        """Map ``nbytes`` more at the top; return the bytes actually mapped.

        Chunks are mapped one by one. When the system has no memory for the next chunk (another
        program took it), grow stops there: the chunks it did get stay mapped and zeroed, the arena
        is consistent at ``old + k * chunk_bytes``, a warning is logged, and ``k * chunk_bytes``
        (possibly 0) is returned. No exception: the caller reads the return value and sizes its
        cache by it. No half-mapped chunk is ever left behind. Any other backend failure raises
        ``BackendError`` after the same clean-up (the chunks mapped before it stay, zeroed).
        """
        with self._lock:
            self._check_open("grow")
            self._check_amount("grow", nbytes)
            room = self.reserved_bytes - self.mapped_bytes
            if nbytes > room:
                raise ArenaRequestError(
                    f"grow of {nbytes} bytes goes beyond the reservation: {self.mapped_bytes} of "
                    f"reserved_bytes {self.reserved_bytes} are mapped, so at most {room} more fit"
                )
            return self._map_top(nbytes // self.chunk_bytes)

    def shrink(self, nbytes: int, ready: Callable[[int], None] | None = None) -> int:
        """Unmap ``nbytes`` from the top and return the memory to the system; return ``nbytes``.

        The backend's ``_before_unmap`` runs first (CUDA: the device is synchronised), so no
        queued kernel still reads a chunk when it goes away. With ``ready``, the caller vouches
        instead, chunk by chunk: ``ready(offset)`` runs before the chunk at ``offset`` is
        unmapped (the top chunk first) and returns once no queued work touches that chunk, so
        the lower chunks' copies can still run while the top ones go."""
        with self._lock:
            self._check_open("shrink")
            self._check_amount("shrink", nbytes)
            if nbytes > self.mapped_bytes:
                raise ArenaRequestError(
                    f"shrink of {nbytes} bytes is more than mapped_bytes {self.mapped_bytes}"
                )
            self._unmap_top(nbytes // self.chunk_bytes, ready)
            return nbytes

    def resize(self, target_bytes: int) -> int:
        """Grow or shrink to ``target_bytes``; return the new ``mapped_bytes`` (less than the
        target when a grow could not get all its memory, see ``grow``)."""
        with self._lock:
            self._check_open("resize")
            self._check_amount("resize to", target_bytes)
            if target_bytes > self.reserved_bytes:
                raise ArenaRequestError(
                    f"resize to {target_bytes} bytes goes beyond reserved_bytes "
                    f"{self.reserved_bytes}"
                )
            if target_bytes > self.mapped_bytes:
                self.grow(target_bytes - self.mapped_bytes)
            elif target_bytes < self.mapped_bytes:
                self.shrink(self.mapped_bytes - target_bytes)
            return self.mapped_bytes

    def view(self, offset: int, nbytes: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A tensor aliasing ``[offset, offset + nbytes)`` of the mapped part, no copy.

        ``dtype`` defaults to uint8; offset and nbytes must be multiples of its item size. The view
        is valid while that range stays mapped: never touch it after a shrink that unmapped it."""
        self._check_open("view")
        _require_int("view offset", offset)
        _require_int("view nbytes", nbytes)
        if offset < 0 or nbytes < 0 or offset + nbytes > self.mapped_bytes:
            raise ArenaRequestError(
                f"view [{offset}, {offset + nbytes}) is outside the mapped part "
                f"[0, {self.mapped_bytes})"
            )
        itemsize = 1 if dtype is None else dtype.itemsize
        if offset % itemsize or nbytes % itemsize:
            raise ArenaRequestError(
                f"view at offset {offset} of {nbytes} bytes is not aligned to the item size "
                f"{itemsize} of {dtype}"
            )
        t = self._view_bytes(self.base + offset, nbytes)
        return t if dtype is None else t.view(dtype)

    def address(self, offset: int) -> int:
        """The raw address ``base + offset``, for device-side tables. Any offset in
        ``[0, reserved_bytes]`` has a stable address, mapped or not."""
        self._check_open("address")
        _require_int("address offset", offset)
        if not 0 <= offset <= self.reserved_bytes:
            raise ArenaRequestError(
                f"address offset {offset} is outside the reservation [0, {self.reserved_bytes}]"
            )
        return self.base + offset

    def close(self) -> None:
        """Unmap everything and release the reservation. Idempotent."""
        with self._lock:
            if self.closed:
                return
            if self.mapped_bytes:
                self._unmap_top(self.mapped_bytes // self.chunk_bytes)
            self._release()
            self.closed = True

    def __enter__(self) -> ArenaBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.mapped_bytes}/{self.reserved_bytes} mapped"
        return (
            f"{type(self).__name__}(device={self.device}, base={self.base:#x}, "
            f"chunk_bytes={self.chunk_bytes}, {state})"
        )

    # -- shared loops ----------------------------------------------------------------------------

    def _map_top(self, chunks: int) -> int:
        """Map up to ``chunks`` chunks at the top and zero them; return the bytes mapped."""
        start = self.mapped_bytes
        try:
            self._map_chunks(chunks)
        finally:
            # Also on a BackendError: the chunks that did get mapped must read as zeros.
            if self.mapped_bytes > start:
                self._zero(start, self.mapped_bytes - start)
        return self.mapped_bytes - start

    def _map_chunks(self, chunks: int) -> None:
        """Map up to ``chunks`` chunks at the top, not zeroed; stop at the first that is
        unavailable. The bench times this apart from the zeroing."""
        start = self.mapped_bytes
        for _ in range(chunks):
            try:
                self._map_chunk(self.mapped_bytes)
            except ChunkUnavailable as e:
                got = self.mapped_bytes - start
                log.warning(
                    "%s: grow got %d of %d bytes (%d of %d chunks): %s",
                    self.device,
                    got,
                    chunks * self.chunk_bytes,
                    got // self.chunk_bytes,
                    chunks,
                    e,
                )
                return
            self.mapped_bytes += self.chunk_bytes

    def _unmap_top(self, chunks: int, ready: Callable[[int], None] | None = None) -> None:
        if chunks == 0:
            return
        if ready is None:
            self._before_unmap()
        for _ in range(chunks):
            offset = self.mapped_bytes - self.chunk_bytes
            if ready is not None:
                ready(offset)
            self._unmap_chunk(offset)
            self.mapped_bytes -= self.chunk_bytes

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise ArenaRequestError(
                f"{what} on a closed arena ({self.device}, base {self.base:#x})"
            )

    def _check_amount(self, what: str, nbytes: int) -> None:
        _require_int(f"{what} bytes", nbytes)
        if nbytes < 0:
            raise ArenaRequestError(f"{what} {nbytes} bytes: the amount must not be negative")
        if nbytes % self.chunk_bytes:
            raise ArenaRequestError(
                f"{what} {nbytes} bytes is not a multiple of chunk_bytes {self.chunk_bytes}"
            )


def _require_int(name: str, value: object) -> None:
    # bool is an int in Python; a True that slipped through would map one byte's worth of nothing.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ArenaRequestError(f"{name} must be an int, got {value!r}")


def create_arena(
    backend: str, reserved_bytes: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES, device: int = 0
) -> ElasticArena:
    """The arena of the configured backend: ``"host"`` or ``"cuda"`` (on CUDA device ``device``)."""
    if backend == "host":
        from strata.vmm.host_arena import HostArena

        return HostArena(reserved_bytes, chunk_bytes)
    if backend == "cuda":
        from strata.vmm.cuda_arena import CudaArena

        return CudaArena(reserved_bytes, chunk_bytes, device=device)
    raise ArenaRequestError(f"arena backend {backend!r} is not one of 'host', 'cuda'")
