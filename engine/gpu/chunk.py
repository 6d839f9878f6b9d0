"""The prompt chunk's operations: a chunk of T tokens through matrix products on tensor cores,
with the runner's expert tables, staging slots, RoPE tables and use counters and its paged K/V.
Per layer:

    RMSNorm -> q, k, v products (``kernels.gemm``) -> q/k norm, RoPE -> K/V written to the pages
    -> causal attention over the cached positions (PyTorch's SDPA: flash attention where it
    applies) -> output product + residual -> RMSNorm -> router (float32) -> top-k
    -> assignments grouped by expert on the device -> gate/up and down of every chosen expert as
    two grouped products reading the experts through the layer's table -> weighted sum of each
    token's k outputs + residual

and the final norm and the output head on the rows asked for. Nothing waits for the host while
every expert has a readable home, and then a chunk replays CUDA graphs captured at load:
everything between one layer's attention and the next is position-independent, so it is one
graph (L + 1 per chunk), and the attention runs eagerly between them (``Segments``), its key
range growing with the position. Graphs exist for ``prefill_chunk_tokens`` and the powers of two
below it down to ``MIN_GRAPH_TOKENS``; a shorter chunk replays the next size up, its padding
tokens routed to no expert and their rows never read (each row's products are its own: the same
bits as eagerly). Otherwise (an expert without a home) each layer's counts come to the host
once, and the chosen experts without a home are staged and computed in rounds of the staging
slots, with the same kernels, so the numbers are the same whatever is cached.

Matrices are multiplied in float16 with float32 sums (the activations are rounded to float16 on
the way in, the weights' reference values on the way out of the registers), so a prefill's
logits differ from the reference path's by more than a decode step's; the tests state the
bound. Routing scores are float32 products, as in the reference, so near-ties choose the same
experts.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from strata.engine.experts.provider import FileExpertProvider
from strata.engine.gguf_index import GGUFIndex
from strata.engine.gpu import oss
from strata.engine.gpu.buffers import ExpertGeometry, StepBuffers, aligned
from strata.engine.gpu.counters import UseCounters
from strata.engine.gpu.staging import MissStaging
from strata.engine.gpu.tables import ExpertTables
from strata.engine.kernels import MISSING, gemm
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
from strata.engine.ops.reference import rms_norm, rotate
from strata.engine.weights import RepackedWeight, Weight, linear

log = logging.getLogger(__name__)

MIN_GRAPH_TOKENS = 64  # the smallest captured chunk: shorter ones replay it, padded
WARM_UP_CHUNKS = (16, 5, 1)  # row counts Triton specialises differently: see ChunkPath.warm_up
# From this many tokens a chunk copies the experts it uses from their RAM homes into VRAM (at
# the copy engines' ~50 GB/s) instead of reading them over PCIe tile by tile (zero-copy reads
# from tensor-core tiles reach a fraction of that); shorter chunks replay their graphs.
STAGE_MIN_TOKENS = 32
STAGE_SLOTS = 64  # VRAM slots the copies go into (a layer's RAM homes in rounds of these)


def _powers_of_two(lo: int, hi: int) -> list[int]:
    out, n = [], lo
    while n <= hi:
        out.append(n)
        n *= 2
    return out


@dataclass
class ChunkParts:
    """What a chunk's operations read and write: the runner's own objects."""

    buf: StepBuffers  # (its anchor)
    geometry: ExpertGeometry
    tables: ExpertTables
    counters: UseCounters
    staging: MissStaging
    kv: KVCache
    index: GGUFIndex
    shape: ModelShape
    is_last: bool
    cos: torch.Tensor  # the RoPE tables [n_ctx, d/2] (the decode step's)
    sin: torch.Tensor


class ChunkBuffers:
    """A chunk's inputs and the tensors that cross from one segment to the next."""

    def __init__(self, parts: ChunkParts, T: int, out_rows: int) -> None:
        s, kv = parts.shape, parts.kv
        a, dev = s.attention, parts.buf.anchor.device
        self.tok = torch.zeros(T, dtype=torch.long, device=dev)
        self.pos = torch.zeros(T, dtype=torch.long, device=dev)
        self.x = torch.zeros(T, s.n_embd, dtype=torch.float32, device=dev)  # the residual
        self.q = torch.zeros(T, a.n_head, a.head_dim, dtype=kv.dtype, device=dev)
        self.k = torch.zeros(T, a.n_head_kv, a.head_dim, dtype=kv.dtype, device=dev)
        self.v = torch.zeros(T, a.n_head_kv, a.head_dim, dtype=kv.dtype, device=dev)
        self.attn = torch.zeros(T, a.q_dim, dtype=torch.float16, device=dev)
        # gated attention's gates, from before attention to the output product
        self.gate = torch.zeros(T, a.q_dim, dtype=torch.float32, device=dev) if a.gated else None
        self.n = torch.full((1,), T, dtype=torch.long, device=dev)  # the real rows (no padding)
        self.rows = T  # the same, for the eager attention between the segments
        rows = out_rows if parts.is_last else 0  # (a stage before the last has no head)
        self.logits = torch.zeros(rows, s.vocab_size, dtype=torch.float32, device=dev)


