"""The OpenAI error shape and the constructors of the errors a request can cause, each naming
the field (``param``) at fault. Shared by the request parsers (``openai_api``, ``openai_tools``)
and the HTTP edge, which maps every exception to one of these once."""

from __future__ import annotations

from strata.daemon.json_types import JSON, JSONObject

__all__ = ["ApiError", "error_body", "invalid", "json_type", "unsupported", "wrong_type"]


class ApiError(Exception):
    """An error the client caused or must know about; ``body()`` is the OpenAI error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> JSONObject:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def unsupported(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param}: {why}", "invalid_request_error", param, "unsupported_parameter")


def wrong_type(param: str, expected: str, value: JSON) -> ApiError:
    return invalid(f"{param}: expected {expected}, got {json_type(value)}", param, "invalid_type")


def json_type(v: JSON) -> str:
    if v is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(v), type(v).__name__)  # fmt: skip
