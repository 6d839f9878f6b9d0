"""Fixtures of the gpu tests. Each skips, printing why, where its device or library is absent;
every test in this folder carries the ``gpu`` marker, so CI (which has no GPU) may skip them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch


@pytest.fixture(scope="session")
def cuda_device() -> int:
    """The index of the CUDA device the gpu tests use (0)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError as e:
        pytest.skip(f"no CUDA device: cuda.bindings is missing ({e})")
    return 0


@pytest.fixture(scope="session")
def nvml_handle(cuda_device: int) -> Iterator[Any]:
    """The NVML handle of ``cuda_device``, found by the device's UUID (never by index)."""
    try:
        import pynvml
    except ImportError as e:
        pytest.skip(f"no NVML: nvidia-ml-py is missing ({e})")
    pynvml.nvmlInit()
    uuid = str(torch.cuda.get_device_properties(cuda_device).uuid)
    if not uuid.startswith(("GPU-", "MIG-")):
        uuid = f"GPU-{uuid}"
    try:
        yield pynvml.nvmlDeviceGetHandleByUUID(uuid.encode())
    finally:
        pynvml.nvmlShutdown()
