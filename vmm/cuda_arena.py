"""The CUDA VMM backend of the elastic arena, through ``cuda.bindings.driver``.

* Works on the device's *primary* context, the one PyTorch uses, so tensors, kernels and graphs
  see the arena's addresses. Each driver sequence pushes that context and pops it again, so the
  calling thread's current context is left as it was.
* ``cuMemAddressReserve`` reserves the whole range once (aligned to the allocation granularity;
  ``chunk_bytes`` must be a multiple of it). ``grow`` does ``cuMemCreate`` (pinned device memory)
  + ``cuMemMap`` + ``cuMemSetAccess`` (read/write for the device) per chunk and keeps each chunk's
  handle; ``shrink`` synchronises the device, then ``cuMemUnmap`` + ``cuMemRelease`` per chunk
  from the top; ``close`` unmaps everything and frees the reservation.
* ``cuMemCreate`` memory is not guaranteed to be zero: new chunks are zeroed with
  ``cuMemsetD8Async`` on PyTorch's current stream, then that stream is synchronised.
* Every ``CUresult`` is checked; a failure raises ``CudaError`` naming the call and the result,
  except ``CUDA_ERROR_OUT_OF_MEMORY`` during a grow, which ends the grow short (see
  ``ArenaBase.grow``).

``cuda.bindings`` is imported when an arena is created, so this module imports on machines
without it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from strata.vmm.arena import ArenaBase, ChunkUnavailable
from strata.vmm.errors import BackendUnavailable, CudaError

if TYPE_CHECKING:
    import torch


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as e:
        from strata.hints import install_hint

        raise BackendUnavailable(
            f"the CUDA arena needs the cuda-bindings package ({e}); {install_hint('cuda-bindings')}"
        ) from e
    return driver


def _check(drv: Any, call: str, result: tuple[Any, ...]) -> Any:
    """The values of a driver call's result tuple, or CudaError naming the call and CUresult."""
    err, *values = result
    if err != drv.CUresult.CUDA_SUCCESS:
        raise CudaError(call, _result_name(drv, err))
    return values[0] if len(values) == 1 else tuple(values) if values else None


def _result_name(drv: Any, err: Any) -> str:
    name = getattr(err, "name", None)
    if name is None:
        res, text = drv.cuGetErrorName(err)
        name = text.decode() if res == drv.CUresult.CUDA_SUCCESS else f"CUresult {int(err)}"
    return name


def _device_index(device: int | str | torch.device) -> int:
    import torch

    d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if d.type != "cuda":
        raise BackendUnavailable(f"the CUDA arena needs a cuda device, got {device!r}")
    return torch.cuda.current_device() if d.index is None else d.index


