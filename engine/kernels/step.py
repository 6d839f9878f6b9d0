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


@triton.jit
def _advance_kernel(best, tok, pos, ring, step):
    i = tl.load(step)
    t = tl.load(best).to(tl.int32)
    tl.store(tok, t)
    tl.store(pos, tl.load(pos) + 1)
    tl.store(ring + i % 2, t)
    tl.store(step, i + 1)


def advance(logits: torch.Tensor, tok: torch.Tensor, pos: torch.Tensor, ring: torch.Tensor,
            step: torch.Tensor) -> None:  # fmt: skip
    """tok <- argmax(logits), pos += 1, ring[step % 2] <- the token, step += 1 (int32 [1] each,
    ring int32 [2]); the first index among equal maxima, as torch.argmax."""
    best = torch.argmax(logits)
    _advance_kernel[(1,)](best, tok, pos, ring, step, num_warps=1)


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
