"""Which API a path speaks, and an error in that API's shape.

Every error leaves the HTTP edge as one :class:`ApiError` (``http.as_api_error`` maps it once);
this module only writes its body the way the client of that path reads errors: Anthropic's
``{"type": "error", "error": {"type", "message"}}`` under ``/v1/messages``, Ollama's
``{"error": "message"}`` under ``/api/``, OpenAI's everywhere else (the Responses API and
llama-server's extras included: llama-server answers errors in OpenAI's shape too).
"""

from __future__ import annotations

from typing import Literal

from strata.daemon.api.api_errors import ApiError
from strata.daemon.json_types import JSONObject

Api = Literal["openai", "anthropic", "ollama"]

ANTHROPIC_PREFIX = "/v1/messages"
OLLAMA_PREFIX = "/api/"

# Anthropic's error types by status (its documented list); other statuses keep their class
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def api_of(path: str) -> Api:
    if path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/"):
        return "anthropic"
    if path.startswith(OLLAMA_PREFIX):
        return "ollama"
    return "openai"


def error_json(err: ApiError, api: Api) -> JSONObject:
    if api == "anthropic":
        kind = _ANTHROPIC_TYPES.get(err.status)
        if kind is None:
            kind = "invalid_request_error" if 400 <= err.status < 500 else "api_error"
        return {"type": "error", "error": {"type": kind, "message": err.message}}
    if api == "ollama":
        return {"error": err.message}
    return err.body()
