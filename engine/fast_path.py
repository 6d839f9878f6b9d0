"""Whether and how a model's stages take the GPU runner (``engine.gpu``): why not (the CPU, a
type without a kernel, Triton missing), building the runners with their kernels compiled, and
the options they take once the expert caches exist (``Engine.load`` through ``loader``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import torch

from strata.engine.cpuinfo import default_threads
from strata.engine.devices import on_device
from strata.engine.errors import EngineError, KnobError
from strata.engine.experts import ExpertProvider
from strata.engine.gguf_index import GGUFIndex
from strata.engine.kv import KVCache
from strata.engine.models import REFERENCE_ONLY
from strata.engine.models.base import MoEModel
from strata.engine.options import EngineOptions
from strata.engine.quant import REPACKED_TYPES

log = logging.getLogger("strata.engine.generate")

# where an automatic cpu_share starts (the share the decode graph is captured with, then tuned)
AUTO_CPU_SHARE_START = 0.5


def fast_path_unavailable(
    index: GGUFIndex, device: torch.device, options: EngineOptions
) -> str | None:
    """Why decode steps cannot take the fused GPU kernels here, or None when they can."""
    if device.type != "cuda":
        return "the compute device is the CPU"
    if not options.fast_decode:
        return "fast_decode is off"
    if (why := REFERENCE_ONLY.get(index.arch)) is not None:
        return f"architecture {index.arch!r}: {why}"
    from strata.engine.kernels import unavailable

    if (reason := unavailable()) is not None:
        return reason
    types = {r.qtype for b in index.iter_experts() for r in b.runs}
    slow = sorted(t.name for t in types - REPACKED_TYPES)
    if slow:
        return f"expert tensors of type {', '.join(slow)} have no decode kernel yet"
    head_dim = int(index.key("attention.key_length", 0)) or int(
        index.key("embedding_length")
    ) // int(index.key("attention.head_count"))
    if head_dim < 2 or head_dim & (head_dim - 1):
        return f"the head dimension {head_dim} is not a power of two"
    return None


def unavailable_on_all(
    index: GGUFIndex, devices: Sequence[torch.device], options: EngineOptions
) -> str | None:
    """Why decode steps cannot take the fused GPU kernels on every stage's device (one reason
    is enough: the stages run one way), or None when they can."""
    for dev in devices:
        if (why := fast_path_unavailable(index, dev, options)) is not None:
            return why if len(devices) == 1 else f"{dev}: {why}"
    return None


def build_gpu_runners(
    model: MoEModel,
    kvs: Sequence[KVCache],
    providers: Sequence[ExpertProvider],
    progress: Callable[[str], None],
    options: EngineOptions,
) -> list | None:
    """One GPU runner per stage with its kernels compiled (one eager step, and prompt chunks),
    or None after a warning when they cannot be built here. Prefill kernels that fail to build
    leave the runners without their prompt-chunk path (one warning): prompts take the reference
    operations."""
    from strata.engine.gpu.decode import TUNE_ENV, tunes
    from strata.engine.gpu.runner import GpuRunner
    from strata.engine.kernels.pdl import pdl_mode

    # the developer's knobs first: a bad value stops the load naming it, where inside the
    # build it would leave the reference path with a warning
    try:
        tunes(os.environ.get(TUNE_ENV), torch.device("cuda"))
        pdl_mode()
    except ValueError as e:
        raise KnobError(str(e)) from None
    n = model.shape.n_layer
    runners: list[GpuRunner] = []
    try:
        for i, (kv, provider) in enumerate(zip(kvs, providers, strict=True)):
            with on_device(model.stage_devices[i]):
                runners.append(GpuRunner(model, i, kv, provider))
        progress("compiling the GPU decode kernels (first start only: then cached)")

        def on_layer(i: int) -> None:
            progress(f"compiling the GPU decode kernels: layer {i + 1}/{n}")

        for r in runners:
            with r.on():
                r.warm_up(on_layer)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # a compiler or driver that cannot build a kernel
        log.debug("building the GPU runner failed", exc_info=True)
        log.warning(
            "the GPU decode kernels failed to build (%s): decoding on the reference path",
            _first_line(e),
        )
        for r in runners:
            r.close()
        return None
    if not options.fast_prefill:
        for r in runners:
            r.prefill = None
        log.info("fast_prefill is off: prompt chunks take the reference path")
        return runners
    _build_chunks(runners, progress, options)
    return runners


def _build_chunks(runners: Sequence, progress: Callable[[str], None],
                  options: EngineOptions) -> None:  # fmt: skip
    chunk = options.prefill_chunk_tokens
    try:
        progress("compiling the GPU prefill kernels (first start only: then cached)")
        for r in runners:
            with r.on():
                r.warm_up_chunks()
        if not options.enforce_eager:
            progress(f"capturing {chunk}-token prompt chunks as CUDA graphs")
            for r in runners:
                with r.on():
                    r.capture_chunks(chunk)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # the same, for the tensor-core kernels alone
        log.debug("building the prefill kernels failed", exc_info=True)
        log.warning(
            "the GPU prefill kernels failed to build (%s): prompt chunks take the reference "
            "path (dequantise, then multiply)",
            _first_line(e),
        )
        for r in runners:
            r.prefill = None


def configure_gpu(runners: Sequence, model: MoEModel, options: EngineOptions,
                  step: Callable[[str], None]) -> None:  # fmt: skip
    """The options the GPU runners take once the caches exist, their tables bound to their
    stage's provider and their graphs captured. (``EngineOptions`` checked each option's
    bounds; what depends on the model, and on two options together, is checked here.)"""
    ahead = options.prefetch_experts
    n_expert = model.shape.routing.n_expert
    if ahead > n_expert:
        raise EngineError(
            f"prefetch_experts={ahead}: must be between 0 and the model's {n_expert} experts "
            "per layer"
        )
    share = options.cpu_share
    auto = share is None
    if share is None:  # tuned once the graph is captured, from a start worth capturing
        cuda = all(r.device.type == "cuda" for r in runners)
        share = AUTO_CPU_SHARE_START if cuda and not ahead else 0.0
    if share and ahead:
        raise EngineError(
            f"cpu_share={share} and prefetch_experts={ahead}: the CPU's share and the copies "
            "ahead both take the experts in RAM; set one of them to 0"
        )
    for r in runners:
        with r.on():
            r.adapt_swaps = options.adapt_swaps
            r.set_prefetch(ahead)
            r.set_cpu_share(share, options.threads or default_threads())
            r.bind(r.provider)  # the tables from its own stage's cache
    if not options.enforce_eager:
        step("capturing the decode step as a CUDA graph")
        for r in runners:
            with r.on():
                r.capture()
    else:
        for r in runners:
            r.graph_reason = "enforce_eager is set"
    if auto:
        time_cpu_share(runners, options, step)


def time_cpu_share(runners: Sequence, options: EngineOptions,
                   step: Callable[[str], None] | None = None) -> None:  # fmt: skip
    """Time the automatic ``cpu_share`` for the experts in RAM now, on each runner that has
    some: at load (``configure_gpu``; a cache whole at load has nothing to time, and keeps the
    start's), and in the bench at each budget, where a load with that cache would have chosen
    another share. The daemon keeps the load's share across resizes: a timing is a second or
    two of the GPU's steps, just when a borrower has taken its memory. Run where no sequence's
    K/V matters (the timed steps write rows of the first page). A pool that an earlier timing
    turned off (share 0) starts again, with the CPU mode's graph, to be timed; one the machine
    refused (no C compiler: ``cpu.reason``) is not asked again. A share the options fix, copies
    ahead, a runner on the CPU or without experts in RAM: nothing. ``step`` hears of the
    timing."""
    if options.cpu_share is not None or options.prefetch_experts:
        return
    todo = [r for r in runners if r.device.type == "cuda" and r.tables.host_count > 0]
    todo = [r for r in todo if r.cpu.on or r.cpu.tuned]
    if todo and step is not None:
        step("timing the CPU's share of the experts in RAM")
    for r in todo:
        with r.on():
            if not r.cpu.on:
                r.set_cpu_share(AUTO_CPU_SHARE_START, options.threads or default_threads())
                if not options.enforce_eager:
                    r.capture()
            r.tune_cpu_share()


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0]
