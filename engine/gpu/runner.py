"""The GPU stage runner: the model file's layers through the GPU operations, one decode step as
one CUDA graph, prompt chunks on tensor cores.

``GpuRunner`` owns every piece of device state of its stage — the step buffers, the K/V, the
expert tables, the graphs, the side streams, the staging slots, the CPU's share — and delegates
only to objects it owns that never call back into it (``engine.gpu``'s modules). Its experts are
its stage's cache's (or the file's), through the tables: local layer ``j`` is model layer
``layers.start + j``. Routing never leaves the device in a graph step; the top-k kernel counts
each chosen expert on the device (``UseCounters``), handed to the provider every
``USAGE_FLUSH_STEPS`` steps and before every change of the tables.
"""

from __future__ import annotations

import logging
import random
import statistics
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from strata.engine.experts import ExpertProvider
from strata.engine.experts.cache import ExpertCache
from strata.engine.experts.slots import ExpertKey
from strata.engine.experts.table import ExpertTablePlan
from strata.engine.gpu.ahead import CopiesAhead
from strata.engine.gpu.buffers import ExpertGeometry, StepBuffers
from strata.engine.gpu.chunk import ChunkOps, ChunkParts, ChunkPath
from strata.engine.gpu.counters import UseCounters
from strata.engine.gpu.cpu_share import (
    CPU_SHARE_CANDIDATES,
    CPU_SHARE_ROUNDS,
    CpuShare,
    CpuShareFault,
    check_timing,
    choose_share,
    round_orders,
    timing_note,
)
from strata.engine.gpu.decode import AHEAD, CPU, PLAIN, DecodeOps, DecodeParts
from strata.engine.gpu.delta import begin_hybrid_step, keep_state
from strata.engine.gpu.oss import cpu_extras
from strata.engine.gpu.sampled import SampledSteps
from strata.engine.gpu.staging import MissStaging, file_of
from strata.engine.gpu.tables import ExpertTables, FastPathError
from strata.engine.kernels.pdl import pdl_note
from strata.engine.kv import KVCache
from strata.engine.models.base import MoEModel
from strata.engine.sampling import TokenLogprob
from strata.engine.step import Batch, StageRunner, StepKind

log = logging.getLogger(__name__)

USAGE_FLUSH_STEPS = 64
VERIFY_SAMPLE = 8  # experts whose copies each adapt() checks, with verify_experts
# chooses a greedy step's token another way (a grammar's mask): (logits, ring slot) -> None
Pick = Callable[[torch.Tensor, int], None]


