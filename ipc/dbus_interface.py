"""``org.strata.Vram1``, the interface the D-Bus edge exports (its contract:
``org.strata.Strata1.xml``): its names, its properties made from the daemon's status, its
methods (each a thin call into the edge) and signals, and the daemon's errors as D-Bus errors."""

from __future__ import annotations

import logging
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from dbus_fast import (
    DBusError,
)
from dbus_fast.annotations import DBusDict, DBusSignature, DBusStr, DBusUInt32, DBusUInt64
from dbus_fast.constants import PropertyAccess
from dbus_fast.service import ServiceInterface, dbus_method, dbus_property, dbus_signal

from strata.daemon.control.leases import LeaseError
from strata.daemon.json_types import JSONObject
from strata.daemon.status import StatusJson
from strata.ipc.bus import (
    DBusValue,
    to_vardict,
)

if TYPE_CHECKING:
    from strata.ipc.dbus import DbusEdge

log = logging.getLogger("strata.ipc.dbus")  # the name the edge's log lines always had

BUS_NAME = "org.strata.Strata1"
OBJECT_PATH = "/org/strata/Strata1"
INTERFACE = "org.strata.Vram1"
CONTRACT = Path(__file__).with_name("org.strata.Strata1.xml")
CLOSE_TIMEOUT_S = 1.0

ERROR_INVALID_ARGUMENT = "org.strata.Error.InvalidArgument"
ERROR_FAILED = "org.strata.Error.Failed"


DBusLeases = Annotated[list[list[DBusValue]], DBusSignature("a(usstt)")]
DBusCacheResized = Annotated[list[int], DBusSignature("tt")]
DBusCacheResizedOn = Annotated[list[int], DBusSignature("utt")]
DBusDevices = Annotated[list[str], DBusSignature("as")]
DBusLeaseReturned = Annotated[list[DBusValue], DBusSignature("us")]

# The unique bus name of the connection whose method call is being handled (see the module doc).
_caller: ContextVar[str | None] = ContextVar("strata_dbus_caller", default=None)


def property_values(status: StatusJson) -> JSONObject:
    """The interface's properties, from the daemon's status schema (as JSON: what GetStatus
    sends)."""
    return {
        "CacheMiB": max(0, status["cache_mib"]),
        "CoreMiB": max(0, status["core_mib"]),
        "FreeMiB": max(0, status["free_mib"] or 0),
        "ReserveMiB": max(0, status["reserve_mib"]),
        "BorrowedMiB": max(0, status["borrowed_mib"]),
        "Leases": [
            [lease["cookie"], lease["app_id"], lease["reason"], lease["mib"], lease["since_us"]]
            for lease in status["leases"]
        ],
        "Device": status["device"] or "",
        "Model": status["model"] or "",
        "State": status["state"],
        "VramRequests": status["vram_requests"],
        "Devices": [d["compute_device"] for d in status.get("devices", [])],
    }


def _dbus_error(e: Exception) -> DBusError:
    """A daemon error as the D-Bus error its class names (its message already names values);
    anything unexpected is logged with its traceback and answered as Failed."""
    if not isinstance(e, LeaseError):
        log.error("unexpected error in a D-Bus call", exc_info=e)
    return DBusError(getattr(e, "dbus_name", ERROR_FAILED), str(e) or type(e).__name__)


# -- the interface ------------------------------------------------------------------------------


