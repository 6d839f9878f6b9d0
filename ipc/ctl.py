"""``strata-ctl``: steer the running daemon over D-Bus (the session bus, ``org.strata.Strata1``).

    strata-ctl status [--json]           the daemon's state, cache, free VRAM, reserve, leases
    strata-ctl reserve MIB [--device N]  set the run-time reserve (0 clears it)
    strata-ctl borrow [--device N] MIB [--app-id ID] [--reason TEXT] [--timeout S] -- COMMAND…
                                         hold a lease while COMMAND runs (like systemd-inhibit)

``--device N`` names a device of a model split over several GPUs (``SetReserveOn``,
``BorrowOn``); without it, device 0 (``SetReserve``, ``Borrow``, as with one GPU).
    strata-ctl return COOKIE             end any lease (Revoke)
    strata-ctl leases [--json]           the leases
    strata-ctl watch                     resizes, leases and property changes as they happen

Exit codes: 0 success (``borrow``: the command's own code), 1 the daemon is not running or refused
the request (a refused reserve is not left in force), 2 a bad command line, 3 (``reserve``) the
reserve is set and in force but not met yet: the room is not free (other programs hold it, or the
cache is still shrinking); the line says why. Errors are one line on stderr, never a traceback.
``--json`` prints each command's answer as JSON (``reserve``: ``result`` and the status).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from dbus_fast import DBusError, Message, MessageType
from dbus_fast.aio import MessageBus

from strata import __version__
from strata.daemon.json_types import JSONObject
from strata.ipc.bus import (
    DBusValue,
    NoSessionBus,
    bus_call,
    connect_session_bus,
    from_variant,
    name_owner_match,
)
from strata.ipc.ctl_format import (
    _all_leases,
    _device_status,
    _size,
    carried_out,
    format_leases,
    format_status,
)
from strata.ipc.dbus_interface import BUS_NAME, INTERFACE, OBJECT_PATH

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_PENDING = 3  # `reserve`: set and in force, the room not free yet
EXIT_NOT_FOUND = 127  # the command of `borrow` does not exist, as in a shell
CALL_TIMEOUT_S = 30.0  # activation may start the daemon; Borrow waits at most 24 s in it

# Errors meaning "nobody owns the name and activation did not start anybody".
_NOT_RUNNING = (
    "org.freedesktop.DBus.Error.ServiceUnknown",
    "org.freedesktop.DBus.Error.NameHasNoOwner",
    "org.freedesktop.DBus.Error.Spawn.",
)


class CtlError(Exception):
    """A one-line reason for exit 1."""


class _Parser(argparse.ArgumentParser):
    """argparse that exits 2 with one line (no usage dump) on a bad command line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


# -- argument types: one line naming the value -------------------------------------------------


def _mib(text: str, *, allow_zero: bool) -> int:
    least = 0 if allow_zero else 1
    try:
        value = int(text, 10)
    except ValueError:
        value = -1
    if value < least or value >= 2**64:
        raise argparse.ArgumentTypeError(f"expected a whole number of MiB >= {least}, got {text!r}")
    return value


def _cookie(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        value = -1
    if not 1 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"expected a lease cookie (1 to 4294967295), got {text!r}")
    return value


