"""The prompt-chunk GEMM of every weight type fits a GPU's shared memory, checked without a GPU.

``strata.bench.kernel_resources`` compiles ``kernels.gemm``'s kernel ahead of time for sm_90 with
Triton's own ptxas (in a child process: the other kernel tests turn Triton's interpreter on, which
compiles nothing). A form over the per-block limit cannot launch on the H200 (the engine then read
prompts on the reference path: gpt-oss's F32 test file did), and a quantised type that needs most
of it runs one block per SM (MXFP4 and IQ4_NL did, at 160-280 KiB, while their levels were loads
from a table). Two forms per type: the dense product (64 activation rows) and the experts' gate
and up (two weight tiles a step)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is not installed")


def _run(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip(f"this Triton has no CUDA backend to compile with ({ptxas} is missing)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "strata.bench.kernel_resources", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _usage() -> list[dict]:
    run = _run("--json", "--forms", "dense,gate_up")
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout)


def test_every_type_fits_and_leaves_room_for_several_blocks() -> None:
    from strata.bench.kernel_resources import QUANT_SMEM_BUDGET, SMEM_LIMIT
    from strata.engine.quant import REPACKED_TYPES

    rows = _usage()
    assert {r["qtype"] for r in rows} == {t.name for t in REPACKED_TYPES}
    assert {r["form"] for r in rows} == {"dense", "gate_up"}
    for r in rows:
        assert 0 < r["shared"] <= SMEM_LIMIT[90], r
        assert r["shared"] <= QUANT_SMEM_BUDGET, f"{r}: one block per SM"


def test_a_bad_name_is_refused() -> None:
    run = _run("--types", "Q4_X", timeout=120)
    assert run.returncode == 2 and "'Q4_X' is not a weight type" in run.stderr
