"""What the prompt-chunk GEMM (``kernels.gemm``) asks of a GPU, per weight type, without a GPU.

A developer's check, not a bench row: it compiles ``_gemm_kernel`` ahead of time for a CUDA
target (Triton's own ptxas, no driver needed) in the three forms a chunk launches — a dense
product, the experts' gate and up (two matrices, SwiGLU) and the experts' down — with the tiles
the GPU path uses (``gemm.GPU_DENSE_TILE``, ``gemm.GPU_MOE_TILE``, through ``gemm._staged``) or
the one ``--tile`` names, and reads the binary the way the GPU would run it:

* **the runtime's specialisation.** Triton's JIT marks every pointer argument, and every integer
  one that is a multiple of 16, as 16-byte divisible (``tt.divisibility``), and passes integers
  below 2^31 as ``i32``. At run time that is every argument but ``M`` and ``n_valid`` (the
  chunk's rows and its grouped assignments); compiled without those marks, the loads become
  single bytes without cp.async pipelining, and the shared memory, registers and instructions
  below would describe a kernel the GPU never runs.
* **shared memory** a block (the compiler's metadata), **registers** a thread and the **stack**
  (bytes a thread, spilled registers) from ``cuobjdump -res-usage``, and the **main loop** from
  ``nvdisasm``'s SASS: the widest backward branch, its body's static instruction count (every
  instruction once, whatever a branch inside it skips), and whether its products are ``HGMMA``
  (Hopper's warpgroup MMA) or ``HMMA`` (per-warp ``mma.sync``). Both tools sit beside ptxas in
  Triton's CUDA backend (or where ``TRITON_CUOBJDUMP_PATH``/``TRITON_NVDISASM_PATH`` point);
  without them those columns are empty and a line says so.
* **warp instructions per multiply-add**: one iteration of the loop issues ``loop x warps`` warp
  instructions and does ``BM x BN x S*32 x matrices`` multiply-adds (matrices: 2 for gate_up,
  gate and up; 1 otherwise), so ``loop x warps / (BM x BN x S x 32 x matrices)`` — what a type's
  dequantisation costs in issue slots per tensor-core MAC.
* **the issue bound** (sm_90 only): an H200 issues at most one warp instruction per scheduler
  per cycle, 132 SMs x 4 schedulers x ~1.98 GHz ~ 1.05e12 a second; a loop that needs ``ipm``
  of them per MAC therefore does at most ``1.05e12 / ipm`` MACs, ``2 x 1.05e12 / ipm`` FLOP, a
  second. A ceiling from counting, not a measurement: it ignores memory stalls and dependencies,
  and the tensor cores' own ceiling (~4.9e14 f16 MAC/s, ~990 TFLOPS) caps it too.

A kernel whose shared memory exceeds the device's per-block limit does not launch (the engine
then reads prompts on the reference path); one that needs most of an SM's runs one block per SM;
a stack means registers spilled to local memory. ``tests/model/test_kernel_resources.py`` holds
every type's forms under the limits below::

    python -m strata.bench.kernel_resources [--arch 90] [--forms dense,gate_up] [--types MXFP4]
        [--tile 64,128,4,4,3] [--jobs 2] [--ops] [--json]

Run it with ``TRITON_INTERPRET`` unset: the interpreter has nothing to compile.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from strata.engine.kernels.gemm import Tile

log = logging.getLogger(__name__)

# per-block shared memory of sm_90 (H100/H200: 227 KiB) and of sm_89/sm_86 (99 KiB), the
# consumer cards Strata is for
SMEM_LIMIT = {90: 232448, 89: 101376, 86: 101376, 80: 166912}
# Every type's tiles stay under this much, so two blocks share an SM: an sm_90 SM has 228 KiB,
# and each resident block also holds 1 KiB the system reserves, so two of up to 100 KiB fit. (It
# was 64 KiB while this check compiled without the runtime's alignment, whose byte-wide loads
# staged little; compiled as the GPU runs them, 16 bytes wide and pipelined, the engine's dense
# tiles need up to ~90 KiB for the K-quants.)
QUANT_SMEM_BUDGET = 100 * 1024
# warp instructions an SM's schedulers issue a second, all SMs together: the H200's 132 SMs x 4
# schedulers x ~1.98 GHz (one instruction per scheduler per cycle); other targets: no bound
ISSUE_RATE = {90: 1.05e12}

# the kernel's pointer arguments and their element types (the rest are integers)
_POINTERS = {
    "a": "*fp16", "y": "*fp32", "rows": "*i32", "blocks": "*i32", "table": "*i64",
    "wts": "*fp32", "w": "*u8", "bias": "*fp32", "bias_v": "*fp32",
}  # fmt: skip
# the integer arguments that are not a multiple of 16 at run time (a chunk's rows, its grouped
# assignments); every other argument is, and the JIT marks it so
_UNALIGNED = ("M", "n_valid")
# how many of the loop's most frequent instructions a row keeps
_TOP_OPS = 8


@dataclass(frozen=True)
class Usage:
    qtype: str
    form: str  # dense, gate_up or down
    k: int
    bm: int
    bn: int
    s: int
    warps: int
    stages: int
    shared: int  # bytes of shared memory a block
    regs: int | None = None  # registers a thread (None: no cuobjdump)
    stack: int | None = None  # bytes of stack a thread: spilled registers (None: no cuobjdump)
    loop: int | None = None  # instructions in the main loop's body (None: no nvdisasm, no loop)
    mma: str | None = None  # HGMMA, HMMA, or None: no tensor-core product in the loop
    instr_per_mac: float | None = None  # warp instructions per multiply-add
    bound_tflops: float | None = None  # the issue-rate ceiling (sm_90 only)
    loop_ops: dict[str, int] = field(default_factory=dict)  # the loop's most frequent opcodes

    @property
    def tile(self) -> str:
        return f"{self.bm}x{self.bn}x{self.s},w{self.warps}"


@dataclass(frozen=True)
class Sass:
    """What the binary says beyond shared memory (every field None where its tool is missing)."""

    regs: int | None
    stack: int | None
    loop: int | None
    mma: str | None
    loop_ops: dict[str, int]


def _k_for(qtype: int) -> int:
    """A row length the type can hold: gpt-oss's 2880 for the types of 32-element blocks (and
    the floats), 2048 for those of 256."""
    import gguf

    from strata.engine.quant.format import Q

    return 2880 if gguf.GGML_QUANT_SIZES[Q(qtype)][0] <= 32 else 2048


def parse_tile(text: str) -> Tile:
    """``BM,BN,S,WARPS,STAGES`` -> a ``gemm.Tile``; a clear ValueError for anything else."""
    from strata.engine.kernels.gemm import Tile

    parts = [v.strip() for v in text.split(",")]
    names = ("BM", "BN", "S", "WARPS", "STAGES")
    if len(parts) != len(names):
        raise ValueError(f"--tile {text!r}: give five integers BM,BN,S,WARPS,STAGES")
    values = {}
    for name, part in zip(names, parts, strict=True):
        try:
            values[name] = int(part)
        except ValueError:
            raise ValueError(f"--tile {text!r}: {name} {part!r} is not an integer") from None
    for name in ("BM", "BN", "S", "WARPS"):
        v = values[name]
        if v < 1 or v & (v - 1):
            raise ValueError(f"--tile {text!r}: {name} {v} is not a power of two")
    for name in ("BM", "BN"):
        if values[name] < 16:  # a tensor-core product's smallest side
            raise ValueError(f"--tile {text!r}: {name} {values[name]} is under 16")
    if values["WARPS"] > 32:  # 1024 threads, a block's most
        raise ValueError(f"--tile {text!r}: WARPS {values['WARPS']} is over 32")
    if values["STAGES"] < 1:
        raise ValueError(f"--tile {text!r}: STAGES {values['STAGES']} is under 1")
    return Tile(*(values[n] for n in names))


def _compile(qtype: int, form: str, arch: int, tile: Tile):  # -> triton CompiledKernel
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from strata.engine.kernels import gemm

    experts = form != "dense"
    const = dict(
        K=_k_for(qtype), QT=qtype, QV=qtype, TOPK=4 if form == "gate_up" else 1,
        EXPERTS=experts, GATHER=form == "gate_up", SCATTER=form == "down",
        GLU=form == "gate_up", WEIGHTED=form == "down", ADD=False, BM=tile.bm, BN=tile.bn,
        S=tile.s, BIAS=False, OAI=False, ALPHA=1.0, LIMIT=0.0,
    )  # fmt: skip
    fn = gemm._gemm_kernel
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: "constexpr" if n in const else _POINTERS.get(n, "i32") for n in names}
    aligned = [i for i, n in enumerate(names) if n not in const and n not in _UNALIGNED]
    src = ASTSource(
        fn,
        signature=sig,
        constexprs={(names.index(n),): v for n, v in const.items()},
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
    )
    return triton.compile(
        src,
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": tile.warps, "num_stages": tile.stages},
    )


def _tool(name: str) -> str | None:
    """The path of one of Triton's CUDA tools, or None where there is none."""
    from triton import knobs

    try:
        return getattr(knobs.nvidia, name).path
    except RuntimeError:  # Triton's answer when neither its copy nor the named path runs
        return None


