"""The daemon in-process (its real loop, HTTP server and engine thread, in a background thread):
leases and resizes against generations in flight.

Sizes as in test_serve: 32 experts of 1.5 MiB, a 64 MiB simulated device, an 8 MiB automatic
reserve; the shrink step is 4 MiB so that a Borrow of 20 MiB is "larger than the step".
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx
import pytest

from strata.daemon.config import StrataConfig
from strata.daemon.control.leases import NotEnoughVram
from strata.daemon.service import Daemon
from strata.daemon.worker import GenerationJob
from strata.engine import synth
from strata.engine.params import SamplingParams
from strata.serve import serve_async
from tests.integration.harness import write_simulated

PERIOD_MS = 200


class InProcess:
    def __init__(self, config: StrataConfig) -> None:
        self._ready: Future[tuple[Daemon, asyncio.Event, asyncio.AbstractEventLoop]] = Future()
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, args=(config,), daemon=True)
        self.thread.start()
        self.daemon, self.stop_event, self.loop = self._ready.result(60)
        self.daemon.worker.ready.result(60)
        self.url = self.daemon.listen_url

    def _run(self, config: StrataConfig) -> None:
        def started(daemon: Daemon, stop: asyncio.Event) -> None:
            self._ready.set_result((daemon, stop, asyncio.get_running_loop()))

        self.code = asyncio.run(serve_async(config, started))

    def call(self, coro: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(15)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth.ensure_synthetic("tiny-qwen3moe", tmp_path_factory.mktemp("models"))


@pytest.fixture
def daemon(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[InProcess]:
    d = InProcess(config_for(model, tmp_path, monkeypatch))
    yield d
    d.close()
    assert d.code == 0


def config_for(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **more: Any
) -> StrataConfig:
    for var in ("XDG_RUNTIME_DIR", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
        (tmp_path / var).mkdir(mode=0o700)
        monkeypatch.setenv(var, str(tmp_path / var))
    device = tmp_path / "device.json"
    write_simulated(device, 64)
    return StrataConfig(
        model=model,
        port=0,
        device="cpu",
        vram_monitor="simulated",
        simulated_vram_file=device,
        cache_mib=48,
        arena_chunk_mib=2,
        elastic_reserve_mib=8,
        elastic_period_ms=PERIOD_MS,
        elastic_stable_ms=600,
        elastic_shrink_step_mib=4,
        prefill_chunk_tokens=8,
        kv_cache_type="f32",
        **more,
    )


def generate(d: InProcess, prompt: list[int], max_tokens: int) -> GenerationJob:
    job = GenerationJob(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    d.daemon.worker.submit(job)
    return job


def test_borrow_larger_than_the_step_is_answered_by_one_decision(daemon: InProcess) -> None:
    controller = daemon.daemon.controller
    resizes = controller.resizes
    t0 = time.monotonic()
    lease = daemon.call(daemon.daemon.borrow(20, ":1.test", os.getpid(), "game", "test")).result(60)
    took = time.monotonic() - t0
    status = daemon.daemon.status()
    print(f"\nBorrow of 20 MiB (step 4 MiB) answered in {took * 1000:.0f} ms")  # not a test
    assert status["free_mib"] >= 20 + 8 and status["borrowed_mib"] == 20
    # the whole amount in one resize, not 4 MiB a period
    assert controller.resizes == resizes + 1
    decision = controller.last_decision
    assert decision is not None and decision.state.urgent_target_mib is None
    daemon.daemon.return_lease(lease.cookie, ":1.test")
    assert daemon.daemon.status()["leases"] == []


def test_health_and_borrow_answer_during_a_long_prefill(daemon: InProcess) -> None:
    engine = daemon.daemon.worker.engine
    prompt = engine.tokenizer.encode("The keeper of the lighthouse wrote " * 250)[:3000]
    job = generate(daemon, prompt, 4)
    started = time.monotonic()
    while daemon.daemon.worker.steps < 2:  # the prefill is under way
        time.sleep(0.005)
    worst, answered = 0.0, 0
    lease_future = daemon.call(daemon.daemon.borrow(20, ":1.t", None, "encoder", "test"))
    steps = []
    while not job.done.done():
        t0 = time.monotonic()
        r = httpx.get(daemon.url + "/health", timeout=60)
        worst = max(worst, time.monotonic() - t0)
        assert r.status_code == 200
        if not job.done.done():
            answered += 1
            steps.append(daemon.daemon.worker.steps)
        time.sleep(0.02)
    granted = lease_future.result(60)
    prefill_s = time.monotonic() - started
    print(f"\nprefill of {len(prompt)} tokens took {prefill_s:.1f} s; {answered} /health "
          f"answers during it, the slowest {worst * 1000:.0f} ms")  # fmt: skip
    # /health answered again and again while the engine computed: the loop never waited on it
    # (counted in prefill chunks, the engine's own progress, not in seconds)
    assert answered >= 3 and len(set(steps)) >= 2, (answered, steps)
    assert granted.mib == 20
    job.done.result(60)


def test_borrow_is_granted_before_the_prefill_ends(daemon: InProcess) -> None:
    engine = daemon.daemon.worker.engine
    prompt = engine.tokenizer.encode("A long prompt about rivers and mills. " * 250)[:3000]
    job = generate(daemon, prompt, 2)
    while daemon.daemon.worker.steps < 2:
        time.sleep(0.005)
    future = daemon.call(daemon.daemon.borrow(20, ":1.t", None, "encoder", "test"))
    at_reply: dict[str, bool] = {}
    # on the loop, the moment the reply is ready: was the prefill still running?
    future.add_done_callback(lambda _: at_reply.update(prefilling=not job.done.done()))
    lease = future.result(60)
    assert at_reply["prefilling"], "the Borrow had to wait for the prefill to end"
    assert lease.mib == 20
    job.done.result(60)


def test_generation_with_a_resize_equals_one_without(daemon: InProcess) -> None:
    engine = daemon.daemon.worker.engine
    prompt = engine.tokenizer.encode("Once upon a time in a quiet valley")
    quiet = generate(daemon, prompt, 48).done.result(60)
    resizes_before = daemon.daemon.controller.resizes
    job = generate(daemon, prompt, 48)
    while daemon.daemon.worker.steps == 0 or not job.done.running():
        time.sleep(0.001)
    daemon.call(daemon.daemon.reserve(30)).result(30)  # a whole-amount shrink mid-generation
    resized = job.done.result(60)
    assert daemon.daemon.controller.resizes > resizes_before, "no resize happened"
    assert resized.tokens == quiet.tokens
    assert resized.text == quiet.text


def test_the_kv_grows_trims_and_grows_again_under_a_lease_within_one_budget(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 3000 tokens of f32 K/V are 12 MiB of the 64 MiB device: the cache's tail yields them
    d = InProcess(config_for(model, tmp_path, monkeypatch, kv_keep_conversations=0))
    try:
        worker, engine = d.daemon.worker, d.daemon.worker.engine
        runner, cache = engine.sequences, engine.cache
        over: list[str] = []
        safe_point = worker._safe_point

        def checked() -> None:  # on the engine thread, between steps: nothing moves meanwhile
            safe_point()
            held = cache.arena.mapped_bytes + runner.kv.mapped_bytes
            if runner.budget is not None and held > runner.budget:
                over.append(f"{held} bytes held, budget {runner.budget}")

        worker._safe_point = checked
        long = engine.tokenizer.encode("The miller counted sacks of grain by the river. " * 300)
        long = long[:3000]
        first = generate(d, long, 4).done.result(120)
        grown = d.daemon.status()
        assert grown["kv_mib"] >= 12 and grown["kv_active_tokens"] == 3003
        generate(d, [5, 6, 7], 2).done.result(60)
        assert d.daemon.status()["kv_mib"] == 2, "trimmed to one chunk after a short prompt"
        lease = d.call(d.daemon.borrow(20, ":1.t", None, "encoder", "test")).result(60)
        again = generate(d, long, 4).done.result(120)  # grows again while the lease holds
        leased = d.daemon.status()
        assert leased["kv_mib"] >= 12 and leased["borrowed_mib"] == 20
        assert leased["cache_mib"] + leased["kv_mib"] <= leased["budget_mib"]
        assert again.tokens == first.tokens
        d.daemon.return_lease(lease.cookie, ":1.t")
        assert not over, over[:3]
    finally:
        d.close()
    assert d.code == 0


def test_a_lease_after_a_long_request_takes_that_conversations_pages(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a request has ended, its conversation's K/V is no longer the core: a lease that
    needs those pages is granted at once (not kept waiting for a next request that may never
    come), and the next turn of that conversation computes its prompt again."""
    d = InProcess(config_for(model, tmp_path, monkeypatch, kv_keep_conversations=0))
    try:
        engine, controller = d.daemon.worker.engine, d.daemon.controller
        long = engine.tokenizer.encode("The miller counted sacks of grain by the river. " * 300)
        long = long[:3000]
        first = generate(d, long, 4).done.result(120)
        before = d.daemon.status()
        assert before["kv_mib"] >= 12 and before["kv_active_tokens"] == 3003
        freeable = controller.max_freeable_mib()
        assert freeable is not None
        most = freeable - 8  # the automatic reserve stays free beside the lease
        print(f"\nafter the request: {before['kv_mib']} MiB of K/V, {before['cache_mib']} MiB "
              f"of cache, a lease may get {most} MiB")  # fmt: skip
        # more than what the cache's tail and the free room alone could give
        core_mib = -(-engine.cache.core_mapped_bytes // 2**20)
        assert most > before["free_mib"] + before["cache_mib"] - core_mib, before
        # one MiB more could never be granted: refused at once, naming the most
        with pytest.raises(NotEnoughVram, match=f"cannot free {most + 1} MiB: at most {most} "):
            d.call(d.daemon.borrow(most + 1, ":1.t", None, "encoder", "test")).result(60)
        lease = d.call(d.daemon.borrow(most, ":1.t", None, "encoder", "test")).result(60)
        leased = d.daemon.status()
        assert lease.mib == most and leased["borrowed_mib"] == most
        assert leased["kv_mib"] == 2 and leased["kv_active_tokens"] == 0  # the sink's chunk
        assert leased["cache_mib"] + leased["kv_mib"] <= leased["budget_mib"]
        # while the lease holds the room, the long prompt is refused with the numbers, with
        # max_tokens left out too (never a 500 from inside the generation)
        text = "The miller counted sacks of grain by the river. " * 100  # ~1,200 tokens
        chat = {"model": model.stem, "messages": [{"role": "user", "content": text}]}
        r = httpx.post(d.url + "/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "messages", error
        assert "MiB of K/V" in error["message"] and "prompt tokens fit" in error["message"]
        d.daemon.return_lease(lease.cookie, ":1.t")
        deadline = time.monotonic() + 60  # the budget grows back once the room has lasted
        while d.daemon.status()["budget_mib"] < before["budget_mib"]:
            assert time.monotonic() < deadline, d.daemon.status()
            time.sleep(0.05)
        again = generate(d, long, 4).done.result(120)
        assert again.cached_tokens == 0 and again.tokens == first.tokens
    finally:
        d.close()
    assert d.code == 0


def test_a_lease_that_could_never_be_granted_beside_the_reserve_is_refused_at_once(
    daemon: InProcess,
) -> None:
    """A lease needs its MiB free on top of the room kept for the reserve: one that cannot fit
    beside it is refused at once with the most it could get, not left to time out."""
    d = daemon.daemon
    limit = d.controller.max_freeable_mib()
    assert limit is not None
    daemon.call(d.reserve(20)).result(60)
    with pytest.raises(NotEnoughVram, match=f"cannot free {limit - 19} MiB: at most {limit - 20} "):
        daemon.call(d.borrow(limit - 19, ":1.t", None, "encoder", "test")).result(60)
    assert d.status()["leases"] == [] and d.status()["reserve_mib"] == 20
    lease = daemon.call(d.borrow(limit - 20, ":1.t", None, "encoder", "test")).result(60)
    assert lease.mib == limit - 20 and d.status()["free_mib"] >= limit
    d.return_lease(lease.cookie, ":1.t")
    daemon.call(d.reserve(0)).result(60)