class _CudaBytes:
    """A device byte range as ``__cuda_array_interface__``, for ``torch.as_tensor`` (no copy)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "data": (ptr, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "strides": None,
            "version": 2,  # no "stream" key: the caller orders its own work
        }


class CudaArena(ArenaBase):
    """An elastic arena in GPU memory through CUDA VMM; see the module docstring."""

    def __init__(
        self, reserved_bytes: int, chunk_bytes: int, device: int | str | torch.device = 0
    ) -> None:
        import torch

        drv = _driver()
        if not torch.cuda.is_available():
            raise BackendUnavailable("the CUDA arena needs a CUDA device; torch sees none")
        index = _device_index(device)
        if not 0 <= index < torch.cuda.device_count():
            raise BackendUnavailable(
                f"CUDA device {index} does not exist ({torch.cuda.device_count()} present)"
            )
        torch.cuda.init()
        self._drv = drv
        _check(drv, "cuInit", drv.cuInit(0))
        self._dev = _check(drv, "cuDeviceGet", drv.cuDeviceGet(index))
        # Retaining the primary context creates it if torch has not yet: torch then uses it too.
        self._ctx = _check(drv, "cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(self._dev))
        self._index = index
        self._prop = drv.CUmemAllocationProp()
        self._prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = index
        self._access = drv.CUmemAccessDesc()
        self._access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._access.location.id = index
        self._access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._handles: list[Any] = []
        try:
            with self._current():
                granularity = int(
                    _check(
                        drv,
                        "cuMemGetAllocationGranularity",
                        drv.cuMemGetAllocationGranularity(
                            self._prop,
                            drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                        ),
                    )
                )
            super().__init__(reserved_bytes, chunk_bytes, f"cuda:{index}", granularity)
            with self._current():
                ptr = _check(
                    drv,
                    "cuMemAddressReserve",
                    drv.cuMemAddressReserve(reserved_bytes, granularity, 0, 0),
                )
        except BaseException:
            drv.cuDevicePrimaryCtxRelease(self._dev)
            raise
        self.base = int(ptr)

    @contextmanager
    def _current(self) -> Iterator[None]:
        drv = self._drv
        _check(drv, "cuCtxPushCurrent", drv.cuCtxPushCurrent(self._ctx))
        try:
            yield
        finally:
            _check(drv, "cuCtxPopCurrent", drv.cuCtxPopCurrent())

    # The public operations push the primary context once around the whole per-chunk loop.
    def grow(self, nbytes: int) -> int:
        with self._lock, self._current():
            return super().grow(nbytes)

    def shrink(self, nbytes: int, ready: Callable[[int], None] | None = None) -> int:
        with self._lock, self._current():
            return super().shrink(nbytes, ready)

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            with self._current():
                super().close()
            _check(
                self._drv,
                "cuDevicePrimaryCtxRelease",
                self._drv.cuDevicePrimaryCtxRelease(self._dev),
            )

    def _map_chunk(self, offset: int) -> None:
        drv, size, addr = self._drv, self.chunk_bytes, self.base + offset
        err, handle = drv.cuMemCreate(size, self._prop, 0)
        if err == drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            raise ChunkUnavailable(f"cuMemCreate of {size} bytes: CUDA_ERROR_OUT_OF_MEMORY")
        _check(drv, "cuMemCreate", (err,))
        try:
            _check(drv, "cuMemMap", drv.cuMemMap(addr, size, 0, handle, 0))
            try:
                _check(drv, "cuMemSetAccess", drv.cuMemSetAccess(addr, size, [self._access], 1))
            except CudaError:
                drv.cuMemUnmap(addr, size)
                raise
        except CudaError as e:
            drv.cuMemRelease(handle)
            if e.result == "CUDA_ERROR_OUT_OF_MEMORY":
                raise ChunkUnavailable(str(e)) from e
            raise
        self._handles.append(handle)

    def _unmap_chunk(self, offset: int) -> None:
        drv = self._drv
        _check(drv, "cuMemUnmap", drv.cuMemUnmap(self.base + offset, self.chunk_bytes))
        _check(drv, "cuMemRelease", drv.cuMemRelease(self._handles.pop()))

    def _zero(self, offset: int, nbytes: int) -> None:
        import torch

        drv = self._drv
        stream = torch.cuda.current_stream(self._index).cuda_stream
        _check(drv, "cuMemsetD8Async", drv.cuMemsetD8Async(self.base + offset, 0, nbytes, stream))
        _check(drv, "cuStreamSynchronize", drv.cuStreamSynchronize(stream))

    def _before_unmap(self) -> None:
        # The device-wide synchronise (what torch.cuda.synchronize does), on the primary context
        # pushed around this shrink: torch.cuda.synchronize would switch devices, replacing the
        # pushed context on a multi-GPU machine.
        _check(self._drv, "cuCtxSynchronize", self._drv.cuCtxSynchronize())

    def _view_bytes(self, address: int, nbytes: int) -> torch.Tensor:
        import torch

        device = torch.device("cuda", self._index)
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8, device=device)
        return torch.as_tensor(_CudaBytes(address, nbytes), device=device)

    def _release(self) -> None:
        drv = self._drv
        _check(drv, "cuMemAddressFree", drv.cuMemAddressFree(self.base, self.reserved_bytes))
