"""``strata-ctl``'s words: the status as a table, the leases as columns, how a request was
carried out, and which part of the status speaks of a device. Plain functions of the status
schema as it arrives over D-Bus (unknown values left out)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from strata.daemon.json_types import JSON, JSONObject


def _all_leases(status: dict[str, Any]) -> list[dict[str, Any]]:
    """Every device's leases, in cookie order (the top-level list is device 0's)."""
    devices = status.get("devices")
    if not devices:  # a daemon from before devices existed
        return status.get("leases", [])
    leases = [lease for d in devices for lease in d.get("leases", [])]
    return sorted(leases, key=lambda lease: lease.get("cookie", 0))


def _device_status(status: dict[str, Any], device: int | None) -> dict[str, Any]:
    """``device``'s entry in the status's device list (None: no device named, the first); {}
    for one the daemon does not have (the request then fails, naming the devices it has)."""
    devices = status.get("devices") or []
    number = 0 if device is None else device
    return devices[number] if 0 <= number < len(devices) else {}


def carried_out(status: JSONObject, before: JSON, mib: int) -> str:
    """How a request was carried out, from the status after it (``vram_requests``)."""
    after = status.get("cache_mib")
    cache = f"cache {before} -> {after} MiB" if before != after else f"cache {_size(after)}"
    if mib == 0:
        return f"cleared ({cache}; it grows back as room lasts)"
    if status.get("vram_requests") == "shrink":
        monitor = status.get("monitor", {})
        why = (
            "vram_monitor is none"
            if monitor.get("kind") == "none"
            else f"the VRAM monitor failed: {monitor.get('problem')}"
        )
        return (
            f"no monitor sees the device ({why}), so Strata shrank its cache by what is asked "
            f"({cache}); whether that memory is free on the GPU is not checked"
        )
    return f"{_size(status.get('free_mib'))} free on {status.get('device', 'the device')} ({cache})"


def _size(mib: Any) -> str:
    return f"{mib} MiB" if mib is not None else "unknown"


_REQUESTS = {
    "room": "carried out once the room is free on the device",
    "shrink": "no monitor sees the device: a request shrinks the cache by its amount",
    "refused": "refused: Strata watches no GPU and holds no VRAM",
}


def format_status(s: JSONObject) -> str:
    """The status as a table people read; an absent (unknown) value says "unknown"."""
    monitor = s.get("monitor", {})
    health = "" if monitor.get("healthy", True) else f" (failing: {monitor.get('problem')})"
    free = _size(s.get("free_mib"))
    if s.get("total_mib") is not None:
        free += f" of {s['total_mib']} MiB"
    if s.get("tenants_mib") is not None:
        free += f" (other programs {s['tenants_mib']} MiB, Strata {_size(s.get('ours_mib'))})"
    holds = s.get("holds", {})
    reserve = (
        f"{_size(s.get('reserve_mib'))} run-time, {_size(s.get('elastic_reserve_mib'))} automatic"
    )
    reserve += "".join(f", {_size(mib)} {name}" for name, mib in sorted(holds.items()))
    if s.get("room_kept_mib") is not None:
        reserve += f"; room kept free {s['room_kept_mib']} MiB"
    if s.get("reserve_state") == "pending":
        reserve += f"; the run-time reserve is not met yet: {s.get('reserve_message')}"
    leases = _all_leases(s)
    rows = [
        ("state", s.get("state", "unknown")),
        ("model", s.get("model") or "unknown"),
        ("device", f"{s.get('device', 'unknown')} (monitor {monitor.get('kind', '?')}){health}"),
        ("compute", s.get("compute_device", "unknown")),
        (
            "cache",
            f"{_size(s.get('cache_mib'))} = core {_size(s.get('core_mib'))} + tail "
            f"{_size(s.get('tail_mib'))} (at most {_size(s.get('max_cache_mib'))}; "
            f"{s.get('cache_experts', '?')} of {s.get('total_experts', '?')} experts)",
        ),
        ("K/V", _kv_line(s)),
        ("free VRAM", free),
        ("reserve", reserve),
        ("borrowed", f"{_size(s.get('borrowed_mib'))} in {len(s.get('leases', []))} lease(s)"),
        ("requests", _REQUESTS.get(s.get("vram_requests", ""), "unknown")),
    ]
    devices = s.get("devices") or []
    if len(devices) > 1:  # a split: the rows above are device 0's, each device's below
        rows += [(f"device {d.get('index', i)}", _device_line(d)) for i, d in enumerate(devices)]
    width = max(len(k) for k, _ in rows)
    text = "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
    if leases:
        text += "\n\n" + format_leases(leases, split=len(devices) > 1)
    return text


def _kv_line(s: dict[str, Any]) -> str:
    """The K/V's share: mapped, the active conversation, the kept ones, and the budget."""
    kept = s.get("kv_kept") or []
    text = (
        f"{_size(s.get('kv_mib'))} (active {s.get('kv_active_tokens', '?')} tokens in "
        f"{_size(s.get('kv_active_mib'))}; {len(kept)} kept conversation(s) "
        f"[{', '.join(str(k.get('tokens', '?')) for k in kept)}] tokens, "
        f"{_size(s.get('kv_kept_mib'))} of their own)"
    )
    if s.get("budget_mib") is not None:
        text += (
            f"; budget {s['budget_mib']} MiB for cache + K/V, "
            f"a prompt of up to {s.get('kv_fits_tokens', '?')} tokens fits"
        )
    return text


def _device_line(d: dict[str, Any]) -> str:
    """One device of a split: its stage, cache, free memory, reserve and leases."""
    monitor = d.get("monitor", {})
    health = "" if monitor.get("healthy", True) else f", monitor failing: {monitor.get('problem')}"
    layers = ""
    if d.get("layers") is not None:
        first = d.get("first_layer", 0)
        layers = f", layers {first}-{first + d['layers'] - 1}"
    free = _size(d.get("free_mib"))
    if d.get("total_mib") is not None:
        free += f" of {d['total_mib']} MiB"
    return (
        f"{d.get('compute_device', '?')} ({d.get('device', '?')}, monitor "
        f"{monitor.get('kind', '?')}{health}){layers}: cache {_size(d.get('cache_mib'))} "
        f"(core {_size(d.get('core_mib'))}), free {free}, reserve {_size(d.get('reserve_mib'))}, "
        f"borrowed {_size(d.get('borrowed_mib'))} in {len(d.get('leases', []))} lease(s)"
    )


def format_leases(leases: list[JSONObject], split: bool = False) -> str:
    """The leases as a table; ``split`` (several devices) adds each lease's device."""
    header = ("COOKIE", "MIB", "APP ID", "REASON", "PID", "SINCE", "OWNER")
    rows = [header] + [
        (
            str(lease.get("cookie", "?")),
            str(lease.get("mib", "?")),
            lease.get("app_id") or "-",
            lease.get("reason") or "-",
            str(lease.get("pid") or "-"),
            _since(lease.get("since_us")),
            lease.get("owner") or "-",
        )
        for lease in leases
    ]
    if split:
        devices = ["DEVICE"] + [str(lease.get("device", 0)) for lease in leases]
        rows = [(row[0], device, *row[1:]) for row, device in zip(rows, devices, strict=True)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _since(us: Any) -> str:
    if not isinstance(us, int):
        return "-"
    return datetime.fromtimestamp(us / 1e6).strftime("%Y-%m-%d %H:%M:%S")
