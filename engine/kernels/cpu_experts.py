"""A few MoE experts' FFN for one token on the CPU, from the experts' repacked bytes in host RAM.

While the GPU reads the experts that are not in VRAM over PCIe, the CPU can compute a share of
them from the same host bytes. ``cpu_experts.c`` does that with a pool of threads and no Python:
a job is a C struct of pointers (the slots' base and per-expert offsets, routing weights, input,
output, scratch) whose values are read when it runs. During a GPU decode a server thread of the
pool runs the jobs a GPU kernel posts into a mailbox in page-locked memory (``CpuExperts.serve``;
``moe.post_for_cpu`` and ``moe.collect_from_cpu`` are the GPU's side), with no Python and no
driver call in between. From Python, ``CpuJob.run`` calls a job through ctypes, which releases
the GIL.

The library is compiled on first use with the system's C compiler (``$CC``, default ``cc``) and
``-march=native``, so its loops use this machine's vector width, and on x86 with AVX2 or
AVX-512BW its integer dot products for the types ``int8_input`` names (their input quantised to
int8, as llama.cpp's CPU kernels do: ~1% on an expert's output). The result is cached under
``$XDG_CACHE_HOME/strata/kernels`` in a file named by a hash of the source, the flags, the
compiler and the CPU (its model and feature flags), so an edited source, another compiler or a
home directory now used on another machine builds a new file (a library built for one CPU's
instructions may stop another with SIGILL), and it is renamed into place whole, so a process
never loads a half-written one. Without a working compiler ``library``
raises ``CpuExpertsUnavailable`` saying why, and the caller keeps every expert on the GPU.

``python -m strata.bench.cpu_experts`` measures the throughput (GB/s of weight bytes).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from strata.engine import cpuinfo
from strata.engine.quant.expert_layout import KernelSlotLayout
from strata.engine.quant.formats import FORMATS
from strata.engine.quant.grids import IQ3_S_GRID, IQ3_XXS_GRID
from strata.engine.quant.repack import PLANES, RepackedLayout
from strata.paths import cache_dir

log = logging.getLogger(__name__)

Q = gguf.GGMLQuantizationType
SOURCE = Path(__file__).with_name("cpu_experts.c")
FLAGS = ("-std=c11", "-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-pthread",
         "-shared", "-fPIC")  # fmt: skip
LIBS = ("-lm",)
MAX_PLANES = 5  # STRATA_MAX_PLANES in the C source: Q4_K and Q5_K have five planes
assert max(len(p) for p in PLANES.values()) <= MAX_PLANES


class CpuExpertsUnavailable(RuntimeError):
    """The CPU expert library cannot be built or loaded here (the message says why)."""


# -- the C structs, field for field -----------------------------------------------------------


class StrataMat(ctypes.Structure):
    _fields_ = [
        ("qtype", ctypes.c_int32),
        ("rows", ctypes.c_int32),
        ("cols", ctypes.c_int32),
        ("offset", ctypes.c_int64),
        ("planes", ctypes.c_int64 * MAX_PLANES),
    ]


class StrataJob(ctypes.Structure):
    _fields_ = [
        ("gate", StrataMat),
        ("up", StrataMat),
        ("down", StrataMat),
        ("D", ctypes.c_int32),
        ("F", ctypes.c_int32),
        ("kmax", ctypes.c_int32),
        ("n", ctypes.c_void_p),
        ("wts", ctypes.c_void_p),
        ("offs", ctypes.c_void_p),
        ("base", ctypes.c_int64),
        ("h", ctypes.c_void_p),
        ("y", ctypes.c_void_p),
        ("act", ctypes.c_void_p),
        ("pool", ctypes.c_void_p),
        ("ids", ctypes.c_void_p),
        ("bias_gate", ctypes.c_void_p),
        ("bias_up", ctypes.c_void_p),
        ("bias_down", ctypes.c_void_p),
        ("oai", ctypes.c_int32),
        ("alpha", ctypes.c_float),
        ("limit", ctypes.c_float),
    ]


# -- building and loading ---------------------------------------------------------------------


def compiler() -> list[str]:
    """The compiler command (``$CC``, default ``cc``), its program resolved to a path."""
    cc = shlex.split(os.environ.get("CC", "cc")) or ["cc"]
    path = shutil.which(cc[0])
    if path is None:
        raise CpuExpertsUnavailable(f"no C compiler found (CC={cc[0]!r} is not on PATH)")
    return [path, *cc[1:]]


def host_cpu(path: Path = cpuinfo.CPUINFO) -> str:
    """What ``-march=native`` compiles for: the machine, and the first processor's model and
    feature flags from ``path`` (the machine alone where that cannot be read)."""
    wanted = ("model name", "flags", "features", "cpu model", "isa")  # x86, Arm, others
    first = (cpuinfo.processors(path) or [{}])[0]
    return "\n".join(
        [platform.machine(), *(f"{k}={first[k]}" for k in sorted(first) if k in wanted)]
    )


def cache_key(source: str, flags: tuple[str, ...], cc: list[str], cpu: str) -> str:
    """The library's file name: a hash of everything that decides its contents."""
    h = hashlib.sha256()
    for part in (source, *flags, *cc, cpu):
        h.update(part.encode())
        h.update(b"\0")
    return f"cpu_experts-{h.hexdigest()[:20]}.so"