def _device(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        value = -1
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"expected a device number (0, 1, …), got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


DEVICE_HELP = "the device, by number, of a model split over several GPUs (default: 0)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="strata-ctl", description="Steer the Strata daemon over D-Bus.")
    parser.add_argument("--version", action="version", version=f"strata-ctl {__version__}")
    parser.add_argument("--json", action="store_true", help="print the status schema as JSON")
    sub = parser.add_subparsers(dest="command_name", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    json_flag = {"action": "store_true", "default": argparse.SUPPRESS, "help": "print JSON"}

    status = sub.add_parser("status", help="the daemon's state, cache, free VRAM and leases")
    status.add_argument("--json", **json_flag)
    status.set_defaults(run=cmd_status)

    reserve = sub.add_parser("reserve", help="set the run-time reserve in MiB (0 clears it)")
    reserve.add_argument("mib", metavar="MIB", type=lambda t: _mib(t, allow_zero=True))
    reserve.add_argument("--device", metavar="N", type=_device, help=DEVICE_HELP)
    reserve.add_argument("--json", **json_flag)
    reserve.set_defaults(run=cmd_reserve)

    borrow = sub.add_parser(
        "borrow",
        help="hold a lease of MIB MiB while COMMAND runs",
        usage="strata-ctl borrow [--device N] MIB [--app-id ID] [--reason TEXT] [--timeout S] "
        "-- COMMAND…",
    )
    borrow.add_argument("mib", metavar="MIB", type=lambda t: _mib(t, allow_zero=False))
    borrow.add_argument("--device", metavar="N", type=_device, help=DEVICE_HELP)
    borrow.add_argument("--app-id", help="who borrows (default: the command's name)")
    borrow.add_argument("--reason", help="why (default: the command line)")
    borrow.add_argument(
        "--timeout", type=_seconds, help="seconds to wait for the VRAM (default: the daemon's)"
    )
    borrow.add_argument("command", metavar="COMMAND", nargs="*", help=argparse.SUPPRESS)
    borrow.set_defaults(run=cmd_borrow)

    ret = sub.add_parser("return", help="end a lease, whoever holds it (Revoke)")
    ret.add_argument("cookie", metavar="COOKIE", type=_cookie)
    ret.set_defaults(run=cmd_return)

    leases = sub.add_parser("leases", help="the leases")
    leases.add_argument("--json", **json_flag)
    leases.set_defaults(run=cmd_leases)

    watch = sub.add_parser("watch", help="print resizes, leases and changes until Ctrl-C")
    watch.set_defaults(run=cmd_watch)
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """``borrow``'s COMMAND is everything after the first ``--``, verbatim (argparse would drop
    every later ``--`` from it)."""
    argv = list(argv)
    tail: list[str] | None = None
    if "--" in argv:
        cut = argv.index("--")
        argv, tail = argv[:cut], argv[cut + 1 :]
    parser = build_parser()
    args = parser.parse_args(argv)
    if tail is not None:
        if args.command_name != "borrow":
            parser.error(f"unexpected arguments after --: {shlex.join(tail)!r}")
        args.command = [*args.command, *tail]
    if args.command_name == "borrow" and not args.command:
        parser.error("borrow: no COMMAND given (strata-ctl borrow MIB -- COMMAND…)")
    return args


# -- talking to the daemon ---------------------------------------------------------------------


class Client:
    def __init__(self, bus: MessageBus) -> None:
        self.bus = bus

    @classmethod
    async def connect(cls) -> Client:
        try:
            return cls(await connect_session_bus())
        except NoSessionBus as e:
            raise CtlError(f"Strata is not reachable: {e}") from None

    async def call(
        self, member: str, signature: str = "", body: list[DBusValue] | None = None
    ) -> list[DBusValue]:
        """One method of org.strata.Vram1; D-Bus errors become a :class:`CtlError`."""
        try:
            reply = await asyncio.wait_for(
                bus_call(
                    self.bus, member, signature, body, destination=BUS_NAME, path=OBJECT_PATH,
                    interface=INTERFACE,
                ),
                CALL_TIMEOUT_S,
            )  # fmt: skip
        except TimeoutError:
            raise CtlError(f"Strata did not answer {member} within {CALL_TIMEOUT_S:g} s") from None
        except DBusError as e:
            if e.type.startswith(_NOT_RUNNING):
                raise CtlError(
                    f"Strata is not running: nothing owns {BUS_NAME} on the session bus and it "
                    f"could not be started ({e.text})"
                ) from None
            if e.type == "org.freedesktop.DBus.Error.NoReply":
                raise CtlError(f"Strata did not answer {member}: {e.text}") from None
            raise CtlError(f"{e.text} ({e.type})") from None
        return from_variant(reply[0]) if reply else None

    async def status(self) -> JSONObject:
        return await self.call("GetStatus")

    def close(self) -> None:
        self.bus.disconnect()


# -- commands -----------------------------------------------------------------------------------


async def cmd_status(args: argparse.Namespace, client: Client) -> int:
    status = await client.status()
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=False))
    else:
        print(format_status(status))
    return 0


