"""Several devices (a layer split): one VRAM controller per device, each with its own simulated
device, policy state, reserve and lease book, in front of one engine worker whose stages each have
a cache. A lease or a reserve on one device shrinks that device's cache only; an unknown device
number is an error naming it and the devices there are. The engine here is a stand-in with the
parts the controllers read (the real one runs in tests/integration/test_devices.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from strata.daemon.config import StrataConfig
from strata.daemon.control.control import ControlConfig, VramController
from strata.daemon.control.leases import Cookies, InvalidArgument, LeaseBook, LeaseNotFound
from strata.daemon.control.policy import PolicyConfig
from strata.daemon.engine_port import KvBytes
from strata.daemon.service import Daemon
from strata.vmm.simulated import SimulatedMonitor

MiB = 2**20


class _Cache:
    """The part of ExpertCache the controller reads: 1 MiB slots, 4 of them the core."""

    slot_bytes = MiB
    max_slots = 48
    core_bytes = core_mapped_bytes = 4 * MiB

    def __init__(self, n_slots: int) -> None:
        self.n_slots = n_slots
        self.mapped_bytes = n_slots * MiB
        self.closed = False

    @property
    def size_bytes(self) -> int:
        return self.n_slots * MiB

    def slots_for_bytes(self, nbytes: int) -> int:
        return max(4, min(self.max_slots, nbytes // MiB))

    def mapped_bytes_for(self, n_slots: int) -> int:
        return n_slots * MiB

    def resize(self, n_slots: int) -> Any:
        before, self.n_slots = self.n_slots, n_slots
        self.mapped_bytes = n_slots * MiB
        return SimpleNamespace(from_slots=before, to_slots=n_slots)


class _Worker:
    """The worker as the controllers drive it: a resize applies at once, to its stage's cache."""

    def __init__(self, caches: list[_Cache]) -> None:
        self.caches = caches
        # loaded; no budget: the cache alone is steered (the K/V is not the controllers' here)
        self.port = SimpleNamespace(kv_bytes=lambda stage: KvBytes(), budget=lambda stage: None)
        self.loaded = True
        self.resize_epoch = 0
        self.on_resized: dict[int, Callable[[Any, str], None]] = {}
        self.asked: list[tuple[int, int]] = []  # (stage, slots)

    def stage_cache(self, stage: int) -> _Cache:
        return self.caches[stage]

    def request_resize(self, n_slots: int, max_shrink: Any, reason: str, stage: int = 0) -> None:
        self.asked.append((stage, n_slots))
        result = self.caches[stage].resize(n_slots)
        listener = self.on_resized.get(stage)
        if listener is not None:
            listener(result, reason)


def _device_file(path: Path, total_mib: int, tenants_mib: int = 0) -> Path:
    tenants = [{"pid": 4242, "mib": tenants_mib}] if tenants_mib else []
    path.write_text(json.dumps({"total_mib": total_mib, "tenants": tenants}))
    return path


def _daemon(tmp_path: Path) -> tuple[Daemon, _Worker]:
    """Two devices of 64 MiB, each cache at 40 MiB (24 MiB free on each)."""
    worker = _Worker([_Cache(40), _Cache(40)])
    policy = PolicyConfig(elastic_reserve_mib=0, elastic_stable_ms=3_600_000)
    control = ControlConfig(period_ms=100, borrow_timeout_ms=24_000)
    cookies, listeners = Cookies(), []
    controllers: list[VramController] = []
    for number in range(2):
        monitor = SimulatedMonitor(
            _device_file(tmp_path / f"device{number}.json", 64),
            lambda number=number: controllers[number].ours_bytes(),
        )
        controllers.append(
            VramController(
                worker, monitor, policy, control, stage=number, book=LeaseBook(cookies),
                listeners=listeners,
            )  # type: ignore[arg-type]
        )  # fmt: skip
    daemon = Daemon(
        StrataConfig(), worker, controllers[0], None, "cpu", controllers, ["cpu", "cpu"]
    )  # type: ignore[arg-type]
    return daemon, worker


def _run(daemon: Daemon, scenario: Callable[[], Any]) -> Any:
    async def main() -> Any:
        for c in daemon.controllers:
            c.bind(asyncio.get_running_loop())
        return await scenario()

    return asyncio.run(main())


def test_a_lease_on_device_1_shrinks_only_its_cache(tmp_path: Path) -> None:
    daemon, worker = _daemon(tmp_path)
    events: list[tuple[str, dict[str, Any]]] = []
    daemon.controller.listeners.append(lambda name, fields: events.append((name, fields)))

    async def scenario() -> None:
        lease = await daemon.borrow(30, ":1.9", None, "org.example.Game", "textures", device=1)
        assert worker.caches[1].n_slots <= 34, "device 1 has 30 MiB free for the lease"
        assert worker.caches[0].n_slots == 40, "device 0's cache is not touched"
        assert all(stage == 1 for stage, _ in worker.asked)
        assert daemon.controllers[1].book.leases() == [lease]
        assert daemon.controllers[0].book.leases() == []
        await asyncio.sleep(0)  # the resize's event is handed to the loop
        resized = [fields for name, fields in events if name == "cache_resized"]
        assert resized and all(fields["device"] == 1 for fields in resized)
        # Return finds the lease on its device by its cookie alone
        daemon.return_lease(lease.cookie, ":1.9")
        assert daemon.controllers[1].book.leases() == []
        with pytest.raises(LeaseNotFound, match=str(lease.cookie)):
            daemon.revoke(lease.cookie)

    _run(daemon, scenario)


