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

``STRATA_PDL=2`` also has each program of the dense matvecs (q/k/v, o, the router, the head)
ask the L2 for its rows' weights before it waits (one bulk prefetch a plane, Hopper's
``cp.async.bulk.prefetch.L2``): the weights never depend on the launch before, so their reads
may begin while it finishes. ``STRATA_PDL=0`` turns it off (every launch then waits for the one
before it as a stream does); the interpreter and GPUs before sm_90 never use it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from strata.engine.kernels.inputs import INTERPRETED
from strata.engine.quant.repack import RepackedLayout

try:  # Triton 3.4 and later
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - an older Triton: no PDL
    gdc_launch_dependents = gdc_wait = None

PDL_ENV = "STRATA_PDL"
_ON: dict[int, bool] = {}  # a device index: whether it has PDL


def pdl_on(device: torch.device) -> bool:
    """Whether launches on ``device`` use PDL: a GPU that has it (``_capable``) and
    ``STRATA_PDL`` not 0."""
    return pdl_mode() > 0 and _capable(device)


def prefetch_on(device: torch.device) -> bool:
    """Whether the dense matvecs ask the L2 for their weights before the wait
    (``STRATA_PDL=2``, on a GPU that has PDL)."""
    return pdl_mode() == 2 and _capable(device)


def _capable(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or later, compiled (not the interpreter), under
    a Triton that has PDL."""
    if device.type != "cuda" or INTERPRETED or gdc_wait is None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _ON:
        _ON[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    return _ON[index]


def pdl_mode() -> int:
    """``STRATA_PDL``: 1 (the default), 0 (off) or 2 (with the matvecs' prefetch); anything
    else is refused, naming it."""
    value = os.environ.get(PDL_ENV, "1").strip()
    if value not in ("0", "1", "2"):
        raise ValueError(
            f"{PDL_ENV}={value!r}: want 0 (off), 1 (on, where the GPU has it) or 2 (on, with "
            "the matvecs' weights prefetched)"
        )
    return int(value)


def pdl_note(device: torch.device) -> str:
    """What a decode path line says of it: that launches overlap where it is on, that
    ``STRATA_PDL=0`` turned it off where the GPU has it, else nothing."""
    if not _capable(device):
        return ""
    mode = pdl_mode()
    if mode == 2:
        return ", launches overlapped (PDL), the matvecs' weights prefetched ahead"
    if mode == 1:
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


def prefetch_spans(lay: RepackedLayout) -> tuple[int, int]:
    """A repacked matrix's row bytes in its first two planes (the quants, and the second
    plane: Q6_K's high bits, the K-quants' scales), for ``prefetch_rows``; 0 for a plane that
    has none or whose rows are not multiples of 16 bytes (a bulk prefetch's unit)."""
    rb = [b if b % 16 == 0 else 0 for b in lay.row_bytes[:2]]
    return rb[0], rb[1] if len(rb) > 1 else 0


@triton.jit
def prefetch_rows(w, r0, n, rb, BN: tl.constexpr):
    """Ask the L2 for rows r0 .. min(r0 + BN, n) - 1 of a plane of ``rb`` bytes a row at
    ``w`` (uint8; rb 0: nothing), one bulk prefetch from the program's first thread."""
    if rb > 0:
        nbytes = (tl.minimum(n - r0, BN) * rb).to(tl.int32)
        at = w + r0.to(tl.int64) * rb
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [at, nbytes], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
