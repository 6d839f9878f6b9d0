"""One bench run from settings to the result (a JSON-ready dict): the bandwidths, Strata at each
cache budget, the resize test, llama.cpp at each ``--n-cpu-moe``, and the pairs.

Order matters for the numbers: NVML's baseline is read before Strata allocates anything, the
bandwidths are measured before the model is loaded, and llama.cpp runs after Strata's engine is
closed (its VRAM is measured as the device's used memory above what it was just before it ran).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import platform
import time
from collections.abc import Callable
from typing import Any

import torch

from strata.bench import card, llama, probes, stats
from strata.bench.settings import DECODE_PROMPT_TOKENS, BenchSettings
from strata.bench.strata_run import StrataBench, dense_bytes_per_token, slots_for
from strata.engine import cpuinfo, quant
from strata.engine.devices import resolve_device
from strata.engine.fast_path import fast_path_unavailable
from strata.engine.generate import Engine
from strata.engine.gguf_index import GGUFIndex
from strata.engine.quant.expert_layout import kernel_slot_bytes_for, slot_bytes_for

log = logging.getLogger(__name__)

MiB = 2**20
Result = dict[str, Any]
Progress = Callable[[int, int, str], None]  # (done, total, what comes next)


class _Steps:
    """Counts finished units of work for a progress bar whose total is known up front."""

    def __init__(self, total: int, callback: Progress | None) -> None:
        self.total, self.done, self.callback = total, 0, callback

    def __call__(self, what: str) -> None:
        self.done = min(self.total, self.done + 1)
        if self.callback is not None:
            self.callback(self.done, self.total, what)

    def skip(self, units: int, what: str) -> None:
        self.done = min(self.total, self.done + units - 1)
        self(what)


def bench_context(settings: BenchSettings, model_ctx: int) -> int:
    """The context the engine gets: as configured, else just what the longest run needs (as
    llama-bench sizes its own per test), at most the model's."""
    if settings.engine.context_length is not None:
        return settings.engine.context_length
    need = max(max(settings.prefill), DECODE_PROMPT_TOKENS + settings.decode_tokens)
    return min(need, model_ctx) if model_ctx > 0 else need


def run_bench(settings: BenchSettings, progress: Progress | None = None) -> Result:
    """Measure everything ``settings`` asks for. Ctrl-C ends the run early: what was measured
    is returned, with ``interrupted`` saying where it stopped."""
    t_start = time.monotonic()
    deadline = None if settings.time_limit_s is None else t_start + settings.time_limit_s
    device = resolve_device(settings.engine.device)
    index = GGUFIndex(settings.model)
    n_experts = len(index.experts)
    # the slots the engine will make: the kernel layout's on the GPU fast path
    fast = fast_path_unavailable(index, device, settings.engine) is None
    slot_bytes = kernel_slot_bytes_for(index) if fast else slot_bytes_for(index)
    chunk = settings.engine.arena_chunk_mib * MiB
    slots = [slots_for(b, n_experts, slot_bytes, chunk) for b in settings.budgets]
    n_ctx = bench_context(settings, int(index.key("context_length", 0)))
    resize_at = slots.index(max(slots)) if slots else -1
    steps = _Steps(
        1
        + sum(settings.reps + 1 for _ in slots)
        + 2 * bool(slots)
        + len(settings.n_cpu_moe) * bool(settings.llama_bench),
        progress,
    )
    result: Result = {
        "model": {
            "path": str(settings.model),
            "name": settings.synthetic or settings.model.name,
            "synthetic": settings.synthetic,
            "arch": index.arch,
            "file_bytes": settings.model.stat().st_size,
            "n_experts": n_experts,
            "slot_bytes": slot_bytes,
            "expert_bytes": sum(b.nbytes for b in index.experts.values()),
            "dense_bytes_per_token": dense_bytes_per_token(index),
        },
        "settings": {
            "reps": settings.reps,
            "decode_tokens": settings.decode_tokens,
            "decode_prompt_tokens": DECODE_PROMPT_TOKENS,
            "prefill": list(settings.prefill),
            "context_length": n_ctx,
            "budgets": [b.label for b in settings.budgets],
            "budget_slots": slots,
            "prefill_chunk_tokens": settings.engine.prefill_chunk_tokens,
            "kv_cache_type": settings.engine.kv_cache_type,
            "arena_chunk_mib": settings.engine.arena_chunk_mib,
            "time_limit_s": settings.time_limit_s,
            "seed": settings.seed,
            "card_gib": settings.card_gib,
        },
        "interrupted": None,
    }
    del index
    monitor, vram_reason = probes.open_nvml(device)
    vram = probes.VramPeak(monitor) if monitor is not None else None
    nvml: Result = {"reason": vram_reason, "base_used_bytes": vram.used() if vram else None}
    result["nvml"] = nvml
    held = contextlib.ExitStack()  # the --card-gib filler, kept until llama.cpp is done
    try:
        result["bandwidth"] = probes.measure_bandwidths(device)
        nvml["after_cuda_init_used_bytes"] = vram.used() if vram else None
        result["device"] = {
            "name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
            "type": device.type,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "card": None,
        }
        filler = None
        if settings.card_gib is not None:  # after the bandwidths, before the model
            filler = held.enter_context(card.emulated_card(settings.card_gib, device))
            result["device"]["card"] = filler.report()
        if slots:
            steps("loading the model")
            _strata_phase(settings, device, n_ctx, slots, resize_at, result, vram, vram_reason,
                          steps, deadline)  # fmt: skip
        else:  # --only-llama-cpp
            steps("llama.cpp")
            result["strata"], result["resize"] = [], None
            result["device"]["dequant"] = None
            result["device"]["decode"] = None
            result["device"]["prefill"] = None
        if settings.llama_bench is not None and not result["interrupted"]:
            if filler is not None:  # what Strata's engine left (or freed) is corrected again
                result["device"]["card"]["before_llama"] = filler.recheck()
            _llama_phase(settings, result, vram, vram_reason, steps)
    finally:
        held.close()
        if vram is not None:
            vram.close()
            vram.monitor.close()
    stats.add_pairs(result)
    result["wall_s"] = time.monotonic() - t_start
    return result


