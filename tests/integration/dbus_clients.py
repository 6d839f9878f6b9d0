"""Small D-Bus programs the integration tests run as subprocesses (on ``DBUS_SESSION_BUS_ADDRESS``).

    python dbus_clients.py borrower MIB [APP_ID]
        Borrow MIB from Strata; print "calling", then "cookie N MS" (the reply and the time it
        took) or "error NAME MESSAGE"; then hold the connection (and the lease) until killed.

    python dbus_clients.py own NAME
        Own NAME on the bus; print "ready", then hold it until killed.

    python dbus_clients.py gamemode [PID…]
        A stand-in for Feral GameMode: owns com.feralinteractive.GameMode with the PIDs already
        registered, answers ListGames/RegisterGame/UnregisterGame like gamemoded and emits
        GameRegistered/GameUnregistered; prints "ready" once it owns the name.

Run by path, so that only dbus-fast needs to be importable.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Annotated, Any

from dbus_fast import Message, MessageType, NameFlag, RequestNameReply
from dbus_fast.aio import MessageBus
from dbus_fast.annotations import DBusInt32, DBusSignature
from dbus_fast.service import ServiceInterface, dbus_method, dbus_signal

GAMEMODE_PATH = "/com/feralinteractive/GameMode"
Games = Annotated[list[list[Any]], DBusSignature("a(io)")]
Game = Annotated[list[Any], DBusSignature("io")]


def say(text: str) -> None:
    print(text, flush=True)


async def borrower(mib: int, app_id: str) -> None:
    bus = await MessageBus().connect()
    call = Message(
        destination="org.strata.Strata1",
        path="/org/strata/Strata1",
        interface="org.strata.Vram1",
        member="Borrow",
        signature="tss",
        body=[mib, app_id, "test"],
    )
    say("calling")
    started = time.perf_counter()
    reply = await bus.call(call)
    took_ms = (time.perf_counter() - started) * 1000
    if reply.message_type == MessageType.ERROR:
        say(f"error {reply.error_name} {reply.body[0]}")
    else:
        say(f"cookie {reply.body[0]} {took_ms:.2f}")
    await asyncio.Event().wait()


def _path(pid: int) -> str:
    return f"{GAMEMODE_PATH}/Games/{pid}"


class GameMode(ServiceInterface):
    def __init__(self, games: list[int]) -> None:
        super().__init__("com.feralinteractive.GameMode")
        self.games = list(games)

    @dbus_method()
    def ListGames(self) -> Games:
        return [[pid, _path(pid)] for pid in self.games]

    @dbus_method()
    def RegisterGame(self, pid: DBusInt32) -> DBusInt32:
        if pid in self.games:
            return -1
        self.games.append(pid)
        self.GameRegistered(pid)
        return 0

    @dbus_method()
    def UnregisterGame(self, pid: DBusInt32) -> DBusInt32:
        if pid not in self.games:
            return -1
        self.games.remove(pid)
        self.GameUnregistered(pid)
        return 0

    @dbus_signal()
    def GameRegistered(self, pid: int) -> Game:
        return [pid, _path(pid)]

    @dbus_signal()
    def GameUnregistered(self, pid: int) -> Game:
        return [pid, _path(pid)]


async def gamemode(games: list[int]) -> None:
    bus = await MessageBus().connect()
    bus.export(GAMEMODE_PATH, GameMode(games))
    reply = await bus.request_name("com.feralinteractive.GameMode", NameFlag.DO_NOT_QUEUE)
    if reply != RequestNameReply.PRIMARY_OWNER:
        say(f"cannot own the name: {reply}")
        sys.exit(1)
    say("ready")
    await bus.wait_for_disconnect()


async def own(name: str) -> None:
    bus = await MessageBus().connect()
    reply = await bus.request_name(name, NameFlag.DO_NOT_QUEUE)
    say("ready" if reply == RequestNameReply.PRIMARY_OWNER else f"cannot own {name}: {reply}")
    await bus.wait_for_disconnect()


def main(argv: list[str]) -> None:
    if argv[0] == "own":
        asyncio.run(own(argv[1]))
    elif argv[0] == "borrower":
        asyncio.run(borrower(int(argv[1]), argv[2] if len(argv) > 2 else "test.borrower"))
    elif argv[0] == "gamemode":
        asyncio.run(gamemode([int(a) for a in argv[1:]]))
    else:
        raise SystemExit(f"unknown program {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
