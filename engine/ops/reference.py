"""The reference implementation of the operations: plain torch on any device, computed the way
llama.cpp computes them (float32 RMSNorm, float64 RoPE tables rounded to the activations' type,
float32 routing). The numbers every GPU kernel is checked against.

``RefOps`` runs one step of ``T`` positions (a prompt chunk, or one decode token) of one stage:
its K/V and its expert provider (the only way to that stage's experts)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from strata.engine.experts import ExpertProvider
from strata.engine.kv import KVCache
from strata.engine.ops import (
    AttentionSpec,
    AttentionWeights,
    DeltaNetSpec,
    DeltaNetWeights,
    HeadWeights,
    MoEWeights,
    RopeSpec,
    RoutingSpec,
    SharedExpert,
    SwigluOAI,
    YarnSpec,
)
from strata.engine.ops.delta_net import delta_net
from strata.engine.recurrent import RecurrentState
from strata.engine.weights import Weight, linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., D], weight: [D]
    scale = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x * scale * weight


class Rope:
    """Rotary position embeddings in the layouts GGUF models use (``RopeSpec``): all of a head or
    its first ``n_rot`` values, in halves (NeoX) or adjacent pairs, and the interleaved
    multi-section layout, where the pairs of the fourth section stay unrotated for text."""

    def __init__(self, head_dim: int, spec: RopeSpec) -> None:
        n_rot = head_dim if spec.n_rot is None else spec.n_rot
        if n_rot % 2 or not 0 < n_rot <= head_dim:
            raise ValueError(f"rope over {n_rot} of {head_dim} values: must be even, at most all")
        self.head_dim, self.n_rot, self.neox = head_dim, n_rot, spec.neox
        # inv_freq: [n_rot/2]
        self.inv_freq = spec.theta ** (-torch.arange(0, n_rot, 2, dtype=torch.float64) / n_rot)
        if spec.sections is not None:
            self.inv_freq = self.inv_freq * _text_pairs(spec.sections, n_rot // 2)
        self.mscale = 1.0
        if spec.yarn is not None:
            self.inv_freq = self.inv_freq * _yarn_mix(spec.yarn, spec.theta, n_rot)
            self.mscale = spec.yarn.mscale if spec.yarn.ext_factor else 1.0

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [T, H, d], positions: [T]
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        angles = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]  # [T, n_rot/2]
        cos = (angles.cos() * self.mscale).to(x.dtype)[:, None, :]  # [T, 1, n_rot/2]
        sin = (angles.sin() * self.mscale).to(x.dtype)[:, None, :]
        if self.n_rot == self.head_dim:
            return rotate(x, cos, sin, self.neox)
        r = self.n_rot
        return torch.cat((rotate(x[..., :r], cos, sin, self.neox), x[..., r:]), dim=-1)


def _text_pairs(sections: tuple[int, int, int, int], n_pairs: int) -> torch.Tensor:
    """[n_pairs] 1.0 where a rotation pair belongs to one of the first three sections of the
    interleaved layout (a text token's position), 0.0 for the fourth (position 0)."""
    total = sum(sections)
    if total <= 0 or any(s < 0 for s in sections):
        raise ValueError(f"rope sections {sections}: need non-negative sizes, not all 0")
    out = torch.zeros(n_pairs, dtype=torch.float64)
    for i in range(n_pairs):
        sector = i % total
        text = any(sector % 3 == j and sector < 3 * sections[j] for j in range(3))
        out[i] = 1.0 if text else 0.0
    return out


def _yarn_mix(yarn: YarnSpec, theta: float, n_rot: int) -> torch.Tensor:
    """[n_rot/2] each rotation pair's angle per position under YaRN, over its original: the
    interpolated angle (1 / factor) mixed with the original by a ramp that is 1 below the
    correction dimension of ``beta_fast`` and 0 above that of ``beta_slow``."""
    if yarn.factor <= 0 or yarn.orig_ctx < 1:
        raise ValueError(f"YaRN factor {yarn.factor} / original context {yarn.orig_ctx}")

    def corr_dim(beta: float) -> float:
        return n_rot * math.log(yarn.orig_ctx / (beta * 2 * math.pi)) / (2 * math.log(theta))

    low = max(0.0, math.floor(corr_dim(yarn.beta_fast)))
    high = min(n_rot - 1.0, math.ceil(corr_dim(yarn.beta_slow)))
    pair = torch.arange(n_rot // 2, dtype=torch.float64)
    ramp = 1 - ((pair - low) / max(0.001, high - low)).clamp(0, 1)
    mix = ramp * yarn.ext_factor
    return (1 - mix) / yarn.factor + mix


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """x: [T, H, d] rotated by the angles whose cos and sin are [T, 1, d/2]."""
    if neox:
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)  # [T, H, d/2, 2]
    return out.flatten(-2)


def attention(
    x: torch.Tensor,
    w: AttentionWeights,
    spec: AttentionSpec,
    rope: Rope,
    kv: KVCache,
    layer: int,
    start: int,
) -> torch.Tensor:
    """The attention block's output for x [T, D] (already normed) at positions start..start+T-1;
    writes their K/V into ``kv``'s layer ``layer`` (the stage's own index)."""
    T = x.shape[0]
    H, Hkv, d = spec.n_head, spec.n_head_kv, spec.head_dim
    gate = None
    if spec.gated:  # per head: its query, then its gate
        qg = linear(x, w.q).view(T, H, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(T, H * d)
    else:
        q = _biased(linear(x, w.q), w.q_bias).view(T, H, d)
    k = _biased(linear(x, w.k), w.k_bias).view(T, Hkv, d)
    v = _biased(linear(x, w.v), w.v_bias).view(T, Hkv, d)
    if w.q_norm is not None and w.k_norm is not None:
        q = rms_norm(q, w.q_norm, spec.rms_eps)
        k = rms_norm(k, w.k_norm, spec.rms_eps)
    positions = torch.arange(start, start + T, device=x.device)
    q, k = rope(q, positions), rope(k, positions)
    kv.write(layer, start, k, v)
    S = start + T
    # a window's first query sees keys from start - window + 1 on: only those are read
    lo = 0 if spec.window is None else max(0, start - spec.window + 1)
    keys, values = kv.read(layer, S, begin=lo)  # [S - lo, Hkv, d]
    group = H // Hkv
    # q: [Hkv, group*T, d] so each K/V head serves its group of query heads without a copy of K/V
    qg = q.view(T, Hkv, group, d).permute(1, 2, 0, 3).reshape(Hkv, group * T, d)
    scores = qg @ keys.permute(1, 2, 0) / math.sqrt(d)  # [Hkv, group*T, S - lo]
    # causal mask: query at position start+t sees keys 0..start+t (and within its window)
    q_pos = positions.repeat(group)  # [group*T]
    k_pos = torch.arange(lo, S, device=x.device)
    mask = k_pos[None, :] > q_pos[:, None]  # [group*T, S - lo]
    if spec.window is not None:
        mask |= k_pos[None, :] <= q_pos[:, None] - spec.window
    scores = scores.masked_fill(mask, float("-inf"))
    if w.sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # each head's sink logit joins the softmax, then takes its share away
        sink = w.sinks.view(Hkv, group, 1, 1).expand(Hkv, group, T, 1).reshape(Hkv, group * T, 1)
        probs = torch.softmax(torch.cat((scores, sink.to(scores.dtype)), dim=-1), dim=-1)
        probs = probs[..., :-1]
    out = probs @ values.permute(1, 0, 2)  # [Hkv, group*T, d]
    out = out.view(Hkv, group, T, d).permute(2, 0, 1, 3).reshape(T, H * d)
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return _biased(linear(out, w.o), w.o_bias)


def _biased(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


def route(
    x: torch.Tensor, router: Weight, spec: RoutingSpec, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    # x: [T, D] -> weights: [T, K], ids: [T, K]
    logits = _biased(linear(x, router), bias)  # [T, E]
    if spec.softmax_after_topk:  # the top k logits, then a softmax over them alone
        top, ids = torch.topk(logits, spec.n_used, dim=-1)
        return torch.softmax(top, dim=-1), ids
    probs = torch.softmax(logits, dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, spec.n_used, dim=-1)
    if spec.norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def swiglu_oai(g: torch.Tensor, u: torch.Tensor, act: SwigluOAI) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU of gate ``g`` and up ``u`` (same shapes)."""
    g = g.clamp(max=act.limit)
    u = u.clamp(-act.limit, act.limit)
    return g * torch.sigmoid(act.alpha * g) * (u + 1)


def moe(
    x: torch.Tensor, w: MoEWeights, spec: RoutingSpec, provider: ExpertProvider, layer: int
) -> torch.Tensor:
    """The routed-expert block's output for x [T, D] (already normed): the only place the
    reference reads expert weights (through ``provider``, by the model's layer index)."""
    T, D = x.shape
    K = spec.n_used
    weights, ids = route(x, w.router, spec, w.router_bias)  # [T, K] each
    # The T*K (token, choice) assignments grouped by expert: one host sync per layer (the counts),
    # then each chosen expert is fetched (and dequantised) once, for all of its tokens.
    flat = ids.reshape(-1)  # [T*K], assignment a = t*K + k
    order = torch.argsort(flat, stable=True)  # [T*K] assignments in expert order
    counts = torch.bincount(flat, minlength=spec.n_expert).tolist()
    xs = x.index_select(0, order // K)  # [T*K, D] each assignment's token
    ys = torch.empty_like(xs)
    start = 0
    b = w.expert_bias
    for e, n in enumerate(counts):
        if n == 0:
            continue
        ew = provider.expert(layer, e)
        h = xs[start : start + n]  # [n, D]
        g, u = linear(h, ew.gate), linear(h, ew.up)  # [n, F] each
        if b is not None:
            g, u = g + b.gate[e], u + b.up[e]
        a = F.silu(g) * u if spec.activation is None else swiglu_oai(g, u, spec.activation)
        y = linear(a, ew.down)
        ys[start : start + n] = y if b is None else y + b.down[e]
        start += n
    y = torch.empty_like(ys).index_copy_(0, order, ys)  # [T*K, D] back in (t, k) order
    # the K outputs of each token summed in a fixed order: the same bits whatever is cached
    return (y.view(T, K, D) * weights[:, :, None]).sum(dim=1)


def shared_expert(x: torch.Tensor, w: SharedExpert) -> torch.Tensor:
    """The σ-gated shared expert's output for x [T, D] (already normed)."""
    y = linear(F.silu(linear(x, w.gate)) * linear(x, w.up), w.down)  # [T, D]
    return y * torch.sigmoid(x @ w.gate_inp)[:, None]


class RefOps:
    """The operations of one reference step: ``tokens`` [T] at positions ``start`` .. of one
    stage, whose K/V holds its layers from ``first`` on."""

    def __init__(
        self,
        tokens: torch.Tensor,
        start: int,
        kv: KVCache,
        first: int,
        provider: ExpertProvider,
        rope: Rope,
        last_only: bool = False,
        kv_slots: dict[int, int] | None = None,
        state: RecurrentState | None = None,
        state_slots: dict[int, int] | None = None,
    ) -> None:
        self.tokens, self.start, self.kv, self.first = tokens, start, kv, first
        self.provider, self.rope, self.last_only = provider, rope, last_only
        # model layer -> its K/V layer in the stage's cache (None: every layer, from ``first``)
        self.kv_slots = kv_slots
        self.state, self.state_slots = state, state_slots  # the DeltaNet layers' states

    def embed(self, embd: Weight) -> torch.Tensor:
        return embd.rows(self.tokens)  # [T, D]

    def attention(
        self, x: torch.Tensor, layer: int, w: AttentionWeights, spec: AttentionSpec
    ) -> torch.Tensor:
        h = rms_norm(x, w.norm, spec.rms_eps)
        slot = layer - self.first if self.kv_slots is None else self.kv_slots[layer]
        return x + attention(h, w, spec, self.rope, self.kv, slot, self.start)

    def moe(self, x: torch.Tensor, layer: int, w: MoEWeights, spec: RoutingSpec) -> torch.Tensor:
        h = rms_norm(x, w.norm, spec.rms_eps)
        out = moe(h, w, spec, self.provider, layer)
        if w.shared is not None:
            out = out + shared_expert(h, w.shared)
        return x + out

    def delta_net(
        self, x: torch.Tensor, layer: int, w: DeltaNetWeights, spec: DeltaNetSpec
    ) -> torch.Tensor:
        if self.state is None or self.state_slots is None:
            raise RuntimeError(f"layer {layer} is a DeltaNet layer and the step has no state")
        i = self.state_slots[layer]
        h = rms_norm(x, w.norm, spec.rms_eps)
        return x + delta_net(h, w, spec, self.state.conv[i], self.state.ssm[i])

    def head(self, x: torch.Tensor, w: HeadWeights) -> torch.Tensor:
        if self.last_only:
            x = x[-1:]
        return linear(rms_norm(x, w.norm, w.rms_eps), w.output)
