"""The CPU's share of the experts in RAM (``cpu_share``): while the GPU's kernels read some of a
layer's chosen RAM experts over PCIe, the CPU computes the others (``kernels.cpu_experts``, on
its own threads) from the same page-locked homes, and the step adds its sum after the GPU's.

On a GPU each step's kernels post the layer's job into a mailbox in page-locked memory and a
pool's server thread answers (no host in the loop, so the step stays one CUDA graph); on the CPU
device the step runs each job itself, in order."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from strata.engine.errors import EngineError
from strata.engine.experts import ExpertProvider
from strata.engine.experts.host import HostTier
from strata.engine.gpu.buffers import ExpertGeometry, StepBuffers, aligned
from strata.engine.kernels import moe

log = logging.getLogger(__name__)

# how long a step's wait for the CPU's answer may last before it gives up (a guard against a
# hang, far beyond any answer's time), and how long each arm keeps the server spinning (longer
# than a step)
CPU_WAIT_LIMIT_NS = 2_000_000_000
CPU_ARM_S = 0.5
# the shares an automatic cpu_share tries at load (GpuRunner.tune_cpu_share), the rounds it
# times them in, and how much slower than the fastest a smaller share may be and still be
# chosen (the CPU's cores are the desktop's too: a share that buys less is not worth them)
CPU_SHARE_CANDIDATES = (0.0, 0.25, 0.375, 0.5, 0.625, 0.75)
CPU_SHARE_ROUNDS = 3
CPU_SHARE_SLACK = 0.03


def round_orders(candidates: Sequence[float], rounds: int) -> list[list[float]]:
    """The order each timing round visits the shares in: forward, then backward, and so on,
    so that no share is always timed right after the same one (a pool's threads waking, the
    clocks settling) and each share's median is over rounds spread across the timing."""
    fwd = list(candidates)
    return [fwd if r % 2 == 0 else fwd[::-1] for r in range(rounds)]


def check_timing(candidates: Sequence[float], steps: int, rounds: int) -> None:
    """Refuse a timing of shares outside [0, 1], or of fewer than one round or step."""
    for share in candidates:
        if isinstance(share, bool) or not 0 <= share <= 1:
            raise ValueError(f"cpu_share candidate {share}: must be between 0 and 1")
    if rounds < 1 or steps < 1:
        raise ValueError(f"cpu_share timing: rounds {rounds} and steps {steps} must be >= 1")


def timing_note(best: float, times: Mapping[float, Sequence[float]], steps: int) -> str:
    """The log's line for a timing: the share kept, and each share's median and range."""
    each = ", ".join(
        f"{s:g}: {statistics.median(ts):.2f} ({min(ts):.2f}-{max(ts):.2f})"
        for s, ts in times.items()
    )
    rounds = max(len(ts) for ts in times.values())
    return (
        f"cpu_share {best:g}, chosen by timing {rounds} rounds of {steps} steps at each share "
        f"(the smallest within {CPU_SHARE_SLACK:.0%} of the fastest; median ms per step, "
        f"min-max: {each})"
    )


def choose_share(times: Mapping[float, Sequence[float]], slack: float = CPU_SHARE_SLACK) -> float:
    """The share to keep from ``times`` (ms per step by share, one per round): each share's
    median over its rounds, then the smallest share within ``slack`` of the fastest median."""
    if not times or any(not ts for ts in times.values()):
        raise ValueError("choose_share: every share needs at least one timing")
    if not 0 <= slack < 1:
        raise ValueError(f"choose_share: slack {slack} must be in [0, 1)")
    med = {s: statistics.median(ts) for s, ts in times.items()}
    fastest = min(med.values())
    return min(s for s, m in med.items() if m <= fastest * (1 + slack))


@dataclass(frozen=True)
class CpuExtras:
    """What gpt-oss's experts add, for the CPU's jobs: per local layer the biases (gate, up
    [E, F], down [E, D]; None: none) and the clamped SwiGLU's (alpha, limit) (None: SiLU)."""

    biases: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]
    oai: tuple[float, float] | None

    @property
    def by_id(self) -> bool:
        """Whether the jobs need the chosen experts' ids (their biases' rows)."""
        return any(b is not None for b in self.biases)


