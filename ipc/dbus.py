"""The D-Bus edge: ``org.strata.Strata1`` on the session bus (contract: ``org.strata.Strata1.xml``).

A thin translation onto the daemon API (``strata.daemon.service.Daemon``): each method parses its
arguments, calls one daemon method and maps the daemon's errors to their D-Bus names. The lease
book, the reserve and the policy live in the daemon; what this module keeps is connection
bookkeeping only: which callers' disappearance it watches, the Borrows still waiting per caller,
and the property values it last signalled (to send one batched ``PropertiesChanged`` per change).

Leases end with their owner's bus connection: the first Borrow of a connection adds a match on
``NameOwnerChanged`` for its unique name, and its disappearance returns every lease it holds
(``Daemon.owner_vanished``). A caller that leaves while its Borrow waits has that Borrow cancelled,
so no lease is left behind.

The caller's unique name reaches the method through a context variable: dbus-fast gives its
method handlers no message, but it runs user message handlers first and creates each coroutine
method's task right after, in the same context, so the task sees the value the handler set.

A lost connection is re-established: the edge waits 0.5 s, then twice as long after each failed
attempt (at most 30 s), connects again, exports the interface and owns the name once more. The
status says ``dbus.state = "down"`` in between (HTTP serves throughout). Leases survive the gap
only where their holder did: on a new bus daemon (another bus id) every old unique name is gone,
so every lease held over D-Bus is returned; on the same bus, each holder is watched again and the
leases of those no longer there are returned. A Borrow still waiting when the connection went is
cancelled (its reply could not reach the caller).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from dbus_fast import (
    DBusError,
    Message,
    MessageFlag,
    MessageType,
    NameFlag,
    RequestNameReply,
)
from dbus_fast.aio import MessageBus

from strata.daemon.bounded import Bounded
from strata.daemon.control.leases import LeaseError
from strata.daemon.json_types import JSON
from strata.ipc.bus import (
    DBUS_NAME,
    DBUS_PATH,
    RECONNECT_MAX_S,  # noqa: F401 (imported from here)
    NoSessionBus,
    bus_call,
    connect_session_bus,
    describe_owner,
    from_variant,  # noqa: F401 (imported from here)
    guard_writes,
    name_owner_match,
    reconnect_delay_s,
    session_bus_address,  # noqa: F401 (imported from here)
    to_vardict,  # noqa: F401 (imported from here)
)
from strata.ipc.dbus_interface import (
    BUS_NAME,
    CLOSE_TIMEOUT_S,
    CONTRACT,  # noqa: F401 (imported from here)
    ERROR_FAILED,
    ERROR_INVALID_ARGUMENT,
    INTERFACE,
    OBJECT_PATH,
    Vram1,
    _caller,
    _cut,
    _dbus_error,
    _in_signatures,
    _name_args,
    property_values,
)

if TYPE_CHECKING:
    from strata.daemon.service import Daemon

log = logging.getLogger(__name__)


# -- the edge -----------------------------------------------------------------------------------


class DbusEdge:
    """The daemon on the session bus. Made by :func:`start_dbus`; ``await close()`` at shutdown.
    While it runs, a lost connection is re-established (see the module doc); ``on_attach``
    coroutines (the GameMode watcher) are given each new connection."""

    def __init__(self, daemon: Daemon, bus: MessageBus) -> None:
        self.daemon = daemon
        self.bus = bus
        self.iface = Vram1(self)
        _name_args(self.iface)
        self._signatures = _in_signatures(self.iface)
        self._watched: set[str] = set()  # callers whose NameOwnerChanged we match
        self._pending: dict[str, set[asyncio.Task[int]]] = {}  # Borrows waiting, by caller
        self._signalled: dict[str, Any] = {}  # property values last sent
        self._flush_queued = False
        self._closed = False
        self._loop = asyncio.get_running_loop()
        self._supervisor: asyncio.Task[None] | None = None
        self._bus_id = ""  # the bus daemon's id: a new one means every unique name is new
        self.on_attach: list[Callable[[MessageBus], Awaitable[None]]] = []

    # -- start and stop -------------------------------------------------------------------------

    async def start(self) -> None:
        from strata.errors import EXIT_RUNTIME, ServiceError

        self.daemon.controller.listeners.append(self._on_event)
        self.daemon.worker.ready.add_done_callback(self._ready_changed)  # engine thread
        self.daemon.size_sources.append(self._sizes)
        taken = await self._attach(self.bus)
        if taken is not None:
            await self.close()
            raise ServiceError(f"{taken}; is another strata serve running in this session?",
                               EXIT_RUNTIME)  # fmt: skip
        self.daemon.dbus.state, self.daemon.dbus.problem = "up", None
        self._supervisor = asyncio.create_task(self._supervise(), name="dbus-supervisor")
        log.info("on the session bus as %s (%s)", BUS_NAME, self.bus.unique_name)

    async def _attach(self, bus: MessageBus) -> str | None:
        """Serve on ``bus``: export the interface, own the name. Returns why the name could not
        be owned (another connection has it), else None."""
        guard_writes(bus)
        self.bus = bus
        self._watched.clear()  # match rules belong to a connection
        bus.add_message_handler(self._on_message)
        self._signalled = property_values(self.daemon.status())
        bus.export(OBJECT_PATH, self.iface)
        (self._bus_id,) = await bus_call(bus, "GetId")
        reply = await bus.request_name(BUS_NAME, NameFlag.DO_NOT_QUEUE)
        if reply not in (RequestNameReply.PRIMARY_OWNER, RequestNameReply.ALREADY_OWNER):
            holder = await describe_owner(self.bus, BUS_NAME)
            return f"the D-Bus name {BUS_NAME} is already owned on the session bus by {holder}"
        return None

    async def close(self) -> None:
        """Say "stopping", release the name and disconnect. Waiting Borrows are cancelled; the
        leases end with the daemon (clients watch the name and borrow again)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(ValueError):
            self.daemon.controller.listeners.remove(self._on_event)
        with contextlib.suppress(ValueError):
            self.daemon.size_sources.remove(self._sizes)
        self._cancel_pending()
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        if self.bus.connected:
            self._flush()  # State: "stopping"
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.bus.release_name(BUS_NAME), CLOSE_TIMEOUT_S)
            self.bus.disconnect()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    asyncio.shield(self.bus.wait_for_disconnect()), CLOSE_TIMEOUT_S
                )

    def _sizes(self) -> list[Bounded]:
        return [Bounded("dbus_watched_callers", "bus connections whose leaving the D-Bus edge "
                        "watches: those with a lease or a Borrow in progress",
                        len(self._watched), None)]  # fmt: skip

    def _cancel_pending(self) -> None:
        for tasks in list(self._pending.values()):
            for task in list(tasks):
                task.cancel()

    def _ready_changed(self, _: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            self._loop.call_soon_threadsafe(self._queue_flush)

    # -- a lost connection ----------------------------------------------------------------------

    async def _supervise(self) -> None:
        """Wait for the connection to go; then reconnect, and again each time it goes."""
        try:
            while not self._closed:
                await self._follow()
        except Exception as e:  # a bug here must not end the daemon: D-Bus stays down
            log.exception("the D-Bus edge stopped reconnecting")
            self.daemon.dbus.state, self.daemon.dbus.problem = "down", f"{type(e).__name__}: {e}"

    async def _follow(self) -> None:
        """One connection's end, and the next one's start."""
        why = await self._disconnected(self.bus)
        if self._closed:
            return
        old_id, link = self._bus_id, self.daemon.dbus
        log.warning("lost the session bus (%s): D-Bus is down, HTTP still serves; reconnecting",
                    why)  # fmt: skip
        link.state, link.problem = "down", f"lost the session bus: {why}"
        self._watched.clear()
        self._cancel_pending()  # their replies could not reach the callers any more
        attempts = await self._reconnect()
        log.info("back on the session bus as %s (%s) after %d attempt(s)", BUS_NAME,
                 self.bus.unique_name, attempts)  # fmt: skip
        await self._recheck_holders(same_bus=self._bus_id == old_id)
        link.state, link.problem = "up", None  # "up": on the bus, the leases reconciled
        link.reconnects += 1
        for hook in list(self.on_attach):
            try:
                await hook(self.bus)
            except Exception as e:  # most likely the connection went again: the next round
                name = getattr(hook, "__qualname__", repr(hook))
                log.warning("setting up %s on the new connection failed: %s", name, e)
                log.debug("the error", exc_info=e)

    @staticmethod
    async def _disconnected(bus: MessageBus) -> str:
        try:
            # shielded: cancelling the supervisor must not cancel dbus-fast's own future
            await asyncio.shield(bus.wait_for_disconnect())
        except Exception as e:
            return str(e) or type(e).__name__
        return "the connection was closed"

    async def _reconnect(self) -> int:
        """Connect and serve again, waiting longer after each failed attempt; returns the number
        of attempts it took."""
        link = self.daemon.dbus
        attempt = 0
        while True:
            await asyncio.sleep(reconnect_delay_s(attempt))
            attempt += 1
            try:
                bus = await connect_session_bus()
            except NoSessionBus as e:
                problem = str(e)
            else:
                try:
                    problem = await self._attach(bus)
                except Exception as e:  # the new connection went too, or the bus refused
                    problem = f"setting up on the session bus failed: {e}"
                if problem is None:
                    return attempt
                bus.disconnect()
            if problem != link.problem:
                log.info("D-Bus still down (attempt %d): %s", attempt, problem)
            link.problem = problem

    async def _recheck_holders(self, same_bus: bool) -> None:
        """Return the leases whose holders left while the connection was down. On another bus
        daemon, no holder's unique name exists any more; on the same one, each holder is watched
        again (the match first, so a holder leaving right after is reported) and asked for."""
        owners = sorted({str(lease.owner) for lease in self.daemon.leases()
                         if str(lease.owner).startswith(":")})  # fmt: skip
        for owner in owners:
            if not same_bus:
                self._vanished(owner)
                continue
            self._watched.add(owner)
            self.bus.send(self._match("AddMatch", owner))
            try:
                (there,) = await bus_call(self.bus, "NameHasOwner", "s", [owner])
            except Exception as e:  # the connection went again: the next round sees to it
                log.debug("asking the bus for %s failed: %s", owner, e)
                return
            if not there:
                self._name_lost(owner)

    # -- methods --------------------------------------------------------------------------------

    async def borrow(
        self, owner: str | None, mib: int, app_id: str, reason: str, device: int | None = None
    ) -> int:
        if not owner:
            raise DBusError(ERROR_FAILED, "Borrow: the caller has no bus name")
        try:
            self.daemon.controller_for(device)  # an unknown device: before anything is watched
        except Exception as e:
            raise _dbus_error(e) from None
        started = time.perf_counter()
        bus = self.bus
        task = asyncio.ensure_future(self._borrow(owner, mib, app_id, reason, device))
        self._pending.setdefault(owner, set()).add(task)
        try:
            cookie = await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
            why = (
                "Strata is stopping"
                if self._closed
                else f"its caller {owner} left the bus"
                if bus.connected
                else "Strata lost its connection to the bus"
            )
            raise DBusError(ERROR_FAILED, f"Borrow of {mib} MiB cancelled: {why}") from None
        except DBusError:
            raise
        except Exception as e:
            if not bus.connected and not isinstance(e, LeaseError):  # no reply can reach it
                raise DBusError(ERROR_FAILED, f"Borrow of {mib} MiB: Strata lost its "
                                "connection to the bus") from None  # fmt: skip
            raise _dbus_error(e) from None
        finally:
            tasks = self._pending.get(owner)
            if tasks is not None:
                tasks.discard(task)
                if not tasks:
                    del self._pending[owner]
            self._forget_if_idle(owner)
        log.info(
            "Borrow(%d MiB) from %s: cookie %d in %.1f ms",
            mib, owner, cookie, (time.perf_counter() - started) * 1000,
        )  # fmt: skip
        return cookie

    async def _borrow(
        self, owner: str, mib: int, app_id: str, reason: str, device: int | None
    ) -> int:
        pid = await self._watch(owner)
        lease = await self.daemon.borrow(mib, owner, pid, app_id, reason, device)
        return lease.cookie

    def return_lease(self, cookie: int, owner: str | None) -> None:
        try:
            self.daemon.return_lease(cookie, owner or "")
        except Exception as e:
            raise _dbus_error(e) from None
        self._forget_if_idle(owner or "")

    def revoke(self, cookie: int) -> None:
        try:
            lease = self.daemon.revoke(cookie)
        except Exception as e:
            raise _dbus_error(e) from None
        self._forget_if_idle(lease.owner)

    async def set_reserve(self, mib: int, device: int | None = None) -> None:
        try:
            await self.daemon.reserve(mib, device)
        except Exception as e:
            raise _dbus_error(e) from None

    def value(self, name: str) -> JSON:
        return property_values(self.daemon.status())[name]

    # -- callers coming and going ---------------------------------------------------------------

    async def _watch(self, owner: str) -> int | None:
        """Match the caller's disappearance (once per caller) and return its PID. The bus handles
        our messages in order, so a caller still there when the PID is asked for is one whose
        disappearance the match will report."""
        if owner not in self._watched:
            self._watched.add(owner)
            self.bus.send(self._match("AddMatch", owner))
        try:
            (pid,) = await bus_call(self.bus, "GetConnectionUnixProcessID", "s", [owner])
        except DBusError as e:
            if e.type == "org.freedesktop.DBus.Error.NameHasNoOwner":
                self._loop.call_soon(self._name_lost, owner)
                raise DBusError(ERROR_FAILED, f"the caller {owner} left the bus") from None
            log.debug("no PID for %s: %s", owner, e.text)
            return None
        return int(pid) if pid else None

    def _forget_if_idle(self, owner: str) -> None:
        """Stop watching a caller with no lease and no Borrow in progress: the callers watched
        stay as many as the leases (at most MAX_LEASES) and the Borrows under way."""
        if owner not in self._watched or owner in self._pending:
            return
        if any(lease.owner == owner for lease in self.daemon.leases()):
            return
        self._watched.discard(owner)
        if self.bus.connected:
            self.bus.send(self._match("RemoveMatch", owner))

    def _match(self, member: str, owner: str) -> Message:
        return Message(
            destination=DBUS_NAME,
            path=DBUS_PATH,
            interface=DBUS_NAME,
            member=member,
            signature="s",
            body=[name_owner_match(owner)],
        )

    def _name_lost(self, owner: str) -> None:
        if owner in self._watched:
            self._watched.discard(owner)
            if self.bus.connected:
                self.bus.send(self._match("RemoveMatch", owner))
        waiting = self._pending.pop(owner, set())
        for task in waiting:
            task.cancel()
        if waiting:
            # let the cancelled Borrows drop their pending leases first, then end granted ones
            self._loop.create_task(self._vanished_after(waiting, owner))
        else:
            self._vanished(owner)

    async def _vanished_after(self, waiting: set[asyncio.Task[int]], owner: str) -> None:
        await asyncio.wait(waiting)
        self._vanished(owner)

    def _vanished(self, owner: str) -> None:
        gone = self.daemon.owner_vanished(owner)
        if gone:
            log.info("%s left the bus: returned leases %s", owner, [g.cookie for g in gone])

    # -- messages -------------------------------------------------------------------------------

    def _on_message(self, msg: Message) -> Message | bool | None:
        if msg.message_type == MessageType.METHOD_CALL:
            _caller.set(msg.sender)
            if (
                msg.path == OBJECT_PATH
                and msg.interface in (INTERFACE, None)
                and msg.member in self._signatures
                and msg.signature != self._signatures[msg.member]
            ):
                want = self._signatures[msg.member]
                error = Message.new_error(
                    msg,
                    ERROR_INVALID_ARGUMENT,
                    f"{msg.member} takes arguments of D-Bus type ({want}), got "
                    f"({msg.signature}): {_cut(repr(msg.body))}",
                )
                return True if msg.flags & MessageFlag.NO_REPLY_EXPECTED else error
            return None
        if (
            msg.message_type == MessageType.SIGNAL
            and msg.member == "NameOwnerChanged"
            and msg.sender == DBUS_NAME
            and msg.body
            and msg.body[0] in self._watched
            and not msg.body[2]
        ):
            self._name_lost(msg.body[0])
        return None

    # -- events from the control plane ----------------------------------------------------------

    def _on_event(self, name: str, fields: dict[str, Any]) -> None:
        if self._closed or not self.bus.connected:
            return
        if name == "cache_resized":
            cache_mib, free_mib = max(0, fields["cache_mib"]), max(0, fields["free_mib"])
            device = fields.get("device", 0)
            if device == 0:  # CacheResized keeps meaning device 0
                self.iface.CacheResized(cache_mib, free_mib)
            self.iface.CacheResizedOn(device, cache_mib, free_mib)
        elif name == "lease_returned":
            self.iface.LeaseReturned(fields["cookie"], fields["why"])
        self._queue_flush()

    def _queue_flush(self) -> None:
        """One PropertiesChanged for everything that changed in this loop iteration."""
        if not self._flush_queued and not self._closed:
            self._flush_queued = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_queued = False
        if not self.bus.connected:
            return
        now = property_values(self.daemon.status())
        changed = {k: v for k, v in now.items() if self._signalled.get(k) != v}
        self._signalled = now
        if changed:
            self.iface.emit_properties_changed(changed)


async def start_dbus(daemon: Daemon) -> DbusEdge | None:
    """Export the interface and own ``org.strata.Strata1``; None (after one warning) when there
    is no session bus. The name already owned by another process raises the service's
    ``ServiceError`` (exit 1) naming that process."""
    try:
        bus = await connect_session_bus()
    except NoSessionBus as e:
        log.warning("%s: D-Bus is off, HTTP only", e)
        daemon.dbus.problem = str(e)
        return None
    edge = DbusEdge(daemon, bus)
    try:
        await edge.start()
    except BaseException:
        await edge.close()
        raise
    return edge