def tools_missing() -> list[str]:
    """The tools this check reads the binary with that cannot be found (empty: all here)."""
    return [n for n in ("cuobjdump", "nvdisasm") if _tool(n) is None]


def _run_tool(path: str, *args: str) -> str:
    run = subprocess.run([path, *args], capture_output=True, text=True)
    if run.returncode != 0:
        cmd = " ".join([path, *args])
        raise RuntimeError(f"{cmd} failed ({run.returncode}): {run.stderr[-500:]}")
    return run.stdout


_RES = re.compile(r"REG:(\d+)\s+STACK:(\d+)")
_LABEL = re.compile(r"^(\.L\w+):")
# "/*0090*/   @!P0 LDG.E R2, desc[UR10][R2.64] ;": address, optional predicate, opcode, operands
_INSTR = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?)\s*;")
_TARGET = re.compile(r"`\((\.L\w+)\)")


def resource_usage(text: str) -> tuple[int, int]:
    """``cuobjdump -res-usage`` of a one-kernel binary -> (registers, stack bytes) a thread."""
    m = _RES.search(text)
    if m is None:
        raise RuntimeError(f"no REG:/STACK: in cuobjdump's resource usage: {text[-500:]!r}")
    return int(m.group(1)), int(m.group(2))


def main_loop(sass: str) -> tuple[int | None, str | None, dict[str, int]]:
    """``nvdisasm -c`` of a kernel -> its main loop (the widest backward branch's span): the
    body's instruction count, its tensor-core product (HGMMA, HMMA or None), and its most
    frequent opcodes (names before the first dot). (None, None, {}) where there is no loop."""
    labels: dict[str, int] = {}
    pending: list[str] = []
    ops: list[tuple[int, str, str]] = []  # (address, opcode, operands)
    for line in sass.splitlines():
        if m := _LABEL.match(line.strip()):
            pending.append(m.group(1))
        elif m := _INSTR.match(line):
            addr = int(m.group(1), 16)
            labels.update((name, addr) for name in pending)
            pending = []
            ops.append((addr, m.group(2), m.group(3)))
    spans = []
    for addr, op, rest in ops:
        if op.split(".")[0] == "BRA" and (t := _TARGET.search(rest)) and t.group(1) in labels:
            if labels[t.group(1)] < addr:
                spans.append((labels[t.group(1)], addr))
    if not spans:
        return None, None, {}
    lo, hi = max(spans, key=lambda s: s[1] - s[0])
    counts = collections.Counter(op.split(".")[0] for a, op, _ in ops if lo <= a <= hi)
    mma = "HGMMA" if counts["HGMMA"] else "HMMA" if counts["HMMA"] else None
    return sum(counts.values()), mma, dict(counts.most_common(_TOP_OPS))