class Mode(enum.Enum):
    EAGER = "eager"
    CAPTURE = "capture"
    REPLAY = "replay"


class Segments:
    """The stretches of a chunk between its attentions: run as they come (EAGER), captured one
    graph each into one pool (CAPTURE), or replayed from those graphs (REPLAY: the operations
    then do their work only inside ``cut``, the eager attention between two segments)."""

    def __init__(self, mode: Mode, graphs: list[torch.cuda.CUDAGraph] | None = None,
                 pool: tuple[int, int] | None = None) -> None:  # fmt: skip
        self.mode = mode
        self.graphs = graphs if graphs is not None else []
        self.pool = pool
        self._next = 0
        self._ctx: torch.cuda.graph | None = None

    @property
    def live(self) -> bool:
        """Whether the operations run their segment work now (not while replaying)."""
        return self.mode != Mode.REPLAY

    def begin(self) -> None:
        if self.mode == Mode.CAPTURE:
            g = torch.cuda.CUDAGraph()
            self.graphs.append(g)
            self._ctx = torch.cuda.graph(g, pool=self.pool)
            self._ctx.__enter__()

    def end(self) -> None:
        if self.mode == Mode.CAPTURE and self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(None, None, None)
        elif self.mode == Mode.REPLAY:
            self.graphs[self._next].replay()
            self._next += 1

    def cut(self, eager: Callable[[], None]) -> None:
        """End the segment so far, run ``eager`` outside any graph, begin the next."""
        self.end()
        eager()
        self.begin()

    def abort(self) -> None:
        """A capture that failed part way: leave the capture (its graph is dropped)."""
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            try:
                ctx.__exit__(None, None, None)
            except Exception:  # the capture was invalid already; its error is the one raised
                log.debug("ending a failed capture", exc_info=True)


class ChunkOps:
    """The operations (``engine.ops.Ops``) of one chunk in the buffers ``b`` at ``start``."""

    def __init__(self, path: ChunkPath, b: ChunkBuffers, start: int, last_only: bool,
                 seg: Segments) -> None:  # fmt: skip
        self.path, self.b, self.start, self.last_only, self.seg = path, b, start, last_only, seg
        self.first = path.p.geometry.first

    def embed(self, embd: Weight) -> torch.Tensor:
        if self.seg.live:
            self.b.x.copy_(embd.rows(self.b.tok))
        return self.b.x

    def attention(
        self, x: torch.Tensor, layer: int, w: AttentionWeights, spec: AttentionSpec
    ) -> torch.Tensor:
        j, path, hy = layer - self.first, self.path, self.path.hybrid
        own = hy is not None and (spec.gated or 2 * path.p.cos.shape[1] != spec.head_dim)
        if hy is not None:
            j = hy.kv_slots[layer]
        if self.seg.live:
            if own:
                hy.pre(path, x, w, spec, self.b)
            else:
                path.pre(x, w, spec, self.b)
        self.seg.cut(lambda: path.attend(j, self.b, self.start, spec, w.sinks))
        if self.seg.live:
            attn = hy.gated(self.b) if hy is not None and spec.gated else self.b.attn
            path.mm(x, attn, w.o, add=True, bias=w.o_bias)
        return x

    def delta_net(
        self, x: torch.Tensor, layer: int, w: DeltaNetWeights, spec: DeltaNetSpec
    ) -> torch.Tensor:
        assert self.path.hybrid is not None
        if self.seg.live:
            self.path.hybrid.delta_net(self.path, x, layer, w, spec, self.b.n)
        return x

    def moe(self, x: torch.Tensor, layer: int, w: MoEWeights, spec: RoutingSpec) -> torch.Tensor:
        if self.seg.live:
            hy = self.path.hybrid
            shared = None
            if w.shared is not None:  # from the block's input, before the experts add to it
                assert hy is not None
                shared = hy.shared(self.path, x, w.norm, spec.rms_eps, w.shared)
            self.path.moe(layer - self.first, x, w, spec, self.b.n)
            if shared is not None:
                x.add_(shared)
        return x

    def head(self, x: torch.Tensor, w: HeadWeights) -> torch.Tensor:
        b = self.b
        if self.seg.live:
            rows = b.x.index_select(0, b.n - 1) if self.last_only else b.x  # the last real row
            h = rms_norm(rows, w.norm, w.rms_eps).half()
            self.path.mm(b.logits[: rows.shape[0]], h, w.output)
        return b.logits


