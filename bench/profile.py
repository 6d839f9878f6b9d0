"""Where a decode step's time goes on a GPU: a developer's tool beside ``strata bench``.

    python -m strata.bench.profile --synthetic qwen3-30b-a3b-q4k [--json OUT]

Loads the model with every expert cached (or ``--cache-mib`` of them, the rest in the host tier),
then reports:

* tokens per second through ``Engine.generate`` (greedy, as the bench's tg test) and the GPU
  time of one step (graph replays back to back, timed with CUDA events);
* a ``torch.profiler`` trace of a few steps: kernels per step, the GPU-busy share of the wall
  time, and per kernel the launches, time and achieved bandwidth (bytes each kernel must read,
  counted from the model's shapes, over its time);
* with ``--check N``: the fast path's logits against the reference path's for N steps;
* with ``--sweep``: each decode kernel alone on the model's shapes at a few block sizes (the
  router with its routing, as the step runs it), its weights rotated over more than the L2
  holds, timed as a graph of launches; ``--sweep router,head`` times only those
  (``SWEPT``); with ``--no-decode`` the sweep runs without the decode measurements before it.
  The matrices behind an RMSNorm (q/k/v, the router, the head) are timed too with the norm a
  launch of its own before a plain matvec (rows "qkv+norm", ...: ``split_norm``).

With dependent launches on (``STRATA_PDL``, ``docs/gpu-decode.md``) a launch's programs wait on
the GPU for the launch before, and the profiler counts that wait in the launch's time: the
kernels then add up to more than the wall time, and the tool says so. Roles want
``STRATA_PDL=0``.

Speeds here are diagnostics; the numbers that count come from ``strata bench``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

import torch

from strata.engine.gpu.decode import Tune
from strata.engine.kernels.pdl import pdl_on
from strata.engine.weights import RepackedWeight

log = logging.getLogger(__name__)
MiB = 2**20


def _engine(
    path: Path,
    fast: bool,
    eager: bool,
    n_ctx: int,
    chunk: int = 512,
    cache_mib: int = 10**7,
    prefetch: int | None = None,
    cpu_share: float | None = None,
) -> Any:
    from strata.engine.generate import Engine
    from strata.engine.options import EngineOptions

    ahead: dict[str, Any] = {} if prefetch is None else {"prefetch_experts": prefetch}
    if cpu_share is not None:
        ahead["cpu_share"] = cpu_share  # (else the engine's defaults)
    options = EngineOptions(
        device="cuda:0", cache_mib=cache_mib, context_length=n_ctx, fast_decode=fast,
        enforce_eager=eager, prefill_chunk_tokens=chunk, **ahead,
    )  # fmt: skip
    return Engine.load(path, options)


def _prompt(n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def decode_speed(engine: Any, n_tokens: int) -> dict[str, Any]:
    from strata.engine.params import SamplingParams

    engine.tokenizer.eog_ids = frozenset()
    prompt = _prompt(16, engine.sequences.model.shape.vocab_size)
    params = SamplingParams(max_tokens=n_tokens, temperature=0.0, seed=0)
    engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))  # warm
    runs = []
    for _ in range(3):
        engine.sequences.rewind(0)
        r = engine.generate(prompt, params)
        runs.append((len(r.tokens) - 1) / r.decode_s)
    out: dict[str, Any] = {"tok_s": runs, "tok_s_median": statistics.median(runs)}
    engine.sequences.flush_usage()
    st = engine.provider.stats
    out.update(hit_rate=st.hit_rate, prefetched=st.prefetched, prefetch_used=st.prefetch_used)
    out.update(cpu_computed=st.cpu_computed)
    dec = engine.sequences.gpu
    if dec is not None and dec.graph is not None:
        # each replay moves its position on (the in-graph advance): start low enough that 51
        # replays stay inside the context
        reps = min(50, engine.n_ctx - 18)
        dec.begin(1, 16)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dec.graph.replay()
        start.record()
        for _ in range(reps):
            dec.graph.replay()
        end.record()
        torch.cuda.synchronize()
        out["gpu_ms_per_step"] = start.elapsed_time(end) / reps
    out.update(_sampled_speed(engine, prompt, n_tokens))
    return out


def _sampled_speed(engine: Any, prompt: list[int], n_tokens: int) -> dict[str, Any]:
    """The bench's sampled decode (tok/s, after a warm-up that captures the sampler's graph)
    and the GPU time of that graph alone (replays back to back)."""
    from dataclasses import replace

    from strata.bench.strata_run import BENCH_SAMPLED

    params = replace(BENCH_SAMPLED, max_tokens=n_tokens, seed=0)
    engine.generate(prompt, replace(params, max_tokens=8))  # warm: compiles, captures
    runs = []
    for _ in range(3):
        engine.sequences.rewind(0)
        r = engine.generate(prompt, params)
        runs.append((len(r.tokens) - 1) / r.decode_s)
    out: dict[str, Any] = {"sampled_tok_s": runs, "sampled_tok_s_median": statistics.median(runs)}
    dec = engine.sequences.gpu
    if dec is not None and dec.sampled.kept:
        _, graph, _ = next(reversed(dec.sampled.kept.values()))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        out["sampler_ms_per_step"] = start.elapsed_time(end) / 50
    return out


def _matrix_bytes(w: Any) -> int:
    """What the matvec kernel reads of one dense weight: its kernel layout's bytes (a weight
    without one is multiplied by torch, not by ``_matvec_kernel``; a vector is not a matrix)."""
    return w.layout.nbytes if isinstance(w, RepackedWeight) else 0


def _dense_bytes(model: Any) -> int:
    """Bytes of every dense matrix one decode step reads: each layer's attention or DeltaNet
    projections, its router and shared expert, and the head (the embeddings: one row)."""
    total = _matrix_bytes(model.head.output)
    for blk, ffn in zip(model.attn, model.ffn, strict=True):
        parts = [getattr(blk, f.name) for f in fields(blk)] + [ffn.router]
        if ffn.shared is not None:
            parts += [ffn.shared.gate, ffn.shared.up, ffn.shared.down]
        total += sum(_matrix_bytes(w) for w in parts)
    return total


def _kernel_bytes(engine: Any) -> dict[str, float]:
    """Bytes each decode kernel family must read per step (weights only), from the shapes."""
    dec = engine.sequences.gpu
    k = dec.model.shape.routing.n_used
    layouts = dec.geometry.slot_layouts
    gate_up = k * sum(s.gate.nbytes + s.up.nbytes for s in layouts)
    down = k * sum(s.down.nbytes for s in layouts)
    return {"_matvec_kernel": _dense_bytes(dec.model), "_gate_up_kernel": gate_up,
            "_down_kernel": down}  # fmt: skip


def _kernel_times(prof: Any) -> dict[str, list[float]]:
    """Each kernel name's launches' GPU us, in the order they ran."""
    events = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        if t > 0:
            events.append((e.time_range.start, e.name, t))
    per: dict[str, list[float]] = defaultdict(list)
    for _, name, t in sorted(events):
        per[name].append(t)
    return per


def _gpu_kernels(times: dict[str, list[float]]) -> tuple[dict[str, list[float]], int, float]:
    """Per kernel name [launches, GPU us] of ``_kernel_times``, the launches, the busy us."""
    per = {name: [len(ts), sum(ts)] for name, ts in times.items()}
    return per, sum(n for n, _ in per.values()), sum(us for _, us in per.values())


def launch_roles(times: dict[str, list[float]], steps: int, n_layer: int) -> list[dict[str, Any]]:
    """The launches of a kernel that runs ``a`` times in every one of ``n_layer`` layers (and
    ``b`` more times after them) told apart by their place in the layer: role j < a is the j-th
    launch of that kernel in a layer (the matvecs of a Qwen3 layer: q/k/v, o, the router), role
    ``after i`` the i-th after the last layer (the head). us per step for each role, so a kernel
    name's sum splits into the operations it serves. Kernels that run fewer times than there are
    layers, or not the same number of times each step, are left out."""
    rows = []
    for name, ts in times.items():
        per, rest = divmod(len(ts), steps)
        if rest or per < n_layer:
            continue
        a = per // n_layer
        sums: dict[str, float] = defaultdict(float)
        for i, t in enumerate(ts):
            j = i % per
            sums[f"{j % a} of {a} a layer" if j < a * n_layer else f"after {j - a * n_layer}"] += t
        for role, us in sums.items():
            rows.append({"name": name[:80], "role": role, "us_per_step": us / steps})
    return rows


def prefill_speed(engine: Any, sizes: list[int], reps: int = 3) -> list[dict[str, Any]]:
    """tok/s of prompts of each size through ``Runner.feed`` (as the bench's pp test), and a
    profile of one: kernels per prompt and the GPU time per kernel."""
    from torch.profiler import ProfilerActivity, profile

    runner = engine.sequences
    vocab = runner.model.shape.vocab_size
    out = []
    for n in sizes:
        prompt = _prompt(n, vocab)
        runner.rewind(0)
        runner.feed(prompt)  # warm
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            runner.rewind(0)
            t0 = time.perf_counter()
            runner.feed(prompt)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        runner.rewind(0)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            runner.feed(prompt)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        per, n_kernels, busy = _gpu_kernels(_kernel_times(prof))
        top = sorted(per.items(), key=lambda kv: -kv[1][1])[:16]
        row = {
            "tokens": n,
            "chunk": runner.prefill_chunk,
            "tok_s": n / statistics.median(times),
            "ms": [t * 1e3 for t in times],
            "profiled_wall_ms": wall * 1e3,
            "kernels": n_kernels,
            "gpu_busy_ms": busy / 1e3,
            "top": [{"name": k[:80], "launches": c, "ms": us / 1e3} for k, (c, us) in top],
        }
        out.append(row)
    return out


def profile_steps(engine: Any, steps: int = 5) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    dec = engine.sequences.gpu
    runner = engine.sequences
    runner.rewind(0)
    runner.feed(_prompt(16, runner.model.shape.vocab_size))
    tok = 1
    for _ in range(3):
        tok = int(torch.argmax(runner.feed([tok])))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = int(torch.argmax(runner.feed([tok])))
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    times = _kernel_times(prof)
    per, n_kernels, busy = _gpu_kernels(times)
    nbytes = _kernel_bytes(engine) if dec is not None else {}
    shape = engine.sequences.model.shape
    # a hybrid's layers run different kernels: a launch's place in its layer says nothing there
    roles = [] if shape.recurrent else launch_roles(times, steps, shape.n_layer)
    kernels = []
    for name, (count, us) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        row = {"name": name[:80], "per_step": count / steps, "us_per_step": us / steps}
        if name in nbytes and us > 0:
            row["gb_s"] = nbytes[name] / (us / steps * 1e-6) / 1e9
        kernels.append(row)
    return {
        "steps": steps,
        "wall_ms_per_step": wall / steps * 1e3,
        "kernels_per_step": n_kernels / steps,
        "gpu_busy_ms_per_step": busy / steps / 1e3,
        "gpu_busy_share": busy / 1e6 / wall,
        "kernels": kernels,
        "roles": roles,
    }


def check(path: Path, engine: Any, n: int, n_ctx: int) -> dict[str, Any]:
    """Logits of the fast path against the reference path, for a prompt and n greedy steps."""
    ref = _engine(path, fast=False, eager=True, n_ctx=n_ctx)
    out: dict[str, Any] = {"steps": []}
    try:
        prompt = _prompt(16, engine.sequences.model.shape.vocab_size)
        a, b = ref.sequences, engine.sequences
        a.rewind(0)
        b.rewind(0)
        la, lb = a.feed(prompt), b.feed(prompt)
        tok = int(torch.argmax(la))
        for _ in range(n):
            la, lb = a.feed([tok]), b.feed([tok])
            err = float((la - lb).abs().max() / la.abs().max())
            top2 = torch.topk(la, 2).values
            out["steps"].append(
                {
                    "rel_err": err,
                    "top1_ref": int(torch.argmax(la)),
                    "top1_fast": int(torch.argmax(lb)),
                    "ref_margin": float(top2[0] - top2[1]),
                }
            )
            tok = int(torch.argmax(la))
    finally:
        ref.close()
    return out


SWEPT = ("qkv", "o", "router", "head", "gate_up", "down")


def sweep(
    engine: Any, only: frozenset[str] = frozenset(SWEPT),
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Each decode kernel family on the model's shapes (those named in ``only``), weights
    rotated past the L2; ``on_row`` hears of each row as it is measured (a sweep cut short
    by a time limit keeps what it printed)."""
    from strata.bench.split_norm import rms_norm
    from strata.engine.kernels import matvec as mv
    from strata.engine.kernels import moe

    dec = engine.sequences.gpu
    last = len(dec.layers) - 1
    lyr = dec.ops.mats[last]
    model, shape = dec.model, dec.model.shape
    rows: list[dict[str, Any]] = []
    l2 = torch.cuda.get_device_properties(0).L2_cache_size

    def copies(nbytes: int) -> int:
        return max(2, -(-4 * l2 // max(1, nbytes)))

    def timed(fn_list: list[Any], nbytes: int, label: str, **cfg: Any) -> None:
        try:
            for f in fn_list:
                f()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(4):
                    for f in fn_list:
                        f()
            g.replay()
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(5):
                g.replay()
            e.record()
            torch.cuda.synchronize()
            us = s.elapsed_time(e) * 1e3 / (5 * 4 * len(fn_list))
            row = {"kernel": label, **cfg, "us": us, "gb_s": nbytes / us / 1e3}
        except Exception as ex:  # a configuration that does not compile or fit
            row = {"kernel": label, **cfg, "error": f"{type(ex).__name__}: {ex}"[:200]}
        rows.append(row)
        if on_row is not None:
            on_row(row)

    def clone_mat(m: Any) -> Any:
        return mv.Mat(m.data.clone(), m.lay)

    x = torch.randn(shape.n_embd, device="cuda")
    head = _mat_of(model.head.output)
    # the router as the step launches it: its last program routes (scratch outputs and counts;
    # the layer's table is only read), so a cut pays for the routing's reductions across its
    # warps too
    r = shape.routing
    dev = torch.device("cuda")
    route = moe.Routing(
        dec.tables.table[: r.n_expert], torch.zeros(r.n_used, dtype=torch.int32, device=dev),
        torch.zeros(r.n_used, device=dev), torch.zeros(r.n_used, dtype=torch.int64, device=dev),
        torch.zeros(r.n_expert, dtype=torch.int32, device=dev), r.n_used, r.norm_topk,
        late=r.softmax_after_topk, ticket=torch.zeros(1, dtype=torch.int32, device=dev),
    )  # fmt: skip
    for label, mats, norm in (
        ("qkv", lyr.qkv, model.attn[dec.layers[last]].norm),
        ("o", (lyr.o,), None),
        ("router", (lyr.router,), model.ffn[dec.layers[last]].norm),
        ("head", (head,) if head is not None else None, model.head.norm),
    ):
        if label not in only or mats is None or any(m is None for m in mats):
            continue
        nbytes = sum(m.lay.nbytes for m in mats)
        sets = [[clone_mat(m) for m in mats] for _ in range(copies(nbytes))]
        xin = torch.randn(mats[0].cols, device="cuda")
        y = torch.empty(sum(m.rows for m in mats), device="cuda")
        routed = route if label == "router" else None
        extra = ROUTER_CONFIGS if routed is not None else ()
        for t in [Tune(bn, nw) for bn, nw in CONFIGS + extra] + list(MATVEC_CAPPED):
            fns = [
                (
                    lambda s=s, t=t, y=y, xin=xin, norm=norm, rt=routed: mv.matvec(
                        y, xin, s, norm, 1e-6, route=rt, **t.kw()
                    )
                )
                for s in sets
            ]
            timed(fns, nbytes, label, **asdict(t))
        if norm is not None:  # the norm a launch of its own, then the plain matvec over it
            h = torch.empty_like(xin)
            for t in [Tune(bn, nw) for bn, nw in SPLIT_CONFIGS]:
                fns = [
                    (
                        lambda s=s, t=t, y=y, xin=xin, norm=norm, h=h, rt=routed: (
                            rms_norm(xin, norm, 1e-6, h),
                            mv.matvec(y, h, s, route=rt, **t.kw()),
                        )
                    )
                    for s in sets
                ]
                timed(fns, nbytes, f"{label}+norm", **asdict(t))
    # the experts: k chosen of a layer's arena slots, rotated over layers' tables
    lay = dec.geometry.slot_layouts[-1]
    wts = torch.full((r.n_used,), 1.0 / r.n_used, device="cuda")
    act = torch.empty(r.n_used, shape.n_ff_exp, device="cuda")
    h = torch.randn(shape.n_embd, device="cuda")
    # each layer's first k experts: their slots, as route would resolve them
    table = dec.tables.table
    tables = [table[i * r.n_expert : i * r.n_expert + r.n_used] for i in range(len(dec.layers))]
    gu_bytes = r.n_used * (lay.gate.nbytes + lay.up.nbytes)
    dn_bytes = r.n_used * lay.down.nbytes
    cuts = [Tune(bn, nw) for bn, nw in CONFIGS]
    for cut in cuts + list(MOE_CAPPED):
        fns = [
            (lambda t=t, c=cut: moe.gate_up(act, h, t, dec.buf.anchor, lay.gate, lay.up,
                                            lay.up_offset, **replace(c, ept=None).kw()))
            for t in tables
        ]  # fmt: skip
        if cut.ept is None and "gate_up" in only:
            timed(fns, gu_bytes, "gate_up", **asdict(cut))
    for cut in cuts + list(MOE_CAPPED) + list(DOWN_EXPERTS):
        if "down" not in only:
            break
        fns = [
            (lambda t=t, c=cut: moe.down(x, act, t, wts, dec.buf.anchor, lay.down,
                                         lay.down_offset, **c.kw()))
            for t in tables
        ]  # fmt: skip
        timed(fns, dn_bytes, "down", **asdict(cut))
    return rows


# (rows per program, warps; None: one thread per unit of a step) tried by --sweep; the wider
# ones (16-32 rows) spread a program's fixed costs (its RMS scale, its launch share) over more
# bytes, for the small dense matrices of a decode step
CONFIGS = ((1, None), (2, None), (4, None), (8, None), (4, 4), (4, 8), (8, 4), (8, 8), (16, 4),
           (16, 8), (32, 8))  # fmt: skip
# and the matrices behind a norm with the norm a launch of its own (``split_norm``): each of
# these cuts timed as that launch and the matvec over its output (rows "qkv+norm", ...)
SPLIT_CONFIGS = ((4, 8), (8, None), (8, 8), (16, 4), (16, 8), (32, 8))
# and for the router, whose last program routes: in one warp the routing's reductions cross no
# warps (compiled for sm_90 under Triton 3.6, Qwen3-30B-A3B's router with its routing has 34
# barriers at 8 warps and 3 at 1; the matvec alone 5 and 0)
ROUTER_CONFIGS = ((1, 1), (2, 1), (4, 1), (2, 2))
# and with a register cap (``Tune.regs``): a kernel compiled to most of the register file runs
# one or two programs a multiprocessor, too few loads in flight for the memory (the H200's
# Triton 3.6 gave the experts' kernels 246-255 registers a thread before the quants were loaded
# as flat tiles: ``unit_kernels.unit_bytes``); a cap trades spills for programs
MATVEC_CAPPED = (Tune(8, None, 128), Tune(4, 8, 128), Tune(16, 8, 128))
MOE_CAPPED = (Tune(4, None, 128), Tune(4, None, 96), Tune(2, None, 128), Tune(8, None, 128))
# down's experts side by side in a step (fewer: fewer threads a program, more programs)
DOWN_EXPERTS = (Tune(4, None, None, 4), Tune(4, None, None, 2), Tune(4, None, None, 1),
                Tune(2, None, None, 2), Tune(4, 4, None, 2))  # fmt: skip


def _swept(engine: Any, only: frozenset[str]) -> list[dict[str, Any]]:
    """``sweep``'s rows, printed one a line, then the fastest cut of each kernel and each
    kernel's table cut against it (``against_table``)."""
    rows = sweep(engine, only, on_row=lambda r: print(json.dumps(r), flush=True))
    best: dict[str, dict[str, Any]] = {}
    for r in rows:
        if "us" in r and (r["kernel"] not in best or r["us"] < best[r["kernel"]]["us"]):
            best[r["kernel"]] = r
    print("best:", json.dumps(best), flush=True)
    for line in against_table(rows, len(engine.sequences.gpu.layers)):
        print(line, flush=True)
    return rows


def against_table(
    rows: list[dict[str, Any]], n_layer: int, table: dict[str, Tune] | None = None
) -> list[str]:
    """Each swept kernel's cut from the table (``decode.TUNED``; a "+norm" form by its op's)
    beside the fastest cut timed, with what a step would gain: the difference times the
    launches a step makes of it (one in each of ``n_layer`` layers; the head once). A kernel
    whose table cut was not timed says so."""
    from strata.engine.gpu.decode import TUNED

    table = TUNED if table is None else table
    out = []
    for kernel in dict.fromkeys(r["kernel"] for r in rows if "us" in r):
        timed = [r for r in rows if r["kernel"] == kernel and "us" in r]
        fast = min(timed, key=lambda r: r["us"])
        cut = table.get(kernel.split("+")[0])
        if cut is None:
            continue
        mine = [r for r in timed if _cut(r) == cut]
        if not mine:
            out.append(f"sweep: {kernel}: the table's cut {cut} was not timed; fastest "
                       f"{_cut(fast)} {fast['us']:.2f} us")  # fmt: skip
            continue
        us = min(r["us"] for r in mine)
        per_step = 1 if kernel.startswith("head") else n_layer
        out.append(f"sweep: {kernel}: the table's cut {cut} {us:.2f} us, fastest {_cut(fast)} "
                   f"{fast['us']:.2f} us ({fast['us'] / us:.2f}x, "
                   f"{per_step * (us - fast['us']):.0f} us a step)")  # fmt: skip
    return out


def _cut(row: dict[str, Any]) -> Tune:
    """The cut a sweep row timed."""
    return Tune(row["bn"], row.get("warps"), row.get("regs"), row.get("ept"))


def _mat_of(w: Any) -> Any:
    from strata.engine.kernels.matvec import Mat

    return Mat(w.data, w.layout) if hasattr(w, "layout") else None


def compiled_kernels() -> list[dict[str, Any]]:
    """Registers, spills and warps of every decode kernel compiled so far (Triton's report)."""
    from strata.engine.kernels import attention, matvec, moe, rope

    out = []
    for mod in (matvec, moe, attention, rope):
        for name in dir(mod):
            fn = getattr(mod, name)
            caches = getattr(fn, "device_caches", None)
            if not isinstance(caches, dict):
                continue
            for cache in caches.values():
                for ck in (cache[0] if isinstance(cache, tuple) else cache).values():
                    meta = getattr(ck, "metadata", None)
                    out.append({
                        "kernel": name,
                        "regs": getattr(ck, "n_regs", None),
                        "spills": getattr(ck, "n_spills", None),
                        "warps": getattr(meta, "num_warps", None),
                    })  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m strata.bench.profile", description=__doc__)
    p.add_argument("--synthetic", help="a synth preset, written on first use")
    p.add_argument("--model", type=Path, help="a GGUF file")
    p.add_argument("--tokens", type=int, default=128, help="decode tokens per timed run")
    p.add_argument("--check", type=int, default=0, help="steps compared with the reference path")
    p.add_argument("--sweep", nargs="?", const=",".join(SWEPT), metavar="KERNELS",
                   help="time each kernel (or those named, comma-separated: "
                   f"{', '.join(SWEPT)}) at a few block sizes")  # fmt: skip
    p.add_argument("--eager", action="store_true", help="no CUDA graph (enforce_eager)")
    p.add_argument("--json", type=Path, help="write everything here")
    p.add_argument("--prefill", help="prompt sizes to time and profile, e.g. 512,4096")
    p.add_argument("--chunk", default="512", help="prefill_chunk_tokens (a list: each in turn)")
    p.add_argument("--no-decode", action="store_true", help="skip the decode measurements")
    p.add_argument("--cache-mib", type=int, default=10**7, help="expert cache (default: all)")
    p.add_argument("--prefetch", type=int, help="prefetch_experts (default: the engine's)")
    p.add_argument("--cpu-share", type=float, help="cpu_share (default: the engine's)")
    args = p.parse_args(argv)
    only = frozenset(k.strip() for k in (args.sweep or "").split(",") if k.strip())
    if unknown := sorted(only - set(SWEPT)):
        p.error(f"--sweep: no kernel {', '.join(unknown)} (one of {', '.join(SWEPT)})")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.model is None:
        if args.synthetic is None:
            p.error("give --model or --synthetic")
        from strata import paths
        from strata.bench.settings import ensure_synthetic

        args.model = ensure_synthetic(args.synthetic, paths.cache_dir())
    sizes = [int(v) for v in args.prefill.split(",")] if args.prefill else []
    n_ctx = max(16 + args.tokens + 16, *sizes, 64)
    result: dict[str, Any] = {"model": str(args.model)}
    t0 = time.monotonic()
    chunks = [int(v) for v in args.chunk.split(",")]
    engine = _engine(
        args.model, True, args.eager, n_ctx, chunks[0], args.cache_mib, args.prefetch,
        args.cpu_share,
    )  # fmt: skip
    result["load_s"] = time.monotonic() - t0
    result["decode_path"] = engine.sequences.decode_path()
    result["prefill_path"] = engine.sequences.prefill_path()
    result["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / MiB
    if sizes:
        result["prefill"] = []
        for c in chunks:  # other chunk sizes on the same engine, each captured in turn
            engine.sequences.prefill_chunk = c
            dec = engine.sequences.gpu
            if dec is not None and dec.prefill is not None and not args.eager:
                dec.capture_chunks(c)
            result["prefill"] += prefill_speed(engine, sizes)
        for r in result["prefill"]:
            print(
                f"pp{r['tokens']} (chunk {r['chunk']}): {r['tok_s']:,.0f} tok/s, "
                f"{r['kernels']} kernels, GPU busy {r['gpu_busy_ms']:.1f} ms of "
                f"{r['profiled_wall_ms']:.1f} ms",
                flush=True,
            )
            for k in r["top"]:
                print(f"  {k['launches']:6.0f}x {k['ms']:9.2f} ms  {k['name']}")
    if args.no_decode:
        if only and engine.sequences.gpu is not None:
            result["sweep"] = _swept(engine, only)
        engine.close()
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        return 0
    result["speed"] = decode_speed(engine, args.tokens)
    print(json.dumps(result["speed"]), flush=True)
    if engine.sequences.gpu is not None:
        result["profile"] = profile_steps(engine)
        pr = result["profile"]
        print(
            f"kernels/step {pr['kernels_per_step']:.0f}, wall {pr['wall_ms_per_step']:.3f} ms, "
            f"GPU busy {pr['gpu_busy_ms_per_step']:.3f} ms ({pr['gpu_busy_share']:.1%})",
            flush=True,
        )
        for k in pr["kernels"][:14]:
            bw = f"{k['gb_s']:8.0f} GB/s" if "gb_s" in k else ""
            print(f"  {k['per_step']:6.1f}x {k['us_per_step']:9.1f} us {bw}  {k['name']}")
        for k in pr["roles"]:
            print(f"  {k['us_per_step']:9.1f} us  {k['name']} ({k['role']})")
        if pdl_on(torch.device("cuda")):
            print("launches overlap (PDL): a kernel's time includes its wait for the launch "
                  "before it; run with STRATA_PDL=0 for the roles", flush=True)  # fmt: skip
    try:
        result["compiled"] = compiled_kernels()
        for k in result["compiled"]:
            print("compiled:", json.dumps(k))
    except Exception as e:  # the report is a diagnostic: never fail the run for it
        print(f"compiled kernels: not readable ({type(e).__name__}: {e})")
    if args.check:
        result["check"] = check(args.model, engine, args.check, n_ctx)
        print(json.dumps(result["check"]), flush=True)
    if only and engine.sequences.gpu is not None:
        result["sweep"] = _swept(engine, only)
    engine.close()
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
