"""The routed MoE block of one decode token, in three launches.

1. ``route``: softmax of the router logits, the top k experts and their weights (renormalised to
   sum to one when the model asks), and each chosen expert's entry of the layer's expert table,
   written to device buffers; it also counts each chosen expert in a per-(layer, expert) usage
   table, so the host learns what is hot without a copy per step. A launch of its own, or the
   tail of the router's matvec (``Routing``, ``matvec(route=...)``): the same code and sums.
2. ``gate_up``: for all k chosen experts at once, program (k, row block) reads the expert's slot
   offset, computes its gate and up rows against the normalised input and writes
   SiLU(gate) * up.
3. ``down``: each program owns a block of output rows; the k experts' down rows, times their
   weights, are summed in one reduction and added to the residual.

No atomics in the arithmetic (the routing's ticket only picks the program that routes): every
sum has one order, so the numbers are the same on every run, and the
same whether an expert was read from a VRAM slot or a staging slot (the host may point a chosen
expert's offset at a staging slot between ``route`` and ``gate_up``).

An expert table holds, per expert, the byte offset of its slot from ``base`` (the expert arena);
a slot holds gate, up and down repacked (``quant.expert_layout.KernelSlotLayout``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from strata.engine.kernels.columns import _release, grid_tile
from strata.engine.kernels.cpu_experts import request_ids_offset, request_offsets
from strata.engine.kernels.dot import (
    MAX_UNITS,
    dot_rows,
    dot_rows2,
    float_tile,
    k_input,
    k_tile,
    launch_regs,
    plane_offsets,
    step_warps,
    steps,
    warps_for,
)
from strata.engine.kernels.inputs import (
    BF16,
    F16,
    F32,
    INTERPRETED,
    KEY_MIN,
    ordered_bits,
    unordered_bits,
)
from strata.engine.kernels.pdl import after_previous, pdl_launch
from strata.engine.quant.repack import RepackedLayout
from strata.engine.quant.unit_kernels import (
    IQ3_S,
    IQ3_XXS,
)


@triton.jit
def _warp_sum(x, N: tl.constexpr, S: tl.constexpr):
    """sum(x), x: [N] float32 (N a power of two), added in the order one warp adds it with S
    consecutive elements a thread (thread t holds x[r * 32S + tS + j]): each thread's values
    pairwise in register order (a balanced tree), then across the lanes by halves (a
    butterfly), as Triton's reduction does in a one-warp kernel. Written as elementwise adds,
    so the order, and the bits, hold in a kernel of any number of warps (the router's matvec
    runs the routing with eight): ``route`` gives the same weights in either launch."""
    L: tl.constexpr = N // S if N // S < 32 else 32  # lanes
    R: tl.constexpr = N // (S * L)  # each thread's rows of S
    V: tl.constexpr = R * S  # values a thread
    v = tl.reshape(tl.permute(tl.reshape(x, [R, L, S]), (1, 0, 2)), [L, V])
    for i in tl.static_range(10):  # V <= 2^10
        if (V >> i) > 1:
            a, b = tl.split(tl.reshape(v, [L, V >> (i + 1), 2]))
            v = a + b
    v = tl.reshape(v, [L])
    for i in tl.static_range(6):  # L <= 32
        if (L >> i) > 1:
            a, b = tl.split(tl.trans(tl.reshape(v, [2, L >> (i + 1)])))
            v = a + b
    return tl.max(v, 0)  # its one element


@triton.jit
def _route(lg, table, ids, wts, eoffs, counts, pf_ids, stage, stage_bytes, pf_stats, E,
           K: tl.constexpr, EP: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr,
           P: tl.constexpr, LATE: tl.constexpr, S: tl.constexpr):  # fmt: skip
    """The routing of one token from its logits ``lg`` [EP] (-inf past E): the top k, their
    weights, their table entries (or staging slots) and the use counts; ``S``: ``_warp_sum``'s
    elements a thread for [EP] (``route_elements``)."""
    e = tl.arange(0, EP)
    em = e < E
    if LATE:  # the top k logits themselves; a softmax over those k after (gpt-oss)
        left = tl.where(em, lg, float("-inf"))
    else:
        p = tl.exp(lg - tl.max(lg, 0))
        p = tl.where(em, p, 0.0)
        p = p / _warp_sum(p, EP, S)
        left = tl.where(em, p, -1.0)
    kk = tl.arange(0, KP)
    sel_w = tl.zeros([KP], tl.float32)
    sel_i = tl.zeros([KP], tl.int32)
    chosen = tl.zeros([EP], tl.int32)
    # Each candidate as one int64: its value's bits made to order as the floats do
    # (``ordered_bits``), then its id reversed, so one max picks the largest value and, among
    # equals, the lowest id. One reduction a pick, not two (a max, then the lowest id holding
    # it): in the router's matvec each crosses 8 warps.
    key = (ordered_bits(left).to(tl.int64) << 32) | (EP - 1 - e)
    for k in tl.static_range(K):
        best = tl.max(key, 0)
        idx = EP - 1 - (best & (EP - 1)).to(tl.int32)
        val = unordered_bits((best >> 32).to(tl.int32))
        sel_w = tl.where(kk == k, val, sel_w)
        sel_i = tl.where(kk == k, idx, sel_i)
        chosen = tl.where(e == idx, 1, chosen)
        key = tl.where(e == idx, KEY_MIN, key)
    if LATE:  # (the first pick is the largest logit)
        top = tl.max(tl.where(kk == 0, sel_w, float("-inf")), 0)
        sel_w = tl.where(kk < K, tl.exp(sel_w - top), 0.0)
        sel_w = sel_w / _warp_sum(sel_w, KP, 1)
    if NORM:
        sel_w = sel_w / _warp_sum(tl.where(kk < K, sel_w, 0.0), KP, 1)
    km = kk < K
    tl.store(ids + kk, sel_i, mask=km)
    tl.store(wts + kk, sel_w, mask=km)
    # each chosen expert's bytes, from the layer's table: the expert kernels read only these
    eo = tl.load(table + sel_i, mask=km, other=0)
    if P > 0:  # a chosen expert copied ahead (kernels.prefetch) is read from its staging slot
        issued = 0
        used = 0
        for j in tl.static_range(P):
            pid = tl.load(pf_ids + j)
            hit = km & (sel_i == pid)
            eo = tl.where(hit, stage.to(tl.int64) + j * stage_bytes, eo)  # int64: no wrap
            issued += (pid != -1).to(tl.int64)
            used += tl.sum(hit.to(tl.int64), 0)
        tl.store(pf_stats, tl.load(pf_stats) + issued)
        tl.store(pf_stats + 1, tl.load(pf_stats + 1) + used)
    tl.store(eoffs + kk, eo, mask=km)
    c = tl.load(counts + e, mask=em, other=0)
    tl.store(counts + e, c + chosen, mask=em)


@triton.jit
def _route_kernel(logits, table, ids, wts, eoffs, counts, pf_ids, stage, stage_bytes, pf_stats, E,
                  K: tl.constexpr, EP: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr,
                  P: tl.constexpr, LATE: tl.constexpr, S: tl.constexpr):  # fmt: skip
    e = tl.arange(0, EP)
    lg = tl.load(logits + e, mask=e < E, other=float("-inf"))
    _route(lg, table, ids, wts, eoffs, counts, pf_ids, stage, stage_bytes, pf_stats, E, K, EP,
           KP, NORM, P, LATE, S)  # fmt: skip


@triton.jit
def _expert(eoffs, base, k):
    return base + tl.multiple_of(tl.load(eoffs + k), 256)


@triton.jit
def glu(g, u, OAI: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """SiLU(g) * u, or gpt-oss's clamped SwiGLU (``ops.SwigluOAI``) with ``OAI``."""
    if OAI:
        g = tl.minimum(g, LIMIT)
        u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
        return g / (1.0 + tl.exp(-ALPHA * g)) * (u + 1.0)
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _gate_up_kernel(
    h, eoffs, base, act, F, D: tl.constexpr,
    g1, g2, g3, g4, up_off, u1, u2, u3, u4, ids, bg, bu,
    TG: tl.constexpr, TU: tl.constexpr, BN: tl.constexpr, T: tl.constexpr,
    BIAS: tl.constexpr, OAI: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    TAIL: tl.constexpr = 0, PDL: tl.constexpr = False,
):  # fmt: skip
    after_previous(PDL)
    k = tl.program_id(0)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    ok = rows < F
    w = _expert(eoffs, base, k)
    if TG == TU:  # one pass over the input for both
        g, u = dot_rows2(
            w, g1, g2, g3, g4, w + up_off, u1, u2, u3, u4, rows, ok, D, h, TG, BN, T, TAIL
        )
    else:
        g = dot_rows(w, g1, g2, g3, g4, rows, ok, D, h, h, 1.0, TG, False, BN, T, TAIL)
        u = dot_rows(w + up_off, u1, u2, u3, u4, rows, ok, D, h, h, 1.0, TU, False, BN, T, TAIL)
    if BIAS:  # the chosen expert's gate and up biases ([E, F], by its id: not in its slot)
        at = tl.load(ids + k).to(tl.int64) * F + rows
        g += tl.load(bg + at, mask=ok, other=0.0)
        u += tl.load(bu + at, mask=ok, other=0.0)
    tl.store(act + k * F + rows, glu(g, u, OAI, ALPHA, LIMIT), mask=ok)


