"""``strata serve`` as a subprocess: start-up, exit codes, and the cache following a simulated
device's tenants and the run-time reserve.

Sizes: the test model has 32 experts of 1.5 MiB (48 MiB in 2 MiB chunks); the simulated device
has 64 MiB and the automatic reserve is 8 MiB, so with no tenant the whole set fits.
"""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from strata.engine import synth
from tests.integration.harness import (
    StrataDaemon,
    grew_after_the_stable_time,
    wait_s,
    write_simulated,
)

TOTAL_MIB = 64
ALL_MIB = 48
CONTROL = ("--arena-chunk-mib", "2", "--elastic-reserve-mib", "8", "--elastic-period-ms", "100",
           "--elastic-stable-ms", "600")  # fmt: skip
SCALE = 3  # the times stated, three times over; every wait allows at least WAIT_FLOOR_S


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth.ensure_synthetic("tiny-qwen3moe", tmp_path_factory.mktemp("models"))


def simulated(tmp_path: Path, *tenants: tuple[int, int]) -> tuple[Path, list[str]]:
    f = tmp_path / "device.json"
    write_simulated(f, TOTAL_MIB, tenants)
    return f, ["--vram-monitor", "simulated", "--simulated-vram-file", str(f), *CONTROL]


def test_health_says_loading_then_ready_and_port_0_is_logged(
    slow_loading_model: Path, tmp_path: Path, daemons: list[StrataDaemon]
) -> None:
    d = StrataDaemon(tmp_path, ["--model", str(slow_loading_model)], wait="listening")
    daemons.append(d)
    assert d.url.startswith("http://127.0.0.1:") and not d.url.endswith(":0")
    r = httpx.get(d.url + "/health", timeout=5)
    assert r.status_code == 503 and r.json() == {"status": "loading"}
    d.wait_ready()
    r = httpx.get(d.url + "/health", timeout=5)
    assert r.status_code == 200 and r.json()["status"] == "ready"
    assert d.status()["listen"] == d.url


def test_second_instance_exits_1_naming_the_first(
    model: Path, tmp_path: Path, daemons: list[StrataDaemon]
) -> None:
    first = StrataDaemon(tmp_path, ["--model", str(model)])
    daemons.append(first)
    second = StrataDaemon(tmp_path, ["--model", str(model)], wait="none")
    assert second.proc.wait(60) == 1
    assert f"another strata serve is running (pid {first.proc.pid}" in second.log


