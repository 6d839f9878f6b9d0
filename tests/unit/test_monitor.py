"""The VRAM monitors without a GPU: the simulated device, the none monitor, and the NVML monitor
against a fake ``pynvml`` module (``sys.modules["pynvml"]``) and a fake CUDA side that renumbers
devices the way ``CUDA_VISIBLE_DEVICES`` does."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from strata.vmm import nvml_monitor
from strata.vmm.errors import MonitorError
from strata.vmm.host_arena import HostArena
from strata.vmm.monitor import (
    NoneMonitor,
    ProcessUsage,
    VramMonitor,
    VramSample,
    create_monitor,
)
from strata.vmm.nvml_monitor import NvmlMonitor, find_nvml_index, normalize_pci, normalize_uuid
from strata.vmm.simulated import SimulatedMonitor

MiB = 1 << 20
GiB = 1 << 30
CHUNK = 2 * MiB


class Ours:
    """A settable ``ours`` callable."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def __call__(self) -> int:
        return self.value


def warnings_from(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == logger and r.levelno == logging.WARNING
    ]


# -- the sample and the none monitor -------------------------------------------------------------


def test_tenants_are_used_minus_ours_never_negative() -> None:
    s = VramSample(10 * GiB, 4 * GiB, 6 * GiB, 2 * GiB, None)
    assert s.tenants_bytes == 4 * GiB
    # ours read a moment after used, with a chunk mapped in between
    assert VramSample(10 * GiB, 8 * GiB, GiB, GiB + CHUNK, None).tenants_bytes == 0


def test_sample_process_used_is_none_unreported_and_zero_unlisted() -> None:
    assert VramSample(1, 1, 0, 0, None).process_used(7) is None
    s = VramSample(GiB, 0, GiB, 0, (ProcessUsage(7, 5), ProcessUsage(9, 6)))
    assert s.process_used(7) == 5
    assert s.process_used(8) == 0


def test_none_monitor_reports_nothing() -> None:
    m = create_monitor("none", ours=Ours(GiB))
    assert isinstance(m, NoneMonitor) and isinstance(m, VramMonitor)
    assert (m.kind, m.device_name, m.healthy, m.problem) == ("none", "none", True, None)
    assert m.sample() is None
    assert m.process_used(os.getpid()) is None
    m.close()
    m.close()


def test_unknown_kind_is_named_with_the_choices() -> None:
    with pytest.raises(MonitorError, match=r"'nvlm' is not one of 'nvml', 'simulated', 'none'"):
        create_monitor("nvlm", ours=Ours())


def test_simulated_needs_a_file() -> None:
    with pytest.raises(MonitorError, match="simulated_vram_file"):
        create_monitor("simulated", ours=Ours())


# -- the simulated device ------------------------------------------------------------------------


