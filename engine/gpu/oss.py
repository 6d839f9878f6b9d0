"""gpt-oss's pieces on the GPU path (``models/gpt_oss.py``): YaRN's RoPE tables, the biases
the decode step's products add, and the prompt chunk's attention over a sliding window with a
sink logit per head. The kernels take each piece as a flag that compiles away for the other
models (``kernels.attention``: the window and the sinks; ``kernels.matvec`` and
``kernels.gemm``: a bias in the epilogue; ``kernels.moe``: the router's softmax after the
top-k, the experts' biases by id, the clamped SwiGLU).

The chunk's attention (``attend``) writes the chunk's K/V to the pages, then runs
``kernels.chunk_attention`` (a flash-attention kernel: the keys read through the block table —
the window layers' own — the window's bounds as the loop's, the sink folded into the online
softmax's denominator, float16 products with float32 sums, or float32-accurate ones for a
float32 K/V). ``attend_reference`` is the torch form it is tested against (and what runs
where neither a GPU nor Triton's interpreter is): each row's float32 scores over its keys with
the head's sink logit appended as one more column, one softmax, the sink's column dropped —
the reference's formula term for term — in blocks of query rows so the temporaries stay
bounded (``ATTEND_BYTES``) however long the prefix is.
"""

from __future__ import annotations

import math

import torch

from strata.engine.gpu.cpu_share import CpuExtras
from strata.engine.gpu.delta import rope_tables_for
from strata.engine.kernels.chunk_attention import chunk_attention
from strata.engine.kernels.inputs import INTERPRETED
from strata.engine.kernels.moe import ExpertExtras
from strata.engine.kv import KVCache
from strata.engine.ops import AttentionWeights, MoEWeights, RopeSpec, RoutingSpec
from strata.engine.ops.reference import Rope

ATTEND_BYTES = 64 << 20  # the float32 scores of one block of query rows, at most (its softmax
# takes two more of that size for a moment)


