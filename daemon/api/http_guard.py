"""The HTTP edge's guards and its one error mapping: what requests in progress hold
(:class:`HttpLoad`), every exception as the error a client sees in its API's shape, and the
middleware — the ``Host`` and ``Origin`` check, the API key, the limits on requests in progress
and on bodies, the request counts for ``/metrics``.
"""

from __future__ import annotations

import hmac
import logging
import socket
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from strata.daemon.api import (
    anthropic_api,
    llama_extras,
    ollama_api,
    page,
    responses_api,
)
from strata.daemon.api.api_shapes import api_of, error_json
from strata.daemon.api.generation import NotServing, QueueFull
from strata.daemon.api.metrics import Metrics
from strata.daemon.api.openai_api import (
    ApiError,
    invalid,
    retry_after_s,
)
from strata.daemon.bounded import Bounded
from strata.engine.errors import ContextOverflow, EngineError

if TYPE_CHECKING:
    from strata.daemon.config import StrataConfig

log = logging.getLogger("strata.daemon.http")  # the name the HTTP edge's log lines always had

OPEN_PATHS = frozenset({"/health", *page.PATHS})  # the page holds no secret; its calls need the key
ENDPOINTS = frozenset({"/health", "/metrics", "/v1/models", "/v1/chat/completions",
                       "/v1/completions", "/v1/vram", "/v1/vram/events", *page.PATHS,
                       *llama_extras.PATHS, *anthropic_api.PATHS, *ollama_api.PATHS,
                       *responses_api.PATHS})  # fmt: skip
CLIENT_GONE = 499  # nginx's status for a request its client abandoned (never sent: it is gone)


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


def add_error_handlers(app: FastAPI) -> None:
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


def add_middleware(app: FastAPI, config: StrataConfig, metrics: Metrics, load: HttpLoad) -> None:
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
