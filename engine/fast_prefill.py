"""The GPU prefill path: a prompt chunk through matrix products on tensor cores.

``FastPrefill`` runs a chunk of T tokens with the fast decoder's state (its expert tables, the
staging slots of misses, the RoPE tables, the usage counts) and the runner's paged K/V. Per layer:

    RMSNorm -> q, k, v products (``kernels.gemm``) -> q/k norm, RoPE -> K/V written to the pages
    -> causal attention over the cached positions (PyTorch's SDPA: flash attention where it
    applies) -> output product + residual -> RMSNorm -> router (float32) -> top-k
    -> assignments grouped by expert on the device -> gate/up and down of every chosen expert as
    two grouped products reading the experts through the layer's table -> weighted sum of each
    token's k outputs + residual

and the final norm and the output head on the rows asked for. Nothing waits for the host while
every expert has a readable home, and then a chunk replays CUDA graphs captured at load:
everything between one layer's attention and the next is position-independent, so it is one
graph (L + 1 per chunk), and the attention runs eagerly between them, its key range growing with
the position. Graphs exist for ``prefill_chunk_tokens`` and the powers of two below it down to
``MIN_GRAPH_TOKENS``; a shorter chunk replays the next size up, its padding tokens routed to no
expert and their rows never read (each row's products are its own: the same bits as eagerly).
Otherwise (an expert without a home) each layer's counts come to the host once, and the chosen
experts without a home are staged and computed in rounds of the staging slots, with the same
kernels, so the numbers are the same whatever is cached.

Matrices are multiplied in float16 with float32 sums (the activations are rounded to float16 on
the way in, the weights' reference values on the way out of the registers), so a prefill's
logits differ from the reference path's by more than a decode step's; the tests state the
bound. Routing scores are float32 products, as in the reference, so near-ties choose the same
experts.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from strata.engine.kernels import MISSING, gemm
from strata.engine.layers.norm import rms_norm
from strata.engine.layers.rope import rotate
from strata.engine.weights import RepackedWeight, Weight, linear

if TYPE_CHECKING:
    from strata.engine.fast_decode import FastDecoder, _Layer

log = logging.getLogger(__name__)

MIN_GRAPH_TOKENS = 64  # the smallest captured chunk: shorter ones replay it, padded
WARM_UP_CHUNKS = (16, 5, 1)  # row counts Triton specialises differently: see warm_up
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


class FastPrefill:
    def __init__(self, dec: FastDecoder) -> None:
        self.dec = dec
        self.args = a = dec.args
        self.device = dec.device
        self.kv = dec.kv
        self.scale = 1.0 / math.sqrt(a.head_dim)
        self.q_dim, self.kv_dim = a.n_head * a.head_dim, a.n_head_kv * a.head_dim
        self.graphs: dict[int, _ChunkGraph] = {}  # chunk size -> its captured segments
        self.pool: tuple[int, int] | None = None  # their one memory pool (run one at a time)
        self.capturing = False
        self._stage: torch.Tensor | None = None  # staging slots for the experts in RAM homes

    # -- products --------------------------------------------------------------------------------

    def _mm(self, y: torch.Tensor, h: torch.Tensor, w: Weight, add: bool = False) -> None:
        """y (=, or +=) h W^T over the chunk's rows; h: float16 [T, K]."""
        if isinstance(w, RepackedWeight) and w.layout.cols % gemm.UNIT == 0:
            gemm.gemm(y, h, w.data, w.layout, add=add)
            return
        out = linear(h.float(), w)  # a type or shape without a kernel: dequantise, multiply
        if add:
            y.add_(out)
        else:
            y.copy_(out)

    # -- one layer -------------------------------------------------------------------------------

    def _pre(self, layer: int, x: torch.Tensor, pos: torch.Tensor, out: _Buffers) -> None:
        """Before attention: q, k, v of the rows x [T, D] at positions pos [T] (int64, on the
        device); q (normed, rotated) to out.q [T, H, d], k (rotated) and v to out.k, out.v [T, Hkv,
        d]. Not the pages: a captured segment keeps the tensors it was captured with, and the
        pages' view grows with the K/V (``_attend`` writes them, eagerly)."""
        b, a = self.dec.layers[layer].block, self.args
        T = x.shape[0]
        H, Hkv, d = a.n_head, a.n_head_kv, a.head_dim
        h = rms_norm(x, b.attn_norm, a.rms_eps).half()  # [T, D]
        qkv = torch.empty(T, self.q_dim + 2 * self.kv_dim, dtype=torch.float32, device=x.device)
        at = 0
        for w in (b.attn.q, b.attn.k, b.attn.v):
            n = w.shape[0]
            self._mm(qkv[:, at : at + n], h, w)
            at += n
        q = qkv[:, : self.q_dim].view(T, H, d)
        k = qkv[:, self.q_dim : self.q_dim + self.kv_dim].view(T, Hkv, d)
        v = qkv[:, self.q_dim + self.kv_dim :].view(T, Hkv, d)
        if b.attn.q_norm is not None and b.attn.k_norm is not None:
            q = rms_norm(q, b.attn.q_norm, a.rms_eps)
            k = rms_norm(k, b.attn.k_norm, a.rms_eps)
        cos = self.dec.cos.index_select(0, pos)[:, None, :]  # [T, 1, d/2]
        sin = self.dec.sin.index_select(0, pos)[:, None, :]
        out.q.copy_(rotate(q, cos, sin, a.rope_neox))
        out.k.copy_(rotate(k, cos, sin, a.rope_neox))
        out.v.copy_(v)

    def _attend(self, layer: int, b: _Buffers, start: int) -> None:
        """The chunk's k, v (b.k, b.v) written to its pages through the block table, then the
        causal attention of its queries b.q [T, H, d] (positions start..start+T-1) over the
        keys 0..start+T-1 in the pages, into b.attn [T, H*d] float16. Eager, between the
        segments: the pool's view is the one the K/V has now."""
        kv, q, out = self.kv, b.q, b.attn
        pages = kv.block_table.index_select(0, b.pos // kv.page).long()
        rows = b.pos % kv.page
        kv.pool[pages, layer, 0, rows] = b.k
        kv.pool[pages, layer, 1, rows] = b.v
        T, H, d = q.shape
        S = start + T
        keys, values = kv.read(layer, S, kv.dtype)  # [S, Hkv, d], gathered from the pages
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

    def _post(self, layer: int, b: _Buffers) -> None:
        """After attention: the output projection and the MoE block, each added to x."""
        lyr = self.dec.layers[layer]
        self._mm(b.x, b.attn, lyr.block.attn.o, add=True)
        self._moe(layer, lyr, b.x, b.n)

    def _moe(self, layer: int, lyr: _Layer, x: torch.Tensor, n_rows: torch.Tensor) -> None:
        dec, a, b = self.dec, self.args, lyr.block
        T, K, E = x.shape[0], a.n_expert_used, a.n_expert
        h32 = rms_norm(x, b.ffn_norm, a.rms_eps)
        probs = torch.softmax(linear(h32, b.router), dim=-1)  # [T, E], float32 as the reference
        wts, ids = torch.topk(probs, K, dim=-1)  # [T, K]
        if a.norm_topk:
            wts = wts / wts.sum(dim=-1, keepdim=True)
        h = h32.half()
        tile = gemm.MOE_TILE
        g = gemm.group_by_expert(ids, E, tile.bm, n_rows)
        dec.prefill_uses[layer] += g.counts
        lay = dec.slot_layouts[layer]
        act = torch.empty(g.rows.numel(), a.n_ff_exp, dtype=torch.float16, device=x.device)
        y = torch.zeros(T * K, a.n_embd, dtype=torch.float32, device=x.device)  # padding: 0
        flat_w = wts.reshape(-1).contiguous()

        def run(table: torch.Tensor) -> None:
            gemm.moe_gate_up(act, h, g, table, dec.anchor, lay.gate, lay.up, lay.up_offset, tile)
            gemm.moe_down(y, act, g, flat_w, table, dec.anchor, lay.down, lay.down_offset, tile)

        if self._stages(T) and dec.host_homes[layer]:
            run(dec.vram_table[layer * E : (layer + 1) * E])  # the VRAM slots' experts
            self._from_host(layer, g.counts, run)  # then the RAM homes', copied into VRAM
        else:
            run(dec.table[layer * E : (layer + 1) * E])
        dec.prefill_fetches[layer * E : (layer + 1) * E] += g.counts > 0  # each read once
        if not (self.capturing or dec.plan.complete):  # a graph is replayed only when complete
            self._misses(layer, g.counts, run)
        x.add_(y.view(T, K, a.n_embd).sum(dim=1))  # the k outputs in a fixed order

    def _stages(self, T: int) -> bool:
        """Whether a chunk of T tokens copies its experts from RAM homes into VRAM (eagerly)."""
        return not self.capturing and T >= STAGE_MIN_TOKENS and self.dec.host_count > 0

    def _from_host(
        self, layer: int, counts: torch.Tensor, run: Callable[[torch.Tensor], None]
    ) -> None:
        """The chosen experts whose home is in RAM: copied into the staging slots (neighbouring
        homes as one copy) and run in rounds of STAGE_SLOTS (a table of MISSING skips the
        others). The same bytes as their homes, so the same numbers as reading them there."""
        dec, E = self.dec, self.args.n_expert
        tier = dec.tier
        assert tier is not None
        used = counts.tolist()
        homes = [(e, s) for e, s in dec.host_homes[layer] if used[e]]
        if not homes:
            return
        stage = self._stage_buffer(tier.slot_bytes)
        base = stage.data_ptr() - dec.anchor.data_ptr()
        n = tier.slot_bytes
        for i in range(0, len(homes), STAGE_SLOTS):
            group = homes[i : i + STAGE_SLOTS]
            j = 0
            while j < len(group):
                k = j + 1
                while (
                    k < len(group)
                    and group[k][1] == group[j][1] + k - j
                    and group[k][1] % tier.piece_slots  # never across two page-locked pieces
                ):
                    k += 1
                stage[j * n : k * n].copy_(tier.view(group[j][1], (k - j) * n), non_blocking=True)
                j = k
            offsets = [MISSING] * E
            for j, (e, _) in enumerate(group):
                offsets[e] = base + j * n
            run(torch.tensor(offsets, dtype=torch.int64).to(self.device, non_blocking=True))

    def _stage_buffer(self, slot_bytes: int) -> torch.Tensor:
        if self._stage is None or self._stage.numel() != STAGE_SLOTS * slot_bytes:
            from strata.engine.fast_decode import _aligned

            self._stage = _aligned(STAGE_SLOTS * slot_bytes, self.device)
        return self._stage

    def _misses(
        self, layer: int, counts: torch.Tensor, run: Callable[[torch.Tensor], None]
    ) -> None:
        """The chosen experts without a readable home, staged and run in rounds of the staging
        slots (the cached ones ran already; a table of MISSING skips them now)."""
        dec = self.dec
        E = self.args.n_expert
        missing = [
            e for e, n in enumerate(counts.tolist()) if n and not dec.plan.is_resident(layer, e)
        ]
        slots = len(dec.staging_offsets)
        for i in range(0, len(missing), slots):
            offsets = [MISSING] * E
            for j, e in enumerate(missing[i : i + slots]):
                dec.file.upload_kernel(
                    dec.index.expert(dec.first + layer, e), dec.staging[j * dec.staging_bytes :]
                )
                offsets[e] = dec.staging_offsets[j]
            run(torch.tensor(offsets, dtype=torch.int64).to(self.device, non_blocking=True))

    # -- a chunk ---------------------------------------------------------------------------------

    def forward(
        self,
        tokens: torch.Tensor,
        start: int,
        last_only: bool = False,
        x_in: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of the chunk ``tokens`` [T] at positions start..start+T-1 (the K/V of
        0..start-1 already written): [T, V] float32, or [1, V] with ``last_only``. A stage's
        decoder that is not the first takes the previous stage's hidden state ``x_in`` [T, D]
        instead of embedding the tokens; one that is not the last returns its hidden state
        [T, D] (a view of its buffers, valid until its next chunk)."""
        self.dec.counts_dirty = True
        logits = self._run(tokens, start, last_only, x_in)
        self.dec.provider.step()
        return logits

    def _run(
        self, tokens: torch.Tensor, start: int, last_only: bool, x_in: torch.Tensor | None = None
    ) -> torch.Tensor:
        T = tokens.numel()
        if T < 1 or start < 0 or start + T > self.kv.n_ctx:
            raise ValueError(
                f"a chunk of {T} tokens at position {start} does not fit the context "
                f"of {self.kv.n_ctx}"
            )
        replay = last_only and self.dec.plan.complete and not self._stages(T)
        graph = self._graph_for(T, start) if replay else None
        if graph is not None:
            logits = graph.replay(tokens, start, x_in)
        else:
            b = _Buffers(self, T, 1 if last_only else T)
            b.tok.copy_(tokens)
            b.pos.copy_(torch.arange(start, start + T, device=self.device))
            b.n.fill_(T)
            if x_in is not None:  # a later stage: the previous stage's hidden state
                b.x.copy_(x_in)
            logits = self._segments(b, start, last_only, lambda i, run: run())
            if not self.dec.is_last:
                logits = b.x
        self.kv.length = start + T
        return logits

    def _segments(
        self, b: _Buffers, start: int, last_only: bool, segment: Callable[[int, Callable], None]
    ) -> torch.Tensor:
        """The chunk in the buffers ``b``: L + 1 position-independent segments (``segment(i,
        run)`` runs segment i: eagerly, or as its captured graph), attention between them."""
        dec, a, L = self.dec, self.args, len(self.dec.layers)

        def first() -> None:
            if dec.is_first:  # (a later stage's x holds the previous stage's output)
                b.x.copy_(dec.embd.rows(b.tok))
            self._pre(0, b.x, b.pos, b)

        def middle(layer: int) -> Callable[[], None]:
            def run() -> None:
                self._post(layer - 1, b)
                self._pre(layer, b.x, b.pos, b)

            return run

        def last() -> None:
            self._post(L - 1, b)
            if not dec.is_last:
                return  # the next stage goes on from b.x
            x = b.x.index_select(0, b.n - 1) if last_only else b.x  # the last real row
            h = rms_norm(x, dec.out_norm, a.rms_eps).half()
            self._mm(b.logits[: x.shape[0]], h, dec.output)

        segment(0, first)
        for layer in range(L):
            self._attend(layer, b, start)
            segment(layer + 1, middle(layer + 1) if layer + 1 < L else last)
        return b.logits

    def _graph_for(self, T: int, start: int) -> _ChunkGraph | None:
        """The smallest captured size that holds T tokens at ``start`` (its padding rows write
        K/V rows past the chunk, never read before they are rewritten: into the sequence's own
        last page, or the sink page where the block table has no page yet)."""
        rows = self.kv.table_pages * self.kv.page
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
        sizes = {n for n in _powers_of_two(MIN_GRAPH_TOKENS, chunk)} | {chunk}
        sizes = {n for n in sizes if n <= self.kv.n_ctx}
        ok = True
        for n in sorted(sizes):
            if n not in self.graphs:
                ok = self._capture(n) and ok
        return ok

    def _capture(self, T: int) -> bool:
        try:
            graph = _ChunkGraph(self, T)
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
        5 s of compiling). Counts nothing."""
        dec = self.dec
        stats = dec.provider.stats
        before = (stats.hits, stats.misses, stats.bytes_from_cache, stats.bytes_from_file)
        start = 0
        for n in WARM_UP_CHUNKS:
            if start + n > self.kv.n_ctx:
                break
            tokens = torch.zeros(n, dtype=torch.long, device=self.device)
            self._run(tokens, start, last_only=True)
            start += n
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stats.hits, stats.misses, stats.bytes_from_cache, stats.bytes_from_file = before
        dec.prefill_uses.zero_()
        dec.prefill_fetches.zero_()
        self.kv.length = 0


class _Buffers:
    """A chunk's inputs and the tensors that cross from one segment to the next."""

    def __init__(self, p: FastPrefill, T: int, out_rows: int) -> None:
        a, dev = p.args, p.device
        self.tok = torch.zeros(T, dtype=torch.long, device=dev)
        self.pos = torch.zeros(T, dtype=torch.long, device=dev)
        self.x = torch.zeros(T, a.n_embd, dtype=torch.float32, device=dev)  # the residual
        self.q = torch.zeros(T, a.n_head, a.head_dim, dtype=p.kv.dtype, device=dev)
        self.k = torch.zeros(T, a.n_head_kv, a.head_dim, dtype=p.kv.dtype, device=dev)
        self.v = torch.zeros(T, a.n_head_kv, a.head_dim, dtype=p.kv.dtype, device=dev)
        self.attn = torch.zeros(T, a.n_head * a.head_dim, dtype=torch.float16, device=dev)
        self.n = torch.full((1,), T, dtype=torch.long, device=dev)  # the real rows (no padding)
        rows = out_rows if p.dec.is_last else 0  # (a stage before the last has no head)
        self.logits = torch.zeros(rows, a.vocab_size, dtype=torch.float32, device=dev)


class _ChunkGraph:
    """The L + 1 segments of a chunk of T tokens (last row's logits only), captured once into
    one memory pool with fixed buffers, as the decode step is: a replay copies the tokens and
    positions in, replays the segments in their order and runs attention eagerly between them
    (its key range grows with the position)."""

    def __init__(self, p: FastPrefill, T: int) -> None:
        self.p, self.T = p, T
        self.buf = _Buffers(p, T, 1)
        self.graphs: list[torch.cuda.CUDAGraph] = []
        if p.pool is None:
            p.pool = torch.cuda.graph_pool_handle()
        pool = p.pool
        stats = p.dec.provider.stats
        saved = (stats.hits, stats.misses, stats.bytes_from_cache, stats.bytes_from_file)
        counts = p.dec.prefill_uses.clone()
        p.dec.prefill_fetches.zero_()

        def capture(i: int, run: Callable[[], None]) -> None:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                run()
            self.graphs.append(g)

        p._run(torch.zeros(T, dtype=torch.long, device=p.device), 0, True)  # compiled, warm
        torch.cuda.synchronize(p.device)
        # The attention between the segments runs for real while capturing, on position 0's
        # rows; whatever it writes is rewritten by the next prompt.
        p.capturing = True
        try:
            p._segments(self.buf, 0, True, capture)
        finally:
            p.capturing = False
        torch.cuda.synchronize(p.device)
        p.dec.prefill_uses.copy_(counts)
        p.dec.prefill_fetches.zero_()
        stats.hits, stats.misses, stats.bytes_from_cache, stats.bytes_from_file = saved

    def replay(
        self, tokens: torch.Tensor, start: int, x_in: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, n = self.buf, tokens.numel()
        b.tok[:n].copy_(tokens)
        b.tok[n:].zero_()
        b.pos.copy_(torch.arange(start, start + self.T, device=b.pos.device))
        b.n.fill_(n)
        if x_in is not None:  # a later stage: the real rows from the previous stage
            b.x[:n].copy_(x_in)
            b.x[n:].zero_()
        self.p._segments(b, start, True, lambda i, run: self.graphs[i].replay())
        if not self.p.dec.is_last:
            return b.x[:n]
        return b.logits[:1].clone()