async def cmd_leases(args: argparse.Namespace, client: Client) -> int:
    status = await client.status()
    leases = _all_leases(status)
    if args.json:
        print(json.dumps(leases, indent=2))
    elif leases:
        print(format_leases(leases, split=len(status.get("devices") or []) > 1))
    else:
        print("no leases")
    return 0


async def cmd_reserve(args: argparse.Namespace, client: Client) -> int:
    """Exit 0 once the reserve is met (or cleared), 3 when it is set but pending, 1 refused."""
    device = args.device
    before = _device_status(await client.status(), device).get("cache_mib")
    if device is None:
        await client.call("SetReserve", "t", [args.mib])
        where = ""
    else:
        await client.call("SetReserveOn", "ut", [device, args.mib])
        where = f" on device {device}"
    full = await client.status()
    status = _device_status(full, device)
    pending = args.mib > 0 and status.get("reserve_state") == "pending"
    if pending:
        how = "pending"
        words = (
            f"set, not met yet: {status.get('reserve_message')}; it stays in force until changed"
        )
    else:
        how = "none" if args.mib == 0 else status.get("vram_requests", "room")
        words = carried_out(status, before, args.mib)
    if args.json:
        result = {"how": how, "message": words, "reserve_mib": args.mib, "device": device or 0}
        print(json.dumps({"result": result, **full}, indent=2))
    else:
        print(f"run-time reserve{where}: {args.mib} MiB: {words}")
    return EXIT_PENDING if pending else 0


async def cmd_return(args: argparse.Namespace, client: Client) -> int:
    await client.call("Revoke", "u", [args.cookie])
    print(f"lease {args.cookie} returned")
    return 0


async def cmd_borrow(args: argparse.Namespace, client: Client) -> int:
    command: list[str] = args.command
    app_id = args.app_id if args.app_id is not None else os.path.basename(command[0])
    reason = args.reason if args.reason is not None else shlex.join(command)[:200]
    device = args.device
    before = _device_status(await client.status(), device).get("cache_mib")
    if device is None:
        call = client.call("Borrow", "tss", [args.mib, app_id, reason])
    else:
        call = client.call("BorrowOn", "utss", [device, args.mib, app_id, reason])
    try:
        cookie = await asyncio.wait_for(call, args.timeout)
    except TimeoutError:
        raise CtlError(f"no lease of {args.mib} MiB within {args.timeout:g} s") from None
    status = _device_status(await client.status(), device)
    if status.get("vram_requests") == "shrink":  # stdout is the command's: say it on stderr
        how = carried_out(status, before, args.mib)
        print(f"strata-ctl: lease {cookie} of {args.mib} MiB: {how}", file=sys.stderr)
    try:
        code = await run_command(command)
    finally:
        with contextlib.suppress(CtlError):  # the daemon may have gone, or revoked it
            await client.call("Return", "u", [cookie])
    return code


async def run_command(command: list[str]) -> int:
    """Run ``command``, forwarding SIGINT and SIGTERM to it; its exit code (128 + N after
    signal N, as a shell reports it). The forwarding is in place before the command starts: a
    signal that comes while it is being started is passed on once it runs."""
    loop = asyncio.get_running_loop()
    proc: asyncio.subprocess.Process | None = None
    early: list[int] = []

    def forward(sig: int) -> None:
        # A Ctrl-C at a terminal already reached the command (same process group): don't
        # deliver it twice. Any other SIGINT and every SIGTERM is passed on.
        if sig == signal.SIGINT and _terminal_foreground():
            return
        if proc is None:
            early.append(sig)
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, forward, sig)
    try:
        try:
            proc = await asyncio.create_subprocess_exec(*command)
        except FileNotFoundError:
            print(f"strata-ctl: command not found: {command[0]}", file=sys.stderr)
            return EXIT_NOT_FOUND
        except PermissionError:
            print(f"strata-ctl: cannot run {command[0]}: permission denied", file=sys.stderr)
            return 126
        for sig in early:
            forward(sig)
        code = await proc.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return code if code >= 0 else 128 - code


