"""The hybrids' operations on the GPU (Qwen3.5/3.6 ``qwen35moe``, Qwen3-Next ``qwen3next``): the
Gated DeltaNet layer, gated attention with partial or sectioned RoPE, and the σ-gated shared
expert, for the decode step (``HybridDecode``, inside its CUDA graph) and for prompt chunks
(``HybridChunk``, inside the chunk's segment graphs). ``DecodeOps`` and ``ChunkOps`` hand these
layers here.

The recurrent state is the stage's ``KVCache.state`` (``recurrent.RecurrentState``): its tensors
never move (checkpoints copy in and out of them), so the captured graphs update them in place.
A DeltaNet layer's state is its index among the stage's DeltaNet layers, an attention layer's
K/V its index among the attention layers (``layer_slots``).

Decode, a DeltaNet layer in four launches: the input projections as one matvec (RMSNorm folded
in; two where the file keeps β and α apart), ``kernels.delta_net.conv_step``,
``recurrent_step`` (norms, gates, the update, the gated RMSNorm) and the output matvec with the
residual. The projection's rows are in the file's order; index maps (``InputMaps``) say where
each of q|k|v, z, β and α is, for both layouts.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from strata.engine.kernels.delta_net import chunk_delta_rule, conv_step, recurrent_step
from strata.engine.kernels.matvec import Mat, matvec
from strata.engine.kernels.rope import rope_store_gated, rope_tables
from strata.engine.kv import KVCache
from strata.engine.ops import (
    AttentionSpec,
    AttentionWeights,
    DeltaNetSpec,
    DeltaNetWeights,
    ModelShape,
    RopeSpec,
    SharedExpert,
)
from strata.engine.ops.delta_net import l2_norm
from strata.engine.ops.reference import Rope, rms_norm, rotate
from strata.engine.recurrent import RecurrentState, begin_state
from strata.engine.weights import RepackedWeight, Weight

if TYPE_CHECKING:
    from strata.engine.gpu.runner import GpuRunner

log = logging.getLogger(__name__)


def rope_tables_for(
    head_dim: int, spec: RopeSpec, n_ctx: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [n_ctx, n_rot/2] float32 for ``spec``: its first ``n_rot`` values of a head
    (all by default), the pairs of the interleaved multi-section layout's fourth section at
    angle 0 (text positions), made as the reference's ``Rope`` makes them."""
    rope = Rope(head_dim, spec)
    if rope.n_rot == head_dim and spec.sections is None:
        return rope_tables(head_dim, spec.theta, n_ctx, device)
    angles = torch.arange(n_ctx, dtype=torch.float64)[:, None] * rope.inv_freq[None, :]
    return angles.cos().float().to(device), angles.sin().float().to(device)


def rotate_partial(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool
) -> torch.Tensor:
    """x: [T, H, d] with its first 2 * cos.shape[-1] values rotated (``reference.rotate``),
    the rest as they are; cos, sin: [T, 1, n_rot/2]."""
    r = 2 * cos.shape[-1]
    if r == x.shape[-1]:
        return rotate(x, cos, sin, neox)
    return torch.cat((rotate(x[..., :r], cos, sin, neox), x[..., r:]), dim=-1)


def layer_slots(shape: ModelShape, layers: range) -> tuple[dict[int, int], dict[int, int]]:
    """For the stage of ``layers``: model layer -> its K/V layer, and -> its state layer."""
    rec = shape.recurrent
    kv = [i for i in layers if not (rec and rec[i])]
    st = [i for i in layers if rec and rec[i]]
    return {i: n for n, i in enumerate(kv)}, {i: n for n, i in enumerate(st)}


@contextlib.contextmanager
def keep_state(state: RecurrentState | None) -> Iterator[None]:
    """Steps run inside (warm-ups, captures, timings) leave ``state`` as it was."""
    if state is None:
        yield
        return
    conv, ssm, dirty = state.conv.clone(), state.ssm.clone(), state.dirty
    try:
        yield
    finally:
        state.conv.copy_(conv)
        state.ssm.copy_(ssm)
        state.dirty = dirty


