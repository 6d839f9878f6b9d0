"""Feral GameMode on the session bus: hold ``gamemode_reserve_mib`` free while a game is registered.

GameMode (``com.feralinteractive.GameMode`` at ``/com/feralinteractive/GameMode``, interface
``com.feralinteractive.GameMode``) emits ``GameRegistered(i pid, o game)`` and
``GameUnregistered(i pid, o game)`` and answers ``ListGames() → a(io)``. The watcher mirrors the
set of registered PIDs: the signals add and remove, and ``ListGames`` replaces the set whenever the
name gets an owner (at start, or when gamemoded starts later). The bus delivers one sender's
signals and replies in order, so a ``ListGames`` reply already reflects every signal before it.

The hold itself lives in the daemon's lease book (``Daemon.set_hold("gamemode", mib | None)``) and
shows in ``status()["holds"]``; this module only translates.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from dbus_fast import DBusError, Message, MessageType
from dbus_fast.aio import MessageBus

from strata.ipc.bus import DBUS_NAME, bus_call, name_owner_match

if TYPE_CHECKING:
    from strata.daemon.service import Daemon
    from strata.ipc.dbus import DbusEdge

log = logging.getLogger(__name__)

GAMEMODE_NAME = "com.feralinteractive.GameMode"
GAMEMODE_PATH = "/com/feralinteractive/GameMode"
GAMEMODE_INTERFACE = "com.feralinteractive.GameMode"
HOLD_SOURCE = "gamemode"
CALL_TIMEOUT_S = 5.0

_SIGNALS_MATCH = (
    f"type='signal',sender='{GAMEMODE_NAME}',path='{GAMEMODE_PATH}',"
    f"interface='{GAMEMODE_INTERFACE}'"
)


class GameModeWatcher:
    def __init__(self, daemon: Daemon, bus: MessageBus, mib: int) -> None:
        self.daemon = daemon
        self.bus = bus
        self.mib = mib
        self.games: set[int] = set()  # GameMode's registered PIDs, as it last told us
        self._owner: str | None = None  # GameMode's unique name while it is on the bus
        self._held: int | None = None
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    async def start(self) -> None:
        self.bus.add_message_handler(self._on_message)
        for rule in (_SIGNALS_MATCH, name_owner_match(GAMEMODE_NAME)):
            await bus_call(self.bus, "AddMatch", "s", [rule])
        try:
            (owner,) = await bus_call(self.bus, "GetNameOwner", "s", [GAMEMODE_NAME])
        except DBusError:
            log.info("GameMode is not running; watching for it (hold: %d MiB)", self.mib)
            if self._owner is not None or self.games:  # it was, on the connection before
                self._vanished()
            return
        self._appeared(owner)

    async def rebind(self, bus: MessageBus) -> None:
        """Follow GameMode on a new connection (the edge lost the old one). The hold stays as it
        was until GameMode, or its absence, says otherwise."""
        with contextlib.suppress(ValueError):
            self.bus.remove_message_handler(self._on_message)
        self.bus = bus
        self._owner = None
        await self.start()

    async def close(self) -> None:
        self._closed = True
        with contextlib.suppress(ValueError):
            self.bus.remove_message_handler(self._on_message)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=1.0)

    # -- GameMode's messages --------------------------------------------------------------------

    def _on_message(self, msg: Message) -> None:
        if msg.message_type != MessageType.SIGNAL or self._closed:
            return None
        if msg.member == "NameOwnerChanged" and msg.sender == DBUS_NAME:
            name, _old, new = msg.body
            if name == GAMEMODE_NAME and new:
                self._appeared(new)
            elif name == GAMEMODE_NAME:
                self._vanished()
        elif (
            msg.interface == GAMEMODE_INTERFACE
            and msg.path == GAMEMODE_PATH
            and msg.sender is not None
            and msg.sender == self._owner
            and msg.member in ("GameRegistered", "GameUnregistered")
            and msg.signature.startswith("i")
        ):
            pid = int(msg.body[0])
            if msg.member == "GameRegistered":
                self.games.add(pid)
            else:
                self.games.discard(pid)
            # one line per process at debug: `gamemoderun sh -c …` registers dozens of them;
            # the hold's summary line (below) is the one at info
            log.debug("GameMode: game %d %s", pid, msg.member[4:].lower())
            self._sync()
        return None

    def _appeared(self, owner: str) -> None:
        self._owner = owner
        log.info("GameMode is on the bus (%s): asking for its games", owner)
        self._spawn(self._list_games(owner))

    def _vanished(self) -> None:
        log.info("GameMode left the bus")
        self._owner = None
        self.games.clear()
        self._sync()

    async def _list_games(self, owner: str) -> None:
        try:
            (games,) = await asyncio.wait_for(
                bus_call(
                    self.bus, "ListGames", destination=owner, path=GAMEMODE_PATH,
                    interface=GAMEMODE_INTERFACE,
                ),
                CALL_TIMEOUT_S,
            )  # fmt: skip
        except Exception as e:  # an error reply, no reply, or the connection gone
            log.warning("GameMode's ListGames failed (%s): keeping what its signals said", e)
            return
        if owner != self._owner:
            return  # it left (or was replaced) meanwhile
        self.games = {int(pid) for pid, _path in games}
        self._sync()

    # -- the hold -------------------------------------------------------------------------------

    def _sync(self) -> None:
        self._spawn(self._apply())

    async def _apply(self) -> None:
        async with self._lock:  # one set_hold at a time, each with the newest wish
            want = self.mib if self.games else None
            if want == self._held:
                return
            self._held = want
            if want is None:
                log.info("GameMode reports no game: dropping the %d MiB hold", self.mib)
            else:
                log.info("GameMode reports %s: holding %d MiB", _games(self.games), want)
            try:
                await self.daemon.set_hold(HOLD_SOURCE, want)
            except Exception:
                log.exception("cannot set the GameMode hold")

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _games(pids: set[int], shown: int = 5) -> str:
    """``"3 games (pids 10, 11, 12)"``, the first ``shown`` PIDs named, the rest counted."""
    ordered = sorted(pids)
    named = ", ".join(str(pid) for pid in ordered[:shown])
    more = f", … {len(ordered) - shown} more" if len(ordered) > shown else ""
    noun = "game" if len(ordered) == 1 else "games"
    return f"{len(ordered)} {noun} (pid {named}{more})"


async def start_gamemode(daemon: Daemon, edge: DbusEdge | None, mib: int) -> GameModeWatcher | None:
    """Follow GameMode on the edge's bus; None (after one warning) when there is no bus."""
    if edge is None:
        log.warning("gamemode_reserve_mib is set but there is no session bus: GameMode is ignored")
        return None
    watcher = GameModeWatcher(daemon, edge.bus, mib)
    await watcher.start()
    edge.on_attach.append(watcher.rebind)
    return watcher
