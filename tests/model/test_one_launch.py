"""The decode step's two fused tails against the two-launch forms they replaced, bit for bit.

* Split attention: the partial programs and the combine in one launch (``DecodeAttention``), a
  dispatch ticket and a count per K/V group, against ``_attn_partial`` then ``_attn_combine``
  as the engine launched them before (copied below as they were, the arithmetic the fused
  launch must keep).
* Routing: the router's matvec whose last program routes (``matvec(route=...)``) against the
  matvec then ``moe.route``'s launch; and ``moe.route``'s launch against ``_route_kernel`` as
  it was (below). Compiled, the old kernel ran its sums in one warp's order and the new code
  writes that order out, so the weights are the same bits; in Triton's interpreter the old
  kernel's sums are numpy's, so there the old and new weights agree to rounding and the ids
  exactly.

Every case runs several launches in a row on the same buffers (a graph replays them so): the
counters must be back at 0 after each. Outputs start as NaN, so an element not written fails.
Compiled on a GPU (the ``gpu`` tests add Qwen3-30B-A3B's shapes: 64 splits, as many as the keys
of an inner step, 128 experts, an eight-warp router matvec); in Triton's interpreter elsewhere.
"""

from __future__ import annotations

import math
import os

import gguf
import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed")
import triton
import triton.language as tl
from test_decode_kernels import DEVICE, mat, nan

from strata.engine.kernels import attention as at
from strata.engine.kernels import moe
from strata.engine.kernels.matvec import matvec

Q = gguf.GGMLQuantizationType
COMPILED = DEVICE.type == "cuda"


# -- the two-launch forms, as the engine ran them --------------------------------------------


