"""``STRATA_PDL``: the decode kernels' programmatic dependent launch, on by default where the
GPU has it (sm_90 and later, compiled), off on the CPU and in the interpreter, and a value
other than 0 or 1 refused by name. That the logits are the same with it on and off is
``test_fast_decode_gpu``'s."""

from __future__ import annotations

import os
import re

import pytest
import torch

if not torch.cuda.is_available():  # (the kernels it imports then run in the interpreter)
    os.environ.setdefault("TRITON_INTERPRET", "1")
from strata.engine.kernels import pdl


def test_the_cpu_and_the_interpreter_launch_without_it(monkeypatch) -> None:
    monkeypatch.setenv(pdl.PDL_ENV, "1")
    assert pdl.pdl_launch(torch.device("cpu")) == {"PDL": False}
    assert not pdl.pdl_on(torch.device("cpu"))
    assert pdl.pdl_note(torch.device("cpu")) == ""


@pytest.mark.parametrize("value", ["", "yes", "3", "on"])
def test_a_value_other_than_0_or_1_is_refused_by_name(monkeypatch, value) -> None:
    monkeypatch.setenv(pdl.PDL_ENV, value)
    with pytest.raises(ValueError, match=f"STRATA_PDL={value.strip()!r}: want 0"):
        pdl.pdl_launch(torch.device("cpu"))


def test_0_turns_it_off_and_1_is_the_default(monkeypatch) -> None:
    monkeypatch.setenv(pdl.PDL_ENV, "0")
    assert pdl.pdl_mode() == 0
    monkeypatch.setenv(pdl.PDL_ENV, " 1 ")
    assert pdl.pdl_mode() == 1
    monkeypatch.delenv(pdl.PDL_ENV)
    assert pdl.pdl_mode() == 1


def test_2_adds_the_prefetch_and_its_line(monkeypatch) -> None:
    monkeypatch.setenv(pdl.PDL_ENV, "2")
    assert pdl.pdl_mode() == 2
    assert not pdl.prefetch_on(torch.device("cpu"))


def test_the_prefetch_spans_are_the_first_two_planes_in_rows_of_16_bytes() -> None:
    from strata.engine.quant.format import Q
    from strata.engine.quant.repack import repacked_layout

    assert pdl.prefetch_spans(repacked_layout(Q.Q6_K, (8, 2048))) == (1024, 512)
    assert pdl.prefetch_spans(repacked_layout(Q.F32, (8, 2048))) == (8192, 0)
    q8 = repacked_layout(Q.Q8_0, (8, 96))  # 96 quants and 3 scales (6 bytes) a row
    assert q8.row_bytes[:2] == (96, 6) and pdl.prefetch_spans(q8) == (96, 0)


_COMPILE = """
import torch
from strata.bench.decode_resources import _caught, _launch, compile_launch
from strata.engine.kernels import attention as at
from strata.engine.kernels import matvec as mv
from strata.engine.quant.format import Q
from strata.engine.quant.repack import repacked_layout

mv.prefetch_on = lambda device: True  # as on an sm_90 GPU with STRATA_PDL=2
lay = repacked_layout(Q.Q6_K, (64, 2048))
m = mv.Mat(torch.zeros(lay.nbytes, dtype=torch.uint8), lay)
H, HKV, D, PAGE = 8, 2, 64, 16
kv = torch.zeros(4 * PAGE, HKV, D, dtype=torch.float16)
table, pos = torch.arange(4, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)
with _caught() as launches:
    mv.matvec(torch.zeros(128), torch.zeros(2048), [m, m], norm=torch.zeros(2048), eps=1e-6)
    _launch("gate_up", int(Q.Q4_K), (2048, 768, 4096))
    _launch("down", int(Q.Q4_K), (2048, 768, 4096))
    for fused in (True, False):
        at.DecodeAttention(H, HKV, D, PAGE, 4, torch.device("cpu"), fused=fused)(
            torch.zeros(H * D), torch.zeros(H * D), kv, kv, table, pos)
for fn, args, kw in launches:
    ptx = compile_launch(fn, args, dict(kw, PDL=True), 90).asm["ptx"]
    print("=== " + fn.__name__)
    print(ptx)
"""


_MEMORY = re.compile(r"\b(?:ld|st|atom|red)(?:\.\w+)*\.global\b")


def test_every_dependent_launch_waits_before_any_load_or_store() -> None:
    """Compiled for sm_90 with Triton's own ptxas (no GPU), each kernel the step launches with
    PDL (the matvec with its prefetch, gate_up, down, the attention and its combine): the
    wait for the launch before comes before its first load, store or atomic of memory, and
    the matvec's bulk prefetches come before the wait."""
    import subprocess
    import sys
    from pathlib import Path

    triton = pytest.importorskip("triton", reason="Triton is not installed")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip(f"this Triton has no CUDA backend to compile with ({ptxas} is missing)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    kernels = dict(part.split("\n", 1) for part in done.stdout.split("=== ")[1:])
    assert set(kernels) == {
        "_matvec_kernel", "_gate_up_kernel", "_down_kernel", "_attn_kernel", "_combine_kernel"
    }  # fmt: skip
    for name, ptx in kernels.items():
        wait = ptx.index("griddepcontrol.wait")
        assert wait < ptx.index("griddepcontrol.launch_dependents"), name
        memory = _MEMORY.search(ptx)  # (ld, st, atom or red, any qualifiers, global)
        assert memory is not None and memory.start() > wait, name
    prefetch = kernels["_matvec_kernel"].index("cp.async.bulk.prefetch.L2.global")
    assert prefetch < kernels["_matvec_kernel"].index("griddepcontrol.wait")
