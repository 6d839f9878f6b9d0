"""The reference Gated DeltaNet layer (Qwen3.5/3.6, Qwen3-Next): plain torch, float32, computed
as llama.cpp computes it (``delta-net-base.cpp`` and the fused CPU kernel: one recurrent update
per position), over a sequence's ``RecurrentState``.

Per position t and v head h, with the state S [S(v), S(k)]::

    S ← S · exp(g_t)                       g_t = softplus(α_t + dt_bias) · A   (A < 0)
    S ← S + σ(β_t) (v_t − S k_t) k_tᵀ       k, q L2-normalised, q scaled by 1/√S
    o_t = S q_t

after a causal convolution (with SiLU) over q|k|v whose last inputs the state keeps; the output
is RMSNorm(o) · SiLU(z), projected back to the model's width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from strata.engine.ops import DeltaNetSpec, DeltaNetWeights
from strata.engine.weights import linear


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., S] / sqrt(sum x^2 + eps) (llama.cpp: rms_norm with eps / S, over sqrt(S))
    return x * torch.rsqrt(x.pow(2).sum(dim=-1, keepdim=True) + eps)


def projections(h: torch.Tensor, w: DeltaNetWeights, spec: DeltaNetSpec):
    """h [T, D] (normed) -> qkv [T, C], z [T, Hv, S], beta [T, Hv], alpha [T, Hv]."""
    T = h.shape[0]
    Hk, Hv, S = spec.n_k_heads, spec.n_v_heads, spec.head_dim
    r = Hv // Hk
    if w.qkvz is not None:  # per k head: q [S], k [S], its r v heads, its r z heads
        mixed = linear(h, w.qkvz).view(T, Hk, 2 * S + 2 * r * S)
        q, k, v, z = mixed.split((S, S, r * S, r * S), dim=-1)
        qkv = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1)
        z = z.reshape(T, Hv, S)
    else:
        assert w.qkv is not None and w.z is not None
        qkv = linear(h, w.qkv)
        z = linear(h, w.z).view(T, Hv, S)
    if w.ba is not None:  # per k head: its r β, then its r α
        ba = linear(h, w.ba).view(T, Hk, 2 * r)
        beta, alpha = ba[..., :r].reshape(T, Hv), ba[..., r:].reshape(T, Hv)
    else:
        assert w.beta is not None and w.alpha is not None
        beta, alpha = linear(h, w.beta), linear(h, w.alpha)
    return qkv, z, beta, alpha


def causal_conv(qkv: torch.Tensor, taps: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
    """qkv [T, C] after the K-1 inputs ``conv_state`` [K-1, C] holds, through the taps [C, K];
    SiLU of the result [T, C]. ``conv_state`` becomes the last K-1 inputs."""
    K = taps.shape[1]
    x = torch.cat((conv_state, qkv), dim=0)  # [K-1+T, C]
    windows = x.unfold(0, K, 1)  # [T, C, K]
    out = (windows * taps).sum(dim=-1)
    if K > 1:
        conv_state.copy_(x[-(K - 1) :])
    return F.silu(out)


def repeat_heads(x: torch.Tensor, n_v: int, tiled: bool) -> torch.Tensor:
    """x [T, Hk, S] to [T, Hv, S]: head h takes k head h % Hk (tiled) or h // (Hv / Hk)."""
    n_k = x.shape[1]
    if n_k == n_v:
        return x
    if tiled:
        return x.repeat(1, n_v // n_k, 1)
    return x.repeat_interleave(n_v // n_k, dim=1)


def delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The gated delta rule over T positions, one update per position. q, k, v: [T, H, S]
    (q scaled), g, beta: [T, H]; ``state`` [H, S(v), S(k)] is updated in place. -> o [T, H, S]."""
    T = q.shape[0]
    out = torch.empty_like(v)
    decay = g.exp()
    for t in range(T):
        state.mul_(decay[t][:, None, None])
        kv = torch.einsum("hvk,hk->hv", state, k[t])  # [H, S]
        delta = (v[t] - kv) * beta[t][:, None]
        state.add_(delta[:, :, None] * k[t][:, None, :])
        out[t] = torch.einsum("hvk,hk->hv", state, q[t])
    return out


def delta_net(
    h: torch.Tensor,
    w: DeltaNetWeights,
    spec: DeltaNetSpec,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
) -> torch.Tensor:
    """The layer's output for h [T, D] (already normed); ``conv_state`` [K-1, C] and
    ``ssm_state`` [Hv, S, S] (its states for this sequence) advance past the T positions."""
    T = h.shape[0]
    Hk, Hv, S = spec.n_k_heads, spec.n_v_heads, spec.head_dim
    qkv, z, beta, alpha = projections(h, w, spec)
    beta = torch.sigmoid(beta)  # [T, Hv]
    g = F.softplus(alpha + w.dt_bias) * w.a  # [T, Hv], <= 0
    mixed = causal_conv(qkv, w.conv, conv_state)  # [T, C]
    q, k, v = mixed.split((spec.key_dim, spec.key_dim, spec.value_dim), dim=-1)
    q = l2_norm(q.reshape(T, Hk, S), spec.rms_eps)
    k = l2_norm(k.reshape(T, Hk, S), spec.rms_eps)
    q = repeat_heads(q, Hv, spec.tiled_heads) / math.sqrt(S)
    k = repeat_heads(k, Hv, spec.tiled_heads)
    o = delta_rule(q, k, v.reshape(T, Hv, S), g, beta, ssm_state)  # [T, Hv, S]
    scale = torch.rsqrt(o.pow(2).mean(dim=-1, keepdim=True) + spec.rms_eps)
    o = o * scale * w.out_norm * F.silu(z)  # the gated RMSNorm
    return linear(o.reshape(T, Hv * S), w.out)
