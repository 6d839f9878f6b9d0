"""How fast the prompt-chunk GEMM (``kernels.gemm``) runs per form, weight type and tile.

A developer's measurement, not a bench row: no model is loaded. For each weight type it builds
random valid weights in the kernel layout — a dense matrix, and a pool of E experts in slots of
one buffer found through a table of byte offsets from an anchor, as the engine lays them out —
a uniform random routing of T tokens to k experts each (seeded), and times the three forms a
prompt chunk launches: ``dense`` (``gemm.gemm``: N x d), ``gate_up`` (``gemm.moe_gate_up``: two
f x d matrices, SiLU(gate) * up) and ``down`` (``gemm.moe_down``: d x f, times the routing
weight), each at every tile asked for::

    python -m strata.bench.gemm_sweep --preset gpt-oss-20b [--types MXFP4] [--json out.json]

Each (type, form, tile) is launched once (the compile, reported apart), its output checked
against the torch twin (dequantise, then multiply in float32: a tile off by more than the
kernel tests' tolerance is ``WRONG`` and never the best), then timed with CUDA events over
``--reps`` launches, the L2 flushed before each (a chunk reads each layer's weights once), and
the median reported: µs, TFLOPS (2 x real rows x N x K, padding not counted; gate_up's N is
2f) and the GB/s of the weight bytes read (each used expert's once). A tile that fails to
compile or launch (``OutOfResources``) is reported in its row. The best tile of each (type,
form) is marked and the engine's own tile (``gemm.DENSE_TILE``, ``gemm.MOE_TILE``) compared
with it.
``--time-limit`` stops starting rows after that many seconds; rows run tile by tile across
types and forms, so a cut sweep has each (type, form)'s first tiles.

On a machine without CUDA it runs in Triton's interpreter (``TRITON_INTERPRET=1``), timed with
``time.perf_counter``: a check that the sweep works, not GPU numbers.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import torch

from strata.bench.settings import (
    SYNTHETIC_NAMES,
    BenchError,
    parse_int,
    parse_seconds,
    synthetic_preset,
)
from strata.engine.gguf_index import ExpertBlob, ExpertRun
from strata.engine.kernels import gemm
from strata.engine.kernels.inputs import INTERPRETED
from strata.engine.quant import REPACKED_TYPES, dequantize_repacked, repack_into
from strata.engine.quant.expert_layout import RUN_ALIGN, KernelSlotLayout, align, kernel_layout
from strata.engine.quant.formats import fmt
from strata.engine.quant.repack import RepackedLayout, repacked_layout

Q = gguf.GGMLQuantizationType
FORMS = ("dense", "gate_up", "down")
DEFAULT_TYPES = ("Q4_K", "MXFP4")
# tests/model/test_prefill_kernels.py's tolerance for the GEMM against its torch twin (float16
# products with float32 sums against float32 products of the reference values)
TOL = 2e-3
WEIGHT_STD = 0.02  # the random weights' spread: gate/up outputs near 1 for d in the thousands
BASE_EXPERTS = 2  # experts made from random values; the others are their rows rotated
FLUSH_BYTES = 256 * 2**20  # written before each timed launch: more than any L2 holds

# Tiles tried beside the engine's (BM rows, BN columns, S units of 32 along K, warps, stages):
# 64 x 128 x 4 and 32 x 128 x 4 (the engine's first tiles), 128 x 128 x 2 and 64 x 64 x 2 (from
# the compiled code's instructions and registers: bench.kernel_resources), their neighbours.
# Dense products have the whole chunk's rows; an expert's block holds T*k/E rows on average (16
# for Qwen3.6 at 512 tokens, 32 for Qwen3-30B, 64 for gpt-oss).
DENSE_CANDIDATES = (
    gemm.Tile(64, 128, 4, 4, 3), gemm.Tile(128, 128, 2, 8, 3), gemm.Tile(128, 128, 4, 8, 3),
    gemm.Tile(128, 64, 2, 4, 3), gemm.Tile(64, 64, 2, 4, 3), gemm.Tile(64, 128, 2, 4, 3),
    gemm.Tile(128, 256, 2, 8, 3), gemm.Tile(256, 128, 2, 8, 3), gemm.Tile(128, 128, 2, 8, 2),
    gemm.Tile(64, 256, 2, 8, 3),
)  # fmt: skip
MOE_CANDIDATES = (
    gemm.Tile(32, 128, 4, 4, 3), gemm.Tile(64, 64, 2, 4, 3), gemm.Tile(16, 64, 2, 4, 3),
    gemm.Tile(32, 64, 2, 4, 3), gemm.Tile(64, 128, 2, 4, 3), gemm.Tile(64, 128, 2, 8, 3),
    gemm.Tile(64, 64, 4, 4, 3), gemm.Tile(64, 64, 2, 4, 2), gemm.Tile(32, 128, 2, 4, 3),
    gemm.Tile(16, 128, 2, 4, 3),
)  # fmt: skip


@dataclass(frozen=True)
class Shape:
    d: int  # hidden size: K of dense and gate/up, N of down
    f: int  # an expert's FF size
    experts: int
    top_k: int
    tokens: int  # the chunk's rows
    dense_n: int  # rows of the dense matrix


@dataclass
class Row:
    qtype: str
    form: str
    tile: str  # "BM,BN,S,WARPS,STAGES"
    engine: bool  # the engine's own tile for this form
    status: str  # ok, WRONG, failed, skipped
    us: float | None = None
    tflops: float | None = None
    gbps: float | None = None
    compile_s: float | None = None  # the first launch, compile included
    max_err: float | None = None  # max |out - reference| / max |reference|
    error: str | None = None
    best: bool = False


def tile_text(t: gemm.Tile) -> str:
    return f"{t.bm},{t.bn},{t.s},{t.warps},{t.stages}"


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def parse_tiles(text: str) -> tuple[gemm.Tile, ...]:
    """``BM,BN,S,WARPS,STAGES;...``: BM, BN powers of two >= 16 (``tl.dot``'s least), S and
    WARPS powers of two, STAGES >= 1; no repeats."""
    tiles: list[gemm.Tile] = []
    for raw in text.split(";"):
        item = raw.strip()
        try:
            v = [int(x) for x in item.split(",")]
        except ValueError:
            v = []
        if len(v) != 5:
            raise BenchError(f"--tiles: invalid tile {item!r} in {text!r} (expected "
                             "BM,BN,S,WARPS,STAGES, five integers; ';' between tiles)")  # fmt: skip
        bm, bn, s, warps, stages = v
        for name, val, ok, want in (
            ("BM", bm, _pow2(bm) and bm >= 16, "a power of two >= 16"),
            ("BN", bn, _pow2(bn) and bn >= 16, "a power of two >= 16"),
            ("S", s, _pow2(s), "a power of two >= 1"),
            ("WARPS", warps, _pow2(warps), "a power of two >= 1"),
            ("STAGES", stages, stages >= 1, "an integer >= 1"),
        ):
            if not ok:
                raise BenchError(f"--tiles: invalid tile {item!r}: {name} {val} is not {want}")
        tiles.append(gemm.Tile(bm, bn, s, warps, stages))
    if len(set(tiles)) != len(tiles):
        raise BenchError(f"--tiles: invalid value {text!r} (a tile is listed twice)")
    return tuple(tiles)


def default_tiles(form: str) -> tuple[gemm.Tile, ...]:
    """The engine's tile for ``form``, then the candidates."""
    if form == "dense":
        return (gemm.DENSE_TILE, *(t for t in DENSE_CANDIDATES if t != gemm.DENSE_TILE))
    return (gemm.MOE_TILE, *(t for t in MOE_CANDIDATES if t != gemm.MOE_TILE))


def preset_shape(name: str) -> tuple[int, int, int, int]:
    """(d, f, E, k) of a ``strata bench --synthetic`` preset, from its spec."""
    from strata.engine import synth, synth_gpt_oss, synth_hybrid

    p = synthetic_preset(name)
    spec = synth.PRESETS.get(p) or synth_gpt_oss.PRESETS.get(p) or synth_hybrid.PRESETS[p][0]
    return spec.n_embd, spec.n_ff_exp, spec.n_expert, spec.n_expert_used


def parse_types(text: str | None, shape: Shape) -> tuple[tuple[Q, ...], list[str]]:
    """The weight types asked for (default: those of ``DEFAULT_TYPES`` the shape can hold, the
    others named in the returned notes); a type without a kernel layout or whose block does not
    divide d or f is an error naming it."""
    known = {t.name: t for t in REPACKED_TYPES}
    names = [v.strip() for v in (text or ",".join(DEFAULT_TYPES)).split(",") if v.strip()]
    if not names or len(set(names)) != len(names):
        raise BenchError(f"--types: invalid value {text!r} (weight type names, no repeats)")
    out: list[Q] = []
    notes: list[str] = []
    for n in names:
        if n not in known:
            raise BenchError(f"--types: {n!r} is not a weight type the kernels read "
                             f"({', '.join(sorted(known))})")  # fmt: skip
        block = fmt(known[n]).block
        bad = [f"--{k} {v}" for k, v in (("d", shape.d), ("f", shape.f)) if v % block]
        if bad:
            why = f"{n}: {' and '.join(bad)} not a multiple of its block of {block}"
            if text is not None:
                raise BenchError(f"--types: {why}")
            notes.append(f"left out {why}")
            continue
        out.append(known[n])
    if not out:
        raise BenchError(f"--types: none of {', '.join(names)} fits d={shape.d}, f={shape.f}")
    return tuple(out), notes


# -- weights -------------------------------------------------------------------------------------


@functools.cache
def _quantisable(qtype: Q) -> bool:
    """Whether gguf-py quantises ``qtype`` (else its blocks are made random)."""
    if qtype in (Q.F32, Q.F16):
        return True
    try:
        gguf.quants.quantize(np.zeros((1, fmt(qtype).block), np.float32), qtype)
    except NotImplementedError:
        return False
    return True


@functools.cache
def _unit_std(qtype: Q) -> float:
    """The spread of random ``qtype`` blocks whose scale is 1 (their d field scales it)."""
    blocks = _random_blocks(np.random.default_rng(0), qtype, 256, np.ones(256, np.float32))
    return float(gguf.quants.dequantize(blocks, qtype).std())


def _random_blocks(rng: np.random.Generator, qtype: Q, n: int, d: np.ndarray) -> np.ndarray:
    """``n`` random blocks with their scale fields set from ``d`` [n] (as synth writes them):
    every value finite, near d times a level."""
    from strata.engine.synth import RANDOM_BLOCK_SCALES
    from strata.engine.synth_recipes import fix_blocks

    size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)  # blocks: [n, type size]
    for at, mult in RANDOM_BLOCK_SCALES[qtype]:
        blocks[:, at : at + 2].view(np.float16)[:, 0] = (d * mult).astype(np.float16)
    fix_blocks(qtype, blocks, d)
    return blocks


