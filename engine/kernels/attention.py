"""Decode attention for one query token over the paged K/V cache, split along the keys, in one
launch.

Grouped-query attention: a partial program (K/V head, split) reads its share of the positions
once for all the query heads of its group, keeping their running max, sum and weighted value sum
(the online softmax), and writes them as the split's partial. The length is read from device
memory (position + 1), so the same launch — and a CUDA graph holding it — serves every step;
splits beyond the length do nothing (at 640 keys 10 of Qwen3-30B-A3B's 64 splits a group have
keys: the others wrote 4 KiB of empty partials and counted them, which no combiner reads).
Combiner programs in the same launch, one per query head, wait for their group's live
partials and combine them (``_combine``, one fixed order).

The tickets (``DecodeAttention.tickets``, int32, 0 between launches): each program first draws
a role from a dispatch counter, the first Hkv * NSPLIT draws partials, the last H draws
combiners, so a combiner only ever waits for programs that have started already (they wait for
nothing: no deadlock, however the GPU schedules the launch). A partial adds 1 to its group's
count once its partial is written; a combiner spins until that count is the live splits'; the last
combiner to finish sets every counter back to 0 for the next launch (a later layer, a graph
replay). In Triton's interpreter the programs run one after another in draw order, so every
wait is already over when it starts.

K/V rows are found through the block table: position p lives in page ``block_table[p // page]``
at row ``p % page``; pages are ``page_stride`` elements apart (``engine.kv``: a page holds every
layer's keys and values, so a layer's rows of one page are a slice of it), rows ``Hkv * d``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from strata.engine.kernels.pdl import after_previous, pdl_launch
from strata.engine.kernels.rope import rotation_pairs

LOW_PRECISION = (torch.float16, torch.bfloat16)  # K/V types whose products run on tensor cores

# DecodeAttention.tickets: [dispatch, combiners done, each group's partials written (Hkv)]
_DISPATCH, _EXITS, _WRITTEN = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _span(pos_p, window, NSPLIT: tl.constexpr, BS: tl.constexpr, WIN: tl.constexpr):
    """(n, lo, per): keys lo .. n - 1 are attended, ``per`` of them a split (a whole number of
    inner steps); splits from cdiv(n - lo, per) on are empty."""
    n = tl.load(pos_p) + 1  # keys 0..pos
    lo = 0
    if WIN:  # a sliding window: keys pos - window + 1 .. pos
        lo = tl.maximum(n - window, 0)
    per = tl.cdiv(tl.cdiv(n - lo, NSPLIT), BS) * BS
    return n, lo, per


@triton.jit
def _rotated(src, rows, rm, cos, sin, w, pos, eps, D: tl.constexpr, NEOX: tl.constexpr,
             QK_NORM: tl.constexpr):  # fmt: skip
    """Heads ``rows`` ([R]) of ``src`` ([heads, D] float32), RMSNorm'd by ``w`` (QK_NORM) and
    rotated to position ``pos``, as ``rope._rope_kernel`` computes them: [R, D]. ``NEOX`` pairs
    value i with i + D/2, else 2i with 2i + 1."""
    d, first, partner, col = rotation_pairs(D, D, NEOX)
    x = tl.load(src + rows[:, None] * D + d[None, :], mask=rm[:, None], other=0.0)
    xp = tl.load(src + rows[:, None] * D + partner[None, :], mask=rm[:, None], other=0.0)
    if QK_NORM:
        scale = tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
        x = x * scale * tl.load(w + d)[None, :]
        xp = xp * scale * tl.load(w + partner)[None, :]
    c = tl.load(cos + pos * (D // 2) + col)[None, :]
    s = tl.load(sin + pos * (D // 2) + col)[None, :]
    return tl.where(first[None, :], x * c - xp * s, x * c + xp * s)


@triton.jit
def _partial(
    q, kc, vc, bt, acc_out, ml_out, sm_scale, HKV, PS, hk, s, n, lo, per, cos, sin, qn, kn, eps,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BS: tl.constexpr,
    NSPLIT: tl.constexpr, LOWP: tl.constexpr, ROPE: tl.constexpr, NEOX: tl.constexpr,
    QK_NORM: tl.constexpr,
):  # fmt: skip
    """Split ``s`` of K/V head ``hk`` (query heads hk * G .. hk * G + G - 1): its running max,
    sum and weighted value sum into the partials. ``ROPE``: q is the projection's q|k|v, each
    program norms and rotates its group's queries itself, and the split holding the token (the
    last with keys) first writes the token's rotated key and its value into the pages, where
    its own loop then reads them (the barrier makes its threads' stores visible to all of
    them); no other program of the launch reads that row."""
    start = lo + s * per
    end = tl.minimum(start + per, n)
    g = tl.arange(0, GP)  # the group's query heads, padded to a tile's rows
    gm = g < G
    d = tl.arange(0, D)
    if ROPE:
        pos = n - 1
        qv = _rotated(q, hk * G + g, gm, cos, sin, qn, pos, eps, D, NEOX, QK_NORM)
        if end == n:
            H = HKV * G
            one = g < 1  # the tile's first row: K/V head hk
            kr = _rotated(q + H * D, hk + g, one, cos, sin, kn, pos, eps, D, NEOX, QK_NORM)
            row = tl.load(bt + pos // PAGE).to(tl.int64) * PS + (pos % PAGE) * HKV * D + hk * D
            tl.store(kc + row + g[:, None] * 0 + d[None, :], kr.to(kc.dtype.element_ty),
                     mask=one[:, None])  # fmt: skip
            v = tl.load(q + (H + HKV + hk) * D + d)
            tl.store(vc + row + d, v.to(vc.dtype.element_ty))
            tl.debug_barrier()
    else:
        qv = tl.load(q + (hk * G + g)[:, None] * D + d[None, :], mask=gm[:, None], other=0.0)
    # A 16-bit K/V: q and the softmax weights are rounded to its type for tensor-core products
    # (float32 sums); a float32 K/V: float32 products throughout (8x slower at 32K positions).
    qv = qv.to(kc.dtype.element_ty) if LOWP else qv.to(tl.float32)  # [GP, D]
    m = tl.full([GP], float("-inf"), tl.float32)
    tot = tl.zeros([GP], tl.float32)  # the softmax's running sums
    acc = tl.zeros([GP, D], tl.float32)
    for t0 in range(start, end, BS):
        p = t0 + tl.arange(0, BS)
        pm = p < end
        at = tl.load(bt + p // PAGE, mask=pm, other=0).to(tl.int64) * PS + (p % PAGE) * HKV * D
        off = (at + hk * D)[:, None] + d[None, :]
        k = tl.load(kc + off, mask=pm[:, None], other=0.0)  # [BS, D]
        v = tl.load(vc + off, mask=pm[:, None], other=0.0)  # [BS, D]
        if LOWP:
            sc = tl.dot(qv, tl.trans(k)) / sm_scale  # [GP, BS]
        else:
            sc = tl.dot(qv, tl.trans(k.to(tl.float32)), input_precision="ieee") / sm_scale
        sc = tl.where(pm[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))  # [GP]
        alpha = tl.exp(m - m_new)
        pr = tl.exp(sc - m_new[:, None])  # [GP, BS]
        tot = tot * alpha + tl.sum(pr, 1)
        if LOWP:
            pv = tl.dot(pr.to(v.dtype), v)
        else:
            pv = tl.dot(pr, v.to(tl.float32), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m = m_new
    part = (hk * G + g) * NSPLIT + s  # [GP]
    tl.store(acc_out + part[:, None] * D + d[None, :], acc, mask=gm[:, None])
    tl.store(ml_out + part * 2, m, mask=gm)
    tl.store(ml_out + part * 2 + 1, tot, mask=gm)


@triton.jit(noinline=True)
def _combine(acc_in, ml_in, out, sinks, h, live, D: tl.constexpr, NSPLIT: tl.constexpr,
             SINK: tl.constexpr):  # fmt: skip
    """Head ``h``'s output from its NSPLIT partials, in one fixed order. Splits from ``live`` on
    are empty: their partials are (-inf, 0, zeros), so their loads are skipped and those values
    taken as they are. Not inlined: Triton then lays its tiles out as in a kernel of its own
    (the [NSPLIT, D] tile would otherwise take the K/V tiles' layout where NSPLIT = BS), so its
    sums run in the order the two-launch form's combine kernel ran them, bit for bit."""
    part = h * NSPLIT + tl.arange(0, NSPLIT)
    sm = tl.arange(0, NSPLIT) < live
    m = tl.load(ml_in + part * 2, mask=sm, other=float("-inf"))  # [NSPLIT]
    tot = tl.load(ml_in + part * 2 + 1, mask=sm, other=0.0)
    top = tl.max(m, 0)
    if SINK:  # the head's sink logit joins the softmax's sum (and adds no value)
        sink = tl.load(sinks + h).to(tl.float32)
        top = tl.maximum(top, sink)
    w = tl.exp(m - top)
    d = tl.arange(0, D)
    acc = tl.load(acc_in + (part * D)[:, None] + d[None, :], mask=sm[:, None], other=0.0)
    den = tl.sum(tot * w, 0)
    if SINK:
        den += tl.exp(sink - top)
    o = tl.sum(acc * w[:, None], 0) / den
    tl.store(out + h * D + d, o)


@triton.jit
def _attn_kernel(
    q, kc, vc, bt, pos_p, acc_out, ml_out, out, sinks, tickets, sm_scale, HKV, PS, window,
    cos, sin, qn, kn, eps,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BS: tl.constexpr,
    NSPLIT: tl.constexpr, LOWP: tl.constexpr, WIN: tl.constexpr, SINK: tl.constexpr,
    FUSED: tl.constexpr, ROPE: tl.constexpr, NEOX: tl.constexpr, QK_NORM: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    after_previous(PDL)
    # the program's role: its draw (FUSED; a draw orders nothing), else its id (partials alone)
    if FUSED:
        r = tl.atomic_add(tickets + _DISPATCH, 1, sem="relaxed")
    else:
        r = tl.program_id(0)
    n, lo, per = _span(pos_p, window, NSPLIT, BS, WIN)
    live = tl.cdiv(n - lo, per)  # the splits with keys: the rest have nothing to do
    if r < HKV * NSPLIT:
        hk = r // NSPLIT
        if r % NSPLIT < live:
            _partial(q, kc, vc, bt, acc_out, ml_out, sm_scale, HKV, PS, hk, r % NSPLIT, n, lo,
                     per, cos, sin, qn, kn, eps, G, GP, D, PAGE, BS, NSPLIT, LOWP, ROPE, NEOX,
                     QK_NORM)  # fmt: skip
            if FUSED:
                # Every thread's partial stores come before the barrier; thread 0's atomic add
                # (release, GPU scope) then publishes them all, as a CUTLASS semaphore does
                # after __syncthreads.
                tl.debug_barrier()
                tl.atomic_add(tickets + _WRITTEN + hk, 1, sem="release")
    else:
        h = r - HKV * NSPLIT  # a combiner (FUSED only): query head h
        at = tickets + _WRITTEN + h // G
        c = tl.load(at, volatile=True)
        while c < live:  # the group's live partial programs have all drawn earlier: they finish
            c = tl.load(at, volatile=True)
        # The acquire reads the count the last release wrote (the adds form one release
        # sequence), so every partial of the group is visible to this program's loads after
        # the barrier (the acquire also drops stale lines from its multiprocessor's L1). Its
        # value (NSPLIT) is used, so the compiler keeps it a read rather than a bare fence.
        c = tl.atomic_add(at, 0, sem="acquire")
        tl.debug_barrier()
        live = tl.minimum(live, c)  # (c is live)
        _combine(acc_out, ml_out, out, sinks, h, live, D, NSPLIT, SINK)
        # the last combiner out: every program has drawn, counted and stopped reading the
        # counters, so they go back to 0 for the next launch
        if tl.atomic_add(tickets + _EXITS, 1) == HKV * G - 1:
            tl.store(tickets + _DISPATCH, 0)
            tl.store(tickets + _EXITS, 0)
            k = tl.arange(0, 64)
            for k0 in range(0, HKV, 64):
                tl.store(tickets + _WRITTEN + k0 + k, 0, mask=k0 + k < HKV)


@triton.jit
def _combine_kernel(acc_in, ml_in, out, sinks, pos_p, window, NSPLIT: tl.constexpr,
                    BS: tl.constexpr, WIN: tl.constexpr, D: tl.constexpr,
                    SINK: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    # the combine as a launch of its own (``DecodeAttention(fused=False)``)
    after_previous(PDL)
    n, lo, per = _span(pos_p, window, NSPLIT, BS, WIN)
    _combine(acc_in, ml_in, out, sinks, tl.program_id(0), tl.cdiv(n - lo, per), D, NSPLIT, SINK)


@dataclass(frozen=True)
class Rotary:
    """What ``DecodeAttention`` needs to take the q/k/v projection as it comes (one launch for
    what ``rope.rope_store`` and the attention did in two): the rotation tables (``cos``,
    ``sin``: [n_ctx, d/2] float32, a whole head rotated), Qwen3's per-head RMSNorm weights of q
    and k (both or neither) and its epsilon, and the pairing (``neox``: i with i + d/2)."""

    cos: torch.Tensor
    sin: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float
    neox: bool


class DecodeAttention:
    """The scratch of split attention, sized once for the model (a CUDA graph keeps it). One
    program per (K/V head, split) computes every query head of the group: each K/V row is read
    once (a program per query head read it G times, at 32K positions 270 µs a layer on an
    H200 for Qwen3-30B-A3B's 8 query heads per K/V head). ``fused`` (the default): the
    combine runs in the same launch (the module's docstring); False: a launch of its own, the
    same arithmetic (to measure one against the other)."""

    BS = 64  # keys per inner step: a page

    def __init__(
        self, n_head: int, n_head_kv: int, head_dim: int, page: int, n_split: int,
        device: torch.device, fused: bool = True,
    ) -> None:  # fmt: skip
        if n_head % n_head_kv:
            raise ValueError(f"{n_head} query heads do not share {n_head_kv} K/V heads evenly")
        for name, v in (("head_dim", head_dim), ("n_split", n_split)):
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} {v} is not a power of two")
        self.H, self.HKV, self.D = n_head, n_head_kv, head_dim
        self.page, self.n_split = page, n_split
        self.G = n_head // n_head_kv
        self.fused = fused
        parts = n_head * n_split
        self.acc = torch.empty(parts * head_dim, dtype=torch.float32, device=device)
        self.ml = torch.empty(parts * 2, dtype=torch.float32, device=device)
        # the launch's counters, 0 between launches: the roles drawn, the combiners done, each
        # group's partials written (the last combiner sets them back to 0)
        self.tickets = torch.zeros(2 + n_head_kv, dtype=torch.int32, device=device)

    def __call__(
        self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        block_table: torch.Tensor, pos: torch.Tensor, page_stride: int | None = None,
        window: int | None = None, sinks: torch.Tensor | None = None,
        rotary: Rotary | None = None,
    ) -> None:  # fmt: skip
        """out: [H * d] float32 <- softmax(q k^T / sqrt(d)) v over positions 0..pos, or over
        pos - window + 1 .. pos with ``window`` (gpt-oss's sliding window: its layers' block
        table); ``sinks`` [H]: each head's sink logit joins its softmax's sum (gpt-oss).
        ``page_stride``: elements from one page to the next (None: pages of one layer side by
        side, ``page * Hkv * d``). ``rotary``: q is the token's projection [(H + 2 Hkv) * d]
        (q, k, v), left as it is: the launch norms and rotates q and k itself and writes the
        token's key and value at ``pos`` in the pages (``Rotary``)."""
        ps = self.page * self.HKV * self.D if page_stride is None else page_stride
        if window is not None and window < 1:
            raise ValueError(f"attention window {window}: must be at least 1")
        if sinks is not None and sinks.numel() != self.H:
            raise ValueError(f"{sinks.numel()} sink logits for {self.H} query heads")
        sink = out if sinks is None else sinks
        r = self._rotary_args(q, rotary)
        parts = self.HKV * self.n_split
        _attn_kernel[(parts + (self.H if self.fused else 0),)](
            q, k_cache, v_cache, block_table, pos, self.acc, self.ml, out, sink, self.tickets,
            math.sqrt(self.D), self.HKV, ps, window or 0, *r,
            G=self.G, GP=max(16, triton.next_power_of_2(self.G)), D=self.D, PAGE=self.page,
            BS=self.BS, NSPLIT=self.n_split, LOWP=k_cache.dtype in LOW_PRECISION,
            WIN=window is not None, SINK=sinks is not None, FUSED=self.fused,
            ROPE=rotary is not None, NEOX=rotary is None or rotary.neox,
            QK_NORM=rotary is not None and rotary.q_norm is not None, num_warps=4,
            **pdl_launch(q.device),
        )  # fmt: skip
        if not self.fused:
            _combine_kernel[(self.H,)](
                self.acc, self.ml, out, sink, pos, window or 0, NSPLIT=self.n_split, BS=self.BS,
                WIN=window is not None, D=self.D, SINK=sinks is not None, num_warps=4,
                **pdl_launch(q.device),
            )  # fmt: skip

    def _rotary_args(self, q: torch.Tensor, rotary: Rotary | None) -> list[object]:
        """The launch's cos, sin, q norm, k norm and epsilon (q's own tensor where unread)."""
        if rotary is None:
            return [q, q, q, q, 0.0]
        H, HKV, D = self.H, self.HKV, self.D
        if q.numel() != (H + 2 * HKV) * D:
            raise ValueError(f"with rotary, q is q|k|v: {(H + 2 * HKV) * D} values for {H} "
                             f"query and {HKV} K/V heads of {D}, got {q.numel()}")  # fmt: skip
        for name, t in (("cos", rotary.cos), ("sin", rotary.sin)):
            if t.dim() != 2 or t.shape[1] != D // 2 or t.dtype != torch.float32:
                raise ValueError(f"rotary {name}: [positions, {D // 2}] float32 (a whole head "
                                 f"rotated), got {list(t.shape)} {t.dtype}")  # fmt: skip
        if (rotary.q_norm is None) != (rotary.k_norm is None):
            raise ValueError("rotary: the q and k norms come together or not at all")
        qn = q if rotary.q_norm is None else rotary.q_norm
        kn = q if rotary.k_norm is None else rotary.k_norm
        for name, t in (("q", qn), ("k", kn)):
            if t is not q and t.numel() != D:
                raise ValueError(f"rotary {name} norm: {t.numel()} weights for heads of {D}")
        return [rotary.cos, rotary.sin, qn, kn, rotary.eps]


def attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """q: [H, d]; keys, values: [S, Hkv, d] -> [H * d] float32 (as ``layers.attention``);
    ``sinks`` [H]: a logit per head that joins the softmax and adds no value."""
    H, d = q.shape
    Hkv = keys.shape[1]
    qg = q.view(Hkv, H // Hkv, d)
    scores = qg @ keys.float().permute(1, 2, 0) / math.sqrt(d)  # [Hkv, G, S]
    if sinks is None:
        probs = torch.softmax(scores, -1)
    else:
        sink = sinks.float().view(Hkv, H // Hkv, 1)
        probs = torch.softmax(torch.cat((scores, sink), -1), -1)[..., :-1]
    return (probs @ values.float().permute(1, 0, 2)).reshape(H * d)
