"""A prompt chunk's attention over the paged K/V cache, flash-attention style, in one launch:
gpt-oss's layers (causal, a sink logit per head, a sliding window on every other layer).

The chunk's queries q [T, H, d] sit at positions start .. start + T - 1; their keys and values
are already in the pages. A program takes a block of ``BM`` query rows and one K/V head, and
all the G query heads that share it: its tile's rows are (row, head) pairs, row-major, the
group padded to a power of two (GP), so each K/V row is read once for the whole group. It walks
its keys in blocks of ``BN`` — from the first key any of its rows sees (0, or the first row's
window start, rounded down to a block) to its last row's position; blocks that causality or the
window exclude for every row are never read — and keeps each tile row's running max, sum and
weighted value sum (the online softmax, float32). Position p's K/V row is found through the
block table: page ``table[p // page]``, row ``p % page`` (``engine.kv``); when a key block lies
in one page (the page a multiple of BN) the block reads one table entry.

The products run on tensor cores: for a float16 K/V, q (scaled) and the softmax weights are
rounded to float16, float32 sums; for a float32 K/V, products as accurate as float32's
(``F32_PRECISION``). The scores are kept in base 2 (q scaled by log2(e) / sqrt(d), ``exp2``).
The sink: the running max starts at the head's sink logit (so the max is taken over it too and
nothing overflows, and no row's max is ever -inf), and the end divides by sum + 2^(sink - max):
the sink joins the denominator and adds no value. Without sinks the max starts at a large
finite negative, for the same reason.

Deterministic: no atomics, each program walks its key blocks in one fixed order, and a row's
result depends only on the chunk's shape (T, start), never on padding beyond T.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from strata.engine.kernels.attention import LOW_PRECISION
from strata.engine.kernels.inputs import INTERPRETED

LOG2E = 1.4426950408889634
# Tile sizes: rows of the tile (query rows x the group's heads) and keys per step. The
# interpreter runs a program at a time in Python: fewer, wider programs there.
BLOCK_M, BLOCK_N = (128, 64) if not INTERPRETED else (128, 128)
NUM_WARPS, NUM_STAGES = 4, 2
# A float32 K/V's products: three TF32 products each on the GPU (float32's accuracy on tensor
# cores; a single TF32 product would round to 10-bit mantissas, as float16 does, and a float32
# K/V is the precise choice, the one the parity tests make), plain float32 in the interpreter
F32_PRECISION = "ieee" if INTERPRETED else "tf32x3"


# the chunk's length and start vary from chunk to chunk: one compiled kernel for all of them
@triton.jit(do_not_specialize=["T", "start"])
def _chunk_attn_kernel(
    q, kc, vc, bt, out, sinks, T, start, window, qk_scale,
    SQT, SQH, SOT, PS, RS,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, LOWP: tl.constexpr, WIN: tl.constexpr,
    SINK: tl.constexpr, ONE_PAGE: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    # the row blocks with the most keys first (the last rows of a causal chunk)
    tb = tl.num_programs(0) - 1 - tl.program_id(0)
    hk = tl.program_id(1)
    t0 = tb * BM
    r = tl.arange(0, BM * GP)
    t = t0 + r // GP  # the tile row's query row in the chunk
    g = r % GP  # and its query head in the group
    h = hk * G + g
    live = (t < T) & (g < G)
    # rows past the chunk take its last row's position: every tile row sees a key
    rpos = start + tl.minimum(t, T - 1)  # [BM * GP]
    d = tl.arange(0, D)
    qv = tl.load(q + (t.to(tl.int64) * SQT + h * SQH)[:, None] + d[None, :],
                 mask=live[:, None], other=0.0)  # fmt: skip
    qv = qv * qk_scale  # scores in base 2, 1 / sqrt(d) folded in
    qv = qv.to(kc.dtype.element_ty) if LOWP else qv.to(tl.float32)  # [BM * GP, D]
    if SINK:
        sk = tl.load(sinks + h, mask=g < G, other=0.0).to(tl.float32) * 1.4426950408889634
        m = sk
    else:
        m = tl.full([BM * GP], -1.0e30, tl.float32)
    tot = tl.zeros([BM * GP], tl.float32)
    acc = tl.zeros([BM * GP, D], tl.float32)
    hi = start + tl.minimum(t0 + BM, T)  # keys < hi: up to the block's last row
    lo = 0
    if WIN:  # the first row's window starts here; no row sees a key before it
        lo = tl.maximum(start + t0 - window + 1, 0)
    for n0 in range(lo - lo % BN, hi, BN):
        p = n0 + tl.arange(0, BN)
        pm = (p >= lo) & (p < hi)
        if ONE_PAGE:  # the block lies in one page
            pg = tl.load(bt + n0 // PAGE).to(tl.int64)
            at = pg * PS + (p % PAGE) * RS
        else:
            pg = tl.load(bt + p // PAGE, mask=pm, other=0).to(tl.int64)
            at = pg * PS + (p % PAGE) * RS
        off = (at + hk * D)[:, None] + d[None, :]
        k = tl.load(kc + off, mask=pm[:, None], other=0.0)  # [BN, D]
        v = tl.load(vc + off, mask=pm[:, None], other=0.0)
        if LOWP:
            s = tl.dot(qv, tl.trans(k))  # [BM * GP, BN]
        else:
            s = tl.dot(qv, tl.trans(k.to(tl.float32)), input_precision=PREC)
        seen = p[None, :] <= rpos[:, None]
        if WIN:
            seen = seen & (p[None, :] > rpos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.math.exp2(m - m_new)
        pr = tl.math.exp2(s - m_new[:, None])
        tot = tot * alpha + tl.sum(pr, 1)
        if LOWP:
            pv = tl.dot(pr.to(v.dtype), v)
        else:
            pv = tl.dot(pr, v.to(tl.float32), input_precision=PREC)
        acc = acc * alpha[:, None] + pv
        m = m_new
    if SINK:  # the sink's share of the denominator (m >= its logit: at most 1)
        tot += tl.math.exp2(sk - m)
    o = acc / tot[:, None]
    tl.store(out + (t.to(tl.int64) * SOT + h * D)[:, None] + d[None, :], o,
             mask=live[:, None])  # fmt: skip


def chunk_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor, start: int,
    window: int | None = None, sinks: torch.Tensor | None = None,
    block_m: int = BLOCK_M, block_n: int = BLOCK_N,
) -> torch.Tensor:  # fmt: skip
    """q: [T, H, d] (float32 or 16-bit) at positions start .. start + T - 1, each row over its
    keys 0 .. its position (``window``: the last ``window`` of them) read through ``table``
    (int32, a page per entry) from ``keys``, ``values``: [pages, page, Hkv, d] views of the
    pool (``KVCache.layer``: pages ``stride(0)`` elements apart). ``sinks`` [H]: each head's
    logit that joins its softmax and adds no value. ``block_m``: tile rows (query rows times
    the group's heads, padded to a power of two); ``block_n``: keys per step. -> [T, H * d]
    float32."""
    T, H, D = q.shape
    if keys.dim() != 4 or keys.shape != values.shape or keys.stride() != values.stride():
        raise ValueError(
            f"keys {tuple(keys.shape)} and values {tuple(values.shape)}: expected two views "
            "[pages, page, Hkv, d] of one pool"
        )
    _, page, HKV, dk = keys.shape
    if dk != D or H % HKV:
        raise ValueError(f"q [{T}, {H}, {D}] against K/V heads [{HKV}, {dk}]: the head sizes "
                         "differ or the query heads do not share the K/V heads evenly")  # fmt: skip
    if D < 16 or D & (D - 1):
        raise ValueError(f"head_dim {D}: the chunk attention needs a power of two >= 16")
    if keys.stride(3) != 1 or keys.stride(2) != D or q.stride(2) != 1:
        raise ValueError("the K/V rows and each query head's d values must be contiguous")
    if keys.dtype != values.dtype or keys.dtype not in (torch.float32, *LOW_PRECISION):
        raise ValueError(f"K/V of {keys.dtype} and {values.dtype}: expected one of float32, "
                         "float16, bfloat16")  # fmt: skip
    if window is not None and window < 1:
        raise ValueError(f"attention window {window}: must be at least 1")
    if sinks is not None and sinks.numel() != H:
        raise ValueError(f"{sinks.numel()} sink logits for {H} query heads")
    if start < 0:
        raise ValueError(f"chunk start {start}: must be at least 0")
    if table.dtype != torch.int32 or table.numel() * page < start + T:
        raise ValueError(
            f"block table of {table.numel()} {table.dtype} entries for positions up to "
            f"{start + T} in pages of {page}: expected int32, enough of them"
        )
    G = H // HKV
    GP = triton.next_power_of_2(G)
    if block_m < GP or block_m & (block_m - 1) or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_m {block_m}, block_n {block_n}: powers of two, block_m at "
                         f"least the group's {GP} heads, block_n at least 16")  # fmt: skip
    out = torch.empty(T, H * D, dtype=torch.float32, device=q.device)
    if T == 0:
        return out
    bm = max(1, block_m // GP)  # query rows per program
    if bm * GP < 16:  # tl.dot's smallest tile
        bm = 16 // GP
    sink = out if sinks is None else sinks
    _chunk_attn_kernel[(triton.cdiv(T, bm), HKV)](
        q, keys, values, table, out, sink, T, start, window or 0, LOG2E / math.sqrt(D),
        q.stride(0), q.stride(1), H * D, keys.stride(0), keys.stride(1),
        G=G, GP=GP, D=D, PAGE=page, BM=bm, BN=block_n, LOWP=keys.dtype in LOW_PRECISION,
        WIN=window is not None, SINK=sinks is not None, ONE_PAGE=page % block_n == 0,
        PREC=F32_PRECISION,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    return out