class Vram1(ServiceInterface):
    """``org.strata.Vram1``: each member is documented in ``org.strata.Strata1.xml``."""

    def __init__(self, edge: DbusEdge) -> None:
        super().__init__(INTERFACE)
        self._edge = edge

    @dbus_method()
    async def Borrow(self, mib: DBusUInt64, app_id: DBusStr, reason: DBusStr) -> DBusUInt32:
        return await self._edge.borrow(_caller.get(), mib, app_id, reason)

    @dbus_method()
    async def BorrowOn(
        self, device: DBusUInt32, mib: DBusUInt64, app_id: DBusStr, reason: DBusStr
    ) -> DBusUInt32:
        return await self._edge.borrow(_caller.get(), mib, app_id, reason, device)

    # Methods without a reply have no return annotation: dbus-fast reads one as the reply's type.
    @dbus_method()
    def Return(self, cookie: DBusUInt32):
        self._edge.return_lease(cookie, _caller.get())

    @dbus_method()
    def Revoke(self, cookie: DBusUInt32):
        self._edge.revoke(cookie)

    @dbus_method()
    async def SetReserve(self, mib: DBusUInt64):
        await self._edge.set_reserve(mib)

    @dbus_method()
    async def SetReserveOn(self, device: DBusUInt32, mib: DBusUInt64):
        await self._edge.set_reserve(mib, device)

    @dbus_method()
    def GetStatus(self) -> DBusDict:
        return to_vardict(self._edge.daemon.status())

    @dbus_property(access=PropertyAccess.READ)
    def CacheMiB(self) -> DBusUInt64:
        return self._edge.value("CacheMiB")

    @dbus_property(access=PropertyAccess.READ)
    def CoreMiB(self) -> DBusUInt64:
        return self._edge.value("CoreMiB")

    @dbus_property(access=PropertyAccess.READ)
    def FreeMiB(self) -> DBusUInt64:
        return self._edge.value("FreeMiB")

    @dbus_property(access=PropertyAccess.READ)
    def ReserveMiB(self) -> DBusUInt64:
        return self._edge.value("ReserveMiB")

    @dbus_property(access=PropertyAccess.READ)
    def BorrowedMiB(self) -> DBusUInt64:
        return self._edge.value("BorrowedMiB")

    @dbus_property(access=PropertyAccess.READ)
    def Leases(self) -> DBusLeases:
        return self._edge.value("Leases")

    @dbus_property(access=PropertyAccess.READ)
    def Device(self) -> DBusStr:
        return self._edge.value("Device")

    @dbus_property(access=PropertyAccess.READ)
    def Model(self) -> DBusStr:
        return self._edge.value("Model")

    @dbus_property(access=PropertyAccess.READ)
    def State(self) -> DBusStr:
        return self._edge.value("State")

    @dbus_property(access=PropertyAccess.READ)
    def VramRequests(self) -> DBusStr:
        return self._edge.value("VramRequests")

    @dbus_property(access=PropertyAccess.READ)
    def Devices(self) -> DBusDevices:
        return self._edge.value("Devices")

    @dbus_signal()
    def CacheResized(self, cache_mib: int, free_mib: int) -> DBusCacheResized:
        return [cache_mib, free_mib]

    @dbus_signal()
    def CacheResizedOn(self, device: int, cache_mib: int, free_mib: int) -> DBusCacheResizedOn:
        return [device, cache_mib, free_mib]

    @dbus_signal()
    def LeaseReturned(self, cookie: int, why: str) -> DBusLeaseReturned:
        return [cookie, why]


def _cut(text: str, limit: int = 120) -> str:
    """A caller's arguments in an error reply, cut: a reply never echoes a large call back."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def _in_signatures(iface: ServiceInterface) -> dict[str, str]:
    return {m.name: m.in_signature for m in ServiceInterface._get_methods(iface)}


# dbus-fast names reply and signal arguments arg_N; introspection shows the contract's names.
_ARG_NAMES = {
    "Borrow": ["cookie"],
    "BorrowOn": ["cookie"],
    "GetStatus": ["status"],
    "CacheResized": ["cache_mib", "free_mib"],
    "CacheResizedOn": ["device", "cache_mib", "free_mib"],
    "LeaseReturned": ["cookie", "why"],
}


def _name_args(iface: ServiceInterface) -> None:
    outs = [(m.name, m.introspection.out_args) for m in ServiceInterface._get_methods(iface)]
    outs += [(s.name, s.introspection.args) for s in ServiceInterface._get_signals(iface)]
    for member, args in outs:
        for arg, name in zip(args, _ARG_NAMES.get(member, []), strict=False):
            arg.name = name
