"""What the prompt-chunk GEMM (``kernels.gemm``) asks of a GPU, per weight type, without a GPU.

A developer's check, not a bench row: it compiles ``_gemm_kernel`` ahead of time for a CUDA
target (Triton's own ptxas, no driver needed) in the three forms a chunk launches — a dense
product, the experts' gate and up (two matrices, SwiGLU) and the experts' down — with the tiles
the GPU path uses, and prints each form's shared memory (registers need the driver to load the
binary: ``python -m strata.bench.profile`` reports them on a GPU). A kernel whose
shared memory exceeds the device's per-block limit does not launch at all (the engine then
reads prompts on the reference path); one that needs most of it runs one block per SM, a
fraction of the tensor cores' rate. ``tests/model/test_kernel_resources.py`` holds every type
under the limits below::

    python -m strata.bench.kernel_resources [--arch 90] [--forms dense,gate_up] [--types MXFP4]

Run it with ``TRITON_INTERPRET`` unset: the interpreter has nothing to compile.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from dataclasses import asdict, dataclass

# per-block shared memory of sm_90 (H100/H200: 227 KiB) and of sm_89/sm_86 (99 KiB), the
# consumer cards Strata is for
SMEM_LIMIT = {90: 232448, 89: 101376, 86: 101376, 80: 166912}
# a quantised type's tiles stay under this much, so several blocks share an SM
QUANT_SMEM_BUDGET = 64 * 1024

# the kernel's pointer arguments and their element types (the rest are integers)
_POINTERS = {
    "a": "*fp16", "y": "*fp32", "rows": "*i32", "blocks": "*i32", "table": "*i64",
    "wts": "*fp32", "w": "*u8", "bias": "*fp32", "bias_v": "*fp32",
}  # fmt: skip


@dataclass(frozen=True)
class Usage:
    qtype: str
    form: str  # dense, gate_up or down
    k: int
    shared: int  # bytes of shared memory a block
    stages: int


def _k_for(qtype: int) -> int:
    """A row length the type can hold: gpt-oss's 2880 for the types of 32-element blocks (and
    the floats), 2048 for those of 256."""
    import gguf

    from strata.engine.quant.format import Q

    return 2880 if gguf.GGML_QUANT_SIZES[Q(qtype)][0] <= 32 else 2048


def usage(qtype: int, form: str, arch: int = 90) -> Usage:
    """Compile one form of the GEMM for ``qtype`` on ``sm_<arch>`` and read its resources."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from strata.engine.kernels import gemm
    from strata.engine.quant.format import Q

    experts = form != "dense"
    tile = gemm._staged(gemm.GPU_MOE_TILE if experts else gemm.GPU_DENSE_TILE, qtype)
    k = _k_for(qtype)
    const = dict(
        K=k, QT=qtype, QV=qtype, TOPK=4 if form == "gate_up" else 1, EXPERTS=experts,
        GATHER=form == "gate_up", SCATTER=form == "down", GLU=form == "gate_up",
        WEIGHTED=form == "down", ADD=False, BM=tile.bm, BN=tile.bn, S=tile.s, BIAS=False,
        OAI=False, ALPHA=1.0, LIMIT=0.0,
    )  # fmt: skip
    fn = gemm._gemm_kernel
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: "constexpr" if n in const else _POINTERS.get(n, "i64") for n in names}
    src = ASTSource(fn, signature=sig, constexprs={(names.index(n),): v for n, v in const.items()})
    compiled = triton.compile(
        src,
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": tile.warps, "num_stages": tile.stages},
    )
    return Usage(Q(qtype).name, form, k, int(compiled.metadata.shared), tile.stages)


FORMS = ("dense", "gate_up", "down")


def all_usage(arch: int = 90, forms: tuple[str, ...] = FORMS,
              types: tuple[str, ...] | None = None) -> list[Usage]:  # fmt: skip
    """``usage`` of each form for each type the kernels read (``types``: by name; None: all)."""
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
    return [usage(int(known[n]), form, arch) for n in names for form in forms]


def _names(text: str | None) -> tuple[str, ...] | None:
    return None if text is None else tuple(v.strip() for v in text.split(",") if v.strip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m strata.bench.kernel_resources", description=__doc__)
    p.add_argument("--arch", type=int, default=90, choices=sorted(SMEM_LIMIT))
    p.add_argument("--forms", default=",".join(FORMS), help="of dense, gate_up, down")
    p.add_argument("--types", help="weight types by name, comma-separated (default: all)")
    p.add_argument("--json", action="store_true", help="one JSON list instead of the table")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("unset TRITON_INTERPRET: the interpreter compiles nothing")
    try:
        rows = all_usage(args.arch, _names(args.forms) or FORMS, _names(args.types))
    except ValueError as e:
        p.error(str(e))
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))
        return 0
    limit = SMEM_LIMIT[args.arch]
    print(f"sm_{args.arch}: {limit // 1024} KiB of shared memory a block")
    print(f"{'type':<8} {'form':<8} {'K':>5} {'shared':>10} stages")
    for r in rows:
        flag = "  over the limit" if r.shared > limit else ""
        print(f"{r.qtype:<8} {r.form:<8} {r.k:>5} {r.shared:>10} {r.stages:>6}{flag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