# down's quants as flat tiles (``unit_bytes``' FLAT), on the Triton releases that spread a 3-D
# tile's rows over the lanes. Compiled for sm_90, Qwen3-30B-A3B's down (Q4_K, 8 warps): under
# 3.6, 180 registers a thread as 3-D tiles, 104 flat; under 3.9, 90 and 1,120 instructions a
# warp as 3-D tiles, 128 and 1,432 flat (each lane's expert offset a load of its own).
DOWN_FLAT = _release(triton.__version__) < (3, 9)


@triton.jit
def _flat_units(eoffs, base, down_off, e0, u0, N: tl.constexpr, EPT: tl.constexpr,
                W: tl.constexpr, K: tl.constexpr):  # fmt: skip
    """For ``unit_bytes``' FLAT loads of a step of EPT chosen experts from e0 side by side, N
    units of each from u0 (W elements a unit): each lane's expert's down matrix and unit,
    ([EPT N W] pointers, [EPT N W] units). Lanes of experts past the k chosen point at the
    last chosen one's slot, with a unit past any row's end (masked: nothing is read)."""
    jf = tl.arange(0, EPT * N * W)
    kk = e0 + jf // (N * W)
    wf = base + tl.multiple_of(tl.load(eoffs + tl.minimum(kk, K - 1)), 256) + down_off
    return wf, tl.where(kk < K, u0 + (jf // W) % N, 1 << 24)


@triton.jit
def _down_units(act, wp, wt, kk, em, d1, d2, d3, d4, r, ok, u, um, F: tl.constexpr,
                TD: tl.constexpr, wf, uf, FLAT: tl.constexpr):  # fmt: skip
    """Units u of the chosen experts kk (their slots' down matrices at wp, weights wt) dotted
    with their act rows, times the weights: [BN, len(u)]. FLAT, wf, uf: the quants as flat
    tiles, the step's lanes (``_flat_units``)."""
    if TD == IQ3_XXS or TD == IQ3_S:
        y = grid_tile(wp, d1, d2, d3, d4, r, ok, u, um, F // 32, TD, act, act, 1.0, kk * F + 32 * u,
                      False)  # fmt: skip
    elif TD != F32 and TD != F16 and TD != BF16:  # units of 32 elements
        xl, xh, sx = k_input(act, act, 1.0, kk * F + 32 * u, um, False)
        y = k_tile(wp, d1, d2, d3, d4, r, ok, u, um, F // 32, TD, xl, xh, sx, wf, uf, FLAT)
    else:
        xo = kk * F + 8 * u
        y = float_tile(wp, r, ok, u, um, F, act, act, 1.0, xo, TD, False, wf, uf, FLAT)
    return y * wt[None, :]


@triton.jit
def _down_kernel(
    act, eoffs, wts, base, x, F: tl.constexpr, D, down_off, d1, d2, d3, d4, ids, bd,
    K: tl.constexpr, TD: tl.constexpr, BN: tl.constexpr, TS: tl.constexpr, EPT: tl.constexpr,
    BIAS: tl.constexpr, KP: tl.constexpr, TAIL: tl.constexpr = 0, FLAT: tl.constexpr = False,
    PDL: tl.constexpr = False,
):  # fmt: skip
    after_previous(PDL)
    # a step's units: EPT experts side by side, TS units of each (then, with TAIL, the rest of
    # each expert's row in a step of TAIL units each); the sum over experts and units is one
    # reduction at the end, in a fixed order
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    ok = rows < D
    r = rows.to(tl.int64)
    NU: tl.constexpr = F // (8 if TD == F32 or TD == F16 or TD == BF16 else 32)
    FULL: tl.constexpr = NU // TS if TAIL > 0 else (NU + TS - 1) // TS  # steps of TS
    W: tl.constexpr = 8 if TD == F32 or TD == F16 or TD == BF16 else 16  # elements a lane row
    t = tl.arange(0, EPT * TS)
    c = t % TS
    acc = tl.zeros([BN, EPT * TS], tl.float32)
    for e0 in tl.static_range(0, K, EPT):
        kk = e0 + t // TS  # the chosen expert each unit belongs to
        em = kk < K
        off = tl.load(eoffs + kk, mask=em, other=0)
        wp = base + tl.multiple_of(off, 256) + down_off
        wt = tl.load(wts + kk, mask=em, other=0.0)
        for i in tl.static_range(FULL):
            u = i * TS + c
            wf, uf = wp, u  # (unread unless FLAT)
            if FLAT:
                wf, uf = _flat_units(eoffs, base, down_off, e0, i * TS, TS, EPT, W, K)
            acc += _down_units(act, wp, wt, kk, em, d1, d2, d3, d4, r, ok, u, em & (u < NU), F, TD,
                               wf, uf, FLAT)  # fmt: skip
    out = tl.sum(acc, 1)
    if TAIL > 0:
        t2 = tl.arange(0, EPT * TAIL)
        c2 = FULL * TS + t2 % TAIL
        acc2 = tl.zeros([BN, EPT * TAIL], tl.float32)
        for e0 in tl.static_range(0, K, EPT):
            kk = e0 + t2 // TAIL
            em = kk < K
            off = tl.load(eoffs + kk, mask=em, other=0)
            wp = base + tl.multiple_of(off, 256) + down_off
            wt = tl.load(wts + kk, mask=em, other=0.0)
            wf, uf = wp, c2
            if FLAT:
                wf, uf = _flat_units(eoffs, base, down_off, e0, FULL * TS, TAIL, EPT, W, K)
            acc2 += _down_units(
                act,
                wp,
                wt,
                kk,
                em,
                d1,
                d2,
                d3,
                d4,
                r,
                ok,
                c2,
                em & (c2 < NU),
                F,
                TD,
                wf,
                uf,
                FLAT,
            )
        out += tl.sum(acc2, 1)
    if BIAS:  # + each chosen expert's down bias ([E, D], by its id) times its weight
        kb = tl.arange(0, KP)
        kbm = kb < K
        bw = tl.load(wts + kb, mask=kbm, other=0.0)
        bi = tl.load(ids + kb, mask=kbm, other=0).to(tl.int64)
        b = tl.load(bd + bi[None, :] * D + r[:, None], mask=ok[:, None] & kbm[None, :], other=0.0)
        out += tl.sum(b * bw[None, :], 1)
    tl.store(x + rows, tl.load(x + rows, mask=ok, other=0.0) + out, mask=ok)


# -- the CPU's share (kernels.cpu_experts): a post to the CPU pool's server, and its answer ----

# the mailbox's fields (cpu_experts.c's strata_mailbox; a test checks them against the library)
MB_SEQ, MB_JOB, MB_DONE, MB_FAULT = 0, 8, 64, 128
_MB_SEQ, _MB_JOB = tl.constexpr(MB_SEQ), tl.constexpr(MB_JOB)  # (what a kernel may read)
_MB_DONE, _MB_FAULT = tl.constexpr(MB_DONE), tl.constexpr(MB_FAULT)


@triton.jit
def _fence_sys(v):
    # every thread: its memory operations so far are ordered, system-wide, before its later
    # ones (host memory that the CPU reads and writes); returns ``v`` so a later operation can
    # depend on it
    return tl.inline_asm_elementwise(
        "fence.sc.sys;\n\tmov.b32 $0, $1;", "=r,r", [v], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _cpu_post_kernel(ids, wts, eoffs, homes, counted, h, base, req, mb, seq, posted, job,
                     zero_off, share, D, K: tl.constexpr, KP: tl.constexpr, AT_O: tl.constexpr,
                     AT_W: tl.constexpr, AT_N: tl.constexpr, AT_H: tl.constexpr,
                     BD: tl.constexpr, POST: tl.constexpr, AT_I: tl.constexpr):  # fmt: skip
    kk = tl.arange(0, KP)
    km = kk < K
    i = tl.load(ids + kk, mask=km, other=0)
    home = tl.load(homes + i, mask=km, other=-1)
    eo = tl.load(eoffs + kk, mask=km, other=0)
    w = tl.load(wts + kk, mask=km, other=0.0)
    ram = km & (home != -1) & (eo == home)  # read from its RAM home (not from a copy in VRAM)
    r = ram.to(tl.int32)
    m = tl.floor(tl.sum(r, 0).to(tl.float32) * tl.load(share) + 0.5).to(tl.int32)
    rank = tl.cumsum(r, 0) - r  # its place among the layer's chosen RAM experts
    take = ram & (rank < m)
    # the request, in the job's host memory at base + req (AT_*: cpu_experts.request_offsets)
    at = base + req
    tl.store((at + AT_O).to(tl.pointer_type(tl.int64)) + rank, home, mask=take)  # (anchor's)
    tl.store((at + AT_W).to(tl.pointer_type(tl.float32)) + rank, w, mask=take)
    if AT_I > 0:  # the experts' ids, where their biases are found (gpt-oss)
        tl.store((at + AT_I).to(tl.pointer_type(tl.int32)) + rank, i, mask=take)
    tl.store((at + AT_N).to(tl.pointer_type(tl.int32)), m)
    dd = tl.arange(0, BD)
    h_at = (at + AT_H).to(tl.pointer_type(tl.float32))
    for d0 in range(0, D, BD):
        dm = d0 + dd < D
        tl.store(h_at + d0 + dd, tl.load(h + d0 + dd, mask=dm), mask=dm)
    tl.store(counted, tl.load(counted) + m.to(tl.int64))
    # the GPU's kernels read zeros for them (a zero expert adds nothing) with weight 0
    tl.store(eoffs + kk, tl.where(take, zero_off, eo), mask=km)
    tl.store(wts + kk, tl.where(take, 0.0, w), mask=km)
    if POST:
        tl.store(posted, m)
        if m > 0:
            s = tl.load(seq) + 1
            tl.store(seq, s)
            tl.store((base + mb + _MB_JOB).to(tl.pointer_type(tl.int32)), job)
            # every thread's writes of the request reach host memory before the new seq does
            f = _fence_sys(dd)
            tl.debug_barrier()
            s = s + tl.min(f, 0).to(tl.int64)  # (+ 0, after the fences)
            tl.store((base + mb + _MB_SEQ).to(tl.pointer_type(tl.int64)), s)


@triton.jit
def _cpu_collect_kernel(x, base, y, mb, seq, posted, limit_ns, D, BD: tl.constexpr):
    if tl.load(posted) > 0:
        want = tl.load(seq)
        done = (base + mb + _MB_DONE).to(tl.pointer_type(tl.int64))
        fault = (base + mb + _MB_FAULT).to(tl.pointer_type(tl.int32))
        got = tl.load(done, volatile=True)
        late = (tl.load(fault, volatile=True) != 0).to(tl.int32)  # an earlier wait gave up
        t0 = _globaltimer()
        while (got < want) & (late == 0):
            got = tl.load(done, volatile=True)
            late = (_globaltimer() - t0 > limit_ns).to(tl.int32)
        if got >= want:
            dd = _fence_sys(tl.arange(0, BD))  # y is read after done was seen
            y_at = (base + y).to(tl.pointer_type(tl.float32))
            for d0 in range(0, D, BD):
                dm = d0 + dd < D
                v = tl.load(y_at + d0 + dd, mask=dm, other=0.0, volatile=True)
                tl.store(x + d0 + dd, tl.load(x + d0 + dd, mask=dm) + v, mask=dm)
        else:
            tl.store(fault, 1)


@dataclass(frozen=True)
class CpuPost:
    """Where a layer's post to the CPU goes, as offsets from ``base`` (the anchor): its job's
    request (``cpu_experts.request_views``' layout) and sum ``y``, both in page-locked host
    memory, and the pool's mailbox (``post=True``: a GPU posts there and a server answers;
    False: the caller runs the job itself after ``post_for_cpu``, as on the CPU device). ``seq``
    int64 [1] counts the posts and ``posted`` int32 [1] is the layer's count of experts for the
    CPU, both on the device."""

    base: torch.Tensor
    req: int
    y: int
    mb: int
    seq: torch.Tensor
    posted: torch.Tensor
    job: int
    post: bool


def post_for_cpu(ids: torch.Tensor, wts: torch.Tensor, eoffs: torch.Tensor, homes: torch.Tensor,
                 counted: torch.Tensor, h: torch.Tensor, zero_off: int,
                 share: torch.Tensor, to: CpuPost, with_ids: bool = False) -> None:  # fmt: skip
    """After ``route``: of the chosen experts read from their RAM homes (``homes``: the
    layer's RAM home offsets from the anchor, -1 elsewhere), the first ``round(share * n)`` in
    top-k order go to the CPU (``share``: float32 [1] on the device, read at run time, so a
    graph follows it). Their count, weights and homes (offsets from the anchor: the job's base
    is the anchor's host address) and the input ``h`` are written into the job's request,
    counted int64 [1] += the count, and with ``to.post`` the job is posted when it has an
    expert. Their entries in ``eoffs`` then point at ``zero_off`` (a slot of zero bytes in VRAM)
    and their ``wts`` are 0, so the expert kernels add nothing for them and read nothing over
    PCIe. ``with_ids``: the chosen ids go into the request too (experts with biases)."""
    k = ids.numel()
    o, w, n, at_h = request_offsets(h.numel(), k)
    at_i = request_ids_offset(h.numel(), k) if with_ids else 0
    _cpu_post_kernel[(1,)](
        ids, wts, eoffs, homes, counted, h, to.base, to.req, to.mb, to.seq, to.posted,
        to.job, zero_off, share, h.numel(), K=k, KP=triton.next_power_of_2(k), AT_O=o, AT_W=w,
        AT_N=n, AT_H=at_h, BD=512, POST=to.post, AT_I=at_i, num_warps=4,
    )  # fmt: skip


def collect_from_cpu(x: torch.Tensor, to: CpuPost, limit_ns: int) -> None:
    """x += the CPU's sum for the layer posted to ``to`` once the server has answered (nothing
    when the layer posted nothing). A wait longer than ``limit_ns`` gives up: nothing is added
    and the mailbox's fault is set (as it is when an earlier wait gave up: none waits then), so
    the host learns that the step is wrong. On a GPU only (the device spins on host memory)."""
    _cpu_collect_kernel[(1,)](
        x, to.base, to.y, to.mb, to.seq, to.posted, limit_ns, x.numel(), BD=512, num_warps=4
    )


BN_GATE_UP = 128 if INTERPRETED else 4
BN_DOWN = 128 if INTERPRETED else 4


@dataclass(frozen=True)
class Prefetched:
    """A layer's prefetches (``kernels.prefetch``): pf_ids int32 [P] (-1: none), their staging
    slots at ``stage + j * stage_bytes`` from the anchor, and pf_stats int64 [2] += (prefetches
    made, prefetches chosen)."""

    pf_ids: torch.Tensor
    stage: int
    stage_bytes: int
    pf_stats: torch.Tensor


def route_elements(ep: int) -> int:
    """Elements a thread of [EP] when ``_route_kernel`` ran alone in one warp (its logits
    16-byte aligned: four float32 at most, one at least): the order of its softmax's sum."""
    return min(4, max(ep // 32, 1))


@dataclass(frozen=True)
class Routing:
    """What ``route`` writes for one layer (its arguments past the logits), so a launch that
    computes the logits can run the routing after them (``matvec``'s ``route``): ``ticket``
    int32 [1] on the device, 0 between launches, counts that launch's programs (the last one
    routes and sets it back to 0)."""

    table: torch.Tensor
    ids: torch.Tensor
    wts: torch.Tensor
    eoffs: torch.Tensor
    counts: torch.Tensor
    k: int
    norm: bool
    prefetched: Prefetched | None = None
    late: bool = False
    ticket: torch.Tensor | None = None

    def launch_args(self, n_expert: int) -> tuple[list[object], dict[str, object]]:
        """The kernels' arguments past the logits (the last the expert count) and their
        constants, checked."""
        if not 1 <= self.k <= n_expert:
            raise ValueError(f"top {self.k} of {n_expert} experts")
        for name, t, n in (("ids", self.ids, self.k), ("wts", self.wts, self.k),
                           ("eoffs", self.eoffs, self.k), ("counts", self.counts, n_expert),
                           ("table", self.table, n_expert)):  # fmt: skip
            if t.numel() != n:
                raise ValueError(f"route's {name} holds {t.numel()} values, not {n}")
        pf, ep = self.prefetched, triton.next_power_of_2(n_expert)
        args: list[object] = [
            self.table, self.ids, self.wts, self.eoffs, self.counts,
            self.ids if pf is None else pf.pf_ids, 0 if pf is None else pf.stage,
            0 if pf is None else pf.stage_bytes, self.eoffs if pf is None else pf.pf_stats,
            n_expert,
        ]  # fmt: skip
        consts: dict[str, object] = dict(
            K=self.k, EP=ep, KP=triton.next_power_of_2(self.k), NORM=self.norm,
            P=0 if pf is None else pf.pf_ids.numel(), LATE=self.late, S=route_elements(ep),
        )  # fmt: skip
        return args, consts

    def alone(self, logits: torch.Tensor) -> None:
        """The routing as a launch of its own, from ``logits`` [E] (``route``)."""
        args, consts = self.launch_args(logits.numel())
        _route_kernel[(1,)](logits, *args, **consts, num_warps=1)  # type: ignore[arg-type]


def route(logits: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor,
          eoffs: torch.Tensor, counts: torch.Tensor, k: int, norm: bool,
          prefetched: Prefetched | None = None, late: bool = False) -> None:  # fmt: skip
    """logits: [E] float32 -> ids: int32 [k], wts: float32 [k], eoffs: int64 [k] (the chosen
    experts' entries of the layer's table, or their staging slots where ``prefetched``),
    counts: int32 [E] += chosen. ``late``: the top k logits, weighted by a softmax over those
    k alone (``RoutingSpec.softmax_after_topk``; a router bias is in the logits already).
    The router's matvec can run the same routing after its own work: ``matvec(route=...)``."""
    Routing(table, ids, wts, eoffs, counts, k, norm, prefetched, late).alone(logits)


@dataclass(frozen=True)
class ExpertExtras:
    """What gpt-oss's experts add (``ops.ExpertBiases``, ``ops.SwigluOAI``): the layer's
    chosen ids int32 [k] (the biases are found by id, not in the slots), the biases float32
    gate/up [E, F] and down [E, D] (None: none), and the clamped SwiGLU's (alpha, limit)
    (None: SiLU(gate) * up)."""

    ids: torch.Tensor
    gate: torch.Tensor | None = None
    up: torch.Tensor | None = None
    down: torch.Tensor | None = None
    oai: tuple[float, float] | None = None


def gate_up(act: torch.Tensor, h: torch.Tensor, eoffs: torch.Tensor, base: torch.Tensor,
            gate: RepackedLayout, up: RepackedLayout, up_off: int, bn: int = BN_GATE_UP,
            num_warps: int | None = None, extras: ExpertExtras | None = None,
            maxnreg: int | None = None) -> None:  # fmt: skip
    """act: [k, F] float32 <- SiLU(gate_i h) * (up_i h) for the expert whose slot is at
    base + eoffs[i] (with ``extras``: + its gate and up biases, the clamped SwiGLU).
    ``bn``, ``num_warps`` and ``maxnreg`` (a register cap) are tuning knobs."""
    k, F, D = eoffs.numel(), gate.rows, gate.cols
    units, tail = steps(int(gate.qtype), D)
    x = extras
    bias = x is not None and x.gate is not None and x.up is not None
    if bias:
        assert x is not None and x.gate is not None
        if x.gate.shape[1:] != (F,) or x.up is None or x.up.shape != x.gate.shape:
            raise ValueError(f"gate/up biases {tuple(x.gate.shape)} for experts of {F} rows")
    alpha, limit = x.oai if x is not None and x.oai is not None else (1.0, 0.0)
    _gate_up_kernel[(k, triton.cdiv(F, bn))](
        h, eoffs, base, act, F, D, *plane_offsets(gate.offsets), up_off,
        *plane_offsets(up.offsets), eoffs if x is None else x.ids,
        x.gate if bias else h, x.up if bias else h,  # type: ignore[union-attr]
        TG=int(gate.qtype), TU=int(up.qtype), BN=bn, T=units, TAIL=tail, BIAS=bias,
        OAI=x is not None and x.oai is not None, ALPHA=alpha, LIMIT=limit,
        num_warps=num_warps or step_warps(units, tail), **launch_regs(maxnreg),
        **pdl_launch(h.device),
    )  # fmt: skip


def down(x: torch.Tensor, act: torch.Tensor, eoffs: torch.Tensor, wts: torch.Tensor,
         base: torch.Tensor, lay: RepackedLayout, down_off: int, bn: int = BN_DOWN,
         num_warps: int | None = None, extras: ExpertExtras | None = None,
         maxnreg: int | None = None, ept: int | None = None,
         flat: bool | None = None) -> None:  # fmt: skip
    """x: [D] += sum over i of wts[i] * (down_i act[i]), expert i's slot at base + eoffs[i]
    (with ``extras``' down biases: wts[i] * (down_i act[i] + bias[ids[i]])). ``bn``,
    ``num_warps``, ``maxnreg`` (a register cap) and ``ept`` (experts side by side in a step, a
    power of two; None: as many as a step of 256 threads holds) are tuning knobs. ``flat``:
    the quants as flat tiles (``unit_bytes``; None: where the Triton release wants them,
    ``DOWN_FLAT``); the same sums either way."""
    k, D, F = eoffs.numel(), lay.rows, lay.cols
    per, tail = steps(int(lay.qtype), F)  # units of one expert per step, and the last
    most = max(1, min(triton.next_power_of_2(k), MAX_UNITS // per))  # experts side by side
    if ept is not None and (ept < 1 or ept & (ept - 1) or ept > most):
        raise ValueError(f"{ept} experts side by side: want a power of two up to {most}")
    ept = ept or most
    bd = extras.down if extras is not None else None
    if bd is not None and bd.shape[1:] != (D,):
        raise ValueError(f"down biases {tuple(bd.shape)} for experts of {D} rows")
    _down_kernel[(triton.cdiv(D, bn),)](
        act, eoffs, wts, base, x, F, D, down_off, *plane_offsets(lay.offsets),
        eoffs if extras is None else extras.ids, x if bd is None else bd,
        K=k, TD=int(lay.qtype), BN=bn, TS=per, EPT=ept, BIAS=bd is not None, TAIL=tail,
        KP=triton.next_power_of_2(k), num_warps=num_warps or warps_for(per * ept),
        FLAT=DOWN_FLAT if flat is None else flat, **launch_regs(maxnreg),
        **pdl_launch(x.device),
    )  # fmt: skip


def route_reference(logits: torch.Tensor, k: int, norm: bool,
                    late: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(ids, weights) as ``layers.moe.route`` chooses them for one token."""
    if late:
        w, i = torch.topk(logits, k)
        return i, torch.softmax(w, -1)
    probs = torch.softmax(logits, dim=-1)
    w, i = torch.topk(probs, k)
    return i, (w / w.sum()) if norm else w
