"""The body of ``POST /v1/vram``: ``{"reserve_mib": N[, "device": D]}``, read into numbers or
refused with what is wrong in words (never a JSON parser's own text)."""

from __future__ import annotations

import json

from strata.daemon.control.leases import InvalidArgument, is_int


class BadVramRequest(InvalidArgument):
    """A ``POST /v1/vram`` body that is not ``{"reserve_mib": N[, "device": D]}``; ``param``
    names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def parse_vram_request(raw: bytes) -> tuple[int, int | None]:
    """``(reserve_mib, device)`` from a ``POST /v1/vram`` body, or :class:`BadVramRequest`
    saying what is wrong in words (never a parser's own text)."""
    example = '{"reserve_mib": 4000}'
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise BadVramRequest(f"the body is not JSON: expected {example}", "reserve_mib") from None
    except RecursionError:
        raise BadVramRequest(
            f"the body is not JSON this daemon reads: nested too deeply; expected {example}",
            "reserve_mib",
        ) from None
    if not isinstance(body, dict):
        raise BadVramRequest(
            f"expected a JSON object such as {example}, got {type(body).__name__}", "reserve_mib"
        )
    for key in body:
        if key not in ("reserve_mib", "device"):
            raise BadVramRequest(
                f"unknown field {key!r}: the body takes reserve_mib and device", str(key)
            )
    if "reserve_mib" not in body:
        raise BadVramRequest(
            "reserve_mib is missing: the MiB to keep free (0 clears the reserve)", "reserve_mib"
        )
    mib = body["reserve_mib"]
    if not is_int(mib) or mib < 0:  # too large: the book's limit names it
        raise BadVramRequest(
            "reserve_mib: expected a whole number of MiB, 0 or more (0 clears the reserve), "
            f"got {json.dumps(mib)}",
            "reserve_mib",
        )
    device = body.get("device")
    if device is not None and not is_int(device):  # a number the daemon lacks: named there
        raise BadVramRequest(
            f"device: expected a device number (0, 1, …), got {json.dumps(device)}", "device"
        )
    return mib, device
