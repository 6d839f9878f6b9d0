"""The decode step's operations: one token per step through fused Triton kernels on the step
buffers, every launch reading positions and lengths from device memory, so one CUDA graph,
captured at load, serves every step. Per layer:

    q/k/v matvec (RMSNorm folded in) -> split attention (q/k norm, RoPE and the token's K/V
    write, then its combine, in the same launch) -> output projection + residual -> router
    matvec (RMSNorm folded in; its last program routes: top-k, weights, expert offsets)
    -> gate/up/SiLU of the k experts -> down of the k experts + weights + residual

then the final norm and the output head. The MoE kernels find each expert through the layer's
expert table (byte offsets from the anchor). A step runs in one of three modes: "plain", "ahead"
(copies ahead of the RAM experts) or "cpu" (the CPU computes its share of them); while some
expert has no readable home the step runs eagerly and stages each miss after the layer's
routing (``stage``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from strata.engine.gpu.ahead import CopiesAhead
from strata.engine.gpu.buffers import ExpertGeometry, StepBuffers
from strata.engine.gpu.counters import UseCounters
from strata.engine.gpu.cpu_share import CpuShare
from strata.engine.gpu.oss import expert_extras, qkv_bias, rope_tables
from strata.engine.gpu.tables import ExpertTables
from strata.engine.kernels import moe
from strata.engine.kernels.attention import DecodeAttention, Rotary
from strata.engine.kernels.matvec import Mat, matvec
from strata.engine.kernels.step import advance
from strata.engine.kv import KVCache
from strata.engine.ops import (
    AttentionSpec,
    AttentionWeights,
    DeltaNetSpec,
    DeltaNetWeights,
    HeadWeights,
    ModelShape,
    MoEWeights,
    RoutingSpec,
)
from strata.engine.ops.reference import rms_norm
from strata.engine.quant import repack_kernels
from strata.engine.weights import RepackedWeight, Weight, linear

_INTERP_BN = 128  # rows per program in Triton's interpreter: few, wide programs
MAX_SPLITS = 64  # most splits of the attention's key range


@dataclass(frozen=True)
class Tune:
    """How one decode launch is cut: rows per program, warps (None: one thread per unit of a
    step), a register cap a thread (None: the compiler's choice; a lower one lets more programs
    share a multiprocessor, at the price of spills) and, for ``down``, the experts side by side
    in a step (None: as many as 256 threads hold). Any values compute the same products; the
    order of their sums may change with them (never with residency: one Tune serves every
    mode)."""

    bn: int
    warps: int | None = None
    regs: int | None = None
    ept: int | None = None

    def __str__(self) -> str:
        """As ``STRATA_DECODE_TUNE`` writes it: bn:warps:regs:ept (an unset field empty)."""
        fields = [self.bn, self.warps, self.regs, self.ept]
        return ":".join("" if f is None else str(f) for f in fields).rstrip(":")

    def kw(self) -> dict[str, int | None]:
        """The kernels' keyword arguments (``ept`` only where it is set: ``moe.down``'s)."""
        out: dict[str, int | None] = dict(bn=self.bn, num_warps=self.warps, maxnreg=self.regs)
        return out if self.ept is None else {**out, "ept": self.ept}


# Each launch's cut, measured on an H200 with the profile tool's --sweep
# (``python -m strata.bench.profile``) on the Qwen3-30B-A3B shapes; the kernels take any values,
# the interpreter its own (``kernels.dot``). ``STRATA_DECODE_TUNE`` overrides them (``tunes``).
# down: 4 rows, not 8: the same speed from VRAM (295.9 against 295.7 tok/s with every expert
# cached), and its reads of experts in RAM over PCIe go at 47 GB/s, not 37 (more reads in
# flight; ``python -m strata.bench.moe_sweep``). router: swept without its routing, which
# runs in its last program and crosses its warps (34 barriers at 8 warps under Triton 3.6, 3 at
# one; ``decode_resources --types F32 --forms router``); the sweep now times it with.
TUNED: dict[str, Tune] = {
    "qkv": Tune(4, 8),
    "o": Tune(8),
    "router": Tune(2),
    "head": Tune(4, 8),
    "gate_up": Tune(4),
    "down": Tune(4),
}
TUNE_ENV = "STRATA_DECODE_TUNE"


def tunes(text: str | None, device: torch.device) -> dict[str, Tune]:
    """The decode launches' cuts: ``TUNED`` on a GPU (the interpreter: few, wide programs),
    with ``text`` (``STRATA_DECODE_TUNE``) overriding some, as ``op=bn:warps:regs:ept`` joined
    by commas, an empty or left-out field unset (``Tune``'s None, not the table's value:
    ``down=4:8:128:2,o=4:8``), the op's whole cut replaced: a developer's
    knob for measuring a cut end to end in ``strata bench`` without editing the table. A bad
    value is refused on any device, naming it."""
    out = dict(TUNED)
    for item in (text or "").split(","):
        if not item.strip():
            continue
        op, sep, spec = item.strip().partition("=")
        if not sep or op not in TUNED:
            raise ValueError(f"{TUNE_ENV}: {item.strip()!r} is not op=bn:warps:regs:ept with op "
                             f"one of {', '.join(TUNED)}")  # fmt: skip
        parts = spec.split(":")
        if len(parts) > 4 or not parts[0].strip().isdigit():
            raise ValueError(f"{TUNE_ENV}: {item.strip()!r}: want bn[:warps[:regs[:ept]]], "
                             "bn a number")  # fmt: skip
        try:
            bn, warps, regs, ept = (int(p) if p.strip() else None for p in [*parts, "", "", ""][:4])
        except ValueError:
            raise ValueError(f"{TUNE_ENV}: {item.strip()!r}: the fields are numbers") from None
        assert bn is not None
        if bn < 1 or bn & (bn - 1) or bn > 64:
            raise ValueError(f"{TUNE_ENV}: {op} rows per program {bn}: a power of two up to 64")
        if warps is not None and warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"{TUNE_ENV}: {op} warps {warps}: 1, 2, 4, 8 or 16")
        if regs is not None and not 16 <= regs <= 255:
            raise ValueError(f"{TUNE_ENV}: {op} register cap {regs}: 16 to 255")
        if ept is not None and op != "down":
            raise ValueError(f"{TUNE_ENV}: {op}: experts side by side are down's alone")
        out[op] = Tune(bn, warps, regs, ept)
    return out if device.type == "cuda" else {k: Tune(_INTERP_BN) for k in TUNED}


PLAIN, AHEAD, CPU = "plain", "ahead", "cpu"


def mat(w: Weight) -> Mat | None:
    return Mat(w.data, w.layout) if isinstance(w, RepackedWeight) else None


def attention_splits(n_head_kv: int, device: torch.device) -> int:
    """Splits of the key range: a power of two, at most MAX_SPLITS, and enough that the
    (K/V head, split) programs cover the GPU's multiprocessors twice."""
    cuda = device.type == "cuda"
    sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 4
    want = max(1, -(-2 * sms // n_head_kv))
    return min(MAX_SPLITS, 1 << (want - 1).bit_length())


@dataclass(frozen=True)
class _Mats:
    qkv: tuple[Mat, Mat, Mat] | None  # all three in the kernel layout: one fused launch
    o: Mat | None
    router: Mat | None
    qkv_bias: torch.Tensor | None = None  # gpt-oss: q|k|v's biases side by side


@dataclass
class DecodeParts:
    """What a decode step's operations read and write: the runner's own objects."""

    buf: StepBuffers
    geometry: ExpertGeometry
    tables: ExpertTables
    counters: UseCounters
    ahead: CopiesAhead
    cpu: CpuShare
    kv: KVCache


class DecodeOps:
    """The operations (``engine.ops.Ops``) of one decode step of a stage whose first layer is
    ``first``; ``ffn``: its layers' routed-expert weights (the copies ahead read the next
    layer's router a layer early)."""

    def __init__(self, parts: DecodeParts, shape: ModelShape, ffn: list[MoEWeights]) -> None:
        self.p, self.shape, self.ffn = parts, shape, ffn
        self.first, self.eps = parts.geometry.first, shape.rms_eps
        dev, a, kv = parts.buf.anchor.device, shape.attention, parts.kv
        self.cos, self.sin = rope_tables(a.head_dim, a.rope, kv.n_ctx, dev)
        self.attend = DecodeAttention(
            a.n_head, a.n_head_kv, a.head_dim, kv.page, attention_splits(a.n_head_kv, dev), dev
        )
        # the tuned cuts on a GPU; the kernels' own defaults in the interpreter
        self.tuned = tunes(os.environ.get(TUNE_ENV), dev)
        self.mats: dict[int, _Mats] = {}
        self.extras: dict[int, moe.ExpertExtras | None] = {}
        # the hybrids' DeltaNet layers, gated attention and shared expert (``gpu.delta``)
        self.hybrid = None
        if shape.recurrent or a.gated or any(f.shared is not None for f in ffn):
            from strata.engine.gpu.delta import HybridDecode

            layers = range(self.first, self.first + len(ffn))
            self.hybrid = HybridDecode(shape, kv, layers, dev)
        # how the step now being queued runs (``GpuRunner._forward`` sets them)
        self.mode = PLAIN
        self.stage: Callable[[int], None] | None = None  # stages a layer's misses
        self.on_layer: Callable[[int], None] | None = None

    def _dense(
        self, y: torch.Tensor, x: torch.Tensor, w: Weight, m: Mat | None,
        norm: torch.Tensor | None = None, residual: bool = False,
        h_out: torch.Tensor | None = None, tune: str = "o", bias: torch.Tensor | None = None,
        route: moe.Routing | None = None, gate: torch.Tensor | None = None,
        up: torch.Tensor | None = None,
        res_gate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:  # fmt: skip
        """y = W x, or y += W x (``residual``), with ``matvec``'s folds (``norm``, ``gate``,
        ``up``, ``h_out``, ``bias``, ``res_gate``, ``route``) in its one launch."""
        if m is not None:  # (a route runs in the same launch)
            matvec(y, x, [m], norm, self.eps, residual, h_out, bias=bias, route=route,
                   gate=gate, up=up, res_gate=res_gate, **self.tuned[tune].kw())  # fmt: skip
            return
        # a type without a kernel: dequantise and multiply (torch ops, captured all the same)
        h = rms_norm(x, norm, self.eps) if norm is not None else x
        if gate is not None:
            h = h * torch.sigmoid(gate)
        if up is not None:
            h = torch.nn.functional.silu(h) * up
        if h_out is not None:
            h_out.copy_(h)
        out = linear(h[None], w)[0]
        if bias is not None:
            out = out + bias
        if res_gate is not None:
            out = out * torch.sigmoid(res_gate[0] @ res_gate[1])
        if residual:
            y.add_(out)
        else:
            y.copy_(out)
        if route is not None:
            route.alone(y)

    def cuts_changed(self) -> str:
        """The decode path line's note of the cuts ``STRATA_DECODE_TUNE`` changed ("" if none,
        and in the interpreter, which keeps its own)."""
        changed = [f"{k}={t}" for k, t in self.tuned.items() if t != TUNED[k]]
        if not changed or self.p.buf.anchor.device.type != "cuda":
            return ""
        return f"; cuts from {TUNE_ENV}: {', '.join(changed)}"

    def _mats(self, j: int, w: AttentionWeights | None = None) -> _Mats:
        if j not in self.mats:
            assert w is not None
            q, k, v = (mat(m) for m in (w.q, w.k, w.v))
            qkv = (q, k, v) if q is not None and k is not None and v is not None else None
            self.mats[j] = _Mats(qkv, mat(w.o), mat(self.ffn[j].router), qkv_bias(w))
        return self.mats[j]

    # -- the operations ------------------------------------------------------------------------

    def embed(self, embd: Weight) -> torch.Tensor:
        b = self.p.buf
        if isinstance(embd, RepackedWeight):
            _embed(embd, b.tok, b.x)
        else:
            b.x.copy_(embd.rows(b.tok)[0])
        return b.x

    def attention(
        self, x: torch.Tensor, layer: int, w: AttentionWeights, spec: AttentionSpec
    ) -> torch.Tensor:
        b, kv, j = self.p.buf, self.p.kv, layer - self.first
        if self.on_layer is not None:
            self.on_layer(layer)
        m = self._mats(j, w)
        if self.mode == AHEAD and j == 0:  # the later layers' guesses come a layer early (moe)
            self._prefetch(0)
        own = spec.gated or 2 * self.cos.shape[1] != spec.head_dim or self.shape.recurrent
        if self.hybrid is not None and own:
            return self.hybrid.attention(self, x, layer, w, spec)
        if m.qkv is not None:
            matvec(b.qkv, x, m.qkv, w.norm, self.eps, bias=m.qkv_bias, **self.tuned["qkv"].kw())
        else:
            b.h.copy_(rms_norm(x, w.norm, self.eps))
            at = 0
            for wt, bias in ((w.q, w.q_bias), (w.k, w.k_bias), (w.v, w.v_bias)):
                n = wt.shape[0]
                self._dense(b.qkv[at : at + n], b.h, wt, mat(wt), bias=bias)
                at += n
        k_cache, v_cache = kv.layer(j)
        # a window layer's K/V is in its own pages (gpt-oss: KVCache.window_table)
        table = kv.window_table if spec.window is not None else kv.block_table
        # q/k norms, RoPE and the token's K/V write run inside the attention's launch
        rotary = Rotary(self.cos, self.sin, w.q_norm, w.k_norm, self.eps, spec.rope.neox)
        self.attend(b.attn_out, b.qkv, k_cache, v_cache, table, b.pos, kv.page_stride,
                    spec.window, w.sinks, rotary)  # fmt: skip
        self._dense(x, b.attn_out, w.o, m.o, residual=True, bias=w.o_bias)
        return x

    def delta_net(
        self, x: torch.Tensor, layer: int, w: DeltaNetWeights, spec: DeltaNetSpec
    ) -> torch.Tensor:
        j = layer - self.first
        if self.on_layer is not None:
            self.on_layer(layer)
        if j not in self.mats:  # a layer without attention: only its router's matrix
            self.mats[j] = _Mats(None, None, mat(self.ffn[j].router))
        if self.mode == AHEAD and j == 0:
            self._prefetch(0)
        assert self.hybrid is not None
        return self.hybrid.delta_net(self, x, layer, w, spec)

    def _prefetch(self, j: int) -> None:
        """Predict local layer ``j``'s experts from the residual stream as it is now (its
        router on it) and queue the copies of those in RAM (``CopiesAhead``)."""
        p, w = self.p, self.ffn[j]
        self._dense(p.ahead.logits, p.buf.x, w.router, self._mats(j).router, w.norm,
                    tune="router", bias=w.router_bias)  # fmt: skip
        p.ahead.copy(j, p.tables.layer(p.tables.homes, j))

    def moe(self, x: torch.Tensor, layer: int, w: MoEWeights, spec: RoutingSpec) -> torch.Tensor:
        p, j = self.p, layer - self.first
        b, ahead, cpu = p.buf, self.mode == AHEAD, self.mode == CPU
        table = p.tables.layer(p.tables.table, j)
        routing = moe.Routing(
            table, b.ids[j], b.wts[j], b.eoffs[j], p.counters.steps[j], spec.n_used,
            spec.norm_topk, p.ahead.prefetched(j) if ahead else None, spec.softmax_after_topk,
            b.route_ticket,
        )  # fmt: skip
        self._dense(b.router_logits, x, w.router, self._mats(j).router, w.norm, h_out=b.h,
                    tune="router", bias=w.router_bias, route=routing)  # fmt: skip
        if ahead and j + 1 < len(self.ffn):
            # the next layer's guess, from the stream before this layer's experts: its copies
            # run beside this layer's (the previous layer's expert kernels are done, so the
            # staging set the next layer shares with them is free)
            self._prefetch(j + 1)
        if self.stage is not None:
            self.stage(j)
        homes = p.tables.layer(p.tables.homes, j)
        if ahead:
            p.ahead.land(j, homes)
        if cpu:
            p.cpu.send(j, homes)
        lay = p.geometry.slot_layouts[j]
        if j not in self.extras:  # gpt-oss: the experts' biases, the clamped SwiGLU
            self.extras[j] = expert_extras(w, spec, b.ids[j])
        ex = self.extras[j]
        moe.gate_up(b.act, b.h, b.eoffs[j], b.anchor, lay.gate, lay.up, lay.up_offset,
                    extras=ex, **self.tuned["gate_up"].kw())  # fmt: skip
        moe.down(x, b.act, b.eoffs[j], b.wts[j], b.anchor, lay.down, lay.down_offset,
                 extras=ex, **self.tuned["down"].kw())  # fmt: skip
        if cpu:
            p.cpu.take(j)
        if w.shared is not None:
            assert self.hybrid is not None
            self.hybrid.shared(self, x, b.h, w.shared)
        return x

    def head(self, x: torch.Tensor, w: HeadWeights) -> torch.Tensor:
        b = self.p.buf
        self._dense(b.logits, x, w.output, mat(w.output), w.norm, tune="head")
        advance(b.logits, b.tok, b.pos, b.ring, b.step_no, b.argmax)
        return b.logits


def _embed(w: RepackedWeight, ids: torch.Tensor, out: torch.Tensor) -> None:
    """The embedding row ``ids[0]`` into ``out`` [D] (one launch on a GPU)."""
    if w.data.is_cuda:
        repack_kernels.dequantize(w.data, w.layout, ids=ids, out=out.view(1, -1))
    else:
        out.copy_(w.rows(ids)[0])
