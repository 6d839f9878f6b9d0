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
import hmac
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from strata import __version__
from strata.daemon import (
    anthropic_api,
    library,
    llama_extras,
    ollama_api,
    page,
    responses_api,
)
from strata.daemon.api_shapes import api_of, error_json
from strata.daemon.bounded import Bounded
from strata.daemon.control import BadVramRequest, parse_vram_request
from strata.daemon.engine_setup import models_dir
from strata.daemon.generation import Generation, Generations, NotServing, QueueFull
from strata.daemon.leases import InvalidArgument, LeaseError, NoDevice, NotEnoughVram, Timeout
from strata.daemon.metrics import CONTENT_TYPE, Metrics
from strata.daemon.openai_api import (
    SSE_DONE,
    ApiError,
    Parsed,
    error_body,
    invalid,
    parse_chat,
    parse_completion,
    retry_after_s,
    sse,
)
from strata.daemon.openai_models import ModelNames
from strata.daemon.openai_reasoning import ReasoningDefaults
from strata.daemon.openai_stream import ReplyStream, reply_body
from strata.daemon.serving import Serving
from strata.daemon.status_feed import event_stream
from strata.engine.errors import ContextOverflow, EngineError

if TYPE_CHECKING:
    from strata.daemon.config import StrataConfig
    from strata.daemon.service import Daemon
    from strata.engine.generate import Engine

log = logging.getLogger(__name__)

FINGERPRINT = f"strata-{__version__}"
OPEN_PATHS = frozenset({"/health", *page.PATHS})  # the page holds no secret; its calls need the key
ENDPOINTS = frozenset({"/health", "/metrics", "/v1/models", "/v1/chat/completions",
                       "/v1/completions", "/v1/vram", "/v1/vram/events", *page.PATHS,
                       *llama_extras.PATHS, *anthropic_api.PATHS, *ollama_api.PATHS,
                       *responses_api.PATHS})  # fmt: skip
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_GONE = 499  # nginx's status for a request its client abandoned (never sent: it is gone)

__all__ = ["as_api_error", "create_app", "error_body"]


class HttpLoad:
    """What the requests in progress hold, counted by the middleware (on the loop)."""

    def __init__(self, max_requests: int, max_body_bytes: int) -> None:
        self.max_requests = max_requests
        self.max_body_bytes = max_body_bytes  # per request
        self.requests = 0
        self.body_bytes = 0  # of the bodies received by requests still in progress

    def sizes(self) -> list[Bounded]:
        return [
            Bounded("http_requests_in_progress", "HTTP requests being served (not /health, "
                    "/metrics)", self.requests, self.max_requests),
            Bounded("http_body_bytes", "request bodies held by the requests in progress",
                    self.body_bytes, self.max_requests * self.max_body_bytes, "bytes"),
        ]  # fmt: skip


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
    _add_error_handlers(app)
    _add_middleware(app, config, metrics, load)
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
        device = 0 if device is None else device  # no device named: the first
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


# -- errors -------------------------------------------------------------------------------------


