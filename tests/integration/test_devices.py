"""Two simulated devices (issue 21): the real daemon with its model's layers split over two
"devices" (both computing on the CPU, each watched through its own simulated VRAM file), on a
private bus, steered with strata-ctl, D-Bus and HTTP.

Each stage has its own cache, monitor, reserve and leases: a lease on device 1 shrinks only stage
1's cache, a reserve on device 0 leaves device 1 alone, a program growing on device 1 takes only
from stage 1, and the status lists both devices (its old keys describing device 0). Sizes are read
from the status rather than assumed; every wait polls with a generous timeout.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from dbus_fast import DBusError

from tests.integration.harness import (
    BusClient,
    PrivateBus,
    StrataDaemon,
    bus_env,
    daemon_env,
    strata_ctl,
    write_simulated,
)

TOTAL_MIB = 300  # each simulated device


def split_args(tmp: Path, model: Path) -> list[str]:
    """Two stages of two layers each, on two simulated devices of TOTAL_MIB each."""
    files = [tmp / "gpu0.json", tmp / "gpu1.json"]
    for f in files:
        write_simulated(f, TOTAL_MIB)
    return [
        "--model", str(model), "--devices", "cpu,cpu", "--layer-split", "2,2",
        "--vram-monitor", "simulated", "--simulated-vram-files", ",".join(map(str, files)),
        "--cache-mib", "48", "--elastic-tail-mib", "24", "--elastic-reserve-mib", "0",
        "--arena-chunk-mib", "2", "--elastic-stable-ms", "500", "--elastic-period-ms", "100",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def shared(
    module_bus: PrivateBus, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StrataDaemon]:
    tmp = tmp_path_factory.mktemp("strata")
    d = StrataDaemon(tmp, split_args(tmp, tiny_model), env=bus_env(module_bus))
    yield d
    d.stop()


def settled(s: dict[str, Any]) -> bool:
    """No lease, no reserve, no tenant: each cache back at its largest."""
    return s["state"] == "ready" and all(
        d["leases"] == [] and d["reserve_mib"] == 0 and d["cache_mib"] >= d["max_cache_mib"]
        for d in s["devices"]
    )


@pytest.fixture
def strata(shared: StrataDaemon, logs_on_failure: list[StrataDaemon]) -> StrataDaemon:
    """The module's daemon as an earlier test left it once it has settled; its log on failure."""
    logs_on_failure.append(shared)
    write_simulated(shared.tmp / "gpu0.json", TOTAL_MIB)
    write_simulated(shared.tmp / "gpu1.json", TOTAL_MIB)
    shared.wait_for(settled, 60, "both caches back at their largest")
    return shared


@pytest.fixture
def env(module_bus: PrivateBus, tmp_path: Path) -> dict[str, str]:
    return daemon_env(tmp_path, bus_env(module_bus))


def test_the_status_lists_both_devices_and_its_old_keys_are_device_0s(
    strata: StrataDaemon, env: dict[str, str], module_bus: PrivateBus
) -> None:
    s = strata.status()
    first, second = s["devices"]
    assert [d["index"] for d in s["devices"]] == [0, 1]
    assert [d["compute_device"] for d in s["devices"]] == ["cpu", "cpu"]
    assert [(d["first_layer"], d["layers"]) for d in s["devices"]] == [(0, 2), (2, 2)]
    assert all(
        d["monitor"]["kind"] == "simulated" and d["monitor"]["healthy"] for d in (first, second)
    )
    assert all(
        d["total_mib"] == TOTAL_MIB and d["cache_mib"] > d["core_mib"] for d in (first, second)
    )
    for key in ("cache_mib", "core_mib", "max_cache_mib", "free_mib", "total_mib", "reserve_mib",
                "borrowed_mib", "leases", "monitor", "vram_requests"):  # fmt: skip
        assert s[key] == first[key], key
    assert s["total_experts"] == 32 and first["max_cache_mib"] + second["max_cache_mib"] == 48

    async def over_dbus() -> None:
        c = await BusClient.connect(module_bus.address)
        assert await c.prop("Devices") == ["cpu", "cpu"]
        assert await c.prop("CacheMiB") == first["cache_mib"]
        status = await c.status()
        assert [d["layers"] for d in status["devices"]] == [2, 2]
        c.close()

    asyncio.run(over_dbus())
    r = strata_ctl("status", env=env)
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("device 1 ")]
    assert len(rows) == 1 and "cpu (simulated, monitor simulated), layers 2-3" in rows[0]
    metrics = httpx.get(strata.url + "/metrics", timeout=10).text
    for number in (0, 1):
        assert f'strata_device_cache_mib{{device="{number}",name="cpu"}}' in metrics


