"""Dense matrix-vector products for one decode token, over repacked weights.

One launch covers up to three matrices that read the same input (attention's q, k and v), each in
its own type, their outputs side by side in ``y``. Folded in, as flags: the RMSNorm of the input
(``norm``: every program computes the scale itself, so nothing waits for a separate norm
kernel), or the input's output gate (``gate``: x · σ(gate), gated attention) or SwiGLU (``up``:
SiLU(x) · up, a shared expert's activation), the residual add (``residual``: y += W x, the
attention output projection), scaled by a gate (``res_gate``: y += σ(h · v) W x, a shared
expert's), a copy of the normalised input for later kernels (``h_out``: the MoE block reads
it), and the MoE routing after the router's logits (``route``: the program that finishes last
routes, so the step has no launch of its own for it).

The torch twin, ``matvec_reference``, dequantises and multiplies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from strata.engine.kernels.dot import (
    dot_rows,
    launch_regs,
    plane_offsets,
    step_warps,
    steps,
)
from strata.engine.kernels.inputs import (
    INTERPRETED,
    XIN_GATE,
    XIN_NORM,
    XIN_PLAIN,
    XIN_SWIGLU,
    rms_scale,
    sigmoid_dot,
    xin,
)
from strata.engine.kernels.moe import Routing, _route
from strata.engine.kernels.pdl import (
    after_previous,
    pdl_launch,
    prefetch_on,
    prefetch_rows,
    prefetch_spans,
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
    XIN: tl.constexpr,
    BN: tl.constexpr,
    T: tl.constexpr,
    TAIL: tl.constexpr,
):
    rows = pid * BN + tl.arange(0, BN)
    ok = rows < n
    acc = dot_rows(w, o1, o2, o3, o4, rows, ok, K, x, nw, rms, QT, XIN, BN, T, TAIL)
    return acc, base + rows, ok


@triton.jit
def _prefetch(w, o1, r0, n, ra, rb, BN: tl.constexpr):
    """A program's rows of a matrix's first two planes asked of the L2 (``prefetch_rows``)."""
    prefetch_rows(w, r0, n, ra, BN)
    prefetch_rows(w + o1, r0, n, rb, BN)


@triton.jit
def _matvec_kernel(
    x, nw, eps, y, h_out, bias, gh, gv, GD, K: tl.constexpr,
    w0, a1, a2, a3, a4, n0,
    w1, b1, b2, b3, b4, n1,
    w2, c1, c2, c3, c4, n2,
    ticket, table, ids, wts, eoffs, counts, pf_ids, stage, stage_bytes, pf_stats, E,
    pa0, pb0, pa1, pb1, pa2, pb2,  # each matrix's row bytes in its first two planes (prefetch)
    Q0: tl.constexpr, Q1: tl.constexpr, Q2: tl.constexpr,  # the three matrices' types
    U0: tl.constexpr, U1: tl.constexpr, U2: tl.constexpr,  # and their units per step
    V0: tl.constexpr, V1: tl.constexpr, V2: tl.constexpr,  # and of a last, narrower one
    NSEG: tl.constexpr, XIN: tl.constexpr, ADD_RES: tl.constexpr, STORE_H: tl.constexpr,
    BN: tl.constexpr, HAS_BIAS: tl.constexpr, RES_GATE: tl.constexpr,
    ROUTE: tl.constexpr, TOPK: tl.constexpr, EP: tl.constexpr, KP: tl.constexpr,
    NORM: tl.constexpr, P: tl.constexpr, LATE: tl.constexpr, S: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    nb0 = tl.cdiv(n0, BN)
    nb1 = tl.cdiv(n1, BN)
    if PREFETCH:  # the weights never depend on the launch before: their reads begin now
        if NSEG == 1 or pid < nb0:
            _prefetch(w0, a1, pid * BN, n0, pa0, pb0, BN)
        elif NSEG == 2 or pid < nb0 + nb1:
            _prefetch(w1, b1, (pid - nb0) * BN, n1, pa1, pb1, BN)
        else:
            _prefetch(w2, c1, (pid - nb0 - nb1) * BN, n2, pa2, pb2, BN)
    after_previous(PDL)
    # RMSNorm(x) . w = rms * ((x * nw) . w): the weights' loads need not wait for the scale
    if NSEG == 1:
        acc, out, ok = _seg(pid, w0, a1, a2, a3, a4, n0, 0, K, x, nw, 1.0, Q0, XIN, BN, U0, V0)
    elif pid < nb0:
        acc, out, ok = _seg(pid, w0, a1, a2, a3, a4, n0, 0, K, x, nw, 1.0, Q0, XIN, BN, U0, V0)
    elif NSEG == 2:
        acc, out, ok = _seg(
            pid - nb0, w1, b1, b2, b3, b4, n1, n0, K, x, nw, 1.0, Q1, XIN, BN, U1, V1
        )
    elif pid < nb0 + nb1:
        acc, out, ok = _seg(
            pid - nb0, w1, b1, b2, b3, b4, n1, n0, K, x, nw, 1.0, Q1, XIN, BN, U1, V1
        )
    else:
        acc, out, ok = _seg(
            pid - nb0 - nb1,
            w2,
            c1,
            c2,
            c3,
            c4,
            n2,
            n0 + n1,
            K,
            x,
            nw,
            1.0,
            Q2,
            XIN,
            BN,
            U2,
            V2,
        )
    if XIN == XIN_NORM:
        rms = rms_scale(x, K, eps, 1024)
        acc = acc * rms
    if HAS_BIAS:  # (W x + b, then the residual: the reference's order)
        acc = acc + tl.load(bias + out, mask=ok, other=0.0)
    if RES_GATE:  # every program takes the gate over all of h (a few KiB) itself
        acc = acc * sigmoid_dot(gh, gv, GD, 256)
    if ADD_RES:
        acc = tl.load(y + out, mask=ok, other=0.0) + acc
    tl.store(y + out, acc, mask=ok)
    if STORE_H:
        if pid == 0:
            k = tl.arange(0, 1024)
            for k0 in tl.static_range(0, K, 1024):
                m = k0 + k < K
                tl.store(h_out + k0 + k, xin(x, nw, rms, k0 + k, m, XIN), mask=m)
    if ROUTE:
        # The ticket. Every thread's stores of its rows come before the barrier; thread 0's
        # atomic add (Triton's default: acq_rel at GPU scope) then releases them all (as a
        # CUTLASS semaphore does after __syncthreads), and the program drawing the last ticket
        # acquires every other program's release: all E logits are visible to its loads (the
        # acquire also drops stale lines from its multiprocessor's L1). It routes (the code
        # ``moe.route``'s launch runs; its sums in an order that holds with any number of
        # warps) and sets the counter back to 0, which no other program of this launch touches
        # any more: the next launch (a later layer, a graph replay) finds 0. In Triton's
        # interpreter the programs run one after another and the last takes this path too.
        tl.debug_barrier()
        if tl.atomic_add(ticket, 1) == tl.num_programs(0) - 1:
            e = tl.arange(0, EP)
            lg = tl.load(y + e, mask=e < E, other=float("-inf"))
            _route(lg, table, ids, wts, eoffs, counts, pf_ids, stage, stage_bytes, pf_stats, E,
                   TOPK, EP, KP, NORM, P, LATE, S)  # fmt: skip
            tl.store(ticket, 0)


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
    route: Routing | None = None,
    gate: torch.Tensor | None = None,
    up: torch.Tensor | None = None,
    res_gate: tuple[torch.Tensor, torch.Tensor] | None = None,
    maxnreg: int | None = None,
) -> None:
    """y[...] = W_i x for each matrix in ``mats`` (their rows side by side in ``y``), or
    y += W x with ``residual``; x is RMSNorm'd with the weight ``norm`` first when given, and
    written to ``h_out`` normalised. Every matrix takes ``len(x)`` inputs. x, y: float32.
    The input may instead be x · σ(``gate``) (gated attention's output) or SiLU(x) · ``up``
    (a SwiGLU: x the gate half); at most one of norm, gate and up.
    ``bias``: float32 [sum of rows], added to the products (before the residual; gpt-oss).
    ``res_gate`` (h, v), with the residual: y += σ(h · v) · (W x) (a shared expert's gate).
    ``route``: y holds one matrix's router logits, and the same launch then routes as
    ``moe.route(y, ...)`` does, bit for bit (its ``ticket`` counts the programs).
    ``num_warps`` (None: one thread per unit of a step), ``bn`` and ``maxnreg`` (a register
    cap a thread; None: the compiler's choice) are tuning knobs."""
    if not 1 <= len(mats) <= 3:
        raise ValueError(f"matvec takes 1 to 3 matrices, got {len(mats)}")
    K = x.numel()
    for m in mats:
        if m.cols != K:
            raise ValueError(f"a {m.rows}x{m.cols} matrix cannot multiply {K} inputs")
    given = [n for n, t in (("norm", norm), ("gate", gate), ("up", up)) if t is not None]
    if len(given) > 1:
        raise ValueError(f"one transform of the input at most, got {' and '.join(given)}")
    for name, t in (("gate", gate), ("up", up)):
        if t is not None and (t.numel() != K or t.dtype != x.dtype):
            raise ValueError(f"{name}: {t.numel()} {t.dtype} values for {K} {x.dtype} inputs")
    if res_gate is not None:
        if not residual:
            raise ValueError("res_gate scales the residual add: it needs residual")
        gh, gv = res_gate
        if gh.numel() != gv.numel() or gh.dtype != torch.float32 or gv.dtype != torch.float32:
            raise ValueError(f"res_gate: h and v of one size in float32, got {gh.numel()} "
                             f"{gh.dtype} and {gv.numel()} {gv.dtype}")  # fmt: skip
    if y.numel() < sum(m.rows for m in mats):
        raise ValueError(f"y holds {y.numel()} values, the matrices give more")
    if residual and len(mats) != 1:
        raise ValueError("a residual add takes one matrix")
    if h_out is not None and norm is None:
        raise ValueError("h_out is the normalised input: it needs norm")
    if bias is not None and (bias.numel() != sum(m.rows for m in mats) or bias.dtype != y.dtype):
        raise ValueError(f"a bias of {bias.numel()} {bias.dtype} values for "
                         f"{sum(m.rows for m in mats)} {y.dtype} rows")  # fmt: skip
    rargs: list[object] = [y, y, y, y, y, y, y, 0, 0, y, 0]  # (unread without a route)
    rconsts: dict[str, object] = dict(TOPK=1, EP=1, KP=1, NORM=False, P=0, LATE=False, S=1)
    if route is not None:
        if len(mats) != 1 or residual:
            raise ValueError("a route follows one router matrix's logits, with no residual")
        if route.ticket is None or route.ticket.numel() != 1 or route.ticket.dtype != torch.int32:
            raise ValueError("a route inside the matvec needs its ticket: int32 [1], 0")
        args_r, consts = route.launch_args(mats[0].rows)
        rargs = [route.ticket, *args_r]
        rconsts = dict(consts, TOPK=consts["K"])
        del rconsts["K"]
    segs = list(mats) + [mats[0]] * (3 - len(mats))
    nw = next((t for t in (norm, gate, up) if t is not None), x)
    xform = XIN_NORM if norm is not None else XIN_GATE if gate is not None else XIN_SWIGLU
    xform = xform if given else XIN_PLAIN
    gh, gv = res_gate if res_gate is not None else (y, y)
    args: list[object] = [x, nw, eps, y, h_out if h_out is not None else y,
                          y if bias is None else bias, gh, gv, gh.numel(), K]  # fmt: skip
    for m in segs:
        args += [m.data, *plane_offsets(m.lay.offsets), m.rows]
    args += rargs
    prefetch = prefetch_on(y.device)
    for m in segs:
        args += prefetch_spans(m.lay) if prefetch else (0, 0)
    types = [int(m.lay.qtype) for m in segs]
    st = [steps(t, K) for t in types]
    units = [u for u, _ in st]
    grid = (sum(triton.cdiv(m.rows, bn) for m in mats),)
    _matvec_kernel[grid](
        *args,
        Q0=types[0], Q1=types[1], Q2=types[2], U0=units[0], U1=units[1], U2=units[2],
        V0=st[0][1], V1=st[1][1], V2=st[2][1],
        NSEG=len(mats), XIN=xform.value, ADD_RES=residual,
        STORE_H=h_out is not None, BN=bn, HAS_BIAS=bias is not None, RES_GATE=res_gate is not None,
        ROUTE=route is not None, **pdl_launch(y.device), PREFETCH=prefetch,
        num_warps=num_warps or max(step_warps(*t) for t in st[: len(mats)]), **rconsts,
        **launch_regs(maxnreg),
    )  # fmt: skip


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def matvec_reference(
    x: torch.Tensor,
    mats: Sequence[Mat],
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    bias: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    up: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch twin of ``matvec`` (without the residual): [sum of rows] float32."""
    h = rms_norm_reference(x, norm, eps) if norm is not None else x
    if gate is not None:
        h = h * torch.sigmoid(gate)
    if up is not None:
        h = torch.nn.functional.silu(h) * up
    outs = [dequantize_repacked(m.data, m.lay.qtype, (m.rows, m.cols)) @ h for m in mats]
    out = torch.cat(outs)
    return out if bias is None else out + bias
