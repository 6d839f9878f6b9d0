"""The engine thread: loads the model, runs one generation at a time, applies cache resizes at safe
points. The asyncio loop never waits on compute: it hands work over and gets futures back.

A resize requested while the engine is idle applies at once; while a generation runs it applies at
the next safe point (a prefill chunk boundary or a decode step). Only the newest requested size
matters: a request replaces the one still pending, whose future then resolves with the newer
result. A growth is applied in pieces of at most ``GROW_PIECE_BYTES``, one per safe point (back
to back while nothing waits), so a request that arrives during a refill (the first one after an
idle release) starts at once and never waits for the whole refill.

A model split over several devices (``devices``) has one cache per stage and one pending resize
per stage: a request for stage 1 never replaces one for stage 0, and each applies to its own
stage's cache. The worker reaches the engine only through ``engine_port.EnginePort``: every stage,
the first one included, by its number.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from strata.daemon.engine_port import CachePort, EnginePort, first_if_none
from strata.engine.experts.cache import ResizeResult
from strata.engine.generate import Engine
from strata.engine.generation import GenerationResult, TokenLogprob
from strata.engine.grammar import Constraint
from strata.engine.params import SamplingParams

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
MMAP_THRESHOLD_BYTES = 4 * 2**20  # blocks this large and larger: mapped, and unmapped when freed


class CAllocator:
    """glibc's malloc, where the process has it: ``trim()`` hands the memory it holds free back
    to the system (``malloc_trim``), ``held_bytes()`` says what it holds (``mallinfo2``: the
    heaps and the mapped blocks). Elsewhere (musl, macOS) both do nothing and say None.

    Why: a long prompt's prefill allocates and frees large temporaries; glibc keeps freed heap
    memory for reuse and raises its mmap threshold after each large free, so without a trim the
    daemon's resident memory grows with the longest prompts seen (368 -> 554 -> 692 MiB over two
    passes of the same requests) and never comes back."""

    def __init__(self) -> None:
        import ctypes
        import ctypes.util

        self._trim: Any = None
        self._info: Any = None
        self._opt: Any = None
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else None
            self._trim = libc.malloc_trim if libc is not None else None
            self._info = libc.mallinfo2 if libc is not None else None
            self._opt = libc.mallopt if libc is not None else None
        except (OSError, AttributeError):
            pass
        if self._trim is not None:
            self._trim.argtypes, self._trim.restype = [ctypes.c_size_t], ctypes.c_int
        if self._info is not None:
            names = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")  # fmt: skip
            fields = [(n, ctypes.c_size_t) for n in names]
            self._info.restype = type("mallinfo2", (ctypes.Structure,), {"_fields_": fields})

    def fix_mmap_threshold(self, nbytes: int) -> bool:
        """Blocks of ``nbytes`` or more get pages of their own, returned when freed: glibc's
        threshold otherwise rises with every large block freed (up to 32 MiB), and the
        prefill's temporaries then fragment the heaps. False where it cannot be set."""
        if self._opt is None:
            return False
        return bool(self._opt(M_MMAP_THRESHOLD, nbytes))

    def trim(self) -> None:
        if self._trim is not None:
            self._trim(0)

    def held_bytes(self) -> int | None:
        """The heaps' bytes and the mapped blocks' bytes the allocator holds now."""
        if self._info is None:
            return None
        info = self._info()
        return int(info.arena + info.hblkhd)


# A growth fills at most this much per safe point: about 55 ms of copying and repacking on an
# H200 (a 4 GiB refill took 886 ms), so a decode step during a refill waits that long at most.
GROW_PIECE_BYTES = 256 * 2**20


class State(StrEnum):
    LOADING = "loading"
    READY = "ready"
    STOPPING = "stopping"
    FAILED = "failed"