def _terminal_foreground() -> bool:
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError):
        return False


async def cmd_watch(args: argparse.Namespace, client: Client) -> int:
    status = await client.status()
    _line(
        f"watching Strata: {status.get('state')}, cache {_size(status.get('cache_mib'))}, "
        f"free {_size(status.get('free_mib'))}, {len(status.get('leases', []))} lease(s); "
        "Ctrl-C to stop"
    )
    bus = client.bus
    rules = [
        f"type='signal',sender='{BUS_NAME}',path='{OBJECT_PATH}'",
        name_owner_match(BUS_NAME),
    ]
    bus.add_message_handler(_print_signal)
    for rule in rules:
        await bus_call(bus, "AddMatch", "s", [rule])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    gone = asyncio.ensure_future(bus.wait_for_disconnect())
    await asyncio.wait([asyncio.ensure_future(stop.wait()), gone], return_when="FIRST_COMPLETED")
    if gone.done() and not stop.is_set():
        raise CtlError("lost the session bus")
    return 0


def _print_signal(msg: Message) -> None:
    if msg.message_type != MessageType.SIGNAL:
        return None
    if msg.member == "NameOwnerChanged" and msg.body and msg.body[0] == BUS_NAME:
        _line(f"Strata is on the bus ({msg.body[2]})" if msg.body[2] else "Strata left the bus")
    elif msg.path == OBJECT_PATH and msg.interface == INTERFACE:
        if msg.member == "CacheResized":
            _line(f"CacheResized cache_mib={msg.body[0]} free_mib={msg.body[1]}")
        elif msg.member == "CacheResizedOn" and msg.body[0] != 0:  # device 0's: CacheResized
            _line(f"CacheResizedOn device={msg.body[0]} cache_mib={msg.body[1]} "
                  f"free_mib={msg.body[2]}")  # fmt: skip
        elif msg.member == "LeaseReturned":
            _line(f"LeaseReturned cookie={msg.body[0]} why={msg.body[1]}")
    elif msg.path == OBJECT_PATH and msg.member == "PropertiesChanged" and msg.body[0] == INTERFACE:
        changed = from_variant(msg.body[1])
        text = " ".join(f"{k}={_compact(v)}" for k, v in sorted(changed.items()))
        _line(f"PropertiesChanged {text}")
    return None


def _line(text: str) -> None:
    stamp = datetime.now().strftime("%H:%M:%S.%f")[:-3]
    try:
        print(f"{stamp} {text}", flush=True)
    except BrokenPipeError:  # `strata-ctl watch | head`: the reader left; nothing to clean up
        os._exit(quiet_broken_pipe())


def _compact(value: Any) -> str:
    if isinstance(value, list):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


# -- main ---------------------------------------------------------------------------------------


async def _run(run: Callable[..., Any], args: argparse.Namespace) -> int:
    client = await Client.connect()
    try:
        return await run(args, client)
    finally:
        client.close()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # --help, --version, or a usage error already printed
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        code = asyncio.run(_run(args.run, args))
        sys.stdout.flush()  # here, not at exit: a reader that left is seen below
        return code
    except CtlError as e:
        print(f"strata-ctl: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("strata-ctl: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `strata-ctl --json status | head -1`: the reader is gone
        return quiet_broken_pipe()


def quiet_broken_pipe() -> int:
    """End quietly once stdout's reader has gone, as a shell tool does (128 + SIGPIPE): point
    stdout at /dev/null so the interpreter's last flush raises nothing either."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
