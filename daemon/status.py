"""The status: :class:`Status` (the daemon, the model, the requests, and device 0's numbers at
the top level, as tools written for one GPU read them) with one :class:`DeviceStatus` per device,
defined with each field's meaning in ``status_schema`` (docs/status.md's tables are generated from
it). ``GET /v1/vram``, D-Bus ``GetStatus`` and its properties, the page, ``/metrics`` and
``strata-ctl`` all read this one type; ``to_json()`` is the schema, keys in field order.

``build_status`` makes it from the engine's :class:`~strata.engine.status.EngineStatus` and each
device's control plane: every device's numbers are worked out once, in ``device_status``, and the
top level takes device 0's from there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from strata.daemon.status_schema import (
    BusStatus,
    DeviceStatus,
    JsonValue,
    KeptConversation,
    LeaseStatus,
    MonitorStatus,
    Status,
    StatusJson,
)
from strata.engine.status import CacheStatus, EngineStatus, StageStatus, drive_read_bytes

if TYPE_CHECKING:
    from strata.daemon.control.control import VramController

MiB = 2**20


@dataclass(frozen=True)
class DaemonFacts:
    """What the status says of the daemon itself, besides the devices and the engine."""

    state: str
    model: str
    model_path: str | None
    listen: str
    dbus: BusStatus
    elastic_reserve_mib: int
    busy: bool
    queued: int
    generated_tokens: int


def _up(nbytes: int) -> int:
    return -(-nbytes // MiB)


def lease_status(controller: VramController) -> list[LeaseStatus]:
    return [
        LeaseStatus(
            lease.cookie,
            lease.app_id,
            lease.reason,
            lease.mib,
            lease.since_us,
            lease.owner,
            lease.pid,
            controller.stage,
        )
        for lease in controller.book.leases()
    ]


def device_status(
    number: int, compute_device: str, c: VramController, stage: StageStatus | None
) -> DeviceStatus:
    """Device ``number``'s part of the status (``stage``: None until the model is loaded)."""
    cache = stage.cache if stage is not None else None
    kv = stage.kv if stage is not None else None
    sample, decision = c.last_sample, c.last_decision
    reserve_state, reserve_message = c.reserve_state()
    budget = kv.budget_bytes if kv is not None else None
    return DeviceStatus(
        index=number,
        compute_device=compute_device,
        device=c.monitor.device_name,
        monitor=MonitorStatus(c.monitor.kind, c.monitor.healthy, c.monitor.problem),
        vram_requests=c.requests,
        first_layer=stage.first_layer if stage is not None else None,
        layers=stage.layers if stage is not None else None,
        cache_mib=cache.mapped_bytes // MiB if cache else 0,
        core_mib=cache.core_bytes // MiB if cache else 0,
        tail_mib=(cache.size_bytes - cache.core_bytes) // MiB if cache else 0,
        max_cache_mib=cache.max_bytes // MiB if cache else 0,
        cache_experts=cache.experts if cache else 0,
        kv_mib=_up(kv.mapped_bytes) if kv is not None else 0,
        budget_mib=budget // MiB if budget is not None else None,
        total_mib=sample.total_bytes // MiB if sample else None,
        free_mib=sample.free_bytes // MiB if sample else None,
        ours_mib=sample.ours_bytes // MiB if sample else None,
        tenants_mib=sample.tenants_bytes // MiB if sample else None,
        reserve_mib=c.book.reserve_mib,
        reserve_state=reserve_state,
        reserve_message=reserve_message,
        holds=dict(c.book.holds),
        room_kept_mib=decision.room_kept_mib if decision else None,
        borrowed_mib=c.book.borrowed_mib,
        leases=lease_status(c),
        resizes=c.resizes,
    )


