"""Ollama's ``POST /api/pull``: the model library's pull (``hf_pull``, what ``strata pull`` runs)
with Ollama's progress events.

``model`` is what ``strata pull`` takes: ``owner/name[:QUANT]`` of a Hugging Face repository,
also written ``hf.co/owner/name:QUANT`` as Ollama's users write it. Streamed (Ollama's default),
the reply is NDJSON: ``{"status": "pulling manifest"}``, then for each file
``{"status": "pulling NAME", "digest": "sha256:…", "total": N, "completed": M}`` as its bytes
land (about every percent), then ``{"status": "success"}``; an error is an ``{"error": …}``
line. With ``stream: false`` the one reply is ``{"status": "success"}`` or the error. A client
that leaves stops the download; its ``.part`` files stay, and the next pull resumes them. One
pull runs at a time; another waits for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from strata.daemon.api.api_errors import ApiError, invalid, unsupported, wrong_type
from strata.daemon.api.openai_api import json_object
from strata.daemon.api.serving import Serving
from strata.daemon.engine_setup import models_dir
from strata.daemon.json_types import JSONObject

if TYPE_CHECKING:
    from strata.daemon.hf_pull import RemoteFile

log = logging.getLogger("strata.daemon.ollama_pull")  # the name its log lines always had

PATHS = ("/api/pull",)
NDJSON = "application/x-ndjson"
STEPS = 100  # progress events per file, at most (one a percent)
_END = object()

Event = JSONObject


class PullCancelled(Exception):
    """The client left: the download stops at its next chunk (its .part file stays)."""


def spec_of(raw: JSONObject) -> tuple[str, bool]:
    """The ``REPO[:QUANT]`` to pull and whether to stream; errors name the field."""
    model = raw.get("model", raw.get("name"))
    if model is None:
        raise invalid("model: missing required field", "model")
    if not isinstance(model, str):
        raise wrong_type("model", "a string", model)
    if raw.get("insecure") not in (None, False):
        raise unsupported("insecure", "pulls are over HTTPS only (HF_ENDPOINT names the hub)")
    stream = raw.get("stream", True)
    if not isinstance(stream, bool):
        raise wrong_type("stream", "a boolean", stream)
    return model, stream


class FileProgress:
    """Bytes landing across a plan's files, in order, as Ollama's per-file events."""

    def __init__(self, files: list[RemoteFile], emit: Callable[[Event], None],
                 stop: threading.Event) -> None:  # fmt: skip
        self.files = files
        self.emit = emit
        self.stop = stop
        self.done = 0
        self.shown = -1  # the step last shown of the current file
        self.index = 0

    def __call__(self, n: int, fresh: bool = True) -> None:
        if self.stop.is_set():
            raise PullCancelled("the client left; the download stopped (it resumes next time)")
        self.done += n
        start = sum(f.size for f in self.files[: self.index])
        while self.index < len(self.files) - 1 and self.done >= start + self.files[self.index].size:
            self._show(self.files[self.index].size)  # the file is whole
            start += self.files[self.index].size
            self.index, self.shown = self.index + 1, -1
        self._show(self.done - start)

    def _show(self, completed: int) -> None:
        f = self.files[self.index]
        step = completed * STEPS // f.size if f.size else STEPS
        if step == self.shown:
            return
        self.shown = step
        event: Event = {"status": f"pulling {Path(f.path).name}", "total": f.size,
                        "completed": min(completed, f.size)}  # fmt: skip
        if f.sha256:
            event["digest"] = f"sha256:{f.sha256}"
        self.emit(event)


def run_pull(spec: str, root: Path, emit: Callable[[Event], None], stop: threading.Event) -> None:
    """The whole pull (on a worker thread): plan, room check, download, manifest."""
    from strata.daemon import hf_pull  # huggingface_hub is imported only by a pull

    emit({"status": "pulling manifest"})
    plan = hf_pull.plan(spec, root)
    if not hf_pull.up_to_date(plan):
        hf_pull.check_space(plan)
        log.info("pulling %s %s into %s", plan.repo, plan.choice.label, plan.folder)
        hf_pull.fetch(plan, FileProgress(list(plan.choice.files), emit, stop))
    emit({"status": "success"})


def as_error(e: BaseException) -> BaseException:
    """A pull's failure as the error the client sees (others are mapped as any exception)."""
    from strata.daemon import hf_pull

    if isinstance(e, hf_pull.UsageError):
        return invalid(f"model: {e}", "model")
    if isinstance(e, hf_pull.PullError | PullCancelled):
        return ApiError(500, str(e), "server_error")
    return e


def add_routes(app: FastAPI, serving: Serving) -> None:
    lock = asyncio.Lock()

    async def events(spec: str, stop: threading.Event) -> AsyncIterator[Event]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def emit(event: Event) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        async with lock:
            root = models_dir(serving.config)
            job = loop.run_in_executor(None, run_pull, spec, root, emit, stop)
            job.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, _END))
            try:
                while (item := await queue.get()) is not _END:
                    yield item
                error = job.exception()
                if error is not None:
                    raise error
            finally:
                stop.set()  # a client that left stops the download
                if not job.done():
                    await asyncio.wait([job])
                if not job.cancelled() and job.exception() is not None:
                    log.info("pull of %s ended: %s", spec, job.exception())

    async def ndjson(spec: str) -> AsyncIterator[bytes]:
        try:
            async for event in events(spec, threading.Event()):
                yield (json.dumps(event) + "\n").encode()
        except Exception as e:  # the status line is sent: the error travels in the stream
            yield (json.dumps({"error": serving.error(as_error(e)).message}) + "\n").encode()

    @app.post("/api/pull")
    async def api_pull(request: Request) -> Response:
        spec, stream = spec_of(json_object(await request.body()))
        from strata.daemon import hf_pull

        try:  # a name that is no repository is a 400 before any stream starts
            hf_pull.parse_spec(spec)
        except hf_pull.UsageError as e:
            raise as_error(e) from None
        if stream:
            return StreamingResponse(ndjson(spec), media_type=NDJSON)
        last: Event = {}
        try:
            async for event in events(spec, threading.Event()):
                last = event
        except Exception as e:
            raise as_error(e) from None
        return JSONResponse(last)
