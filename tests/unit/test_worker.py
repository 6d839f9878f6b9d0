"""The engine worker's queue gauge: a request whose client left before it started stays in the
queue until the engine reaches it, but no longer counts as waiting."""

from __future__ import annotations

import threading
from typing import Any

from strata.daemon.worker import EngineWorker, GenerationJob
from strata.engine.params import SamplingParams


def test_the_queue_counts_only_jobs_that_can_still_run() -> None:
    worker = EngineWorker(lambda: None)  # not started: jobs stay queued
    jobs = [GenerationJob([1, 2, 3], SamplingParams(max_tokens=1)) for _ in range(4)]
    for job in jobs:
        worker.submit(job)
    assert worker.queued() == 4
    jobs[1].cancel.set()
    jobs[3].cancel.set()
    assert worker.queued() == 2
    assert worker.describe()["queued"] == 2


def test_jobs_whose_client_left_are_dropped_at_the_next_submit() -> None:
    # during one long generation, clients that come and leave must not pile up jobs
    worker = EngineWorker(lambda: None)  # not started: nothing is taken off the queue
    left = []
    for _ in range(100):
        job = GenerationJob([1], SamplingParams(max_tokens=1))
        worker.submit(job)
        job.cancel.set()  # its client left while it waited
        left.append(job)
        assert worker.held() <= 1
    waiting = GenerationJob([1], SamplingParams(max_tokens=1))
    worker.submit(waiting)
    assert worker.held() == 1 and worker.queued() == 1
    assert all(job.done.cancelled() for job in left)  # as when the engine reaches them
    assert not waiting.done.done()


# -- a growth in pieces ---------------------------------------------------------------------------


class _Cache:
    """The part of ExpertCache the worker drives: slots of 64 MiB, resizes recorded."""

    slot_bytes = 64 * 2**20

    def __init__(self, n_slots: int) -> None:
        self.n_slots = n_slots
        self.calls: list[int] = []

    def resize(self, n_slots: int, max_shrink: int | None = None) -> Any:
        from strata.engine.experts.cache import ResizeResult

        self.calls.append(n_slots)
        before, self.n_slots = self.n_slots, n_slots
        return ResizeResult(before, n_slots, abs(n_slots - before), 0.001)


class _Port:
    """An engine behind the worker's ``EnginePort``: one cache per stage, each stage's budget
    (None: none) and the slots its refill would reach (``wants``); budgets set are recorded with
    their stage; a generation passes 20 safe points."""

    engine = None  # the API edges' engine: none here

    def __init__(self, *caches: _Cache) -> None:
        self.caches = list(caches)
        self.stage_budgets: list[int | None] = [None] * len(caches)
        self.wants: list[int | None] = [None] * len(caches)
        self.budgets: list[tuple[int, int]] = []
        self.listeners: dict[int, Any] = {}
        self.safe_points: list[int] = []

    def stage_count(self) -> int:
        return len(self.caches)

    def cache(self, stage: int) -> _Cache:
        return self.caches[stage]

    def budget(self, stage: int) -> int | None:
        return self.stage_budgets[stage]

    def set_budget(self, stage: int, budget: int) -> int:
        self.budgets.append((stage, budget))
        return budget // self.caches[stage].slot_bytes

    def refill_slots(self, stage: int) -> int | None:
        want = self.wants[stage]
        return want if want is not None and want > self.caches[stage].n_slots else None

    def listen(self, stage: int, on_resized: Any) -> None:
        self.listeners[stage] = on_resized

    def generate(self, prompt: Any, params: Any, *, safe_point: Any, **_: Any) -> str:
        for _ in range(20):  # a generation of 20 steps
            self.safe_points.append(self.caches[0].n_slots)
            safe_point()
        return "done"

    def save_profile(self) -> None:
        pass

    def close(self) -> None:
        pass


def _budget_port(cache: _Cache, want: int) -> _Port:
    """One stage whose budget has room for ``want`` slots once the K/V gave its pages back."""
    port = _Port(cache)
    port.stage_budgets[0], port.wants[0] = want * cache.slot_bytes, want
    return port


