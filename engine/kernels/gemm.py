"""Matrix products of a prompt chunk on tensor cores, over repacked weights, dequantised in
registers.

One kernel serves every product of a prefill chunk:

- **dense** (``gemm``): y[m] = W a[m] for the rows of a chunk (q, k, v, the output projection with
  the residual added, the router, the output head);
- **grouped by expert** (``moe_gate_up``, ``moe_down``): the chunk's (token, choice) assignments
  sorted by expert into blocks of BM rows (``group_by_expert``, on the device, fixed-size buffers,
  no host sync), each block one expert's: its weights are found through the layer's expert table
  (byte offsets from an anchor, as the decode kernels find them) and a block whose expert has no
  readable home (``MISSING``) or that is padding is skipped. gate/up write SiLU(gate) * up in the
  sorted order; down writes each assignment's output times its routing weight back in
  assignment order, so the k outputs of a token are summed afterwards in a fixed order (no
  atomics: the same bits on every run and from every tier).

A program's tile is [BM rows of activations] x [BN rows of W]; each step covers S units of 32
elements along K (a K-quant or IQ sub-block, a block of a 32-element type; the gathered types'
halves come from their decoders in ``quant.unit_kernels``). In every 4-bit layout
byte 16u + k of a row's quants holds elements 32u + k (low nibble) and 32u + 16 + k (high
nibble; Q5_K's fifth bits and Q6_K's high two sit in planes of their own), so a step
dequantises two [BN, S * 16] half tiles — the low and the high halves of its units — to float16
and multiplies each with the matching half of the activations: two ``tl.dot`` s on the tensor
cores, accumulating in float32 (F32 and BF16 weights multiply in TF32, whose range they need).
Activations are float16 (the normalised hidden state, the attention output, SiLU(gate) * up), as
in llama.cpp's cuBLAS path.

The torch twin, ``gemm_reference``, dequantises (the reference values) and multiplies in float32;
the tests bound the difference.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch
import triton
import triton.language as tl

from strata.engine.kernels.dot import (
    plane_offsets,
)
from strata.engine.kernels.inputs import (
    BF16,
    F16,
    F32,
    INTERPRETED,
    IQ4_XS,
    Q4_0,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_0,
)
from strata.engine.quant.repack import RepackedLayout, dequantize_repacked
from strata.engine.quant.unit_kernels import K_UNITS, nl_level, u_float, unit_halves

Q = gguf.GGMLQuantizationType
UNIT = 32  # elements of one unit along K


@triton.jit
def _f16_at(w, off, at, mask):
    return tl.load((w + off).to(tl.pointer_type(tl.float16)) + at, mask=mask, other=0).to(
        tl.float32
    )


@triton.jit
def w_halves(wp, o1, o2, o3, o4, r, rm, u, um, K: tl.constexpr, QT: tl.constexpr):
    """Rows r [BN] (int64) x units u [S] of the repacked ``QT`` matrix at ``wp``: the low and
    high halves of each unit (elements 32u + k and 32u + 16 + k, k < 16) as float32
    ([BN, S, 16], [BN, S, 16])."""
    NK: tl.constexpr = K // 32  # units in a row
    k = tl.arange(0, 16)
    m3 = rm[:, None, None] & um[None, :, None]
    m2 = rm[:, None] & um[None, :]
    blk = (r * (NK // K_UNITS))[:, None] + (u // K_UNITS)[None, :]  # [BN, S]: its 256-block
    if QT == Q4_K:
        q_at = (r * (NK * 16))[:, None, None] + (16 * u)[None, :, None] + k[None, None, :]
        q = tl.load(wp + q_at, mask=m3, other=0).to(tl.int32)
        s_at = (r * NK)[:, None] + u[None, :]
        sc = tl.load(wp + o1 + s_at, mask=m2, other=0).to(tl.float32)
        mn = tl.load(wp + o2 + s_at, mask=m2, other=0).to(tl.float32)
        ds = (_f16_at(wp, o3, blk, m2) * sc)[:, :, None]  # the reference's d * sc, dmin * mn
        dm = (_f16_at(wp, o4, blk, m2) * mn)[:, :, None]
        lo = u_float(q & 15, 0.0) * ds - dm
        hi = u_float(q >> 4, 0.0) * ds - dm
    elif QT == Q5_K:
        q_at = (r * (NK * 16))[:, None, None] + (16 * u)[None, :, None] + k[None, None, :]
        q = tl.load(wp + q_at, mask=m3, other=0).to(tl.int32)
        s_at = (r * NK)[:, None] + u[None, :]
        hw = tl.load((wp + o1).to(tl.pointer_type(tl.uint32)) + s_at, mask=m2, other=0)
        h_lo = ((hw[:, :, None] >> k[None, None, :]) & 1).to(tl.int32)  # fifth bits
        h_hi = ((hw[:, :, None] >> (k + 16)[None, None, :]) & 1).to(tl.int32)
        sc = tl.load(wp + o2 + s_at, mask=m2, other=0).to(tl.float32)
        mn = tl.load(wp + o3 + s_at, mask=m2, other=0).to(tl.float32)
        ds = (_f16_at(wp, o4, 2 * blk, m2) * sc)[:, :, None]  # dd: d, then dmin, per block
        dm = (_f16_at(wp, o4, 2 * blk + 1, m2) * mn)[:, :, None]
        lo = u_float((q & 15) | (h_lo << 4), 0.0) * ds - dm
        hi = u_float((q >> 4) | (h_hi << 4), 0.0) * ds - dm
    elif QT == IQ4_XS:
        q_at = (r * (NK * 16))[:, None, None] + (16 * u)[None, :, None] + k[None, None, :]
        q = tl.load(wp + q_at, mask=m3, other=0).to(tl.int32)
        sc = tl.load(wp + o1 + (r * NK)[:, None] + u[None, :], mask=m2, other=0)
        dl = (_f16_at(wp, o2, blk, m2) * sc.to(tl.int8, bitcast=True).to(tl.float32))[:, :, None]
        lo = dl * nl_level(q & 15)
        hi = dl * nl_level(q >> 4)
    elif QT == Q4_0:
        q_at = (r * (NK * 16))[:, None, None] + (16 * u)[None, :, None] + k[None, None, :]
        q = tl.load(wp + q_at, mask=m3, other=0).to(tl.int32)
        d = _f16_at(wp, o1, (r * NK)[:, None] + u[None, :], m2)[:, :, None]
        lo = d * u_float(q & 15, 8.0)
        hi = d * u_float(q >> 4, 8.0)
    elif QT == Q6_K:
        q_at = (r * (NK * 16))[:, None, None] + (16 * u)[None, :, None] + k[None, None, :]
        ql = tl.load(wp + q_at, mask=m3, other=0).to(tl.int32)
        h_at = (r * (NK * 8))[:, None, None] + (16 * (u // 2))[None, :, None] + k[None, None, :]
        qh = tl.load(wp + o1 + h_at, mask=m3, other=0).to(tl.int32)
        sh = (4 * (u % 2))[None, :, None]
        ql_lo = (ql & 15) | (((qh >> sh) & 3) << 4)
        ql_hi = (ql >> 4) | (((qh >> (sh + 2)) & 3) << 4)
        s_at = (r * (NK * 2))[:, None] + (16 * (u // 8) + u % 8)[None, :]
        s_lo = tl.load(wp + o2 + s_at, mask=m2, other=0).to(tl.int8, bitcast=True)
        s_hi = tl.load(wp + o2 + s_at + 8, mask=m2, other=0).to(tl.int8, bitcast=True)
        d = _f16_at(wp, o3, blk, m2)
        lo = (d * s_lo.to(tl.float32))[:, :, None] * u_float(ql_lo, 32.0)
        hi = (d * s_hi.to(tl.float32))[:, :, None] * u_float(ql_hi, 32.0)
    elif QT == Q8_0:
        q_at = (r * K)[:, None, None] + (32 * u)[None, :, None] + k[None, None, :]
        q_lo = tl.load(wp + q_at, mask=m3, other=0).to(tl.int8, bitcast=True).to(tl.int32)
        q_hi = tl.load(wp + q_at + 16, mask=m3, other=0).to(tl.int8, bitcast=True).to(tl.int32)
        d = _f16_at(wp, o1, (r * NK)[:, None] + u[None, :], m2)[:, :, None]
        lo = u_float(q_lo + 128, 128.0) * d
        hi = u_float(q_hi + 128, 128.0) * d
    elif QT == F32 or QT == F16 or QT == BF16:  # plain floats: element 32u + k of row r
        at = (r * K)[:, None, None] + (32 * u)[None, :, None] + k[None, None, :]
        if QT == F32:
            p = wp.to(tl.pointer_type(tl.float32))
            lo = tl.load(p + at, mask=m3, other=0.0)
            hi = tl.load(p + at + 16, mask=m3, other=0.0)
        elif QT == F16:
            p = wp.to(tl.pointer_type(tl.float16))
            lo = tl.load(p + at, mask=m3, other=0.0).to(tl.float32)
            hi = tl.load(p + at + 16, mask=m3, other=0.0).to(tl.float32)
        else:  # BF16: the top half of an f32
            p = wp.to(tl.pointer_type(tl.uint16))
            lo = (tl.load(p + at, mask=m3, other=0).to(tl.uint32) << 16).to(
                tl.float32, bitcast=True
            )
            hi = (tl.load(p + at + 16, mask=m3, other=0).to(tl.uint32) << 16).to(
                tl.float32, bitcast=True
            )
    else:  # the gathered types, through their decoders (quant.unit_kernels)
        S: tl.constexpr = u.shape[0]
        lo, hi = unit_halves(
            wp + tl.zeros([S], tl.int32), o1, o2, o3, o4, r, rm, u, um, NK, QT, HALF=True
        )  # (rounded to float16 in _mma)
    return lo, hi


@triton.jit
def _mma(a, w, acc, QT: tl.constexpr, BN: tl.constexpr, S: tl.constexpr):
    """acc + a [BM, S*16] (float16) times the half tile w [BN, S, 16] (float32), on tensor cores:
    in float16, but in TF32 for F32 and BF16 weights, whose values may lie outside float16's
    range (TF32 holds every bfloat16 and float16 value exactly)."""
    w2 = tl.reshape(w, [BN, S * 16])
    if QT == F32 or QT == BF16:
        return tl.dot(a.to(tl.float32), tl.trans(w2), acc, input_precision="tf32")
    else:
        return tl.dot(a, tl.trans(w2.to(tl.float16)), acc)


@triton.jit
def _gemm_kernel(
    a, a_stride, y, y_stride, M, N,
    rows, n_valid, blocks, table, wts,
    w, w_off, o1, o2, o3, o4, v_off, p1, p2, p3, p4, bias, bias_v,
    K: tl.constexpr, QT: tl.constexpr, QV: tl.constexpr, TOPK: tl.constexpr,
    EXPERTS: tl.constexpr, GATHER: tl.constexpr, SCATTER: tl.constexpr, GLU: tl.constexpr,
    WEIGHTED: tl.constexpr, ADD: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, S: tl.constexpr,
    BIAS: tl.constexpr = False, OAI: tl.constexpr = False, ALPHA: tl.constexpr = 1.0,
    LIMIT: tl.constexpr = 0.0,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    p = pid_m * BM + tl.arange(0, BM)
    wp = w + w_off
    if EXPERTS:
        e = tl.load(blocks + pid_m)
        bias_at = e.to(tl.int64) * N  # (an expert's bias row: [E, N] by its id)
        if e < 0:  # padding past the last expert's blocks
            return
        off = tl.load(table + e)
        if off == -1:  # MISSING (offsets are from an anchor: others may be negative)
            return
        wp = wp + tl.multiple_of(off, 256)
        ids = tl.load(rows + p)
        pm = ids < n_valid
    else:
        ids = p
        pm = p < M
        bias_at = 0
    a_row = ids // TOPK if GATHER else p
    y_row = ids if SCATTER else p
    n = pid_n * BN + tl.arange(0, BN)
    nm = n < N
    r = n.to(tl.int64)
    NK: tl.constexpr = K // 32
    c = tl.arange(0, S * 16)
    col = 32 * (c // 16) + c % 16  # the low half of each unit; + 16: the high half
    a_ptr = a + a_row.to(tl.int64)[:, None] * a_stride + col[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    acc_v = tl.zeros([BM, BN], tl.float32)
    s = tl.arange(0, S)
    for u0 in tl.range(0, NK, S):
        u = u0 + s
        um = u < NK
        am = pm[:, None] & (u0 + c // 16 < NK)[None, :]
        a_lo = tl.load(a_ptr + 32 * u0, mask=am, other=0.0)
        a_hi = tl.load(a_ptr + 32 * u0 + 16, mask=am, other=0.0)
        lo, hi = w_halves(wp, o1, o2, o3, o4, r, nm, u, um, K, QT)
        acc = _mma(a_lo, lo, acc, QT, BN, S)
        acc = _mma(a_hi, hi, acc, QT, BN, S)
        if GLU:
            lo, hi = w_halves(wp + v_off, p1, p2, p3, p4, r, nm, u, um, K, QV)
            acc_v = _mma(a_lo, lo, acc_v, QV, BN, S)
            acc_v = _mma(a_hi, hi, acc_v, QV, BN, S)
    if BIAS:  # (gpt-oss: the dense products' biases, each expert's by its id)
        acc += tl.load(bias + bias_at + n, mask=nm, other=0.0)[None, :]
        if GLU:
            acc_v += tl.load(bias_v + bias_at + n, mask=nm, other=0.0)[None, :]
    if GLU:
        if OAI:  # gpt-oss's clamped SwiGLU (ops.SwigluOAI)
            acc = tl.minimum(acc, LIMIT)
            acc_v = tl.minimum(tl.maximum(acc_v, -LIMIT), LIMIT)
            acc = acc / (1.0 + tl.exp(-ALPHA * acc)) * (acc_v + 1.0)
        else:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_v  # SiLU(gate) * up
    if WEIGHTED:
        acc = acc * tl.load(wts + ids, mask=pm, other=0.0)[:, None]
    y_ptr = y + y_row.to(tl.int64)[:, None] * y_stride + n[None, :]
    ym = pm[:, None] & nm[None, :]
    if ADD:
        acc = acc + tl.load(y_ptr, mask=ym, other=0.0).to(tl.float32)
    tl.store(y_ptr, acc.to(y.dtype.element_ty), mask=ym)


@dataclass(frozen=True)
class Tile:
    """A launch's block sizes: BM activation rows, BN weight rows, S units of K per step."""

    bm: int
    bn: int
    s: int = 4
    warps: int = 4
    stages: int = 2