@triton.jit
def _attn_partial(
    q, kc, vc, bt, pos_p, acc_out, ml_out, sm_scale, HKV, PS, window,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BS: tl.constexpr,
    NSPLIT: tl.constexpr, LOWP: tl.constexpr, WIN: tl.constexpr,
):  # fmt: skip
    hk = tl.program_id(0)
    s = tl.program_id(1)
    n = tl.load(pos_p) + 1
    lo = 0
    if WIN:
        lo = tl.maximum(n - window, 0)
    per = tl.cdiv(tl.cdiv(n - lo, NSPLIT), BS) * BS
    start = lo + s * per
    end = tl.minimum(start + per, n)
    g = tl.arange(0, GP)
    gm = g < G
    d = tl.arange(0, D)
    qv = tl.load(q + (hk * G + g)[:, None] * D + d[None, :], mask=gm[:, None], other=0.0)
    qv = qv.to(kc.dtype.element_ty) if LOWP else qv.to(tl.float32)
    m = tl.full([GP], float("-inf"), tl.float32)
    tot = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for t0 in range(start, end, BS):
        p = t0 + tl.arange(0, BS)
        pm = p < end
        at = tl.load(bt + p // PAGE, mask=pm, other=0).to(tl.int64) * PS + (p % PAGE) * HKV * D
        off = (at + hk * D)[:, None] + d[None, :]
        k = tl.load(kc + off, mask=pm[:, None], other=0.0)
        v = tl.load(vc + off, mask=pm[:, None], other=0.0)
        if LOWP:
            sc = tl.dot(qv, tl.trans(k)) / sm_scale
        else:
            sc = tl.dot(qv, tl.trans(k.to(tl.float32)), input_precision="ieee") / sm_scale
        sc = tl.where(pm[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        alpha = tl.exp(m - m_new)
        pr = tl.exp(sc - m_new[:, None])
        tot = tot * alpha + tl.sum(pr, 1)
        if LOWP:
            pv = tl.dot(pr.to(v.dtype), v)
        else:
            pv = tl.dot(pr, v.to(tl.float32), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m = m_new
    part = (hk * G + g) * NSPLIT + s
    tl.store(acc_out + part[:, None] * D + d[None, :], acc, mask=gm[:, None])
    tl.store(ml_out + part * 2, m, mask=gm)
    tl.store(ml_out + part * 2 + 1, tot, mask=gm)


@triton.jit
def _attn_combine(acc_in, ml_in, out, sinks, D: tl.constexpr, NSPLIT: tl.constexpr,
                  SINK: tl.constexpr):  # fmt: skip
    h = tl.program_id(0)
    part = h * NSPLIT + tl.arange(0, NSPLIT)
    m = tl.load(ml_in + part * 2)
    tot = tl.load(ml_in + part * 2 + 1)
    top = tl.max(m, 0)
    if SINK:
        sink = tl.load(sinks + h).to(tl.float32)
        top = tl.maximum(top, sink)
    w = tl.exp(m - top)
    d = tl.arange(0, D)
    acc = tl.load(acc_in + (part * D)[:, None] + d[None, :])
    den = tl.sum(tot * w, 0)
    if SINK:
        den += tl.exp(sink - top)
    o = tl.sum(acc * w[:, None], 0) / den
    tl.store(out + h * D + d, o)


@triton.jit
def _route_kernel(logits, table, ids, wts, eoffs, counts, pf_ids, stage, stage_bytes, pf_stats, E,
                  K: tl.constexpr, EP: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr,
                  P: tl.constexpr, LATE: tl.constexpr):  # fmt: skip
    e = tl.arange(0, EP)
    em = e < E
    lg = tl.load(logits + e, mask=em, other=float("-inf"))
    if LATE:
        left = tl.where(em, lg, float("-inf"))
    else:
        p = tl.exp(lg - tl.max(lg, 0))
        p = tl.where(em, p, 0.0)
        p = p / tl.sum(p, 0)
        left = tl.where(em, p, -1.0)
    kk = tl.arange(0, KP)
    sel_w = tl.zeros([KP], tl.float32)
    sel_i = tl.zeros([KP], tl.int32)
    chosen = tl.zeros([EP], tl.int32)
    for k in tl.static_range(K):
        best = tl.max(left, 0)
        idx = tl.min(tl.where(left == best, e, EP), 0)
        sel_w = tl.where(kk == k, best, sel_w)
        sel_i = tl.where(kk == k, idx, sel_i)
        chosen = tl.where(e == idx, 1, chosen)
        if LATE:
            left = tl.where(e == idx, float("-inf"), left)
        else:
            left = tl.where(e == idx, -1.0, left)
    if LATE:
        top = tl.max(tl.where(kk == 0, sel_w, float("-inf")), 0)
        sel_w = tl.where(kk < K, tl.exp(sel_w - top), 0.0)
        sel_w = sel_w / tl.sum(sel_w, 0)
    if NORM:
        sel_w = sel_w / tl.sum(tl.where(kk < K, sel_w, 0.0), 0)
    km = kk < K
    tl.store(ids + kk, sel_i, mask=km)
    tl.store(wts + kk, sel_w, mask=km)
    eo = tl.load(table + sel_i, mask=km, other=0)
    if P > 0:
        issued = 0
        used = 0
        for j in tl.static_range(P):
            pid = tl.load(pf_ids + j)
            hit = km & (sel_i == pid)
            eo = tl.where(hit, stage.to(tl.int64) + j * stage_bytes, eo)
            issued += (pid != -1).to(tl.int64)
            used += tl.sum(hit.to(tl.int64), 0)
        tl.store(pf_stats, tl.load(pf_stats) + issued)
        tl.store(pf_stats + 1, tl.load(pf_stats + 1) + used)
    tl.store(eoffs + kk, eo, mask=km)
    c = tl.load(counts + e, mask=em, other=0)
    tl.store(counts + e, c + chosen, mask=em)


def two_launch_attention(att: at.DecodeAttention, q: torch.Tensor, kc: torch.Tensor,
                         vc: torch.Tensor, table: torch.Tensor, pos: torch.Tensor,
                         window: int | None, sinks: torch.Tensor | None,
                         ps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(out, acc, ml) of the two launches on scratch of their own."""
    H, D, ns = att.H, att.D, att.n_split
    acc = nan(H * ns * D)
    ml = nan(H * ns * 2)
    out = nan(H * D)
    _attn_partial[(att.HKV, ns)](
        q, kc, vc, table, pos, acc, ml, math.sqrt(D), att.HKV, ps, window or 0,
        G=att.G, GP=max(16, triton.next_power_of_2(att.G)), D=D, PAGE=att.page, BS=att.BS,
        NSPLIT=ns, LOWP=kc.dtype in at.LOW_PRECISION, WIN=window is not None, num_warps=4,
    )  # fmt: skip
    _attn_combine[(H,)](acc, ml, out, out if sinks is None else sinks, D=D, NSPLIT=ns,
                        SINK=sinks is not None, num_warps=4)  # fmt: skip
    return out, acc, ml


def old_route(logits: torch.Tensor, r: moe.Routing) -> None:
    args, consts = r.launch_args(logits.numel())
    del consts["S"]
    _route_kernel[(1,)](logits, *args, **consts, num_warps=1)  # type: ignore[arg-type]


# -- attention ---------------------------------------------------------------------------------


def attention_case(H: int, HKV: int, D: int, page: int, n_split: int, lengths: list[int],
                   kv_dtype: torch.dtype, window: int | None, with_sinks: bool,
                   fused: bool = True) -> None:  # fmt: skip
    n_pages = -(-max(lengths) // page)
    torch.manual_seed(H + n_split + max(lengths))
    kc = torch.randn(n_pages * page, HKV, D, device=DEVICE).to(kv_dtype)
    vc = torch.randn(n_pages * page, HKV, D, device=DEVICE).to(kv_dtype)
    table = torch.randperm(n_pages).int().to(DEVICE)  # pages out of order
    sinks = torch.randn(H, device=DEVICE) if with_sinks else None
    att = at.DecodeAttention(H, HKV, D, page, n_split, DEVICE, fused=fused)
    ps = page * HKV * D
    for length in lengths:  # one object, launch after launch: the counters come back to 0
        q = torch.randn(H * D, device=DEVICE)
        pos = torch.tensor([length - 1], dtype=torch.int32, device=DEVICE)
        out = nan(H * D)
        att(out, q, kc, vc, table, pos, ps, window, sinks)
        want, acc, ml = two_launch_attention(att, q, kc, vc, table, pos, window, sinks, ps)
        assert torch.equal(out, want), (length, (out - want).abs().max())
        # the live splits' partials (those with keys: the combine reads no other)
        keys = length - (max(length - window, 0) if window is not None else 0)
        bs = at.DecodeAttention.BS
        per = math.ceil(math.ceil(keys / n_split) / bs) * bs
        live = torch.arange(H * n_split) % n_split < math.ceil(keys / per)
        assert torch.equal(att.acc.view(-1, D)[live], acc.view(-1, D)[live]), "partials changed"
        assert torch.equal(att.ml.view(-1, 2)[live], ml.view(-1, 2)[live]), "partials changed"
        assert att.tickets.cpu().tolist() == [0] * (2 + HKV), att.tickets


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float32], ids=["f16", "f32"])
@pytest.mark.parametrize(("H", "HKV"), [(8, 2), (4, 4)])
def test_one_attention_launch_is_the_two_launch_form_bit_for_bit(kv_dtype, H, HKV) -> None:
    attention_case(H, HKV, 32, 16, 8, [1, 5, 128, 17, 100, 1], kv_dtype, None, False)


@pytest.mark.parametrize("window", [None, 24], ids=["full", "window"])
def test_one_attention_launch_with_sinks_and_a_window_is_bit_for_bit(window) -> None:
    attention_case(8, 2, 32, 16, 4, [3, 70, 9, 120], torch.float16, window, True)


def test_the_attention_with_a_combine_launch_of_its_own_is_bit_for_bit() -> None:
    attention_case(8, 2, 32, 16, 8, [40, 1, 128], torch.float16, None, False, fused=False)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two-launch"])
def test_one_attention_launch_on_the_30b_models_shape(fused) -> None:
    # 32 query heads, 4 K/V heads of 128, 64 splits: as many as the keys of an inner step
    # (the combine's tile is then the K/V tile's shape), every split live past 4096 keys
    if not COMPILED:
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    attention_case(32, 4, 128, 64, 64, [1, 200, 5000, 4096, 9001, 2], torch.float16, None,
                   False, fused)  # fmt: skip


# -- routing -----------------------------------------------------------------------------------


def routing_case(E: int, k: int, cols: int, late: bool, norm: bool, steps: int,
                 bn: int | None = None, prefetch: bool = False) -> None:  # fmt: skip
    rng = np.random.default_rng(E + k)
    m = mat(Q.F32, E, cols, rng)
    table = torch.arange(E, dtype=torch.int64, device=DEVICE) * 4096 - 8192
    ticket = torch.zeros(1, dtype=torch.int32, device=DEVICE)

    def buffers() -> tuple[torch.Tensor, ...]:
        return (torch.zeros(k, dtype=torch.int32, device=DEVICE), nan(k),
                torch.zeros(k, dtype=torch.int64, device=DEVICE),
                torch.full((E,), 3, dtype=torch.int32, device=DEVICE))  # fmt: skip

    fused, alone, old = buffers(), buffers(), buffers()
    stats = [torch.tensor([10, 4], dtype=torch.int64, device=DEVICE) for _ in range(3)]
    pf_ids = torch.tensor([E - 1, -1, 0], dtype=torch.int32, device=DEVICE)

    def routing(b: tuple[torch.Tensor, ...], st: torch.Tensor) -> moe.Routing:
        pf = moe.Prefetched(pf_ids, 1 << 20, 4096, st) if prefetch else None
        return moe.Routing(table, *b, k, norm, pf, late, ticket)

    kw = {} if bn is None else {"bn": bn}
    for _ in range(steps):  # the counts and statistics accumulate; the ticket comes back to 0
        x = torch.randn(cols, device=DEVICE)
        nw = torch.rand(cols, device=DEVICE) + 0.5
        y, y2 = nan(E), nan(E)
        matvec(y, x, [m], nw, 1e-6, route=routing(fused, stats[0]), **kw)
        assert int(ticket) == 0
        matvec(y2, x, [m], nw, 1e-6, **kw)
        assert torch.equal(y, y2), "the logits changed"
        pf = routing(alone, stats[1]).prefetched
        moe.route(y2, table, *alone, k, norm, pf, late)
        old_route(y2, routing(old, stats[2]))
        for a, b in zip(fused, alone, strict=True):
            assert torch.equal(a, b), (a, b)
        assert torch.equal(stats[0], stats[1])
        if COMPILED:  # the old launch's own order: the same bits
            for a, b in zip(alone, old, strict=True):
                assert torch.equal(a, b), (a, b)
        else:  # numpy's order in the interpreter: the same ids, weights to rounding
            assert torch.equal(alone[0], old[0]) and torch.equal(alone[3], old[3])
            assert (alone[1] - old[1]).abs().max() < 1e-6
    if prefetch:
        assert int(stats[0][0]) == 10 + 2 * steps  # two copies made each step


@pytest.mark.parametrize(
    ("E", "k", "late", "norm"),
    [(16, 4, False, True), (16, 4, False, False), (12, 3, True, False), (64, 1, False, True)],
)
def test_the_routing_after_the_router_matvec_is_routes_launch_bit_for_bit(E, k, late, norm):
    routing_case(E, k, 256, late, norm, steps=3)


def test_the_routing_after_the_router_matvec_reads_the_copies_ahead() -> None:
    routing_case(16, 4, 256, False, True, steps=2, prefetch=True)


def test_a_route_in_the_matvec_is_refused_where_it_cannot_run() -> None:
    m = mat(Q.F32, 8, 64, np.random.default_rng(1))
    ids = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    eo = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    counts = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    table = torch.zeros(8, dtype=torch.int64, device=DEVICE)
    ticket = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    x = torch.zeros(64, device=DEVICE)
    with pytest.raises(ValueError, match="needs its ticket"):
        matvec(nan(8), x, [m], route=moe.Routing(table, ids, nan(2), eo, counts, 2, True))
    r = moe.Routing(table, ids, nan(2), eo, counts, 2, True, ticket=ticket)
    with pytest.raises(ValueError, match="one router matrix"):
        matvec(nan(8), x, [m], residual=True, route=r)
    short = moe.Routing(table, ids, nan(2), eo, counts[:5], 2, True, ticket=ticket)
    with pytest.raises(ValueError, match="route's counts holds 5 values, not 8"):
        matvec(nan(8), x, [m], route=short)
    with pytest.raises(ValueError, match="top 9 of 8 experts"):
        moe.route(nan(8), table, ids, nan(2), eo, counts, 9, True)
    assert int(ticket) == 0 and not counts.any(), "a refused launch ran"


@pytest.mark.gpu
@pytest.mark.parametrize("late", [False, True], ids=["softmax-first", "top-k-first"])
def test_the_routing_after_the_router_matvec_on_the_30b_models_shape(late) -> None:
    # 128 experts, top 8, a 2048-wide F32 router in two-row programs of eight warps (TUNED)
    if not COMPILED:
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    routing_case(128, 8, 2048, late, not late, steps=6, bn=2)
    routing_case(128, 8, 2048, late, not late, steps=2, bn=2, prefetch=True)


# -- the step's greedy token -----------------------------------------------------------------


@pytest.mark.parametrize("n", [7, 4096, 3 * 4096 + 5], ids=["one-program", "one-full", "four"])
def test_advance_takes_torchs_argmax_in_one_launch_step_after_step(n) -> None:
    """``step.advance``: torch.argmax's token (the first of equal maxima, -0.0 equal to 0.0,
    negative logits), the position and the step moved on, the ring slot written; several
    steps on the same buffers (a graph replays them so): the scratch is back each time."""
    from strata.engine.kernels import step

    gen = torch.Generator().manual_seed(n)
    tok, pos = (
        torch.zeros(1, dtype=torch.int32, device=DEVICE),
        torch.full((1,), 40, dtype=torch.int32, device=DEVICE),
    )
    ring = torch.full((2,), -1, dtype=torch.int32, device=DEVICE)
    count = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    scratch = step.argmax_scratch(DEVICE)
    cases = [torch.randn(n, generator=gen) - 10.0]  # every logit negative
    tie = torch.randn(n, generator=gen)
    tie[[n // 3, n - 1]] = 9.0  # equal maxima: the first
    cases.append(tie)
    zeros = torch.full((n,), -1.0)
    zeros[n // 2] = -0.0
    zeros[n - 1] = 0.0  # -0.0 equals 0.0: the first of them
    cases.append(zeros)
    for i, logits in enumerate(cases):
        step.advance(logits.to(DEVICE), tok, pos, ring, count, scratch)
        want, want_pos, slot = step.advance_reference(logits, 40 + i, i)
        assert int(tok) == want and int(pos) == want_pos and int(ring[slot]) == want
        assert int(count) == i + 1
        assert scratch.cpu().tolist() == [-(1 << 63), 0], "the scratch is back for a replay"
    with pytest.raises(ValueError, match="advance's scratch: int64 \\[2\\]"):
        step.advance(cases[0].to(DEVICE), tok, pos, ring, count, scratch[:1])
