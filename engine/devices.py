"""Which device the engine runs on: names resolved to ``torch.device`` with clear errors, and
the context that makes a stage's GPU current for the kernels launched inside it."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from strata.engine.errors import EngineError


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``; CUDA that is absent is an error naming the device."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise EngineError(f"device {name!r} is not cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise EngineError(f"device {name!r}: no CUDA device is available")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise EngineError(
                f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise EngineError(f"device {name!r} is not cpu, cuda or cuda:N")
    return device


def on_device(device: torch.device) -> AbstractContextManager[object]:
    """Make ``device`` the current CUDA device for what runs inside (Triton launches on the
    current device, whatever their tensors' device); nothing on the CPU."""
    if device.type != "cuda":
        return nullcontext()
    return torch.cuda.device(device)