INTERP_TILE = Tile(16, 512, 8, 4, 1)  # few, wide programs: the interpreter pays per op
# The GPU's tiles, chosen from the compiled code (``python -m strata.bench.kernel_resources``:
# sm_90, every weight type): a step dequantises [BN, 32 S] weights and the tensor cores' share
# of it is small, so the rate is set by the instructions of the dequantisation per multiply-add
# and by what stays in registers. 128 x 128 rows (two warpgroups, wgmma) for the dense products
# and 64 x 64 (one warpgroup) for an expert's block: no register spills for any type, at most
# 90 KiB of shared memory (two or more blocks an SM), and 2-4x fewer instructions per
# multiply-add than the 64 x 128 x 4 / 32 x 128 x 4 tiles before them, which spilled (MXFP4's
# gate and up: 1.4 KiB a thread). An expert's block costs about the same at 16, 32 or 64 rows
# (the weights' dequantisation dominates), so 64 rows serve every chunk size.
GPU_DENSE_TILE = Tile(128, 128, 2, 8, 3)
DENSE_TILE = INTERP_TILE if INTERPRETED else GPU_DENSE_TILE


def _staged(tile: Tile, *qtypes: int) -> Tile:
    """``tile`` as a launch of these weight types runs it: F32 weights in one stage. Their float32
    tiles are four times a quantised type's bytes, and the pipeliner stages them in shared memory
    (compiled for sm_90, the dense tile in three stages: 112 KiB, one block an SM; in one: 64
    KiB)."""
    if int(Q.F32) in qtypes and tile.stages > 1:
        return Tile(tile.bm, tile.bn, tile.s, tile.warps, 1)
    return tile