def write_state(path: Path, state: dict[str, Any] | str) -> None:
    """Replace the file atomically, as docs/simulated-vram.md tells tests to."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(state if isinstance(state, str) else json.dumps(state))
    os.replace(tmp, path)


def device(total_mib: float, *tenants: tuple[int, float], **extra: Any) -> dict[str, Any]:
    return {
        "total_mib": total_mib,
        "tenants": [{"pid": pid, "name": f"t{pid}", "mib": mib} for pid, mib in tenants],
        **extra,
    }


@pytest.fixture
def vram_file(tmp_path: Path) -> Path:
    path = tmp_path / "vram.json"
    write_state(path, device(1000, (10, 100)))
    return path


def test_simulated_arithmetic(vram_file: Path) -> None:
    write_state(vram_file, device(1000, (10, 100), (20, 200), (10, 50)))
    ours = Ours(300 * MiB)
    m = create_monitor("simulated", ours=ours, simulated_file=vram_file)
    assert isinstance(m, SimulatedMonitor) and isinstance(m, VramMonitor)
    assert (m.kind, m.device_name, m.healthy) == ("simulated", "simulated", True)
    s = m.sample()
    assert s is not None
    assert s.total_bytes == 1000 * MiB
    assert s.ours_bytes == 300 * MiB
    assert s.used_bytes == 650 * MiB
    assert s.free_bytes == 350 * MiB
    assert s.tenants_bytes == 350 * MiB
    me = os.getpid()
    expected = sorted([(10, 150 * MiB), (20, 200 * MiB), (me, 300 * MiB)])
    assert s.processes == tuple(ProcessUsage(p, b) for p, b in expected)
    assert m.process_used(10) == 150 * MiB
    assert m.process_used(me) == 300 * MiB
    stranger = next(p for p in (31337, 31338) if p != me)  # on no tenant's list, and not us
    assert m.process_used(stranger) == 0
    ours.value = 100 * MiB  # ours is read at each sample, never remembered
    s = m.sample()
    assert s is not None and (s.free_bytes, s.ours_bytes) == (550 * MiB, 100 * MiB)


def test_simulated_fractional_mib_and_free_never_negative(vram_file: Path) -> None:
    write_state(vram_file, device(100, (10, 0.5), (11, 150)))
    s = SimulatedMonitor(vram_file, Ours(10 * MiB)).sample()
    assert s is not None
    assert s.used_bytes == 160 * MiB + MiB // 2  # oversubscribed: a tenant took the room first
    assert s.free_bytes == 0


def test_simulated_file_is_read_again_at_every_sample(vram_file: Path) -> None:
    m = SimulatedMonitor(vram_file, Ours(0))
    assert m.sample().free_bytes == 900 * MiB  # type: ignore[union-attr]
    write_state(vram_file, device(1000, (10, 100), (20, 400)))
    assert m.sample().free_bytes == 500 * MiB  # type: ignore[union-attr]
    assert m.process_used(20) == 400 * MiB
    write_state(vram_file, device(2000))
    s = m.sample()
    assert s is not None and (s.total_bytes, s.free_bytes) == (2000 * MiB, 2000 * MiB)


def test_simulated_change_within_one_mtime_tick_is_seen(vram_file: Path) -> None:
    """Same size, same mtime, new content: the bytes decide, not the timestamp."""
    write_state(vram_file, device(1000, (10, 100)))
    st = vram_file.stat()
    m = SimulatedMonitor(vram_file, Ours(0))
    assert m.sample().free_bytes == 900 * MiB  # type: ignore[union-attr]
    vram_file.write_text(json.dumps(device(1000, (10, 300))))  # in place, same length
    os.utime(vram_file, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert vram_file.stat().st_mtime_ns == st.st_mtime_ns
    assert m.sample().free_bytes == 700 * MiB  # type: ignore[union-attr]


def test_simulated_without_per_process_reports_none(vram_file: Path) -> None:
    write_state(vram_file, device(1000, (10, 100), per_process=False))
    m = SimulatedMonitor(vram_file, Ours(MiB))
    s = m.sample()
    assert s is not None and s.processes is None and s.free_bytes == 899 * MiB
    assert m.process_used(10) is None


MALFORMED = [
    ("not-json", "{total_mib: 1", ["not valid JSON", "line 1"]),
    ("not-object", "[1, 2]", ["JSON object", "list"]),
    ("no-total", "{}", ["total_mib is missing"]),
    ("zero-total", '{"total_mib": 0}', ["total_mib must be positive"]),
    ("text-total", '{"total_mib": "24G"}', ["total_mib", "'24G'"]),
    ("bool-total", '{"total_mib": true}', ["total_mib", "True"]),
    ("unknown-key", '{"total_mib": 1, "tenant": []}', ["unknown key(s) tenant"]),
    ("tenants-object", '{"total_mib": 1, "tenants": {}}', ["tenants must be a list"]),
    ("tenant-no-pid", '{"total_mib": 1, "tenants": [{"mib": 1}]}', ["tenants[0].pid is missing"]),
    (
        "tenant-bad-pid",
        '{"total_mib": 1, "tenants": [{"pid": 1, "mib": 1}, {"pid": -3, "mib": 1}]}',
        ["tenants[1].pid", "-3"],
    ),
    (
        "tenant-negative",
        '{"total_mib": 1, "tenants": [{"pid": 1, "mib": -1}]}',
        ["tenants[0].mib", "non-negative", "-1"],
    ),
    (
        "tenant-unknown-key",
        '{"total_mib": 1, "tenants": [{"pid": 1, "mb": 1}]}',
        ["tenants[0]", "unknown key(s) mb"],
    ),
    ("per-process-text", '{"total_mib": 1, "per_process": "no"}', ["per_process", "'no'"]),
    ("nan", '{"total_mib": NaN}', ["total_mib", "finite"]),
]


@pytest.mark.parametrize(
    ("content", "words"), [(c, w) for _, c, w in MALFORMED], ids=[i for i, _, _ in MALFORMED]
)
def test_malformed_file_at_start_names_file_and_problem(
    tmp_path: Path, content: str, words: list[str]
) -> None:
    path = tmp_path / "vram.json"
    path.write_text(content)
    with pytest.raises(MonitorError) as e:
        create_monitor("simulated", ours=Ours(), simulated_file=path)
    text = str(e.value)
    assert str(path) in text
    for w in words:
        assert w in text


def test_missing_file_at_start_names_file(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.json"
    with pytest.raises(MonitorError, match="cannot read it: No such file") as e:
        create_monitor("simulated", ours=Ours(), simulated_file=path)
    assert str(path) in str(e.value)


def test_malformed_at_run_time_warns_once_and_keeps_last_good(
    vram_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="strata.vmm.simulated")
    m = SimulatedMonitor(vram_file, Ours(0))
    good = m.sample()
    assert good is not None and good.free_bytes == 900 * MiB
    write_state(vram_file, '{"total_mib": ')
    assert m.sample() == good
    assert m.sample() == good
    write_state(vram_file, '{"total_mib": -5}')  # still bad, differently: the same streak
    assert m.sample() == good
    assert m.process_used(10) == 100 * MiB
    assert m.healthy
    warnings = warnings_from(caplog, "strata.vmm.simulated")
    assert len(warnings) == 1, warnings
    assert str(vram_file) in warnings[0] and "not valid JSON" in warnings[0]
    assert "keeping its last good state" in warnings[0]

    write_state(vram_file, device(1000, (10, 600)))
    assert m.sample().free_bytes == 400 * MiB  # type: ignore[union-attr]
    assert any("readable again" in r.getMessage() for r in caplog.records)
    vram_file.unlink()  # a new bad streak: a new warning
    assert m.sample().free_bytes == 400 * MiB  # type: ignore[union-attr]
    assert m.sample().free_bytes == 400 * MiB  # type: ignore[union-attr]
    warnings = warnings_from(caplog, "strata.vmm.simulated")
    assert len(warnings) == 2, warnings
    assert "cannot read it" in warnings[1] and str(vram_file) in warnings[1]


def test_failing_at_run_time_warns_once_and_stops_sampling(
    vram_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    m = SimulatedMonitor(vram_file, Ours(0))
    assert m.sample() is not None
    write_state(vram_file, device(1000, (10, 100), failing=True))
    for _ in range(3):
        assert m.sample() is None
    assert m.process_used(10) is None
    assert not m.healthy and m.problem is not None and str(vram_file) in m.problem
    assert len(warnings_from(caplog, "strata.vmm.simulated")) == 1
    write_state(vram_file, device(1000))  # like NVML: once failed, failed for the process's life
    assert m.sample() is None
    # The "driver" still answers allocations from the file.
    assert m.try_allocate(1000 * MiB) and not m.try_allocate(1000 * MiB + 1)


def test_ours_must_be_a_non_negative_int(vram_file: Path) -> None:
    m = SimulatedMonitor(vram_file, lambda: -1)
    with pytest.raises(MonitorError, match=r"ours\(\) returned -1"):
        m.sample()


def test_try_allocate_refuses_beyond_free(vram_file: Path) -> None:
    ours = Ours(100 * MiB)
    m = SimulatedMonitor(vram_file, ours)  # 1000 total, 100 tenant, 100 ours: 800 free
    assert m.free_bytes() == 800 * MiB
    assert m.try_allocate(800 * MiB)
    assert not m.try_allocate(800 * MiB + 1)
    ours.value = 900 * MiB
    assert m.try_allocate(0) and not m.try_allocate(1)


@pytest.fixture
def arena_on(vram_file: Path) -> Iterator[Callable[[], tuple[HostArena, SimulatedMonitor]]]:
    made: list[HostArena] = []

    def make() -> tuple[HostArena, SimulatedMonitor]:
        box: list[HostArena] = []
        monitor = SimulatedMonitor(vram_file, lambda: box[0].mapped_bytes if box else 0)
        arena = HostArena(8 * CHUNK, CHUNK, commit=monitor.commit_guard())
        box.append(arena)
        made.append(arena)
        return arena, monitor

    yield make
    for a in made:
        a.close()


def test_arena_grow_beyond_simulated_free_maps_only_what_fits(
    vram_file: Path, arena_on: Callable[[], tuple[HostArena, SimulatedMonitor]]
) -> None:
    write_state(vram_file, device(16, (10, 10)))  # 6 MiB free: three 2 MiB chunks
    arena, monitor = arena_on()
    assert arena.grow(8 * CHUNK) == 3 * CHUNK
    assert arena.mapped_bytes == 3 * CHUNK
    s = monitor.sample()
    assert s is not None and (s.ours_bytes, s.free_bytes) == (3 * CHUNK, 0)
    write_state(vram_file, device(16))  # the tenant leaves
    assert arena.grow(5 * CHUNK) == 5 * CHUNK
    write_state(vram_file, device(16, (10, 2)))  # it comes back: oversubscribed, free 0
    assert monitor.sample().free_bytes == 0  # type: ignore[union-attr]
    arena.shrink(2 * CHUNK)
    assert arena.grow(2 * CHUNK) == CHUNK  # 2 MiB free after the shrink, not 4


def test_commit_guard_commits_through_the_inner_commit(vram_file: Path) -> None:
    calls: list[tuple[int, int, int]] = []
    m = SimulatedMonitor(vram_file, Ours(0))  # 900 MiB free
    guard = m.commit_guard(lambda fd, off, n: calls.append((fd, off, n)))
    guard(3, 0, 900 * MiB)
    with pytest.raises(OSError, match="simulated device") as e:
        guard(3, 0, 900 * MiB + 1)
    assert e.value.errno == 12  # ENOMEM: the arena's "no memory for this chunk"
    assert calls == [(3, 0, 900 * MiB)]


# -- NVML: matching ------------------------------------------------------------------------------

U = [f"GPU-{c * 8}-{c * 4}-{c * 4}-{c * 4}-{c * 12}" for c in "abc"]
BUS = ["00000000:19:00.0", "00000000:3B:00.0", "00000001:86:00.0"]
NVML_DEVICES: list[tuple[str | None, str | None]] = list(zip(U, BUS, strict=True))


def test_uuid_and_pci_normalisation() -> None:
    assert normalize_uuid(U[0]) == normalize_uuid(U[0][4:].upper()) == "a" * 32
    assert normalize_uuid("MIG-" + U[1][4:]) == "b" * 32
    assert normalize_pci("0000:3b:00.0") == normalize_pci("00000000:3B:00.0") == (0, 0x3B, 0, 0)
    assert normalize_pci("86:00.0") == (0, 0x86, 0, 0)
    with pytest.raises(MonitorError, match="'GPU-xyz'"):
        normalize_uuid("GPU-xyz")
    with pytest.raises(MonitorError, match="'nineteen'"):
        normalize_pci("nineteen")


@pytest.mark.parametrize(
    ("uuid", "pci", "index"),
    [
        (U[2][4:], None, 2),  # PyTorch's UUID has no GPU- prefix
        (U[1].upper(), None, 1),
        (None, "0001:86:00.0", 2),  # CUDA writes a 4-digit domain
        (None, "00000000:3b:00.0", 1),
        ("MIG-" + "d" * 8 + "-dddd-dddd-dddd-" + "d" * 12, "0000:19:00.0", 0),  # MIG: by bus
        (U[0], "0000:3b:00.0", 0),  # the UUID decides
    ],
)
def test_find_nvml_index(uuid: str | None, pci: str | None, index: int) -> None:
    assert find_nvml_index(uuid, pci, NVML_DEVICES) == index


def test_find_nvml_index_names_what_it_looked_for_and_what_exists() -> None:
    lost = "GPU-" + "e" * 8 + "-eeee-eeee-eeee-" + "e" * 12
    with pytest.raises(MonitorError) as e:
        find_nvml_index(lost, "0000:af:00.0", NVML_DEVICES)
    text = str(e.value)
    assert lost in text and "0000:af:00.0" in text
    for i, (u, b) in enumerate(NVML_DEVICES):
        assert f"{i}: {u} at {b}" in text
    with pytest.raises(MonitorError, match="neither its UUID nor its PCI bus id"):
        find_nvml_index(None, None, NVML_DEVICES)
    with pytest.raises(MonitorError, match="no devices"):
        find_nvml_index(U[0], None, [])
    with pytest.raises(MonitorError, match=r"names NVML devices \[0, 1\]"):
        find_nvml_index(None, "19:00.0", [(None, BUS[0]), (None, BUS[0])])


# -- NVML: a fake pynvml and a fake CUDA ---------------------------------------------------------


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        names = {3: "Not Supported", 13: "Function Not Found", 15: "GPU is lost"}
        return names.get(self.value, f"error {self.value}")


class FakeLibraryMismatch(Exception):
    pass


FakeLibraryMismatch.__name__ = "NVMLLibraryMismatchError"


@dataclass
class FakeGpu:
    uuid: str
    bus_id: str
    name: str = "NVIDIA Fake"
    total: int = 24 * GiB
    reserved: int = 512 * MiB
    used: int = 0
    compute: list[tuple[int, int | None]] = field(default_factory=list)
    graphics: list[tuple[int, int | None]] = field(default_factory=list)


class FakePynvml:
    """The part of pynvml the monitor calls; a handle is the FakeGpu itself."""

    NVMLError = FakeNVMLError
    NVMLLibraryMismatchError = FakeLibraryMismatch
    nvmlMemory_v2 = 0x02000028

    def __init__(self, gpus: list[FakeGpu]) -> None:
        self.gpus = gpus
        self.has_v2 = True
        self.broken: int | None = None  # every call raises this NVML error code
        self.init_error: int | None = None
        self.process_error: Exception | None = None
        self.inits = self.shutdowns = 0

    def _check(self) -> None:
        if self.broken is not None:
            raise FakeNVMLError(self.broken)

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._check()
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, handle: FakeGpu) -> str:
        return handle.uuid

    def nvmlDeviceGetPciInfo(self, handle: FakeGpu) -> Any:
        return SimpleNamespace(busId=handle.bus_id.encode())  # a ctypes char array: bytes

    def nvmlDeviceGetName(self, handle: FakeGpu) -> str:
        return handle.name

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu, version: int | None = None) -> Any:
        self._check()
        free = handle.total - handle.reserved - handle.used
        if version:
            if not self.has_v2:
                raise FakeNVMLError(13)
            assert version == self.nvmlMemory_v2
            return SimpleNamespace(
                version=version,
                total=handle.total,
                reserved=handle.reserved,
                free=free,
                used=handle.used,
            )
        return SimpleNamespace(total=handle.total, free=free, used=handle.used + handle.reserved)

    def _procs(self, entries: list[tuple[int, int | None]]) -> list[Any]:
        self._check()
        if self.process_error is not None:
            raise self.process_error
        return [SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in entries]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeGpu) -> list[Any]:
        return self._procs(handle.compute)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: FakeGpu) -> list[Any]:
        return self._procs(handle.graphics)


def fake_cuda(gpus: list[FakeGpu]) -> Callable[[int], tuple[str | None, str | None]]:
    """``cuda_identity`` as a CUDA driver would answer it: devices renumbered by
    ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs), UUIDs without ``GPU-``, 4-digit PCI domains."""

    def identify(cuda_index: int) -> tuple[str | None, str | None]:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        order = list(range(len(gpus)))
        if visible is not None:
            order = [
                int(tok) if tok.isdigit() else next(i for i, g in enumerate(gpus) if g.uuid == tok)
                for tok in visible.split(",")
            ]
        gpu = gpus[order[cuda_index]]
        domain, rest = gpu.bus_id.split(":", 1)
        return gpu.uuid.removeprefix("GPU-"), f"{int(domain, 16):04x}:{rest.lower()}"

    return identify


@pytest.fixture
def gpus() -> list[FakeGpu]:
    return [
        FakeGpu(U[0], BUS[0], "NVIDIA Fake A", total=8 * GiB, used=GiB),
        FakeGpu(U[1], BUS[1], "NVIDIA Fake B", total=16 * GiB, used=2 * GiB),
        FakeGpu(U[2], BUS[2], "NVIDIA Fake C", total=24 * GiB, used=3 * GiB),
    ]


@pytest.fixture
def fake_nvml(gpus: list[FakeGpu], monkeypatch: pytest.MonkeyPatch) -> Iterator[FakePynvml]:
    fake = FakePynvml(gpus)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(nvml_monitor, "cuda_identity", fake_cuda(gpus))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    yield fake


@pytest.mark.parametrize(
    ("visible", "cuda_index", "nvml_index"),
    [
        (None, 1, 1),
        ("2,0", 0, 2),
        ("2,0", 1, 0),
        ("1", 0, 1),
        (f"{U[2]},{U[0]}", 0, 2),
        (f"{U[2]},{U[0]}", 1, 0),
    ],
)
def test_nvml_monitor_follows_cuda_visible_devices(
    fake_nvml: FakePynvml,
    gpus: list[FakeGpu],
    monkeypatch: pytest.MonkeyPatch,
    visible: str | None,
    cuda_index: int,
    nvml_index: int,
) -> None:
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    m = create_monitor("nvml", ours=Ours(0), device_index=cuda_index)
    assert isinstance(m, NvmlMonitor) and isinstance(m, VramMonitor)
    assert m.healthy, m.problem
    gpu = gpus[nvml_index]
    assert (m.kind, m.uuid, m.device_name) == ("nvml", gpu.uuid, gpu.name)
    s = m.sample()
    assert s is not None and s.total_bytes == gpu.total and s.used_bytes == gpu.used
    m.close()


def test_nvml_sample_uses_memory_info_v2(fake_nvml: FakePynvml, gpus: list[FakeGpu]) -> None:
    gpus[0].compute = [(100, 3 * GiB // 4)]
    gpus[0].graphics = [(200, GiB // 4)]
    ours = Ours(3 * GiB // 4)
    m = NvmlMonitor(ours, 0)
    assert m.memory_info_version == 2
    s = m.sample()
    assert s is not None
    assert s.total_bytes == 8 * GiB
    assert s.used_bytes == GiB  # the 512 MiB the driver reserves is nobody's
    assert s.free_bytes == 8 * GiB - GiB - 512 * MiB
    assert s.ours_bytes == 3 * GiB // 4
    assert s.tenants_bytes == GiB // 4
    assert s.processes == (ProcessUsage(100, 3 * GiB // 4), ProcessUsage(200, GiB // 4))


def test_nvml_falls_back_to_memory_info_v1(fake_nvml: FakePynvml) -> None:
    fake_nvml.has_v2 = False
    m = NvmlMonitor(Ours(0), 0)
    assert m.healthy and m.memory_info_version == 1
    s = m.sample()
    assert s is not None and s.used_bytes == GiB + 512 * MiB  # v1: used counts the reserve


def test_nvml_per_process_usage(fake_nvml: FakePynvml, gpus: list[FakeGpu]) -> None:
    # 300: compute and graphics contexts, one process: its usage once, not twice.
    # 400: two entries in one list (two MIG instances): summed.
    gpus[0].compute = [(300, GiB), (400, 100 * MiB), (400, 50 * MiB)]
    gpus[0].graphics = [(300, GiB), (500, 10 * MiB)]
    m = NvmlMonitor(Ours(0), 0)
    s = m.sample()
    assert s is not None
    assert s.processes == (
        ProcessUsage(300, GiB),
        ProcessUsage(400, 150 * MiB),
        ProcessUsage(500, 10 * MiB),
    )
    assert m.process_used(300) == GiB
    assert m.process_used(400) == 150 * MiB
    assert m.process_used(999) == 0


@pytest.mark.parametrize(
    "unreported",
    ["value-not-available", "not-supported", "library-mismatch"],
)
def test_nvml_unreported_per_process_usage_is_none(
    fake_nvml: FakePynvml, gpus: list[FakeGpu], unreported: str
) -> None:
    gpus[0].compute = [(300, GiB)]
    if unreported == "value-not-available":  # WDDM: pynvml gives None for the ~0ULL marker
        gpus[0].graphics = [(301, None)]
    elif unreported == "not-supported":
        fake_nvml.process_error = FakeNVMLError(3)
    else:
        fake_nvml.process_error = FakeLibraryMismatch("use a versioned function")
    m = NvmlMonitor(Ours(0), 0)
    s = m.sample()
    assert s is not None and s.processes is None
    assert s.free_bytes == 8 * GiB - GiB - 512 * MiB
    assert m.process_used(300) is None
    assert m.healthy


def test_nvml_unavailable_entry_hides_only_that_sample(
    fake_nvml: FakePynvml, gpus: list[FakeGpu]
) -> None:
    gpus[0].compute = [(300, GiB), (301, None)]
    m = NvmlMonitor(Ours(0), 0)
    assert m.sample().processes is None  # type: ignore[union-attr]
    gpus[0].compute = [(300, GiB)]
    assert m.sample().processes == (ProcessUsage(300, GiB),)  # type: ignore[union-attr]


def test_nvml_unsupported_per_process_is_decided_once(
    fake_nvml: FakePynvml, gpus: list[FakeGpu]
) -> None:
    gpus[0].compute = [(300, GiB)]
    fake_nvml.process_error = FakeNVMLError(3)
    m = NvmlMonitor(Ours(0), 0)
    assert m.sample().processes is None  # type: ignore[union-attr]
    fake_nvml.process_error = None
    assert m.sample().processes is None  # type: ignore[union-attr]
    assert m.healthy


def test_nvml_failing_at_run_time_warns_once_and_samples_none(
    fake_nvml: FakePynvml, caplog: pytest.LogCaptureFixture
) -> None:
    m = NvmlMonitor(Ours(0), 0)
    assert m.sample() is not None
    fake_nvml.broken = 15  # GPU is lost
    for _ in range(3):
        assert m.sample() is None
    assert m.process_used(os.getpid()) is None
    assert not m.healthy
    assert m.problem is not None and "GPU is lost" in m.problem
    warnings = warnings_from(caplog, "strata.vmm.nvml_monitor")
    assert len(warnings) == 1, warnings
    assert "GPU is lost" in warnings[0] and "cache keeps its size" in warnings[0]
    fake_nvml.broken = None  # no flicker: failed stays failed
    assert m.sample() is None
    m.close()
    m.close()
    assert fake_nvml.shutdowns == 1


def test_nvml_absent_gives_an_unhealthy_monitor_not_a_crash(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    m = create_monitor("nvml", ours=Ours(0))
    assert isinstance(m, VramMonitor)
    assert not m.healthy and m.device_name == "unavailable"
    assert m.sample() is None and m.process_used(1) is None
    warnings = warnings_from(caplog, "strata.vmm.nvml_monitor")
    assert len(warnings) == 1 and "the nvidia-ml-py package" in warnings[0], warnings
    assert "install it with: " in warnings[0] and "strata[gpu]" not in warnings[0]
    m.close()


def test_nvml_init_failure_gives_an_unhealthy_monitor(
    fake_nvml: FakePynvml, caplog: pytest.LogCaptureFixture
) -> None:
    fake_nvml.init_error = 12  # NVML shared library not found
    m = create_monitor("nvml", ours=Ours(0))
    assert not m.healthy and m.sample() is None
    assert len(warnings_from(caplog, "strata.vmm.nvml_monitor")) == 1
    m.close()
    assert fake_nvml.shutdowns == 0  # never initialised


def test_nvml_device_not_found_names_it(
    fake_nvml: FakePynvml, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(nvml_monitor, "cuda_identity", lambda i: ("f" * 32, "0000:af:00.0"))
    m = create_monitor("nvml", ours=Ours(0))
    assert not m.healthy and m.sample() is None
    assert m.problem is not None and "f" * 32 in m.problem and U[0] in m.problem
    assert len(warnings_from(caplog, "strata.vmm.nvml_monitor")) == 1
    m.close()
    assert fake_nvml.shutdowns == 1


def test_nvml_without_cuda_gives_an_unhealthy_monitor(
    monkeypatch: pytest.MonkeyPatch, gpus: list[FakeGpu]
) -> None:
    import torch

    monkeypatch.setitem(sys.modules, "pynvml", FakePynvml(gpus))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    m = create_monitor("nvml", ours=Ours(0))  # the real cuda_identity
    assert not m.healthy
    assert m.problem is not None and "no CUDA device" in m.problem
