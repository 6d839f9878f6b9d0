"""Copying a layer's experts from RAM before its routing has chosen them, in two launches.

A decode step reads a RAM-homed expert over PCIe only after its layer's top-k has chosen it: the
link idles while the rest of the layer computes, and then every miss of the layer queues on it.
The residual stream changes by a small update per layer (each block adds to it, none replaces
it), so a layer's router applied to the stream a layer earlier predicts the experts it will
choose:

1. ``predict``: the top P experts of those router logits; each whose home is in RAM becomes a
   prefetch (its id and host offset), the others an empty entry (id -1).
2. ``copy_experts``: on a side stream, each prefetch's bytes are copied from its RAM home into
   its staging slot (the layer's set of P slots; layers alternate between two sets, so a layer's
   copies never overwrite the slots the previous layer still reads). Layer l + 1's copies are
   queued before layer l's experts compute, on the other of two side streams, so they never wait
   for layer l's copies or expert kernels and the link stays busy.

``moe.route`` then points each chosen expert that was prefetched at its staging slot instead of
its RAM home. The staging slot holds the same bytes as the home, so the numbers are the same
whether a prediction was right or wrong; a wrong one costs the link time of its copy (and the
chosen expert is then read over PCIe as before), a right one moves its read off the layer's
critical path. Offsets are bytes from the decoder's anchor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.engine.kernels import MISSING
from strata.engine.kernels.inputs import INTERPRETED

WORD = 8  # bytes a copy moves per element (int64); slots and homes are 256-byte aligned
COPY_BLOCK = 64 if INTERPRETED else 2048  # words per program per iteration: 16 KiB on a GPU
COPY_PROGRAMS = 1 if INTERPRETED else 16  # programs per expert: enough reads in flight for PCIe


@triton.jit
def _predict_kernel(logits, homes, pf_ids, pf_src, E, P: tl.constexpr, EP: tl.constexpr,
                    PP: tl.constexpr):  # fmt: skip
    e = tl.arange(0, EP)
    left = tl.load(logits + e, mask=e < E, other=float("-inf"))
    jj = tl.arange(0, PP)
    sel = tl.zeros([PP], tl.int32)
    for j in tl.static_range(P):
        best = tl.max(left, 0)
        idx = tl.min(tl.where(left == best, e, EP), 0)  # the lowest id among equals, as route
        sel = tl.where(jj == j, idx, sel)
        left = tl.where(e == idx, float("-inf"), left)
    jm = jj < P
    src = tl.load(homes + sel, mask=jm, other=-1)
    tl.store(pf_ids + jj, tl.where(src != -1, sel, -1), mask=jm)
    tl.store(pf_src + jj, src, mask=jm)


@triton.jit
def _copy_kernel(words, pf_ids, pf_src, dst, n_words, stage_words, G: tl.constexpr,
                 BLOCK: tl.constexpr):  # fmt: skip
    j = tl.program_id(0)
    if tl.load(pf_ids + j) != -1:
        src = tl.multiple_of(tl.load(pf_src + j) // 8, 32)
        out = tl.multiple_of(dst.to(tl.int64) + j * stage_words, 32)  # int64: no wrap-around
        i = tl.arange(0, BLOCK)
        for start in range(tl.program_id(1) * BLOCK, n_words, G * BLOCK):
            m = start + i < n_words
            tl.store(words + out + start + i, tl.load(words + src + start + i, mask=m), mask=m)


@triton.jit
def _missed_kernel(words, ids, eoffs, homes, pf_ids, late, n_words, slot_words,
                   P: tl.constexpr, PP: tl.constexpr, G: tl.constexpr,
                   BLOCK: tl.constexpr):  # fmt: skip
    # decided from ids, homes and pf_ids only (never eoffs, which program (k, 0) rewrites)
    k = tl.program_id(0)
    e = tl.load(ids + k)
    home = tl.load(homes + e)
    jj = tl.arange(0, PP)
    staged = tl.sum((tl.load(pf_ids + jj, mask=jj < P, other=-1) == e).to(tl.int32), 0)
    if (home != -1) & (staged == 0):
        src = tl.multiple_of(home // 8, 32)
        out = tl.multiple_of(late.to(tl.int64) + k * slot_words, 32)  # int64: no wrap-around
        i = tl.arange(0, BLOCK)
        for start in range(tl.program_id(1) * BLOCK, n_words, G * BLOCK):
            m = start + i < n_words
            tl.store(words + out + start + i, tl.load(words + src + start + i, mask=m), mask=m)
        if tl.program_id(1) == 0:
            tl.store(eoffs + k, out * 8)


def predict(logits: torch.Tensor, homes: torch.Tensor, pf_ids: torch.Tensor,
            pf_src: torch.Tensor) -> None:  # fmt: skip
    """logits: [E] float32 (the layer's router on the stream before its attention), homes:
    int64 [E] (each expert's RAM home from the anchor, MISSING where it has none) ->
    pf_ids: int32 [P] (the top P experts with a RAM home, -1 for the others), pf_src: int64 [P]
    (their homes)."""
    E, P = logits.numel(), pf_ids.numel()
    _predict_kernel[(1,)](
        logits, homes, pf_ids, pf_src, E, P=P, EP=triton.next_power_of_2(E),
        PP=triton.next_power_of_2(P), num_warps=1,
    )  # fmt: skip


def copy_experts(anchor: torch.Tensor, pf_ids: torch.Tensor, pf_src: torch.Tensor, dst: int,
                 nbytes: int, stage_bytes: int, programs: int = COPY_PROGRAMS,
                 block: int = COPY_BLOCK, num_warps: int = 8) -> None:  # fmt: skip
    """For each prefetch j (pf_ids[j] != -1): ``nbytes`` from anchor + pf_src[j] to
    anchor + dst + j * stage_bytes (offsets and sizes multiples of 256), by ``programs``
    programs per prefetch moving ``block`` words each per iteration."""
    if dst % 256 or stage_bytes % 256 or nbytes % WORD:
        raise ValueError(f"staging at {dst} (+{stage_bytes} per slot) is not 256-byte aligned")
    P = pf_ids.numel()
    _copy_kernel[(P, programs)](
        anchor.view(torch.int64), pf_ids, pf_src, dst // WORD, nbytes // WORD,
        stage_bytes // WORD, G=programs, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip


def predict_reference(logits: torch.Tensor, homes: torch.Tensor, p: int) -> list[tuple[int, int]]:
    """(id, home) of each prefetch ``predict`` makes, in its order, (-1, MISSING) when empty."""
    order = sorted(range(logits.numel()), key=lambda e: (-float(logits[e]), e))[:p]
    return [(e, int(homes[e])) if int(homes[e]) != MISSING else (-1, MISSING) for e in order]


def copy_missed(anchor: torch.Tensor, ids: torch.Tensor, eoffs: torch.Tensor, homes: torch.Tensor,
                pf_ids: torch.Tensor, late: int, nbytes: int, slot_bytes: int) -> None:  # fmt: skip
    """After a layer's top-k: each chosen expert ``ids[k]`` with a RAM home that was not copied
    ahead (not in ``pf_ids``) is copied now into slot k at anchor + late (``nbytes`` of it, slots
    ``slot_bytes`` apart) and ``eoffs[k]`` points there, so the expert kernels read VRAM only.
    One copy of many programs keeps the link busier than the expert kernels' own reads would,
    and does not trail behind the next layer's copies ahead."""
    if late % 256 or slot_bytes % 256 or nbytes % WORD:
        raise ValueError(f"staging at {late} (+{slot_bytes} per slot) is not 256-byte aligned")
    K, P = ids.numel(), pf_ids.numel()
    _missed_kernel[(K, COPY_PROGRAMS)](
        anchor.view(torch.int64), ids, eoffs, homes, pf_ids, late // WORD, nbytes // WORD,
        slot_bytes // WORD, P=P, PP=triton.next_power_of_2(P), G=COPY_PROGRAMS,
        BLOCK=COPY_BLOCK, num_warps=8,
    )  # fmt: skip
