"""The end of a decode step on the device: the greedy token becomes the next step's input.

After the output head, ``advance`` takes the argmax of the logits, writes it as the next input
token, moves the position on by one and files the token in a two-slot ring (slot = step number
mod 2) that the host reads without waiting for later steps. A greedy generation can then run one
step ahead of the host: step n + 1 is already running while the host handles token n. The host
still writes the input itself whenever it chooses a token another way, or ``choose`` writes it
on the device (the argmax of logits a grammar's mask has changed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.engine.kernels.inputs import KEY_MIN, ordered_bits

ARGMAX_BLOCK = 4096  # logits a program of ``advance`` reads
_LOW: tl.constexpr = tl.constexpr((1 << 31) - 1)


@triton.jit
def _advance_kernel(logits, N, best, tok, pos, ring, step, BLOCK: tl.constexpr):
    # Each program's largest logit and its index as one int64 (``ordered_bits`` high, the
    # index reversed low, so among equal maxima the first index is the largest key), into
    # best[0] by an atomic max. The ticket (best[1]): thread 0's atomic max comes before its
    # add (acq_rel, GPU scope), so the program drawing the last ticket reads every program's
    # max; it writes the step's token, moves the position and the step on, and sets both
    # words back (KEY_MIN, 0) for the next launch (a graph replay). In Triton's interpreter
    # the programs run one after another and the last takes this path too.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(logits + offs, mask=offs < N, other=float("-inf"))
    key = (ordered_bits(v).to(tl.int64) << 32) | (-offs + _LOW)
    tl.atomic_max(best, tl.max(key, 0))
    if tl.atomic_add(best + 1, 1) == tl.num_programs(0) - 1:
        k = tl.atomic_xchg(best, KEY_MIN)
        t = (-(k & _LOW) + _LOW).to(tl.int32)
        i = tl.load(step)
        tl.store(tok, t)
        tl.store(pos, tl.load(pos) + 1)
        tl.store(ring + i % 2, t)
        tl.store(step, i + 1)
        tl.store(best + 1, 0)


def argmax_scratch(device: torch.device) -> torch.Tensor:
    """``advance``'s two words: the running key (KEY_MIN) and the ticket (0) between launches;
    one per runner, as its graph keeps it."""
    return torch.tensor([-(1 << 63), 0], dtype=torch.int64, device=device)


def advance(logits: torch.Tensor, tok: torch.Tensor, pos: torch.Tensor, ring: torch.Tensor,
            step: torch.Tensor, scratch: torch.Tensor) -> None:  # fmt: skip
    """tok <- argmax(logits), pos += 1, ring[step % 2] <- the token, step += 1 (int32 [1] each,
    ring int32 [2]); the first index among equal maxima, as torch.argmax (a NaN aside), in one
    launch (torch's argmax took two reductions, 16 µs of a Qwen3-30B-A3B step on an H200, and
    this a third launch). ``scratch``: ``argmax_scratch``'s."""
    n = logits.numel()
    if scratch.numel() != 2 or scratch.dtype != torch.int64:
        raise ValueError(f"advance's scratch: int64 [2] from argmax_scratch, got {scratch.numel()} "
                         f"{scratch.dtype}")  # fmt: skip
    if not 0 < n < 2**31:
        raise ValueError(f"argmax over {n} logits: want 1 to 2^31 - 1")
    grid = (triton.cdiv(n, ARGMAX_BLOCK),)
    _advance_kernel[grid](logits, n, scratch, tok, pos, ring, step, BLOCK=ARGMAX_BLOCK,
                          num_warps=4)  # fmt: skip


def choose(logits: torch.Tensor, tok: torch.Tensor, ring: torch.Tensor, slot: int) -> None:
    """tok <- argmax(logits), ring[slot] <- the same: the step's token chosen again after its
    logits changed (a grammar's mask); the position and the step count stay as ``advance``
    left them. Nothing waits."""
    best = torch.argmax(logits)
    tok.copy_(best)
    ring[slot : slot + 1].copy_(best)


def advance_reference(logits: torch.Tensor, pos: int, step: int) -> tuple[int, int, int]:
    """(next token, next position, ring slot) as ``advance`` leaves them."""
    return int(torch.argmax(logits)), pos + 1, step % 2