def read_binary(cubin: bytes) -> Sass:
    """Registers, stack and the main loop of a compiled kernel, from Triton's CUDA tools."""
    cuobjdump, nvdisasm = _tool("cuobjdump"), _tool("nvdisasm")
    regs = stack = loop = mma = None
    loop_ops: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "kernel.cubin"
        path.write_bytes(cubin)
        if cuobjdump is not None:
            regs, stack = resource_usage(_run_tool(cuobjdump, "-res-usage", str(path)))
        if nvdisasm is not None:
            loop, mma, loop_ops = main_loop(_run_tool(nvdisasm, "-c", str(path)))
    return Sass(regs, stack, loop, mma, loop_ops)


def usage(qtype: int, form: str, arch: int = 90, tile: Tile | None = None) -> Usage:
    """Compile one form of the GEMM for ``qtype`` on ``sm_<arch>`` (with ``tile``, or the
    engine's tile for that form) and read its resources."""
    from strata.engine.kernels import gemm
    from strata.engine.quant.format import Q

    if tile is None:
        tile = gemm._staged(gemm.GPU_DENSE_TILE if form == "dense" else gemm.GPU_MOE_TILE, qtype)
    compiled = _compile(qtype, form, arch, tile)
    sass = read_binary(compiled.asm["cubin"])
    ipm = bound = None
    if sass.loop is not None:
        macs = tile.bm * tile.bn * tile.s * 32 * (2 if form == "gate_up" else 1)
        ipm = sass.loop * tile.warps / macs
        if arch in ISSUE_RATE:
            bound = 2 * ISSUE_RATE[arch] / ipm / 1e12
    return Usage(
        Q(qtype).name, form, _k_for(qtype), tile.bm, tile.bn, tile.s, tile.warps, tile.stages,
        int(compiled.metadata.shared), sass.regs, sass.stack, sass.loop, sass.mma, ipm, bound,
        sass.loop_ops,
    )  # fmt: skip


def _usage_job(job: tuple[int, str, int, Tile | None]) -> Usage:
    return usage(*job)


FORMS = ("dense", "gate_up", "down")


