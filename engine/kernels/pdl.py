"""Programmatic dependent launch (PDL) for the decode step's kernels.

A decode step is ~300 short launches, each waiting for the one before it. Launched with PDL
(Hopper and later), a kernel's programs may be placed on the multiprocessors while the launch
before it is still finishing its last programs; each program then waits
(``griddepcontrol.wait``: the launch before it complete and its writes visible) before it
touches memory, and lets the launch after it be placed (``griddepcontrol.launch_dependents``).
The products are the same: every load and store of the kernel comes after the wait, so the
order of the launches' memory effects is the stream's. What it saves is the gap between two
launches (placing programs, their first instructions), which a CUDA graph keeps too.

Calling the wait first and then letting the next launch in keeps the chain one launch deep: a
launch's programs are placed only once every program of the one before has passed its own wait.

``STRATA_PDL=0`` turns it off (every launch then waits for the one before it as a stream does);
the interpreter and GPUs before sm_90 never use it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from strata.engine.kernels.inputs import INTERPRETED

try:  # Triton 3.4 and later
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - an older Triton: no PDL
    gdc_launch_dependents = gdc_wait = None

PDL_ENV = "STRATA_PDL"
_ON: dict[int, bool] = {}  # a device index: whether it has PDL


def pdl_on(device: torch.device) -> bool:
    """Whether launches on ``device`` use PDL: a GPU that has it (``_capable``) and
    ``STRATA_PDL`` not 0."""
    return pdl_wanted() and _capable(device)


def _capable(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or later, compiled (not the interpreter), under
    a Triton that has PDL."""
    if device.type != "cuda" or INTERPRETED or gdc_wait is None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _ON:
        _ON[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    return _ON[index]


def pdl_wanted() -> bool:
    """``STRATA_PDL``: 1 (the default) or 0; anything else is refused, naming it."""
    value = os.environ.get(PDL_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{PDL_ENV}={value!r}: want 0 (off) or 1 (on, where the GPU has it)")
    return value == "1"


def pdl_note(device: torch.device) -> str:
    """What a decode path line says of it: that launches overlap where it is on, that
    ``STRATA_PDL=0`` turned it off where the GPU has it, else nothing."""
    if not _capable(device):
        return ""
    if pdl_wanted():
        return ", launches overlapped (PDL)"
    return f", launches not overlapped ({PDL_ENV}=0)"


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """A launch's keyword arguments: the kernel's ``PDL`` constant and Triton's launch option."""
    if pdl_on(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def after_previous(PDL: tl.constexpr):
    """At a program's start, before any load or store: with ``PDL``, wait for the launch
    before this one, then let the launch after this one be placed."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
