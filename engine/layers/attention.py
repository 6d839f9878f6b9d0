"""Grouped-query causal self-attention over the K/V cache."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from strata.engine.kv import KVCache
from strata.engine.layers.norm import rms_norm
from strata.engine.layers.rope import Rope
from strata.engine.weights import Weight, linear


@dataclass(frozen=True)
class AttentionWeights:
    q: Weight
    k: Weight
    v: Weight
    o: Weight
    q_norm: torch.Tensor | None = None  # [d] per-head RMSNorm (Qwen3)
    k_norm: torch.Tensor | None = None


@dataclass(frozen=True)
class AttentionShape:
    n_head: int
    n_head_kv: int
    head_dim: int
    rms_eps: float


def attention(
    x: torch.Tensor,
    w: AttentionWeights,
    shape: AttentionShape,
    rope: Rope,
    kv: KVCache,
    layer: int,
    start: int,
) -> torch.Tensor:
    # x: [T, D]; positions start .. start+T-1
    T = x.shape[0]
    H, Hkv, d = shape.n_head, shape.n_head_kv, shape.head_dim
    q = linear(x, w.q).view(T, H, d)
    k = linear(x, w.k).view(T, Hkv, d)
    v = linear(x, w.v).view(T, Hkv, d)
    if w.q_norm is not None and w.k_norm is not None:
        q = rms_norm(q, w.q_norm, shape.rms_eps)
        k = rms_norm(k, w.k_norm, shape.rms_eps)
    positions = torch.arange(start, start + T, device=x.device)
    q, k = rope(q, positions), rope(k, positions)
    kv.write(layer, start, k, v)
    keys, values = kv.read(layer, start + T)  # [S, Hkv, d], S = start + T
    group = H // Hkv
    # q: [Hkv, group*T, d] so each K/V head serves its group of query heads without a copy of K/V
    qg = q.view(T, Hkv, group, d).permute(1, 2, 0, 3).reshape(Hkv, group * T, d)
    scores = qg @ keys.permute(1, 2, 0) / math.sqrt(d)  # [Hkv, group*T, S]
    # causal mask: query at position start+t sees keys 0..start+t
    S = start + T
    q_pos = positions.repeat(group)  # [group*T]
    mask = torch.arange(S, device=x.device)[None, :] > q_pos[:, None]  # [group*T, S]
    scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = probs @ values.permute(1, 0, 2)  # [Hkv, group*T, d]
    out = out.view(Hkv, group, T, d).permute(2, 0, 1, 3).reshape(T, H * d)
    return linear(out, w.o)