def test_a_growth_comes_in_pieces_and_a_request_does_not_wait_for_all_of_them() -> None:
    from strata.daemon.worker import GROW_PIECE_BYTES

    cache = _Cache(4)
    engine = _Port(cache)
    worker = EngineWorker(lambda: engine)  # type: ignore[arg-type, return-value]
    piece = GROW_PIECE_BYTES // cache.slot_bytes
    assert piece == 4
    resized: list[tuple[int, int]] = []
    worker.on_resized[0] = lambda r, why: resized.append((r.from_slots, r.to_slots))
    job = GenerationJob([1], SamplingParams(max_tokens=1))
    with worker._cv:  # both at once, before the engine thread looks
        worker._jobs.append(job)
        done = worker.request_resize(4 + 5 * piece, None, "room (request)")
    worker.start()
    assert job.done.result(30) == "done" and done.result(30).to_slots == 4 + 5 * piece
    worker.stop(30)
    # one piece before the job started, then one per safe point: the job began with the cache
    # four pieces short of its target instead of waiting for the whole refill
    assert cache.calls == [8, 12, 16, 20, 24]
    assert engine.safe_points[:5] == [8, 12, 16, 20, 24]
    assert resized == [(4, 8), (8, 12), (12, 16), (16, 20), (20, 24)]
    assert worker.resize_epoch == 10  # even: no resize under way


def test_the_room_a_request_gave_back_refills_the_cache_in_pieces_after_it() -> None:
    from strata.daemon.worker import GROW_PIECE_BYTES

    cache = _Cache(4)
    piece = GROW_PIECE_BYTES // cache.slot_bytes
    engine = _budget_port(cache, 4 + 3 * piece)
    worker = EngineWorker(lambda: engine)  # type: ignore[arg-type, return-value]
    resized: list[tuple[int, int, str]] = []
    worker.on_resized[0] = lambda r, why: resized.append((r.from_slots, r.to_slots, why))
    worker.start()
    worker.ready.result(30)
    assert set(engine.listeners) == {0}, "the worker hears of the engine's own resizes"
    first = GenerationJob([1], SamplingParams(max_tokens=1))
    worker.submit(first)
    assert first.done.result(30) == "done"
    assert engine.safe_points == [4] * 20, "nothing grew during the request"
    second = GenerationJob([1], SamplingParams(max_tokens=1))
    worker.submit(second)
    assert second.done.result(30) == "done"
    worker.stop(30)
    # after the first request: one piece at a time, the budget asked again at each piece
    assert cache.calls[:3] == [4 + piece, 4 + 2 * piece, 4 + 3 * piece]
    assert [why for *_, why in resized[:3]] == ["room the K/V gave back"] * 3
    assert engine.budgets[:3] == [(0, engine.stage_budgets[0])] * 3
    assert cache.n_slots == 4 + 3 * piece


def test_a_pending_resize_is_not_replaced_by_the_refill_after_a_request() -> None:
    from strata.daemon.worker import _Resize

    cache = _Cache(40)
    engine = _budget_port(cache, 60)
    worker = EngineWorker(lambda: engine)  # type: ignore[arg-type, return-value]
    worker.port = engine  # type: ignore[assignment]  # as the engine thread sees it
    pending = _Resize(8, None, "reserve (request)", [])
    worker._resizes[0] = pending  # a shrink asked for while the request ran
    worker._refill_after_request()
    assert worker._resizes[0] is pending, "the newer request decides the size"
    worker._resizes.clear()
    worker._refill_after_request()
    refill = worker._resizes.get(0)
    assert refill is not None and refill.reason == "room the K/V gave back"
    assert refill.budget_bytes == engine.stage_budgets[0] and refill.futures == []
    engine.wants[0] = 40  # no room left: nothing to ask
    worker._resizes.clear()
    worker._refill_after_request()
    assert worker._resizes == {}


def test_a_shrink_comes_at_once() -> None:
    cache = _Cache(40)
    worker = EngineWorker(lambda: _Port(cache))  # type: ignore[arg-type, return-value]
    worker.start()
    worker.ready.result(30)
    assert worker.request_resize(4, None, "reserve (request)").result(30).to_slots == 4
    worker.stop(30)
    assert cache.calls == [4]


# -- a layer split: one cache and one pending resize per stage ----------------------------------