def _check(a: torch.Tensor, lay: RepackedLayout) -> None:
    if lay.cols % UNIT:
        raise ValueError(f"a {lay.rows}x{lay.cols} matrix: {lay.cols} is not a multiple of {UNIT}")
    if a.dtype != torch.float16 or a.dim() != 2 or a.stride(1) != 1:
        raise ValueError(f"activations must be float16 [M, K] with unit column stride, got "
                         f"{a.dtype} {tuple(a.shape)} strides {a.stride()}")  # fmt: skip
    if a.shape[1] < lay.cols:
        raise ValueError(f"{a.shape[1]} activation columns cannot feed a {lay.cols}-column matrix")


def gemm(
    y: torch.Tensor,
    a: torch.Tensor,
    w: torch.Tensor,
    lay: RepackedLayout,
    add: bool = False,
    tile: Tile = DENSE_TILE,
    bias: torch.Tensor | None = None,
) -> None:
    """y[m, :] (=, or += with ``add``) W a[m, :] (+ ``bias``: float32 [N]) for the M rows of
    ``a``. a: float16 [M, K]; w: the repacked matrix's bytes (N x K); y: [M, N] float32 or
    float16, any row stride."""
    _check(a, lay)
    M, N = a.shape[0], lay.rows
    _check_bias(bias, 1, N)
    if y.dim() != 2 or y.shape[0] < M or y.shape[1] < N or y.stride(1) != 1:
        raise ValueError(f"y {tuple(y.shape)} cannot hold a [{M}, {N}] product")
    if M == 0:
        return
    o = plane_offsets(lay.offsets)
    tile = _staged(tile, int(lay.qtype))
    grid = (triton.cdiv(M, tile.bm), triton.cdiv(N, tile.bn))
    _gemm_kernel[grid](
        a, a.stride(0), y, y.stride(0), M, N,
        a, 0, a, a, a,
        w, 0, *o, 0, *o, a if bias is None else bias, a,
        K=lay.cols, QT=int(lay.qtype), QV=int(lay.qtype), TOPK=1,
        EXPERTS=False, GATHER=False, SCATTER=False, GLU=False, WEIGHTED=False, ADD=add,
        BM=tile.bm, BN=tile.bn, S=tile.s, num_warps=tile.warps, num_stages=tile.stages,
        BIAS=bias is not None,
    )  # fmt: skip


