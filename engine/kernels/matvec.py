"""Dense matrix-vector products for one decode token, over repacked weights.

One launch covers up to three matrices that read the same input (attention's q, k and v), each in
its own type, their outputs side by side in ``y``. Folded in, as flags: the RMSNorm of the input
(``norm``: every program computes the scale itself, so nothing waits for a separate norm
kernel), the residual add (``residual``: y += W x, the attention output projection), and a copy
of the normalised input for later kernels (``h_out``: the MoE block reads it).

The torch twin, ``matvec_reference``, dequantises and multiplies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from strata.engine.kernels.dot import (
    INTERPRETED,
    dot_rows,
    plane_offsets,
    rms_scale,
    units_per_step,
    warps_for,
    xin,
)
from strata.engine.quant.repack import RepackedLayout, dequantize_repacked


@dataclass(frozen=True)
class Mat:
    """A repacked matrix as the kernels take it: its bytes and their layout."""

    data: torch.Tensor  # [>= lay.nbytes] uint8
    lay: RepackedLayout

    @property
    def rows(self) -> int:
        return self.lay.rows

    @property
    def cols(self) -> int:
        return self.lay.cols


@triton.jit
def _seg(
    pid,
    w,
    o1,
    o2,
    o3,
    o4,
    n,
    base,
    K: tl.constexpr,
    x,
    nw,
    rms,
    QT: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BN: tl.constexpr,
    T: tl.constexpr,
):
    rows = pid * BN + tl.arange(0, BN)
    ok = rows < n
    acc = dot_rows(w, o1, o2, o3, o4, rows, ok, K, x, nw, rms, QT, HAS_NORM, BN, T)
    return acc, base + rows, ok


@triton.jit
def _matvec_kernel(
    x, nw, eps, y, h_out, bias, K: tl.constexpr,
    w0, a1, a2, a3, a4, n0,
    w1, b1, b2, b3, b4, n1,
    w2, c1, c2, c3, c4, n2,
    Q0: tl.constexpr, Q1: tl.constexpr, Q2: tl.constexpr,  # the three matrices' types
    U0: tl.constexpr, U1: tl.constexpr, U2: tl.constexpr,  # and their units per step
    NSEG: tl.constexpr, HAS_NORM: tl.constexpr, ADD_RES: tl.constexpr, STORE_H: tl.constexpr,
    BN: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    # RMSNorm(x) . w = rms * ((x * nw) . w): the weights' loads need not wait for the scale
    nb0 = tl.cdiv(n0, BN)
    nb1 = tl.cdiv(n1, BN)
    if NSEG == 1:
        acc, out, ok = _seg(pid, w0, a1, a2, a3, a4, n0, 0, K, x, nw, 1.0, Q0, HAS_NORM, BN, U0)
    elif pid < nb0:
        acc, out, ok = _seg(pid, w0, a1, a2, a3, a4, n0, 0, K, x, nw, 1.0, Q0, HAS_NORM, BN, U0)
    elif NSEG == 2:
        acc, out, ok = _seg(
            pid - nb0, w1, b1, b2, b3, b4, n1, n0, K, x, nw, 1.0, Q1, HAS_NORM, BN, U1
        )
    elif pid < nb0 + nb1:
        acc, out, ok = _seg(
            pid - nb0, w1, b1, b2, b3, b4, n1, n0, K, x, nw, 1.0, Q1, HAS_NORM, BN, U1
        )
    else:
        acc, out, ok = _seg(
            pid - nb0 - nb1, w2, c1, c2, c3, c4, n2, n0 + n1, K, x, nw, 1.0, Q2, HAS_NORM, BN, U2
        )
    if HAS_NORM:
        rms = rms_scale(x, K, eps, 1024)
        acc = acc * rms
    if HAS_BIAS:  # (W x + b, then the residual: the reference's order)
        acc = acc + tl.load(bias + out, mask=ok, other=0.0)
    if ADD_RES:
        acc = tl.load(y + out, mask=ok, other=0.0) + acc
    tl.store(y + out, acc, mask=ok)
    if STORE_H:
        if pid == 0:
            k = tl.arange(0, 1024)
            for k0 in tl.static_range(0, K, 1024):
                m = k0 + k < K
                tl.store(h_out + k0 + k, xin(x, nw, rms, k0 + k, m, HAS_NORM), mask=m)


BN = 128 if INTERPRETED else 4  # rows per program (each thread holds all of them)


def matvec(
    y: torch.Tensor,
    x: torch.Tensor,
    mats: Sequence[Mat],
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: bool = False,
    h_out: torch.Tensor | None = None,
    bn: int = BN,
    num_warps: int | None = None,
    bias: torch.Tensor | None = None,
) -> None:
    """y[...] = W_i x for each matrix in ``mats`` (their rows side by side in ``y``), or
    y += W x with ``residual``; x is RMSNorm'd with the weight ``norm`` first when given, and
    written to ``h_out`` normalised. Every matrix takes ``len(x)`` inputs. x, y: float32.
    ``bias``: float32 [sum of rows], added to the products (before the residual; gpt-oss).
    ``num_warps`` (None: one thread per unit of a step) and ``bn`` are tuning knobs."""
    if not 1 <= len(mats) <= 3:
        raise ValueError(f"matvec takes 1 to 3 matrices, got {len(mats)}")
    K = x.numel()
    for m in mats:
        if m.cols != K:
            raise ValueError(f"a {m.rows}x{m.cols} matrix cannot multiply {K} inputs")
    if y.numel() < sum(m.rows for m in mats):
        raise ValueError(f"y holds {y.numel()} values, the matrices give more")
    if residual and len(mats) != 1:
        raise ValueError("a residual add takes one matrix")
    if h_out is not None and norm is None:
        raise ValueError("h_out is the normalised input: it needs norm")
    if bias is not None and (bias.numel() != sum(m.rows for m in mats) or bias.dtype != y.dtype):
        raise ValueError(f"a bias of {bias.numel()} {bias.dtype} values for "
                         f"{sum(m.rows for m in mats)} {y.dtype} rows")  # fmt: skip
    segs = list(mats) + [mats[0]] * (3 - len(mats))
    nw = norm if norm is not None else x
    args: list[object] = [x, nw, eps, y, h_out if h_out is not None else y,
                          y if bias is None else bias, K]  # fmt: skip
    for m in segs:
        args += [m.data, *plane_offsets(m.lay.offsets), m.rows]
    types = [int(m.lay.qtype) for m in segs]
    units = [units_per_step(t, K) for t in types]
    grid = (sum(triton.cdiv(m.rows, bn) for m in mats),)
    _matvec_kernel[grid](
        *args,
        Q0=types[0], Q1=types[1], Q2=types[2], U0=units[0], U1=units[1], U2=units[2],
        NSEG=len(mats), HAS_NORM=norm is not None, ADD_RES=residual,
        STORE_H=h_out is not None, BN=bn, HAS_BIAS=bias is not None,
        num_warps=num_warps or max(warps_for(u) for u in units[: len(mats)]),
    )  # fmt: skip


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def matvec_reference(
    x: torch.Tensor,
    mats: Sequence[Mat],
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch twin of ``matvec`` (without the residual): [sum of rows] float32."""
    h = rms_norm_reference(x, norm, eps) if norm is not None else x
    outs = [dequantize_repacked(m.data, m.lay.qtype, (m.rows, m.cols)) @ h for m in mats]
    out = torch.cat(outs)
    return out if bias is None else out + bias