def test_each_stage_has_its_own_pending_resize_and_cache() -> None:
    first, second = _Cache(40), _Cache(40)
    engine = _Port(first, second)
    worker = EngineWorker(lambda: engine)  # type: ignore[arg-type, return-value]
    worker.port = engine  # type: ignore[assignment]  # not started: requests stay pending
    assert worker.stage_cache(0) is first and worker.stage_cache(1) is second
    one = worker.request_resize(10, None, "lease (request)", stage=1)
    zero = worker.request_resize(30, None, "reserve (request)")
    assert set(worker._resizes) == {0, 1}, "a request for stage 1 never replaces stage 0's"
    newer = worker.request_resize(8, None, "lease (request)", stage=1)
    assert worker._resizes[1].n_slots == 8 and worker._resizes[0].n_slots == 30
    seen: list[tuple[str, int, int]] = []
    worker.on_resized[0] = lambda r, why: seen.append(("stage 0", r.from_slots, r.to_slots))
    worker.on_resized[1] = lambda r, why: seen.append(("stage 1", r.from_slots, r.to_slots))
    worker._apply_resizes()
    assert first.calls == [30] and second.calls == [8]
    assert one.result(0).to_slots == newer.result(0).to_slots == 8  # the newer size answers both
    assert zero.result(0).to_slots == 30
    assert seen == [("stage 0", 40, 30), ("stage 1", 40, 8)]
    assert worker._resizes == {}


def test_a_stage_budget_goes_to_that_stage() -> None:
    first, second = _Cache(4), _Cache(4)
    engine = _Port(first, second)
    worker = EngineWorker(lambda: engine)  # type: ignore[arg-type, return-value]
    worker.start()
    worker.ready.result(30)
    done = worker.request_budget(6 * _Cache.slot_bytes, "room (period)", stage=1)
    assert done.result(30).to_slots == 6
    worker.stop(30)
    assert engine.budgets == [(1, 6 * _Cache.slot_bytes)]
    assert first.calls == [] and second.calls == [6], "stage 0's cache is left alone"
    # a resize the K/V's growth makes in stage 1 reaches stage 1's listener, not stage 0's
    heard: list[tuple[str, str]] = []
    worker.on_resized[0] = lambda r, why: heard.append(("stage 0", why))
    worker.on_resized[1] = lambda r, why: heard.append(("stage 1", why))
    engine.listeners[1](second.resize(5), "K/V growth")
    assert heard == [("stage 1", "K/V growth")]


def test_a_waiting_job_whose_client_left_leaves_the_queue_at_once() -> None:
    """The queue gauges (queued, and engine_jobs: what the queue holds) drop a waiting request
    when its client goes, not when the engine reaches it or the next request comes."""
    import asyncio
    from types import SimpleNamespace

    from strata.daemon.api.generation import Generations

    async def check_nothing(why: str = "") -> None:
        return None

    controller = SimpleNamespace(request_began=lambda: None, request_ended=lambda: None,
                                 check=check_nothing)  # fmt: skip
    worker = EngineWorker(lambda: None)  # not started: jobs stay queued

    async def scenario() -> None:
        gens = Generations(worker, controller, max_queued=4)
        first = await gens.submit([1, 2], SamplingParams(max_tokens=1), received=0.0)
        second = await gens.submit([3, 4], SamplingParams(max_tokens=1), received=0.0)
        assert worker.held() == 2 and worker.queued() == 2
        second.cancel()  # its client went away while it waited
        assert worker.held() == 1 and worker.queued() == 1
        assert second.job.done.cancelled() and not first.job.done.done()
        await asyncio.sleep(0)  # the done callback hops to the loop: counted as abandoned
        assert worker.withdraw(second.job) is False  # gone already

    asyncio.run(scenario())


def test_the_allocator_hands_memory_back_after_a_request_when_nothing_waits() -> None:
    """After a request with nothing waiting, the C allocator's free memory goes back to the
    system (malloc_trim): a long prompt's temporaries no longer stay resident for ever."""
    from strata.daemon.worker import CAllocator

    done = "done"
    engine = _Port(_Cache(4))
    worker = EngineWorker(lambda: engine)  # type: ignore[arg-type, return-value]
    worker.start()
    try:
        worker.ready.result(30)
        job = GenerationJob([1, 2], SamplingParams(max_tokens=1))
        worker.submit(job)
        assert job.done.result(30) is done
        for _ in range(3000):  # the trim follows the result; a hang guard, not a timing
            if worker.trims:
                break
            threading.Event().wait(0.01)
        assert worker.trims == 1
    finally:
        worker.stop(10)
    held = CAllocator().held_bytes()
    assert held is None or held > 0  # glibc says what it holds; elsewhere: unknown, not 0
