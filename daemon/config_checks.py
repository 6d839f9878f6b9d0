"""The small readings ``StrataConfig``'s checks share: a device name, a list option's items (a
TOML array or comma-separated text), a list as text, and whether a host stays on this machine."""

from __future__ import annotations

import ipaddress

from strata.daemon.json_types import JSON


def device_name(value: str) -> str | None:
    """A device name as ``device`` takes it, normalised; None: not one."""
    value = value.strip().lower()
    kind, _, index = value.partition(":")
    if value in ("auto", "cpu", "cuda") or (kind == "cuda" and index.isdigit()):
        return value
    return None


def as_list(value: JSON) -> list[JSON] | None:
    """A list option's value as given: a TOML array, or a comma-separated string (a flag, an
    environment variable). None: not a list (pydantic then says what it expected)."""
    if isinstance(value, str):
        return [] if not value.strip() else [item.strip() for item in value.split(",")]
    if isinstance(value, (list, tuple)):
        return list(value)
    return None


def list_text(values: list[JSON]) -> str:
    return ",".join(str(v) for v in values)


def loopback(host: str) -> bool:
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:  # a host name: only localhost is known to stay on this machine
        return False