def as_api_error(exc: BaseException) -> ApiError:
    """Every exception that leaves a handler, as the API error the client sees."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, QueueFull):
        return ApiError(
            429,
            f"{exc}; retry later",
            "requests",
            None,
            "rate_limit_exceeded",
            {"Retry-After": str(retry_after_s(exc.mean_generation_s))},
        )
    if isinstance(exc, NotServing):
        return ApiError(503, str(exc), "server_error", None, "stopping")
    if isinstance(exc, StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return ApiError(exc.status_code, str(exc.detail), "invalid_request_error", None, code)
    if isinstance(exc, RequestValidationError):
        return invalid(str(exc.errors()[0].get("msg")) if exc.errors() else "invalid request")
    if isinstance(exc, ContextOverflow):  # the budget shrank after the request was checked
        return invalid(str(exc), None, "context_length_exceeded")
    if isinstance(exc, EngineError):
        log.error("generation failed: %s", exc)
        return ApiError(500, f"the engine failed: {exc}", "server_error")
    if isinstance(exc, ClientDisconnect):  # nobody reads this reply: counted, not an error
        log.debug("a client left while sending its request")
        return ApiError(CLIENT_GONE, "the client closed the connection", "invalid_request_error",
                        None, "client_closed_request")  # fmt: skip
    log.error("unexpected error: %r", exc, exc_info=exc)
    return ApiError(500, "internal error (see the daemon's log)", "server_error")


def _error_response(exc: BaseException, path: str = "") -> JSONResponse:
    """The error in the shape of the API ``path`` speaks (api_shapes)."""
    err = as_api_error(exc)
    body = error_json(err, api_of(path))
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def _add_error_handlers(app: FastAPI) -> None:
    async def handle(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, StarletteHTTPException) and exc.status_code in (404, 405):
            where = _cut(f"{request.method} {request.url.path}")
            what = "no such endpoint" if exc.status_code == 404 else "method not allowed"
            exc = StarletteHTTPException(exc.status_code, f"{what}: {where}")
        return _error_response(exc, request.url.path)

    for kind in (ApiError, QueueFull, NotServing, StarletteHTTPException,
                 RequestValidationError, EngineError, ClientDisconnect, Exception):  # fmt: skip
        app.add_exception_handler(kind, handle)


# -- middleware ---------------------------------------------------------------------------------


def _add_middleware(app: FastAPI, config: StrataConfig, metrics: Metrics, load: HttpLoad) -> None:
    # add_middleware puts each new one outside the ones before it
    app.add_middleware(LimitBody, max_bytes=config.max_request_kib * 1024, load=load)
    app.add_middleware(LimitInProgress, load=load)
    if config.api_key:
        app.add_middleware(RequireKey, key=config.api_key)
    origins = [o.strip() for o in (config.cors_allow_origins or "").split(",") if o.strip()]
    if origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            max_age=600,
        )
    app.add_middleware(GuardHostAndOrigin, hosts=allowed_hosts(config), origins=origins)
    app.add_middleware(CountRequests, metrics=metrics)


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
WILDCARDS = ("0.0.0.0", "::", "")


def allowed_hosts(config: StrataConfig) -> frozenset[str]:
    """The names a request's ``Host`` may give (lower case, no port): the loopback names, the
    configured ``host``, ``allowed_hosts``, and for a wildcard bind the machine's own names and
    addresses."""
    names = {*LOOPBACK_NAMES, config.host.strip().strip("[]").lower()}
    names |= {h.strip().lower() for h in (config.allowed_hosts or "").split(",") if h.strip()}
    if config.host.strip().strip("[]") in WILDCARDS:
        names |= _machine_names()
    return frozenset(names - {""})


def _machine_names() -> set[str]:
    names = {socket.gethostname().lower(), socket.getfqdn().lower()}
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None):
            names.add(str(info[4][0]).lower())
    except OSError:  # a host name that does not resolve: the names alone
        pass
    return names


def host_name(value: str) -> str:
    """A Host or origin authority without port, brackets and case: ``[::1]:8427`` -> ``::1``."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class GuardHostAndOrigin:
    """What keeps web pages out. A browser names the page's origin in ``Origin`` on every
    cross-origin POST (``no-cors`` and form posts included, which need no preflight), so a
    request with an ``Origin`` that is neither the daemon's own (http on an allowed host and
    the port it serves) nor in ``cors_allow_origins`` gets 403. A ``Host`` that names another
    machine (a page that rebinds its own name to 127.0.0.1) gets 400. Requests without an
    ``Origin`` — curl, the ``openai`` client, scripts — are not affected by the first check."""

    def __init__(self, app: ASGIApp, hosts: frozenset[str], origins: list[str]) -> None:
        self.app = app
        self.hosts = hosts
        self.origins = frozenset(o.rstrip("/").lower() for o in origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        err = self._check(scope)
        if err is not None:
            await _error_response(err, scope["path"])(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> ApiError | None:
        host = _header(scope, b"host")
        name = host_name(host.decode("latin-1")) if host is not None else None
        if name is not None and name not in self.hosts:
            shown = _shown(host.decode("latin-1")) if host is not None else ""
            return ApiError(400, f"Host {shown} is not a name of this server (allowed_hosts)",
                            "invalid_request_error", None, "host_not_allowed")  # fmt: skip
        origin = _header(scope, b"origin")
        if origin is None:
            return None
        value = origin.decode("latin-1").strip().rstrip("/").lower()
        if value in self.origins or self._own(value, scope):
            return None
        return ApiError(403, f"cross-origin request from {_shown(value)} refused (an origin must "
                        "be listed in cors_allow_origins)", "invalid_request_error", None,
                        "origin_not_allowed")  # fmt: skip

    def _own(self, origin: str, scope: Scope) -> bool:
        scheme, sep, authority = origin.partition("://")
        server = scope.get("server")
        if scheme != "http" or not sep or server is None:
            return False
        port = authority.rsplit(":", 1)[1] if authority.count(":") == 1 or "]:" in authority else ""
        return host_name(authority) in self.hosts and port == str(server[1])


def _cut(value: str, limit: int = 120) -> str:
    """A client's text in an error message, cut: no reply echoes a large input back."""
    return value if len(value) <= limit else f"{value[:limit]}… ({len(value)} characters)"


def _shown(value: str, limit: int = 80) -> str:
    """A client's value in an error message: quoted, and cut so no reply echoes a large input."""
    return repr(value if len(value) <= limit else value[:limit] + "…")


class CountRequests:
    """``strata_http_requests_total{endpoint, status}``, counted as each response starts."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = _endpoint(scope["path"])
        counted = False

        async def counting_send(message: Message) -> None:
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:
                counted = True
                self.metrics.request(endpoint, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            if not counted:
                self.metrics.request(endpoint, 500)


def _endpoint(path: str) -> str:
    if path in ENDPOINTS:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


class RequireKey:
    """``Authorization: Bearer <api_key>`` (or Anthropic's ``x-api-key: <api_key>``) on every
    path but ``/health``."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"authorization")
        scheme, _, token = (given or b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            await self.app(scope, receive, send)
            return
        other = _header(scope, b"x-api-key")
        if other is not None and hmac.compare_digest(other.strip(), self.key):
            await self.app(scope, receive, send)
            return
        given = given or other
        message = "invalid API key" if given else "missing API key (Authorization: Bearer KEY)"
        err = ApiError(401, message, "invalid_request_error", None, "invalid_api_key",
                       {"WWW-Authenticate": "Bearer"})  # fmt: skip
        await _error_response(err, scope["path"])(scope, receive, send)


UNCAPPED_PATHS = frozenset({"/health", "/metrics"})  # monitoring answers under any load


class LimitInProgress:
    """At most ``load.max_requests`` requests served at once: one more is a 503 with
    ``Retry-After`` at once, before its body is read. With the body limit, this bounds the
    request bodies (and the streams' unsent text) held in memory."""

    def __init__(self, app: ASGIApp, load: HttpLoad) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNCAPPED_PATHS:
            await self.app(scope, receive, send)
            return
        if self.load.requests >= self.load.max_requests:
            err = ApiError(503, f"{self.load.requests} requests are in progress, the most this "
                           "server takes at once (max_requests_in_progress); retry shortly",
                           "server_error", None, "too_many_requests_in_progress",
                           {"Retry-After": "1"})  # fmt: skip
            await _error_response(err, scope["path"])(scope, receive, send)
            return
        self.load.requests += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.requests -= 1


class LimitBody:
    """Request bodies of at most ``max_bytes``: a 413 by ``Content-Length`` before reading, or
    as soon as a chunked body passes the limit. The bytes received are counted in ``load``
    until the request ends (the body is held that long)."""

    def __init__(self, app: ASGIApp, max_bytes: int, load: HttpLoad | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.load = load

    def _too_large(self, size: str) -> ApiError:
        return ApiError(
            413,
            f"the request body of {size} bytes is larger than the limit of {self.max_bytes} bytes "
            f"(max_request_kib)",
            "invalid_request_error",
            None,
            "request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            too_large = _error_response(self._too_large(length.decode()), scope["path"])
            await too_large(scope, receive, send)
            return
        seen = 0
        load = self.load

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                got = len(message.get("body", b""))
                seen += got
                if load is not None:
                    load.body_bytes += got
                if seen > self.max_bytes:
                    raise self._too_large(f"more than {seen}")
            return message

        try:
            await self.app(scope, limited_receive, send)
        finally:
            if load is not None:
                load.body_bytes -= seen


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None