def hit_rate(engine: EngineStatus | None) -> float | None:
    """Expert cache hits over fetches since start, every stage's together; unknown without a
    cache (every fetch a miss would read as 0.0) or before any fetch."""
    if engine is None:
        return None
    fetches = [s.fetches for s in engine.stages]
    if not any(f.cached for f in fetches):
        return None
    hits = sum(f.hits for f in fetches)
    total = hits + sum(f.misses for f in fetches)
    return hits / total if total else None


def _host_tier(caches: list[CacheStatus]) -> dict[str, int | None]:
    """The host tier's and the file's part (every stage's share of the one tier together), and
    what this process has read from the drive."""
    tiers = [c.host for c in caches if c.host is not None]
    drive = drive_read_bytes()
    return {
        "host_tier_mib": sum(t.nbytes for t in tiers) // MiB,
        "host_experts": sum(t.experts for t in tiers),
        "host_room_experts": sum(t.slots - t.experts for t in tiers),
        "file_experts": sum(c.file_experts for c in caches) if caches else None,
        "swaps": sum(c.swaps for c in caches),
        "corrupt_copies": sum(c.corrupt for c in caches),
        "drive_read_mib": drive // MiB if drive is not None else None,
    }


def build_status(
    facts: DaemonFacts,
    engine: EngineStatus | None,
    controllers: Sequence[VramController],
    compute_devices: Sequence[str],
) -> Status:
    """Each device's part; the top level: device 0's numbers and the whole model's."""
    stages: list[StageStatus | None] = list(engine.stages) if engine is not None else []
    stages += [None] * (len(controllers) - len(stages))
    devices = [
        device_status(i, compute_devices[i], c, stages[i]) for i, c in enumerate(controllers)
    ]
    first, stage, kv = devices[0], stages[0], stages[0].kv if stages[0] is not None else None
    caches = [s.cache for s in stages if s is not None and s.cache is not None]
    return Status(
        state=facts.state,
        model=facts.model,
        model_path=facts.model_path,
        listen=facts.listen,
        compute_device=first.compute_device,
        device=first.device,
        monitor=first.monitor,
        vram_requests=first.vram_requests,
        dbus=facts.dbus,
        cache_mib=first.cache_mib,
        core_mib=first.core_mib,
        tail_mib=first.tail_mib,
        max_cache_mib=first.max_cache_mib,
        cache_experts=first.cache_experts,
        # the model's routed experts: every stage's cache's
        total_experts=sum(c.max_experts for c in caches)
        if stage is not None and stage.cache is not None
        else None,
        **_host_tier(caches),
        kv_mib=first.kv_mib,
        kv_active_tokens=kv.active_tokens if kv is not None else 0,
        kv_active_mib=_up(kv.active_bytes) if kv is not None else 0,
        kv_kept_mib=_up(kv.kept_bytes) if kv is not None else 0,
        kv_kept=[KeptConversation(n) for n in kv.kept_tokens] if kv is not None else [],
        budget_mib=first.budget_mib,
        kv_fits_tokens=engine.fits_tokens if engine is not None and kv is not None else None,
        total_mib=first.total_mib,
        free_mib=first.free_mib,
        ours_mib=first.ours_mib,
        tenants_mib=first.tenants_mib,
        reserve_mib=first.reserve_mib,
        reserve_state=first.reserve_state,
        reserve_message=first.reserve_message,
        elastic_reserve_mib=facts.elastic_reserve_mib,
        holds=first.holds,
        room_kept_mib=first.room_kept_mib,
        borrowed_mib=first.borrowed_mib,
        leases=first.leases,
        resizes=first.resizes,
        hit_rate=hit_rate(engine),
        busy=facts.busy,
        queued=facts.queued,
        generated_tokens=facts.generated_tokens,
        devices=devices,
    )


__all__ = [
    "BusStatus",
    "DaemonFacts",
    "DeviceStatus",
    "JsonValue",
    "KeptConversation",
    "LeaseStatus",
    "MonitorStatus",
    "Status",
    "StatusJson",
    "build_status",
    "device_status",
    "hit_rate",
    "lease_status",
]
