"""The RMSNorm as a launch of its own, for ``profile --sweep``'s "+norm" rows: the norm written
once (``rms_norm``), then a plain matvec over it, against the matvec with the norm folded in
(each of its programs re-reads the input, the norm's weights and the input again for the
scale: for a q/k/v program of 4 rows, 24 KiB of L2 reads beside 4.6 KiB of Q4_K weights).
An experiment's tool: the engine folds the norm in until the sweep shows otherwise."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.engine.kernels.inputs import rms_scale

SLICE = 256  # elements a program writes (every program sums all of x for the scale)


@triton.jit
def _norm_kernel(x, nw, h, eps, K: tl.constexpr, SLICE: tl.constexpr):
    k = tl.program_id(0) * SLICE + tl.arange(0, SLICE)
    m = k < K
    rms = rms_scale(x, K, eps, 1024)
    v = tl.load(x + k, mask=m, other=0.0) * rms * tl.load(nw + k, mask=m, other=0.0)
    tl.store(h + k, v, mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """out = x * rsqrt(mean(x^2) + eps) * weight, float32 vectors of one size (the reference's
    order of products, ``matvec.rms_norm_reference``)."""
    K = x.numel()
    got = [(t.numel(), t.dtype) for t in (x, weight, out)]
    if any(g != (K, torch.float32) for g in got):
        raise ValueError(f"rms_norm: float32 x, weight and out of one size, got {got}")
    _norm_kernel[(triton.cdiv(K, SLICE),)](x, weight, out, eps, K=K, SLICE=SLICE)
