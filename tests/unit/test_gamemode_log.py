"""GameMode's signals as ``gamemoderun sh -c …`` sends them (one GameRegistered per process, dozens
of them): one info line for the hold, the processes at debug only."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from dbus_fast import Message, MessageType

from strata.ipc.gamemode import GAMEMODE_INTERFACE, GAMEMODE_PATH, GameModeWatcher

OWNER = ":1.42"


class _Daemon:
    def __init__(self) -> None:
        self.holds: list[tuple[str, int | None]] = []

    async def set_hold(self, source: str, mib: int | None) -> None:
        self.holds.append((source, mib))


def _signal(member: str, pid: int) -> Message:
    return Message(
        message_type=MessageType.SIGNAL, sender=OWNER, path=GAMEMODE_PATH,
        interface=GAMEMODE_INTERFACE, member=member, signature="io",
        body=[pid, f"/com/feralinteractive/GameMode/Games/{pid}"],
    )  # fmt: skip


def test_fifty_processes_of_one_game_log_one_info_line(caplog: pytest.LogCaptureFixture) -> None:
    daemon = _Daemon()

    async def scenario() -> Any:
        watcher = GameModeWatcher(daemon, None, 512)  # type: ignore[arg-type]
        watcher._owner = OWNER
        for pid in range(1000, 1050):
            watcher._on_message(_signal("GameRegistered", pid))
        while watcher._tasks:
            await asyncio.wait(set(watcher._tasks))
        for pid in range(1000, 1050):
            watcher._on_message(_signal("GameUnregistered", pid))
        while watcher._tasks:
            await asyncio.wait(set(watcher._tasks))

    with caplog.at_level(logging.DEBUG, logger="strata.ipc.gamemode"):
        asyncio.run(scenario())
    info = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert info == [
        "GameMode reports 50 games (pid 1000, 1001, 1002, 1003, 1004, … 45 more): holding 512 MiB",
        "GameMode reports no game: dropping the 512 MiB hold",
    ], info
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(debug) == 100  # each process, at debug
    assert daemon.holds == [("gamemode", 512), ("gamemode", None)]
