"""A real program growing 1 GiB at a time beside the daemon, on a GPU watched through NVML.

The device is made a 24 GiB card: a filler process holds all of it but 24 GiB before the daemon
starts. The daemon then serves the synthetic Qwen3-30B-A3B file (llama.cpp's Q4_K_M recipe,
`strata bench --synthetic qwen3-30b-a3b`; written once into the cache directory, so a bench run
in the same machine lease reuses it) with its defaults: the automatic cache size, a 1024 MiB
automatic reserve, checks every second. A second process, a real CUDA program, creates its
context and then allocates 1 GiB at a time until it holds 12 GiB; an allocation that does not fit
fails (an out-of-memory error only that process sees) and is retried 50 ms later, as a game or an
image tool would. Then it exits, and the cache grows back.

Printed (run with ``-s``): the program's steps against the time and the daemon's periods, its
failed allocations, and the cache's size as the daemon reported it every 250 ms. On an H200:

    python3 -m pytest tests/gpu/test_growing_program_nvml.py -s -p no:cacheprovider
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from strata import paths
from tests.integration.harness import StrataDaemon

pytestmark = pytest.mark.gpu

GiB, MiB = 2**30, 2**20
CARD_GIB = 24  # the card emulated
STEP_GIB, WANT_GIB = 1, 12
PERIOD_S = 1.0  # elastic_period_ms's default
WAIT_S = 300.0  # only a hang fails here

FILLER = textwrap.dedent(
    """
    import sys, time, torch
    torch.empty(1, device="cuda")  # the context first: what is left after it is what counts
    free, total = torch.cuda.mem_get_info()
    keep = int(sys.argv[1])
    x = torch.empty(max(0, free - keep), dtype=torch.uint8, device="cuda")
    print("filler", x.numel(), total, flush=True)
    time.sleep(3600)
    """
)

PROGRAM = textwrap.dedent(
    """
    import json, sys, time, torch
    step, want = int(sys.argv[1]), int(sys.argv[2])
    t0 = time.monotonic()
    def say(**kw):
        print(json.dumps({"t": round(time.monotonic() - t0, 3), **kw}), flush=True)
    torch.empty(1, device="cuda")  # its CUDA context: the first thing the daemon sees grow
    say(event="context")
    held, failed = [], 0
    while len(held) * step < want and time.monotonic() - t0 < 240:
        try:
            held.append(torch.empty(step, dtype=torch.uint8, device="cuda"))
            say(event="step", held=len(held) * step, failed=failed)
        except torch.OutOfMemoryError:
            failed += 1  # unseen by the driver's counters: only this process knows
            time.sleep(0.05)
    say(event="done", held=len(held) * step, failed=failed)
    sys.stdin.readline()  # hold until told, then exit (its context goes too)
    """
)


def test_a_program_growing_1_gib_at_a_time_gets_12_gib_on_a_24_gib_card(
    tmp_path: Path, nvml_handle: object
) -> None:
    from strata.engine.synth import ensure_synthetic

    t0 = time.monotonic()
    model = ensure_synthetic("qwen3-30b-a3b", paths.cache_dir())
    print(f"\nmodel {model} ({model.stat().st_size / GiB:.2f} GiB), ready in "
          f"{time.monotonic() - t0:.0f} s")  # fmt: skip
    procs: list[subprocess.Popen[str]] = []
    d: StrataDaemon | None = None
    try:
        filler = subprocess.Popen([sys.executable, "-c", FILLER, str(CARD_GIB * GiB)],
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        procs.append(filler)
        assert filler.stdout is not None
        words = filler.stdout.readline().split()
        assert words and words[0] == "filler", words
        print(f"filler holds {int(words[1]) / GiB:.1f} GiB of {int(words[2]) / GiB:.1f} GiB: "
              f"{CARD_GIB} GiB left, as on a {CARD_GIB} GiB card")  # fmt: skip

        args = ["--model", str(model), "--device", "cuda:0", "--vram-monitor", "nvml",
                "--idle-release-s", "0"]  # fmt: skip
        t0 = time.monotonic()
        d = StrataDaemon(tmp_path, args, wait="listening")
        d.wait_ready(900)  # a first start compiles the Triton kernels: minutes
        start = d.status()
        print(f"daemon ready in {time.monotonic() - t0:.0f} s: cache {start['cache_mib']} MiB "
              f"(core {start['core_mib']}, {start['cache_experts']} of {start['total_experts']} "
              f"experts), free {start['free_mib']} MiB, other programs {start['tenants_mib']} "
              f"MiB, room kept {start['room_kept_mib']} MiB (elastic_reserve_mib "
              f"{start['elastic_reserve_mib']})")  # fmt: skip
        trace: list[tuple[float, int, int | None, int | None, int | None]] = []
        stop = threading.Event()

        def watch() -> None:
            t = time.monotonic()
            while not stop.is_set():
                s = d.status()
                trace.append((time.monotonic() - t, s["cache_mib"], s["free_mib"],
                              s["tenants_mib"], s["room_kept_mib"]))  # fmt: skip
                time.sleep(0.25)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        program = subprocess.Popen(
            [sys.executable, "-c", PROGRAM, str(STEP_GIB * GiB), str(WANT_GIB * GiB)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        procs.append(program)
        assert program.stdout is not None and program.stdin is not None
        events = []
        deadline = time.monotonic() + WAIT_S
        while not events or events[-1]["event"] != "done":
            assert time.monotonic() < deadline, events
            events.append(json.loads(program.stdout.readline()))
        done = events[-1]
        context_t = events[0]["t"]
        print(f"\nthe program: {done['held'] / GiB:.0f} of {WANT_GIB} GiB in {done['t']:.1f} s "
              f"({(done['t'] - context_t) / PERIOD_S:.1f} periods after its context), "
              f"{done['failed']} failed allocations")  # fmt: skip
        print("  GiB held   at s   periods   failed so far")
        for e in events:
            if e["event"] == "step":
                periods = (e["t"] - context_t) / PERIOD_S
                print(f"  {e['held'] / GiB:8.0f}  {e['t']:6.1f}  {periods:8.1f}  {e['failed']:14d}")

        program.stdin.write("\n")
        program.stdin.flush()
        program.wait(60)
        exited = time.monotonic()
        back = d.wait_for(lambda s: s["cache_mib"] >= start["cache_mib"] - 64
                          and s["cache_experts"] == start["cache_experts"], WAIT_S,
                          "the cache growing back")  # fmt: skip
        regrow = time.monotonic() - exited
        stop.set()
        watcher.join(10)
        print(f"\nthe program exited: the cache back to {back['cache_mib']} MiB "
              f"({back['cache_experts']} experts) {regrow:.1f} s later "
              f"(elastic_stable_ms 5000, then the refill)")  # fmt: skip
        print("\ncache trace (every 250 ms): s, cache MiB, free MiB, other programs MiB, room")
        last = None
        for t, cache, free, tenants, room in trace:
            row = (cache, free, tenants, room)
            if row != last:
                print(f"  {t:6.2f}  {cache:6d}  {free}  {tenants}  {room}")
                last = row
        resizes = [line for line in d.log.splitlines() if "cache resized" in line]
        print(f"\n{len(resizes)} resizes; the last ones:\n" + "\n".join(resizes[-8:]))
        assert done["held"] == WANT_GIB * GiB
        assert min(c for _, c, *_ in trace) < start["cache_mib"]  # it gave
        assert back["cache_experts"] == start["cache_experts"]
    finally:
        for p in procs:
            p.kill()
        if d is not None:
            code = d.stop()
            print(d.log[-3000:])
            assert code == 0