compiles = 0  # how many times this process ran the compiler (the tests check the cache with it)


def build(source: str, cc: list[str], where: Path, cpu: str | None = None) -> Path:
    """The compiled library of ``source`` in ``where`` for ``cpu`` (default: this one): the
    cached file, or compiled now into a temporary file beside it and renamed into place (atomic:
    a concurrent process finds the whole file or none; two compiling at once both write whole
    files)."""
    global compiles
    target = where / cache_key(source, FLAGS + LIBS, cc, host_cpu() if cpu is None else cpu)
    if target.exists():
        return target
    try:
        where.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=where, prefix=".cpu_experts-", suffix=".so.tmp")
        os.close(fd)
    except OSError as e:
        raise CpuExpertsUnavailable(f"cannot write the kernel cache {where}: {e}") from e
    src = Path(tmp).with_suffix(".c")
    try:
        src.write_text(source)
        cmd = [*cc, *FLAGS, "-o", tmp, str(src), *LIBS]
        log.info("compiling the CPU expert kernels: %s", shlex.join(cmd))
        compiles += 1
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise CpuExpertsUnavailable(f"the C compiler {cc[0]} could not run: {e}") from e
        if done.returncode != 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
            raise CpuExpertsUnavailable(
                f"compiling {SOURCE.name} with {cc[0]} failed (exit {done.returncode}):\n{tail}"
            )
        os.replace(tmp, target)
    finally:
        for leftover in (tmp, src):
            Path(leftover).unlink(missing_ok=True)
    return target


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    vp, i32 = ctypes.c_void_p, ctypes.c_int32
    lib.strata_pool_new.argtypes, lib.strata_pool_new.restype = [ctypes.c_int], vp
    lib.strata_pool_free.argtypes, lib.strata_pool_free.restype = [vp], None
    lib.strata_run_job.argtypes, lib.strata_run_job.restype = [vp], None
    lib.strata_supported.argtypes, lib.strata_supported.restype = [i32], ctypes.c_int
    lib.strata_type_layout.argtypes = [i32, ctypes.POINTER(ctypes.c_int32)]
    lib.strata_type_layout.restype = ctypes.c_int
    lib.strata_pool_serve.argtypes = [vp, vp, ctypes.POINTER(vp), ctypes.c_int]
    lib.strata_pool_serve.restype = ctypes.c_int
    lib.strata_pool_arm.argtypes, lib.strata_pool_arm.restype = [vp, ctypes.c_int64], None
    lib.strata_mailbox_layout.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    lib.strata_mailbox_layout.restype = None
    lib.strata_job_bytes.argtypes, lib.strata_job_bytes.restype = [], ctypes.c_size_t
    lib.strata_pool_stats.argtypes = [vp, ctypes.POINTER(ctypes.c_int64)]
    lib.strata_pool_stats.restype = None
    fp = ctypes.POINTER(ctypes.c_float)
    lib.strata_set_grids.argtypes, lib.strata_set_grids.restype = [fp, i32, fp, i32], ctypes.c_int
    lib.strata_int8_input.argtypes, lib.strata_int8_input.restype = [i32], ctypes.c_int
    lib.strata_quantize.argtypes = [fp, ctypes.c_int, vp, fp, fp]
    lib.strata_quantize.restype = ctypes.c_int
    lib.strata_dot.argtypes = [ctypes.POINTER(StrataMat), vp, ctypes.c_int, fp]
    lib.strata_dot.restype = ctypes.c_float
    return lib