def _strata_phase(
    settings: BenchSettings,
    device: torch.device,
    n_ctx: int,
    slots: list[int],
    resize_at: int,
    result: Result,
    vram: probes.VramPeak | None,
    vram_reason: str | None,
    steps: _Steps,
    deadline: float | None,
) -> None:
    largest = max(slots)
    cache_mib = math.ceil(largest * result["model"]["slot_bytes"] / MiB)
    options = dataclasses.replace(
        settings.engine,
        context_length=n_ctx,
        cache_mib=cache_mib,
        elastic_tail_mib=cache_mib,  # all of it elastic: the bench shrinks it down to nothing
    )
    t0 = time.monotonic()
    engine = Engine.load(settings.model, options)
    # The bench sizes the cache itself, budget by budget: the K/V grows beside it, outside any
    # budget, so a long prompt never shrinks the cache being measured.
    engine.sequences.budget = None
    result["load_s"] = time.monotonic() - t0
    result["device"]["threads"] = torch.get_num_threads()  # as the engine set them
    result["device"]["dequant"] = _dequant_path(device)
    result["device"]["decode"] = engine.sequences.decode_path()
    result["device"]["prefill"] = engine.sequences.prefill_path()
    rows: list[Any] = []
    result["strata"] = rows
    result["resize"] = None
    base = result["nvml"]["base_used_bytes"]
    if base is not None and result["device"]["card"]:  # the filler is not Strata's
        base += result["device"]["card"]["filler_bytes"]
    bench = StrataBench(
        engine, settings, result["bandwidth"], vram, vram_reason, base, steps, deadline,
    )  # fmt: skip
    try:
        for i, budget in enumerate(settings.budgets):
            if bench.over_time():
                why = f"time limit of {settings.time_limit_s:g} s reached before this budget"
                rows.append({"budget": budget.label, "skipped": why})
                steps.skip(settings.reps + 1, "next")
                continue
            rows.append(bench.measure(budget, slots[i]))
            if i == resize_at:
                if bench.over_time():
                    result["resize"] = {"reason": f"time limit of {settings.time_limit_s:g} s"}
                else:
                    result["resize"] = bench.resize_test()
                steps.skip(2, "next")
    except KeyboardInterrupt:
        result["interrupted"] = "during the Strata measurements (Ctrl-C)"
        log.warning("interrupted: reporting what was measured so far")
    finally:
        result["device"]["dequant"] = _dequant_path(device)  # a kernel may have failed meanwhile
        engine.close()
        del engine, bench
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()


def _llama_phase(
    settings: BenchSettings,
    result: Result,
    vram: probes.VramPeak | None,
    vram_reason: str | None,
    steps: _Steps,
) -> None:
    assert settings.llama_bench is not None
    out: Result = {"binary": str(settings.llama_bench), "rows": []}
    result["llama_cpp"] = out
    try:
        llama.run_all(
            settings.llama_bench,
            settings.model,
            settings.prefill,
            settings.decode_tokens,
            settings.reps,
            settings.n_cpu_moe,
            vram,
            vram_reason,
            settings.llama_timeout_s,
            steps,
            out["rows"],
        )
    except KeyboardInterrupt:
        result["interrupted"] = "during the llama.cpp runs (Ctrl-C)"


def _dequant_path(device: torch.device) -> str:
    return quant.gpu_dequant_path() if device.type == "cuda" else "torch reference (CPU)"


def _cpu_name() -> str:
    first = cpuinfo.processors()[:1]
    return (first[0].get("model name") if first else None) or platform.processor() or "cpu"
