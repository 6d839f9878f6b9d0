"""The CPU expert kernels (``engine/kernels/cpu_experts.c``): a job's output equals a float64
torch reference built from ``dequantize_repacked`` for every type the library computes, reads
its inputs at call time, runs from any thread, and the compiled library is cached by its source.

Skipped, with the reason printed, where no C compiler is found.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from strata.engine import cpuinfo
from strata.engine.kernels import cpu_experts
from strata.engine.kernels.cpu_experts import CpuExperts, CpuExpertsUnavailable, CpuJob
from strata.engine.quant import repack
from strata.engine.quant.expert_layout import RUN_ALIGN, KernelSlotLayout, align
from strata.engine.quant.formats import fmt
from strata.engine.quant.repack import RepackedLayout, repacked_layout
from tests.model.quantdata import random_bytes

Q = gguf.GGMLQuantizationType
SUPPORTED = [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_K, Q.Q4_0, Q.IQ4_XS, Q.F16, Q.BF16, Q.F32, Q.Q4_1,
             Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.MXFP4, Q.Q2_K, Q.Q3_K, Q.IQ3_XXS, Q.IQ3_S]  # fmt: skip
TOL = 1e-4  # relative error of y against the float64 reference
# and where the kernels read their input quantised to int8 (``int8_input``): h and act each
# rounded to 8 bits a value (a unit of 32 on one scale) put ~1% into y (0.8-1.4% measured on
# these tests' experts); a kernel reading the wrong bytes is off by ~100%
TOL_INT8 = 3e-2
# where x86 has AVX2 or AVX-512BW (IQ3_XXS: AVX-512 with VBMI)
INT8_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K, Q.IQ4_XS, Q.IQ4_NL, Q.MXFP4, Q.IQ3_S]
INT8_TYPES += [Q.IQ3_XXS, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]


def tol(qtype: Q) -> float:
    return TOL_INT8 if cpu_experts.int8_input(qtype) else TOL


def q4_tol() -> float:
    """The tolerance of the Q4_K/Q6_K experts most tests use."""
    return max(tol(Q.Q4_K), tol(Q.Q6_K))


def quantised(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 kernels read it: each unit of 32 as round(x / d) * d, d = max |x| / 127 in
    float32 (round half to even, as C's nearbyintf)."""
    units = x.float().reshape(-1, 32)
    d = units.abs().amax(1, keepdim=True) / 127.0
    q = torch.where(d > 0, torch.round(units / d), torch.zeros_like(units))
    return (q * d).reshape(-1)


def hostile_input(rng: np.random.Generator) -> torch.Tensor:
    """Units of 32 the quantisation must get exactly: values that scale to halves (ties to
    even), tiny and huge ones, all zeros, one NaN, one infinity, one at the largest float."""
    x = torch.from_numpy(rng.integers(-1000, 1001, 32 * 64).astype(np.float32) / 8)
    u = x.view(-1, 32)
    u[1] *= 1e-30
    u[2] = torch.arange(-16, 16, dtype=torch.float32) + 0.5  # max 15.5: x / d at .5 steps
    u[2, 0] = 127 / 2
    u[3] = 0
    u[4, 9] = float("nan")
    u[5, 30] = float("-inf")
    u[6, 3] = torch.finfo(torch.float32).max
    u[7] *= 3e37
    return x


