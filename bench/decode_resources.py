"""What the decode kernels ask of a GPU, per weight type, without a GPU.

A developer's check, not a bench row: ``kernel_resources`` does it for the prompt-chunk GEMM,
this for the launches of one decode token. It calls the engine's own launch functions
(``moe.gate_up``, ``moe.down``, ``matvec``) on CPU tensors of a model's shapes with the cuts the
GPU path uses (``gpu.decode.TUNED``, with ``STRATA_DECODE_TUNE`` as the engine reads it: a
cut is checked here before a GPU lease), catches each launch before it would run (Triton's
``JITFunction.run``), and compiles it ahead of time for a CUDA target with the specialisation
the runtime's JIT gives it: pointers and integers that are multiples of 16 marked 16-byte
divisible (the slots and planes are 256-byte aligned), integers equal to 1 made constants. The
binary is read with Triton's cuobjdump and nvdisasm (``kernel_resources.read_binary``):

* **registers** a thread and the **stack** (bytes a thread: spilled registers, local-memory
  loads and stores in the inner loop);
* **instructions**: the kernel's static SASS instruction count (every instruction once), and
  **barriers** (``BAR.SYNC``: every reduction or layout change that crosses warps has them).

The forms, on Qwen3-30B-A3B's shapes (``--shape D,F,Q``: the model's width, an expert's rows,
attention q's rows): ``gate_up`` (8 chosen experts' gate and up, F x D each), ``down`` (their
down, D x F), ``qkv`` (attention q's matrix, Q x D, the RMSNorm folded in), ``o`` (the
output projection, D x Q, the residual added) and, asked for by name, ``router`` (128 experts'
router, 128 x D, the norm folded in, with the routing of the top 8 in its last program: its
barriers are mostly the routing's; ``--types F32``, as the files keep routers)::

    python -m strata.bench.decode_resources [--types IQ3_S,Q4_K] [--forms gate_up,down,router]
        [--arch 90] [--shape 2048,768,4096] [--json]

Run it with ``TRITON_INTERPRET`` unset: the interpreter has nothing to compile.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

FORMS = ("gate_up", "down", "qkv", "o", "router")
MATRIX_FORMS = FORMS[:4]  # the default: the forms of the weight types (a router is F32)
QWEN3_30B = (2048, 768, 4096)  # the model's width, an expert's rows, attention q's rows
TOP_K = 8
N_EXPERT = 128  # the router's rows

_INSTR = re.compile(r"^\s*/\*[0-9a-f]+\*/\s", re.M)


@dataclass(frozen=True)
class DecodeUsage:
    qtype: str
    form: str  # gate_up, down or qkv
    shape: str  # the matrix a program reads rows of: rows x columns
    warps: int
    regs: int | None  # registers a thread (None: no cuobjdump)
    stack: int | None  # bytes of stack a thread (None: no cuobjdump)
    instructions: int | None  # SASS instructions, each once (None: no nvdisasm)
    barriers: int | None  # BAR.SYNC instructions (None: no nvdisasm)


@contextmanager
def _caught() -> Iterator[list[tuple[object, tuple, dict]]]:
    """Launches of Triton kernels inside the block are kept, not run: (kernel, args, kwargs)."""
    from triton.runtime.jit import JITFunction

    launches: list[tuple[object, tuple, dict]] = []
    real = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    JITFunction.run = run  # type: ignore[method-assign]
    try:
        yield launches
    finally:
        JITFunction.run = real  # type: ignore[method-assign]


_OPTIONS = ("num_warps", "num_stages", "maxnreg", "enable_fp_fusion")


def compile_launch(fn, args: tuple, kwargs: dict, arch: int = 90):  # -> CompiledKernel
    """One caught launch compiled for ``sm_<arch>`` as the runtime's JIT would specialise it."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in _OPTIONS}
    values = dict(zip([p.name for p in fn.params], args, strict=False))
    values.update(kwargs)
    sig: dict[str, str] = {}
    const: dict[tuple[int, ...], object] = {}
    attrs: dict[tuple[int, ...], list] = {}
    for i, p in enumerate(fn.params):
        v = values[p.name] if p.name in values else p.default
        if v is inspect.Parameter.empty:
            raise ValueError(f"{fn.__name__}: no value for {p.name}")
        if p.is_constexpr or v is None or (type(v) is int and v == 1):
            sig[p.name] = "constexpr"
            const[(i,)] = v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + _dtype_name(v.dtype)
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[p.name] = "u1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: {p.name} is a {type(v).__name__}")
    src = ASTSource(fn, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _dtype_name(dtype) -> str:
    """A tensor's element type as Triton's signatures write it (fp32, u8, ...)."""
    import torch

    names = {
        torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
        torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32",
        torch.int64: "i64", torch.bool: "i1",
    }  # fmt: skip
    return names[dtype]


def _launch(form: str, qtype: int, shape: tuple[int, int, int]) -> None:
    """The engine's launch of ``form`` for ``qtype`` on CPU tensors (caught, never run), at
    the GPU's cut (``TUNED``, with ``STRATA_DECODE_TUNE`` as the engine reads it)."""
    import torch

    from strata.engine.gpu.decode import TUNE_ENV, tunes
    from strata.engine.kernels import moe
    from strata.engine.kernels.matvec import Mat, matvec
    from strata.engine.quant.repack import align, repacked_layout

    cuts = tunes(os.environ.get(TUNE_ENV), torch.device("cuda"))  # (no device is asked)
    D, F, NQ = shape
    h, base = torch.zeros(D), torch.zeros(256, dtype=torch.uint8)
    eoffs = torch.zeros(TOP_K, dtype=torch.int64)
    act = torch.zeros(TOP_K, F)
    if form == "gate_up":
        g = repacked_layout(qtype, (F, D))
        moe.gate_up(act, h, eoffs, base, g, g, align(g.nbytes), **cuts["gate_up"].kw())
    elif form == "down":
        dn = repacked_layout(qtype, (D, F))
        moe.down(h, act, eoffs, torch.zeros(TOP_K), base, dn, 0, **cuts["down"].kw())
    elif form == "qkv":
        m = Mat(base, repacked_layout(qtype, (NQ, D)))
        matvec(torch.zeros(NQ), h, [m], norm=h, eps=1e-6, **cuts["qkv"].kw())
    elif form == "o":
        m = Mat(base, repacked_layout(qtype, (D, NQ)))
        matvec(h, torch.zeros(NQ), [m], residual=True, **cuts["o"].kw())
    elif form == "router":
        m = Mat(base, repacked_layout(qtype, (N_EXPERT, D)))
        i64, i32 = torch.int64, torch.int32
        route = moe.Routing(
            torch.zeros(N_EXPERT, dtype=i64), torch.zeros(TOP_K, dtype=i32), torch.zeros(TOP_K),
            torch.zeros(TOP_K, dtype=i64), torch.zeros(N_EXPERT, dtype=i32), TOP_K, True,
            ticket=torch.zeros(1, dtype=i32),
        )  # fmt: skip
        matvec(torch.zeros(N_EXPERT), h, [m], norm=h, eps=1e-6, h_out=torch.zeros(D),
               route=route, **cuts["router"].kw())  # fmt: skip
    else:
        raise ValueError(f"{form!r} is not a decode form ({', '.join(FORMS)})")


def usage(qtype: int, form: str, arch: int = 90,
          shape: tuple[int, int, int] = QWEN3_30B) -> DecodeUsage:  # fmt: skip
    """Compile the engine's ``form`` launch for ``qtype`` and read its resources."""
    from strata.bench.kernel_resources import _run_tool, _tool, resource_usage
    from strata.engine.quant.format import Q

    with _caught() as launches:
        _launch(form, qtype, shape)
    (fn, args, kwargs), *_ = launches
    k = compile_launch(fn, args, kwargs, arch)
    regs = stack = instructions = barriers = None
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "kernel.cubin"
        path.write_bytes(k.asm["cubin"])
        if (cuobjdump := _tool("cuobjdump")) is not None:
            regs, stack = resource_usage(_run_tool(cuobjdump, "-res-usage", str(path)))
        if (nvdisasm := _tool("nvdisasm")) is not None:
            sass = _run_tool(nvdisasm, "-c", str(path))
            instructions, barriers = len(_INSTR.findall(sass)), sass.count("BAR.SYNC")
    D, F, NQ = shape
    rows, cols = {"gate_up": (F, D), "down": (D, F), "qkv": (NQ, D), "o": (D, NQ),
                  "router": (N_EXPERT, D)}[form]  # fmt: skip
    return DecodeUsage(Q(qtype).name, form, f"{rows}x{cols}", int(k.metadata.num_warps), regs,
                       stack, instructions, barriers)  # fmt: skip


def _parse_shape(text: str) -> tuple[int, int, int]:
    try:
        d, f, q = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--shape {text!r}: want D,F,Q, three whole numbers") from None
    if min(d, f, q) < 1 or d % 256 or f % 256:
        raise ValueError(f"--shape {text!r}: D and F must be positive multiples of 256")
    return d, f, q


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m strata.bench.decode_resources",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--types", default="Q4_K", help="weight types by name, comma-separated")
    p.add_argument("--forms", default=",".join(MATRIX_FORMS), help="of " + ", ".join(FORMS))
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--shape", default=",".join(map(str, QWEN3_30B)), help="D,F,Q")
    p.add_argument("--json", action="store_true", help="one JSON list instead of the table")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("unset TRITON_INTERPRET: the interpreter compiles nothing")
    from strata.engine.quant import REPACKED_TYPES

    known = {t.name: int(t) for t in REPACKED_TYPES}
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    for t in types:
        if t not in known:
            p.error(f"{t!r} is not a weight type the kernels read ({', '.join(sorted(known))})")
    for f in forms:
        if f not in FORMS:
            p.error(f"{f!r} is not a decode form ({', '.join(FORMS)})")
    try:
        shape = _parse_shape(args.shape)
        import torch

        from strata.engine.gpu.decode import TUNE_ENV, tunes

        tunes(os.environ.get(TUNE_ENV), torch.device("cuda"))  # a bad knob, named before compiling
    except ValueError as e:
        p.error(str(e))
    rows = [usage(known[t], f, args.arch, shape) for t in types for f in forms]
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))
        return 0
    print(f"sm_{args.arch}; stack in bytes a thread; instructions and barriers: SASS, each once")
    print(f"{'type':<8} {'form':<8} {'matrix':<10} {'warps':>5} {'regs':>4} {'stack':>5} "
          f"{'instr':>6} {'bars':>4}")  # fmt: skip
    for r in rows:
        cells = [("-" if v is None else str(v)) for v in (r.regs, r.stack, r.instructions,
                                                          r.barriers)]  # fmt: skip
        flag = "  spills" if r.stack else ""
        print(f"{r.qtype:<8} {r.form:<8} {r.shape:<10} {r.warps:>5} {cells[0]:>4} {cells[1]:>5} "
              f"{cells[2]:>6} {cells[3]:>4}{flag}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