class CpuShareFault(EngineError):
    """A decode step waited for the CPU's share of the experts in vain: its output is wrong
    (the message says why). The runner has turned the CPU share off."""


def check_share(share: object) -> float:
    if isinstance(share, bool) or not isinstance(share, (int, float)):
        raise ValueError(f"cpu_share={share!r}: must be a number between 0 and 1")
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"cpu_share={share}: must be between 0 and 1")
    return float(share)


class CpuShare:
    """``extras``: per layer, what gpt-oss's experts add on the CPU too (``CpuExtras``)."""

    def __init__(self, buf: StepBuffers, geometry: ExpertGeometry, n_layer: int,
                 n_used: int, extras: CpuExtras | None = None) -> None:  # fmt: skip
        self.buf, self.geometry, self.n_layer, self.n_used = buf, geometry, n_layer, n_used
        self.extras = extras
        self.device = buf.anchor.device
        self.share = 0.0
        self.now = torch.zeros(1, dtype=torch.float32, device=self.device)  # what kernels read
        self.tuned: dict[float, float] = {}  # median ms per step by share (the runner's timing)
        self.cpu = None  # CpuExperts, while a share is set and the CPU kernels run here
        self.jobs: list = []
        self.reason: str | None = None  # why a share asked for is not taken here

    @property
    def on(self) -> bool:
        return self.cpu is not None

    def path_note(self, sharing: bool) -> str:
        """The decode path's words for the share (empty when off): how much, whether any expert
        is in RAM now (``sharing``), and the types whose CPU kernels read an int8 input."""
        if self.cpu is None:
            return ""
        from strata.engine.kernels import cpu_experts

        note = f"; the CPU computes {self.share:.0%} of the chosen experts in RAM"
        types = {lay.qtype for slot in self.geometry.slot_layouts for lay in slot.layouts}
        int8 = sorted(t.name for t in types if cpu_experts.int8_input(t))
        if int8:
            note += f" ({', '.join(int8)} with an int8 input, as llama.cpp's CPU kernels)"
        if not sharing:
            note += " (none is in RAM now: every expert has a VRAM slot)"
        return note

    def set(self, share: float, threads: int, tier: HostTier | None) -> None:
        """Let the CPU compute ``share`` (0 to 1) of each layer's chosen RAM experts on
        ``threads`` threads; 0: none. Where the CPU kernels cannot run here (no C compiler, a
        type they lack) the log says why and the GPU reads every one."""
        share = check_share(share)
        self.close()
        self.share = share
        self.now.fill_(share)
        self.tuned = {}
        if share == 0:
            return
        from strata.engine.kernels import cpu_experts

        cuda = self.device.type == "cuda"
        try:
            cpu = cpu_experts.CpuExperts(threads)
        except cpu_experts.CpuExpertsUnavailable as e:
            self._refuse(str(e))
            return
        try:
            jobs = [cpu.job(lay, self.n_used, pin=cuda) for lay in self.geometry.slot_layouts]
            if self.extras is not None:
                for job, biases in zip(jobs, self.extras.biases, strict=True):
                    job.set_extras(biases, self.extras.oai)
        except ValueError as e:  # a type the CPU kernels lack
            cpu.close()
            self._refuse(str(e))
            return
        L, dev, buf = self.n_layer, self.device, self.buf
        self.cpu, self.jobs, self.reason = cpu, jobs, None
        self.done = torch.zeros(L, dtype=torch.int64, device=dev)
        # the slot a CPU-computed expert's entry points at: zeros, so the GPU adds nothing
        self.zero_slot = aligned(self.geometry.staging_bytes, dev)
        self.zero_off = buf.offset(self.zero_slot)
        # on a GPU the pool's server answers the posts of each step's kernels (no host in the
        # loop); on the CPU device the step runs each job itself, in order
        mb = cpu.serve(jobs, pin=True) if cuda else None
        self.seq = torch.zeros(1, dtype=torch.int64, device=dev)
        self.posted = torch.zeros(L, dtype=torch.int32, device=dev)
        a = buf.anchor.data_ptr()
        self.posts = [self._post(i, job, mb, a) for i, job in enumerate(jobs)]
        if tier is not None:
            self.set_base(tier)

    def _post(self, i: int, job: object, mb: object, a: int) -> moe.CpuPost:
        """Where layer ``i``'s kernels post its job and find its answer (offsets from the
        anchor ``a``)."""
        return moe.CpuPost(
            base=self.buf.anchor, req=job.request.data_ptr() - a, y=job.y.data_ptr() - a,
            mb=0 if mb is None else mb.address - a, seq=self.seq,
            posted=self.posted[i : i + 1], job=i, post=mb is not None,
        )  # fmt: skip

    def _refuse(self, why: str) -> None:
        self.reason = why
        log.warning("cpu_share=%g: the CPU computes no expert here: %s", self.share, why)

    def set_base(self, tier: HostTier) -> bool:
        """Where the CPU reads the RAM homes: the split writes each chosen home as the GPU reads
        it (its offset from the anchor), so each job's base is the anchor's address turned into
        a host address. False, with the share off and the log saying why, where the tier's
        memory has no such single offset."""
        if self.cpu is None:
            return True
        delta = tier.host_minus_device() if self.device.type == "cuda" else 0
        if delta is None:
            self.close()
            self._refuse(
                "the host tier's memory has no single offset from its device addresses to its "
                "host addresses"
            )
            return False
        for job in self.jobs:
            job.base = self.buf.anchor.data_ptr() + delta
        return True

    def send(self, layer: int, homes: torch.Tensor) -> None:
        """Hand the CPU its share of the layer's RAM experts: the split (their entries then add
        nothing on the GPU), their choice and the input written into the layer's job, and on a
        GPU the job posted to the pool's server, which runs it while the expert kernels read the
        others; on the CPU device the job runs now."""
        b, to = self.buf, self.posts[layer]
        moe.post_for_cpu(
            b.ids[layer], b.wts[layer], b.eoffs[layer], homes, self.done[layer : layer + 1],
            b.h, self.zero_off, self.now, to, self.extras is not None and self.extras.by_id,
        )  # fmt: skip
        if not to.post:  # the CPU device (Triton's interpreter): in order
            self.jobs[layer].run()

    def take(self, layer: int) -> None:
        """Add the CPU's sum for the layer to the residual stream (after the GPU's experts)."""
        to = self.posts[layer]
        if to.post:
            moe.collect_from_cpu(self.buf.x, to, CPU_WAIT_LIMIT_NS)
        else:
            self.buf.x.add_(self.jobs[layer].y)

    def arm(self) -> None:
        """Keep the pool's server spinning through the steps queued next."""
        if self.cpu is not None:
            self.cpu.arm(CPU_ARM_S)

    def fault(self) -> str | None:
        """Why a step's wait for the CPU's answer gave up (its output is wrong), or None."""
        mb = self.cpu.mailbox if self.cpu is not None else None
        if mb is None or not mb.fault:
            return None
        if mb.fault == 1:
            return (
                f"a decode step waited more than {CPU_WAIT_LIMIT_NS / 1e9:g} s for the CPU's "
                "share of the experts"
            )
        return "the CPU's server got a post of no job"

    def count(self, provider: ExpertProvider) -> None:
        """The chosen RAM experts the CPU computed (their reads are counted as RAM reads
        already), and their bytes: what went to the CPU instead of over PCIe."""
        if self.cpu is None:
            return
        done = self.done.to("cpu", copy=True).tolist()
        self.done.zero_()
        stats = provider.stats
        for layer, n in enumerate(done):
            stats.cpu_computed += n
            stats.bytes_cpu += n * self.geometry.expert_bytes[layer]

    def zero(self) -> None:
        if self.cpu is not None:
            self.done.zero_()

    def close(self) -> None:
        if self.cpu is not None:
            self.jobs = []
            self.cpu.close()
            self.cpu = None
