"""After the q/k/v projection of one decode token: Qwen3's per-head RMSNorm of q and k, rotary
embeddings at the position held on the device, and the token's k and v written into the paged
K/V cache. One launch: program i < H is query head i (rotated in place), the next Hkv programs
are the key heads, the last Hkv the value heads. The decode step does this inside the
attention's launch (``attention.Rotary``); ``rope_store`` is its two-launch form, which the
tests compare it with, and ``rope_store_gated`` the hybrids' own launch.

RoPE's cos and sin come from tables made once in float64 and rounded to float32, exactly as the
reference (``layers.rope``) makes them, and are applied with the reference's products. ``neox``
pairs dimension i with i + d/2 (Qwen), otherwise 2i with 2i + 1 (Llama, Mixtral).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _halves(D: tl.constexpr, NEOX: tl.constexpr):
    half = tl.arange(0, D // 2)
    if NEOX:
        return half, half + D // 2
    return 2 * half, 2 * half + 1


@triton.jit
def _rope_kernel(
    qkv,
    cos,
    sin,
    qn,
    kn,
    kc,
    vc,
    bt,
    pos_p,
    eps,
    H,
    HKV,
    PS,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    NEOX: tl.constexpr,
    QK_NORM: tl.constexpr,
):
    i = tl.program_id(0)
    pos = tl.load(pos_p)
    ia, ib = _halves(D, NEOX)
    # the token's K/V row: its page's start, then the row in the page
    at = tl.load(bt + pos // PAGE).to(tl.int64) * PS + (pos % PAGE) * HKV * D
    if i < H + HKV:
        a = tl.load(qkv + i * D + ia)
        b = tl.load(qkv + i * D + ib)
        if QK_NORM:
            if i < H:
                w = qn
            else:
                w = kn
            scale = tl.rsqrt((tl.sum(a * a, 0) + tl.sum(b * b, 0)) / D + eps)
            a = a * scale * tl.load(w + ia)
            b = b * scale * tl.load(w + ib)
        half = tl.arange(0, D // 2)
        c = tl.load(cos + pos * (D // 2) + half)
        s = tl.load(sin + pos * (D // 2) + half)
        ra = a * c - b * s
        rb = a * s + b * c
        if i < H:
            tl.store(qkv + i * D + ia, ra)
            tl.store(qkv + i * D + ib, rb)
        else:
            row = kc + at + (i - H) * D
            tl.store(row + ia, ra.to(kc.dtype.element_ty))
            tl.store(row + ib, rb.to(kc.dtype.element_ty))
    else:
        hv = i - H - HKV
        d = tl.arange(0, D)
        v = tl.load(qkv + (H + HKV + hv) * D + d)
        tl.store(vc + at + hv * D + d, v.to(vc.dtype.element_ty))


def rope_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    pos: torch.Tensor,
    eps: float,
    n_head: int,
    n_head_kv: int,
    head_dim: int,
    page: int,
    neox: bool,
    page_stride: int | None = None,
) -> None:
    """qkv: [(H + 2 Hkv) * d] float32, q rotated in place; k_cache, v_cache: one layer's
    pages, ``page_stride`` elements apart (None: side by side, ``page * Hkv * d``), each
    [page, Hkv, d]; block_table: int32 [n_pages]; pos: int32 [1] on the device."""
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim {head_dim} is not a power of two")
    qk = q_norm is not None and k_norm is not None
    grid = (n_head + 2 * n_head_kv,)
    _rope_kernel[grid](
        qkv,
        cos,
        sin,
        q_norm if qk else qkv,
        k_norm if qk else qkv,
        k_cache,
        v_cache,
        block_table,
        pos,
        eps,
        n_head,
        n_head_kv,
        page * n_head_kv * head_dim if page_stride is None else page_stride,
        D=head_dim,
        PAGE=page,
        NEOX=neox,
        QK_NORM=qk,
        num_warps=1,
    )


def rope_tables(
    head_dim: int, theta: float, n_ctx: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [n_ctx, d/2] float32, made as ``layers.rope.Rope`` makes them."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(n_ctx, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float().to(device), angles.sin().float().to(device)


@triton.jit
def rotation_pairs(D: tl.constexpr, R: tl.constexpr, NEOX: tl.constexpr):
    """For a head of D values whose first R rotate: (d, first, partner, col) over d < D, each
    value's pair partner and its angle's column (``cos``/``sin`` [positions, R/2]), ``first``
    where it is the pair's first (x c - x' s, else x c + x' s). ``NEOX`` pairs i with i + R/2,
    else 2i with 2i + 1; values from R on are their own partners, at column 0."""
    d = tl.arange(0, D)
    if NEOX:
        first = d < R // 2
        partner = tl.where(first, d + R // 2, d - R // 2)
        col = tl.where(first, d, d - R // 2)
    else:
        first = d % 2 == 0
        partner = tl.where(first, d + 1, d - 1)
        col = d // 2
    if R < D:
        rot = d < R
        partner = tl.where(rot, partner, d)
        col = tl.where(rot, col, 0)
    return d, first, partner, col


@triton.jit
def _rope_gated_kernel(
    qkv, cos, sin, qn, kn, q_out, gate_out, kc, vc, bt, pos_p, eps, H, HKV, PS,
    D: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr, NEOX: tl.constexpr,
    QK_NORM: tl.constexpr, GATED: tl.constexpr, QS: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    pos = tl.load(pos_p)
    d = tl.arange(0, D)
    at = tl.load(bt + pos // PAGE).to(tl.int64) * PS + (pos % PAGE) * HKV * D
    if i < H + HKV:
        if i < H:
            src = qkv + i * QS
            w = qn
        else:
            src = qkv + H * QS + (i - H) * D
            w = kn
        _, first, partner, col = rotation_pairs(D, R, NEOX)
        x = tl.load(src + d)
        xp = tl.load(src + partner)
        if QK_NORM:
            scale = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
            x = x * scale * tl.load(w + d)
            xp = xp * scale * tl.load(w + partner)
        c = tl.load(cos + pos * (R // 2) + col)
        s = tl.load(sin + pos * (R // 2) + col)
        y = tl.where(first, x * c - xp * s, x * c + xp * s)
        y = tl.where(d < R, y, x)  # values from R on stay
        if i < H:
            tl.store(q_out + i * D + d, y)
            if GATED:
                tl.store(gate_out + i * D + d, tl.load(src + D + d))
        else:
            tl.store(kc + at + (i - H) * D + d, y.to(kc.dtype.element_ty))
    else:
        hv = i - H - HKV
        v = tl.load(qkv + H * QS + HKV * D + hv * D + d)
        tl.store(vc + at + hv * D + d, v.to(vc.dtype.element_ty))


def rope_store_gated(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None, q_out: torch.Tensor, gate_out: torch.Tensor | None,
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, pos: torch.Tensor,
    eps: float, n_head: int, n_head_kv: int, head_dim: int, page: int, neox: bool,
    page_stride: int,
) -> None:  # fmt: skip
    """``rope_store`` for partial rotary (the first ``2 * cos.shape[1]`` values of a head) and
    gated attention: qkv [H * (2 d if gated else d) + 2 Hkv d] float32 holds each query head's
    query then its gate (``gate_out`` given) before k and v; the normed, rotated queries go to
    ``q_out`` [H d], the gates to ``gate_out`` [H d], k and v into the pages."""
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim {head_dim} is not a power of two")
    n_rot = 2 * cos.shape[1]
    if not 0 < n_rot <= head_dim:
        raise ValueError(f"RoPE tables of {n_rot} values for heads of {head_dim}")
    gated = gate_out is not None
    want = n_head * head_dim * (2 if gated else 1) + 2 * n_head_kv * head_dim
    if qkv.numel() != want:
        raise ValueError(f"qkv holds {qkv.numel()} values, want {want}")
    qk = q_norm is not None and k_norm is not None
    _rope_gated_kernel[(n_head + 2 * n_head_kv,)](
        qkv, cos, sin, q_norm if qk else qkv, k_norm if qk else qkv, q_out,
        gate_out if gated else q_out, k_cache, v_cache, block_table, pos, eps, n_head,
        n_head_kv, page_stride,
        D=head_dim, R=n_rot, PAGE=page, NEOX=neox, QK_NORM=qk, GATED=gated,
        QS=head_dim * (2 if gated else 1),  # a query head's rows: its query, then its gate
        num_warps=1,
    )  # fmt: skip