def begin_hybrid_step(runner: GpuRunner, start: int, check: bool) -> None:
    """Before ``runner``'s step from ``start``, where its stage has a recurrent state: a state
    that holds more than its committed tokens (a look-ahead stopped with a step run ahead, or a
    step that failed) goes back to its latest checkpoint and reads the committed tokens since
    then again, one decode step each, as ``Sequences.rewind`` would (where the stage is the
    whole model; a stage alone cannot read tokens, and the step is refused). With ``check``,
    the step then begins (``recurrent.begin_state``)."""
    state = runner.kv.state
    if state is None:
        return
    whole = runner.layers.start == 0 and runner.is_last
    if state.dirty and len(state.tokens) == start and whole:
        tokens = list(state.tokens)
        n = state.restore(tokens)
        log.debug("recurrent state: back to position %d, %d tokens read again", n, start - n)
        for pos in range(n, start):
            state.begin_step()
            runner.run_step(tokens[pos], pos)
            state.advance([tokens[pos]])
    if check:
        begin_state(state, start)


@dataclass(frozen=True)
class InputMaps:
    """Where a DeltaNet layer's pieces are in its projection's output ``in_`` [P]: q|k|v (the
    conv's channels, int32 [C]), z [Hv S], β and α [Hv]."""

    width: int  # P
    conv: torch.Tensor
    z: torch.Tensor
    beta: torch.Tensor
    alpha: torch.Tensor

    @classmethod
    def of(cls, spec: DeltaNetSpec, qkvz: bool, ba: bool, device: torch.device) -> InputMaps:
        """``qkvz``: q, k, v and z in one matrix, per k head: q, k, its r v heads, its r z heads
        (else qkv [C] then z [Hv S]); ``ba``: β and α in one, per k head its r β then its r α
        (else β [Hv] then α [Hv])."""
        Hk, Hv, S = spec.n_k_heads, spec.n_v_heads, spec.head_dim
        r, C, V = Hv // Hk, spec.conv_dim, spec.value_dim
        hv = torch.arange(Hv)
        gv, iv = hv // r, hv % r  # v head hv is its k head's iv-th
        if qkvz:
            W = 2 * S + 2 * r * S
            d = torch.arange(S)
            q = (torch.arange(Hk)[:, None] * W + d).reshape(-1)
            v = (gv[:, None] * W + 2 * S + iv[:, None] * S + d).reshape(-1)
            conv, z, at = torch.cat((q, q + S, v)), v + r * S, Hk * W
        else:
            conv, z, at = torch.arange(C), C + torch.arange(V), C + V
        if ba:
            beta = at + gv * 2 * r + iv
            alpha = beta + r
        else:
            beta = at + hv
            alpha = beta + Hv
        i32 = dict(dtype=torch.int32, device=device)
        return cls(at + 2 * Hv, *(t.to(**i32) for t in (conv, z, beta, alpha)))

    @staticmethod
    def kind(w: DeltaNetWeights) -> tuple[bool, bool]:
        return w.qkvz is not None, w.ba is not None


def _parts(w: DeltaNetWeights) -> list[Weight]:
    """The layer's input projections in the order of ``in_``."""
    if w.qkvz is not None:
        parts = [w.qkvz]
    else:
        assert w.qkv is not None and w.z is not None
        parts = [w.qkv, w.z]
    if w.ba is not None:
        return [*parts, w.ba]
    assert w.beta is not None and w.alpha is not None
    return [*parts, w.beta, w.alpha]


def _all_maps(dn: DeltaNetSpec | None, device: torch.device) -> dict[tuple[bool, bool], InputMaps]:
    if dn is None:
        return {}
    kinds = [(a, b) for a in (False, True) for b in (False, True)]
    return {k: InputMaps.of(dn, *k, device) for k in kinds}