def check_quantised(lib: ctypes.CDLL, x: torch.Tensor) -> None:
    """strata_quantize's bytes, scales and group sums against torch's, bit for bit."""
    n = x.numel()
    q = torch.full((n,), 99, dtype=torch.int8)
    d, s = torch.full((n // 16,), 7.0), torch.full((n // 16,), 7.0)
    fp = ctypes.POINTER(ctypes.c_float)
    ptr = [ctypes.cast(t.data_ptr(), fp) for t in (x, d, s)]
    assert lib.strata_quantize(ptr[0], n - 1, q.data_ptr(), ptr[1], ptr[2]) == 0  # not units
    assert (q == 99).all() and (d == 7).all(), "a refused call wrote"
    assert lib.strata_quantize(ptr[0], n, q.data_ptr(), ptr[1], ptr[2]) == 1
    units = x.view(-1, 32)
    finite = units.isfinite().all(1, keepdim=True)
    dx = torch.where(finite, units.abs().amax(1, keepdim=True) / 127.0, float("nan"))
    want_q = torch.where(finite & (dx > 0), torch.round(units / dx), 0).to(torch.int8)
    assert torch.equal(q.view(-1, 32), want_q)
    groups = want_q.view(-1, 16).sum(1, dtype=torch.int32).float()
    want_d = dx.repeat_interleave(2)
    for got, want in ((d, want_d), (s, want_d * groups)):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_the_input_is_quantised_as_the_tests_emulate_it(lib, rng) -> None:
    check_quantised(lib, hostile_input(rng))


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")  # an XDG_CACHE_HOME of the tests' own


@pytest.fixture(scope="module", autouse=True)
def lib(cache: Path) -> ctypes.CDLL:
    """The library, compiled into the tests' cache (not the user's) unless already loaded."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(cache))
        try:
            return cpu_experts.library()
        except CpuExpertsUnavailable as e:
            pytest.skip(str(e))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261207)


@dataclass
class Experts:
    """E experts' slots in one buffer, one of them (the last) alone at an odd address in a
    buffer of its own (as a staging slot may be), with their dense float64 matrices."""

    layout: KernelSlotLayout
    arena: torch.Tensor
    lone: torch.Tensor
    addrs: list[int]  # each expert's slot address
    dense: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # gate, up, down

    def reference(self, ids: list[int], wts: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h64, y = h.double(), torch.zeros(h.numel(), dtype=torch.float64)
        for i, e in enumerate(ids):
            g, u, d = self.dense[e]
            y += float(wts[i]) * (d @ (torch.nn.functional.silu(g @ h64) * (u @ h64)))
        return y


def raw_bytes(qtype: Q, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """GGUF bytes of ``shape``; BF16's of moderate values (``random_bytes`` spans 2^+-63, whose
    products overflow float32)."""
    if qtype == Q.BF16:
        w = torch.from_numpy(rng.uniform(-4, 4, shape).astype(np.float32))
        return w.to(torch.bfloat16).view(torch.uint8).reshape(-1).numpy()
    return random_bytes(qtype, shape, rng)


def experts(tg: Q, td: Q, D: int, F: int, E: int, rng: np.random.Generator) -> Experts:
    gate, down = repacked_layout(tg, (F, D)), repacked_layout(td, (D, F))
    up_offset = align(gate.nbytes, RUN_ALIGN)
    layout = KernelSlotLayout(
        gate, gate, down, up_offset, up_offset + align(gate.nbytes, RUN_ALIGN)
    )
    slot = align(layout.nbytes, RUN_ALIGN)
    arena = torch.zeros((E - 1) * slot, dtype=torch.uint8)
    lone = torch.zeros(slot + 1, dtype=torch.uint8)
    addrs, dense = [], []
    for e in range(E):
        where = lone[1:] if e == E - 1 else arena[e * slot : (e + 1) * slot]
        mats = []
        for off, lay in zip(layout.offsets, layout.layouts, strict=True):
            shape = (lay.rows, lay.cols)
            raw = torch.from_numpy(raw_bytes(lay.qtype, shape, rng))
            packed = repack.repack(raw, lay.qtype, shape)
            where[off : off + lay.nbytes] = packed
            mats.append(repack.dequantize_repacked(packed, lay.qtype, shape).double())
        addrs.append(where.data_ptr())
        dense.append(tuple(mats))
    return Experts(layout, arena, lone, addrs, dense)  # type: ignore[arg-type]


def fill(job: CpuJob, ex: Experts, ids: list[int], base: int, seed: int) -> None:
    """Point the job at experts ``ids`` (offsets from ``base``), with new weights and input."""
    gen = torch.Generator().manual_seed(seed)
    job.n[0] = len(ids)
    job.base = base
    job.offs[: len(ids)] = torch.tensor([ex.addrs[e] - base for e in ids], dtype=torch.int64)
    job.wts.copy_(torch.rand(job.kmax, generator=gen))
    job.h.copy_(torch.randn(job.h.numel(), generator=gen))
    job.y.fill_(float("nan"))  # every element must be written


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not got.isnan().any(), "an output element was not written"
    return float((got.double() - want).norm() / want.norm())


def shape_for(qtype: Q) -> tuple[int, int]:
    """(D, F) small enough to be quick, whole blocks for ``qtype`` in both directions (and
    neither a multiple of the vector width for the float types)."""
    block = fmt(qtype).block
    return (2 * block, block) if block > 1 else (100, 37)


# -- every type -------------------------------------------------------------------------------


def test_supported_types_are_the_library_s_and_gguf_s_ids(lib) -> None:
    assert {t for t in Q if lib.strata_supported(int(t))} == set(SUPPORTED)
    assert cpu_experts.layout_mismatches(lib) == ""  # block and plane sizes as described


def test_the_grids_are_handed_in_once_and_a_wrong_size_is_refused(lib, rng) -> None:
    """The grid types read float32 copies of their grids (``_set_grids``, at load), and byte
    copies for the integer kernels; a call with other sizes, or values that are not bytes, is
    refused and leaves them as they were; so is a grid of more than 8 values (3 bits a value:
    the codes the integer kernels look up with AVX-512 VBMI)."""
    assert lib.strata_supported(int(Q.IQ3_S)) and lib.strata_supported(int(Q.IQ3_XXS))
    zeros = np.zeros(512 * 4, dtype=np.float32)
    p = zeros.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    assert lib.strata_set_grids(p, 255, p, 512) == 0
    assert lib.strata_set_grids(p, 256, p, 511) == 0
    for bad in (0.5, -1.0, 256.0, float("nan")):
        zeros[7] = bad
        assert lib.strata_set_grids(p, 256, p, 512) == 0, bad
    zeros[:9] = np.arange(9)
    assert lib.strata_set_grids(p, 256, p, 512) == 0, "nine values"
    zeros[8] = 0
    assert lib.strata_set_grids(p, 256, p, 512) == 1, "eight values"
    assert cpu_experts._set_grids(lib)  # (the real ones again)
    ex = experts(Q.IQ3_S, Q.IQ3_XXS, 256, 256, 3, rng)
    job = CpuExperts(2).job(ex.layout, kmax=2, pin=False)
    fill(job, ex, [2, 0], base=ex.arena.data_ptr(), seed=3)
    job.run()
    want = max(tol(Q.IQ3_S), tol(Q.IQ3_XXS))
    assert rel_err(job.y, ex.reference([2, 0], job.wts, job.h)) < want, "the grids changed"


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_a_job_matches_the_dequantised_reference(qtype: Q, rng) -> None:
    D, F = shape_for(qtype)
    ex = experts(qtype, qtype, D, F, 5, rng)
    job = CpuExperts(2).job(ex.layout, kmax=4, pin=False)
    ids = [4, 0, 2]  # n < kmax; the lone odd-address slot first
    fill(job, ex, ids, base=ex.arena.data_ptr() + 3 * RUN_ALIGN, seed=1)  # some offsets < 0
    job.run()
    assert rel_err(job.y, ex.reference(ids, job.wts, job.h)) < tol(qtype)


def check_rows(qtype: Q, cols: int, rng: np.random.Generator, lib: ctypes.CDLL) -> None:
    """Three rows, as a job computes them (``row_dot``), against float64 over the dequantised
    rows and the input as that type's kernels read it: the float input, or its int8 rounding."""
    raw = torch.from_numpy(raw_bytes(qtype, (3, cols), rng))
    packed = repack.repack(raw, qtype, (3, cols))
    w = repack.dequantize_repacked(packed, qtype, (3, cols)).double()
    x = torch.randn(cols, generator=torch.Generator().manual_seed(9)) * 3
    x[:32] *= 1e-3  # a unit of small values beside larger ones
    read = quantised(x) if lib.strata_int8_input(int(qtype)) else x
    lay = repacked_layout(qtype, (3, cols))
    for r in range(3):
        want = float(w[r] @ read.double())
        got = cpu_experts.row_dot(lay, packed, r, x, lib)
        assert abs(got - want) <= 1e-5 * float(w[r].abs() @ read.double().abs()), (r, got, want)


# the 32-element types the int8 kernels take two blocks at a time: an odd count ends in one
PAIRED = {Q.IQ4_NL, Q.MXFP4, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1}


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_a_row_matches_the_reference_of_the_input_it_reads(qtype: Q, lib, rng) -> None:
    check_rows(qtype, shape_for(qtype)[0], rng, lib)
    if qtype in PAIRED:
        check_rows(qtype, 96, rng, lib)  # two blocks and one


@pytest.mark.parametrize("qtype", sorted(PAIRED), ids=lambda t: t.name)
def test_a_job_of_rows_ending_in_one_block_matches_the_reference(qtype: Q, rng) -> None:
    """Rows of three blocks (a pair and one) both ways: the second expert's act starts mid-pair
    in the job's buffer, and its pair still meets its own input's sums (``xq_t``'s n)."""
    ex = experts(qtype, qtype, 96, 96, 4, rng)
    job = CpuExperts(2).job(ex.layout, kmax=3, pin=False)
    ids = [1, 3, 0]
    fill(job, ex, ids, base=ex.arena.data_ptr(), seed=2)
    job.run()
    assert rel_err(job.y, ex.reference(ids, job.wts, job.h)) < tol(qtype)


# the library's other code paths, where this CPU can run them: x86's generic float kernels, AVX2's
# integer ones, AVX-512 without VNNI's, and with VNNI but not VBMI (what -march=native chose is
# tested above)
MARCHES = {
    "x86-64": set(),
    "haswell": {"avx2", "fma", "bmi2"},
    "skylake-avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"},
    # VNNI without VBMI: the level types' sums (xq_t's n), IQ3_S's gather
    "cascadelake": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni"},
}


