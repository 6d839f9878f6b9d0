"""The HTTP edge: parse, call one daemon method, map errors. No policy or state lives here."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from strata import __version__
from strata.daemon.leases import LeaseError, NotEnoughVram, Timeout


class VramRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reserve_mib: StrictInt = Field(ge=0)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def create_app(daemon: Any) -> FastAPI:
    app = FastAPI(title="Strata", version=__version__, docs_url=None, redoc_url=None)
    app.state.daemon = daemon

    @app.get("/health")
    async def health() -> JSONResponse:
        state = daemon.state
        body: dict[str, Any] = {"status": state}
        if state == "ready":
            body.update(model=daemon.model_id, device=daemon.device)
        return JSONResponse(body, status_code=200 if state == "ready" else 503)

    @app.get("/v1/vram")
    async def get_vram() -> dict[str, Any]:
        return daemon.status()

    @app.post("/v1/vram")
    async def post_vram(request: Request) -> JSONResponse:
        try:
            body = VramRequest.model_validate_json(await request.body())
        except ValueError as e:
            return JSONResponse(
                error_body(f"invalid body: {_first_error(e)}", "invalid_request_error",
                           "reserve_mib"),
                status_code=400,
            )  # fmt: skip
        try:
            await daemon.reserve(body.reserve_mib)
        except Timeout as e:
            return JSONResponse(error_body(str(e), "timeout", "reserve_mib", "timeout"), 504)
        except NotEnoughVram as e:
            return JSONResponse(
                error_body(str(e), "invalid_request_error", "reserve_mib", "not_enough_vram"), 400
            )
        except LeaseError as e:
            return JSONResponse(error_body(str(e), "invalid_request_error", "reserve_mib"), 400)
        return JSONResponse(daemon.status())

    return app


def _first_error(e: ValueError) -> str:
    errors = getattr(e, "errors", None)
    if callable(errors):
        first = errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        return f"{where}: {first.get('msg')}"
    return str(e)
