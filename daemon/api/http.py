"""The HTTP edge: parse, call one daemon method, map errors. No policy or state lives here.

Routes: ``/health``, ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``,
``/v1/vram``, ``/v1/vram/events``, ``/metrics``, and the page at ``/`` (docs/http.md); the
other APIs register theirs in one place (``anthropic_api``, ``responses_api``, ``ollama_api``,
``llama_extras``), on the same generation path (``serving``). Around them, outermost first:
request counting, the ``Host`` and ``Origin`` checks that keep web pages out, CORS (only when
``cors_allow_origins`` is set), the key (``Authorization: Bearer`` or ``x-api-key``, only when
``api_key`` is set; ``/health`` and the page's static files stay open), the cap on requests in
progress, the body-size limit. Every error is mapped once, in :func:`as_api_error`, and leaves
as a JSON body in the shape of the API its path speaks (``api_shapes``: OpenAI's, Anthropic's,
Ollama's).

What requests in progress hold is counted (:class:`HttpLoad`) and shown in ``/metrics`` with its
bound: at most ``max_requests_in_progress`` requests, each with a body of at most
``max_request_kib``, each streaming at most max_tokens pieces of text not yet sent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from strata import __version__
from strata.daemon import library
from strata.daemon.api import (
    anthropic_api,
    llama_extras,
    ollama_api,
    page,
    responses_api,
)
from strata.daemon.api.generation import Generation, Generations
from strata.daemon.api.http_guard import HttpLoad, add_error_handlers, add_middleware, as_api_error
from strata.daemon.api.metrics import CONTENT_TYPE, Metrics
from strata.daemon.api.openai_api import (
    SSE_DONE,
    ApiError,
    Parsed,
    error_body,
    invalid,
    parse_chat,
    parse_completion,
    sse,
)
from strata.daemon.api.openai_models import ModelNames
from strata.daemon.api.openai_reasoning import ReasoningDefaults
from strata.daemon.api.openai_stream import ReplyStream, reply_body
from strata.daemon.api.serving import Serving
from strata.daemon.bounded import Bounded
from strata.daemon.control.control import BadVramRequest, parse_vram_request
from strata.daemon.control.leases import (
    InvalidArgument,
    LeaseError,
    NoDevice,
    NotEnoughVram,
    Timeout,
)
from strata.daemon.engine_setup import models_dir
from strata.daemon.status_feed import event_stream

if TYPE_CHECKING:
    from strata.daemon.service import Daemon
    from strata.engine.generate import Engine

log = logging.getLogger("strata.daemon.http")  # the name its log lines always had

FINGERPRINT = f"strata-{__version__}"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

__all__ = ["as_api_error", "create_app", "error_body"]


def create_app(daemon: Daemon) -> FastAPI:
    """The HTTP edge: every API on one generation path (``Serving``), the VRAM routes, the
    metrics and the page."""
    config = daemon.config
    load = HttpLoad(config.max_requests_in_progress, config.max_request_kib * 1024)
    generations: Generations | None = None

    def sizes() -> list[Bounded]:
        engine = daemon.worker.engine
        n_ctx = engine.n_ctx if engine is not None else None
        buffered = generations.buffered() if generations is not None else 0
        limit = load.max_requests * (n_ctx + 1) if n_ctx is not None else None
        stream = Bounded("stream_pieces", "generated text pieces not yet sent to their clients",
                         buffered, limit)  # fmt: skip
        return [*daemon.sizes(), *load.sizes(), stream]

    metrics = Metrics(daemon, sizes)
    generations = Generations(
        daemon.worker, daemon.controls, config.max_queued_requests, metrics.generation
    )
    app = FastAPI(title="Strata", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)  # fmt: skip
    app.state.daemon = daemon
    app.state.generations = generations
    app.state.metrics = metrics
    add_error_handlers(app)
    add_middleware(app, config, metrics, load)
    # every API's requests take this one path (serving.py): name, prepare, queue
    serving = _serving(daemon, generations)
    _add_openai_routes(app, serving)
    _add_vram_routes(app, daemon, metrics)
    for path, file in page.load().items():
        app.add_api_route(path, _page_file(file), methods=["GET"], include_in_schema=False)
    # the other APIs, on the same generation path
    for api in (llama_extras, anthropic_api, ollama_api, responses_api):
        api.add_routes(app, serving)
    return app


def _serving(daemon: Daemon, generations: Generations) -> Serving:
    config = daemon.config

    def engine() -> Engine:
        """The loaded engine, or a 503 while loading or stopping."""
        if daemon.state == "ready" and daemon.worker.engine is not None:
            return daemon.worker.engine
        if daemon.state == "stopping":
            raise ApiError(503, "the daemon is stopping", "server_error", None, "stopping")
        raise ApiError(503, "the model is still loading; retry shortly", "server_error", None,
                       "model_loading", {"Retry-After": "1"})  # fmt: skip

    def created() -> int:
        try:
            return int(daemon.model_path.stat().st_mtime)  # type: ignore[union-attr]
        except (AttributeError, OSError):
            return int(daemon.started)

    def in_library(name: str) -> bool:
        try:
            return library.find(models_dir(config), name) is not None
        except (library.LibraryError, OSError):  # several quantisations, an unreadable folder
            return False

    def names() -> ModelNames:
        path = daemon.model_path
        return ModelNames.of(daemon.model_id, path.name if path else "", config.model_alias,
                             config.serve_any_model_name, in_library)  # fmt: skip

    reasoning = ReasoningDefaults(config.reasoning_format, config.enable_thinking)
    return Serving(daemon, config, engine, names, created, reasoning, generations,
                   FINGERPRINT, as_api_error)  # fmt: skip


def _add_openai_routes(app: FastAPI, serving: Serving) -> None:
    """Health, OpenAI's models, chat and completions."""
    daemon, config = serving.daemon, serving.config

    async def generate(request: Request, req: Parsed, received: float) -> Response:
        s = await serving.start(request, req, received)
        if req.stream:
            return StreamingResponse(
                _events(ReplyStream(s.reply, s.ready, s.engine.tokenizer), s.gen),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        r = await s.gen.result()
        return JSONResponse(reply_body(s.reply, r, s.ready, s.engine.tokenizer))

    @app.get("/health")
    async def health() -> JSONResponse:
        state = daemon.state
        body: dict[str, Any] = {"status": state}
        if state == "ready":
            body.update(model=daemon.model_id, device=daemon.device)
        return JSONResponse(body, status_code=200 if state == "ready" else 503)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        serving.engine()
        shelf = await asyncio.to_thread(library.listed, models_dir(config))
        return serving.names().listing(serving.created(), shelf)

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        serving.engine()
        return serving.names().entry(model, serving.created())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        received = time.monotonic()
        return await generate(
            request, parse_chat(await request.body(), config.max_stop_sequences), received
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        received = time.monotonic()
        return await generate(
            request, parse_completion(await request.body(), config.max_stop_sequences), received
        )


def _add_vram_routes(app: FastAPI, daemon: Daemon, metrics: Metrics) -> None:
    """``/v1/vram`` (the status, the run-time reserve), its events, and ``/metrics``."""

    @app.get("/v1/vram")
    async def get_vram() -> dict[str, Any]:
        return daemon.status()

    @app.post("/v1/vram")
    async def post_vram(request: Request) -> JSONResponse:
        try:
            reserve_mib, device = parse_vram_request(await request.body())
        except BadVramRequest as e:
            raise invalid(str(e), e.param) from None
        try:
            daemon.controller_for(device)
        except InvalidArgument as e:
            raise invalid(str(e), "device", "unknown_device") from None
        try:
            outcome = await daemon.reserve(reserve_mib, device)
        except Timeout as e:
            raise ApiError(504, str(e), "timeout", "reserve_mib", "timeout") from None
        except NotEnoughVram as e:
            raise invalid(str(e), "reserve_mib", "not_enough_vram") from None
        except NoDevice as e:
            raise ApiError(
                409, str(e), "invalid_request_error", "reserve_mib", "no_device"
            ) from None
        except LeaseError as e:
            raise invalid(str(e), "reserve_mib") from None
        # what was done, and how: "room" (free on the device), "shrink" (no monitor: the cache
        # shrank by the amount), "pending" (set and in force, the room not free yet: the
        # status's reserve_state says the same), "none" (a reserve of 0)
        done = {"how": outcome.how, "message": outcome.message}
        return JSONResponse({"result": done, **daemon.status()})

    @app.get("/v1/vram/events")
    async def vram_events() -> StreamingResponse:
        return StreamingResponse(
            event_stream(daemon.feed, time.time), media_type="text/event-stream",
            headers=SSE_HEADERS,
        )  # fmt: skip

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)


def _page_file(file: page.PageFile) -> Any:
    async def serve() -> Response:
        return Response(file.body, media_type=file.media_type, headers=page.HEADERS)

    return serve


async def _events(stream: ReplyStream, gen: Generation) -> AsyncIterator[bytes]:
    """The SSE stream: the role chunk (chat), the text's chunks, the closing chunk, usage,
    [DONE]. An error after the headers went out is an error event, as OpenAI sends it."""
    try:
        for chunk in stream.start():
            yield sse(chunk)
        async for piece in gen.pieces():
            for chunk in stream.piece(piece):
                yield sse(chunk)
        r = gen.final()
    except Exception as e:  # the status line is sent: the error travels in the stream
        yield sse(as_api_error(e).body())
        yield SSE_DONE
        return
    finally:
        gen.close()  # a client that left mid-stream cancels the generation here
    for chunk in stream.end(r):
        yield sse(chunk)
    yield SSE_DONE
