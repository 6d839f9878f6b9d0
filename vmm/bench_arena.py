"""How long the CUDA arena takes to map (grow) and unmap (shrink) 1, 4 and 16 GiB per chunk size.

For each chunk size one arena reserves the largest size; each (size, chunk) pair is timed over a
few repetitions and the median is reported. Three phases are timed apart:

* ``map``: ``cuMemCreate`` + ``cuMemMap`` + ``cuMemSetAccess`` for every chunk, zeroing excluded;
* ``zero``: the ``cuMemsetD8Async`` + stream synchronise that ``grow`` adds for the new range
  (what ``grow`` costs in all is ``map + zero``);
* ``unmap``: ``shrink`` itself: ``cuCtxSynchronize`` once, then ``cuMemUnmap`` + ``cuMemRelease``
  for every chunk.

Usage: ``python -m strata.vmm.bench_arena [--sizes-gib 1,4,16] [--chunks-mib 2,8,32,64]
[--reps 5] [--device 0] [--json PATH]``. It prints a table (stdout) and, with ``--json``, writes
the samples and medians.

Measured on an NVIDIA H200 (driver 580.159.04, torch 2.11.0+cu130, cuda-bindings 13.3.1),
medians of 5, milliseconds; grow costs map + zero:

| size | chunk 2 MiB | 8 MiB | 32 MiB | 64 MiB |  (map / unmap; zero)
| 1 GiB | 27.2 / 21.8 | 6.7 / 5.9 | 1.8 / 2.0 | 1.0 / 1.4 |  zero 0.3-0.7
| 4 GiB | 112.2 / 87.7 | 28.0 / 25.3 | 7.2 / 8.4 | 4.1 / 5.4 |  zero 1.1-2.1
| 16 GiB | 442.5 / 358.0 | 116.4 / 100.5 | 30.4 / 35.6 | 17.3 / 22.5 |  zero 4.2-6.5

The cost is per chunk (about 55 us per map, 45-90 us per unmap), so the default chunk is 32 MiB
(``arena.DEFAULT_CHUNK_BYTES``): 14x faster than 2 MiB, while 64 MiB would gain under 2x more and
halve the precision with which the cache follows free VRAM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from strata.vmm.arena import MiB
from strata.vmm.cuda_arena import CudaArena

GiB = 1 << 30


def measure(
    sizes_gib: list[int], chunks_mib: list[int], reps: int, device: int = 0
) -> list[dict[str, Any]]:
    """One row per (chunk size, size): the medians and the raw samples, in milliseconds."""
    rows = []
    for chunk_mib in chunks_mib:
        chunk = chunk_mib * MiB
        with CudaArena(max(sizes_gib) * GiB, chunk, device=device) as arena:
            arena.shrink(arena.grow(chunk))  # warm the driver's paths before timing
            for size_gib in sizes_gib:
                size = size_gib * GiB
                samples: dict[str, list[float]] = {"map": [], "zero": [], "unmap": []}
                for _ in range(reps):
                    with arena._lock, arena._current():
                        t0 = time.perf_counter()
                        arena._map_chunks(size // chunk)
                        t1 = time.perf_counter()
                        if arena.mapped_bytes != size:
                            raise RuntimeError(
                                f"only {arena.mapped_bytes} of {size} bytes could be mapped"
                            )
                        arena._zero(0, size)
                        t2 = time.perf_counter()
                    arena.shrink(size)
                    t3 = time.perf_counter()
                    samples["map"].append((t1 - t0) * 1e3)
                    samples["zero"].append((t2 - t1) * 1e3)
                    samples["unmap"].append((t3 - t2) * 1e3)
                row: dict[str, Any] = {
                    "size_gib": size_gib,
                    "chunk_mib": chunk_mib,
                    "chunks": size // chunk,
                }
                for phase, values in samples.items():
                    row[f"{phase}_ms"] = statistics.median(values)
                    row[f"{phase}_ms_samples"] = values
                rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| size GiB | chunk MiB | chunks | map ms | zero ms | unmap ms | map+zero ms |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in sorted(rows, key=lambda r: (r["size_gib"], r["chunk_mib"])):
        lines.append(
            f"| {r['size_gib']} | {r['chunk_mib']} | {r['chunks']} | {r['map_ms']:.1f} | "
            f"{r['zero_ms']:.1f} | {r['unmap_ms']:.1f} | {r['map_ms'] + r['zero_ms']:.1f} |"
        )
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of ints"
        ) from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must list positive ints")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="strata bench arena", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-gib", type=_int_list, default=[1, 4, 16])
    parser.add_argument("--chunks-mib", type=_int_list, default=[2, 8, 32, 64])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.reps <= 0:
        parser.error(f"--reps must be positive, got {args.reps}")

    import torch

    rows = measure(args.sizes_gib, args.chunks_mib, args.reps, args.device)
    props = torch.cuda.get_device_properties(args.device)
    meta = {
        "device": props.name,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "reps": args.reps,
        "timer": "time.perf_counter, medians of reps",
        "zero_included_in_map": False,
    }
    sys.stdout.write(f"{props.name}, torch {torch.__version__}, median of {args.reps}\n")
    sys.stdout.write(format_table(rows) + "\n")
    if args.json is not None:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
