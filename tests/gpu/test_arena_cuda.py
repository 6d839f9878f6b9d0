"""The elastic arena on CUDA VMM: the host backend's whole contract, plus what only a GPU shows:
NVML's free memory following grow and shrink, and a grow while another process holds the memory.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from strata.vmm.cuda_arena import CudaArena
from strata.vmm.errors import ArenaRequestError
from tests.unit.test_arena_host import (
    CHUNK,
    CHUNKS,
    ArenaContract,
    MakeArena,
    pattern,
    read,
    write,
)

pytestmark = pytest.mark.gpu

MiB = 1 << 20
GiB = 1 << 30
NVML_SLACK = 8 * MiB  # driver bookkeeping (page tables) beside the chunks themselves


class TestCudaArena(ArenaContract):
    @pytest.fixture
    def make_arena(self, cuda_device: int) -> Iterator[MakeArena]:
        made: list[CudaArena] = []

        def make(chunks: int = CHUNKS) -> CudaArena:
            made.append(CudaArena(chunks * CHUNK, CHUNK, device=cuda_device))
            return made[-1]

        yield make
        for a in made:
            a.close()

    def test_views_are_device_tensors_at_arena_addresses(
        self, make_arena: MakeArena, cuda_device: int
    ) -> None:
        a = make_arena()
        a.grow(2 * CHUNK)
        v = a.view(CHUNK, CHUNK, torch.float16)
        assert a.device == f"cuda:{cuda_device}"
        assert v.device == torch.device("cuda", cuda_device)
        assert v.data_ptr() == a.address(CHUNK) and v.numel() == CHUNK // 2
        v.fill_(1.5)
        assert float(a.view(0, 2 * CHUNK, torch.float16).float().sum()) == 1.5 * (CHUNK // 2)

    def test_chunk_must_be_a_multiple_of_the_granularity(
        self, make_arena: MakeArena, cuda_device: int
    ) -> None:
        g = make_arena().granularity
        with pytest.raises(ArenaRequestError) as err:
            CudaArena(64 * g, g + g // 2, device=cuda_device)
        assert f"chunk_bytes {g + g // 2}" in str(err.value)
        assert f"granularity {g}" in str(err.value)


def nvml_free(handle: Any) -> int:
    import pynvml

    torch.cuda.synchronize()
    return int(pynvml.nvmlDeviceGetMemoryInfo(handle).free)


def test_nvml_free_memory_follows_grow_and_shrink(cuda_device: int, nvml_handle: Any) -> None:
    with CudaArena(2 * GiB, CHUNK, device=cuda_device) as a:
        a.shrink(a.grow(CHUNK))  # the driver's first-use allocations happen here, not below
        free0 = nvml_free(nvml_handle)
        assert a.grow(GiB) == GiB
        free1 = nvml_free(nvml_handle)
        a.shrink(GiB)
        free2 = nvml_free(nvml_handle)
    print(
        f"NVML free: before {free0 / MiB:.1f} MiB, after grow(1 GiB) {free1 / MiB:.1f} MiB "
        f"(-{(free0 - free1) / MiB:.1f}), after shrink {free2 / MiB:.1f} MiB "
        f"(+{(free2 - free1) / MiB:.1f})"
    )
    assert abs((free0 - free1) - GiB) <= NVML_SLACK
    assert abs((free2 - free1) - GiB) <= NVML_SLACK


HOG = textwrap.dedent(
    """
    import sys, torch
    leave, device = int(sys.argv[1]), int(sys.argv[2])
    torch.cuda.set_device(device)
    torch.empty(1, device="cuda")  # the context first: its memory counts as taken
    held, step = [], 1 << 30
    while step >= 2 << 20:
        free, _ = torch.cuda.mem_get_info()
        if free - leave < step:
            step //= 2
            continue
        try:
            held.append(torch.empty(step, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            step //= 2
    print("ready", torch.cuda.mem_get_info()[0], flush=True)
    sys.stdin.read()
    """
)


def test_grow_under_memory_pressure_maps_what_fits(cuda_device: int, nvml_handle: Any) -> None:
    leave = 64 * MiB
    with CudaArena(2 * GiB, CHUNK, device=cuda_device) as a:
        a.grow(CHUNK)
        data = pattern(CHUNK, seed=5)
        write(a, 0, data)
        # Device memory this test needs later is taken before the other process takes the rest.
        top = pattern(CHUNK, seed=6)
        top_dev = top.to(f"cuda:{cuda_device}")
        hog = subprocess.Popen(
            [sys.executable, "-c", HOG, str(leave), str(cuda_device)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            line = hog.stdout.readline()  # type: ignore[union-attr]
            assert line.startswith("ready"), f"the memory hog did not start: {line!r}"
            hog_free = int(line.split()[1])
            free_before = nvml_free(nvml_handle)
            got = a.grow(GiB)
            free_after = nvml_free(nvml_handle)
            print(
                f"under pressure: hog left {hog_free / MiB:.1f} MiB free (NVML "
                f"{free_before / MiB:.1f}); grow(1 GiB) got {got / MiB:.0f} MiB; NVML free after "
                f"{free_after / MiB:.1f} MiB"
            )
            assert 0 <= got < GiB and got % CHUNK == 0
            assert got <= free_before + NVML_SLACK
            assert a.mapped_bytes == CHUNK + got
            # Consistent and usable: old bytes kept, new ones zero and writable.
            assert torch.equal(read(a, 0, CHUNK), data)
            if got:
                assert not read(a, CHUNK, got).any()
                a.view(a.mapped_bytes - CHUNK, CHUNK).copy_(top_dev)
                assert torch.equal(read(a, a.mapped_bytes - CHUNK, CHUNK), top)
            assert a.shrink(got) == got and a.mapped_bytes == CHUNK
        finally:
            hog.stdin.close()  # type: ignore[union-attr]
            hog.wait(timeout=60)
        assert a.grow(GiB) == GiB, "once the other process is gone the memory comes back"
        assert torch.equal(read(a, 0, CHUNK), data)
