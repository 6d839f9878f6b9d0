"""Strata's side of the bench: one loaded engine, its expert cache resized to each budget, and at
each budget a warm-up and ``reps`` repetitions of every prefill size and of one decode.

Every run records raw counts and times (tokens, steps, seconds, expert hits and misses and their
bytes); the rates in a row are computed from those by ``stats`` and nothing else. Decode runs
generate exactly ``decode_tokens`` tokens (end-of-generation tokens are not honoured, as in
llama-bench's ``tg`` test), greedily, from the same seeded random prompt each time; every run
starts from an empty K/V cache.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from strata.bench import probes, stats
from strata.bench.settings import (
    DECODE_PROMPT_TOKENS,
    RESIZE_BYTES,
    RESIZE_DECODE_TOKENS,
    BenchSettings,
    Budget,
)
from strata.engine.experts.host import drive_read_bytes
from strata.engine.experts.provider import ProviderStats
from strata.engine.generate import Engine
from strata.engine.gguf_index import GGUFIndex
from strata.engine.grammar import GrammarSpec, json_schema_lark
from strata.engine.params import SamplingParams

log = logging.getLogger(__name__)

MiB = 2**20
Row = dict[str, Any]
Progress = Callable[[str], None]  # called once per finished unit of work, with what comes next
NVML_SLACK = 64 * MiB  # NVML's free memory may lag or lead a resize by a little
NVML_WAIT_S = 10.0


# --grammar: JSON lines of tool calls, without end (so that every run has its decode_tokens):
# short strings, numbers, booleans and names from a list, so the mask changes at most steps
# the sampled decode row's sampler: a chat client's usual settings, every filter on, seeded
BENCH_SAMPLED = SamplingParams(temperature=0.7, top_p=0.95, top_k=40, min_p=0.05,
                               repeat_penalty=1.1)  # fmt: skip

BENCH_GRAMMAR = GrammarSpec(
    "lark",
    "start: line+\nline: "
    + json_schema_lark(
        {
            "type": "object",
            "properties": {
                "name": {"enum": ["read_file", "list_files", "search"]},
                "arguments": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "maxLength": 24},
                        "line": {"type": "integer", "minimum": 0, "maximum": 100000},
                        "recursive": {"type": "boolean"},
                    },
                    "required": ["path", "line", "recursive"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
    )
    + ' "\\n"\n',
)


def dense_bytes_per_token(index: GGUFIndex) -> int:
    """Bytes of non-expert weights one decode step reads: every dense matrix once, one row of
    the token embedding (all of it where the output matrix is tied to it)."""
    total = 0
    for name, t in index.tensors.items():
        if name.endswith("_exps.weight"):
            continue
        if name == "token_embd.weight" and "output.weight" in index.tensors:
            total += t.nbytes // t.shape[0]
        else:
            total += t.nbytes
    return total


def slots_for(budget: Budget, n_experts: int, slot_bytes: int, chunk_bytes: int) -> int:
    """The slots a budget gets: a share of the experts, or the whole slots whose mapping (whole
    arena chunks) fits its MiB, at most one per expert (as ``ExpertCache.slots_for_bytes``)."""
    usable = (budget.mib or 0) * MiB // chunk_bytes * chunk_bytes
    return budget.slots(n_experts, min(usable // slot_bytes, n_experts))


def _counts(s: ProviderStats) -> dict[str, int]:
    return {
        "hits": s.hits,
        "misses": s.misses,
        "hit_bytes": s.bytes_from_cache,
        "miss_bytes": s.bytes_from_ram + s.bytes_from_file,
        "prefetched": s.prefetched,
        "prefetch_used": s.prefetch_used,
        "prefetch_unused_bytes": s.bytes_prefetched_unused,
        "cpu_computed": s.cpu_computed,
        "cpu_bytes": s.bytes_cpu,
    }


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in before}


class StrataBench:
    """Measures one engine at each budget. ``deadline`` (monotonic seconds) stops new work."""

    def __init__(
        self,
        engine: Engine,
        settings: BenchSettings,
        bandwidth: dict[str, Any],
        vram: probes.VramPeak | None,
        vram_reason: str | None,
        nvml_base: int | None,
        progress: Progress,
        deadline: float | None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.bandwidth = bandwidth
        self.vram = vram
        self.vram_reason = vram_reason
        self.nvml_base = nvml_base
        self.progress = progress
        self.deadline = deadline
        self.device = engine.sequences.model.device
        self.cuda = self.device.type == "cuda"
        self.dense_bytes = dense_bytes_per_token(engine.index)
        self.vocab = engine.sequences.model.shape.vocab_size
        if settings.grammar:  # its tokenizer takes the end tokens before they are cleared
            engine.grammars.compile(BENCH_GRAMMAR)
        # exactly decode_tokens tokens per run, as llama-bench's tg test
        engine.tokenizer.eog_ids = frozenset()

    # -- helpers --------------------------------------------------------------------------------

    def over_time(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def _prompt(self, n: int) -> list[int]:
        rng = np.random.default_rng([self.settings.seed, n])
        return rng.integers(0, self.vocab, size=n).tolist()

    def _counts(self) -> dict[str, int]:
        # the fast path counts reads on the device: hand them over first
        self.engine.sequences.flush_usage()
        return _counts(self.engine.provider.stats)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    # -- single runs ----------------------------------------------------------------------------

    def prefill_run(self, n: int) -> Row:
        ids = self._prompt(n)
        self.engine.sequences.rewind(0)
        self._sync()
        before = self._counts()
        drive = drive_read_bytes()
        t0 = time.perf_counter()
        self.engine.sequences.feed(ids)
        self._sync()  # the logits stay on the device: wait for them
        seconds = time.perf_counter() - t0
        after = drive_read_bytes()
        read = None if drive is None or after is None else after - drive
        return {"tokens": n, "seconds": seconds, "drive_read_bytes": read,
                **_delta(before, self._counts())}  # fmt: skip

    def decode_run(
        self,
        n_tokens: int,
        at_step: int | None = None,
        action: Callable[[], Any] | None = None,
        grammar: bool = False,
        sampled: bool = False,
    ) -> Row:
        """One generation of ``n_tokens``; its counts cover the decode steps only. ``action``
        runs at the safe point after decode step ``at_step`` (the resize test's shrink);
        ``grammar``: under ``BENCH_GRAMMAR`` (the masks' host time is kept); ``sampled``: with
        ``BENCH_SAMPLED`` instead of greedy."""
        prompt = self._prompt(DECODE_PROMPT_TOKENS)
        runner = self.engine.sequences
        runner.rewind(0)
        chunks = math.ceil(len(prompt) / runner.prefill_chunk)
        calls = 0
        marks: dict[str, Any] = {}

        def safe_point() -> None:
            nonlocal calls
            calls += 1
            if calls == chunks:
                marks["decode"] = self._counts()
            if action is not None and at_step is not None and calls == chunks + at_step:
                marks["action"] = action()

        self._sync()
        params = (
            replace(BENCH_SAMPLED, max_tokens=n_tokens, seed=self.settings.seed)
            if sampled
            else SamplingParams(max_tokens=n_tokens, temperature=0.0, seed=self.settings.seed)
        )
        constraint = self.engine.grammars.compile(BENCH_GRAMMAR) if grammar else None
        r = self.engine.generate(prompt, params, safe_point=safe_point, constraint=constraint)
        gaps = np.diff(r.token_times).tolist()
        run = {
            "prompt_tokens": len(prompt),
            "tokens": len(r.tokens),
            "steps": max(0, len(r.tokens) - 1),
            "first_token_s": r.first_token_s,
            "decode_s": r.decode_s,
            "max_gap_s": max(gaps) if gaps else None,
            **_delta(marks.get("decode", self._counts()), self._counts()),
        }
        if action is not None:
            run["gaps_s"] = gaps
            run["action"] = marks.get("action")
        if constraint is not None:
            run["mask_s"], run["masks"] = r.mask_s, constraint.masks
        return run

    # -- one budget -----------------------------------------------------------------------------

    def resize_to(self, slots: int) -> float | None:
        cache = self.engine.cache
        if cache is None:
            return None
        t0 = time.perf_counter()
        cache.resize(slots)
        return time.perf_counter() - t0

    def _retime_share(self) -> None:
        """An automatic CPU share timed for this budget's experts in RAM, as a load with this
        cache would time it (the row's ``cpu.tuned_ms_per_step``); the engine loaded with the
        cache whole had nothing in RAM to time."""
        from strata.engine.fast_path import time_cpu_share

        stages = [st for st in self.engine.sequences.stages if st.on_gpu]
        time_cpu_share(stages, self.settings.engine, self.progress)

    def measure(self, budget: Budget, slots: int) -> Row:
        s = self.settings
        cache = self.engine.cache
        n_experts = len(self.engine.index.experts)
        row: Row = {"budget": budget.label, "total_experts": n_experts}
        row["resize_s"] = self.resize_to(slots)
        self._retime_share()
        # what the cache holds after the resize (a grow that finds too little memory stops short)
        row["cache_experts"] = cache.n_slots if cache is not None else 0
        row["cache_bytes"] = cache.arena.mapped_bytes if cache is not None else 0
        self._memory_begin()
        n_ctx = self.engine.n_ctx
        sizes = [p for p in s.prefill if p <= n_ctx]
        decode_fits = DECODE_PROMPT_TOKENS + s.decode_tokens <= n_ctx
        warm_tokens = min(16, s.decode_tokens)
        row["warmup"] = {
            "prefill": self.prefill_run(min(sizes)) if sizes else None,
            "decode": self.decode_run(warm_tokens) if decode_fits else None,
            # (the sampler's graph is captured by its first request: not in the timed runs)
            "sampled": self.decode_run(warm_tokens, sampled=True) if decode_fits else None,
        }
        self.progress(f"{budget.label}: rep 1/{s.reps}")
        prefill: dict[int, list[Row]] = {p: [] for p in sizes}
        decode: list[Row] = []
        constrained: list[Row] = []
        sampled: list[Row] = []
        row["reps_run"], row["reps_reason"] = 0, None
        for rep in range(s.reps):
            if rep > 0 and self.over_time():
                row["reps_reason"] = f"time limit of {s.time_limit_s:g} s reached"
                break
            for p in sizes:
                prefill[p].append(self.prefill_run(p))
            if decode_fits:
                decode.append(self.decode_run(s.decode_tokens))
                sampled.append(self.decode_run(s.decode_tokens, sampled=True))
                if s.grammar:
                    constrained.append(self.decode_run(s.decode_tokens, grammar=True))
            row["reps_run"] = rep + 1
            nxt = f"{budget.label}: rep {rep + 2}/{s.reps}" if rep + 1 < s.reps else "next"
            self.progress(nxt)
        row["prefill"] = [self._prefill_row(p, prefill.get(p), n_ctx) for p in s.prefill]
        row["decode"] = (
            self._decode_row(decode)
            if decode_fits
            else {
                "tokens": s.decode_tokens,
                "skipped": f"{DECODE_PROMPT_TOKENS} + {s.decode_tokens} tokens do not fit the "
                f"context of {n_ctx} tokens",
            }
        )
        if decode_fits:
            row["decode"]["sampled"] = self._sampled_row(sampled, row["decode"])
        if s.grammar and decode_fits:
            row["decode"]["grammar"] = self._grammar_row(constrained, row["decode"])
        row["memory"] = self._memory_end()
        return row

    def _sampled_row(self, runs: list[Row], greedy: Row) -> Row:
        """The decode with ``BENCH_SAMPLED`` beside the greedy one: tok/s, their ratio, and its
        own hit rate (its tokens differ from the greedy run's, so its experts do: with part of
        them in RAM, a ratio under 1 may be more misses, not a slower step)."""
        rate = stats.summary(stats.decode_rates(runs))
        base = (greedy.get("tok_s") or {}).get("median")
        p = BENCH_SAMPLED
        return {
            "runs": runs,
            "tok_s": rate,
            "vs_greedy": rate["median"] / base if rate and base else None,
            "hit_rate": stats.hit_rate(runs),
            "sampler": {
                name: getattr(p, name)
                for name in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty")
            },
        }

    def _grammar_row(self, runs: list[Row], plain: Row) -> Row:
        """The decode under BENCH_GRAMMAR beside the plain one: tok/s, the masks' host time
        per token, and ``overhead``, the time per token it adds as a share of a plain step's
        (greedy: the plain runs may step ahead of the host, the constrained ones may not)."""
        rate = stats.summary(stats.decode_rates(runs))
        base = (plain.get("tok_s") or {}).get("median")
        masks = sum(r["masks"] for r in runs)
        mask_s = sum(r["mask_s"] for r in runs) / masks if masks else None
        return {
            "runs": runs,
            "tok_s": rate,
            "mask_us_per_token": None if mask_s is None else mask_s * 1e6,
            "mask_share": None if mask_s is None or not base else mask_s * base,
            "overhead": base / rate["median"] - 1 if rate and base else None,
        }

    def _prefill_row(self, p: int, runs: list[Row] | None, n_ctx: int) -> Row:
        if runs is None:
            return {"tokens": p, "skipped": f"beyond the context of {n_ctx} tokens"}
        row: Row = {
            "tokens": p,
            "runs": runs,
            "tok_s": stats.summary(stats.prefill_rates(runs)),
            "hit_rate": stats.hit_rate(runs),
        }
        # the experts a chunk reads from RAM cross the link: the bound it sets on prompt speed
        pcie = self.bandwidth.get("pcie_bytes_per_s")
        if not self.cuda:
            row["link"], row["link_reason"] = None, "CPU run: nothing crosses PCIe"
        elif pcie is None:
            row["link"] = None
            row["link_reason"] = self.bandwidth.get("reason", "bandwidths not measured")
        else:
            row["link"], row["link_reason"] = stats.prompt_link(runs, pcie), None
        return row

    def _decode_row(self, runs: list[Row]) -> Row:
        out: Row = {
            "tokens": self.settings.decode_tokens,
            "runs": runs,
            "tok_s": stats.summary(stats.decode_rates(runs)),
            "ttft_s": stats.summary([r["first_token_s"] for r in runs if r["first_token_s"]]),
            "hit_rate": stats.hit_rate(runs),
            "prefetch": stats.prefetch(runs),
            "cpu": stats.cpu_share(runs),
        }
        dec = self.engine.sequences.gpu  # (one stage: its GPU runner; stages tune their own)
        if out["cpu"] is not None and dec is not None:
            # the share the CPU was given, and the timings that chose it (automatic cpu_share)
            out["cpu"]["share"] = dec.cpu.share
            out["cpu"]["tuned_ms_per_step"] = {f"{k:g}": v for k, v in dec.cpu.tuned.items()}
        if self.cuda:  # the misses the CPU computed (cpu_share) did not cross the link
            miss, cpu = stats.per_step(runs, "miss_bytes"), stats.per_step(runs, "cpu_bytes")
            out["pcie_bytes_per_token"] = None if miss is None else miss - (cpu or 0.0)
            out["pcie_reason"] = None
        else:
            out["pcie_bytes_per_token"] = None
            out["pcie_reason"] = "CPU run: misses are read from host memory, not over PCIe"
        bw = self.bandwidth
        if "device_bytes_per_s" in bw:
            out["roofline"] = stats.roofline(
                runs, self.dense_bytes, bw["device_bytes_per_s"], bw["pcie_bytes_per_s"]
            )
            out["roofline_reason"] = None
        else:
            out["roofline"] = None
            out["roofline_reason"] = bw.get("reason", "bandwidths not measured")
        return out

    # -- memory ---------------------------------------------------------------------------------

    def _memory_begin(self) -> None:
        if self.cuda:
            self._sync()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        self._rss_reset = probes.reset_peak_rss()
        if self.vram is not None:
            self.vram.reset()

    def _memory_end(self) -> Row:
        cache = self.engine.cache
        m: Row = {"peak_rss_bytes": probes.peak_rss_bytes()}
        m["peak_rss_scope"] = "this budget" if self._rss_reset else "the whole process"
        m.update(probes.rss_parts())
        m.update(self._ram_parts())
        m.update(self._state_parts())
        if not self.cuda:
            m.update(peak_vram_bytes=None, peak_vram_source=None, vram_reason="CPU run: no VRAM")
            return m
        arena = cache.arena.mapped_bytes if cache is not None else 0
        m["torch_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
        m["arena_mapped_bytes"] = arena
        m["strata_peak_bytes"] = m["torch_peak_allocated_bytes"] + arena
        peak = self.vram.peak() if self.vram is not None else None
        if peak is not None and self.nvml_base is not None:
            m["nvml_peak_bytes"] = peak - self.nvml_base
            m["nvml_reason"] = None
            m["peak_vram_bytes"], m["peak_vram_source"] = m["nvml_peak_bytes"], "nvml"
        else:
            m["nvml_peak_bytes"] = None
            m["nvml_reason"] = self.vram_reason or "NVML stopped answering"
            m["peak_vram_bytes"], m["peak_vram_source"] = m["strata_peak_bytes"], "torch+arena"
        return m

    def _state_parts(self) -> Row:
        """A hybrid's recurrent state (Gated DeltaNet layers): its bytes for one conversation,
        fixed whatever its length, and the checkpoints held beside it (copies of it at message
        starts, for rewinds). Empty for a model without one."""
        states = self.engine.sequences.states
        if not states:
            return {}
        live = sum(st.state_bytes for st in states)
        return {
            "recurrent_state_bytes": live,
            "recurrent_checkpoint_bytes": sum(st.nbytes for st in states) - live,
            "recurrent_checkpoints": max(len(st.checkpoints) for st in states),
        }

    def _ram_parts(self) -> Row:
        """Where the experts outside VRAM are: the host tier, and the GGUF's expert runs in the
        page cache (``mincore``), and what the process has read from the drive so far."""
        cache = self.engine.cache
        tier = cache.tier_stats() if cache is not None else None
        runs = [(r.offset, r.nbytes) for b in self.engine.index.iter_experts() for r in b.runs]
        return {
            "host_tier_bytes": tier.bytes if tier else 0,
            "host_experts": tier.experts if tier else 0,
            "file_experts": cache.file_experts if cache is not None else len(runs) // 3,
            "expert_page_cache_bytes": self.engine.index.resident_bytes(runs),
            "drive_read_bytes": drive_read_bytes(),
        }

    # -- resizing under load --------------------------------------------------------------------

    def resize_test(self) -> Row:
        """Shrink by 4 GiB (request -> NVML shows the memory free), grow back (-> refilled),
        then shrink by 4 GiB at a safe point of a decode and record the longest token gap."""
        cache = self.engine.cache
        if not self.cuda:
            return {"reason": "CPU run: resizes are timed on a GPU, against NVML"}
        if cache is None or cache.arena.mapped_bytes < RESIZE_BYTES:
            size = 0 if cache is None else cache.arena.mapped_bytes
            return {"reason": f"the cache ({size / MiB:.0f} MiB) is smaller than 4 GiB"}
        n0, mapped0 = cache.n_slots, cache.arena.mapped_bytes
        target = cache.slots_for_bytes(mapped0 - RESIZE_BYTES)
        out: Row = {"from_slots": n0, "to_slots": target, "nvml_reason": self.vram_reason}
        free0 = self.vram.free() if self.vram is not None else None
        t0 = time.perf_counter()
        down = cache.resize(target)
        out["shrink_call_s"] = time.perf_counter() - t0
        out["shrink_to_host"], out["shrink_to_file"] = down.to_host, down.to_file
        out["shrink_phases_s"] = down.phases
        out["shrink_bytes"] = freed = mapped0 - cache.arena.mapped_bytes
        out["shrink_to_nvml_free_s"] = self._wait_free(
            lambda f: f + NVML_SLACK >= free0 + freed, t0, free0
        )
        free1 = self.vram.free() if self.vram is not None else None
        t0 = time.perf_counter()
        up = cache.resize(n0)
        out["grow_to_refilled_s"] = time.perf_counter() - t0
        out["grow_from_host"] = up.from_host
        out["refilled"] = cache.cached_experts == n0
        out["grow_bytes"] = cache.arena.mapped_bytes - (mapped0 - freed)
        free2 = self.vram.free() if self.vram is not None else None
        # the arena maps before it fills, so NVML shows the memory taken before the call returns
        out["grow_nvml_taken_bytes"] = None if free1 is None or free2 is None else free1 - free2
        self.progress("shrink during decode")
        n_tokens = min(RESIZE_DECODE_TOKENS, self.settings.decode_tokens)
        at_step = max(1, n_tokens // 3)

        def shrink() -> float:
            t = time.perf_counter()
            cache.resize(target)
            return time.perf_counter() - t

        run = self.decode_run(n_tokens, at_step, shrink)
        gaps = run["gaps_s"]
        out["during_decode"] = {
            "tokens": run["tokens"],
            "shrink_after_step": at_step,
            "shrink_s": run["action"],
            "max_gap_s": max(gaps) if gaps else None,
            "median_gap_s": stats.summary(gaps)["median"] if gaps else None,
            # the shrink runs after the forward pass of step at_step, before its token is
            # sampled: the gap from token at_step - 1 to token at_step holds it
            "gap_at_shrink_s": gaps[at_step - 1] if len(gaps) >= at_step else None,
            "gaps_s": gaps,
        }
        cache.resize(n0)
        return out

    def _wait_free(self, done: Callable[[int], bool], t0: float, base: int | None) -> float | None:
        """Seconds from ``t0`` until NVML's free memory satisfies ``done`` (within the slack)."""
        if self.vram is None or base is None:
            return None
        deadline = time.perf_counter() + NVML_WAIT_S
        while time.perf_counter() < deadline:
            free = self.vram.free()
            if free is None:
                return None
            if done(free):
                return time.perf_counter() - t0
            time.sleep(0.001)
        return None
