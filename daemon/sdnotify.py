"""``sd_notify`` with the standard library: readiness, status, watchdog and stop messages.

The protocol (sd_notify(3)): newline-separated ``KEY=VALUE`` lines in one datagram on the
``AF_UNIX`` socket named by ``$NOTIFY_SOCKET``; a name starting with ``@`` is in the abstract
namespace. systemd reads the sender's credentials from the socket, so ``NotifyAccess=main`` accepts
only what the daemon's own process sends. Without ``$NOTIFY_SOCKET`` (not started by systemd) every
method does nothing. A failed send is logged at debug level and never raised: the daemon must not
stop serving because its supervisor went away.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import Mapping

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 1.0  # a supervisor that stopped reading must not stall the main loop for long


class Notifier:
    """Messages to the service manager. Safe to call from any thread."""

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self.address = address
        self.watchdog_usec = watchdog_usec
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, pid: int | None = None) -> Notifier:
        """The notifier systemd asked for: ``$NOTIFY_SOCKET``, and ``$WATCHDOG_USEC`` when
        ``$WATCHDOG_PID`` is unset or names this process (a child that inherited the variables
        must not ping on its parent's behalf)."""
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET") or None
        if address is not None and not address.startswith(("/", "@")):
            log.debug("NOTIFY_SOCKET=%s is not an AF_UNIX address: not notifying", address)
            address = None
        return cls(address, _watchdog_usec(env, os.getpid() if pid is None else pid))

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_interval_s(self) -> float | None:
        """How often to send ``WATCHDOG=1``: half the watchdog timeout, as sd_watchdog_enabled(3)
        advises; None when there is no watchdog for this process."""
        if self.watchdog_usec is None:
            return None
        return self.watchdog_usec / 2 / 1e6

    # -- messages -------------------------------------------------------------------------------

    def ready(self, status: str | None = None) -> bool:
        return self.send("READY=1", *_status_line(status))

    def status(self, text: str) -> bool:
        return self.send(*_status_line(text))

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for ``seconds`` more before the start (or stop) timeout, counted from now."""
        return self.send(f"EXTEND_TIMEOUT_USEC={max(0, round(seconds * 1e6))}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        return self.send("STOPPING=1", *_status_line(status))

    def send(self, *lines: str) -> bool:
        """Send ``lines`` as one message; True when it was handed to the socket."""
        if self.address is None or not lines:
            return False
        data = "\n".join(lines).encode()
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            with self._lock:
                if self._sock is None:
                    self._sock = socket.socket(
                        socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
                    )
                    self._sock.settimeout(SEND_TIMEOUT_S)
                self._sock.sendto(data, target)
        except OSError as e:
            log.debug("sd_notify to %s failed (%s): %r", self.address, e, data)
            return False
        return True

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def _status_line(text: str | None) -> tuple[str, ...]:
    # One message is newline-separated: a newline inside STATUS= would start a bogus field.
    return () if text is None else ("STATUS=" + " ".join(text.split("\n")),)


def _watchdog_usec(env: Mapping[str, str], pid: int) -> int | None:
    owner = env.get("WATCHDOG_PID")
    if owner:
        try:
            if int(owner) != pid:
                return None
        except ValueError:
            return None
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec if usec > 0 else None


# -- helpers for the asyncio main loop ----------------------------------------------------------


async def watchdog_loop(notifier: Notifier) -> None:
    """Send ``WATCHDOG=1`` every ``watchdog_interval_s`` until cancelled. It runs as a task on the
    main loop on purpose: a loop that hangs stops the pings, and systemd restarts the daemon."""
    interval = notifier.watchdog_interval_s
    if not notifier.enabled or interval is None:
        return
    while True:
        notifier.watchdog()
        await asyncio.sleep(interval)


async def http_status(host: str, port: int, path: str, timeout_s: float = 2.0) -> int | None:
    """The status code of a real ``GET path`` on ``host:port``; None when nothing answers. The
    readiness check uses it on the daemon's own socket, so ``READY=1`` means clients get through."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    request = f"GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n"
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(request.encode())
            await writer.drain()
            status_line = await reader.readline()
    except (OSError, TimeoutError) as e:
        log.debug("GET %s on %s: %s", path, authority, e or type(e).__name__)
        return None
    finally:
        if writer is not None:
            writer.close()
    parts = status_line.split()
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return None
    return int(parts[1])
