"""Nothing silent: a VRAM request is carried out and says how, or refused saying why, through
HTTP, D-Bus and ``strata-ctl`` alike. Never a success that changed nothing.

Two daemons on one private bus's worth of clients each:

* **blind**: the simulated device reports failure (``failing: true``, as NVML failing): no monitor
  sees the device, so a request shrinks the cache by exactly its amount, and the answer says so;
  more than the cache's elastic part is refused with the numbers. 48 MiB cache, 24 MiB core.
* **cpu**: the demo set-up, computing on the CPU with no monitor and no cache: a request for more
  than 0 MiB is refused (``NoDevice``: no GPU is watched).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.harness import (
    BusClient,
    PrivateBus,
    StrataDaemon,
    bus_env,
    daemon_env,
    simulated_device_args,
    strata_ctl,
)


@pytest.fixture(scope="module")
def blind_daemon(
    module_bus: PrivateBus, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StrataDaemon]:
    tmp = tmp_path_factory.mktemp("blind")
    device = tmp / "device.json"
    device.write_text('{"total_mib": 600, "failing": true}')
    d = StrataDaemon(tmp, simulated_device_args(device, tiny_model), env=bus_env(module_bus))
    yield d
    d.stop()


@pytest.fixture(scope="module")
def cpu_daemon(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[StrataDaemon, PrivateBus]]:
    bus = PrivateBus(tmp_path_factory.mktemp("cpubus"))
    tmp = tmp_path_factory.mktemp("cpu")
    d = StrataDaemon(tmp, ["--model", str(tiny_model), "--device", "cpu"], env=bus_env(bus))
    yield d, bus
    d.stop()
    bus.close()


@pytest.fixture
def blind(blind_daemon: StrataDaemon, logs_on_failure: list[StrataDaemon]) -> StrataDaemon:
    """The blind daemon with no reserve and no lease left by an earlier test."""
    logs_on_failure.append(blind_daemon)
    httpx.post(blind_daemon.url + "/v1/vram", json={"reserve_mib": 0}, timeout=30)
    blind_daemon.wait_for(lambda s: s["leases"] == [] and s["cache_mib"] == 48, 30, "at rest")
    return blind_daemon


@pytest.fixture
def cpu(
    cpu_daemon: tuple[StrataDaemon, PrivateBus], logs_on_failure: list[StrataDaemon]
) -> tuple[StrataDaemon, PrivateBus]:
    logs_on_failure.append(cpu_daemon[0])
    return cpu_daemon


# -- HTTP ---------------------------------------------------------------------------------------


def test_http_reserve_with_a_failed_monitor_shrinks_the_cache_by_that_much_and_says_so(
    blind: StrataDaemon,
) -> None:
    s = blind.status()
    assert s["vram_requests"] == "shrink" and not s["monitor"]["healthy"]
    assert s["free_mib"] is None
    (path,) = [line for line in blind.log.splitlines() if "path: " in line]
    assert "no VRAM monitor: simulated VRAM file" in path
    assert "a request shrinks the cache by its amount" in path
    r = httpx.post(blind.url + "/v1/vram", json={"reserve_mib": 20}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["result"]["how"] == "shrink"
    message = body["result"]["message"]
    assert "the VRAM monitor failed" in message and "says the device is failing" in message
    assert "cache 48 -> 28 MiB" in message and "not checked" in message
    assert body["cache_mib"] <= 48 - 20 and body["reserve_mib"] == 20

    too_much = httpx.post(blind.url + "/v1/vram", json={"reserve_mib": 30}, timeout=30)
    assert too_much.status_code == 400, too_much.text
    err = too_much.json()["error"]
    assert err["code"] == "not_enough_vram" and err["param"] == "reserve_mib"
    assert "cannot free 30 MiB: at most 24 MiB" in err["message"]
    assert "its elastic part is 24 MiB" in err["message"]
    assert blind.status()["reserve_mib"] == 20  # the refused request changed nothing

    cleared = httpx.post(blind.url + "/v1/vram", json={"reserve_mib": 0}, timeout=30)
    assert cleared.status_code == 200 and cleared.json()["result"]["how"] == "none"
    assert blind.wait_for(lambda s: s["cache_mib"] == 48, 30, "back at once")["reserve_mib"] == 0


def test_http_reserve_without_a_gpu_is_refused_saying_why(
    cpu: tuple[StrataDaemon, PrivateBus],
) -> None:
    d, _ = cpu
    s = d.status()
    assert (s["vram_requests"], s["monitor"]["kind"], s["cache_mib"]) == ("refused", "none", 0)
    assert ("path: CPU (device = cpu); no VRAM monitor (vram_monitor none); VRAM requests are "
            "refused (no GPU)") in d.log  # fmt: skip
    r = httpx.post(d.url + "/v1/vram", json={"reserve_mib": 200}, timeout=30)
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["code"] == "no_device" and err["param"] == "reserve_mib"
    assert "cannot free 200 MiB" in err["message"] and "watches no GPU" in err["message"]
    assert d.status()["reserve_mib"] == 0
    zero = httpx.post(d.url + "/v1/vram", json={"reserve_mib": 0}, timeout=30)
    assert zero.status_code == 200 and zero.json()["result"]["how"] == "none"


# -- D-Bus --------------------------------------------------------------------------------------


def test_dbus_borrow_and_set_reserve_with_a_failed_monitor(
    blind: StrataDaemon, module_bus: PrivateBus
) -> None:
    async def scenario() -> None:
        c = await BusClient.connect(module_bus.address)
        try:
            assert await c.prop("VramRequests") == "shrink"
            (cookie,) = await c.strata("Borrow", "tss", [16, "org.example.Game", "level"])
            status = await c.status()
            assert status["cache_mib"] <= 48 - 16 and status["borrowed_mib"] == 16
            assert "free_mib" not in status  # unknown: left out, never 0
            await c.strata("SetReserve", "t", [8])  # 8 + 16 of the 24 MiB elastic part
            assert (await c.status())["cache_mib"] <= 48 - 24
            reply = await c.call("Borrow", "tss", [4, "org.example.More", "more"])
            assert reply.error_name == "org.strata.Error.NotEnoughVram", reply.body
            assert "cannot free 4 MiB: at most 0 MiB" in reply.body[0]
            await c.strata("Return", "u", [cookie])
            await c.strata("SetReserve", "t", [0])
            st = await c.wait_status(lambda s: s["cache_mib"] == 48, 30, "back at once")
            assert st["leases"] == []
        finally:
            c.close()

    asyncio.run(scenario())


def test_dbus_requests_without_a_gpu_fail_with_no_device(
    cpu: tuple[StrataDaemon, PrivateBus],
) -> None:
    _, bus = cpu

    async def scenario() -> None:
        c = await BusClient.connect(bus.address)
        try:
            assert await c.prop("VramRequests") == "refused"
            calls = [("SetReserve", "t", [4000]), ("Borrow", "tss", [4000, "org.example.G", "x"])]
            for member, sig, body in calls:
                reply = await c.call(member, sig, body)
                assert reply.error_name == "org.strata.Error.NoDevice", (member, reply.body)
                assert "watches no GPU" in reply.body[0]
            status = await c.status()
            assert status["reserve_mib"] == 0 and status["leases"] == []
            assert "hit_rate" not in status  # no cache: unknown, left out (null over HTTP)
        finally:
            c.close()

    asyncio.run(scenario())


# -- strata-ctl ---------------------------------------------------------------------------------


def test_ctl_reserve_says_how_it_was_carried_out_or_why_not(
    blind: StrataDaemon,
    module_bus: PrivateBus,
    cpu: tuple[StrataDaemon, PrivateBus],
    tmp_path: Path,
) -> None:
    env = daemon_env(tmp_path, bus_env(module_bus))
    r = strata_ctl("reserve", "20", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("run-time reserve: 20 MiB: no monitor sees the device")
    assert "cache 48 -> 28 MiB" in r.stdout and "not checked" in r.stdout
    status = strata_ctl("status", env=env)
    assert "no monitor sees the device: a request shrinks the cache" in status.stdout
    r = strata_ctl("reserve", "0", env=env)
    assert r.returncode == 0 and "cleared" in r.stdout, r.stderr

    _, cpu_bus = cpu
    cpu_env = daemon_env(tmp_path / "c", bus_env(cpu_bus))
    r = strata_ctl("reserve", "4000", env=cpu_env)
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "watches no GPU" in lines[0] and "org.strata.Error.NoDevice" in lines[0]
    table = strata_ctl("status", env=cpu_env)
    assert "refused: Strata watches no GPU and holds no VRAM" in table.stdout
    shown = json.loads(strata_ctl("status", "--json", env=cpu_env).stdout)
    assert shown["vram_requests"] == "refused" and "hit_rate" not in shown
