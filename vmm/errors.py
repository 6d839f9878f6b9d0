"""The exception hierarchy of ``strata.vmm``, mapped once at each edge (daemon, CLI, bench)."""

from __future__ import annotations


class VmmError(Exception):
    """Base of every error ``strata.vmm`` raises on purpose."""


class ArenaRequestError(VmmError, ValueError):
    """A request the arena's own API rejects: negative, not chunk-aligned, beyond the reservation,
    shrinking more than is mapped, a view outside the mapped part, use after close. The message
    names the value and the limit; the arena is left exactly as it was."""


class BackendUnavailable(VmmError):
    """The backend cannot run on this machine (no CUDA device, ``cuda-bindings`` not installed)."""


class BackendError(VmmError):
    """A backend call failed for a reason other than a lack of memory: a driver or system error
    that the caller cannot fix by waiting. The message names the call and the error code.

    Running out of memory during ``grow`` is *not* an error: ``grow`` returns what it got."""


class CudaError(BackendError):
    """A CUDA driver call returned something other than ``CUDA_SUCCESS``."""

    def __init__(self, call: str, result: str) -> None:
        super().__init__(f"{call} failed: {result}")
        self.call = call
        self.result = result


class MonitorError(VmmError):
    """A VRAM monitor that cannot be created as configured: an unknown kind, a simulated-VRAM file
    that is missing or malformed, a CUDA device that matches no NVML device (``find_nvml_index``;
    the NVML monitor turns that one into its warning rather than a crash). The message names the
    file or the device looked for and what was found instead.

    A monitor that stops working *at run time* never raises this: it logs one warning, sets
    ``healthy = False`` and returns ``None`` from ``sample()``."""
