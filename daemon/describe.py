"""The line ``strata serve`` logs once the model is loaded: the path it took (the VRAM arena, the
monitor, the kernels, the stages of a split), or why not (the CPU, and the reason)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from strata.daemon.service import Daemon


def describe_path(daemon: Daemon) -> str:
    """One line: the path ``strata serve`` took (the VRAM arena, the monitor, the kernels), or
    why not."""

    monitor = daemon.controller.monitor
    if monitor.kind == "none":
        watch = "no VRAM monitor (vram_monitor none)"
    elif monitor.healthy:
        watch = f"{monitor.kind} VRAM monitor on {monitor.device_name}"
    else:
        watch = f"no VRAM monitor: {monitor.problem}"
    requests = {
        "room": "requests wait for their room",
        "shrink": "a request shrinks the cache by its amount",
        "refused": "VRAM requests are refused (no GPU)",
    }[daemon.controller.requests]
    port = daemon.worker.port
    if not daemon.device.startswith("cuda"):
        return (
            f"path: CPU ({_why_cpu(daemon.config.device, daemon.config.devices)}); {watch}; "
            f"{requests}"
            f"{_stages_text(daemon)}"
        )
    status = port.status() if port is not None else None
    cache = status.stages[0].cache if status is not None else None
    arena = cache.arena if cache is not None else None
    arena_text = {"CudaArena": "CUDA VMM arena", None: "no expert cache"}.get(arena, str(arena))
    kernels = status.decode_path if status is not None else "not loaded"
    if status is not None and not status.decodes_on_gpu:
        from strata.engine.kernels import unavailable

        why = unavailable() or ("fast_decode is off" if not daemon.config.fast_decode else None)
        kernels += f", no Triton kernels: {why}" if why else ""
    prefill = status.prefill_path if status is not None else "not loaded"
    return (
        f"path: {daemon.device}: {arena_text}; {watch}; {requests}; decode: {kernels}; "
        f"prefill: {prefill}{_stages_text(daemon)}"
    )


def _stages_text(daemon: Daemon) -> str:
    """With several devices: each stage, its layers and its device's monitor."""
    if len(daemon.controllers) < 2:
        return ""
    parts = []
    for number, c in enumerate(daemon.controllers):
        layers = daemon.status_layers(number)
        monitor = c.monitor.kind if c.monitor.healthy else f"failed: {c.monitor.problem}"
        parts.append(f"{number} on {daemon.devices[number]}{layers} ({monitor} monitor)")
    return "; stages: " + ", ".join(parts)


def _why_cpu(asked: str, devices: list[str] | None = None) -> str:
    if devices is not None:
        return f"devices = {','.join(devices)}"
    if asked == "cpu":
        return "device = cpu"
    import torch

    if torch.version.cuda is None:
        return f"no CUDA device: this torch {torch.__version__} is a CPU build"
    return (
        f"no CUDA device: torch.cuda.is_available() is False (torch for CUDA {torch.version.cuda})"
    )