def raw_matrix(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """A rows x cols matrix of ``qtype`` as its GGUF bytes ([nbytes] uint8): random floats of
    spread WEIGHT_STD, quantised by gguf-py where it can, else random blocks of that spread."""
    if _quantisable(qtype):
        w = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(WEIGHT_STD)
        if qtype == Q.F32:
            return w.view(np.uint8).reshape(-1)
        if qtype == Q.F16:
            return w.astype(np.float16).view(np.uint8).reshape(-1)
        return gguf.quants.quantize(w, qtype).reshape(-1)
    n = rows * cols // fmt(qtype).block
    d = (WEIGHT_STD / _unit_std(qtype) * rng.uniform(0.5, 1.5, n)).astype(np.float32)
    return _random_blocks(rng, qtype, n, d).reshape(-1)


def repacked(raw: torch.Tensor, lay: RepackedLayout, shift: int, dst: torch.Tensor) -> None:
    """The kernel layout of ``raw``'s rows rotated by ``shift`` (another matrix of the same
    values) written into ``dst``."""
    rows = raw.view(lay.rows, -1).roll(shift % lay.rows, 0)
    repack_into(dst, rows.reshape(-1), lay)


class Pool:
    """E experts of one type, gate/up/down repacked, in shuffled slots of one buffer; ``table``
    holds each one's byte offset from ``anchor``, as the engine's expert tables do."""

    def __init__(self, qtype: Q, s: Shape, rng: np.random.Generator, dev: torch.device) -> None:
        def run(name: str, shape: tuple[int, int]) -> ExpertRun:  # (its bytes never read)
            return ExpertRun(name, qtype, shape, 0, repacked_layout(qtype, shape).nbytes)

        E = s.experts
        blob = ExpertBlob(0, 0, run("gate", (s.f, s.d)), run("up", (s.f, s.d)),
                          run("down", (s.d, s.f)))  # fmt: skip
        self.lay: KernelSlotLayout = kernel_layout(blob)
        self.slot = align(self.lay.nbytes, RUN_ALIGN)
        self.arena = torch.zeros(RUN_ALIGN + E * self.slot, dtype=torch.uint8, device=dev)
        self.anchor = self.arena[:RUN_ALIGN]
        perm = rng.permutation(E)
        self.at = [RUN_ALIGN + int(perm[e]) * self.slot for e in range(E)]  # [E] slot starts
        shapes = ((s.f, s.d), (s.f, s.d), (s.d, s.f))
        bases = [[torch.from_numpy(raw_matrix(qtype, *sh, rng)).to(dev) for sh in shapes]
                 for _ in range(min(E, BASE_EXPERTS))]  # fmt: skip
        for e in range(E):
            for raw, lay, off in zip(bases[e % len(bases)], self.lay.layouts, self.lay.offsets,
                                     strict=True):  # fmt: skip
                repacked(raw, lay, e // len(bases), self.arena[self.at[e] + off :])
        self.table = torch.tensor(self.at, dtype=torch.int64, device=dev)  # from the anchor

    def matrix(self, e: int, which: int) -> torch.Tensor:
        """Expert e's gate (0), up (1) or down (2) as float32, the reference's values."""
        lay, off = self.lay.layouts[which], self.lay.offsets[which]
        return dequantize_repacked(self.arena[self.at[e] + off :][: lay.nbytes], lay)


Launch = Callable[[], None]


class Inputs:
    """The chunk, the same for every type: its activations and its routing (seeded)."""

    def __init__(self, s: Shape, seed: int, dev: torch.device) -> None:
        self.s = s
        g = torch.Generator().manual_seed(seed)
        T, k, E = s.tokens, s.top_k, s.experts
        self.h = torch.randn(T, s.d, generator=g).half().to(dev)  # h: [T, d], dense and gate/up
        scores = torch.rand(T, E, generator=g)
        self.ids = torch.topk(scores, k, dim=1).indices.to(dev)  # ids: [T, k], uniform, distinct
        self.wts = torch.softmax(torch.randn(T, k, generator=g), 1).reshape(-1).to(dev)  # [T*k]
        self.act = torch.randn(T * k, s.f, generator=g).half().to(dev)  # down's input: [T*k, f]
        self.used = int((torch.bincount(self.ids.reshape(-1).cpu(), minlength=E) > 0).sum())
        self._groups: dict[int, gemm.Groups] = {}

    def groups(self, bm: int) -> gemm.Groups:
        """The assignments grouped by expert into blocks of ``bm`` rows (bm changes them)."""
        if bm not in self._groups:
            self._groups[bm] = gemm.group_by_expert(self.ids, self.s.experts, bm)
        return self._groups[bm]


class TypeBench:
    """One weight type's matrices: the dense one and the expert pool, and the forms' torch
    twins (computed on first use)."""

    def __init__(self, qtype: Q, x: Inputs, seed: int, dev: torch.device) -> None:
        s = x.s
        rng = np.random.default_rng([seed, int(qtype)])
        self.qtype, self.x = qtype, x
        self.dense = repacked_layout(qtype, (s.dense_n, s.d))
        self.w = torch.empty(self.dense.nbytes, dtype=torch.uint8, device=dev)
        repacked(torch.from_numpy(raw_matrix(qtype, s.dense_n, s.d, rng)).to(dev), self.dense, 0,
                 self.w)  # fmt: skip
        self.pool = Pool(qtype, s, rng, dev)
        self._refs: dict[str, torch.Tensor] = {}

    def reference(self, form: str) -> torch.Tensor:
        """The form's output from float32 products of the reference values: dense [T, N]; the
        expert forms per assignment (token * k + choice) [T*k, f] or [T*k, d]."""
        if form not in self._refs:
            self._refs[form] = self._reference(form)
        return self._refs[form]

    def _reference(self, form: str) -> torch.Tensor:
        x = self.x
        if form == "dense":
            return gemm.gemm_reference(x.h, self.w, self.dense)
        k = x.s.top_k
        flat = x.ids.reshape(-1)
        out = torch.empty(flat.numel(), x.s.f if form == "gate_up" else x.s.d, device=flat.device)
        for e in flat.unique().tolist():
            a = (flat == e).nonzero().flatten()  # a: the expert's assignments
            if form == "gate_up":
                h = x.h[a // k].float()
                g, u = self.pool.matrix(e, 0), self.pool.matrix(e, 1)
                out[a] = torch.nn.functional.silu(h @ g.T) * (h @ u.T)
            else:
                out[a] = (x.act[a].float() @ self.pool.matrix(e, 2).T) * x.wts[a, None]
        return out

    def work(self, form: str) -> tuple[int, int]:
        """(floating-point operations over the real rows, weight bytes read) of one launch."""
        s, lay = self.x.s, self.pool.lay
        A = s.tokens * s.top_k
        if form == "dense":
            return 2 * s.tokens * s.dense_n * s.d, self.dense.nbytes
        if form == "gate_up":
            return 2 * A * 2 * s.f * s.d, self.x.used * (lay.gate.nbytes + lay.up.nbytes)
        return 2 * A * s.d * s.f, self.x.used * lay.down.nbytes

    def launcher(self, form: str, tile: gemm.Tile) -> tuple[Launch, Callable[[], torch.Tensor]]:
        """A launch of ``form`` with ``tile`` and how to read its output as the reference's."""
        x, p, s = self.x, self.pool, self.x.s
        dev = x.h.device
        if form == "dense":
            y = torch.full((s.tokens, s.dense_n), math.nan, device=dev)
            return lambda: gemm.gemm(y, x.h, self.w, self.dense, tile=tile), lambda: y
        g = x.groups(tile.bm)
        valid = g.rows < g.n_valid
        at = g.rows[valid].long()  # the assignment at each sorted position that holds one
        if form == "gate_up":
            act = torch.full((g.rows.numel(), s.f), math.nan, dtype=torch.float16, device=dev)

            def gate_up() -> None:
                gemm.moe_gate_up(act, x.h, g, p.table, p.anchor, p.lay.gate, p.lay.up,
                                 p.lay.up_offset, tile)  # fmt: skip

            def by_assignment() -> torch.Tensor:
                out = torch.full((g.n_valid, s.f), math.nan, device=dev)
                out[at] = act[valid].float()
                return out

            return gate_up, by_assignment
        a = torch.zeros(g.rows.numel(), s.f, dtype=torch.float16, device=dev)  # sorted order
        a[valid] = x.act[at]
        y = torch.full((g.n_valid, s.d), math.nan, device=dev)

        def down() -> None:
            gemm.moe_down(y, a, g, x.wts, p.table, p.anchor, p.lay.down, p.lay.down_offset, tile)

        return down, lambda: y


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| relative to max |want|; inf where got holds a NaN or an infinity."""
    if not torch.isfinite(got).all():
        return math.inf
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


class Timer:
    """Seconds of each of ``reps`` launches: CUDA events around each, the L2 flushed before;
    on the CPU (the interpreter) ``time.perf_counter``."""

    def __init__(self, dev: torch.device, reps: int) -> None:
        self.dev, self.reps = dev, reps
        cuda = dev.type == "cuda"
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev) if cuda else None

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def __call__(self, fn: Callable[[], None]) -> list[float]:
        if self.flush is None:
            out = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
            return out
        fn()  # a warm launch after the checked one
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.reps)]  # fmt: skip
        for _ in events:  # a head start: the launches below are queued before the GPU gets
            self.flush.zero_()  # to them, so no event waits on Python (~65 us a flush)
        for a, b in events:
            self.flush.zero_()
            a.record()
            fn()
            b.record()
        self.sync()
        return [a.elapsed_time(b) / 1e3 for a, b in events]


def engine_tile(form: str) -> gemm.Tile:
    return gemm.DENSE_TILE if form == "dense" else gemm.MOE_TILE


def _why(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def run_row(b: TypeBench, form: str, tile: gemm.Tile, timer: Timer) -> Row:
    """One (type, form, tile): launch (compile), check against the twin, time."""
    row = Row(b.qtype.name, form, tile_text(tile), tile == engine_tile(form), "ok")
    try:
        fn, out = b.launcher(form, tile)
        t0 = time.perf_counter()
        fn()
        timer.sync()
        row.compile_s = time.perf_counter() - t0
        err = max_err(out(), b.reference(form))
        times = timer(fn)
    except Exception as e:  # a tile that cannot compile or launch (OutOfResources, ...)
        row.status, row.error = "failed", _why(e)
        return row
    if math.isinf(err):
        row.status, row.error = "WRONG", "an output is NaN or infinite"
    else:
        row.max_err = err
        if err > TOL:
            row.status, row.error = "WRONG", f"max error {err:.2e} of the output's scale > {TOL}"
    sec = statistics.median(times)
    flops, nbytes = b.work(form)
    row.us, row.tflops, row.gbps = sec * 1e6, flops / sec / 1e12, nbytes / sec / 1e9
    return row


@dataclass(frozen=True)
class Plan:
    shape: Shape
    preset: str | None
    types: tuple[Q, ...]
    tiles: dict[str, tuple[gemm.Tile, ...]]  # form -> its tiles, in order
    reps: int
    seed: int
    device: torch.device
    time_limit_s: float | None
    notes: tuple[str, ...]


def order(plan: Plan) -> list[tuple[Q, str, gemm.Tile]]:
    """Tile by tile across types and forms: a sweep cut by the time limit has each (type,
    form)'s first tiles (the engine's, by default)."""
    n = max(len(t) for t in plan.tiles.values())
    return [(q, f, plan.tiles[f][i]) for i in range(n) for q in plan.types for f in plan.tiles
            if i < len(plan.tiles[f])]  # fmt: skip


def sweep(plan: Plan, say: Callable[[str], None], start: float) -> list[Row]:
    """Every row of ``plan``, each told to ``say`` as a line when done; rows not started within
    the time limit (seconds since ``start``, a ``time.monotonic``) are ``skipped``."""
    from strata.engine.devices import on_device

    x: Inputs | None = None
    benches: dict[Q, TypeBench | str] = {}  # a type's matrices, or why they could not be made
    rows: list[Row] = []
    timer = Timer(plan.device, plan.reps)
    with on_device(plan.device):
        for q, form, tile in order(plan):
            if plan.time_limit_s is not None and time.monotonic() - start > plan.time_limit_s:
                row = Row(q.name, form, tile_text(tile), tile == engine_tile(form), "skipped")
            else:
                if x is None:
                    x = Inputs(plan.shape, plan.seed, plan.device)
                if q not in benches:
                    t0 = time.perf_counter()
                    try:
                        benches[q] = TypeBench(q, x, plan.seed, plan.device)
                        say(f"{q.name}: weights made in {time.perf_counter() - t0:.1f} s")
                    except Exception as e:  # (its rows say why; the other types go on)
                        benches[q] = f"its weights could not be made: {_why(e)}"
                b = benches[q]
                if isinstance(b, str):
                    row = Row(q.name, form, tile_text(tile), tile == engine_tile(form), "failed",
                              error=b)  # fmt: skip
                else:
                    row = run_row(b, form, tile, timer)
                say(row_line(row))
            rows.append(row)
    return rows


def summary(rows: list[Row]) -> list[dict[str, object]]:
    """Per (type, form) the fastest correct tile (marked ``best`` in its row) and the engine's
    tile against it."""
    out: list[dict[str, object]] = []
    keys = list(dict.fromkeys((r.qtype, r.form) for r in rows))
    for q, f in keys:
        mine = [r for r in rows if (r.qtype, r.form) == (q, f)]
        ok = [r for r in mine if r.status == "ok" and r.us is not None]
        eng = next((r for r in mine if r.engine), None)
        best = min(ok, key=lambda r: r.us or 0.0) if ok else None
        if best is not None:
            best.best = True
        ratio = eng.us / best.us if best and eng and eng.status == "ok" and eng.us else None
        out.append({
            "qtype": q, "form": f, "best_tile": best.tile if best else None,
            "best_us": best.us if best else None, "engine_tile": tile_text(engine_tile(f)),
            "engine_status": eng.status if eng else "not swept",
            "engine_us": eng.us if eng else None, "engine_ratio": ratio,
        })  # fmt: skip
    return out


def _num(v: float | None, fmt_: str) -> str:
    return "-" if v is None else format(v, fmt_)


def row_line(r: Row) -> str:
    marks = " ".join(m for m, on in (("engine", r.engine), ("best", r.best)) if on)
    tail = f"  {r.error}" if r.error else ""
    return (f"{r.qtype:<7} {r.form:<7} {r.tile:<16} {_num(r.us, '10.1f')} {_num(r.tflops, '7.2f')}"
            f" {_num(r.gbps, '8.1f')} {_num(r.compile_s, '8.2f')} {_num(r.max_err, '8.1e')}"
            f"  {r.status:<7} {marks}{tail}")  # fmt: skip


HEADER = (f"{'type':<7} {'form':<7} {'tile':<16} {'us':>10} {'TFLOPS':>7} {'GB/s':>8} "
          f"{'first s':>8} {'max err':>8}  status")  # fmt: skip


def timing_text(dev: torch.device, reps: int) -> str:
    if dev.type == "cuda":
        return f"CUDA events: median of {reps} launches, the L2 flushed before each"
    return (f"time.perf_counter: median of {reps} launches in Triton's interpreter on the CPU "
            "(not GPU numbers)")  # fmt: skip


def report(plan: Plan, rows: list[Row], best: list[dict[str, object]], elapsed: float) -> dict:
    """The JSON-ready result."""
    dev = plan.device
    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "gpu_numbers": dev.type == "cuda",
        "timing": timing_text(dev, plan.reps),
        "preset": plan.preset,
        "shape": asdict(plan.shape),
        "types": [q.name for q in plan.types],
        "forms": list(plan.tiles),
        "reps": plan.reps,
        "seed": plan.seed,
        "tolerance": TOL,
        "engine_tiles": {f: tile_text(engine_tile(f)) for f in plan.tiles},
        "rows": [asdict(r) for r in rows],
        "best": best,
        "skipped": [f"{r.qtype} {r.form} {r.tile}" for r in rows if r.status == "skipped"],
        "time_limit_s": plan.time_limit_s,
        "elapsed_s": elapsed,
        "notes": list(plan.notes),
    }


def print_summary(result: dict, out) -> None:
    for b in result["best"]:
        head = f"{b['qtype']} {b['form']}: "
        if b["best_tile"] is None:
            line = head + "no tile ran correctly"
        else:
            line = head + f"best {b['best_tile']} {b['best_us']:.1f} us"
        if b["engine_ratio"] is not None:
            line += f"; the engine's {b['engine_tile']} {b['engine_ratio']:.2f}x the best"
        else:
            line += f"; the engine's {b['engine_tile']}: {b['engine_status']}"
        print(line, file=out)
    if result["skipped"]:
        print(f"time limit {result['time_limit_s']:g} s: {len(result['skipped'])} rows skipped: "
              + "; ".join(result["skipped"]), file=out)  # fmt: skip


def _device(name: str | None) -> torch.device:
    from strata.engine.devices import resolve_device
    from strata.engine.errors import EngineError

    if not INTERPRETED and not torch.cuda.is_available():
        raise BenchError("no CUDA device: set TRITON_INTERPRET=1 to run the sweep (slowly, "
                         "not GPU numbers) in Triton's interpreter on the CPU")  # fmt: skip
    try:
        dev = resolve_device(name or ("cpu" if INTERPRETED else "cuda"))
    except EngineError as e:
        raise BenchError(f"--device: {e}") from None
    if INTERPRETED and dev.type != "cpu":
        raise BenchError(f"--device {name}: TRITON_INTERPRET=1 runs the kernels on the CPU "
                         "(give --device cpu, or unset TRITON_INTERPRET for the GPU)")  # fmt: skip
    if not INTERPRETED and dev.type != "cuda":
        raise BenchError(f"--device {name}: the kernels run on the CPU only in Triton's "
                         "interpreter (set TRITON_INTERPRET=1)")  # fmt: skip
    return dev


def _shape(a: argparse.Namespace) -> Shape:
    names = ("d", "f", "experts", "top_k")
    got = dict(zip(names, preset_shape(a.preset), strict=True)) if a.preset else {}
    for name in names:
        text = getattr(a, name)
        if text is not None:
            got[name] = parse_int(text, "--" + name.replace("_", "-"), 1)
    missing = [f"--{n.replace('_', '-')}" for n in names if n not in got]
    if missing:
        raise BenchError(f"give --preset or {', '.join(missing)}")
    for n in ("d", "f"):
        if got[n] % gemm.UNIT:
            raise BenchError(f"--{n}: invalid value {got[n]} (expected a multiple of {gemm.UNIT})")
    if got["top_k"] > got["experts"]:
        raise BenchError(f"--top-k: invalid value {got['top_k']} (more than --experts "
                         f"{got['experts']})")  # fmt: skip
    tokens = parse_int(a.tokens, "--tokens", 1)
    dense_n = parse_int(a.dense_n, "--dense-n", 1) if a.dense_n is not None else got["d"]
    return Shape(got["d"], got["f"], got["experts"], got["top_k"], tokens, dense_n)


def build_plan(a: argparse.Namespace) -> Plan:
    """The arguments checked and turned into a plan; a bad one raises BenchError naming it."""
    shape = _shape(a)
    types, notes = parse_types(a.types, shape)
    forms = [v.strip() for v in a.forms.split(",") if v.strip()]
    for f in forms:
        if f not in FORMS:
            raise BenchError(f"--forms: {f!r} is not a form of the GEMM ({', '.join(FORMS)})")
    if not forms or len(set(forms)) != len(forms):
        raise BenchError(f"--forms: invalid value {a.forms!r} (forms of {', '.join(FORMS)}, "
                         "no repeats)")  # fmt: skip
    given = parse_tiles(a.tiles) if a.tiles is not None else None
    tiles = {f: given if given is not None else default_tiles(f) for f in forms}
    limit = parse_seconds(a.time_limit, "--time-limit") if a.time_limit is not None else None
    return Plan(shape, a.preset, types, tiles, parse_int(a.reps, "--reps", 1),
                parse_int(a.seed, "--seed", 0), _device(a.device), limit, tuple(notes))  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m strata.bench.gemm_sweep", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--preset", choices=SYNTHETIC_NAMES,
                   help="d, f, E and k of a `strata bench --synthetic` model")  # fmt: skip
    p.add_argument("--d", help="hidden size (K of dense and gate/up, N of down)")
    p.add_argument("--f", help="an expert's FF size")
    p.add_argument("--experts", help="experts in a layer (E)")
    p.add_argument("--top-k", dest="top_k", help="experts chosen per token (k)")
    p.add_argument("--tokens", default="512", help="the chunk's rows (default 512)")
    p.add_argument("--dense-n", dest="dense_n", help="rows of the dense matrix (default d)")
    p.add_argument("--types", help="weight types, comma-separated (default "
                   f"{','.join(DEFAULT_TYPES)}, those the shape can hold)")  # fmt: skip
    p.add_argument("--forms", default=",".join(FORMS), help="of dense, gate_up, down")
    p.add_argument("--tiles", help="BM,BN,S,WARPS,STAGES;... for every form (default: the "
                   "engine's tile and about ten candidates per form)")  # fmt: skip
    p.add_argument("--reps", default="20", help="timed launches per row (median)")
    p.add_argument("--seed", default="0")
    p.add_argument("--device", help="cuda, cuda:N; cpu under TRITON_INTERPRET=1")
    p.add_argument("--time-limit", dest="time_limit",
                   help="start no row after this many seconds (the rest: skipped)")  # fmt: skip
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="the results as JSON: to PATH, or alone on stdout without one")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    p = parser()
    a = p.parse_args(argv)
    try:
        plan = build_plan(a)
    except BenchError as e:
        p.error(str(e))
    s = plan.shape
    for line in (
        f"gemm_sweep: d={s.d} f={s.f} E={s.experts} k={s.top_k} T={s.tokens} dense "
        f"N={s.dense_n}; {timing_text(plan.device, plan.reps)}",
        *plan.notes,
        HEADER,
    ):
        print(line, file=sys.stderr)  # (progress: stdout is the table, or the JSON)
    rows = sweep(plan, lambda line: print(line, file=sys.stderr, flush=True), start)
    best = summary(rows)
    result = report(plan, rows, best, time.monotonic() - start)
    out = sys.stderr if a.json == "-" else sys.stdout
    if a.json != "-":  # the rows again, by type and form, the best marked
        print(HEADER, file=out)
        for key in dict.fromkeys((r.qtype, r.form) for r in rows):
            for r in rows:
                if (r.qtype, r.form) == key and r.status != "skipped":
                    print(row_line(r), file=out)
    print_summary(result, out)
    if a.json == "-":
        print(json.dumps(result, indent=1))
    elif a.json is not None:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
