"""The control plane's decisions in words: one line for the log and the status's explanation
(what room is kept and why, what other programs use, what the decision does), and the unwatched
decision's reasoning."""

from __future__ import annotations

from strata.daemon.control.leases import BookView
from strata.daemon.control.policy_types import (
    ELASTIC_RESERVE,
    Budget,
    CacheView,
    DeviceView,
    PolicyConfig,
    PolicyState,
)


def unwatched_text(
    book: BookView, start: int, demand: int, core: int, idle_s: float | None, size: int, target: int
) -> str:
    """``decide_unwatched``'s reasoning in words (``idle_s``: None while a request runs)."""
    text = (
        f"no monitor sees the device: the cache is {start} MiB less what is asked "
        f"({demand} MiB: reserve {book.reserve_mib}, holds {sum(book.holds.values())}, leases "
        f"{book.borrowed_mib}), at most {start - core} MiB below that"
    )
    if idle_s is not None:
        text += f"; idle for {idle_s:g} s: down to the core"
    if target != size:
        text += f"; {'shrink' if target < size else 'grow'} {size} -> {target} MiB"
    else:
        text += f"; no change at {size} MiB"
    return text


def _action_text(
    now_ms: float,
    cache: CacheView,
    cfg: PolicyConfig,
    b: Budget,
    target: int,
    reason: str,
    state: PolicyState,
) -> str:
    """What the decision does, and why, in words."""
    size = cache.size_mib
    if reason == "idle":
        since = now_ms - (state.room_since_ms if state.room_since_ms is not None else now_ms)
        return (
            f"no request for {cfg.idle_release_ms / 1000:g} s or more: "
            + (f"shrink {size} -> {target} MiB, the core" if target < size else "held at the core")
            + (
                f" (room for {b.goal_mib - cache.core_mib} MiB more for {since / 1000:g} s)"
                if b.goal_mib > cache.core_mib
                else ""
            )
        )
    elif target < size:
        how = {
            "tenant": f"one step of at most {cfg.elastic_shrink_step_mib} MiB: other programs grew",
            "lease": "all at once: a new lease",
            "reserve": "all at once: the reserve was raised",
            "vram_max": f"all at once: vram_max_mib is {cfg.vram_max_mib}",
            "max": f"all at once: the cache's largest size is {cache.max_mib}",
        }.get(reason, f"all at once: the {reason} hold")
        return f"shrink {size} -> {target} MiB ({how})"
    elif target > size and reason == "room":
        return f"grow {size} -> {target} MiB (the room lasted {state.stable_ms / 1000:g} s)"
    elif target > size:
        return f"grow {size} -> {target} MiB (back to the core at once)"
    elif reason == "waiting":
        waited = now_ms - (state.room_since_ms if state.room_since_ms is not None else now_ms)
        return (
            f"room for {b.goal_mib - size} MiB more; grow once it has lasted "
            f"{state.stable_ms / 1000:g} s ({waited / 1000:g} s so far)"
        )
    else:
        return f"no change at {size} MiB"


def explain(
    now_ms: float,
    device: DeviceView,
    cache: CacheView,
    cfg: PolicyConfig,
    book: BookView,
    b: Budget,
    target: int,
    reason: str,
    state: PolicyState,
) -> str:
    """One line for the log and the status: the room and why, the tenants, the action."""
    base_name = {ELASTIC_RESERVE: "automatic", "reserve": "reserve"}.get(
        b.base_source, f"hold {b.base_source}"
    )
    parts = [f"{base_name} {b.base_mib}"]
    parts += [
        f"lease {lease.cookie}: {b.owed_mib[lease.cookie]} of {lease.mib} not yet allocated"
        for lease in book.leases
    ]
    if b.ahead_mib:
        parts.append(f"ahead {b.ahead_mib}: other programs are growing")
    text = [f"keep {b.room_mib} MiB free ({'; '.join(parts)})"]
    text.append(f"other programs use {b.tenants_mib} MiB")

    text.append(_action_text(now_ms, cache, cfg, b, target, reason, state))

    free_at_core = device.usable_mib - b.tenants_mib - cache.fixed_mib - cache.core_mib
    if b.room_mib > free_at_core:
        what = f"the room to keep ({b.room_mib} MiB)"
        if b.base_mib > free_at_core and b.base_source != ELASTIC_RESERVE:
            what = f"the {base_name} of {b.base_mib} MiB"
        text.append(
            f"{what} cannot be met: even at its core ({cache.core_mib} MiB) the cache "
            f"leaves {max(0, free_at_core)} MiB free of {device.total_mib} MiB"
        )
    if b.cap_reason == "vram_max" and b.cap_mib < cache.core_mib:
        text.append(
            f"vram_max_mib {cfg.vram_max_mib} is below the core plus the engine's memory "
            f"({cache.core_mib} + {cache.fixed_mib} MiB): the cache stays at its core"
        )
    if state.stable_ms != cfg.elastic_stable_ms:
        text.append(f"stable time {state.stable_ms / 1000:g} s after an oscillation")
    return "; ".join(text)
