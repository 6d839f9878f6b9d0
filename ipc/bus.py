"""The session bus, for the daemon's D-Bus edge and for its clients (``strata-ctl``, GameMode's
watcher): finding and connecting to it, calling a method with a timeout, matching a name's
owner, guarding writes on a connection that may die, and status values as D-Bus variants (and
back)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from pathlib import Path
from typing import Any, TypeAlias

from dbus_fast import BusType, DBusError, Message, MessageType, Variant
from dbus_fast.aio import MessageBus

from strata.daemon.json_types import JSON, JSONObject

# A D-Bus value as dbus-fast reads and writes it: basic types, variants, arrays (lists),
# structs (lists or tuples) and dicts
DBusValue: TypeAlias = (
    Variant | str | int | float | bool | bytes
    | list["DBusValue"] | tuple["DBusValue", ...] | dict[str, "DBusValue"]
)  # fmt: skip

log = logging.getLogger(__name__)

DBUS_NAME = "org.freedesktop.DBus"
DBUS_PATH = "/org/freedesktop/DBus"
CONNECT_TIMEOUT_S = 5.0
RECONNECT_FIRST_S = 0.5  # the wait before the first attempt to reconnect; doubled after each
RECONNECT_MAX_S = 30.0


class NoSessionBus(Exception):
    """There is no session bus to talk to; the message says why."""


# -- the session bus, for the daemon and for clients --------------------------------------------


def session_bus_address(environ: dict[str, str] | None = None) -> str | None:
    """``DBUS_SESSION_BUS_ADDRESS``, else the systemd user bus ``$XDG_RUNTIME_DIR/bus`` when that
    socket exists (what sd-bus falls back to), else None."""
    env = os.environ if environ is None else environ
    address = env.get("DBUS_SESSION_BUS_ADDRESS", "").strip()
    if address:
        return address
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime, "bus").is_socket():
        return f"unix:path={Path(runtime, 'bus')}"
    return None


async def connect_session_bus(timeout: float = CONNECT_TIMEOUT_S) -> MessageBus:
    """A connection to the session bus, or :class:`NoSessionBus` naming the reason."""
    address = session_bus_address()
    if address is None:
        raise NoSessionBus(
            "no session bus: DBUS_SESSION_BUS_ADDRESS is unset and $XDG_RUNTIME_DIR/bus does not "
            "exist"
        )
    try:
        bus = MessageBus(bus_address=address, bus_type=BusType.SESSION)
        return await asyncio.wait_for(bus.connect(), timeout)
    except TimeoutError:
        raise NoSessionBus(
            f"the session bus at {address} did not answer in {timeout:g} s"
        ) from None
    except Exception as e:  # OSError, AuthError, InvalidAddressError: all mean "no bus"
        raise NoSessionBus(f"cannot connect to the session bus at {address}: {e}") from None


async def bus_call(
    bus: MessageBus,
    member: str,
    signature: str = "",
    body: list[DBusValue] | None = None,
    *,
    destination: str = DBUS_NAME,
    path: str = DBUS_PATH,
    interface: str = DBUS_NAME,
) -> list[DBusValue]:
    """Call a method and return the reply's body; a D-Bus error reply raises ``DBusError``, a
    bus no longer connected ``ConnectionError`` (dbus-fast would wait for its reply forever)."""
    if not bus.connected:
        raise ConnectionError(f"not connected to the bus (calling {member})")
    reply = await bus.call(
        Message(
            destination=destination,
            path=path,
            interface=interface,
            member=member,
            signature=signature,
            body=body or [],
        )
    )
    assert reply is not None
    if reply.message_type == MessageType.ERROR:
        raise DBusError._from_message(reply)
    return reply.body


def name_owner_match(name: str) -> str:
    """The match rule for ``NameOwnerChanged`` of one name."""
    return (
        f"type='signal',sender='{DBUS_NAME}',path='{DBUS_PATH}',interface='{DBUS_NAME}',"
        f"member='NameOwnerChanged',arg0='{name}'"
    )


async def describe_owner(bus: MessageBus, name: str) -> str:
    """Who owns ``name`` on ``bus``, for a message: its unique name, pid and command line (as
    much of it as the bus and /proc say)."""
    try:
        (owner,) = await bus_call(bus, "GetNameOwner", "s", [name])
    except DBusError:
        return "another connection"
    try:
        (pid,) = await bus_call(bus, "GetConnectionUnixProcessID", "s", [owner])
    except DBusError:
        return owner
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        cmd = ""
    return f"{owner} (pid {pid}{': ' + cmd if cmd else ''})"


def reconnect_delay_s(attempt: int) -> float:
    """The wait before reconnection attempt ``attempt`` (0, 1, …): 0.5 s, doubled each time, at
    most 30 s."""
    return min(RECONNECT_MAX_S, RECONNECT_FIRST_S * 2 ** min(attempt, 32))


class _GuardedSocket:
    """The socket dbus-fast's writer sends through, made safe in two ways dbus-fast is not.

    A socket buffer that is full (a large reply or signal to a slow bus) raises EAGAIN, which
    dbus-fast's writer takes for a lost connection and drops the bus (python-dbus-next#153): here
    it writes nothing, and the writer waits until the socket is writable. And once the bus has
    disconnected, what is still sent to it is dropped: dbus-fast would write to the closed
    socket's descriptor, and its error path would unregister whatever uses that number now (a
    new connection's)."""

    def __init__(self, bus: MessageBus, sock: socket.socket) -> None:
        self._bus = bus
        self._sock = sock

    def send(self, data: Any) -> int:
        if self._bus._disconnected:
            return len(data)
        try:
            return self._sock.send(data)
        except (BlockingIOError, InterruptedError):
            return 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def guard_writes(bus: MessageBus) -> None:
    """Send ``bus``'s messages through :class:`_GuardedSocket` (a connected bus)."""
    writer = getattr(bus, "_writer", None)
    sock = getattr(writer, "sock", None)
    if sock is None or isinstance(sock, _GuardedSocket):
        log.debug("dbus-fast's writer has no socket to guard: %r", writer)
        return
    writer.sock = _GuardedSocket(bus, sock)  # type: ignore[union-attr]


# -- values on the wire -------------------------------------------------------------------------


def to_variant(value: JSON) -> Variant:
    """A status value as a variant: ints are int64 ('x'), dicts a{sv}, lists of dicts aa{sv}."""
    if isinstance(value, bool):
        return Variant("b", value)
    if isinstance(value, int):
        return Variant("x", value)
    if isinstance(value, float):
        return Variant("d", value)
    if isinstance(value, str):
        return Variant("s", value)
    if isinstance(value, dict):
        return Variant("a{sv}", to_vardict(value))
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, dict) for v in value):
            return Variant("aa{sv}", [to_vardict(v) for v in value])
        if all(isinstance(v, str) for v in value):
            return Variant("as", list(value))
        return Variant("av", [to_variant(v) for v in value if v is not None])
    raise TypeError(f"no D-Bus type for {value!r}")


def to_vardict(values: JSONObject) -> dict[str, Variant]:
    """A dict as a{sv}; None (unknown) values are left out: D-Bus has no null."""
    return {str(k): to_variant(v) for k, v in values.items() if v is not None}


def from_variant(value: DBusValue) -> JSON:
    """Variants (nested) back to plain Python values."""
    if isinstance(value, Variant):
        return from_variant(value.value)
    if isinstance(value, dict):
        return {k: from_variant(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):  # arrays and structs alike: JSON has lists only
        return [from_variant(v) for v in value]
    return value