def rope_tables(
    head_dim: int, spec: RopeSpec, n_ctx: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [n_ctx, n_rot/2] float32, as the reference's ``Rope`` makes them: with YaRN
    (gpt-oss) each pair's mixed angle, cos and sin times its magnitude; else
    ``gpu.delta.rope_tables_for``'s."""
    if spec.yarn is None:
        return rope_tables_for(head_dim, spec, n_ctx, device)
    rope = Rope(head_dim, spec)
    angles = torch.arange(n_ctx, dtype=torch.float64)[:, None] * rope.inv_freq[None, :]
    cos = (angles.cos() * rope.mscale).float().to(device)
    return cos, (angles.sin() * rope.mscale).float().to(device)


def qkv_bias(w: AttentionWeights) -> torch.Tensor | None:
    """q|k|v's biases side by side (the fused matvec's rows), or None where the file has
    none."""
    parts = (w.q_bias, w.k_bias, w.v_bias)
    if all(b is None for b in parts):
        return None
    if any(b is None for b in parts):
        raise ValueError("q, k and v biases come together or not at all")
    return torch.cat([b.float() for b in parts if b is not None]).contiguous()


def expert_extras(w: MoEWeights, spec: RoutingSpec, ids: torch.Tensor) -> ExpertExtras | None:
    """What the decode step's expert kernels add for this block (None: nothing, the plain
    SiLU experts). ``ids``: the layer's chosen ids, written by the top-k."""
    b, act = w.expert_bias, spec.activation
    if b is None and act is None:
        return None
    oai = (act.alpha, act.limit) if act is not None else None
    if b is None:
        return ExpertExtras(ids, oai=oai)
    return ExpertExtras(
        ids, b.gate.float().contiguous(), b.up.float().contiguous(),
        b.down.float().contiguous(), oai,
    )  # fmt: skip


def route(logits: torch.Tensor, k: int, spec: RoutingSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's routing from its float32 router logits [T, E] (the router's bias added):
    (weights, ids) [T, k] each, as ``ops.reference.route``."""
    if spec.softmax_after_topk:
        top, ids = torch.topk(logits, k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    probs = torch.softmax(logits, dim=-1)
    wts, ids = torch.topk(probs, k, dim=-1)
    if spec.norm_topk:
        wts = wts / wts.sum(dim=-1, keepdim=True)
    return wts, ids


def attend(kv: KVCache, j: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           pos: torch.Tensor, start: int, window: int | None,
           sinks: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """Local layer ``j``'s attention for a chunk: its k, v [T, Hkv, d] written at positions
    ``pos`` (start..start+T-1) through the layer's block table (the window layers' own), then
    each query row of q [T, H, d] over its keys — 0..its position, or the last ``window`` of
    them — with each head's sink logit ``sinks`` [H] joining the softmax. -> [T, H * d]
    float32. On a GPU (and in Triton's interpreter): ``kernels.chunk_attention``; elsewhere
    ``attend_reference``'s torch form."""
    if not (q.is_cuda or INTERPRETED):
        return attend_reference(kv, j, q, k, v, pos, start, window, sinks)
    table = _write(kv, j, k, v, pos, window)
    keys, values = kv.layer(j)
    return chunk_attention(q, keys, values, table, start, window, sinks)


def _write(kv: KVCache, j: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
           window: int | None) -> torch.Tensor:  # fmt: skip
    """The chunk's k, v written to layer ``j``'s pages; -> the layer's block table."""
    if window is not None and not kv.windowed[j]:
        raise ValueError(f"K/V layer {j} keeps every position, its attention has a window")
    table = kv.window_table if kv.windowed[j] else kv.block_table
    slot = kv.slot[j]
    pages = table.index_select(0, pos // kv.page).long()
    rows = pos % kv.page
    kv.pool[pages, slot, 0, rows] = k.to(kv.dtype)
    kv.pool[pages, slot, 1, rows] = v.to(kv.dtype)
    return table


def attend_reference(kv: KVCache, j: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     pos: torch.Tensor, start: int, window: int | None,
                     sinks: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """``attend`` in torch, float32: the keys gathered through the table, each row's scores
    with the head's sink logit as one more column, one softmax, the sink's column dropped (the
    reference's formula term for term), in blocks of query rows (``ATTEND_BYTES``)."""
    T, H, d = q.shape
    Hkv = k.shape[1]
    group = H // Hkv
    table = _write(kv, j, k, v, pos, window)
    slot = kv.slot[j]
    S = start + T
    lo = max(0, start - window + 1) if window is not None else 0
    at = torch.arange(lo, S, device=q.device)
    kp = table.index_select(0, at // kv.page).long()
    keys = kv.pool[kp, slot, 0, at % kv.page].float()  # [S - lo, Hkv, d]
    values = kv.pool[kp, slot, 1, at % kv.page].float()
    kt = keys.permute(1, 2, 0)  # [Hkv, d, S - lo]
    vt = values.permute(1, 0, 2)  # [Hkv, S - lo, d]
    out = torch.empty(T, H * d, dtype=torch.float32, device=q.device)
    qf = q.float()
    step = max(1, ATTEND_BYTES // (4 * H * (S - lo + 1)))
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        n = t1 - t0
        # qg: [Hkv, group * n, d], head-major within each K/V head's group
        qg = qf[t0:t1].view(n, Hkv, group, d).permute(1, 2, 0, 3).reshape(Hkv, group * n, d)
        scores = qg @ kt / math.sqrt(d)  # [Hkv, group * n, S - lo]
        q_pos = (torch.arange(start + t0, start + t1, device=q.device)).repeat(group)
        mask = at[None, :] > q_pos[:, None]
        if window is not None:
            mask |= at[None, :] <= q_pos[:, None] - window
        scores = scores.masked_fill(mask, float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            sink = sinks.float().view(Hkv, group, 1, 1).expand(Hkv, group, n, 1)
            probs = torch.softmax(torch.cat((scores, sink.reshape(Hkv, group * n, 1)), -1), -1)
            probs = probs[..., :-1]
        o = probs @ vt  # [Hkv, group * n, d]
        out[t0:t1] = o.view(Hkv, group, n, d).permute(2, 0, 1, 3).reshape(n, H * d)
    return out


def cpu_extras(ffn: list[MoEWeights], spec: RoutingSpec) -> CpuExtras | None:
    """What the CPU's share of the experts adds for a stage's layers ``ffn`` (None: the plain
    SiLU experts): the biases, copied to the CPU, and the clamped SwiGLU."""
    act = spec.activation
    biases = [
        None if w.expert_bias is None
        else (w.expert_bias.gate.cpu(), w.expert_bias.up.cpu(), w.expert_bias.down.cpu())
        for w in ffn
    ]  # fmt: skip
    if act is None and all(b is None for b in biases):
        return None
    return CpuExtras(biases, (act.alpha, act.limit) if act is not None else None)
