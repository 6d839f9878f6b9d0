"""Sequences for the fast-path tests: over the reference runner, and over the GPU runner
assembled by hand (``Engine.load`` takes the fast path on a GPU only), on the GPU when there is
one, else on the CPU in Triton's interpreter (set here, before the kernels are imported, as the
importing tests do: whichever module imports them first decides)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from strata.engine.experts.cache import ExpertCache
from strata.engine.experts.provider import FileExpertProvider
from strata.engine.generate import Engine
from strata.engine.gguf_index import GGUFIndex
from strata.engine.gpu.runner import GpuRunner
from strata.engine.models import architecture_module
from strata.engine.reference_runner import ReferenceRunner
from strata.engine.sequences import Sequences, new_kvs

MiB = 2**20
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PROMPT = [1, 5, 9, 100, 7]


# The logits' tolerance beside the GPU's where the CPU computes a share of the RAM experts and
# its kernels read their input quantised to int8 (``cpu_experts.int8_input``: every block type
# on x86 with AVX2 or AVX-512BW, IQ3_XXS with VBMI): that rounding moves them by 2-3e-3 of the
# largest on the tiny Q4_K_M model (every RAM expert on the CPU) and 1.6e-2 on the tiny gpt-oss
# (MXFP4, its clamped SwiGLU), as llama.cpp's CPU kernels' q8 input does.
INT8_SHARE_TOL = 3e-2


def cpu_share_tol(gpu: GpuRunner, float_tol: float) -> float:
    """``float_tol`` (the CPU's sums round otherwise than the GPU's), or ``INT8_SHARE_TOL``
    where a kernel of the CPU's share reads an int8 input for some layer's experts."""
    from strata.engine.kernels import cpu_experts

    layouts = (lay for slot in gpu.geometry.slot_layouts for lay in slot.layouts)
    int8 = any(cpu_experts.int8_input(lay.qtype) for lay in layouts)
    return INT8_SHARE_TOL if int8 else float_tol


def reference_runner(path: Path) -> Sequences:
    index = GGUFIndex(path)
    model = architecture_module(index.arch).Model(index, DEVICE)
    (kv,) = new_kvs(model, 64, "f32")
    return Sequences([ReferenceRunner(model, 0, kv, FileExpertProvider(index, DEVICE))], 64, 512)


def share_cache(
    index: GGUFIndex, cache_share: float, host: bool, layers: range | None = None
) -> ExpertCache:
    """An expert cache on DEVICE in the kernel layout holding ``cache_share`` of the experts (of
    ``layers``: a stage's), with a host tier (page-locked on CUDA) holding the rest when
    ``host``."""
    probe = ExpertCache.create(
        index, torch.device("cpu"), 1 << 40, None, 2 * MiB, kernel=True, layers=layers
    )
    budget = int(probe.max_slots * cache_share) * probe.slot_bytes
    probe.close()
    pinner = None
    if host and DEVICE.type == "cuda":
        from strata.vmm.pinned import CudaPinner

        pinner = CudaPinner(DEVICE.index or 0)
    return ExpertCache.create(
        index, DEVICE, budget, None, 2 * MiB, kernel=True,
        host_budget_bytes=1 << 40 if host else 0, pinner=pinner, layers=layers,
    )  # fmt: skip


def fast_runner(
    path: Path,
    cache_share: float | None = None,
    prefill: bool = False,
    host: bool = False,
    prefetch: int = 0,
    cpu_share: float = 0.0,
) -> Sequences:
    """Dense weights repacked, the GPU runner's kernels warmed up, and an expert cache in the
    kernel layout holding ``cache_share`` of the experts (None: no cache), with a host tier
    holding the rest when ``host``, and ``prefetch`` predicted experts copied ahead from it
    (or ``cpu_share`` of the chosen ones in it computed by the CPU, on two threads).
    Prompts take the reference path unless ``prefill`` (``test_fast_prefill`` tests that
    path)."""
    index = GGUFIndex(path)
    model = architecture_module(index.arch).Model(index, DEVICE, repack=True)
    (kv,) = new_kvs(model, 64, "f32")
    gpu = GpuRunner(model, 0, kv, FileExpertProvider(index, DEVICE))
    gpu.warm_up()
    if not prefill:
        gpu.prefill = None
    provider = gpu.provider
    if cache_share is not None:
        provider = share_cache(index, cache_share, host)
    gpu.set_prefetch(prefetch)
    gpu.set_cpu_share(cpu_share, 2)
    gpu.bind(provider)
    return Sequences([gpu], 64, 512)


def worst(a: torch.Tensor, b: torch.Tensor, tol: float) -> float:
    """The largest difference of two [T, V] logit tables, relative to each row's largest
    value; asserts the top tokens agree wherever the first row's top-2 margin exceeds 2 tol."""
    out = 0.0
    for ra, rb in zip(a.cpu(), b.cpu(), strict=True):
        scale = float(ra.abs().max())
        out = max(out, float((ra - rb).abs().max()) / scale)
        top2 = torch.topk(ra, 2).values
        if float(top2[0] - top2[1]) > 2 * tol * scale:
            assert int(ra.argmax()) == int(rb.argmax())
    return out


def decode(runner: Sequences, steps: int, first: int) -> list[torch.Tensor]:
    """Logits of PROMPT and of ``steps`` forced tokens from ``first`` (the same for every
    runner), on the CPU."""
    runner.rewind(0)
    out = [runner.feed(PROMPT).cpu()]
    tok = first
    for _ in range(steps):
        out.append(runner.feed([tok]).cpu())
        tok = (tok * 31 + 7) % 500
    return out


def forced_logits(e: Engine, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """An engine's logits of ``prompt`` and of ``steps`` forced tokens, on the CPU."""
    e.sequences.rewind(0)
    out = [e.sequences.feed(prompt).cpu()]
    tok = 17
    for _ in range(steps):
        out.append(e.sequences.feed([tok]).cpu())
        tok = (tok * 131 + 3) % 2000
    return out
