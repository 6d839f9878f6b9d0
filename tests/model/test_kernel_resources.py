"""The prompt-chunk GEMM of every weight type fits a GPU's shared memory and keeps its registers,
checked without a GPU.

``strata.bench.kernel_resources`` compiles ``kernels.gemm``'s kernel ahead of time for sm_90 with
Triton's own ptxas, with the alignment the runtime's JIT proves (in a child process: the other
kernel tests turn Triton's interpreter on, which compiles nothing), and reads the binary with
Triton's cuobjdump and nvdisasm. A form over the per-block limit cannot launch on the H200 (the
engine then read prompts on the reference path: gpt-oss's F32 test file did); a type that needs
most of an SM runs one block per SM (MXFP4 and IQ4_NL did, at 160-280 KiB, while their levels
were loads from a table); a stack is registers spilled to local memory, loads and stores in the
loop that the tensor cores wait on. Three forms per type with the engine's tiles: the
dense product, the experts' gate and up (two weight tiles a step) and their down. And the decode
kernels of the grid types (``strata.bench.decode_resources``), which once spilled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# The compiles run in child processes without the interpreter; the engine's kernels this process
# imports (for their tiles) are imported as every other kernel test imports them, so that the
# order the test files run in does not decide whether the later ones get the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed")

# a made-up listing in nvdisasm's form: an outer loop (.L_x_0) holding an inner one (.L_x_1),
# and the self-branch after EXIT that every kernel ends with
_SASS = """\
_kernel:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/                   LOP3.LUT R6, R4, 0xf, RZ, 0xc0, !PT ;
.L_x_1:
        /*0030*/                   HMMA.16816.F32 R8, R12, R16, R8 ;
        /*0040*/              @!P1 BRA `(.L_x_1) ;
        /*0050*/                   LOP3.LUT R7, R5, 0xf, RZ, 0xc0, !PT ;
        /*0060*/               @P0 BRA `(.L_x_0) ;
        /*0070*/                   EXIT ;
