"""A program that grows in steps larger than the room, on the simulated device, through the real
daemon: as games and image tools do, it allocates a fixed step at a time, and an allocation that
does not fit fails where only the program sees it (the driver's counters show what succeeded).

Sizes: the tiny model's 48 MiB cache (core 12 MiB: a quarter), an 8 MiB automatic reserve, steps
of 10 MiB; the device leaves room for exactly one step at the start (68 MiB: 48 + 8 + 10, and
the K/V's first 2 MiB chunk). The
program wants 4 steps (40 MiB), more than the room and the first step's margin together.

What is counted is the daemon's own work (its resize decisions, from its log), never how long
anything took: the waits below only bound a hang. Run with ``-s`` for the trace.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx

from tests.integration.harness import StrataDaemon, write_simulated

CACHE_MIB, RESERVE_MIB, STEP_MIB, STEPS = 48, 8, 10, 4
KV_MIB = 2  # the K/V's first chunk, beside the cache
TOTAL_MIB = CACHE_MIB + KV_MIB + RESERVE_MIB + STEP_MIB  # room for its first step
# the controller's line for a new size: the cache's slots, or the budget it shares with the K/V
DECIDED = r"(?:resize to \d+ slots|budget \d+ MiB)"
PID = 4242
WAIT_S = 120.0  # only a hang fails here


def test_a_program_growing_in_steps_larger_than_the_room_gets_them_and_the_cache_grows_back(
    tiny_model: Path, tmp_path: Path, daemons: list[StrataDaemon]
) -> None:
    device = tmp_path / "device.json"
    write_simulated(device, TOTAL_MIB)
    args = [
        "--model", str(tiny_model), "--device", "cpu", "--vram-monitor", "simulated",
        "--simulated-vram-file", str(device), "--cache-mib", str(CACHE_MIB),
        "--elastic-reserve-mib", str(RESERVE_MIB), "--arena-chunk-mib", "2",
        "--elastic-period-ms", "200", "--elastic-stable-ms", "1000",
        "--elastic-shrink-step-mib", "32", "--idle-release-s", "0",
    ]  # fmt: skip
    d = StrataDaemon(tmp_path, args)
    daemons.append(d)
    start = d.wait_for(lambda s: s["free_mib"] is not None, WAIT_S, "the first check")
    assert start["cache_mib"] == CACHE_MIB and start["free_mib"] == RESERVE_MIB + STEP_MIB
    assert start["core_mib"] == 12

    held, failed, trace = 0, 0, []
    deadline = time.monotonic() + WAIT_S
    with httpx.Client(base_url=d.url, timeout=10) as http:
        while held < STEPS * STEP_MIB:
            assert time.monotonic() < deadline, f"{held} MiB after {WAIT_S} s: {trace[-5:]}"
            s = http.get("/v1/vram").json()
            # what a driver would say: the cache as mapped now, the program's own memory
            free = TOTAL_MIB - held - s["cache_mib"] - s["kv_mib"]
            if free >= STEP_MIB:
                held += STEP_MIB
                write_simulated(device, TOTAL_MIB, [(PID, held)])
                trace.append((len(_shrinks(d.log)), held, s["cache_mib"], failed))
            else:
                failed += 1
            time.sleep(0.02)
    shrinks = _shrinks(d.log)
    print(
        f"\n{STEPS} steps of {STEP_MIB} MiB against a {RESERVE_MIB} MiB room: "
        f"{len(shrinks)} shrinks (one per period at most), {failed} failed allocations"
    )
    print("shrinks before  held MiB  cache MiB  failed so far")
    for row in trace:
        print("%14d  %8d  %9d  %13d" % row)  # noqa: UP031
    # every step after the first needed the cache to give: one decision each, give or take the
    # step that catches up with the room kept ahead
    assert len(shrinks) <= STEPS + 1, shrinks
    assert all(reason == "tenant" for reason in shrinks)
    assert "ahead" in d.log  # the room kept ahead of it, in the decisions' explanations

    # It stops growing: the cache holds still (its room kept ahead fades), then the program
    # exits and the cache grows back to the whole expert set.
    write_simulated(device, TOTAL_MIB)
    d.wait_for(lambda s: s["cache_mib"] == CACHE_MIB and s["cache_experts"] == 32, WAIT_S,
               "the cache growing back")  # fmt: skip
    assert re.search(r"grow \d+ -> \d+ MiB \(the room lasted 1 s\)", d.log), d.log[-3000:]


def _shrinks(log: str) -> list[str]:
    """The reasons of the daemon's resize decisions that shrank the cache, in order."""
    out = []
    for m in re.finditer(DECIDED + r" \((\w+), \w[\w ]*\): .*?shrink (\d+) -> (\d+)", log):
        out.append(m.group(1))
    return out


def test_idle_release_gives_all_but_the_core_and_the_next_request_grows_it_back(
    tiny_model: Path, tmp_path: Path, daemons: list[StrataDaemon]
) -> None:
    device = tmp_path / "device.json"
    write_simulated(device, 600)
    args = [
        "--model", str(tiny_model), "--device", "cpu", "--vram-monitor", "simulated",
        "--simulated-vram-file", str(device), "--cache-mib", str(CACHE_MIB),
        "--arena-chunk-mib", "2", "--elastic-period-ms", "100", "--elastic-stable-ms", "500",
        "--elastic-reserve-mib", str(RESERVE_MIB), "--idle-release-s", "1",
    ]  # fmt: skip
    d = StrataDaemon(tmp_path, args)
    daemons.append(d)
    idle = d.wait_for(lambda s: s["cache_mib"] == s["core_mib"], WAIT_S, "the idle release")
    assert idle["core_mib"] == 12 and "(idle, period)" in d.log
    assert "no request for 1 s or more" in d.log
    r = httpx.post(d.url + "/v1/completions", timeout=WAIT_S,
                   json={"model": tiny_model.stem, "prompt": "Once", "max_tokens": 4})  # fmt: skip
    assert r.status_code == 200, r.text
    # the request's own check grew it back, at once: the room had lasted through the idle time
    assert re.search(DECIDED + r" \(room, request\)", d.log), d.log[-3000:]
    back = d.wait_for(lambda s: s["cache_experts"] == 32, WAIT_S, "the refill")
    assert back["cache_mib"] == CACHE_MIB