def _check_bias(bias: torch.Tensor | None, rows: int, n: int) -> None:
    if bias is not None and (bias.dtype != torch.float32 or bias.numel() != rows * n
                             or not bias.is_contiguous()):  # fmt: skip
        want = f"[{rows}, {n}]" if rows > 1 else f"[{n}]"
        raise ValueError(f"a bias {bias.dtype} {tuple(bias.shape)}: want contiguous float32 {want}")


# -- grouped by expert ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Groups:
    """A chunk's assignments sorted by expert into blocks of ``bm`` rows (all on the device).

    rows: int32 [P] the assignment (token * k + choice) at each sorted position, ``n_valid`` for
    padding; blocks: int32 [P // bm] each block's expert (-1: padding); counts: int32 [E] the
    assignments of each expert."""

    rows: torch.Tensor
    blocks: torch.Tensor
    counts: torch.Tensor
    n_valid: int
    topk: int
    bm: int


def max_sorted_rows(n_assign: int, n_expert: int, bm: int) -> int:
    """Sorted positions enough for any routing: each expert's run padded to a multiple of bm,
    and the sentinel expert's (padding tokens) after them."""
    return triton.cdiv(n_assign + (n_expert + 1) * (bm - 1), bm) * bm


def group_by_expert(
    ids: torch.Tensor, n_expert: int, bm: int, n_rows: torch.Tensor | None = None
) -> Groups:
    """ids: [T, k] the chosen experts of each token -> their assignments grouped by expert,
    with buffers sized for the worst case (no host sync). ``n_rows`` (int64 [1] on the device):
    only the first n_rows tokens count, the others (a graph's padding) are left out."""
    T, k = ids.shape
    A = T * k
    dev = ids.device
    flat = ids.reshape(-1).to(torch.int64)  # [A]
    if n_rows is not None:  # padding goes to a sentinel expert after the last, never run
        token = torch.arange(A, device=dev) // k
        flat = torch.where(token < n_rows, flat, n_expert)
    E = n_expert + 1
    counts = torch.zeros(E, dtype=torch.int64, device=dev)  # [E] (bincount would sync)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + bm - 1) // bm * bm
    ends = torch.cumsum(padded, 0)  # [E] end of each expert's padded run
    order = torch.argsort(flat, stable=True)  # assignments in expert order
    e_sorted = flat[order]
    first = torch.cumsum(counts, 0) - counts  # [E] first sorted index of each expert
    dest = (ends - padded)[e_sorted] + torch.arange(A, device=dev) - first[e_sorted]
    P = max_sorted_rows(A, n_expert, bm)
    rows = torch.full((P,), A, dtype=torch.int32, device=dev)
    rows.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(0, P, bm, device=dev)
    blocks = torch.searchsorted(ends, starts, right=True).to(torch.int32)  # [P // bm]
    blocks = torch.where(blocks < n_expert, blocks, -1)  # past the last expert: skipped
    return Groups(rows, blocks, counts[:n_expert].to(torch.int32), A, k, bm)


