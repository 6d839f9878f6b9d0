"""The GPU decode path: one token per step through fused Triton kernels, replayed as one CUDA graph.

``FastDecoder`` owns every piece of device state a decode step touches besides the weights and
the K/V (which the model and the runner hold): the fixed input and output buffers, the per-layer
expert tables, the staging slots of expert misses and the captured graph. A step is, per layer:

    q/k/v matvec (RMSNorm folded in) -> q/k norm, RoPE, K/V write -> split attention (2 launches)
    -> output projection + residual -> router matvec (RMSNorm folded in) -> top-k
    -> gate/up/SiLU of the k experts -> down of the k experts + weights + residual

then the final norm and the output head: 9 launches per layer, all reading positions and lengths
from device memory, so one CUDA graph, captured at load, serves every step. The MoE kernels find
each expert through the layer's expert table (byte offsets from ``anchor``): the cache's arena
slots never move, and the tables are rewritten (one copy) whenever the cache changes, at safe
points only.

While some expert has no home the kernels can read (the cache holds less than every expert;
until the host tier exists) a step runs the same kernels eagerly instead: after each layer's top-k
the chosen ids come to the host, each miss is uploaded and repacked into a staging slot, and the
table entry is pointed at it before the expert kernels run. The numbers are the same either way.

Routing never leaves the device in a graph step; the top-k kernel counts each chosen expert in a
device table that the decoder hands to the provider's usage counts every ``USAGE_FLUSH_STEPS``
steps and before every cache plan.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from strata.engine.errors import EngineError
from strata.engine.experts.cache import ExpertCache
from strata.engine.experts.host import HostTier
from strata.engine.experts.provider import ExpertProvider, FileExpertProvider
from strata.engine.experts.slots import ExpertKey
from strata.engine.experts.table import (
    FILE,
    HOST,
    MISSING,
    VRAM,
    ExpertTablePlan,
    device_rows,
    plan_table,
    replan_entries,
)
from strata.engine.fast_prefill import FastPrefill
from strata.engine.kernels import moe, prefetch
from strata.engine.kernels.attention import DecodeAttention
from strata.engine.kernels.matvec import Mat, matvec
from strata.engine.kernels.rope import rope_store, rope_tables
from strata.engine.kernels.step import advance
from strata.engine.kv import KVCache
from strata.engine.layers.decoder import Block, MoEDecoder
from strata.engine.layers.norm import rms_norm
from strata.engine.quant import repack_kernels
from strata.engine.quant.expert_layout import RUN_ALIGN, align, kernel_layout
from strata.engine.weights import RepackedWeight, Weight, linear

if TYPE_CHECKING:
    from strata.engine.kernels.cpu_experts import CpuExperts, CpuJob

log = logging.getLogger(__name__)
_INTERP_BN = 128  # rows per program in Triton's interpreter: few, wide programs

USAGE_FLUSH_STEPS = 64
# chooses a greedy step's token another way (a grammar's mask): (logits, ring slot) -> None
Pick = Callable[[torch.Tensor, int], None]
VERIFY_SAMPLE = 8  # experts whose copies each adapt() checks, with verify_experts

# Rows per program and warps (None: one thread per unit of a step) of each launch, measured on an
# H200 with the profile tool's --sweep (``python -m strata.engine.bench.profile``) on the
# Qwen3-30B-A3B shapes; the kernels take any values, the interpreter its own (``kernels.dot``).
# down: 4 rows, not 8: the same speed from VRAM (295.9 against 295.7 tok/s with every expert
# cached), and its reads of experts in RAM over PCIe go at 47 GB/s, not 37 (more reads in
# flight; ``python -m strata.engine.bench.moe_sweep``). One value for both, so residency never
# changes a kernel's arithmetic.
TUNED: dict[str, tuple[int, int | None]] = {
    "qkv": (4, 8),
    "o": (8, None),
    "router": (2, None),
    "head": (4, 8),
    "gate_up": (4, None),
    "down": (4, None),
}
MAX_SPLITS = 64  # most splits of the attention's key range
# the CPU's share: how long a step's wait for the CPU's answer may last before it gives up (a
# guard against a hang, far beyond any answer's time), and how long each arm keeps the server
# spinning (longer than a step)
CPU_WAIT_LIMIT_NS = 2_000_000_000
CPU_ARM_S = 0.5
# the shares an automatic cpu_share tries at load (tune_cpu_share)
CPU_SHARE_CANDIDATES = (0.0, 0.25, 0.375, 0.5, 0.625, 0.75)


class FastPathError(RuntimeError):
    """The decode kernels cannot serve this model here; the message says why."""


class CpuShareFault(EngineError):
    """A decode step waited for the CPU's share of the experts in vain: its output is wrong
    (the message says why). The decoder has turned the CPU share off."""


def _mat(w: Weight) -> Mat | None:
    return Mat(w.data, w.layout) if isinstance(w, RepackedWeight) else None


@dataclass(frozen=True)
class _Layer:
    block: Block
    qkv: tuple[Mat, Mat, Mat] | None  # all three in the kernel layout: one fused launch
    o: Mat | None
    router: Mat | None


def _aligned(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 buffer of ``nbytes`` whose first byte is RUN_ALIGN-aligned."""
    buf = torch.zeros(nbytes + RUN_ALIGN, dtype=torch.uint8, device=device)
    skip = -buf.data_ptr() % RUN_ALIGN
    return buf[skip : skip + nbytes]