class ChunkPath:
    """A stage's prompt chunks: the products, the graphs by chunk size and their pool, the
    VRAM slots RAM experts are copied into. ``file``: the file behind the runner's provider
    (set by the runner when it binds one)."""

    def __init__(self, parts: ChunkParts, forward: Callable[[ChunkOps], torch.Tensor],
                 file: FileExpertProvider) -> None:  # fmt: skip
        self.p, self.forward_ops, self.file = parts, forward, file
        self.device = parts.buf.anchor.device
        self.scale = 1.0 / math.sqrt(parts.shape.attention.head_dim)
        self.graphs: dict[int, ChunkGraph] = {}  # chunk size -> its captured segments
        self.pool: tuple[int, int] | None = None  # their one memory pool (run one at a time)
        self.capturing = False
        self._stage: torch.Tensor | None = None  # staging slots for the experts in RAM homes
        # the hybrids' DeltaNet layers, gated attention and shared expert (``gpu.delta``)
        self.hybrid = None
        s = parts.shape
        if s.recurrent or s.attention.gated:
            from strata.engine.gpu.delta import HybridChunk

            g = parts.geometry
            layers = range(g.first, g.first + len(g.slot_layouts))
            self.hybrid = HybridChunk(s, parts.kv, layers, self.device)

    # -- products and the pieces of a layer ------------------------------------------------------

    def mm(self, y: torch.Tensor, h: torch.Tensor, w: Weight, add: bool = False,
           bias: torch.Tensor | None = None) -> None:  # fmt: skip
        """y (=, or +=) h W^T (+ ``bias``) over the chunk's rows; h: float16 [T, K]."""
        if isinstance(w, RepackedWeight) and w.layout.cols % gemm.UNIT == 0:
            gemm.gemm(y, h, w.data, w.layout, add=add, bias=bias)
            return
        out = linear(h.float(), w)  # a type or shape without a kernel: dequantise, multiply
        if bias is not None:
            out = out + bias
        if add:
            y.add_(out)
        else:
            y.copy_(out)

    def pre(self, x: torch.Tensor, w: AttentionWeights, a: AttentionSpec, b: ChunkBuffers) -> None:
        """Before attention: q (normed, rotated) to b.q [T, H, d], k (rotated) and v to b.k,
        b.v [T, Hkv, d]. Not the pages: a captured segment keeps the tensors it was captured
        with, and the pages' view grows with the K/V (``attend`` writes them, eagerly)."""
        T, H, Hkv, d = x.shape[0], a.n_head, a.n_head_kv, a.head_dim
        h = rms_norm(x, w.norm, a.rms_eps).half()  # [T, D]
        qkv = torch.empty(T, a.q_dim + 2 * a.kv_dim, dtype=torch.float32, device=x.device)
        at = 0
        for m, bias in ((w.q, w.q_bias), (w.k, w.k_bias), (w.v, w.v_bias)):
            n = m.shape[0]
            self.mm(qkv[:, at : at + n], h, m, bias=bias)
            at += n
        q = qkv[:, : a.q_dim].view(T, H, d)
        k = qkv[:, a.q_dim : a.q_dim + a.kv_dim].view(T, Hkv, d)
        v = qkv[:, a.q_dim + a.kv_dim :].view(T, Hkv, d)
        if w.q_norm is not None and w.k_norm is not None:
            q = rms_norm(q, w.q_norm, a.rms_eps)
            k = rms_norm(k, w.k_norm, a.rms_eps)
        cos = self.p.cos.index_select(0, b.pos)[:, None, :]  # [T, 1, d/2]
        sin = self.p.sin.index_select(0, b.pos)[:, None, :]
        b.q.copy_(rotate(q, cos, sin, a.rope.neox))
        b.k.copy_(rotate(k, cos, sin, a.rope.neox))
        b.v.copy_(v)

    def attend(self, j: int, b: ChunkBuffers, start: int, a: AttentionSpec,
               sinks: torch.Tensor | None = None) -> None:  # fmt: skip
        """The chunk's k, v (b.k, b.v) written to local layer ``j``'s pages through the block
        table, then the causal attention of its queries b.q (positions start..start+T-1) over
        the keys 0..start+T-1 in the pages, into b.attn [T, H*d] float16. Eager, between the
        segments: the pool's view is the one the K/V has now. A window or sinks (gpt-oss):
        ``gpu.oss.attend``."""
        kv, q, out = self.p.kv, b.q, b.attn
        if a.window is not None or sinks is not None:  # the real rows only: the same bits
            r = b.rows  # whether a graph's padding is there or not
            out[:r].copy_(oss.attend(kv, j, q[:r], b.k[:r], b.v[:r], b.pos[:r], start, a.window,
                                     sinks))  # fmt: skip
            out[r:].zero_()
            return
        pages = kv.block_table.index_select(0, b.pos // kv.page).long()
        rows = b.pos % kv.page
        kv.pool[pages, j, 0, rows] = b.k
        kv.pool[pages, j, 1, rows] = b.v
        T, H, d = q.shape
        S = start + T
        keys, values = kv.read(j, S, kv.dtype)  # [S, Hkv, d], gathered from the pages
        keys, values = keys.permute(1, 0, 2)[None], values.permute(1, 0, 2)[None]  # [1, Hkv, S, d]
        qh = q.permute(1, 0, 2)[None]  # [1, H, T, d]
        if start == 0:
            o = F.scaled_dot_product_attention(
                qh, keys, values, is_causal=True, scale=self.scale, enable_gqa=True
            )
        else:
            group = H // keys.shape[1]
            if group > 1:  # the lower-right causal mask takes no GQA: a K/V head per query head
                keys = keys.repeat_interleave(group, dim=1)
                values = values.repeat_interleave(group, dim=1)
            o = F.scaled_dot_product_attention(
                qh, keys, values, attn_mask=causal_lower_right(T, S), scale=self.scale
            )
        out.copy_(o[0].permute(1, 0, 2).reshape(T, H * d))

    def moe(self, j: int, x: torch.Tensor, w: MoEWeights, r: RoutingSpec,
            n_rows: torch.Tensor) -> None:  # fmt: skip
        """The routed-expert block of local layer ``j`` over the chunk's rows, added to x."""
        p = self.p
        T, K, E, D = x.shape[0], r.n_used, r.n_expert, x.shape[1]
        h32 = rms_norm(x, w.norm, r.rms_eps)
        logits = linear(h32, w.router)  # [T, E], float32 as the reference
        if w.router_bias is not None:
            logits = logits + w.router_bias
        wts, ids = oss.route(logits, K, r)  # [T, K]
        h = h32.half()
        tile = gemm.MOE_TILE
        g = gemm.group_by_expert(ids, E, tile.bm, n_rows)
        p.counters.prompts[j] += g.counts
        lay = p.geometry.slot_layouts[j]
        anchor = p.buf.anchor
        act = torch.empty(g.rows.numel(), p.shape.n_ff_exp, dtype=torch.float16, device=x.device)
        y = torch.zeros(T * K, D, dtype=torch.float32, device=x.device)  # padding: 0
        flat_w = wts.reshape(-1).contiguous()

        ex = oss.expert_extras(w, r, ids)  # gpt-oss: biases by expert id, the clamped SwiGLU
        gu = (ex.gate, ex.up) if ex is not None and ex.gate is not None else None
        oai, bd = (ex.oai, ex.down) if ex is not None else (None, None)

        def run(table: torch.Tensor) -> None:
            gemm.moe_gate_up(act, h, g, table, anchor, lay.gate, lay.up, lay.up_offset, tile,
                             gu, oai)  # fmt: skip
            gemm.moe_down(y, act, g, flat_w, table, anchor, lay.down, lay.down_offset, tile, bd)

        t = p.tables
        if self.copies_homes(T) and t.host_homes[j]:
            run(t.layer(t.vram, j))  # the VRAM slots' experts
            self._from_host(j, g.counts, run)  # then the RAM homes', copied into VRAM
        else:
            run(t.layer(t.table, j))
        p.counters.fetches[j * E : (j + 1) * E] += g.counts > 0  # each read once
        if not (self.capturing or t.complete):  # a graph is replayed only when complete
            p.staging.chunk(j, g.counts, t.plan, self.file, run)
        x.add_(y.view(T, K, D).sum(dim=1))  # the k outputs in a fixed order

    def copies_homes(self, T: int) -> bool:
        """Whether a chunk of T tokens copies its experts from RAM homes into VRAM (eagerly)."""
        return not self.capturing and T >= STAGE_MIN_TOKENS and self.p.tables.host_count > 0

    def _from_host(self, j: int, counts: torch.Tensor, run: Callable[[torch.Tensor], None]) -> None:
        """The chosen experts whose home is in RAM: copied into the staging slots (neighbouring
        homes as one copy) and run in rounds of STAGE_SLOTS (a table of MISSING skips the
        others). The same bytes as their homes, so the same numbers as reading them there."""
        t = self.p.tables
        tier = t.tier
        assert tier is not None
        used = counts.tolist()
        homes = [(e, s) for e, s in t.host_homes[j] if used[e]]
        if not homes:
            return
        n = tier.slot_bytes
        if self._stage is None or self._stage.numel() != STAGE_SLOTS * n:
            self._stage = aligned(STAGE_SLOTS * n, self.device)
        stage = self._stage
        base = self.p.buf.offset(stage)
        for i in range(0, len(homes), STAGE_SLOTS):
            group = homes[i : i + STAGE_SLOTS]
            a = 0
            while a < len(group):
                z = a + 1
                while (
                    z < len(group)
                    and group[z][1] == group[a][1] + z - a
                    and group[z][1] % tier.piece_slots  # never across two page-locked pieces
                ):
                    z += 1
                stage[a * n : z * n].copy_(tier.view(group[a][1], (z - a) * n), non_blocking=True)
                a = z
            offsets = [MISSING] * t.n_expert
            for a, (e, _) in enumerate(group):
                offsets[e] = base + a * n
            run(torch.tensor(offsets, dtype=torch.int64).to(self.device, non_blocking=True))

    # -- a chunk ---------------------------------------------------------------------------------

    def run(self, tokens: torch.Tensor, start: int, last_only: bool,
            x_in: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Logits of the chunk ``tokens`` [T] at positions start..start+T-1 (the K/V of
        0..start-1 already written): [T, V] float32, or [1, V] with ``last_only``. A stage that
        is not the first takes the previous stage's hidden state ``x_in`` [T, D]; one that is
        not the last returns its hidden state [T, D] (a view of its buffers, valid until its
        next chunk)."""
        T, kv = tokens.numel(), self.p.kv
        if T < 1 or start < 0 or start + T > kv.n_ctx:
            raise ValueError(
                f"a chunk of {T} tokens at position {start} does not fit the context of {kv.n_ctx}"
            )
        replay = last_only and self.p.tables.complete and not self.copies_homes(T)
        graph = self._graph_for(T, start) if replay else None
        if graph is not None:
            out = graph.replay(tokens, start, x_in)
        else:
            b = ChunkBuffers(self.p, T, 1 if last_only else T)
            b.tok.copy_(tokens)
            b.pos.copy_(torch.arange(start, start + T, device=self.device))
            b.n.fill_(T)
            if x_in is not None:  # a later stage: the previous stage's hidden state
                b.x.copy_(x_in)
            out = self.segments(b, start, last_only, Segments(Mode.EAGER))
            if not self.p.is_last:
                out = b.x
        kv.length = start + T
        return out

    def segments(self, b: ChunkBuffers, start: int, last_only: bool, seg: Segments) -> torch.Tensor:
        """The chunk in the buffers ``b``, its segments run as ``seg`` says."""
        seg.begin()
        try:
            out = self.forward_ops(ChunkOps(self, b, start, last_only, seg))
        except BaseException:
            seg.abort()
            raise
        seg.end()
        return out

    def _graph_for(self, T: int, start: int) -> ChunkGraph | None:
        """The smallest captured size that holds T tokens at ``start`` (its padding rows write
        K/V rows past the chunk, never read before they are rewritten: into the sequence's own
        last page, or the sink page where the block table has no page yet)."""
        kv = self.p.kv
        rows = kv.table_pages * kv.page
        fits = [n for n in self.graphs if n >= T and start + n <= rows]
        return self.graphs[min(fits)] if fits else None

    def capture(self, chunk: int) -> bool:
        """Capture the segments of prompt chunks as CUDA graphs, for sizes of powers of two
        from MIN_GRAPH_TOKENS up to ``chunk`` and ``chunk`` itself; a shorter chunk replays the
        next size up, padded (the padding tokens are routed to no expert). They are replayed
        while every expert has a readable home. False, with a warning, where capture fails:
        chunks then run the same kernels eagerly (the same numbers)."""
        if self.device.type != "cuda" or chunk < 1:
            return False
        sizes = set(_powers_of_two(MIN_GRAPH_TOKENS, chunk)) | {chunk}
        sizes = {n for n in sizes if n <= self.p.kv.n_ctx}
        ok = True
        for n in sorted(sizes):
            if n not in self.graphs:
                ok = self._capture(n) and ok
        return ok

    def _capture(self, T: int) -> bool:
        try:
            graph = ChunkGraph(self, T)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # an op that cannot be captured
            reason = f"{type(e).__name__}: {e}".splitlines()[0]
            log.warning("prompt chunks of %d tokens run without CUDA graphs: %s", T, reason)
            torch.cuda.synchronize(self.device)
            return False
        self.graphs[T] = graph
        return True

    def warm_up(self) -> None:
        """Chunks of a few tokens (rewritten by the next prompt; the block table points every
        position at the sink page now): the kernels compile now, not in a request. Triton
        compiles a kernel again for a row count of 1, a multiple of 16 and any other, so the
        chunks have 16, 5 and 1 tokens; the later ones start after the first, as a
        conversation's next turn does (on an H200 its first odd-sized chunk otherwise took
        5 s of compiling). The caller counts nothing of them."""
        start, kv = 0, self.p.kv
        for n in WARM_UP_CHUNKS:
            if start + n > kv.n_ctx:
                break
            self.run(torch.zeros(n, dtype=torch.long, device=self.device), start, last_only=True)
            start += n
        kv.length = 0


class ChunkGraph:
    """The L + 1 segments of a chunk of T tokens (last row's logits only), captured once into
    the path's memory pool with fixed buffers, as the decode step is: a replay copies the tokens
    and positions in, replays the segments in their order and runs attention eagerly between
    them (its key range grows with the position). The caller counts nothing of the capture."""

    def __init__(self, path: ChunkPath, T: int) -> None:
        self.path, self.T = path, T
        self.buf = ChunkBuffers(path.p, T, 1)
        if path.pool is None:
            path.pool = torch.cuda.graph_pool_handle()
        dev = path.device
        path.run(torch.zeros(T, dtype=torch.long, device=dev), 0, True)  # compiled, warm
        torch.cuda.synchronize(dev)
        # The attention between the segments runs for real while capturing, on position 0's
        # rows; whatever it writes is rewritten by the next prompt.
        seg = Segments(Mode.CAPTURE, pool=path.pool)
        path.capturing = True
        try:
            path.segments(self.buf, 0, True, seg)
        finally:
            path.capturing = False
        torch.cuda.synchronize(dev)
        self.graphs = seg.graphs

    def replay(self, tokens: torch.Tensor, start: int,
               x_in: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        b, n = self.buf, tokens.numel()
        b.tok[:n].copy_(tokens)
        b.tok[n:].zero_()
        b.pos.copy_(torch.arange(start, start + self.T, device=b.pos.device))
        b.n.fill_(n)
        b.rows = n
        if x_in is not None:  # a later stage: the real rows from the previous stage
            b.x[:n].copy_(x_in)
            b.x[n:].zero_()
        self.path.segments(b, start, True, Segments(Mode.REPLAY, self.graphs))
        if not self.path.p.is_last:
            return b.x[:n]
        return b.logits[:1].clone()