@pytest.mark.isa
@pytest.mark.parametrize("march", sorted(MARCHES))
def test_each_instruction_sets_kernels_match_the_reference(march: str, tmp_path, rng) -> None:
    cpus = cpuinfo.processors()
    flags = set(cpus[0].get("flags", "").split()) if cpus else set()
    if platform.machine() != "x86_64" or not MARCHES[march] <= flags:
        pytest.skip(f"this CPU cannot run -march={march} code ({platform.machine()})")
    so = tmp_path / f"cpu_experts-{march}.so"
    flags_m = [f if f != "-march=native" else f"-march={march}" for f in cpu_experts.FLAGS]
    cmd = [*cpu_experts.compiler(), *flags_m, "-o", str(so), str(cpu_experts.SOURCE)]
    done = subprocess.run([*cmd, *cpu_experts.LIBS], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    lib = cpu_experts._declare(ctypes.CDLL(str(so)))
    assert cpu_experts._set_grids(lib)
    assert bool(lib.strata_int8_input(int(Q.Q4_K))) == (march != "x86-64")
    check_quantised(lib, hostile_input(rng))
    for qtype in [*INT8_TYPES, *PAIRED, Q.IQ4_XS, Q.Q8_0]:
        check_rows(qtype, 96 if qtype in PAIRED else 512, rng, lib)


@pytest.mark.parametrize("qtype", INT8_TYPES, ids=lambda t: t.name)
def test_the_int8_kernels_are_those_of_x86_with_avx2(qtype: Q) -> None:
    cpus = cpuinfo.processors()
    flags = cpus[0].get("flags", "").split() if cpus else []
    # AVX2 (8 lanes), or AVX-512 with its byte instructions (16 lanes; AVX-512F alone: floats)
    want = "avx2" in flags and ("avx512f" not in flags or "avx512bw" in flags)
    if qtype == Q.IQ3_XXS:  # only with its grid's codes in registers (AVX-512 VBMI)
        want = want and "avx512bw" in flags and "avx512vbmi" in flags
    assert cpu_experts.int8_input(qtype) == want
    assert not cpu_experts.int8_input(Q.F16)  # a float kernels' type


@pytest.mark.parametrize("qtype", INT8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_nan_or_infinite_input_gives_nan(qtype: Q, bad: float, rng) -> None:
    """Not a number made of int8s: the unit holding it gets the scale NaN. Where the type takes
    the float kernel on this CPU (IQ3_XXS without AVX-512 VBMI), an infinite input gives an
    infinite or NaN sum, never a finite one."""
    cols = shape_for(qtype)[0]
    raw = torch.from_numpy(raw_bytes(qtype, (1, cols), rng))
    packed = repack.repack(raw, qtype, (1, cols))
    x = torch.randn(cols)
    x[40] = bad
    got = cpu_experts.row_dot(repacked_layout(qtype, (1, cols)), packed, 0, x)
    if cpu_experts.int8_input(qtype) or math.isnan(bad):
        assert math.isnan(got)
    else:
        assert not math.isfinite(got)


def test_row_dot_refuses_what_it_cannot_compute() -> None:
    lay = repacked_layout(Q.Q4_K, (2, 256))
    data = torch.zeros(lay.nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="row 2 of a 2-row"):
        cpu_experts.row_dot(lay, data, 2, torch.zeros(256))
    with pytest.raises(ValueError, match="256 contiguous float32"):
        cpu_experts.row_dot(lay, data, 0, torch.zeros(128))
    with pytest.raises(ValueError, match="uint8 bytes"):
        cpu_experts.row_dot(lay, data[:10], 0, torch.zeros(256))
    with pytest.raises(ValueError, match="do not compute TQ1_0"):  # a type the library has not
        cpu_experts.row_dot(replace(lay, qtype=Q.TQ1_0), data, 0, torch.zeros(256))


def test_gate_up_q4_k_with_a_q6_k_down_as_q4_k_m_mixes_them(rng) -> None:
    ex = experts(Q.Q4_K, Q.Q6_K, 512, 256, 3, rng)
    job = CpuExperts(2).job(ex.layout, kmax=3, pin=False)
    fill(job, ex, [2, 1, 0], base=0, seed=2)  # offsets are absolute addresses
    job.run()
    assert rel_err(job.y, ex.reference([2, 1, 0], job.wts, job.h)) < q4_tol()


def test_a_quantised_gate_beside_a_float_down_of_ragged_width(rng) -> None:
    ex = experts(Q.Q8_0, Q.F32, 64, 37, 2, rng)  # act units span two experts: unused by F32
    job = CpuExperts(3).job(ex.layout, kmax=2, pin=False)
    fill(job, ex, [1, 0], base=0, seed=3)
    job.run()
    assert rel_err(job.y, ex.reference([1, 0], job.wts, job.h)) < tol(Q.Q8_0)


def test_a_realistic_q4_k_expert(rng) -> None:
    ex = experts(Q.Q4_K, Q.Q4_K, 2048, 768, 2, rng)
    job = CpuExperts(2).job(ex.layout, kmax=2, pin=False)
    fill(job, ex, [0, 1], base=0, seed=4)
    job.run()
    assert rel_err(job.y, ex.reference([0, 1], job.wts, job.h)) < q4_tol()


# -- calls ------------------------------------------------------------------------------------


@pytest.fixture
def q4(rng) -> Experts:
    return experts(Q.Q4_K, Q.Q6_K, 256, 256, 4, rng)


def test_no_entries_give_zeros(q4) -> None:
    job = CpuExperts(2).job(q4.layout, kmax=2, pin=False)
    fill(job, q4, [], base=0, seed=5)
    job.run()
    assert torch.equal(job.y, torch.zeros_like(job.y))


@pytest.mark.parametrize(
    "types", [(Q.Q4_K, Q.Q6_K), (Q.Q2_K, Q.Q3_K)], ids=["Q4_K-Q6_K", "Q2_K-Q3_K"]
)
def test_the_thread_count_does_not_change_a_bit(types: tuple[Q, Q], rng) -> None:
    """Each row's arithmetic is the same whichever thread does it (and the int8 input's units
    are quantised the same whichever thread ends them)."""
    ex = experts(*types, 256, 256, 4, rng)
    ys = []
    for threads in (1, 3):
        job = CpuExperts(threads).job(ex.layout, kmax=3, pin=False)
        fill(job, ex, [3, 1, 2], base=0, seed=6)
        job.run()
        ys.append(job.y.clone())
    assert torch.equal(ys[0], ys[1])
    assert rel_err(ys[0], ex.reference([3, 1, 2], job.wts, job.h)) < max(map(tol, types))


def test_each_run_reads_the_inputs_written_in_place(q4) -> None:
    job = CpuExperts(2).job(q4.layout, kmax=3, pin=False)
    fill(job, q4, [0, 1], base=0, seed=7)
    job.run()
    first = job.y.clone()
    fill(job, q4, [2, 3, 0], base=q4.arena.data_ptr(), seed=8)  # n, offs, base, wts, h
    job.run()
    assert not torch.equal(job.y, first)
    assert rel_err(job.y, q4.reference([2, 3, 0], job.wts, job.h)) < q4_tol()
    job.h.mul_(-1.0)
    job.run()
    assert rel_err(job.y, q4.reference([2, 3, 0], job.wts, job.h)) < q4_tol()


def test_a_job_runs_from_other_threads_one_after_another(q4) -> None:
    job = CpuExperts(2).job(q4.layout, kmax=2, pin=False)
    fill(job, q4, [1, 3], base=0, seed=9)
    for _ in range(3):
        job.y.fill_(float("nan"))
        t = threading.Thread(target=job.run)
        t.start()
        t.join()
        assert rel_err(job.y, q4.reference([1, 3], job.wts, job.h)) < q4_tol()


def answer(mb: cpu_experts.Mailbox, seq: int) -> None:
    """Wait until the server has answered post ``seq`` (a hang guard, not a timing: a minute)."""
    deadline = time.monotonic() + 60
    while mb.answered < seq:
        assert time.monotonic() < deadline, f"post {seq} was not answered"
        time.sleep(0.001)


def test_a_server_answers_each_post_with_that_job_s_sum(q4) -> None:
    """What a GPU kernel does, from the host: write a job's request in place, post its index;
    the server runs that job and publishes ``done`` after ``y``."""
    pool = CpuExperts(3)
    jobs = [pool.job(q4.layout, kmax=3, pin=False) for _ in range(2)]
    mb = pool.serve(jobs, pin=False)
    assert mb.address % 64 == 0 and (mb.posted, mb.answered, mb.fault) == (0, 0, 0)
    for seq, (j, ids) in enumerate([(0, [3, 1]), (1, [2, 0, 1]), (0, [1])], start=1):
        fill(jobs[j], q4, ids, base=0, seed=20 + seq)
        pool.arm(1.0)
        assert mb.post(j) == seq
        answer(mb, seq)
        assert rel_err(jobs[j].y, q4.reference(ids, jobs[j].wts, jobs[j].h)) < q4_tol()
    assert pool.stats().jobs == 3 and mb.fault == 0
    pool.close()


def test_a_post_is_answered_once_the_pool_is_armed(q4) -> None:
    """A server left unarmed sleeps after its quiet time; a post made then (here, or as soon
    as it starts) waits for the next arm (the decoder arms before every step) at the latest."""
    pool = CpuExperts(2)
    job = pool.job(q4.layout, kmax=2, pin=False)
    mb = pool.serve([job], pin=False)
    fill(job, q4, [0, 2], base=0, seed=30)
    seq = mb.post(0)
    pool.arm(0.5)
    answer(mb, seq)
    assert rel_err(job.y, q4.reference([0, 2], job.wts, job.h)) < q4_tol()
    pool.close()


def test_a_post_naming_no_job_is_answered_with_a_fault(q4) -> None:
    """So a device waiting for it never hangs, and the host learns of it."""
    pool = CpuExperts(2)
    job = pool.job(q4.layout, kmax=1, pin=False)
    mb = pool.serve([job], pin=False)
    pool.arm(1.0)
    answer(mb, mb.post(5))
    assert mb.fault == 2 and pool.stats().jobs == 0
    pool.close()


def test_serve_refuses_what_it_cannot_serve(q4) -> None:
    pool, other = CpuExperts(2), CpuExperts(1)
    with pytest.raises(ValueError, match="at least one job"):
        pool.serve([], pin=False)
    with pytest.raises(ValueError, match="job 1 belongs to another"):
        pool.serve([pool.job(q4.layout, 1, False), other.job(q4.layout, 1, False)], pin=False)
    pool.serve([pool.job(q4.layout, 1, False)], pin=False)
    with pytest.raises(RuntimeError, match="serves a mailbox already"):
        pool.serve([pool.job(q4.layout, 1, False)], pin=False)
    pool.close()
    other.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.serve([], pin=False)
    pool.arm(1.0)  # a closed pool: nothing to arm, no error


def test_a_serving_pool_left_alone_is_freed(q4) -> None:
    """The server's jobs point back at their pool; the pool still goes when nothing else
    holds it, and its server thread with it."""
    pool = CpuExperts(2)
    pool.serve([pool.job(q4.layout, 1, False)], pin=False)
    free = pool._free
    del pool
    import gc

    gc.collect()
    assert not free.alive


def test_closing_a_pool_while_its_server_runs_jobs_ends(q4) -> None:
    """The pool's threads finish a job begun before the stop, and none starts after it (the
    server is stopped before the workers), so ``close`` returns whenever it comes: right after
    a post, the server may be anywhere between seeing it and starting the job. A close that
    stopped the workers first left a server that started its job just then waiting for them
    forever (a few hundred rounds found it)."""

    def rounds() -> None:
        for i in range(300):
            pool = CpuExperts(4)
            job = pool.job(q4.layout, kmax=3, pin=False)
            mb = pool.serve([job], pin=False)
            fill(job, q4, [0, 1, 2], base=0, seed=40)
            pool.arm(1.0)
            mb.post(0)
            pool.close()
            done.append(i)

    done: list[int] = []
    # a daemon thread: a hang fails this test without keeping the test process alive
    closing = threading.Thread(target=rounds, daemon=True)
    closing.start()
    closing.join(300)  # a hang guard, not a timing
    assert not closing.is_alive(), f"close did not return in round {len(done)} of 300"


def test_the_mailbox_layout_is_the_kernels(lib) -> None:
    from strata.engine.kernels import moe

    lay = cpu_experts.mailbox_layout()
    assert (lay.seq, lay.job, lay.done, lay.fault) == (
        moe.MB_SEQ, moe.MB_JOB, moe.MB_DONE, moe.MB_FAULT
    )  # fmt: skip
    assert lay.size % 64 == 0


# -- errors and the pool's life ---------------------------------------------------------------


def test_an_unsupported_type_is_named(q4) -> None:
    iq2 = RepackedLayout(Q.IQ2_XXS, 256, 256, (0,), (66,), 256 * 66)  # (a type without one)
    layout = KernelSlotLayout(q4.layout.gate, q4.layout.up, iq2, 1 << 16, 1 << 17)
    with pytest.raises(ValueError, match=r"down.*IQ2_XXS"):
        CpuExperts(1).job(layout, kmax=2, pin=False)


def test_a_mismatched_shape_is_named(rng) -> None:
    ex = experts(Q.Q8_0, Q.Q8_0, 64, 32, 1, rng)
    wide = repacked_layout(Q.Q8_0, (64, 64))
    layout = KernelSlotLayout(ex.layout.gate, ex.layout.up, wide, 1 << 16, 1 << 17)
    with pytest.raises(ValueError, match="down is 64 x 64, expected 64 x 32"):
        CpuExperts(1).job(layout, kmax=1, pin=False)


@pytest.mark.parametrize("threads", [0, -2])
def test_a_pool_needs_a_thread(threads: int) -> None:
    with pytest.raises(ValueError, match=f"threads={threads}"):
        CpuExperts(threads)


def test_close_is_idempotent_and_its_jobs_refuse_to_run(q4) -> None:
    pool = CpuExperts(3)
    job = pool.job(q4.layout, kmax=1, pin=False)
    pool.close()
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        job.run()


def test_a_pool_left_alone_is_freed() -> None:
    pools = [CpuExperts(2) for _ in range(4)]
    finalizers = [p._free for p in pools]
    del pools
    assert not any(f.alive for f in finalizers)


# -- building ---------------------------------------------------------------------------------


LOAD = """
from strata.engine.kernels import cpu_experts
print(cpu_experts.library()._name, cpu_experts.compiles)
"""


def test_a_fresh_process_reuses_the_cached_library(cache: Path) -> None:
    where = cache / "strata" / "kernels"
    built = cpu_experts.build(cpu_experts.SOURCE.read_text(), cpu_experts.compiler(), where)
    mtime = built.stat().st_mtime_ns
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    out = subprocess.run(
        [sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == [str(built), "0"]  # that file, and no compiler run
    assert built.stat().st_mtime_ns == mtime
    assert [p.name for p in where.iterdir()] == [built.name]  # no temporary files left


def test_the_cache_key_follows_the_source_flags_compiler_and_cpu() -> None:
    cc, cpu = ["/usr/bin/cc"], "x86_64\nflags=sse avx2"
    key = cpu_experts.cache_key("int x;", cpu_experts.FLAGS, cc, cpu)
    assert key == cpu_experts.cache_key("int x;", cpu_experts.FLAGS, cc, cpu)
    assert key != cpu_experts.cache_key("int x; ", cpu_experts.FLAGS, cc, cpu)
    assert key != cpu_experts.cache_key("int x;", (*cpu_experts.FLAGS, "-g"), cc, cpu)
    assert key != cpu_experts.cache_key("int x;", cpu_experts.FLAGS, ["/usr/bin/clang"], cpu)
    assert key != cpu_experts.cache_key("int x;", cpu_experts.FLAGS, cc, cpu + " avx512f")


CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Some CPU @ 3.00GHz
flags\t\t: fpu sse2  avx2

processor\t: 1
model name\t: Another CPU
flags\t\t: fpu
"""


def test_the_cpu_is_named_by_its_first_processors_model_and_flags(tmp_path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(CPUINFO)
    lines = cpu_experts.host_cpu(info).splitlines()
    assert lines[1:] == ["flags=fpu sse2 avx2", "model name=Some CPU @ 3.00GHz"]
    info.write_text(CPUINFO.replace("avx2", "avx2 avx512f"))
    assert cpu_experts.host_cpu(info).splitlines()[1] == "flags=fpu sse2 avx2 avx512f"
    assert cpu_experts.host_cpu(tmp_path / "missing").splitlines() == lines[:1]  # the machine


def test_a_library_built_for_another_cpu_is_not_loaded_here(tmp_path) -> None:
    source, cc = "int strata_x;\n", cpu_experts.compiler()
    mine = cpu_experts.build(source, cc, tmp_path)
    assert cpu_experts.build(source, cc, tmp_path) == mine  # found again, same CPU
    other = cpu_experts.build(source, cc, tmp_path, cpu=cpu_experts.host_cpu() + " avx512f")
    assert other != mine
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, other.name])


def test_a_failed_compile_says_what_the_compiler_said(tmp_path) -> None:
    with pytest.raises(CpuExpertsUnavailable, match=r"(?s)with .* failed \(exit \d+\):\n.*error"):
        cpu_experts.build("this is not C;\n", cpu_experts.compiler(), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_missing_compiler_is_named(monkeypatch) -> None:
    monkeypatch.setenv("CC", "no-such-cc-strata")
    with pytest.raises(CpuExpertsUnavailable, match=r"no C compiler found.*no-such-cc-strata"):
        cpu_experts.compiler()
