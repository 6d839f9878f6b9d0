"""How fast the routed-expert kernels of a decode step read their experts, by where they live.

A developer's measurement, not a bench row: it builds a pool of experts with the shapes of a
model's layers (random bytes in the kernel layout) in VRAM and in page-locked host memory, then
times graphs of ``layers`` x (``gate_up``, ``down``) — one decode step's expert work — with every
chosen expert in RAM, in VRAM, or half and half, for several row blocks and warp counts. Beside
them: the copy engine and a plain copy kernel moving the same bytes, the rates a kernel that reads
RAM over PCIe can hope for. Prints one table (GB/s of RAM bytes, µs per layer; the row with
every expert in VRAM: GB/s of the quantised bytes it reads there)::

    python -m strata.bench.moe_sweep --d 2048 --f 768 --down Q6_K
"""

from __future__ import annotations

import argparse
import statistics
import sys

import gguf
import torch
import triton
import triton.language as tl

from strata.engine.kernels import moe
from strata.engine.quant import REPACKED_TYPES
from strata.engine.quant.expert_layout import RUN_ALIGN, align
from strata.engine.quant.repack import repacked_layout

Q = gguf.GGMLQuantizationType


@triton.jit
def _copy_kernel(src, offs, dst, n, BLOCK: tl.constexpr):
    # program (k, block): bytes [block * BLOCK, +BLOCK) of expert k's first n bytes
    k = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    o = tl.load(offs + k)
    p = (src + o).to(tl.pointer_type(tl.int32))
    v = tl.load(p + i, mask=i < n // 4)
    tl.store(dst.to(tl.pointer_type(tl.int32)) + k * (n // 4) + i, v, mask=i < n // 4)


class Pool:
    """``n`` experts in VRAM and ``n`` in page-locked RAM, each a slot of ``slot`` random bytes."""

    def __init__(self, n: int, slot: int, dev: torch.device) -> None:
        self.n, self.slot = n, slot
        self.anchor = torch.empty(256, dtype=torch.uint8, device=dev)
        g = torch.Generator().manual_seed(1)
        host = torch.randint(0, 256, (n * slot + 256,), dtype=torch.uint8, generator=g)
        self.ram = host.pin_memory()  # mapped into the device's address space (UVA)
        self.vram = self.ram.to(dev)
        a = self.anchor.data_ptr()
        self.ram_off = [align(self.ram.data_ptr(), RUN_ALIGN) - a + i * slot for i in range(n)]
        self.vram_off = [align(self.vram.data_ptr(), RUN_ALIGN) - a + i * slot for i in range(n)]


def _time(fn, dev: torch.device, reps: int) -> float:
    """Median seconds of ``fn`` replayed from a CUDA graph."""
    s = torch.cuda.Stream(dev)
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.synchronize(dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize(dev)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=2048, help="model width (rows of down)")
    ap.add_argument("--f", type=int, default=768, help="expert width (rows of gate and up)")
    types = sorted(t.name for t in REPACKED_TYPES)
    ap.add_argument("--gate", default="Q4_K", choices=types, help="type of gate and up")
    ap.add_argument("--down", default="Q6_K", choices=types, help="type of down")
    ap.add_argument("--k", type=int, default=8, help="experts chosen per token")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--pool", type=int, default=96, help="experts in each place (> L2)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument(
        "--ram-counts", default="",
        help="also time a step with this many of each layer's k experts in RAM (the rest in VRAM),"
        " e.g. 1,2,4: how the link's rate holds up with few experts a layer",
    )  # fmt: skip
    a = ap.parse_args(argv)
    try:
        counts = [int(v) for v in a.ram_counts.split(",")] if a.ram_counts else []
    except ValueError:
        ap.error(f"--ram-counts {a.ram_counts!r}: give whole numbers separated by commas")
    if any(not 0 < c <= a.k for c in counts):
        ap.error(f"--ram-counts {a.ram_counts!r}: each must be between 1 and k={a.k}")
    if not torch.cuda.is_available():
        print("moe_sweep: no CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda:0")
    tg, td = Q[a.gate], Q[a.down]
    gate, down = repacked_layout(tg, (a.f, a.d)), repacked_layout(td, (a.d, a.f))
    up_off = align(gate.nbytes, RUN_ALIGN)
    down_off = up_off + align(gate.nbytes, RUN_ALIGN)
    slot = align(down_off + down.nbytes, RUN_ALIGN)
    expert_bytes = 2 * gate.nbytes + down.nbytes
    pool = Pool(a.pool, slot, dev)
    gen = torch.Generator().manual_seed(2)

    def tables(ram_share: int) -> list[torch.Tensor]:
        out = []
        for _ in range(a.layers):
            r = torch.randperm(a.pool, generator=gen)[: a.k].tolist()
            v = torch.randperm(a.pool, generator=gen)[: a.k].tolist()
            offs = [
                pool.ram_off[r[i]] if i < ram_share else pool.vram_off[v[i]] for i in range(a.k)
            ]
            out.append(torch.tensor(offs, dtype=torch.int64, device=dev))
        return out

    h = torch.randn(a.d, device=dev)
    x = torch.zeros(a.d, device=dev)
    act = torch.zeros(a.k, a.f, device=dev)
    wts = torch.softmax(torch.randn(a.k, device=dev), 0)
    rows: list[tuple[str, float, float]] = []

    def record(name: str, seconds: float, ram_bytes: int) -> None:
        per_layer = seconds / a.layers * 1e6
        rate = ram_bytes / seconds / 1e9 if ram_bytes else float("nan")
        rows.append((name, rate, per_layer))
        print(f"{name:<44} {rate:7.1f} GB/s  {per_layer:8.1f} us/layer", flush=True)

    # the ceilings: the copy engine, and a copy kernel per layer, over the same RAM bytes
    eo_ram = tables(a.k)
    nbytes = a.layers * a.k * expert_bytes
    dst = torch.empty(a.k * slot, dtype=torch.uint8, device=dev)
    src_views = [pool.ram[i * slot : i * slot + expert_bytes] for i in range(a.k)]

    def ce() -> None:
        for _ in range(a.layers):
            for i, v in enumerate(src_views):
                dst[i * slot : i * slot + expert_bytes].copy_(v, non_blocking=True)

    record("copy engine (8 experts a layer)", _time(ce, dev, a.reps), nbytes)
    n4 = expert_bytes // 4 * 4
    for block in (1024, 4096):

        def sm(block=block) -> None:
            for t in eo_ram:
                _copy_kernel[(a.k, triton.cdiv(n4 // 4, block))](
                    pool.anchor, t, dst, n4, BLOCK=block, num_warps=4
                )

        record(f"copy kernel, blocks of {block * 4} B", _time(sm, dev, a.reps), nbytes)

    def step(ts, bn_gu=moe.BN_GATE_UP, w_gu=None, bn_dn=moe.BN_DOWN, w_dn=None, parts="gd"):
        def run() -> None:
            for t in ts:
                if "g" in parts:
                    moe.gate_up(act, h, t, pool.anchor, gate, gate, up_off, bn_gu, w_gu)
                if "d" in parts:
                    moe.down(x, act, t, wts, pool.anchor, down, down_off, bn_dn, w_dn)

        return run

    gu_bytes = a.layers * a.k * 2 * gate.nbytes
    dn_bytes = a.layers * a.k * down.nbytes
    # the RAM rows' rates are of the bytes read over PCIe, the VRAM row's of those read from VRAM
    for share, label in ((a.k, "all in RAM"), (a.k // 2, "half in RAM"), (0, "all in VRAM")):
        t = _time(step(tables(share)), dev, a.reps)
        record(f"gate_up + down, {label} (defaults)", t, nbytes * share // a.k if share else nbytes)
    for c in counts:
        t = _time(step(tables(c)), dev, a.reps)
        record(f"gate_up + down, {c} of {a.k} in RAM", t, int(nbytes * c / a.k))
    for bn in (2, 4, 8, 16):
        for w in (None, 4, 8):
            t = _time(step(eo_ram, bn_gu=bn, w_gu=w, parts="g"), dev, a.reps)
            record(f"gate_up alone, RAM, bn {bn} warps {w or 'default'}", t, gu_bytes)
    for bn in (2, 4, 8, 16):
        for w in (None, 4):
            t = _time(step(eo_ram, bn_dn=bn, w_dn=w, parts="d"), dev, a.reps)
            record(f"down alone, RAM, bn {bn} warps {w or 'default'}", t, dn_bytes)
    best = max((r for r in rows if r[0].startswith("gate_up alone")), key=lambda r: r[1])
    bestd = max((r for r in rows if r[0].startswith("down alone")), key=lambda r: r[1])
    print(f"best gate_up: {best[0]}; best down: {bestd[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
