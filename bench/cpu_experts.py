"""The CPU expert kernels' throughput (``engine/kernels/cpu_experts.c``): GB/s of weight bytes
for jobs of k experts on a pool of each size, cycling through more slots than the caches hold.

    python -m strata.bench.cpu_experts --types Q4_K,Q6_K --threads 1,4,15

A developer's tool beside ``strata bench``: its numbers go into the closing notes as measured.
"""

from __future__ import annotations

import argparse

import gguf
import torch

from strata.engine.kernels.cpu_experts import CpuExperts
from strata.engine.quant.expert_layout import RUN_ALIGN, KernelSlotLayout, align
from strata.engine.quant.repack import FIXED_PLANES, PLANES, repacked_layout

Q = gguf.GGMLQuantizationType


def random_repacked(qtype: Q, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """A repacked matrix of random bytes with finite, small scales: [nbytes] uint8 (for timing;
    the tests build theirs from GGUF blocks instead)."""
    lay = repacked_layout(qtype, (rows, cols))
    data = torch.randint(0, 256, (lay.nbytes,), dtype=torch.uint8, generator=gen)
    floats = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
    for p in PLANES[qtype]:
        plane = lay.plane(data, p.name)
        if p.fixed_bytes:
            plane.copy_(FIXED_PLANES[qtype, p.name])
        elif p.name in ("d", "dm", "dd", "m"):  # the f16 scales and mins
            scales = (torch.rand(plane.numel() // 2, generator=gen) * 0.01).half()
            plane.copy_(scales.view(torch.uint8).view(plane.shape))
        elif p.name == "e":  # MXFP4's e8m0 scales near 1, as trained weights have them (random
            # bytes made half the products subnormal, and those took the CPU's slow path)
            plane.copy_(torch.randint(118, 131, plane.shape, dtype=torch.uint8, generator=gen))
        elif qtype in floats:
            w = torch.randn(plane.numel() // floats[qtype].itemsize, generator=gen)
            plane.copy_(w.to(floats[qtype]).view(torch.uint8).view(plane.shape))
    return data


def bench(qtype: Q, threads: int, D: int, F: int, k: int, experts: int, reps: int) -> float:
    """GB/s of weight bytes: jobs of ``k`` experts (gate, up, down all ``qtype``), each job's
    experts the next ones of ``experts`` distinct slots (more than the caches hold), timed by
    the pool from each job's start to its end (the best of three runs of ``reps`` jobs)."""
    gen = torch.Generator().manual_seed(0)
    gate, down = repacked_layout(qtype, (F, D)), repacked_layout(qtype, (D, F))
    up_off = align(gate.nbytes, RUN_ALIGN)
    layout = KernelSlotLayout(gate, gate, down, up_off, up_off + align(gate.nbytes, RUN_ALIGN))
    slot = align(layout.nbytes, RUN_ALIGN)
    distinct = 4  # random slots, copied to fill the rest
    one = torch.zeros(distinct * slot, dtype=torch.uint8)
    for e in range(distinct):
        for off, lay in zip(layout.offsets, layout.layouts, strict=True):
            at = e * slot + off
            one[at : at + lay.nbytes] = random_repacked(qtype, lay.rows, lay.cols, gen)
    arena = one.repeat(-(-experts // distinct))
    pool = CpuExperts(threads)
    job = pool.job(layout, k, pin=False)
    job.base = arena.data_ptr()
    job.n[0] = k
    job.wts.fill_(1.0 / k)
    job.h.copy_(torch.randn(D, generator=gen))
    offs = [torch.arange(f, f + k) * slot for f in range(experts - k + 1)]
    best = float("inf")
    for _ in range(3):
        before = pool.stats()
        for r in range(reps):
            job.offs.copy_(offs[(r * k) % len(offs)])
            job.run()
        after = pool.stats()
        # the jobs' own time, from their start to their end in C: not the Python around them
        best = min(best, (after.busy_s - before.busy_s) / max(1, after.jobs - before.jobs))
    pool.close()
    return k * (2 * gate.nbytes + down.nbytes) / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=bench.__doc__)
    ap.add_argument("--types", default="Q4_K,Q6_K", help="GGML type names, comma-separated")
    ap.add_argument("--threads", default="1,2", help="pool sizes, comma-separated")
    ap.add_argument("--D", type=int, default=2048, help="model dimension (gate/up columns)")
    ap.add_argument("--F", type=int, default=768, help="expert FFN dimension (gate/up rows)")
    ap.add_argument("--k", type=int, default=8, help="experts per job")
    ap.add_argument("--experts", type=int, default=128, help="distinct slots the jobs cycle")
    ap.add_argument("--reps", type=int, default=40, help="jobs per timing")
    args = ap.parse_args()
    for name in args.types.split(","):
        for t in (int(v) for v in args.threads.split(",")):
            gbs = bench(Q[name], t, args.D, args.F, args.k, args.experts, args.reps)
            print(f"{name} {args.F}x{args.D} threads={t}: {gbs:.2f} GB/s")


if __name__ == "__main__":
    main()
