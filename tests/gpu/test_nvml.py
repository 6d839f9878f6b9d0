"""The NVML VRAM monitor on the real device: it watches the device nvidia-smi knows by the CUDA
device's UUID, sees a torch allocation move free memory by its size (as Strata's own, not a
tenant's), and reports our process's usage (or says it cannot)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest
import torch

from strata.vmm.monitor import VramSample, create_monitor
from strata.vmm.nvml_monitor import NvmlMonitor, normalize_pci
from tests.helpers import require_tool

pytestmark = pytest.mark.gpu

MiB = 1 << 20
GiB = 1 << 30
SLACK = 16 * MiB  # driver bookkeeping (page tables) beside the allocation itself


@pytest.fixture
def monitor(cuda_device: int) -> Iterator[NvmlMonitor]:
    try:
        import pynvml  # noqa: F401
    except ImportError as e:
        pytest.skip(f"no NVML: nvidia-ml-py is missing ({e})")
    dev = torch.device("cuda", cuda_device)
    torch.empty(1, device=dev)  # the CUDA context first: its memory is not the tests'
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()  # no cached block may serve the allocations below
    m = create_monitor(
        "nvml", ours=lambda: torch.cuda.memory_reserved(dev), device_index=cuda_device
    )
    assert isinstance(m, NvmlMonitor)
    assert m.healthy, m.problem
    yield m
    m.close()


def take(monitor: NvmlMonitor) -> VramSample:
    s = monitor.sample()
    assert s is not None, monitor.problem
    return s


def test_watches_the_device_nvidia_smi_knows_by_the_cuda_uuid(
    monitor: NvmlMonitor, cuda_device: int
) -> None:
    smi = require_tool("nvidia-smi")
    out = subprocess.run(
        [smi, "--query-gpu=index,uuid,pci.bus_id,name", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    rows = {}
    for line in out.splitlines():
        if line.strip():
            index, uuid, bus_id, name = (c.strip() for c in line.split(",", 3))
            rows[uuid.lower()] = (index, bus_id, name)
    props = torch.cuda.get_device_properties(cuda_device)
    cuda_uuid = str(props.uuid)
    if not cuda_uuid.upper().startswith(("GPU-", "MIG-")):
        cuda_uuid = f"GPU-{cuda_uuid}"
    print(f"cuda:{cuda_device} {cuda_uuid}; monitor {monitor!r} {monitor.uuid}; nvidia-smi {rows}")
    assert monitor.uuid is not None and monitor.uuid.lower() == cuda_uuid.lower()
    assert monitor.uuid.lower() in rows, f"{monitor.uuid} is not among nvidia-smi's {rows}"
    _, bus_id, name = rows[monitor.uuid.lower()]
    assert monitor.device_name == name
    if getattr(props, "pci_bus_id", None) is not None:
        cuda_pci = (props.pci_domain_id, props.pci_bus_id, props.pci_device_id, 0)
        assert normalize_pci(bus_id) == cuda_pci
    s = take(monitor)
    assert 0 < s.free_bytes and s.used_bytes + s.free_bytes <= s.total_bytes
    assert monitor.memory_info_version == 2, "expected NVML memory info v2 on a current driver"


def test_free_memory_follows_a_torch_allocation_counted_as_ours(
    monitor: NvmlMonitor, cuda_device: int
) -> None:
    dev = torch.device("cuda", cuda_device)
    before = take(monitor)
    x = torch.empty(GiB, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize(dev)
    during = take(monitor)
    del x
    torch.cuda.empty_cache()
    torch.cuda.synchronize(dev)
    after = take(monitor)
    grown = during.ours_bytes - before.ours_bytes
    print(
        f"NVML free: before {before.free_bytes / MiB:.1f} MiB, with 1 GiB "
        f"{during.free_bytes / MiB:.1f} MiB (-{(before.free_bytes - during.free_bytes) / MiB:.1f}),"
        f" after freeing {after.free_bytes / MiB:.1f} MiB; ours +{grown / MiB:.1f} MiB; tenants "
        f"{before.tenants_bytes / MiB:.1f} -> {during.tenants_bytes / MiB:.1f} MiB"
    )
    assert GiB <= grown <= GiB + 32 * MiB  # the caching allocator's segment for 1 GiB
    assert abs((before.free_bytes - during.free_bytes) - grown) <= SLACK
    assert abs((during.used_bytes - before.used_bytes) - grown) <= SLACK
    assert abs(during.tenants_bytes - before.tenants_bytes) <= SLACK  # ours is not a tenant
    assert abs((after.free_bytes - during.free_bytes) - grown) <= SLACK


def test_per_process_usage_of_our_process(monitor: NvmlMonitor, cuda_device: int) -> None:
    x = torch.empty(GiB, dtype=torch.uint8, device=torch.device("cuda", cuda_device))
    torch.cuda.synchronize(cuda_device)
    s = take(monitor)
    mine = monitor.process_used(os.getpid())
    print(f"PID {os.getpid()}: {mine}; processes {s.processes}")
    del x
    if mine is None:
        assert s.processes is None  # the driver does not report it: allowed, and said so
        return
    assert s.processes is not None
    if mine == 0:
        # NVML lists PIDs of the host's PID namespace; in a container ours has another number.
        if not s.processes:
            pytest.skip(f"NVML lists no process while PID {os.getpid()} holds 1 GiB (container?)")
        assert max(p.used_bytes for p in s.processes) >= GiB, s.processes
        return
    assert mine >= GiB  # the allocation plus the context