class GpuRunner(StageRunner):
    on_gpu = True

    def __init__(self, model: MoEModel, number: int, kv: KVCache, provider: ExpertProvider) -> None:
        super().__init__(model, number, kv, provider)
        shape = model.shape
        a, r = shape.attention, shape.routing
        if a.head_dim < 2 or a.head_dim & (a.head_dim - 1):
            raise FastPathError(f"head_dim {a.head_dim} is not a power of two")
        L, dev = len(self.layers), self.device
        self.geometry = g = ExpertGeometry.of(model.index, self.layers)
        self.buf = buf = StepBuffers(shape, L, dev)
        self.tables = ExpertTables(L, r.n_expert, self.layers.start, buf.anchor)
        self.counters = UseCounters(L, r.n_expert, self.layers.start, g.expert_bytes, dev)
        self.ahead = CopiesAhead(buf, g, L, r.n_expert, r.n_used)
        self.sampled = SampledSteps(buf)
        ffn = [model.ffn[i] for i in self.layers]
        self.cpu = CpuShare(buf, g, L, r.n_used, cpu_extras(ffn, r))
        self.staging = MissStaging(buf, g, model.index, r.n_used)
        self.file = file_of(provider)
        self.ops = DecodeOps(
            DecodeParts(buf, g, self.tables, self.counters, self.ahead, self.cpu, kv), shape, ffn
        )
        parts = ChunkParts(
            buf, g, self.tables, self.counters, self.staging, kv, model.index, shape,
            self.is_last, self.ops.cos, self.ops.sin,
        )  # fmt: skip
        # prompt chunks on tensor cores (None: they take the reference path)
        self.prefill: ChunkPath | None = ChunkPath(parts, self._chunk_forward, self.file)
        # the captured step by mode: "plain", and where RAM homes exist "ahead" (copies ahead)
        # or "cpu" (the CPU's share)
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.graph_reason: str | None = "not captured"
        self.steps = 0
        self.adapt_swaps = 0  # exchanges at each adapt() (set from the options at load)
        self._last: StepKind | None = None  # the kind of the step run last (end_step's)
        self._rope = None  # the reference's RoPE, for chunks where the prefill path is off

    @property
    def logits(self) -> torch.Tensor:
        return self.buf.logits

    @property
    def plan(self) -> ExpertTablePlan:
        """The expert tables' plan (where each expert of the stage is read from)."""
        return self.tables.plan

    # -- how a step runs -----------------------------------------------------------------------

    @property
    def mode(self) -> str:
        """How a step runs now: "ahead" (copies ahead), "cpu" (the CPU computes its share of
        the RAM experts) or "plain"; the first two only while some expert is in RAM."""
        if self.prefetching:
            return AHEAD
        return CPU if self.cpu_sharing else PLAIN

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The captured step that replays now (None: steps run eagerly)."""
        return self.graphs.get(self.mode)

    @property
    def prefetching(self) -> bool:
        """Whether steps copy predicted experts ahead: asked for, and some expert is in RAM."""
        return self.ahead.p > 0 and self.tables.host_count > 0

    @property
    def cpu_sharing(self) -> bool:
        """Whether steps give the CPU its share: asked for, possible here, experts in RAM."""
        return self.cpu.on and self.tables.host_count > 0

    @property
    def can_look_ahead(self) -> bool:
        """Whether steps may run back to back with no host in the loop: every expert has a
        home the kernels read (no step stages a miss)."""
        return self.tables.complete

    def set_prefetch(self, p: int) -> None:
        """Copy up to ``p`` of each layer's predicted experts from RAM ahead of its routing
        (``gpu.ahead``; 0: never). Before capture."""
        self.ahead.set(p)

    def set_cpu_share(self, share: float, threads: int) -> None:
        """Let the CPU compute ``share`` (0 to 1) of each layer's chosen experts whose home is
        in RAM, on ``threads`` threads (``gpu.cpu_share``); 0: none. Before capture."""
        # a captured step's host functions point at the jobs about to go: it goes first (steps
        # run eagerly until the next capture)
        self.graphs.pop(CPU, None)
        self.cpu.set(share, threads, self.tables.tier)

    # -- experts -------------------------------------------------------------------------------

    def bind(self, provider: ExpertProvider) -> None:
        """Serve experts from ``provider`` (an expert cache in the kernel layout, or the file):
        the tables follow the cache from now on."""
        if isinstance(provider, ExpertCache):
            if provider.layers is not None and not set(self.layers) <= set(provider.layers):
                r, c = self.layers, provider.layers
                raise FastPathError(
                    f"the runner of layers {r.start}-{r.stop - 1} was given the cache of "
                    f"layers {c.start}-{c.stop - 1}: a stage reads its own stage's cache only"
                )
            if not provider.kernel:
                raise FastPathError("the expert cache holds the file's layout, not the kernels'")
        self.flush_usage()  # the uses so far are the old provider's
        old = self.cache
        if old is not None and old is not provider:
            self._unfollow(old)
        self.provider = provider
        self.file = file_of(provider)
        if self.prefill is not None:
            self.prefill.file = self.file
        if isinstance(provider, ExpertCache):
            provider.listeners.append(self.on_cache_change)
            provider.before_plan = self.flush_usage
        self.rebuild_table()

    def _unfollow(self, cache: ExpertCache) -> None:
        if self.on_cache_change in cache.listeners:
            cache.listeners.remove(self.on_cache_change)
        cache.before_plan = None

    def on_cache_change(self, keys: Sequence[ExpertKey] | None) -> None:
        """The cache changed at a safe point; ``keys``: the only experts whose homes changed (an
        exchange), None: anything may have. The tables follow: only those entries where that
        keeps every expert as readable as before, else all of them."""
        cache = self.cache
        if keys is not None and cache is not None:
            self.flush_usage()  # the uses so far ran under the plan about to change
            if self.tables.replan(cache, keys):
                return
        self.rebuild_table()

    def rebuild_table(self) -> None:
        """Plan the tables from the cache (tags checked) and copy them over; the uses counted so
        far are classified first, by the plan they ran under."""
        self.flush_usage()
        self.tables.rebuild(self.cache)
        tier = self.tables.tier
        self.ahead.check(tier)
        if tier is not None and not self.cpu.set_base(tier):
            self.graphs.pop(CPU, None)

    def flush_usage(self) -> list[ExpertKey]:
        """Hand the uses counted on the device to the provider (``UseCounters.flush``), with the
        copies ahead made and the experts the CPU computed."""
        if not self.counters.dirty:
            return []
        used = self.counters.flush(self.provider, self.tables.plan)
        self.ahead.count(self.provider)
        self.cpu.count(self.provider)
        return used

    def adapt(self) -> int:
        """At a safe point: hand the counts over, then let the cache exchange up to
        ``adapt_swaps`` hot RAM-homed experts with cold tail experts (the tables follow).
        Returns the exchanges made."""
        used = self.flush_usage()
        cache = self.cache
        if cache is None:
            return 0
        if cache.verify and used:  # a sample of what the steps just read, checked where it is
            cache.check_sample(
                random.Random(self.steps).sample(used, min(VERIFY_SAMPLE, len(used)))
            )
        return cache.exchange(self.adapt_swaps) if self.adapt_swaps else 0

    def land_exchanges(self) -> None:
        """At a safe point: exchanges whose copies ran on the cache's side stream beside the
        steps since the last one land (the tables follow them)."""
        cache = self.cache
        if cache is not None and cache.exchanging:
            cache.land_exchanges()

    # -- steps ---------------------------------------------------------------------------------

    def run(self, batch: Batch, x: torch.Tensor | None = None) -> torch.Tensor:
        seq = batch.one
        self._last = batch.kind
        fast = batch.kind == StepKind.DECODE or self.prefill is not None
        begin_hybrid_step(self, seq.start, fast)  # (the reference operations check their own)
        if batch.kind == StepKind.DECODE:
            if x is not None:  # a later stage: the previous stage's hidden state
                self.buf.x.copy_(x)
            self.run_step(seq.tokens[0], seq.start)
            return self.buf.logits[None] if self.is_last else self.buf.x
        if self.prefill is None:  # fast_prefill is off: the reference operations
            from strata.engine.ops.reference import Rope
            from strata.engine.reference_runner import reference_step

            if self._rope is None:
                spec = self.model.attention_spec
                self._rope = Rope(spec.head_dim, spec.rope)
            return reference_step(self, self._rope, batch, x)
        self.counters.dirty = True
        return self.prefill.run(seq.tensor(self.device), seq.start, batch.last_only, x)

    def _chunk_forward(self, ops: ChunkOps) -> torch.Tensor:
        return self.model.forward(ops, self.layers, ops.b.x)

    def end_step(self) -> None:
        if self._last == StepKind.DECODE:
            self.after_step()
            self.confirm_cpu()
        else:
            self.provider.step()

    def _forward(self, stage: Callable[[int], None] | None, mode: str | None = None,
                 on_layer: Callable[[int], None] | None = None) -> None:  # fmt: skip
        """One decode step's kernels, run as ``mode`` (None: the ``mode`` of now)."""
        ops = self.ops
        ops.mode = self.mode if mode is None else mode
        ops.stage, ops.on_layer = stage, on_layer
        if ops.mode == CPU:
            self.cpu.arm()  # (an eager step's posts; a capture's cost nothing)
        try:
            self.model.forward(ops, self.layers, self.buf.x)
        finally:
            ops.stage = ops.on_layer = None

    def _stage_misses(self, j: int) -> None:
        self.staging.decode(j, self.tables.plan, self.file)

    def step(self, token: int, pos: int) -> torch.Tensor:
        """Logits of ``token`` at position ``pos`` (K/V of 0..pos-1 already written): the
        runner's own buffer [V], valid until the next step. (One stage alone.)"""
        self.run_step(token, pos)
        self.after_step()
        self.confirm_cpu()
        return self.buf.logits

    def run_step(self, token: int, pos: int) -> None:
        """Queue one step's kernels: the graph where every expert has a readable home, else
        eagerly, staging the misses."""
        if not 0 <= pos < self.kv.n_ctx:
            raise ValueError(f"position {pos} is outside the context of {self.kv.n_ctx}")
        self.buf.tok.fill_(token)
        self.buf.pos.fill_(pos)
        self.counters.dirty = True
        if self.mode == CPU:
            self._arm_cpu()
        if self.tables.complete:
            graph = self.graph
            if graph is not None:
                graph.replay()
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

    def confirm_cpu(self) -> None:
        """After a step whose logits the caller reads at once: with the CPU's share on a GPU,
        wait for the step and raise ``CpuShareFault`` if its wait for the CPU gave up."""
        if self.mode == CPU and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
            self._check_cpu()

    def _arm_cpu(self) -> None:
        """A step in the "cpu" mode is about to be queued: keep the pool's server spinning
        through it, and say so if an earlier step's wait for the CPU gave up."""
        self._check_cpu()
        self.cpu.arm()

    def _check_cpu(self) -> None:
        """Raise ``CpuShareFault`` when a step waited for the CPU's answer in vain (its output is
        wrong); the CPU share is off from then on, and the steps read every RAM expert over
        PCIe."""
        why = self.cpu.fault()
        if why is None:
            return
        torch.cuda.synchronize(self.device)  # the queued steps (they wait no more) end first
        self.set_cpu_share(0, 1)
        log.error("cpu_share is off from now on: %s", why)
        raise CpuShareFault(f"{why}; that step's output is wrong, so this request stops")

    # -- greedy steps, one ahead of the host ---------------------------------------------------

    def begin(self, token: int, pos: int) -> None:
        """The first step of a greedy run reads ``token`` at ``pos``; later ones their
        predecessor's argmax at the next position (``kernels.step.advance``)."""
        self.land_exchanges()
        self.buf.tok.fill_(token)
        self.buf.pos.fill_(pos)
        self.buf.step_no.zero_()

    def launch(self, n: int, pick: Pick | None = None) -> None:
        """Queue step n of a greedy run (its input is on the device already) and the copy of
        its token to the host; nothing waits. ``pick``: as ``finish``'s."""
        self.run_ahead()
        self.finish(n, pick)

    def run_ahead(self) -> None:
        """Queue a greedy run's next step: its input is the token its predecessor left on the
        device. ``finish`` then files its token."""
        self.counters.dirty = True
        if self.kv.state is not None:  # it holds a token not committed yet
            self.kv.state.begin_step()
        if self.mode == CPU:
            self._arm_cpu()
        graph = self.graph
        if graph is not None:
            graph.replay()
        else:
            self._forward(None)

    def finish(self, n: int, pick: Pick | None = None) -> None:
        """Queue the copy of step n's token to the host. ``pick(logits, slot)`` first chooses
        that token another way than the step's plain argmax (a grammar's mask, the request's
        sampler), writing it as the next input and into ring slot n % 2."""
        b, slot = self.buf, n % 2
        if pick is not None:
            pick(b.logits, slot)
        if self.sampled.bound:
            self.sampled.copy(slot)
        else:
            b.ring_host[slot : slot + 1].copy_(b.ring[slot : slot + 1], non_blocking=True)
        if b.ring_done is not None:
            b.ring_done[slot].record()

    def result(self, n: int) -> tuple[int, TokenLogprob | None]:
        """The token of step n, and its log-probabilities where the sampler gives them (waits
        for that step only)."""
        b, slot = self.buf, n % 2
        if b.ring_done is not None:
            b.ring_done[slot].synchronize()
        self._check_cpu()
        if self.sampled.bound:
            return self.sampled.read(slot)
        return int(b.ring_host[slot]), None

    def accept(self) -> None:
        """A step of a greedy run whose token the host took (a safe point): count it as
        ``step`` does, and land the exchanges that ran beside it."""
        self.steps += 1
        self.provider.step()
        self.land_exchanges()

    # -- set-up --------------------------------------------------------------------------------

    @contextmanager
    def _uncounted(self) -> Iterator[None]:
        """Steps run inside count nothing (``UseCounters.uncounted``), copies ahead and the
        CPU's share included, and leave a hybrid's recurrent state as it was."""
        self.ahead.zero()
        self.cpu.zero()
        with self.counters.uncounted(self.provider, self.device), keep_state(self.kv.state):
            yield

    def warm_up(self, on_layer: Callable[[int], None] | None = None,
                mode: str | None = None) -> None:  # fmt: skip
        """One eager step at position 0 (its K/V row is rewritten by the next prompt): every
        kernel compiles now, not in the first request. ``mode`` as ``_forward``'s."""
        self.buf.tok.zero_()
        self.buf.pos.zero_()
        with self._uncounted():
            stage = None if self.tables.complete else self._stage_misses
            self._forward(stage, mode, on_layer)
        self.ahead.zero()
        self.cpu.zero()

    def warm_up_chunks(self) -> None:
        """Compile the prompt-chunk kernels now (``ChunkPath.warm_up``); counts nothing."""
        assert self.prefill is not None
        with self._uncounted():
            self.prefill.warm_up()

    def capture_chunks(self, chunk: int) -> bool:
        """Capture prompt chunks of up to ``chunk`` tokens as graphs; counts nothing."""
        assert self.prefill is not None
        with self._uncounted():
            return self.prefill.capture(chunk)

    def capture(self) -> bool:
        """Capture one step as a CUDA graph per mode (replayed while every expert has a
        readable home). Returns False, with ``graph_reason`` saying why, where that fails:
        steps then run the same kernels eagerly."""
        if self.device.type != "cuda":
            self.graph_reason = "CUDA graphs need a CUDA device"
            return False
        # with a host tier, RAM homes come and go with resizes: the step with copies ahead, or
        # with the CPU's share, too
        cache = self.cache
        tier = cache is not None and cache.tier is not None
        modes = [PLAIN] + ([AHEAD] if self.ahead.p and tier else [])
        modes += [CPU] if self.cpu.on and tier else []
        graphs = {}
        try:
            for mode in modes:
                if mode != PLAIN:  # its kernels compile before the capture, not inside it
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

    def tune_cpu_share(
        self, candidates: Sequence[float] = CPU_SHARE_CANDIDATES, steps: int = 4,
        rounds: int = CPU_SHARE_ROUNDS,
    ) -> float:  # fmt: skip
        """Choose the CPU's share by timing ``rounds`` rounds of ``steps`` decode steps at each
        of ``candidates`` (0: the plain step), and keep and return ``choose_share``'s (0 turns
        the CPU share off). Run after ``capture`` (or eagerly), at load: the steps write K/V
        rows from position 1, which the next prompt rewrites, and their counts are dropped.
        Nothing to choose (no CPU pool, no expert in RAM, the CPU device): the share as is."""
        if not self.cpu_sharing or self.device.type != "cuda":
            return self.cpu.share
        check_timing(candidates, steps, rounds)
        steps = max(1, min(steps, self.kv.page - 3))  # each timing from position 1
        times = self._time_shares(candidates, steps, rounds)
        try:
            self._check_cpu()
        except CpuShareFault:  # said in the log; the share is off
            return 0.0
        best = choose_share(times)
        if best == 0:
            self.set_cpu_share(0, 1)  # (no pool: the thread count is not used)
        else:
            self.cpu.share = best
            self.cpu.now.fill_(best)
        self.cpu.tuned = {s: statistics.median(ts) for s, ts in times.items()}
        log.info("%s", timing_note(best, times, steps))
        return best

    def _time_shares(
        self, candidates: Sequence[float], steps: int, rounds: int
    ) -> dict[float, list[float]]:
        """ms per step at each share, one timing a round (``round_orders``); every row is
        written in the first page: each share's steps start again from position 1."""
        times: dict[float, list[float]] = {s: [] for s in candidates}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with self._uncounted():
            for order in round_orders(candidates, rounds):
                for share in order:
                    mode = PLAIN if share == 0 else CPU
                    self.cpu.now.fill_(share)
                    graph = self.graphs.get(mode)
                    self.begin(1, 1)
                    for i in range(steps + 2):
                        if i == 2:
                            start.record()
                        if mode == CPU:
                            self.cpu.arm()
                        if graph is not None:
                            graph.replay()
                        else:
                            self._forward(None, mode=mode)
                    end.record()
                    end.synchronize()
                    times[share].append(start.elapsed_time(end) / steps)
        self.ahead.zero()
        self.cpu.zero()
        return times

    # -- what it is ----------------------------------------------------------------------------

    def decode_path(self) -> str:
        how = (
            "one CUDA graph per step" if self.graph is not None else f"eager ({self.graph_reason})"
        )
        how += pdl_note(self.device) + self.cpu.path_note(self.cpu_sharing)
        return f"fused Triton kernels, {how}{self.ops.cuts_changed()}"

    def prefill_path(self) -> str:
        if self.prefill is not None:
            return "matrix products on tensor cores over the repacked weights, grouped by expert"
        return super().prefill_path()

    def close(self) -> None:
        """Hand over the last counts and let the graphs, the CPU's threads and the cache go."""
        self.flush_usage()
        self.graphs = {}
        self.sampled.close()
        if self.prefill is not None:
            self.prefill.graphs = {}
        self.cpu.close()
        cache = self.cache
        if cache is not None:
            self._unfollow(cache)