def _one(w: Weight) -> Mat | None:
    """``w`` as the matvec kernel takes it (None: a type without the kernel layout)."""
    return Mat(w.data, w.layout) if isinstance(w, RepackedWeight) else None


def _mats(ws: list[Weight]) -> list[Mat] | None:
    ms = [_one(w) for w in ws]
    return None if any(m is None for m in ms) else ms  # type: ignore[return-value]


class HybridDecode:
    """The hybrids' pieces of one decode step of the stage of ``layers``: fixed buffers, the
    index maps, the slots. ``ops``: the step's ``DecodeOps`` (its buffers, tables and
    ``_dense``)."""

    def __init__(self, shape: ModelShape, kv: KVCache, layers: range, device: torch.device) -> None:
        self.kv, self.eps = kv, shape.rms_eps
        self.kv_slots, self.state_slots = layer_slots(shape, layers)
        f32 = dict(dtype=torch.float32, device=device)
        a = shape.attention
        self.qgkv = torch.zeros(a.q_dim * (2 if a.gated else 1) + 2 * a.kv_dim, **f32)
        self.q = torch.zeros(a.q_dim, **f32)
        self.gate = torch.zeros(a.q_dim, **f32)
        dn = shape.delta_net
        self.maps = _all_maps(dn, device)
        if dn is not None:
            self.in_ = torch.zeros(max(m.width for m in self.maps.values()), **f32)
            self.mixed = torch.zeros(dn.conv_dim, **f32)
            self.o = torch.zeros(dn.value_dim, **f32)
        self.sh: dict[int, torch.Tensor] = {}  # the shared expert's buffers by its width

    def _project(self, ops, x: torch.Tensor, norm: torch.Tensor, ws: list[Weight],
                 out: torch.Tensor, tune: str) -> None:  # fmt: skip
        """out = [W_1; W_2; ...] RMSNorm(x): one launch per three matrices in the kernel
        layout, else dequantised products."""
        ms = _mats(ws)
        if ms is None:
            at = 0
            for w in ws:
                n = w.shape[0]
                ops._dense(out[at : at + n], x, w, None, norm)
                at += n
            return
        at = 0
        for i in range(0, len(ms), 3):
            group = ms[i : i + 3]
            n = sum(m.rows for m in group)
            matvec(out[at : at + n], x, group, norm, self.eps, **ops.tuned[tune].kw())
            at += n

    def delta_net(self, ops, x: torch.Tensor, layer: int, w: DeltaNetWeights,
                  spec: DeltaNetSpec) -> torch.Tensor:  # fmt: skip
        state = self.kv.state
        if state is None:
            raise RuntimeError(f"layer {layer} is a DeltaNet layer and the stage has no state")
        i = self.state_slots[layer]
        maps = self.maps[InputMaps.kind(w)]
        in_ = self.in_[: maps.width]
        self._project(ops, x, w.norm, _parts(w), in_, "qkv")
        conv_step(in_, maps.conv, w.conv, state.conv[i], self.mixed)
        recurrent_step(
            self.mixed, in_, maps.z, maps.beta, maps.alpha, w.dt_bias, w.a, state.ssm[i],
            w.out_norm, self.o, spec.n_k_heads, spec.rms_eps, spec.tiled_heads,
        )  # fmt: skip
        ops._dense(x, self.o, w.out, _one(w.out), residual=True)
        return x

    def attention(self, ops, x: torch.Tensor, layer: int, w: AttentionWeights,
                  spec: AttentionSpec) -> torch.Tensor:  # fmt: skip
        """Attention with each query head's gate (out · σ(gate)) and partial or sectioned
        RoPE (the decode step's tables)."""
        b, kv = ops.p.buf, self.kv
        self._project(ops, x, w.norm, [w.q, w.k, w.v], self.qgkv, "qkv")
        k_cache, v_cache = kv.layer(self.kv_slots[layer])
        rope_store_gated(
            self.qgkv, ops.cos, ops.sin, w.q_norm, w.k_norm, self.q,
            self.gate if spec.gated else None, k_cache, v_cache, kv.block_table, b.pos,
            spec.rms_eps, spec.n_head, spec.n_head_kv, spec.head_dim, kv.page, spec.rope.neox,
            kv.page_stride,
        )  # fmt: skip
        ops.attend(b.attn_out, self.q, k_cache, v_cache, kv.block_table, b.pos, kv.page_stride)
        # the output gate, attn_out · σ(gate), on the projection's way in
        gate = self.gate if spec.gated else None
        ops._dense(x, b.attn_out, w.o, _one(w.o), residual=True, gate=gate)
        return x

    def shared(self, ops, x: torch.Tensor, h: torch.Tensor, w: SharedExpert) -> None:
        """x += σ(h · gate_inp) · down(SiLU(gate h) · up h); h: the block's normed input. Two
        launches: gate and up, then down with the SwiGLU on its way in and the gated residual
        add on its way out."""
        F_ = w.gate.shape[0]
        if F_ not in self.sh:
            self.sh[F_] = torch.zeros(2 * F_, dtype=torch.float32, device=x.device)
        act = self.sh[F_]
        ms = _mats([w.gate, w.up])
        if ms is not None:
            matvec(act, h, ms, **ops.tuned["gate_up"].kw())
        else:
            ops._dense(act[:F_], h, w.gate, None)
            ops._dense(act[F_:], h, w.up, None)
        ops._dense(x, act[:F_], w.down, _one(w.down), residual=True, up=act[F_:],
                   res_gate=(h, w.gate_inp))  # fmt: skip