def all_usage(arch: int = 90, forms: tuple[str, ...] = FORMS,
              types: tuple[str, ...] | None = None, tile: Tile | None = None,
              jobs: int = 1) -> list[Usage]:  # fmt: skip
    """``usage`` of each form for each type the kernels read (``types``: by name; None: all),
    compiled in ``jobs`` processes."""
    from strata.engine.quant import REPACKED_TYPES

    known = {t.name: t for t in REPACKED_TYPES}
    names = sorted(known, key=lambda n: int(known[n])) if types is None else types
    for n in names:
        if n not in known:
            raise ValueError(f"{n!r} is not a weight type the kernels read "
                             f"({', '.join(sorted(known))})")  # fmt: skip
    for f in forms:
        if f not in FORMS:
            raise ValueError(f"{f!r} is not a form of the GEMM ({', '.join(FORMS)})")
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    work = [(int(known[n]), form, arch, tile) for n in names for form in forms]
    if jobs == 1 or len(work) == 1:
        return [_usage_job(w) for w in work]
    # fresh interpreters (spawn): torch's and Triton's threads do not survive a fork
    with ProcessPoolExecutor(min(jobs, len(work)), mp_context=get_context("spawn")) as pool:
        return list(pool.map(_usage_job, work))


def _names(text: str | None) -> tuple[str, ...] | None:
    return None if text is None else tuple(v.strip() for v in text.split(",") if v.strip())


def _cell(v: float | int | str | None, spec: str) -> str:
    """``v`` formatted, or a dash as wide (an empty field: no tool, no loop)."""
    return format("-", spec.split(".")[0]) if v is None else format(v, spec)


def _table(rows: list[Usage], arch: int, ops: bool) -> None:
    limit = SMEM_LIMIT[arch]
    print(f"sm_{arch}: {limit // 1024} KiB of shared memory a block; shared and stack in bytes, "
          f"loop in instructions, ipm: warp instructions per multiply-add")  # fmt: skip
    if arch in ISSUE_RATE:
        print(f"bound: 2 x {ISSUE_RATE[arch]:.3g} warp instructions/s / ipm, in TFLOPS "
              f"(the issue rate's ceiling, not a measurement)")  # fmt: skip
    missing = tools_missing()
    if missing:
        print(f"registers, stack and the loop need {' and '.join(missing)}, not found: shown as -")
    print(f"{'type':<8} {'form':<8} {'K':>5} {'tile':<12} {'stages':>6} {'shared':>7} "
          f"{'regs':>4} {'stack':>5} {'loop':>5} {'mma':<5} {'ipm':>7} {'bound':>6}")  # fmt: skip
    for r in rows:
        flags = ["over the limit"] if r.shared > limit else []
        flags += ["spills"] if r.stack else []
        line = (f"{r.qtype:<8} {r.form:<8} {r.k:>5} {r.tile:<12} {r.stages:>6} {r.shared:>7} "
                f"{_cell(r.regs, '>4')} {_cell(r.stack, '>5')} {_cell(r.loop, '>5')} "
                f"{_cell(r.mma, '<5')} {_cell(r.instr_per_mac, '>7.4f')} "
                f"{_cell(r.bound_tflops, '>6.0f')}")  # fmt: skip
        print(line + ("  " + ", ".join(flags) if flags else ""))
        if ops and r.loop_ops:
            print("    " + " ".join(f"{k} {v}" for k, v in r.loop_ops.items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m strata.bench.kernel_resources",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--arch", type=int, default=90, choices=sorted(SMEM_LIMIT))
    p.add_argument("--forms", default=",".join(FORMS), help="of dense, gate_up, down")
    p.add_argument("--types", help="weight types by name, comma-separated (default: all)")
    p.add_argument("--tile", help="BM,BN,S,WARPS,STAGES for every form and type, as given "
                   "(default: the engine's tiles)")  # fmt: skip
    p.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    p.add_argument("--ops", action="store_true", help="the loop's most frequent instructions")
    p.add_argument("--json", action="store_true", help="one JSON list instead of the table")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("unset TRITON_INTERPRET: the interpreter compiles nothing")
    if args.jobs < 1:
        p.error(f"--jobs must be at least 1, got {args.jobs}")
    try:
        tile = None if args.tile is None else parse_tile(args.tile)
        rows = all_usage(args.arch, _names(args.forms) or FORMS, _names(args.types), tile,
                         args.jobs)  # fmt: skip
    except ValueError as e:
        p.error(str(e))
    missing = tools_missing()
    if missing:
        log.warning("%s not found: registers, stack and the loop are left empty", missing)
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))
        return 0
    _table(rows, args.arch, args.ops)
    return 0


if __name__ == "__main__":
    sys.exit(main())
