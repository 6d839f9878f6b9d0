"""One generation at a time, first come first served, between the asyncio loop and the engine.

``Generations.submit`` admits a request (at most ``max_queued`` waiting behind the running one,
else :class:`QueueFull`), runs the VRAM controller's per-request check, and hands the job to the
engine thread. A :class:`Generation` carries the text back to the loop as it becomes final (as
:class:`Piece` objects, with the log-probabilities of the tokens that made it) and cancels its
job when the client goes away: a waiting job then never starts (the worker skips cancelled jobs)
and a running one stops at its next step.

No HTTP here: the caller passes the ASGI ``receive`` callable only so a disconnect can be seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from strata.daemon.worker import EngineWorker, GenerationJob
from strata.engine.generation import GenerationResult, TokenLogprob
from strata.engine.grammar import Constraint
from strata.engine.params import SamplingParams

if TYPE_CHECKING:
    from starlette.types import Receive

    from strata.daemon.control.control import ControlGroup, VramController

log = logging.getLogger("strata.daemon.generation")  # the name its log lines always had

_END = object()
_MEAN_WEIGHT = 0.2  # weight of the newest generation in the running mean duration


class QueueFull(Exception):
    """``max_queued`` requests already wait behind the running one."""

    def __init__(self, waiting: int, mean_generation_s: float | None) -> None:
        super().__init__(f"{waiting} requests are already waiting for the engine (the limit)")
        self.waiting = waiting
        self.mean_generation_s = mean_generation_s


class NotServing(Exception):
    """The engine is stopping: the request was not run, or not to its end."""


@dataclass(frozen=True)
class Finished:
    """What the metrics learn about one generation once the engine is done with it.

    ``outcome``: ``stop``/``length`` (complete), ``cancelled`` (started, then the client left or
    the daemon stopped), ``abandoned`` (the client left before it started), ``dropped`` (the
    daemon stopped before it started), ``error``.
    """

    outcome: str
    received: float  # time.monotonic() when the request arrived
    result: GenerationResult | None


@dataclass(frozen=True)
class Piece:
    """Text as it became final, and the log-probabilities of the tokens since the last piece
    (empty unless asked for; a last piece may hold only those: a stop string's tokens)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


class Generation:
    """One admitted request: ``pieces()`` (streaming) or ``result()``, never both."""

    def __init__(self, job: GenerationJob, received: float) -> None:
        self.job = job
        self.received = received
        self.started: float | None = None  # monotonic, set on the engine thread
        self.number = 0  # its place in the order of admission (the log names it)
        self.left = False  # the client went away
        self.released = False
        self.closed = False  # the response is over: nobody takes text any more
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._watch: asyncio.Task[None] | None = None
        self._on_cancel: Callable[[Generation], None] = lambda g: None
        self._stash: list[TokenLogprob] = []  # logprobs waiting for their text (engine thread)

    async def pieces(self) -> AsyncIterator[Piece]:
        """Text as it becomes final; the generation is over when this ends (see ``final``).
        Closing it early (the client left) cancels the job."""
        try:
            while (item := await self._queue.get()) is not _END:
                yield item
        finally:
            self.close()

    async def result(self) -> GenerationResult:
        async for _ in self.pieces():
            pass
        return self.final()

    def final(self) -> GenerationResult:
        """The finished generation; raises :class:`NotServing` when the daemon stopped it and
        the engine's own error when it failed."""
        done = self.job.done
        if done.cancelled():
            raise NotServing("the daemon stopped before this request started")
        error = done.exception()
        if error is not None:
            raise error
        result = done.result()
        if result.finish_reason == "cancelled":
            raise NotServing("the daemon is stopping; the generation was cut short")
        return result

    def cancel(self) -> None:
        """The client left: a waiting job never starts, a running one stops at its next step."""
        if not self.job.done.done():
            self.left = True
            self.job.cancel.set()
            self._on_cancel(self)

    def close(self) -> None:
        """The response is over: sent, or given up. Text still queued, or still coming from a
        generation that stops at its next step, is dropped: nobody would take it."""
        self.cancel()
        self.closed = True
        while not self._queue.empty():
            self._queue.get_nowait()
        if self._watch is not None:
            self._watch.cancel()

    def _put(self, item: Any) -> None:  # on the loop
        if not self.closed:
            self._queue.put_nowait(item)

    async def _watch_disconnect(self, receive: Receive) -> None:
        # Once the body is read, the server's receive() answers only when the client goes away
        # (or the response is complete, when cancelling is a no-op).
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.cancel()
                return


class Generations:
    """The FIFO in front of the engine thread."""

    def __init__(
        self,
        worker: EngineWorker,
        controller: ControlGroup | VramController,
        max_queued: int,
        observe: Callable[[Finished], None] | None = None,
    ) -> None:
        self.worker = worker
        self.controller = controller
        self.max_queued = max_queued
        self.observe = observe
        self.mean_generation_s: float | None = None
        self._lock = threading.Lock()
        self._in_flight = 0  # admitted and not finished (or given up before starting)
        self._admitted = 0  # requests admitted since start: each one's number
        self._live: weakref.WeakSet[Generation] = weakref.WeakSet()  # for buffered()

    async def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        received: float,
        stream: bool = False,
        receive: Receive | None = None,
        constraint: Constraint | None = None,
        show_special: frozenset[int] = frozenset(),
    ) -> Generation:
        """Admit and queue one generation. Raises :class:`QueueFull` or :class:`NotServing`."""
        with self._lock:
            # the running one plus max_queued waiting ones
            if self._in_flight >= self.max_queued + 1:
                raise QueueFull(self._in_flight - 1, self.mean_generation_s)
            self._in_flight += 1
            self._admitted += 1
            number = self._admitted
        self.controller.request_began()  # not idle (idle_release_s) until it is over
        loop = asyncio.get_running_loop()
        job = GenerationJob(prompt, params, constraint=constraint, show_special=show_special)
        gen = Generation(job, received)
        gen.number = number
        gen._on_cancel = self._given_up
        if stream:

            def on_text(text: str) -> None:  # engine thread
                _hop(loop, gen._put, Piece(text, tuple(gen._stash)))
                gen._stash.clear()

            job.on_text = on_text
            job.on_logprobs = gen._stash.extend

        def on_start() -> None:  # engine thread
            gen.started = time.monotonic()

        job.on_start = on_start
        job.done.add_done_callback(lambda _: _hop(loop, self._finished, gen))
        try:
            await self._check_vram()
            self.worker.submit(job)
        except BaseException as e:
            self._release(gen)
            if isinstance(e, RuntimeError):
                raise NotServing(str(e)) from None
            raise
        if receive is not None:
            gen._watch = loop.create_task(gen._watch_disconnect(receive))
        self._live.add(gen)
        return gen

    def buffered(self) -> int:
        """Text pieces generated and not yet taken by their responses (each response holds at
        most max_tokens + 1, the pieces and the end, and none once it is over)."""
        return sum(gen._queue.qsize() for gen in list(self._live))

    async def _check_vram(self) -> None:
        # The policy looks at VRAM at each request's start too; a resize it asks for applies at
        # the next safe point. A failing check must not fail the request.
        try:
            await self.controller.check("request")
        except Exception:
            log.exception("VRAM check at a request's start failed")

    def _given_up(self, gen: Generation) -> None:
        if gen.started is None:
            self._release(gen)  # it will never start: its place in the queue is free now
            self.worker.withdraw(gen.job)  # and off the engine's queue at once, not when reached

    def _release(self, gen: Generation) -> None:
        with self._lock:
            if gen.released:
                return
            gen.released = True
            self._in_flight -= 1
        self.controller.request_ended()

    def _finished(self, gen: Generation) -> None:  # on the loop, once the engine is done
        self._release(gen)
        done = gen.job.done
        result = None
        if done.cancelled():
            outcome = "abandoned" if gen.left else "dropped"
        elif done.exception() is not None:
            outcome = "error"
            log.error("generation failed: %s", done.exception())
        else:
            result = done.result()
            outcome = result.finish_reason
            log.info("%s", request_line(gen, result))
            if outcome != "cancelled" and gen.started is not None:
                took = time.monotonic() - gen.started
                mean = self.mean_generation_s
                self.mean_generation_s = (
                    took if mean is None else mean + _MEAN_WEIGHT * (took - mean)
                )
        if self.observe is not None:
            try:
                self.observe(Finished(outcome, gen.received, result))
            except Exception:
                log.exception("observing a finished generation failed")
        if gen._stash:  # the engine is done with it: logprobs no text followed
            gen._put(Piece("", tuple(gen._stash)))
            gen._stash = []
        gen._put(_END)


def request_line(gen: Generation, r: GenerationResult) -> str:
    """The log line of one finished generation, as llama-server prints one: the prompt (and how
    much of it came from the K/V of an earlier request), what was generated, the speeds, and the
    time from the request's arrival to its first token."""
    computed = r.prompt_tokens - r.cached_tokens
    prefill = f", {computed / r.prefill_s:.1f} tok/s" if computed and r.prefill_s > 0 else ""
    decode = f"{r.decode_tok_s:.1f} tok/s" if r.decode_tok_s else "n/a tok/s"
    first = (r.token_times[0] - gen.received) if r.token_times else None
    ttft = f"{first * 1000:.0f} ms" if first is not None else "none"
    return (
        f"request {gen.number}: prompt {r.prompt_tokens} tokens ({r.cached_tokens} cached"
        f"{prefill}), {r.completion_tokens} generated at {decode}, first token after {ttft}, "
        f"finish {r.finish_reason}"
    )


def _hop(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """From the engine thread to the loop (a closed loop: the daemon is gone, nobody listens)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)