def test_busy_port_exits_1_naming_it(model: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        d = StrataDaemon(tmp_path, ["--model", str(model), "--port", str(port)], wait="none")
        assert d.proc.wait(60) == 1
    assert f"port {port} on 127.0.0.1 is already in use" in d.log


def test_model_that_cannot_load_exits_2_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF but not really")
    d = StrataDaemon(tmp_path, ["--model", str(bad)], wait="none")
    assert d.proc.wait(60) == 2
    assert str(bad) in d.log
    assert "demo" not in d.log


def test_a_model_with_a_misaligned_tensor_never_reports_ready(tmp_path: Path) -> None:
    # it used to load, report ready and answer every request with a 500
    from tests.model.test_gguf_damage import gguf_bytes

    bad = tmp_path / "misaligned.gguf"
    bad.write_bytes(gguf_bytes([("token_embd.weight", (32,), 0, 4)]))
    d = StrataDaemon(tmp_path, ["--model", str(bad)], wait="none")
    assert d.proc.wait(60) == 2
    assert "not a multiple of the file's alignment 32" in d.log and "ready" not in d.log


def test_a_model_whose_metadata_contradicts_its_tensors_never_reports_ready(
    model: Path, tmp_path: Path
) -> None:
    # 6 experts said, 8 in the tensors: it would have failed at the first request
    from tests.model.test_gguf_damage import set_u32

    bad = tmp_path / "six-experts.gguf"
    bad.write_bytes(set_u32(model.read_bytes(), "expert_count", 6))
    d = StrataDaemon(tmp_path, ["--model", str(bad), "--device", "cpu"], wait="none")
    assert d.proc.wait(60) == 2
    assert f"{bad}: tensor blk.0.ffn_gate_inp.weight has shape (8, 256)" in d.log
    assert "ready" not in d.log and "Traceback" not in d.log


def test_bad_option_exits_2(tmp_path: Path) -> None:
    d = StrataDaemon(tmp_path, ["--elastic-period-ms", "soon"], wait="none")
    assert d.proc.wait(60) == 2
    assert "--elastic-period-ms: invalid value 'soon'" in d.log


def test_sigterm_exits_0(model: Path, tmp_path: Path, daemons: list[StrataDaemon]) -> None:
    d = StrataDaemon(tmp_path, ["--model", str(model)])
    daemons.append(d)
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(wait_s(5)) == 0  # the daemon allows itself 4 s (STOP_TIMEOUT_S)
    print(f"\nSIGTERM -> exit in {time.monotonic() - t0:.2f} s")
    assert "stopped" in d.log


def test_tenant_takes_room_cache_shrinks_then_grows_back(
    model: Path, tmp_path: Path, daemons: list[StrataDaemon]
) -> None:
    device, args = simulated(tmp_path)
    d = StrataDaemon(tmp_path, ["--model", str(model), "--cache-mib", str(ALL_MIB), *args])
    daemons.append(d)
    start = d.status()
    assert start["cache_mib"] == ALL_MIB and start["device"] == "simulated"
    core = start["core_mib"]

    t0 = time.monotonic()
    write_simulated(device, TOTAL_MIB, [(4242, 20)])  # free drops to 64-48-20 < 8
    # free_mib is the last check's (docs/status.md), cache_mib the arena now: wait for both
    s = d.wait_for(lambda s: s["cache_mib"] <= TOTAL_MIB - 20 - 8 and s["free_mib"] >= 8,
                   1.0 * SCALE, "shrink")  # fmt: skip
    shrink_s = time.monotonic() - t0
    assert s["cache_mib"] >= core and s["tenants_mib"] == 20

    t0 = time.monotonic()
    write_simulated(device, TOTAL_MIB)  # the tenant leaves
    d.wait_for(lambda s: s["cache_experts"] == 32, (0.6 + 1.0) * SCALE, "regrow and refill")
    grow_s = time.monotonic() - t0
    print(f"\nsimulated: tenant -> shrunk in {shrink_s * 1000:.0f} ms; "
          f"room back -> refilled in {grow_s * 1000:.0f} ms (stable time 600 ms)")  # fmt: skip
    assert "cache resized" in d.log
    # it grew once the room had lasted the stable time, by the daemon's own clock
    assert grew_after_the_stable_time(d.log, 0.6), d.log[-3000:]


def test_tenant_larger_than_the_tail_leaves_the_core(
    model: Path, tmp_path: Path, daemons: list[StrataDaemon]
) -> None:
    device, args = simulated(tmp_path)
    d = StrataDaemon(tmp_path, ["--model", str(model), "--cache-mib", str(ALL_MIB), *args])
    daemons.append(d)
    core = d.status()["core_mib"]
    write_simulated(device, TOTAL_MIB, [(4242, 60)])
    s = d.wait_for(lambda s: s["cache_mib"] == core, 2.0 * SCALE, "shrink to the core")
    assert s["free_mib"] == 0  # the core is never given up
    resizes = s["resizes"]
    d.wait_for(lambda s: s["resizes"] == resizes, 0, "checks that change nothing")
    assert d.status()["cache_mib"] == core


def test_reserve_over_http_answers_once_the_room_exists(
    model: Path, tmp_path: Path, daemons: list[StrataDaemon]
) -> None:
    _, args = simulated(tmp_path)
    d = StrataDaemon(tmp_path, ["--model", str(model), "--cache-mib", str(ALL_MIB), *args])
    daemons.append(d)
    t0 = time.monotonic()
    r = httpx.post(d.url + "/v1/vram", json={"reserve_mib": 30}, timeout=30)
    took = time.monotonic() - t0
    assert r.status_code == 200, r.text
    s = r.json()
    assert s["reserve_mib"] == 30 and s["free_mib"] >= 30, s
    print(f"\nreserve 30 MiB answered in {took * 1000:.0f} ms")  # a number, not a test
    assert s["result"]["how"] == "room" and "MiB are free on simulated" in s["result"]["message"]
    bad = httpx.post(d.url + "/v1/vram", json={"reserve_mib": -1}, timeout=5)
    assert bad.status_code == 400 and "reserve_mib" in bad.text
    too_big = httpx.post(d.url + "/v1/vram", json={"reserve_mib": 10_000}, timeout=5)
    assert too_big.status_code == 400 and "10000" in too_big.text
    assert d.status()["reserve_mib"] == 30  # unchanged by the rejected requests


def test_failing_monitor_keeps_a_fixed_size_cache(
    model: Path, tmp_path: Path, daemons: list[StrataDaemon]
) -> None:
    device, args = simulated(tmp_path)
    d = StrataDaemon(tmp_path, ["--model", str(model), "--cache-mib", str(ALL_MIB), *args])
    daemons.append(d)
    device.write_text('{"total_mib": 64, "failing": true}')
    d.wait_for(lambda s: not s["monitor"]["healthy"], 2.0 * SCALE, "monitor marked unhealthy")
    s = d.status()
    assert s["cache_mib"] == ALL_MIB and s["state"] == "ready" and s["vram_requests"] == "shrink"
    assert d.log.count("WARNING") >= 1 and d.proc.poll() is None