GPU_MOE_TILE = Tile(64, 64, 2, 4, 3)  # (see GPU_DENSE_TILE)
MOE_TILE = INTERP_TILE if INTERPRETED else GPU_MOE_TILE


def moe_gate_up(
    act: torch.Tensor,
    h: torch.Tensor,
    g: Groups,
    table: torch.Tensor,
    anchor: torch.Tensor,
    gate: RepackedLayout,
    up: RepackedLayout,
    up_off: int,
    tile: Tile = MOE_TILE,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    oai: tuple[float, float] | None = None,
) -> None:
    """act: float16 [P, F] <- SiLU(gate_e h[t]) * (up_e h[t]) at each sorted position of
    assignment (t, choice) to expert e (padding rows are left as they were). h: float16 [T, D];
    table: int64 [E] byte offsets of the experts' slots from ``anchor``. gpt-oss: ``biases``
    (gate, up: float32 [E, F]) added by expert id, ``oai`` (alpha, limit): the clamped
    SwiGLU."""
    _check(h, gate)
    if tile.bm != g.bm:
        raise ValueError(f"tile rows {tile.bm} differ from the groups' block of {g.bm}")
    F = gate.rows
    if biases is not None:
        _check_bias(biases[0], g.counts.numel(), F)
        _check_bias(biases[1], g.counts.numel(), F)
    alpha, limit = oai if oai is not None else (1.0, 0.0)
    og, ou = plane_offsets(gate.offsets), plane_offsets(up.offsets)
    tile = _staged(tile, int(gate.qtype), int(up.qtype))
    grid = (g.blocks.numel(), triton.cdiv(F, tile.bn))
    _gemm_kernel[grid](
        h, h.stride(0), act, act.stride(0), 0, F,
        g.rows, g.n_valid, g.blocks, table, h,
        anchor, 0, *og, up_off, *ou,
        h if biases is None else biases[0], h if biases is None else biases[1],
        K=gate.cols, QT=int(gate.qtype), QV=int(up.qtype), TOPK=g.topk,
        EXPERTS=True, GATHER=True, SCATTER=False, GLU=True, WEIGHTED=False, ADD=False,
        BM=tile.bm, BN=tile.bn, S=tile.s, num_warps=tile.warps, num_stages=tile.stages,
        BIAS=biases is not None, OAI=oai is not None, ALPHA=alpha, LIMIT=limit,
    )  # fmt: skip