class HybridChunk:
    """The hybrids' pieces of a prompt chunk (``ChunkOps``): the DeltaNet layer over the chunk's
    first ``b.n`` rows (the rest, a captured graph's padding, change no state), gated
    attention's projections and RoPE, the shared expert."""

    def __init__(self, shape: ModelShape, kv: KVCache, layers: range, device: torch.device) -> None:
        self.kv, self.shape = kv, shape
        self.kv_slots, self.state_slots = layer_slots(shape, layers)
        self.maps = _all_maps(shape.delta_net, device)

    def delta_net(self, path, x: torch.Tensor, layer: int, w: DeltaNetWeights,
                  spec: DeltaNetSpec, n: torch.Tensor) -> None:  # fmt: skip
        """x [T, D] += the layer's output over its first ``n`` rows (int64 [1], the device's)."""
        state = self.kv.state
        if state is None:
            raise RuntimeError(f"layer {layer} is a DeltaNet layer and the stage has no state")
        i = self.state_slots[layer]
        T, dev = x.shape[0], x.device
        Hk, Hv, S = spec.n_k_heads, spec.n_v_heads, spec.head_dim
        maps = self.maps[InputMaps.kind(w)]
        h = rms_norm(x, w.norm, spec.rms_eps).half()
        in_ = torch.empty(T, maps.width, dtype=torch.float32, device=dev)
        at = 0
        for m in _parts(w):
            path.mm(in_[:, at : at + m.shape[0]], h, m)
            at += m.shape[0]
        qkv = in_.index_select(1, maps.conv)  # [T, C]
        conv = state.conv[i]  # [K-1, C]
        K = w.conv.shape[1]
        xc = torch.cat((conv, qkv), dim=0)  # [K-1+T, C]
        mixed = F.silu((xc.unfold(0, K, 1) * w.conv).sum(dim=-1))  # [T, C]
        if K > 1:  # the last K-1 real inputs
            conv.copy_(xc.index_select(0, n + torch.arange(K - 1, device=dev)))
        q, k, v = mixed.split((spec.key_dim, spec.key_dim, spec.value_dim), dim=-1)
        q = (l2_norm(q.reshape(T, Hk, S), spec.rms_eps) * S**-0.5).contiguous()
        k = l2_norm(k.reshape(T, Hk, S), spec.rms_eps).contiguous()
        g = (F.softplus(in_.index_select(1, maps.alpha) + w.dt_bias) * w.a).contiguous()
        beta = torch.sigmoid(in_.index_select(1, maps.beta)).contiguous()
        o = torch.zeros(T, Hv, S, dtype=torch.float32, device=dev)
        chunk_delta_rule(q, k, v.reshape(T, Hv, S).contiguous(), g, beta, state.ssm[i], o, n,
                         spec.tiled_heads)  # fmt: skip
        z = in_.index_select(1, maps.z).view(T, Hv, S)
        o = o * torch.rsqrt(o.pow(2).mean(dim=-1, keepdim=True) + spec.rms_eps)
        o = o * w.out_norm * F.silu(z)
        path.mm(x, o.reshape(T, Hv * S).half(), w.out, add=True)

    def pre(self, path, x: torch.Tensor, w: AttentionWeights, a: AttentionSpec, b) -> None:
        """``ChunkPath.pre`` for gated attention and partial RoPE: q (normed, rotated) to b.q,
        its gate to b.gate [T, H d], k (rotated) and v to b.k, b.v."""
        T, H, Hkv, d = x.shape[0], a.n_head, a.n_head_kv, a.head_dim
        h = rms_norm(x, w.norm, a.rms_eps).half()
        qw = a.q_dim * (2 if a.gated else 1)
        qkv = torch.empty(T, qw + 2 * a.kv_dim, dtype=torch.float32, device=x.device)
        at = 0
        for m in (w.q, w.k, w.v):
            path.mm(qkv[:, at : at + m.shape[0]], h, m)
            at += m.shape[0]
        if a.gated:
            qg = qkv[:, :qw].view(T, H, 2 * d)
            q = qg[..., :d]
            b.gate.copy_(qg[..., d:].reshape(T, H * d))
        else:
            q = qkv[:, :qw].view(T, H, d)
        k = qkv[:, qw : qw + a.kv_dim].view(T, Hkv, d)
        v = qkv[:, qw + a.kv_dim :].view(T, Hkv, d)
        if w.q_norm is not None and w.k_norm is not None:
            q = rms_norm(q, w.q_norm, a.rms_eps)
            k = rms_norm(k, w.k_norm, a.rms_eps)
        cos = path.p.cos.index_select(0, b.pos)[:, None, :]  # [T, 1, n_rot/2]
        sin = path.p.sin.index_select(0, b.pos)[:, None, :]
        b.q.copy_(rotate_partial(q, cos, sin, a.rope.neox))
        b.k.copy_(rotate_partial(k, cos, sin, a.rope.neox))
        b.v.copy_(v)

    def gated(self, b) -> torch.Tensor:
        """The attention's output times σ(gate), for the output product (float16)."""
        return (b.attn.float() * torch.sigmoid(b.gate)).half()

    def shared(self, path, x: torch.Tensor, norm: torch.Tensor, eps: float,
               w: SharedExpert) -> torch.Tensor:  # fmt: skip
        """The shared expert's output [T, D] for the block's input x (before its residual)."""
        h32 = rms_norm(x, norm, eps)
        h = h32.half()
        F_ = w.gate.shape[0]
        gu = torch.empty(x.shape[0], 2 * F_, dtype=torch.float32, device=x.device)
        path.mm(gu[:, :F_], h, w.gate)
        path.mm(gu[:, F_:], h, w.up)
        mid = (F.silu(gu[:, :F_]) * gu[:, F_:]).half()
        y = torch.empty_like(x)
        path.mm(y, mid, w.down)
        return y * torch.sigmoid(h32 @ w.gate_inp)[:, None]