def attention_splits(n_head_kv: int, device: torch.device) -> int:
    """Splits of the key range: a power of two, at most MAX_SPLITS, and enough that the
    (K/V head, split) programs cover the GPU's multiprocessors twice."""
    cuda = device.type == "cuda"
    sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 4
    want = max(1, -(-2 * sms // n_head_kv))
    return min(MAX_SPLITS, 1 << (want - 1).bit_length())


class FastDecoder:
    """The decode step's kernels over the model's layers, or over one stage's (``stage``: the
    index into ``model.spans``; ``kv`` then that stage's K/V): a stage's decoder reads its
    input hidden state from ``x`` (set by ``StagedDecoder``) unless it is the first, and leaves
    it there unless it is the last, which runs the output head. Its tables, buffers and graph
    are its device's, and its experts its stage's cache's: local layer ``j`` is model layer
    ``first + j``."""

    def __init__(self, model: MoEDecoder, kv: KVCache, stage: int | None = None) -> None:
        a = model.args
        if a.head_dim < 2 or a.head_dim & (a.head_dim - 1):
            raise FastPathError(f"head_dim {a.head_dim} is not a power of two")
        self.model, self.kv, self.args = model, kv, a
        self.stage = stage
        span = range(a.n_layer) if stage is None else model.spans[stage]
        self.span, self.first = span, span.start
        self.is_first, self.is_last = span.start == 0, span.stop == a.n_layer
        self.device = dev = model.device if stage is None else model.stage_devices[stage]
        self.index = model.index
        self.eps = a.rms_eps
        self.layers = [self._layer(model.blocks[i]) for i in span]
        self.embd = model.embd
        self.output = model.output
        self.out_norm = model.out_norm
        L, E, K, D = len(span), a.n_expert, a.n_expert_used, a.n_embd
        q_dim, kv_dim = a.n_head * a.head_dim, a.n_head_kv * a.head_dim
        f32 = torch.float32
        # the fixed buffers a step reads and writes (a captured graph keeps their addresses)
        self.tok = torch.zeros(1, dtype=torch.int32, device=dev)
        self.pos = torch.zeros(1, dtype=torch.int32, device=dev)
        self.x = torch.zeros(D, dtype=f32, device=dev)  # the residual stream
        self.h = torch.zeros(D, dtype=f32, device=dev)  # its normalised copy for the experts
        self.qkv = torch.zeros(q_dim + 2 * kv_dim, dtype=f32, device=dev)
        self.attn_out = torch.zeros(q_dim, dtype=f32, device=dev)
        self.router_logits = torch.zeros(E, dtype=f32, device=dev)
        self.ids = torch.zeros(L, K, dtype=torch.int32, device=dev)
        self.wts = torch.zeros(L, K, dtype=f32, device=dev)
        self.eoffs = torch.zeros(L, K, dtype=torch.int64, device=dev)  # the chosen experts' slots
        self.counts = torch.zeros(L, E, dtype=torch.int32, device=dev)
        # the prefill path's uses (token assignments, not reads) and the distinct experts each
        # chunk read, per table entry (the reads are classified by home at the flush)
        self.prefill_uses = torch.zeros(L, E, dtype=torch.int32, device=dev)
        self.prefill_fetches = torch.zeros(L * E, dtype=torch.int64, device=dev)
        self.act = torch.zeros(K, a.n_ff_exp, dtype=f32, device=dev)
        self.logits = torch.zeros(a.vocab_size, dtype=f32, device=dev)
        # each step's greedy token: a two-slot ring on the device, read into pinned host memory
        # after the step, so the host can let the next step run while it reads this one
        self.ring = torch.zeros(2, dtype=torch.int32, device=dev)
        self.step_no = torch.zeros(1, dtype=torch.int32, device=dev)
        cuda = dev.type == "cuda"
        self._ring_host = torch.zeros(2, dtype=torch.int32, pin_memory=cuda)
        self._ring_done = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self.cos, self.sin = rope_tables(a.head_dim, a.rope_theta, kv.n_ctx, dev)
        self.attention = DecodeAttention(
            a.n_head, a.n_head_kv, a.head_dim, kv.page, attention_splits(a.n_head_kv, dev), dev
        )
        # experts: one slot layout per layer, staging slots for the misses of one layer
        self.slot_layouts = [kernel_layout(self.index.expert(layer, 0)) for layer in span]
        # bytes a step reads from the experts when all of them hit: k per layer
        self.expert_bytes = [self.index.expert(layer, 0).nbytes for layer in span]
        self.step_expert_bytes = K * sum(self.expert_bytes)
        self.staging_bytes = align(max(s.nbytes for s in self.slot_layouts), RUN_ALIGN)
        self.anchor = _aligned(RUN_ALIGN, dev)
        self.staging = _aligned(K * self.staging_bytes, dev)
        base = self.staging.data_ptr() - self.anchor.data_ptr()
        self.staging_offsets = [base + j * self.staging_bytes for j in range(K)]
        self.table = torch.full((L * E,), MISSING, dtype=torch.int64, device=dev)
        # the same with only the VRAM slots (RAM homes MISSING), and each layer's RAM homes
        # (expert, host slot): prompt chunks copy those into VRAM instead of reading them
        # over PCIe tile by tile
        self.vram_table = torch.full((L * E,), MISSING, dtype=torch.int64, device=dev)
        self.host_homes: list[list[tuple[int, int]]] = [[] for _ in range(L)]
        self.tier: HostTier | None = None
        self.host_count = 0
        self.plan: ExpertTablePlan = plan_table(L, E, None, lambda s: MISSING)
        # each expert's RAM home (MISSING for the rest): what a step may copy ahead
        self.homes = torch.full((L * E,), MISSING, dtype=torch.int64, device=dev)
        self.prefetch = 0  # predicted experts each layer copies ahead (set_prefetch)
        # the CPU's share of the chosen experts read from RAM (set_cpu_share): its kernels, one
        # job (page-locked buffers) per layer, and each RAM home's host address
        self.cpu_share = 0.0
        self.cpu_share_now = torch.zeros(1, dtype=torch.float32, device=dev)  # what kernels read
        self.cpu_tuned: dict[float, float] = {}  # tune_cpu_share's ms per step, by share
        self.cpu: CpuExperts | None = None
        self.cpu_jobs: list[CpuJob] = []
        self.cpu_reason: str | None = None  # why a share asked for is not taken here
        # the copies ahead run here, odd and even layers apart: a layer's copies never wait for
        # the previous layer's to end (nor for its expert kernels), so the link has work from
        # the moment each guess is made. High priority: their few programs start first.
        self.sides = [torch.cuda.Stream(dev, priority=-1) for _ in range(2)] if cuda else []
        self._said_mode = False  # whether the log has said how steps run (graph or staging)
        # the stage's experts, through the layer -> stage map (the only way to a cache)
        self.provider: ExpertProvider = model.provider_of(span.start)
        self.file: FileExpertProvider = _file_of(self.provider)
        # the captured step by mode: "plain", and where RAM homes exist "ahead" (copies ahead)
        # or "cpu" (the CPU's share)
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.graph_reason: str | None = "not captured"
        self.steps = 0
        self.counts_dirty = False  # a step or a chunk ran since the last flush of the counts
        self.adapt_swaps = 0  # exchanges at each adapt() (set from the options at load)
        # the tuned block sizes on a GPU; the kernels' own defaults in the interpreter
        self.tuned = TUNED if dev.type == "cuda" else {k: (_INTERP_BN, None) for k in TUNED}
        # prompt chunks on tensor cores (None: they take the reference path)
        self.prefill: FastPrefill | None = FastPrefill(self)

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The captured step that replays now (None: steps run eagerly)."""
        return self.graphs.get(self.mode)

    @property
    def mode(self) -> str:
        """How a step runs now: "ahead" (copies ahead), "cpu" (the CPU computes its share of
        the RAM experts) or "plain"; the first two only while some expert is in RAM."""
        if self.prefetching:
            return "ahead"
        return "cpu" if self.cpu_sharing else "plain"

    @property
    def cpu_sharing(self) -> bool:
        """Whether steps give the CPU its share: asked for, possible here, experts in RAM."""
        return self.cpu is not None and self.host_count > 0

    def set_cpu_share(self, share: float, threads: int) -> None:
        """Let the CPU compute ``share`` (0 to 1) of each layer's chosen experts whose home is
        in RAM (``kernels.cpu_experts``, on ``threads`` threads) while the GPU's kernels read
        the others over PCIe; 0: none. Before capture. Where the CPU kernels cannot run here
        (no C compiler, a type they lack) the log says why and the GPU reads every one."""
        if isinstance(share, bool) or not isinstance(share, (int, float)):
            raise ValueError(f"cpu_share={share!r}: must be a number between 0 and 1")
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"cpu_share={share}: must be between 0 and 1")
        # a captured step's host functions point at the jobs about to go: it goes first (steps
        # run eagerly until the next capture)
        self.graphs.pop("cpu", None)
        self._close_cpu()
        self.cpu_share = float(share)
        self.cpu_share_now.fill_(self.cpu_share)
        self.cpu_tuned = {}
        if share == 0:
            return
        from strata.engine.kernels import cpu_experts

        cuda = self.device.type == "cuda"
        K = self.args.n_expert_used
        try:
            cpu = cpu_experts.CpuExperts(threads)
        except cpu_experts.CpuExpertsUnavailable as e:
            self.cpu_reason = str(e)
            log.warning("cpu_share=%g: the CPU computes no expert here: %s", share, e)
            return
        try:
            jobs = [cpu.job(lay, K, pin=cuda) for lay in self.slot_layouts]
        except ValueError as e:  # a type the CPU kernels lack
            cpu.close()
            self.cpu_reason = str(e)
            log.warning("cpu_share=%g: the CPU computes no expert here: %s", share, e)
            return
        L, dev = len(self.layers), self.device
        self.cpu, self.cpu_jobs, self.cpu_reason = cpu, jobs, None
        self.cpu_done = torch.zeros(L, dtype=torch.int64, device=dev)
        # the slot a CPU-computed expert's entry points at: zeros, so the GPU adds nothing
        self.zero_slot = _aligned(self.staging_bytes, dev)
        self.zero_off = self.zero_slot.data_ptr() - self.anchor.data_ptr()
        # on a GPU the pool's server answers the posts of each step's kernels (no host in the
        # loop); on the CPU device the step runs each job itself, in order
        mb = cpu.serve(jobs, pin=True) if cuda else None
        self.cpu_seq = torch.zeros(1, dtype=torch.int64, device=dev)
        self.cpu_posted = torch.zeros(L, dtype=torch.int32, device=dev)
        a = self.anchor.data_ptr()
        self.cpu_posts = [
            moe.CpuPost(
                base=self.anchor,
                req=job.request.data_ptr() - a,
                y=job.y.data_ptr() - a,
                mb=0 if mb is None else mb.address - a,
                seq=self.cpu_seq,
                posted=self.cpu_posted[i : i + 1],
                job=i,
                post=mb is not None,
            )
            for i, job in enumerate(jobs)
        ]
        if self.tier is not None:
            self._cpu_base()

    def _cpu_base(self) -> None:
        """Where the CPU reads the RAM homes: the split writes each chosen home as the GPU
        reads it (its offset from the anchor), so each job's base is the anchor's address
        turned into a host address. Where the tier's memory has no such single offset (on a
        GPU) the CPU share goes off, and the log says why."""
        assert self.tier is not None
        a = self.anchor.data_ptr()
        delta = self.tier.host_minus_device() if self.device.type == "cuda" else 0
        if delta is None:
            self.graphs.pop("cpu", None)
            self._close_cpu()
            self.cpu_reason = (
                "the host tier's memory has no single offset from its device addresses to its "
                "host addresses"
            )
            log.warning("cpu_share=%g: the CPU computes no expert here: %s", self.cpu_share,
                        self.cpu_reason)  # fmt: skip
            return
        for job in self.cpu_jobs:
            job.base = a + delta

    def _close_cpu(self) -> None:
        if self.cpu is not None:
            self.cpu_jobs = []
            self.cpu.close()
            self.cpu = None

    def set_prefetch(self, p: int) -> None:
        """Copy up to ``p`` of each layer's predicted experts from RAM ahead of its routing
        (``kernels.prefetch``; 0: never), in two sets of p staging slots. Before capture."""
        E = self.args.n_expert
        if not 0 <= p <= E:
            raise ValueError(f"prefetch_experts={p}: must be between 0 and the model's {E} experts")
        L, dev = len(self.layers), self.device
        self.prefetch = p
        self.pf_logits = torch.zeros(E, dtype=torch.float32, device=dev)
        self.pf_ids = torch.full((L, max(p, 1)), -1, dtype=torch.int32, device=dev)
        self.pf_src = torch.full((L, max(p, 1)), MISSING, dtype=torch.int64, device=dev)
        self.pf_stats = torch.zeros(L, 2, dtype=torch.int64, device=dev)
        # two sets (by layer parity) of p slots for the copies ahead, then two of k for the
        # chosen experts in RAM that no copy ahead brought (kernels.prefetch.copy_missed)
        K = self.args.n_expert_used
        self.pf_staging = _aligned(max(2 * (p + K), 1) * self.staging_bytes, dev)
        self.pf_base = self.pf_staging.data_ptr() - self.anchor.data_ptr()
        self.late_base = self.pf_base + 2 * p * self.staging_bytes
        self.pf_done = [torch.cuda.Event() for _ in range(L)] if self.sides else []
        # bytes each layer copies: its slot layout, whole words (homes hold whole slots)
        self.pf_bytes = [align(lay.nbytes, RUN_ALIGN) for lay in self.slot_layouts]

    @property
    def prefetching(self) -> bool:
        """Whether steps copy predicted experts ahead: asked for, and some expert is in RAM."""
        return self.prefetch > 0 and self.host_count > 0

    def _layer(self, b: Block) -> _Layer:
        q, k, v = (_mat(w) for w in (b.attn.q, b.attn.k, b.attn.v))
        qkv = (q, k, v) if q is not None and k is not None and v is not None else None
        return _Layer(b, qkv, _mat(b.attn.o), _mat(b.router))

    # -- experts ---------------------------------------------------------------------------------

    def bind(self, provider: ExpertProvider) -> None:
        """Serve experts from ``provider`` (an expert cache in the kernel layout, or the file):
        the tables follow the cache from now on."""
        if isinstance(provider, ExpertCache):
            if provider.layers is not None and not set(self.span) <= set(provider.layers):
                r, c = self.span, provider.layers
                raise FastPathError(
                    f"the decoder of layers {r.start}-{r.stop - 1} was given the cache of "
                    f"layers {c.start}-{c.stop - 1}: a stage reads its own stage's cache only"
                )
            if not provider.kernel:
                raise FastPathError("the expert cache holds the file's layout, not the kernels'")
            provider.listeners.append(self.on_cache_change)
            provider.before_plan = self.flush_usage
        self.provider = provider
        self.file = _file_of(provider)
        self.rebuild_table()

    def on_cache_change(self, keys: Sequence[ExpertKey] | None) -> None:
        """The cache changed at a safe point; ``keys``: the only experts whose homes changed (an
        exchange), None: anything may have. The tables follow: only those entries where that
        keeps every expert as readable as before, else all of them."""
        if keys is None or not self._replan(keys):
            self.rebuild_table()

    def _replan(self, keys: Sequence[ExpertKey]) -> bool:
        """Plan and write the entries of ``keys`` alone (uses counted so far classified first);
        False, with nothing changed, where the plan's completeness would change (then the whole
        rebuild says so in the log)."""
        cache = self.provider
        if not isinstance(cache, ExpertCache):
            return False
        tier = cache.tier
        anchor = self.anchor.data_ptr()
        plan, changed = replan_entries(
            self.plan, keys, cache.table, lambda s: cache.slot_address(s) - anchor,
            None if tier is None else tier.table,
            None if tier is None else (lambda s: tier.address(s) - anchor), self.first,
        )  # fmt: skip
        if plan.complete != self.plan.complete:
            return False
        self.flush_usage()
        self.plan = plan
        idx = sorted(changed)
        dev = self._upload([idx, *device_rows(changed[i] for i in idx)])
        for dst, row in zip(self._tables, dev[1:], strict=True):
            dst.index_copy_(0, dev[0], row)
        E = self.args.n_expert
        for layer in {i // E for i in idx}:
            gone = {i % E for i in idx if i // E == layer}
            homes = [(e, h) for e, h in self.host_homes[layer] if e not in gone]
            for i in idx:
                if i // E == layer and changed[i][1] == HOST:
                    assert tier is not None
                    home = tier.table.slot_of((self.first + layer, i % E))
                    assert home is not None
                    homes.append((i % E, home))
            self.host_homes[layer] = sorted(homes, key=lambda es: es[1])
        self.host_count = plan.count(HOST)
        return True

    def rebuild_table(self) -> None:
        """Plan the tables from the cache's slot table and its host tier's (tags checked) and
        copy them over. The uses counted so far are classified first, by the plan they ran
        under."""
        self.flush_usage()
        cache = self.provider if isinstance(self.provider, ExpertCache) else None
        anchor = self.anchor.data_ptr()
        a = self.args
        was_complete = self.plan.complete
        L = len(self.layers)
        if cache is None:
            self.plan = plan_table(L, a.n_expert, None, lambda s: MISSING)
        else:
            tier = cache.tier
            if tier is not None and self.device.type == "cuda" and not tier.pinned:
                raise FastPathError("the host tier is not page-locked: the GPU cannot read it")
            offset = lambda s: cache.slot_address(s) - anchor  # noqa: E731
            host = None if tier is None else (lambda s: tier.address(s) - anchor)
            self.plan = plan_table(
                L, a.n_expert, cache.table, offset,
                None if tier is None else tier.table, host, self.first,
            )  # fmt: skip
        self._write_table()
        if self.plan.complete != was_complete or not self._said_mode:
            self._said_mode = True
            vram, host = self.plan.count(VRAM), self.plan.count(HOST)
            if self.plan.complete:
                log.info(
                    "every expert has a home the kernels read (%d in VRAM, %d in RAM over "
                    "PCIe): decode steps stage nothing",
                    vram,
                    host,
                )
            else:
                log.info(
                    "%d experts in VRAM, %d in RAM, %d only on the file: decode steps run "
                    "eagerly and stage each miss from the file",
                    vram,
                    host,
                    self.plan.count(FILE),
                )

    @property
    def _tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tables ``device_rows`` gives the rows of, in its order."""
        return self.table, self.vram_table, self.homes

    def _upload(self, rows: list[list[int]]) -> torch.Tensor:
        """``rows`` as one int64 tensor on the device, queued in stream order with no wait (from
        page-locked memory on a GPU: behind a resize's copies)."""
        src = torch.tensor(rows, dtype=torch.int64)
        if self.device.type == "cuda":
            src = src.pin_memory()
        return src.to(self.device, non_blocking=True)

    def _write_table(self) -> None:
        plan = self.plan
        dev = self._upload(list(device_rows(zip(plan.offsets, plan.where, strict=True))))
        for dst, row in zip(self._tables, dev, strict=True):
            dst.copy_(row)
        cache = self.provider if isinstance(self.provider, ExpertCache) else None
        self.tier = cache.tier if cache is not None else None
        self.host_homes = [[] for _ in range(len(self.layers))]
        self.host_count = plan.count(HOST)
        if self.tier is not None:
            if self.prefetch and self.tier.slot_bytes < max(self.pf_bytes):
                raise FastPathError(
                    f"host slots of {self.tier.slot_bytes} bytes are smaller than a copy ahead "
                    f"of {max(self.pf_bytes)}"
                )
            for slot, tag in self.tier.table:
                self.host_homes[tag.layer - self.first].append((tag.expert, slot))
            for homes in self.host_homes:
                homes.sort(key=lambda es: es[1])  # host slot order: neighbours copy as one
            if self.cpu is not None:
                self._cpu_base()

    def _stage_misses(self, layer: int) -> None:
        """Eager steps with misses: after the layer's top-k, stage each chosen expert that has no
        readable home into a staging slot and point its chosen-expert offset there (the table
        itself is not touched: it only ever holds homes)."""
        for j, e in enumerate(self.ids[layer].tolist()):
            if not self.plan.is_resident(layer, e):
                blob = self.index.expert(self.first + layer, e)
                self.file.upload_kernel(blob, self.staging[j * self.staging_bytes :])
                self.eoffs[layer, j].fill_(self.staging_offsets[j])

    def flush_usage(self) -> list[ExpertKey]:
        """Hand the expert uses counted on the device to the provider's usage counts, and count
        the reads they made in its stats by where each expert's home is in the current plan
        (every plan change flushes first, so that is the plan they ran under): a decode step
        reads each chosen expert once, a prefill chunk each distinct one once. Nothing to do
        (and no wait for the device) when no step ran since the last flush."""
        if not self.counts_dirty:
            return []
        self.counts_dirty = False
        steps = self.counts.to("cpu", copy=True).reshape(-1)
        prompts = self.prefill_uses.to("cpu", copy=True).reshape(-1)
        fetched = self.prefill_fetches.to("cpu", copy=True)
        self.counts.zero_()
        self.prefill_uses.zero_()
        self.prefill_fetches.zero_()
        E, first = self.args.n_expert, self.first
        uses = dict(zip(*_nonzero(steps + prompts), strict=True))
        if uses:
            counts = {(first + i // E, i % E): int(n) for i, n in uses.items()}
            self.provider.record_counts(counts)
        self._count_reads(dict(zip(*_nonzero(steps), strict=True)))
        self._count_reads(dict(zip(*_nonzero(fetched), strict=True)))
        if self.prefetch:
            self._count_prefetches()
        if self.cpu is not None:
            self._count_cpu()
        return sorted((first + i // E, i % E) for i in uses)

    def adapt(self) -> int:
        """At a safe point: hand the counts over, then let the cache exchange up to
        ``adapt_swaps`` hot RAM-homed experts with cold tail experts (the tables follow).
        Returns the exchanges made."""
        used = self.flush_usage()
        cache = self.provider if isinstance(self.provider, ExpertCache) else None
        if cache is None:
            return 0
        if cache.verify and used:  # a sample of what the steps just read, checked where it is
            cache.check_sample(
                random.Random(self.steps).sample(used, min(VERIFY_SAMPLE, len(used)))
            )
        return cache.exchange(self.adapt_swaps) if self.adapt_swaps else 0

    def _count_prefetches(self) -> None:
        """Copies ahead made and chosen (a chosen one is counted as the read of its RAM home
        already: the kernels read its copy instead), and the bytes of the unchosen ones, which
        crossed PCIe for nothing."""
        made = self.pf_stats.to("cpu", copy=True).tolist()
        self.pf_stats.zero_()
        stats = self.provider.stats
        for layer, (n, used) in enumerate(made):
            stats.prefetched += n
            stats.prefetch_used += used
            stats.bytes_prefetched_unused += (n - used) * self.expert_bytes[layer]

    def _count_cpu(self) -> None:
        """The chosen RAM experts the CPU computed (their reads are counted as RAM reads
        already), and their bytes: what went to the CPU instead of over PCIe."""
        done = self.cpu_done.to("cpu", copy=True).tolist()
        self.cpu_done.zero_()
        stats = self.provider.stats
        for layer, n in enumerate(done):
            stats.cpu_computed += n
            stats.bytes_cpu += n * self.expert_bytes[layer]

    def _count_reads(self, reads: dict[int, int]) -> None:
        """reads: table entry -> times read."""
        stats, plan, E = self.provider.stats, self.plan, self.args.n_expert
        for i, n in reads.items():
            nbytes = n * self.expert_bytes[i // E]
            where = plan.where[i]
            if where == VRAM:
                stats.hits += n
                stats.bytes_from_cache += nbytes
            elif where == HOST:
                stats.misses += n
                stats.bytes_from_ram += nbytes
            else:
                stats.misses += n
                stats.bytes_from_file += nbytes

    # -- one step --------------------------------------------------------------------------------

    def _dense(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        w: Weight,
        mat: Mat | None,
        norm: torch.Tensor | None = None,
        residual: bool = False,
        h_out: torch.Tensor | None = None,
        tune: str = "o",
    ) -> None:
        if mat is not None:
            bn, warps = self.tuned[tune]
            matvec(y, x, [mat], norm, self.eps, residual, h_out, bn, warps)
            return
        # a type without a kernel: dequantise and multiply (torch ops, captured all the same)
        h = rms_norm(x, norm, self.eps) if norm is not None else x
        if h_out is not None:
            h_out.copy_(h)
        out = linear(h[None], w)[0]
        if residual:
            y.add_(out)
        else:
            y.copy_(out)

    def _attention(self, layer: int, lyr: _Layer) -> None:
        b, a, kv = lyr.block, self.args, self.kv
        if lyr.qkv is not None:
            bn, warps = self.tuned["qkv"]
            matvec(self.qkv, self.x, lyr.qkv, b.attn_norm, self.eps, bn=bn, num_warps=warps)
        else:
            self.h.copy_(rms_norm(self.x, b.attn_norm, self.eps))
            at = 0
            for w in (b.attn.q, b.attn.k, b.attn.v):
                n = w.shape[0]
                self._dense(self.qkv[at : at + n], self.h, w, _mat(w))
                at += n
        k_cache, v_cache = kv.layer(layer)
        rope_store(
            self.qkv,
            self.cos,
            self.sin,
            b.attn.q_norm,
            b.attn.k_norm,
            k_cache,
            v_cache,
            kv.block_table,
            self.pos,
            self.eps,
            a.n_head,
            a.n_head_kv,
            a.head_dim,
            kv.page,
            a.rope_neox,
            kv.page_stride,
        )
        self.attention(
            self.attn_out, self.qkv, k_cache, v_cache, kv.block_table, self.pos, kv.page_stride
        )
        self._dense(self.x, self.attn_out, b.attn.o, lyr.o, residual=True)

    def _prefetch(self, layer: int) -> None:
        """Predict ``layer``'s experts from the residual stream as it is now (its router on
        it) and queue the copies of those in RAM into the layer's staging set on the side
        stream of its parity, beside the previous layer's: the link stays busy while the main
        stream computes. The layer's expert kernels wait for its copies (``pf_done``)."""
        lyr, E = self.layers[layer], self.args.n_expert
        b = lyr.block
        self._dense(self.pf_logits, self.x, b.router, lyr.router, b.ffn_norm, tune="router")
        ids, src = self.pf_ids[layer], self.pf_src[layer]
        prefetch.predict(self.pf_logits, self.homes[layer * E : (layer + 1) * E], ids, src)
        dst = self.pf_base + (layer % 2) * self.prefetch * self.staging_bytes
        args = (self.anchor, ids, src, dst, self.pf_bytes[layer], self.staging_bytes)
        if not self.sides:
            prefetch.copy_experts(*args)
            return
        side = self.sides[layer % 2]
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            prefetch.copy_experts(*args)
            self.pf_done[layer].record(side)

    def _moe(
        self, layer: int, lyr: _Layer, stage: Callable[[int], None] | None, ahead: bool,
        cpu: bool = False,
    ) -> None:  # fmt: skip
        a, b = self.args, lyr.block
        self._dense(
            self.router_logits, self.x, b.router, lyr.router, b.ffn_norm, h_out=self.h,
            tune="router",
        )  # fmt: skip
        if ahead and layer + 1 < len(self.layers):
            # the next layer's guess, from the stream before this layer's experts: its copies
            # run beside this layer's (the previous layer's expert kernels are done, so the
            # staging set the next layer shares with them is free)
            self._prefetch(layer + 1)
        ids, wts, eoffs = self.ids[layer], self.wts[layer], self.eoffs[layer]
        table = self.table[layer * a.n_expert : (layer + 1) * a.n_expert]
        pf = None
        if ahead:
            stage_at = self.pf_base + (layer % 2) * self.prefetch * self.staging_bytes
            pf = moe.Prefetched(
                self.pf_ids[layer], stage_at, self.staging_bytes, self.pf_stats[layer]
            )
        moe.route(
            self.router_logits, table, ids, wts, eoffs, self.counts[layer], a.n_expert_used,
            a.norm_topk, pf,
        )  # fmt: skip
        if stage is not None:
            stage(layer)
        if ahead:
            E = a.n_expert
            late = self.late_base + (layer % 2) * a.n_expert_used * self.staging_bytes
            prefetch.copy_missed(
                self.anchor, ids, eoffs, self.homes[layer * E : (layer + 1) * E],
                self.pf_ids[layer], late, self.pf_bytes[layer], self.staging_bytes,
            )  # fmt: skip
            if self.sides:  # this layer's copies ahead have landed
                torch.cuda.current_stream(self.device).wait_event(self.pf_done[layer])
        if cpu:
            self._cpu_send(layer)
        lay = self.slot_layouts[layer]
        bn, warps = self.tuned["gate_up"]
        moe.gate_up(
            self.act, self.h, eoffs, self.anchor, lay.gate, lay.up, lay.up_offset, bn, warps
        )
        bn, warps = self.tuned["down"]
        moe.down(self.x, self.act, eoffs, wts, self.anchor, lay.down, lay.down_offset, bn, warps)
        if cpu:
            self._cpu_take(layer)

    def _cpu_send(self, layer: int) -> None:
        """Hand the CPU its share of the layer's RAM experts: the split (their entries then
        add nothing on the GPU), their choice and the input written into the layer's job, and
        on a GPU the job posted to the pool's server, which runs it while the expert kernels
        read the others; on the CPU device the job runs now."""
        E = self.args.n_expert
        span = slice(layer * E, (layer + 1) * E)
        to = self.cpu_posts[layer]
        moe.post_for_cpu(
            self.ids[layer], self.wts[layer], self.eoffs[layer], self.homes[span],
            self.cpu_done[layer : layer + 1], self.h, self.zero_off,
            self.cpu_share_now, to,
        )  # fmt: skip
        if not to.post:  # the CPU device (Triton's interpreter): in order
            self.cpu_jobs[layer].run()

    def _cpu_take(self, layer: int) -> None:
        """Add the CPU's sum for the layer to the residual stream (after the GPU's experts)."""
        to = self.cpu_posts[layer]
        if to.post:
            moe.collect_from_cpu(self.x, to, CPU_WAIT_LIMIT_NS)
        else:
            self.x.add_(self.cpu_jobs[layer].y)

    def _arm_cpu(self) -> None:
        """A step in the "cpu" mode is about to be queued: keep the pool's server spinning
        through it, and say so if an earlier step's wait for the CPU gave up."""
        self._check_cpu()
        if self.cpu is not None:
            self.cpu.arm(CPU_ARM_S)

    def _check_cpu(self) -> None:
        """Raise ``CpuShareFault`` when a step waited for the CPU's answer in vain (its output is
        wrong); the CPU share is off from then on, and the steps read every RAM expert over
        PCIe."""
        mb = self.cpu.mailbox if self.cpu is not None else None
        if mb is None or not mb.fault:
            return
        why = (
            f"a decode step waited more than {CPU_WAIT_LIMIT_NS / 1e9:g} s for the CPU's share "
            "of the experts"
            if mb.fault == 1
            else "the CPU's server got a post of no job"
        )
        torch.cuda.synchronize(self.device)  # the queued steps (they wait no more) end first
        self.set_cpu_share(0, 1)
        log.error("cpu_share is off from now on: %s", why)
        raise CpuShareFault(f"{why}; that step's output is wrong, so this request stops")

    def tune_cpu_share(
        self, candidates: Sequence[float] = CPU_SHARE_CANDIDATES, steps: int = 8
    ) -> float:
        """Choose the CPU's share by timing: ``steps`` decode steps (after two unmeasured ones)
        at each share in ``candidates`` (0: the plain step), then the fastest is kept and
        returned (0 turns the CPU share off). Run after ``capture`` (or eagerly without a
        graph), at load: the steps write K/V rows from position 1, which the next prompt
        rewrites, and every count they make is dropped. Nothing to choose (no CPU pool, no
        expert in RAM, the CPU device): returns the share as it is."""
        if not self.cpu_sharing or self.device.type != "cuda":
            return self.cpu_share
        steps = max(1, min(steps, self.kv.page - 3))  # every row written in the first page
        times: dict[float, float] = {}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for share in candidates:
            if not 0 <= share <= 1:
                raise ValueError(f"cpu_share candidate {share}: must be between 0 and 1")
        with self._uncounted():
            for share in candidates:
                mode = "plain" if share == 0 else "cpu"
                self.cpu_share_now.fill_(share)
                graph = self.graphs.get(mode)
                self.begin(1, 1)
                for i in range(steps + 2):
                    if i == 2:
                        start.record()
                    if mode == "cpu":
                        self.cpu.arm(CPU_ARM_S)  # type: ignore[union-attr]
                    if graph is not None:
                        graph.replay()
                    else:
                        self._forward(None, mode=mode)
                end.record()
                end.synchronize()
                times[share] = start.elapsed_time(end) / steps
        try:
            self._check_cpu()
        except CpuShareFault:  # said in the log; the share is off
            return 0.0
        best = min(times, key=lambda s: (times[s], s))
        if best == 0:
            self.set_cpu_share(0, 1)  # (no pool: the thread count is not used)
        else:
            self.cpu_share = best
            self.cpu_share_now.fill_(best)
        self.cpu_tuned = times
        log.info(
            "cpu_share %g, chosen by timing %d steps at each share (ms per step: %s)",
            best, steps, ", ".join(f"{k:g}: {v:.2f}" for k, v in times.items()),
        )  # fmt: skip
        return best

    def _forward(
        self,
        stage: Callable[[int], None] | None,
        on_layer: Callable[[int], None] | None = None,
        mode: str | None = None,
    ) -> None:
        """One step's kernels, run as ``mode`` (None: the ``mode`` of now)."""
        mode = self.mode if mode is None else mode
        ahead, cpu = mode == "ahead", mode == "cpu"
        if cpu and self.cpu is not None:
            self.cpu.arm(CPU_ARM_S)  # (an eager step's posts; a capture's cost nothing)
        if not self.is_first:
            pass  # a later stage: ``x`` holds the previous stage's output
        elif isinstance(self.embd, RepackedWeight):
            _embed(self.embd, self.tok, self.x)
        else:
            self.x.copy_(self.embd.rows(self.tok)[0])
        for layer, lyr in enumerate(self.layers):
            if on_layer is not None:
                on_layer(self.first + layer)
            if ahead and layer == 0:  # the later layers' guesses come a layer early (_moe)
                self._prefetch(0)
            self._attention(layer, lyr)
            self._moe(layer, lyr, stage, ahead, cpu)
        if not self.is_last:
            return  # the next stage goes on from ``x``
        self._dense(self.logits, self.x, self.output, _mat(self.output), self.out_norm, tune="head")
        advance(self.logits, self.tok, self.pos, self.ring, self.step_no)

    def step(self, token: int, pos: int) -> torch.Tensor:
        """Logits of ``token`` at position ``pos`` (K/V of 0..pos-1 already written): the
        decoder's own buffer [V], valid until the next step."""
        self.run_step(token, pos)
        self.after_step()
        self.confirm_cpu()
        return self.logits

    def confirm_cpu(self) -> None:
        """After a step whose logits the caller reads at once: with the CPU's share on a GPU,
        wait for the step and raise ``CpuShareFault`` if its wait for the CPU gave up."""
        if self.mode == "cpu" and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
            self._check_cpu()

    def run_step(self, token: int, pos: int) -> None:
        """Queue one step's kernels: the graph where every expert has a readable home, else
        eagerly, staging the misses."""
        if not 0 <= pos < self.kv.n_ctx:
            raise ValueError(f"position {pos} is outside the context of {self.kv.n_ctx}")
        self.tok.fill_(token)
        self.pos.fill_(pos)
        self.counts_dirty = True
        if self.mode == "cpu":
            self._arm_cpu()
        if self.plan.complete:
            if self.graph is not None:
                self.graph.replay()
            else:
                self._forward(None)
        else:
            self._forward(self._stage_misses)

    def after_step(self) -> None:
        """A step ran (a safe point): count it, land the exchanges that ran beside it, and
        every USAGE_FLUSH_STEPS steps hand the uses over and let the cache adapt."""
        self.steps += 1
        self.provider.step()
        self.land_exchanges()
        if self.steps % USAGE_FLUSH_STEPS == 0:
            self.adapt()

    def land_exchanges(self) -> None:
        """At a safe point: exchanges whose copies ran on the cache's side stream beside the
        steps since the last one land (the tables follow them)."""
        cache = self.provider
        if isinstance(cache, ExpertCache) and cache.exchanging:
            cache.land_exchanges()

    # -- greedy steps, one ahead of the host ------------------------------------------------------

    @property
    def can_look_ahead(self) -> bool:
        """Whether steps may run back to back with no host in the loop: every expert has a
        home the kernels read (no step stages a miss)."""
        return self.plan.complete

    def begin(self, token: int, pos: int) -> None:
        """The first step of a greedy run reads ``token`` at ``pos``; later ones their
        predecessor's argmax at the next position (``advance``)."""
        self.land_exchanges()
        self.tok.fill_(token)
        self.pos.fill_(pos)
        self.step_no.zero_()

    def launch(self, n: int, pick: Pick | None = None) -> None:
        """Queue step n of a greedy run (its input is on the device already) and the copy of
        its token to the host; nothing waits. ``pick``: as ``finish``'s."""
        self.run_ahead()
        self.finish(n, pick)

    def run_ahead(self) -> None:
        """Queue a greedy run's next step: its input is the token its predecessor left on the
        device. ``finish`` then files its token."""
        self.counts_dirty = True
        if self.mode == "cpu":
            self._arm_cpu()
        if self.graph is not None:
            self.graph.replay()
        else:
            self._forward(None)

    def finish(self, n: int, pick: Pick | None = None) -> None:
        """Queue the copy of step n's token to the host. ``pick(logits, slot)`` first chooses
        that token another way than the step's plain argmax (a grammar's mask), writing it as
        the next input and into ring slot n % 2."""
        slot = n % 2
        if pick is not None:
            pick(self.logits, slot)
        self._ring_host[slot : slot + 1].copy_(self.ring[slot : slot + 1], non_blocking=True)
        if self._ring_done is not None:
            self._ring_done[slot].record()

    def result(self, n: int) -> int:
        """The greedy token of step n (waits for that step only)."""
        slot = n % 2
        if self._ring_done is not None:
            self._ring_done[slot].synchronize()
        self._check_cpu()
        return int(self._ring_host[slot])

    def accept(self) -> None:
        """A step of a greedy run whose token the host took (a safe point): count it as
        ``step`` does, and land the exchanges that ran beside it."""
        self.steps += 1
        self.provider.step()
        self.land_exchanges()

    # -- set-up ----------------------------------------------------------------------------------

    def warm_up(
        self, on_layer: Callable[[int], None] | None = None, mode: str | None = None
    ) -> None:
        """One eager step at position 0 (its K/V row is rewritten by the next prompt): every
        kernel compiles now, not in the first request. ``mode`` as ``_forward``'s."""
        self.tok.zero_()
        self.pos.zero_()
        with self._uncounted():
            self._forward(None if self.plan.complete else self._stage_misses, on_layer, mode)

    @contextmanager
    def _uncounted(self) -> Iterator[None]:
        """Steps run inside count nothing: no hit, miss, use, copy ahead or CPU expert (they
        warm up or time the kernels, not serve a request). Waits for them at the end."""
        stats = self.provider.stats
        before = (stats.hits, stats.misses, stats.bytes_from_cache, stats.bytes_from_file)
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stats.hits, stats.misses, stats.bytes_from_cache, stats.bytes_from_file = before
        self.counts.zero_()
        if self.prefetch:
            self.pf_stats.zero_()
        if self.cpu is not None:
            self.cpu_done.zero_()

    def capture(self) -> bool:
        """Capture one step as a CUDA graph (replayed while every expert has a readable home).
        Returns False, with ``graph_reason`` saying why, where that fails: steps then run the
        same kernels eagerly."""
        if self.device.type != "cuda":
            self.graph_reason = "CUDA graphs need a CUDA device"
            return False
        # with a host tier, RAM homes come and go with resizes: the step with copies ahead, or
        # with the CPU's share, too
        cache = self.provider if isinstance(self.provider, ExpertCache) else None
        tier = cache is not None and cache.tier is not None
        modes = ["plain"] + (["ahead"] if self.prefetch and tier else [])
        modes += ["cpu"] if self.cpu is not None and tier else []
        graphs = {}
        try:
            for mode in modes:
                if mode != "plain":  # its kernels compile before the capture, not inside it
                    self.warm_up(mode=mode)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self._forward(None, mode=mode)
                graphs[mode] = graph
        except Exception as e:  # an op that cannot be captured
            self.graph_reason = f"capture failed ({type(e).__name__}: {e})".splitlines()[0]
            log.warning("decode steps run without a CUDA graph: %s", self.graph_reason)
            torch.cuda.synchronize(self.device)
            return False
        self.graphs, self.graph_reason = graphs, None
        return True

    def describe(self) -> str:
        how = (
            "one CUDA graph per step" if self.graph is not None else f"eager ({self.graph_reason})"
        )
        if self.cpu is not None:
            how += f"; the CPU computes {self.cpu_share:.0%} of the chosen experts in RAM"
            if not self.cpu_sharing:
                how += " (none is in RAM now: every expert has a VRAM slot)"
        return f"fused Triton kernels, {how}"

    def close(self) -> None:
        """Hand over the last counts and let the graph, the CPU's threads and the cache go."""
        self.flush_usage()
        self.graphs = {}
        self._close_cpu()
        if isinstance(self.provider, ExpertCache):
            if self.on_cache_change in self.provider.listeners:
                self.provider.listeners.remove(self.on_cache_change)
            self.provider.before_plan = None


def _embed(w: RepackedWeight, ids: torch.Tensor, out: torch.Tensor) -> None:
    """The embedding row ``ids[0]`` into ``out`` [D] (one launch on a GPU)."""
    if w.data.is_cuda:
        repack_kernels.dequantize(w.data, w.layout, ids=ids, out=out.view(1, -1))
    else:
        out.copy_(w.rows(ids)[0])


def _file_of(provider: ExpertProvider) -> FileExpertProvider:
    if isinstance(provider, ExpertCache):
        return provider.file
    if isinstance(provider, FileExpertProvider):
        return provider
    raise FastPathError(f"no file behind the expert provider {type(provider).__name__}")


def _nonzero(flat: torch.Tensor) -> tuple[list[int], list[int]]:
    idx = torch.nonzero(flat).flatten()
    return idx.tolist(), flat[idx].tolist()