def moe_down(
    y: torch.Tensor,
    act: torch.Tensor,
    g: Groups,
    wts: torch.Tensor,
    table: torch.Tensor,
    anchor: torch.Tensor,
    down: RepackedLayout,
    down_off: int,
    tile: Tile = MOE_TILE,
    bias: torch.Tensor | None = None,
) -> None:
    """y: float32 [T * k, D] <- wts[a] * (down_e act[p] (+ ``bias``: float32 [E, D], the
    expert's row)) for the assignment a at each sorted position p of expert e.
    wts: float32 [T * k]."""
    _check(act, down)
    if tile.bm != g.bm:
        raise ValueError(f"tile rows {tile.bm} differ from the groups' block of {g.bm}")
    D = down.rows
    _check_bias(bias, g.counts.numel(), D)
    o = plane_offsets(down.offsets)
    tile = _staged(tile, int(down.qtype))
    grid = (g.blocks.numel(), triton.cdiv(D, tile.bn))
    _gemm_kernel[grid](
        act, act.stride(0), y, y.stride(0), 0, D,
        g.rows, g.n_valid, g.blocks, table, wts,
        anchor, down_off, *o, 0, *o, act if bias is None else bias, act,
        K=down.cols, QT=int(down.qtype), QV=int(down.qtype), TOPK=1,
        EXPERTS=True, GATHER=False, SCATTER=True, GLU=False, WEIGHTED=True, ADD=False,
        BM=tile.bm, BN=tile.bn, S=tile.s, num_warps=tile.warps, num_stages=tile.stages,
        BIAS=bias is not None,
    )  # fmt: skip


def gemm_reference(a: torch.Tensor, w: torch.Tensor, lay: RepackedLayout) -> torch.Tensor:
    """The torch twin of ``gemm``: [M, N] float32 from the reference values of W."""
    return a.float() @ dequantize_repacked(w, lay.qtype, (lay.rows, lay.cols)).T
