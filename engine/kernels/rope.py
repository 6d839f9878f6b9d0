"""After the q/k/v projection of one decode token: Qwen3's per-head RMSNorm of q and k, rotary
embeddings at the position held on the device, and the token's k and v written into the paged
K/V cache. One launch: program i < H is query head i (rotated in place), the next Hkv programs
are the key heads, the last Hkv the value heads.

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