def test_a_reserve_on_device_0_leaves_device_1_alone(tmp_path: Path) -> None:
    daemon, worker = _daemon(tmp_path)

    async def scenario() -> Any:
        return await daemon.reserve(40, device=0)

    outcome = _run(daemon, scenario)
    assert outcome.how == "room" and outcome.free_mib is not None and outcome.free_mib >= 40
    assert worker.caches[0].n_slots <= 24 and worker.caches[1].n_slots == 40
    assert daemon.controllers[0].book.reserve_mib == 40
    assert daemon.controllers[1].book.reserve_mib == 0
    # a reserve without a device is device 0's, as with one device
    _run(daemon, lambda: daemon.reserve(0))
    assert daemon.controllers[0].book.reserve_mib == 0


@pytest.mark.parametrize("device", [2, 99, -1])
def test_an_unknown_device_is_named_with_the_devices_there_are(tmp_path: Path, device: int) -> None:
    daemon, worker = _daemon(tmp_path)
    expected = (
        rf"device {device}: no such device; Strata runs on 2 device\(s\): 0 \(cpu\), 1 \(cpu\)"
    )
    with pytest.raises(InvalidArgument, match=expected):
        _run(daemon, lambda: daemon.reserve(10, device=device))
    with pytest.raises(InvalidArgument, match=expected):
        _run(daemon, lambda: daemon.borrow(10, ":1.9", None, "a", "b", device=device))
    assert worker.asked == [] and daemon.all_leases() == []
    assert all(c.book.reserve_mib == 0 for c in daemon.controllers)


def test_a_hold_applies_to_every_device_and_leases_are_listed_with_their_device(
    tmp_path: Path,
) -> None:
    daemon, _ = _daemon(tmp_path)

    async def scenario() -> None:
        await daemon.set_hold("gamemode", 8)
        await daemon.borrow(4, ":1.9", None, "a", "first", device=1)
        await daemon.borrow(4, ":1.9", None, "a", "second", device=0)
        assert [c.book.holds for c in daemon.controllers] == [{"gamemode": 8}] * 2
        leases = [(lease["cookie"], lease["device"]) for lease in daemon.all_leases()]
        assert leases == [(1, 1), (2, 0)]
        gone = daemon.owner_vanished(":1.9")
        assert sorted(lease.cookie for lease in gone) == [1, 2] and daemon.all_leases() == []

    _run(daemon, scenario)


def test_build_makes_one_monitor_and_controller_per_device(tmp_path: Path) -> None:
    from strata.daemon.service import build

    files = [_device_file(tmp_path / "a.json", 100, 10), _device_file(tmp_path / "b.json", 200)]
    config = StrataConfig(
        devices="cpu,cpu", vram_monitor="simulated",
        simulated_vram_files=",".join(str(f) for f in files),
    )  # fmt: skip
    daemon, close = build(config)
    try:
        assert daemon.devices == ["cpu", "cpu"] and daemon.device == "cpu"
        samples = [c.monitor.sample() for c in daemon.controllers]
        assert [s.total_bytes // MiB for s in samples if s] == [100, 200]
        assert [s.tenants_bytes // MiB for s in samples if s] == [10, 0]
        assert [c.stage for c in daemon.controllers] == [0, 1]
        assert daemon.controllers[0].listeners is daemon.controllers[1].listeners
        assert daemon.controllers[1].where == "device 1, cpu"
        status = daemon.status()  # loading: each device listed, no stage and no check yet
        assert [(d["index"], d["compute_device"], d["layers"]) for d in status["devices"]] == [
            (0, "cpu", None),
            (1, "cpu", None),
        ]
        assert (
            status["state"] == "loading" and status["devices"][1]["monitor"]["kind"] == "simulated"
        )
    finally:
        close()


def test_build_with_one_device_is_as_before(tmp_path: Path) -> None:
    from strata.daemon.service import build

    config = StrataConfig(
        device="cpu", vram_monitor="simulated",
        simulated_vram_file=str(_device_file(tmp_path / "a.json", 100)),
    )  # fmt: skip
    daemon, close = build(config)
    try:
        assert len(daemon.controllers) == 1 and daemon.controllers[0].where is None
        assert [d["index"] for d in daemon.status()["devices"]] == [0]
    finally:
        close()


def test_each_cuda_device_gets_its_own_nvml_monitor(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML watches each device of a split, found from its CUDA index (the NVML monitor then
    finds the handle by that CUDA device's UUID, tests/unit/test_monitor.py)."""
    import strata.daemon.service as service
    import strata.vmm.monitor as monitor

    made: list[tuple[str, int]] = []

    def fake_monitor(kind: str, *, ours: Any, device_index: int = 0, simulated_file: Any = None):
        made.append((kind, device_index))
        return monitor.NoneMonitor()

    monkeypatch.setattr(monitor, "create_monitor", fake_monitor)
    monkeypatch.setattr(service, "require_gpu_packages", lambda device: None)
    daemon, close = service.build(StrataConfig(devices="cuda:1,cuda:0,cuda"))
    close()
    assert made == [("nvml", 1), ("nvml", 0), ("nvml", 0)]
    assert daemon.devices == ["cuda:1", "cuda:0", "cuda"]
    assert [c.on_gpu for c in daemon.controllers] == [True, True, True]