def test_a_lease_on_device_1_shrinks_only_stage_1s_cache(
    strata: StrataDaemon, env: dict[str, str]
) -> None:
    before = strata.status()["devices"]
    second = before[1]
    # more than is free on device 1, within what its cache's elastic part can give
    mib = second["free_mib"] + (second["cache_mib"] - second["core_mib"]) // 2
    show = f"import httpx; print(httpx.get({strata.url + '/v1/vram'!r}, timeout=30).text)"
    r = strata_ctl(
        "borrow", "--device", "1", str(mib), "--app-id", "org.example.Game", "--", sys.executable,
        "-c", show, env=env, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    during = json.loads(r.stdout)["devices"]  # while the command ran, the lease held
    assert during[1]["cache_mib"] < second["cache_mib"], "stage 1's cache gave room"
    assert during[1]["free_mib"] >= mib, "the room is free on device 1 before the command ran"
    assert [(x["app_id"], x["mib"], x["device"]) for x in during[1]["leases"]] == [
        ("org.example.Game", mib, 1)
    ]
    assert during[0]["cache_mib"] == before[0]["cache_mib"], "device 0's cache is not touched"
    assert during[0]["leases"] == [] and during[0]["borrowed_mib"] == 0
    # the lease ended with the command, and stage 1's cache grows back
    strata.wait_for(settled, 60, "the lease returned and stage 1's cache grown back")


def test_borrow_on_over_dbus_and_its_signal(strata: StrataDaemon, module_bus: PrivateBus) -> None:
    async def scenario() -> None:
        c = await BusClient.connect(module_bus.address)
        second = (await c.status())["devices"][1]
        mib = second["free_mib"] + 4
        (cookie,) = await c.strata("BorrowOn", "utss", [1, mib, "org.example.Render", "frames"])
        _, body = await c.wait_signal("CacheResizedOn", lambda b: b[0] == 1)
        assert body[2] >= mib, "free on device 1 right after the resize"
        status = await c.status()
        assert [x["cookie"] for x in status["devices"][1]["leases"]] == [cookie]
        assert "leases" not in status or status["leases"] == [], "the top level is device 0's"
        assert not any(name == "CacheResized" for _, name, _ in c.signals), "device 0 unchanged"
        await c.strata("Return", "u", [cookie])  # a cookie alone names the lease
        await c.wait_signal("LeaseReturned", lambda b: b == [cookie, "returned"])
        c.close()

    asyncio.run(scenario())


def test_a_reserve_on_device_0_leaves_device_1_alone(
    strata: StrataDaemon, env: dict[str, str]
) -> None:
    before = strata.status()["devices"]
    first = before[0]
    mib = first["free_mib"] + (first["cache_mib"] - first["core_mib"]) // 2
    r = strata_ctl("reserve", str(mib), "--device", "0", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"run-time reserve on device 0: {mib} MiB: "), r.stdout
    s = strata.status()
    assert s["reserve_mib"] == mib and s["devices"][0]["reserve_mib"] == mib
    assert s["devices"][0]["cache_mib"] < first["cache_mib"]
    assert s["devices"][0]["free_mib"] >= mib
    assert s["devices"][1]["reserve_mib"] == 0
    assert s["devices"][1]["cache_mib"] == before[1]["cache_mib"], "device 1's cache is not touched"
    r = strata_ctl("reserve", "0", "--device", "0", env=env)
    assert r.returncode == 0 and "cleared" in r.stdout, r.stderr
    # over HTTP, device 1's reserve: only stage 1 shrinks
    second = strata.wait_for(settled, 60, "device 0 grown back")["devices"][1]
    mib = second["free_mib"] + 4
    reply = httpx.post(strata.url + "/v1/vram", json={"reserve_mib": mib, "device": 1}, timeout=60)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["result"]["how"] == "room" and "device 1" in body["result"]["message"]
    assert body["devices"][1]["reserve_mib"] == mib and body["reserve_mib"] == 0
    assert body["devices"][0]["cache_mib"] == body["devices"][0]["max_cache_mib"]
    reply = httpx.post(strata.url + "/v1/vram", json={"reserve_mib": 0, "device": 1}, timeout=60)
    assert reply.status_code == 200, reply.text


def test_an_unknown_device_is_an_error_naming_it_and_the_devices_there_are(
    strata: StrataDaemon, env: dict[str, str], module_bus: PrivateBus
) -> None:
    named = "device 2: no such device; Strata runs on 2 device(s): 0 (cpu), 1 (cpu)"
    r = strata_ctl("reserve", "10", "--device", "2", env=env)
    assert r.returncode == 1 and named in r.stderr and "InvalidArgument" in r.stderr, r.stderr
    r = strata_ctl("borrow", "--device", "2", "10", "--", "true", env=env)
    assert r.returncode == 1 and named in r.stderr, r.stderr
    reply = httpx.post(strata.url + "/v1/vram", json={"reserve_mib": 10, "device": 2}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert named in error["message"] and error["param"] == "device"
    assert error["code"] == "unknown_device"
    reply = httpx.post(strata.url + "/v1/vram", json={"reserve_mib": 10, "device": -1}, timeout=30)
    assert reply.status_code == 400, reply.text
    assert "device -1: no such device" in reply.json()["error"]["message"], reply.text
    reply = httpx.post(strata.url + "/v1/vram", json={"reserve_mib": 10, "device": "1"}, timeout=30)
    assert reply.status_code == 400 and "device" in reply.json()["error"]["message"], reply.text

    async def over_dbus() -> None:
        c = await BusClient.connect(module_bus.address)
        for member, signature, body in (("BorrowOn", "utss", [7, 10, "a", "b"]),
                                        ("SetReserveOn", "ut", [7, 10])):  # fmt: skip
            with pytest.raises(DBusError) as e:
                await c.strata(member, signature, body)
            assert e.value.type == "org.strata.Error.InvalidArgument"
            assert "device 7: no such device" in e.value.text and "1 (cpu)" in e.value.text
        c.close()

    asyncio.run(over_dbus())
    s = strata.status()  # nothing was recorded
    assert all(d["reserve_mib"] == 0 and d["leases"] == [] for d in s["devices"])


def test_a_program_growing_on_device_1_takes_only_from_stage_1(strata: StrataDaemon) -> None:
    before = strata.status()["devices"]
    second = before[1]
    grow = second["free_mib"] + (second["cache_mib"] - second["core_mib"]) // 2
    write_simulated(strata.tmp / "gpu1.json", TOTAL_MIB, [(4242, grow)])
    s = strata.wait_for(
        lambda s: s["devices"][1]["cache_mib"] < second["cache_mib"], 60,
        "stage 1's cache shrunk for the program on device 1",
    )  # fmt: skip
    assert s["devices"][1]["tenants_mib"] == grow
    assert s["devices"][0]["cache_mib"] == before[0]["cache_mib"]
    assert s["devices"][0]["tenants_mib"] == 0


def test_a_split_that_does_not_add_up_stops_the_daemon_naming_it(
    tmp_path: Path, tiny_model: Path
) -> None:
    args = split_args(tmp_path, tiny_model)
    args[args.index("--layer-split") + 1] = "1,1"  # the model has 4 layers
    d = StrataDaemon(tmp_path, args, wait="listening")
    try:
        assert d.proc.wait(120) == 2, d.log
    finally:
        d.stop()
    assert "layer_split=[1, 1]" in d.log and "4 layers" in d.log, d.log
