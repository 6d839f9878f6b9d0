"""A lost session bus connection is found again: the name re-owned, the status saying D-Bus was
down in between, the leases whose holders left meanwhile returned and the others kept.

Two ways to lose it. The bus daemon killed and a new one started at the same address (the real
daemon as a subprocess): every unique name of the old bus is gone, so is every lease held over
it. Strata's own connection dropped while the bus lives (the daemon's objects in-process, no
model: the reconnection is held until the test has made a holder leave): the holder still there
keeps its lease and is watched again, the one that left has its lease returned.

Every wait polls with a generous timeout; nothing here depends on how fast Strata reconnects or
on the order of the events in between.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from strata.daemon.config import StrataConfig
from strata.daemon.service import build
from strata.ipc import dbus as edge_module
from strata.ipc.dbus import BUS_NAME, start_dbus
from tests.integration.harness import (
    BusClient,
    ClientProcess,
    PrivateBus,
    StrataDaemon,
    simulated_device_args,
    write_simulated,
)

TIMEOUT_S = 120.0


def _config(tmp: Path) -> StrataConfig:
    """No model (nothing is loaded), a simulated device with room for the leases: without a
    device to borrow from, a Borrow would be refused."""
    device = tmp / "device.json"
    write_simulated(device, 4096)
    return StrataConfig(device="cpu", vram_monitor="simulated", simulated_vram_file=device)


def test_a_bus_killed_and_started_again_finds_strata_back_without_the_old_leases(
    tmp_path: Path, tiny_model: Path, daemons: list[StrataDaemon]
) -> None:
    socket = tmp_path / "bus.socket"
    address = f"unix:path={socket}"  # as systemd's user bus: no guid, the same after a restart
    first = PrivateBus(tmp_path / "bus1", socket_path=socket)
    device = tmp_path / "device.json"  # a device to borrow from (without one, Borrow is refused)
    write_simulated(device, 600)
    d = StrataDaemon(tmp_path, simulated_device_args(device, tiny_model),
                     env={"DBUS_SESSION_BUS_ADDRESS": address})  # fmt: skip
    daemons.append(d)
    assert d.status()["dbus"] == {"state": "up", "problem": None, "reconnects": 0}
    borrower = ClientProcess.program(first, tmp_path, "borrower", "8")
    second: PrivateBus | None = None
    try:
        assert borrower.line() == "calling"
        cookie = int(borrower.line().split()[1])
        assert [lease["cookie"] for lease in d.status()["leases"]] == [cookie]

        first.kill()
        down = d.wait_for(lambda s: s["dbus"]["state"] == "down", TIMEOUT_S, "D-Bus down")
        assert "lost the session bus" in down["dbus"]["problem"]
        metrics = httpx.get(d.url + "/metrics", timeout=5).text
        assert "strata_dbus_up 0.0" in metrics
        assert d.status()["state"] == "ready"  # HTTP serves on
        # no bus, no news: whether the holder is still there cannot be known yet
        assert [lease["cookie"] for lease in d.status()["leases"]] == [cookie]

        second = PrivateBus(tmp_path / "bus2", socket_path=socket)
        up = d.wait_for(lambda s: s["dbus"]["state"] == "up", TIMEOUT_S, "D-Bus up again")
        assert up["dbus"] == {"state": "up", "problem": None, "reconnects": 1}
        assert up["leases"] == []  # a new bus: the old holder's name is gone
        metrics = httpx.get(d.url + "/metrics", timeout=5).text
        assert "strata_dbus_up 1.0" in metrics and "strata_dbus_reconnects_total 1.0" in metrics

        async def on_the_new_bus() -> dict[str, Any]:
            assert second is not None
            c = await BusClient.connect(second.address)
            try:
                assert await c.dbus("NameHasOwner", "s", [BUS_NAME]) == [True]
                assert await c.prop("State") == "ready"
                return await c.status()
            finally:
                c.close()

        over_dbus = asyncio.run(on_the_new_bus())
        assert over_dbus["dbus"]["state"] == "up" and over_dbus["leases"] == []
        assert "Traceback" not in d.log
        assert f"lease {cookie} returned: its owner" in d.log
    finally:
        borrower.close()
        if second is not None:
            second.close()
        first.close()


async def _until(what: str, check: Callable[[], Awaitable[bool] | bool]) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TIMEOUT_S
    while True:
        result = check()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return
        assert loop.time() < deadline, f"{what} not reached in {TIMEOUT_S} s"
        await asyncio.sleep(0.02)


def test_a_dropped_connection_on_a_living_bus_keeps_the_leases_of_holders_still_there(
    bus: PrivateBus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", bus.address)
    gate = asyncio.Event()
    real_connect = edge_module.connect_session_bus

    async def held_connect(*args: Any, **kw: Any) -> Any:
        await gate.wait()  # the test says when Strata may come back
        return await real_connect(*args, **kw)

    monkeypatch.setattr(edge_module, "reconnect_delay_s", lambda attempt: 0.0)

    async def scenario() -> None:
        daemon, close_monitor = build(_config(tmp_path))
        edge = await start_dbus(daemon)
        assert edge is not None and daemon.dbus.state == "up"
        monkeypatch.setattr(edge_module, "connect_session_bus", held_connect)  # from now on
        stays, leaves = await BusClient.connect(bus.address), await BusClient.connect(bus.address)
        try:
            (kept,) = await stays.strata("Borrow", "tss", [10, "org.example.Stays", "test"])
            (gone,) = await leaves.strata("Borrow", "tss", [20, "org.example.Leaves", "test"])
            leaving = leaves.bus.unique_name

            edge.bus.disconnect()  # Strata's own connection ends; the bus and the clients stay
            await _until("D-Bus down", lambda: daemon.dbus.state == "down")
            leaves.close()

            async def left() -> bool:
                return await stays.dbus("NameHasOwner", "s", [leaving]) == [False]

            await _until("the second holder gone from the bus", left)
            assert {lease["cookie"] for lease in daemon.status()["leases"]} == {kept, gone}

            gate.set()
            await _until("D-Bus up again", lambda: daemon.dbus.state == "up")
            assert daemon.dbus.reconnects == 1
            assert [lease["cookie"] for lease in daemon.status()["leases"]] == [kept]
            status = await stays.status()  # served on the new connection
            assert [lease["cookie"] for lease in status["leases"]] == [kept]

            n = len(stays.signals)
            await stays.strata("Return", "u", [kept])  # still its own lease
            await stays.wait_signal("LeaseReturned", lambda b: b == [kept, "returned"], start=n)
            assert daemon.status()["leases"] == []
        finally:
            stays.close()
            await edge.close()
            close_monitor()

    asyncio.run(scenario())


def test_a_holder_leaving_after_the_reconnection_is_still_watched(
    bus: PrivateBus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", bus.address)
    monkeypatch.setattr(edge_module, "reconnect_delay_s", lambda attempt: 0.0)

    async def scenario() -> None:
        daemon, close_monitor = build(_config(tmp_path))
        edge = await start_dbus(daemon)
        assert edge is not None
        holder, watcher = await BusClient.connect(bus.address), await BusClient.connect(bus.address)
        try:
            (cookie,) = await holder.strata("Borrow", "tss", [10, "org.example.App", "test"])
            edge.bus.disconnect()
            await _until("D-Bus back", lambda: daemon.dbus.reconnects == 1)
            assert daemon.dbus.state == "up"
            assert [lease["cookie"] for lease in daemon.status()["leases"]] == [cookie]
            n = len(watcher.signals)
            holder.close()
            await watcher.wait_signal(
                "LeaseReturned", lambda b: b == [cookie, "vanished"], timeout=TIMEOUT_S, start=n
            )
            assert daemon.status()["leases"] == []
        finally:
            watcher.close()
            await edge.close()
            close_monitor()

    asyncio.run(scenario())


def test_the_gamemode_hold_follows_gamemode_onto_the_new_connection(
    bus: PrivateBus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from strata.ipc.gamemode import GAMEMODE_NAME, start_gamemode

    monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", bus.address)
    monkeypatch.setattr(edge_module, "reconnect_delay_s", lambda attempt: 0.0)
    gate = asyncio.Event()
    real_connect = edge_module.connect_session_bus

    async def held_connect(*args: Any, **kw: Any) -> Any:
        await gate.wait()
        return await real_connect(*args, **kw)

    gamemode = ClientProcess.program(bus, tmp_path, "gamemode", "4242")  # a game registered

    async def scenario() -> None:
        daemon, close_monitor = build(_config(tmp_path))
        edge = await start_dbus(daemon)
        assert edge is not None
        watcher = await start_gamemode(daemon, edge, 512)
        assert watcher is not None
        observer = await BusClient.connect(bus.address)
        try:
            await _until("the hold", lambda: daemon.status()["holds"] == {"gamemode": 512})
            monkeypatch.setattr(edge_module, "connect_session_bus", held_connect)
            edge.bus.disconnect()
            await _until("D-Bus down", lambda: daemon.dbus.state == "down")
            gamemode.kill()  # GameMode goes while Strata cannot hear it go

            async def gone() -> bool:
                return await observer.dbus("NameHasOwner", "s", [GAMEMODE_NAME]) == [False]

            await _until("GameMode gone from the bus", gone)
            assert daemon.status()["holds"] == {"gamemode": 512}  # nothing said otherwise yet
            gate.set()
            await _until("D-Bus up again", lambda: daemon.dbus.state == "up")
            await _until("the hold dropped", lambda: daemon.status()["holds"] == {})
        finally:
            observer.close()
            await watcher.close()
            await edge.close()
            close_monitor()

    try:
        assert gamemode.line() == "ready"
        asyncio.run(scenario())
    finally:
        gamemode.close()
