"""The engine worker's queue gauge: a request whose client left before it started stays in the
queue until the engine reaches it, but no longer counts as waiting."""

from __future__ import annotations

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