def _set_grids(lib: ctypes.CDLL) -> bool:
    """Hand the library the grid types' grids as float32 rows of 4 (from their descriptions,
    ``quant.grids``): it reads those, not each matrix's byte plane of the same values."""
    rows = [np.frombuffer(g, dtype=np.uint8).astype(np.float32) for g in (IQ3_XXS_GRID, IQ3_S_GRID)]
    ptrs = [r.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) for r in rows]
    return bool(lib.strata_set_grids(ptrs[0], rows[0].size // 4, ptrs[1], rows[1].size // 4))


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """The compiled library, built (or found in the cache) once per process. Raises
    ``CpuExpertsUnavailable`` saying why it cannot be had."""
    global _lib
    with _lock:
        if _lib is None:
            path = build(SOURCE.read_text(), compiler(), cache_dir() / "kernels")
            try:
                lib = _declare(ctypes.CDLL(str(path)))
            except (OSError, AttributeError) as e:
                raise CpuExpertsUnavailable(f"the library {path} would not load: {e}") from e
            if lib.strata_job_bytes() != ctypes.sizeof(StrataJob):
                raise CpuExpertsUnavailable(
                    f"{path}: strata_job is {lib.strata_job_bytes()} bytes in C, "
                    f"{ctypes.sizeof(StrataJob)} in the ctypes mirror"
                )
            if wrong := layout_mismatches(lib):
                raise CpuExpertsUnavailable(
                    f"{path} reads types unlike their descriptions: {wrong}"
                )
            if not _set_grids(lib):
                raise CpuExpertsUnavailable(f"{path} refused the grids of IQ3_XXS and IQ3_S")
            _lib = lib
        return _lib


def layout_mismatches(lib: ctypes.CDLL) -> str:
    """The types whose block or plane sizes in the library differ from their descriptions
    (``quant.formats``), as text; empty when every type the library computes agrees."""
    out = (ctypes.c_int32 * (2 + MAX_PLANES))()
    wrong = []
    for q, f in FORMATS.items():
        if not lib.strata_type_layout(int(q), out):
            continue
        want = [f.block, len(f.planes), *(p.block_bytes for p in f.planes)]
        want += [0] * (2 + MAX_PLANES - len(want))
        if list(out) != want:
            wrong.append(f"{q.name} {list(out)} (described: {want})")
    return "; ".join(wrong)


# -- the Python side --------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolStats:
    """A pool's jobs so far: how many computed an expert, the seconds from their start to their
    end on the calling thread, and of those the seconds until every thread ended phase 1 (gate
    and up)."""

    jobs: int
    busy_s: float
    phase1_s: float


class CpuExperts:
    """A pool of ``threads`` threads (the caller of a job counts as one) and the jobs on it.
    No two jobs of one pool may run at the same time: the caller serialises them (the pool's
    server, or one Python caller)."""

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"threads={threads}: a CPU expert pool needs at least 1 thread")
        self.lib = library()
        self.threads = threads
        pool = self.lib.strata_pool_new(threads)
        if not pool:
            raise RuntimeError(f"strata_pool_new({threads}) failed: its threads did not start")
        self.pool: int = pool
        # what the C side points at while the pool lives (a server's jobs and mailbox): freed
        # after the pool, never before
        self._keep: list[object] = []
        self._free = weakref.finalize(self, _free_pool, self.lib, pool, self._keep)
        self.mailbox: Mailbox | None = None

    @property
    def closed(self) -> bool:
        return not self._free.alive

    def close(self) -> None:
        """Join the threads and free the pool (once; later calls do nothing). Its jobs must not
        run afterwards (``CpuJob.run`` refuses; a CUDA graph holding one must be gone)."""
        self._free()

    def serve(self, jobs: list[CpuJob], pin: bool) -> Mailbox:
        """Start the pool's server: a thread that runs ``jobs[i]`` whenever a device posts
        ``i`` to the returned mailbox (page-locked when ``pin``), until the pool closes.
        ``moe.post_for_cpu`` posts; ``moe.collect_from_cpu`` waits for the answer. Once per
        pool; arm the pool (``arm``) before each decode step."""
        if self.closed:
            raise RuntimeError("this CpuExperts is closed")
        if self.mailbox is not None:
            raise RuntimeError("this CpuExperts serves a mailbox already")
        if not jobs:
            raise ValueError("a server needs at least one job")
        for i, job in enumerate(jobs):
            if job.experts is not self:
                raise ValueError(f"job {i} belongs to another CpuExperts")
        mb = Mailbox(pin)
        ptrs = (ctypes.c_void_p * len(jobs))(*(j.arg_address for j in jobs))
        self._keep += [mb] + [j.buffers for j in jobs]
        if self.lib.strata_pool_serve(self.pool, mb.address, ptrs, len(jobs)) != 0:
            raise RuntimeError("strata_pool_serve failed: its server thread did not start")
        self.mailbox = mb
        return mb

    def arm(self, seconds: float) -> None:
        """Keep the server spinning for the next ``seconds`` (a step is about to post)."""
        if not self.closed and self.mailbox is not None:
            self.lib.strata_pool_arm(self.pool, int(seconds * 1e9))

    def stats(self) -> PoolStats:
        """What the pool's jobs took so far (0 everywhere once closed)."""
        if self.closed:
            return PoolStats(0, 0.0, 0.0)
        out = (ctypes.c_int64 * 3)()
        self.lib.strata_pool_stats(self.pool, out)
        return PoolStats(out[0], out[1] / 1e9, out[2] / 1e9)

    def supports(self, qtype: Q | int) -> bool:
        return bool(self.lib.strata_supported(int(qtype)))

    def job(self, layout: KernelSlotLayout, kmax: int, pin: bool) -> CpuJob:
        """A job for up to ``kmax`` experts of ``layout``, its buffers page-locked when ``pin``.
        Raises ValueError naming the matrix and its type when the library cannot compute that
        type, or naming a shape that does not fit."""
        if self.closed:
            raise RuntimeError("this CpuExperts is closed")
        if kmax < 1:
            raise ValueError(f"kmax={kmax}: a job computes up to at least 1 expert")
        for name, lay in zip(("gate", "up", "down"), layout.layouts, strict=True):
            if not self.supports(lay.qtype):
                raise ValueError(
                    f"{name}: the CPU expert kernels do not compute {Q(lay.qtype).name}"
                )
        F, D = layout.gate.rows, layout.gate.cols
        want = {"gate": (F, D), "up": (F, D), "down": (D, F)}
        for (name, shape), lay in zip(want.items(), layout.layouts, strict=True):
            if (lay.rows, lay.cols) != shape:
                raise ValueError(
                    f"{name} is {lay.rows} x {lay.cols}, expected {shape[0]} x {shape[1]} "
                    "(gate and up F x D, down D x F)"
                )
        return CpuJob(self, layout, kmax, pin)


def _free_pool(lib: ctypes.CDLL, pool: int, keep: list[object]) -> None:
    lib.strata_pool_free(pool)
    keep.clear()


@dataclass(frozen=True)
class MailboxLayout:
    """Byte offsets of the mailbox's fields, and its size (from the library)."""

    seq: int
    job: int
    done: int
    fault: int
    size: int


def mailbox_layout() -> MailboxLayout:
    out = (ctypes.c_int64 * 5)()
    library().strata_mailbox_layout(out)
    return MailboxLayout(*out)


class Mailbox:
    """Where a device posts jobs to a pool's server: 64-byte-aligned host memory (page-locked
    when ``pin``, so a GPU maps it) holding ``seq`` (the last post), ``job`` (which job),
    ``done`` (the last post answered) and ``fault`` (1: a device's wait gave up; 2: a post named
    no job). The GPU writes seq and job; the server writes done."""

    def __init__(self, pin: bool) -> None:
        lay = mailbox_layout()
        raw = torch.zeros(lay.size + 64, dtype=torch.uint8, pin_memory=pin)
        at = -raw.data_ptr() % 64
        self._raw = raw  # owns the memory
        self.buf = raw[at : at + lay.size]
        self.address = self.buf.data_ptr()
        self.layout = lay
        # the fields as C values over that memory: a read costs what a load costs (the decoder
        # reads the fault whenever it takes a step's result)
        at = self.address
        self._seq = ctypes.c_int64.from_address(at + lay.seq)
        self._job = ctypes.c_int32.from_address(at + lay.job)
        self._done = ctypes.c_int64.from_address(at + lay.done)
        self._fault = ctypes.c_int32.from_address(at + lay.fault)

    @property
    def posted(self) -> int:
        return self._seq.value

    @property
    def answered(self) -> int:
        return self._done.value

    @property
    def fault(self) -> int:
        return self._fault.value

    def post(self, job: int) -> int:
        """Post ``job`` from the host (what a device kernel does; for tests and tools):
        returns the post's seq."""
        seq = self.posted + 1
        self._job.value = job
        self._seq.value = seq
        return seq


def _mat(lay: RepackedLayout, offset: int) -> StrataMat:
    planes = (ctypes.c_int64 * MAX_PLANES)(*lay.offsets)  # unused ones stay 0
    return StrataMat(int(lay.qtype), lay.rows, lay.cols, offset, planes)


def int8_input(qtype: int) -> bool:
    """Whether this machine's kernels of ``qtype`` read their input quantised to int8 (a unit of
    32 values on one scale, integer dot products: the K-quants, the IQ4 types, MXFP4 and IQ3_S
    where x86's AVX2 or AVX-512BW is there), so their results differ from the float kernels' by
    that rounding of the input."""
    return bool(library().strata_int8_input(int(qtype)))


def row_dot(
    lay: RepackedLayout, data: torch.Tensor, row: int, x: torch.Tensor,
    lib: ctypes.CDLL | None = None,
) -> float:  # fmt: skip
    """Row ``row`` of the repacked matrix ``data`` (uint8, ``lay``'s bytes, on the CPU) times
    ``x`` (float32 [cols]) as a job's kernels compute it, the input prepared as a job prepares
    it: for the tests and the bench (``lib``: a build of the library other than ``library()``,
    declared). Raises ValueError for what the library cannot compute."""
    if data.dtype != torch.uint8 or data.device.type != "cpu" or data.numel() < lay.nbytes:
        raise ValueError(f"want {lay.nbytes} uint8 bytes on the CPU, got {data.numel()} "
                         f"{data.dtype} on {data.device}")  # fmt: skip
    if x.dtype != torch.float32 or x.numel() != lay.cols or not x.is_contiguous():
        raise ValueError(f"want {lay.cols} contiguous float32 inputs, got {x.numel()} {x.dtype}")
    if not 0 <= row < lay.rows:
        raise ValueError(f"row {row} of a {lay.rows}-row matrix")
    lib = library() if lib is None else lib
    if not lib.strata_supported(int(lay.qtype)):
        raise ValueError(f"the CPU kernels do not compute {lay.qtype.name}")
    data = data.contiguous()
    xp = ctypes.cast(x.data_ptr(), ctypes.POINTER(ctypes.c_float))
    return float(lib.strata_dot(ctypes.byref(_mat(lay, 0)), data.data_ptr(), row, xp))


def request_offsets(D: int, kmax: int) -> tuple[int, int, int, int]:
    """Byte offsets in a job's request of its offs (int64 [kmax]), wts (float32 [kmax]), n
    (int32 [1]) and h (float32 [D]): the one description of the layout, which ``request_views``
    and the GPU's ``moe.post_for_cpu`` both follow."""
    return 0, 8 * kmax, 12 * kmax, 12 * kmax + 4


def request_ids_offset(D: int, kmax: int) -> int:
    """Byte offset in a job's request of the chosen experts' ids (int32 [kmax], after h):
    written only for experts with biases (gpt-oss), whose rows they find."""
    return request_offsets(D, kmax)[3] + 4 * D


def request_bytes(D: int, kmax: int) -> int:
    """Bytes of a job's request (``request_views``, then the ids), a multiple of 16."""
    return -(-(request_ids_offset(D, kmax) + 4 * kmax) // 16) * 16


def request_views(
    buf: torch.Tensor, D: int, kmax: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A job's inputs as views of one 16-byte-aligned uint8 buffer of ``request_bytes``, so one
    write fills them all: (offs int64 [kmax], wts float32 [kmax], n int32 [1], h float32 [D]),
    at ``request_offsets``, each aligned for its type."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < request_bytes(D, kmax):
        raise ValueError(
            f"a request of D={D}, kmax={kmax} needs a 1-D uint8 buffer of "
            f"{request_bytes(D, kmax)} bytes, got {buf.dtype} {tuple(buf.shape)}"
        )
    o, w, n, h = request_offsets(D, kmax)
    return (
        buf[o:w].view(torch.int64),
        buf[w:n].view(torch.float32),
        buf[n : n + 4].view(torch.int32),
        buf[h : h + 4 * D].view(torch.float32),
    )


class CpuJob:
    """The buffers of one job and the C struct that points at them. ``n``, ``wts``, ``offs`` and
    ``h`` are read when the job runs: write them in place (a GPU copy, torch ops), never rebind
    them; they are views of one buffer, ``request`` (``request_views``: one copy fills them
    all). Expert i's slot is at address ``base + offs[i]``; ``y`` is the result."""

    def __init__(self, experts: CpuExperts, layout: KernelSlotLayout, kmax: int, pin: bool):
        self.experts = experts  # the pool (and the library) live as long as the job
        self.layout = layout
        self.kmax = kmax
        F, D = layout.gate.rows, layout.gate.cols

        def buf(size: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(size, dtype=dtype, pin_memory=pin)

        self.request = buf(request_bytes(D, kmax), torch.uint8)
        self.offs, self.wts, self.n, self.h = request_views(self.request, D, kmax)
        at = request_ids_offset(D, kmax)
        self.ids = self.request[at : at + 4 * kmax].view(torch.int32)  # [kmax]
        self.extras: tuple[torch.Tensor, ...] = ()  # what bias pointers point at
        self.y = buf(D, torch.float32)  # [D]
        self.act = buf(kmax * F, torch.float32)  # [kmax * F]
        self.struct = StrataJob(
            gate=_mat(layout.gate, layout.offsets[0]),
            up=_mat(layout.up, layout.offsets[1]),
            down=_mat(layout.down, layout.offsets[2]),
            D=D,
            F=F,
            kmax=kmax,
            n=self.n.data_ptr(),
            wts=self.wts.data_ptr(),
            offs=self.offs.data_ptr(),
            base=0,
            h=self.h.data_ptr(),
            y=self.y.data_ptr(),
            act=self.act.data_ptr(),
            pool=experts.pool,
        )

    @property
    def base(self) -> int:
        """The host address the offsets count from."""
        return self.struct.base

    @base.setter
    def base(self, value: int) -> None:
        self.struct.base = value

    def set_extras(self, biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
                   oai: tuple[float, float] | None) -> None:  # fmt: skip
        """gpt-oss's experts: ``biases`` (gate, up: float32 [E, F], down: [E, D], on the CPU),
        found by the ids the request carries; ``oai`` (alpha, limit): the clamped SwiGLU.
        Before the job first runs."""
        F, D = self.layout.gate.rows, self.layout.gate.cols
        if biases is not None:
            g, u, d = (b.detach().to("cpu", torch.float32).contiguous() for b in biases)
            if g.shape[1:] != (F,) or u.shape != g.shape or d.shape != (g.shape[0], D):
                raise ValueError(f"expert biases {tuple(g.shape)}, {tuple(u.shape)}, "
                                 f"{tuple(d.shape)} for experts of {F} x {D}")  # fmt: skip
            self.extras = (g, u, d)
            self.struct.ids = self.ids.data_ptr()
            self.struct.bias_gate, self.struct.bias_up, self.struct.bias_down = (
                t.data_ptr() for t in self.extras
            )
        if oai is not None:
            self.struct.oai, self.struct.alpha, self.struct.limit = 1, oai[0], oai[1]

    @property
    def buffers(self) -> tuple[object, ...]:
        """What the C struct points at (kept alive while a server may run the job)."""
        return (self.struct, self.request, self.y, self.act, *self.extras)

    @property
    def arg_address(self) -> int:
        """The address of this job's struct (what the library's calls take)."""
        return ctypes.addressof(self.struct)

    def run(self) -> None:
        """Compute ``y`` now, on the calling thread and the pool's (the GIL is released)."""
        if self.experts.closed:
            raise RuntimeError("the CpuExperts of this job is closed")
        self.experts.lib.strata_run_job(self.arg_address)