.L_x_2:
        /*0080*/                   BRA `(.L_x_2);
"""


def _run(*args: str, timeout: int = 900, tool: str = "kernel_resources",
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess:  # fmt: skip
    import triton

    from strata.bench.kernel_resources import tools_missing

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip(f"this Triton has no CUDA backend to compile with ({ptxas} is missing)")
    if missing := tools_missing():
        pytest.skip(f"this Triton's CUDA backend has no {' or '.join(missing)} to read binaries")
    child = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (env or {})
    cmd = [sys.executable, "-m", f"strata.bench.{tool}", *args]
    return subprocess.run(cmd, env=child, capture_output=True, text=True, timeout=timeout)


def test_every_type_fits_without_spills() -> None:
    from strata.bench.kernel_resources import FORMS, QUANT_SMEM_BUDGET, SMEM_LIMIT
    from strata.engine.kernels import gemm
    from strata.engine.quant import REPACKED_TYPES
    from strata.engine.quant.format import Q

    run = _run("--json", "--jobs", "2")  # two processes: ~1 minute on two cores, not two
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(run.stdout)
    assert {(r["qtype"], r["form"]) for r in rows} == {
        (t.name, f) for t in REPACKED_TYPES for f in FORMS
    }
    problems = []
    for r in rows:
        qt = int(Q[r["qtype"]])
        engine = gemm.GPU_DENSE_TILE if r["form"] == "dense" else gemm.GPU_MOE_TILE
        engine = gemm._staged(engine, qt)
        tile = (r["bm"], r["bn"], r["s"], r["warps"], r["stages"])
        assert tile == (engine.bm, engine.bn, engine.s, engine.warps, engine.stages), r
        at = f"{r['qtype']} {r['form']} ({r['bm']}x{r['bn']}x{r['s']}, {r['warps']} warps, " \
             f"{r['stages']} stages)"  # fmt: skip
        if r["loop"] is None or r["mma"] is None:
            problems.append(f"{at}: no main loop with tensor-core products found in its SASS")
        if not 0 < r["shared"] <= SMEM_LIMIT[90]:
            problems.append(f"{at}: {r['shared']} bytes of shared memory, over sm_90's limit")
        if r["shared"] > QUANT_SMEM_BUDGET:
            problems.append(f"{at}: {r['shared']} bytes of shared memory, over the "
                            f"{QUANT_SMEM_BUDGET} that lets two blocks share an SM")  # fmt: skip
        if r["stack"] != 0:
            problems.append(f"{at}: {r['stack']} bytes of stack a thread ({r['regs']} registers)")
    assert not problems, "\n".join(problems)


def test_a_bad_name_is_refused() -> None:
    run = _run("--types", "Q4_X", timeout=120)
    assert run.returncode == 2 and "'Q4_X' is not a weight type" in run.stderr


def test_a_tile_of_ones_own() -> None:
    run = _run("--json", "--types", "Q8_0", "--forms", "down", "--tile", "16,64,2,2,2")
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads(run.stdout)
    assert (row["bm"], row["bn"], row["s"], row["warps"], row["stages"]) == (16, 64, 2, 2, 2)
    # one iteration: 16 x 64 x 64 multiply-adds, issued by 2 warps
    assert row["instr_per_mac"] == pytest.approx(row["loop"] * 2 / (16 * 64 * 2 * 32))


def test_a_bad_tile_is_refused() -> None:
    run = _run("--tile", "48,128,4,4,3", timeout=120)
    assert run.returncode == 2 and "BM 48 is not a power of two" in run.stderr, run.stderr


@pytest.mark.parametrize(
    "text, message",
    [
        ("64,128,4,4", "give five integers"),
        ("64,128,4,4,3,1", "give five integers"),
        ("64,big,4,4,3", "BN 'big' is not an integer"),
        ("64,128,3,4,3", "S 3 is not a power of two"),
        ("64,96,4,4,3", "BN 96 is not a power of two"),
        ("8,128,4,4,3", "BM 8 is under 16"),
        ("64,8,4,4,3", "BN 8 is under 16"),
        ("64,128,0,4,3", "S 0 is not a power of two"),
        ("64,128,4,6,3", "WARPS 6 is not a power of two"),
        ("64,128,4,64,3", "WARPS 64 is over 32"),
        ("64,128,4,4,0", "STAGES 0 is under 1"),
    ],
)
def test_tile_rules(text: str, message: str) -> None:
    from strata.bench.kernel_resources import parse_tile

    with pytest.raises(ValueError, match=message):
        parse_tile(text)


def test_a_good_tile_parses() -> None:
    from strata.bench.kernel_resources import parse_tile
    from strata.engine.kernels.gemm import Tile

    assert parse_tile(" 32, 256,8,8,3 ") == Tile(32, 256, 8, 8, 3)


def test_the_main_loop_is_the_widest_backward_branch() -> None:
    from strata.bench.kernel_resources import main_loop, resource_usage

    loop, mma, ops = main_loop(_SASS)
    assert (loop, mma) == (6, "HMMA")  # 0x10..0x60, the inner loop's instructions included
    assert ops == {"LOP3": 2, "LDG": 1, "HMMA": 1, "BRA": 2}
    assert main_loop(_SASS.replace("`(.L_x_0)", "`(.L_x_2)")) == (2, "HMMA", {"HMMA": 1, "BRA": 1})
    text = " Function _gemm_kernel:\n  REG:168 STACK:16 SHARED:1024 LOCAL:0 CONSTANT[0]:736\n"
    assert resource_usage(text) == (168, 16)
    with pytest.raises(RuntimeError, match="no REG:/STACK:"):
        resource_usage("Resource usage:\n")


def test_the_grid_types_decode_kernels_keep_their_registers() -> None:
    """``decode_resources`` compiles the engine's decode launches as the GPU path makes them:
    the grid types' tiles (``kernels.dot.grid_tile``) once took 255 registers and spilled."""
    run = _run("--json", "--types", "IQ3_S,IQ3_XXS", "--forms", "gate_up,down",
               tool="decode_resources")  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(run.stdout)
    assert [(r["qtype"], r["form"], r["shape"]) for r in rows] == [
        ("IQ3_S", "gate_up", "768x2048"), ("IQ3_S", "down", "2048x768"),
        ("IQ3_XXS", "gate_up", "768x2048"), ("IQ3_XXS", "down", "2048x768"),
    ]  # fmt: skip
    for r in rows:
        assert r["stack"] == 0 and r["regs"] < 255, r
        assert r["instructions"] > 0 and r["barriers"] >= 0, r


def test_a_cut_from_the_tune_knob_is_the_one_compiled() -> None:
    """``STRATA_DECODE_TUNE`` reaches the compiled launch as it reaches the engine's: q's
    matvec at 16 rows and 4 warps, where ``TUNED`` has 4 rows and 8."""
    from strata.engine.gpu.decode import TUNED

    assert TUNED["qkv"].warps != 4
    run = _run("--json", "--types", "Q8_0", "--forms", "qkv", tool="decode_resources",
               env={"STRATA_DECODE_TUNE": "qkv=16:4"})  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads(run.stdout)
    assert row["warps"] == 4 and row["stack"] == 0, row


def test_the_router_and_its_routing_compile_as_one_launch() -> None:
    """The router form: 128 experts' F32 router with the routing in its last program, compiled
    as the decode step launches it (its barriers are what the routing costs across warps)."""
    run = _run("--json", "--types", "F32", "--forms", "router", tool="decode_resources")
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads(run.stdout)
    assert (row["qtype"], row["form"], row["shape"]) == ("F32", "router", "128x2048")
    assert row["stack"] == 0 and row["barriers"] > 0, row


@pytest.mark.parametrize(
    "args, message",
    [
        (("--types", "Q4_X"), "'Q4_X' is not a weight type the kernels read"),
        (
            ("--forms", "attention"),
            "'attention' is not a decode form (gate_up, down, qkv, o, router)",
        ),
        (("--shape", "2048,700,4096"), "D and F must be positive multiples of 256"),
        (("--shape", "2048,768"), "want D,F,Q, three whole numbers"),
    ],
)
def test_the_decode_check_refuses_what_it_cannot_compile(args, message) -> None:
    run = _run(*args, timeout=120, tool="decode_resources")
    assert run.returncode == 2 and message in run.stderr, run.stderr[-2000:]


def test_the_decode_check_names_a_bad_tune_knob_before_compiling() -> None:
    run = _run("--types", "Q8_0", "--forms", "qkv", timeout=120, tool="decode_resources",
               env={"STRATA_DECODE_TUNE": "qkv=3"})  # fmt: skip
    assert run.returncode == 2, run.stderr[-2000:]
    assert "STRATA_DECODE_TUNE: qkv rows per program 3" in run.stderr, run.stderr[-2000:]