@dataclass
class GenerationJob:
    """One generation. ``on_text`` and ``on_logprobs`` run on the engine thread (callers hop to
    their loop); ``cancel`` is checked at every safe point, before the job starts too;
    ``constraint`` and ``show_special`` as ``Engine.generate`` takes them."""

    prompt: list[int]
    params: SamplingParams
    on_text: Callable[[str], None] | None = None
    on_logprobs: Callable[[list[TokenLogprob]], None] | None = None
    constraint: Constraint | None = None
    show_special: frozenset[int] = frozenset()
    cancel: threading.Event = field(default_factory=threading.Event)
    done: cf.Future[GenerationResult] = field(default_factory=cf.Future)
    on_start: Callable[[], None] | None = None


@dataclass
class _Resize:
    n_slots: int
    max_shrink: int | None
    reason: str
    futures: list[cf.Future[ResizeResult]]
    from_slots: int | None = None  # where a growth in pieces began
    seconds: float = 0.0  # the pieces' time so far
    copied: int = 0
    # bytes for the cache and the K/V together: n_slots follows from it at each piece (the
    # K/V's share first, as it is then)
    budget_bytes: int | None = None


class EngineWorker:
    def __init__(self, load: Callable[[], EnginePort]) -> None:
        self._load = load
        self.port: EnginePort | None = None  # once loaded
        self.state = State.LOADING
        self.error: BaseException | None = None
        self.ready = cf.Future[None]()
        self._jobs: deque[GenerationJob] = deque()
        self._resizes: dict[int, _Resize] = {}  # the pending resize of each stage
        self._cv = threading.Condition()
        self._stop = False
        self.busy = False
        self.steps = 0  # safe points passed: prefill chunks and decode steps
        self.tokens = 0  # tokens generated since start, counted as each one is
        # Odd while a resize maps or unmaps memory: a reading of the device taken while it
        # changed (or was odd) may count Strata's own memory as another program's.
        self.resize_epoch = 0
        # told of each resize of a stage's cache, by stage number (0: the first)
        self.on_resized: dict[int, Callable[[ResizeResult, str], None]] = {}
        self._thread = threading.Thread(target=self._run, name="strata-engine", daemon=True)
        self.allocator = CAllocator()
        self.allocator.fix_mmap_threshold(MMAP_THRESHOLD_BYTES)
        self.trims = 0  # the allocator's free memory handed back, after requests

    # -- control (any thread) -------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def engine(self) -> Engine | None:
        """The loaded engine itself, for the API edges (its tokenizer and chat template); None
        before it is loaded."""
        return self.port.engine if self.port is not None else None

    @property
    def loaded(self) -> bool:
        return self.port is not None

    def stage_cache(self, stage: int) -> CachePort | None:
        """The expert cache of ``stage``; None before the model is loaded, or without one."""
        return self.port.cache(stage) if self.port is not None else None

    def submit(self, job: GenerationJob) -> None:
        """Queue ``job``. Jobs cancelled while they waited are dropped here (their futures
        cancelled, as when the engine reaches them): during one long generation, clients that
        come and leave would otherwise pile up jobs that never run."""
        with self._cv:
            if self._stop:
                raise RuntimeError("the engine is stopping")
            dropped = [j for j in self._jobs if j.cancel.is_set()]
            if dropped:
                self._jobs = deque(j for j in self._jobs if not j.cancel.is_set())
            self._jobs.append(job)
            self._cv.notify()
        for j in dropped:  # outside the lock: the futures' callbacks run here
            j.done.cancel()

    def withdraw(self, job: GenerationJob) -> bool:
        """Take ``job`` off the queue now (its client left while it waited), its future
        cancelled as when the engine reaches it: the queue and what it holds count it no more.
        False when it is no longer queued (running, done, or never submitted)."""
        with self._cv:
            try:
                self._jobs.remove(job)
            except ValueError:
                return False
        job.cancel.set()
        job.done.cancel()  # outside the lock: the future's callbacks run here
        return True

    def queued(self) -> int:
        """Jobs that wait and can still run (a cancelled one stays in the deque until the
        engine reaches it or the next submit drops it, but no longer counts)."""
        with self._cv:
            return sum(1 for job in self._jobs if not job.cancel.is_set())

    def held(self) -> int:
        """Jobs in the queue, cancelled ones not dropped yet included: what it holds."""
        with self._cv:
            return len(self._jobs)

    def request_resize(
        self, n_slots: int, max_shrink: int | None, reason: str, stage: int | None = None
    ) -> cf.Future[ResizeResult]:
        """Ask for ``n_slots`` in ``stage``'s cache at the next safe point (at once when idle);
        ``stage`` None: the first, as where a caller names no device."""
        stage = first_if_none(stage)
        fut: cf.Future[ResizeResult] = cf.Future()
        with self._cv:
            pending = self._resizes.get(stage)
            futures = pending.futures if pending else []
            self._resizes[stage] = _Resize(n_slots, max_shrink, reason, [*futures, fut])
            self._cv.notify()
        return fut

    def request_budget(
        self, budget_bytes: int, reason: str, stage: int | None = None
    ) -> cf.Future[ResizeResult]:
        """Ask for ``budget_bytes`` for ``stage``'s cache and K/V together at the next safe point
        (at once when idle): the K/V's kept conversations yield first, the cache gets the rest
        (never below its core). ``stage`` None: the first."""
        stage = first_if_none(stage)
        fut: cf.Future[ResizeResult] = cf.Future()
        with self._cv:
            pending = self._resizes.get(stage)
            futures = pending.futures if pending else []
            cache = self.stage_cache(stage)
            now = cache.n_slots if cache is not None else 0
            self._resizes[stage] = _Resize(
                now, None, reason, [*futures, fut], budget_bytes=budget_bytes
            )
            self._cv.notify()
        return fut

    def stop(self, timeout: float | None = None) -> None:
        """Cancel queued and running work, free the cache's memory, end the thread."""
        with self._cv:
            self._stop = True
            for job in self._jobs:
                job.cancel.set()
            self._cv.notify()
        self._thread.join(timeout)

    # -- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            port = self._load()
        except BaseException as e:  # reported to the service, which exits with its code
            self.error = e
            self.state = State.FAILED
            self.ready.set_exception(e)
            return
        # the K/V's growth resizes a stage's cache itself: the control plane hears of it as of any
        # (and the refill after a request comes from here, in pieces)
        for number in range(port.stage_count()):
            port.listen(number, lambda r, why, n=number: self._resized(n, r, why))
        self.port = port
        self.state = State.READY
        self.ready.set_result(None)
        try:
            while True:
                with self._cv:
                    while not (self._stop or self._jobs or self._resizes):
                        self._cv.wait()
                    if self._stop:
                        break
                    job = self._jobs.popleft() if self._jobs else None
                self._apply_resizes()
                if job is not None:
                    self._run_job(job)
        finally:
            self._shutdown()

    def _run_job(self, job: GenerationJob) -> None:
        assert self.port is not None
        if job.cancel.is_set() or not job.done.set_running_or_notify_cancel():
            if not job.done.done():
                job.done.cancel()
            return
        if job.on_start is not None:
            job.on_start()
        self.busy = True
        try:
            result = self.port.generate(
                job.prompt,
                job.params,
                on_text=job.on_text,
                cancelled=lambda: job.cancel.is_set() or self._stop,
                safe_point=self._safe_point,
                constraint=job.constraint,
                show_special=job.show_special,
                on_logprobs=job.on_logprobs,
                on_token=self._count_token,
            )
        except BaseException as e:
            job.done.set_exception(e)
        else:
            job.done.set_result(result)
        finally:
            self.busy = False
            self._refill_after_request()
            with self._cv:
                idle = not self._jobs
            if idle:  # nothing waits: hand the request's freed temporaries back to the system
                self.allocator.trim()
                self.trims += 1

    def _refill_after_request(self) -> None:
        """The room a request's K/V gave back goes to the cache's tail, in pieces like any growth
        (a request arriving meanwhile starts at once) — unless a resize is already pending: the
        newer request decides the size. Each stage of a split refills its own cache."""
        port = self.port
        if port is None:
            return
        for number in range(port.stage_count()):
            budget_bytes = port.budget(number)
            if budget_bytes is None or port.refill_slots(number) is None:
                continue
            with self._cv:
                cache = self.stage_cache(number)
                if number not in self._resizes and cache is not None:
                    self._resizes[number] = _Resize(cache.n_slots, None, "room the K/V gave back",
                                                    [], budget_bytes=budget_bytes)  # fmt: skip

    def _count_token(self) -> None:
        self.tokens += 1  # one writer (this thread); the loop only reads it

    def _safe_point(self) -> None:
        self.steps += 1
        self._apply_resizes()

    def _apply_resizes(self) -> None:
        """Each stage's pending resize (stage 0 first)."""
        with self._cv:
            stages = sorted(self._resizes)
        for stage in stages:
            self._apply_resize(stage)

    def _resized(self, stage: int, result: ResizeResult, reason: str) -> None:
        listener = self.on_resized.get(stage)
        if listener is not None:
            listener(result, reason)

    def _apply_budget(self, stage: int, pending: _Resize) -> None:
        """A resize asked as a budget (cache and K/V together): the K/V's share first, as it
        is now, then the slots that leave."""
        if pending.budget_bytes is None or self.port is None:
            return
        self.resize_epoch += 1  # the K/V may unmap
        try:
            pending.n_slots = self.port.set_budget(stage, pending.budget_bytes)
        finally:
            self.resize_epoch += 1

    def _apply_resize(self, stage: int) -> None:
        with self._cv:
            pending = self._resizes.pop(stage, None)
        if pending is None:
            return
        cache = self.stage_cache(stage)
        if cache is None:
            err = RuntimeError("no expert cache to resize")
            for f in pending.futures:
                f.set_exception(err)
            return
        start = cache.n_slots
        self._apply_budget(stage, pending)
        piece = max(1, GROW_PIECE_BYTES // cache.slot_bytes)
        to = min(pending.n_slots, start + piece) if pending.n_slots > start else pending.n_slots
        self.resize_epoch += 1
        try:
            result = cache.resize(to, pending.max_shrink)
        except BaseException as e:
            log.error("cache resize of stage %d to %d slots failed: %s", stage, to, e)
            for f in pending.futures:
                f.set_exception(e)
            return
        finally:
            self.resize_epoch += 1
        began = pending.from_slots if pending.from_slots is not None else result.from_slots
        seconds, copied = pending.seconds + result.seconds, pending.copied + result.copied
        self._resized(stage, result, pending.reason)
        if to < pending.n_slots and result.to_slots == to:  # more pieces to come
            with self._cv:
                newer = self._resizes.get(stage)
                if newer is None:
                    self._resizes[stage] = _Resize(
                        pending.n_slots, pending.max_shrink, pending.reason, pending.futures,
                        began, seconds, copied, pending.budget_bytes,
                    )  # fmt: skip
                    self._cv.notify()
                    return
                # a newer size replaced it: its futures wait for that one
                newer.futures = [*pending.futures, *newer.futures]
                if newer.from_slots is None:
                    newer.from_slots, newer.seconds, newer.copied = began, seconds, copied
                return
        if began != result.to_slots:
            log.info(
                "cache%s resized %d -> %d slots (%.0f -> %.0f MiB) for %s in %.1f ms, %d copied",
                f" of stage {stage}" if stage else "",
                began,
                result.to_slots,
                began * cache.slot_bytes / 2**20,
                result.to_slots * cache.slot_bytes / 2**20,
                pending.reason,
                seconds * 1000,
                copied,
            )
        for f in pending.futures:
            f.set_result(result)

    def _shutdown(self) -> None:
        with self._cv:
            jobs, self._jobs = list(self._jobs), deque()
            pending, self._resizes = list(self._resizes.values()), {}
        for job in jobs:
            job.done.cancel()
        for resize in pending:
            for f in resize.futures:
                f.cancel()
        if self.port is not None:
            self.port.save_profile()
            self.port.close()  # unmaps the arena: the VRAM goes back now

    def describe(self) -> dict[str, str | bool | int]:
        return {"state": str(self.state), "busy": self.busy, "queued": self.queued()}
