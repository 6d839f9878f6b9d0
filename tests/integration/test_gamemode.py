"""Feral GameMode: while it reports a registered game, Strata holds ``gamemode_reserve_mib`` free.

A stand-in ``com.feralinteractive.GameMode`` (``dbus_clients.py gamemode``: ListGames,
RegisterGame, UnregisterGame and the GameRegistered/GameUnregistered signals, as gamemoded has
them) runs on the private bus, started before Strata or after it. Sizes as in test_dbus: 488 MiB
free with the 48 MiB cache full; a 512 MiB hold makes the cache shrink to its 24 MiB core.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.helpers import require_tool
from tests.integration.harness import (
    ClientProcess,
    PrivateBus,
    StrataDaemon,
    bus_env,
    daemon_env,
    simulated_device_args,
    write_simulated,
)

HOLD = 512
GAMEMODE = ("com.feralinteractive.GameMode", "/com/feralinteractive/GameMode")


def start(tmp: Path, bus: PrivateBus, model: Path, daemons: list[StrataDaemon]) -> StrataDaemon:
    write_simulated(tmp / "device.json", 602, [(4242, 64)])  # 2 MiB: the K/V's first chunk
    args = [*simulated_device_args(tmp / "device.json", model), "--gamemode-reserve-mib", str(HOLD)]
    d = StrataDaemon(tmp, args, env=bus_env(bus))
    daemons.append(d)
    return d


def gamemode_call(bus: PrivateBus, tmp: Path, method: str, pid: int) -> None:
    """What a game's libgamemode does: RegisterGame/UnregisterGame(pid) on GameMode."""
    gdbus = require_tool("gdbus")
    name, path = GAMEMODE
    r = subprocess.run(
        [gdbus, "call", "--session", "--dest", name, "--object-path", path, "--method",
         f"{name}.{method}", str(pid)],
        env=daemon_env(tmp, bus_env(bus)), capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "(0,)", r.stdout + r.stderr


# generous waits (they return as soon as the state holds): a loaded CI machine is slow
def held(d: StrataDaemon, timeout: float = 60) -> None:
    status = d.wait_for(lambda s: s["holds"] == {"gamemode": HOLD}, timeout, "the GameMode hold")
    d.wait_for(lambda s: s["cache_mib"] == 24 and s["free_mib"] >= HOLD, timeout, "the room")
    assert status["reserve_mib"] == 0  # a hold, not the run-time reserve


def released(d: StrataDaemon, timeout: float = 60) -> None:
    d.wait_for(lambda s: s["holds"] == {}, timeout, "no GameMode hold")
    d.wait_for(lambda s: s["cache_mib"] == 48, timeout, "the cache grown back")


def test_gamemode_running_before_strata_is_asked_for_its_games_and_followed(
    tmp_path: Path, bus: PrivateBus, tiny_model: Path, daemons: list[StrataDaemon]
) -> None:
    gamemode = ClientProcess.program(bus, tmp_path, "gamemode", "1111")  # one game running
    try:
        assert gamemode.line() == "ready"
        d = start(tmp_path, bus, tiny_model, daemons)
        held(d)  # from ListGames at start
        gamemode_call(bus, tmp_path, "RegisterGame", 2222)
        gamemode_call(bus, tmp_path, "UnregisterGame", 1111)
        held(d)  # 2222 still runs
        gamemode_call(bus, tmp_path, "UnregisterGame", 2222)
        released(d)
        gamemode_call(bus, tmp_path, "RegisterGame", 3333)
        held(d)
    finally:
        gamemode.close()
    released(d)  # GameMode left the bus: its games with it
    assert "GameMode left the bus" in d.log


def test_gamemode_started_after_strata_is_noticed(
    tmp_path: Path, bus: PrivateBus, tiny_model: Path, daemons: list[StrataDaemon]
) -> None:
    d = start(tmp_path, bus, tiny_model, daemons)
    assert d.status()["holds"] == {}
    gamemode = ClientProcess.program(bus, tmp_path, "gamemode", "1111")
    try:
        assert gamemode.line() == "ready"
        held(d)  # ListGames when the name appeared
        gamemode_call(bus, tmp_path, "UnregisterGame", 1111)
        released(d)
    finally:
        gamemode.close()
    # and again, with no game at first
    gamemode = ClientProcess.program(bus, tmp_path, "gamemode")
    try:
        assert gamemode.line() == "ready"
        gamemode_call(bus, tmp_path, "RegisterGame", 4444)
        held(d)
    finally:
        gamemode.close()
    released(d)
