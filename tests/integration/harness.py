"""The real daemon as a subprocess, on a private session bus, with a simulated VRAM device.

``PrivateBus`` starts ``dbus-daemon --print-address --print-pid`` with its own configuration (and
an optional activation directory). ``StrataDaemon`` starts ``python -m strata serve --port 0`` with
private XDG directories, waits until ``/health`` says ready (or only until it listens), and keeps
the daemon's log; the ``daemon_log_on_failure`` fixture prints it when a test fails.

For the D-Bus tests: ``bus_env`` puts a daemon or client on a ``PrivateBus``,
``simulated_device_args`` makes the daemon's simulated-device options, ``strata_ctl`` runs the
console script, ``ClientProcess`` runs a program of ``dbus_clients.py`` (a borrower, a GameMode
stand-in) with its output read line by line, and ``BusClient`` is an in-test dbus-fast connection
that calls ``org.strata.Strata1`` and records its signals with their arrival times.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

from strata.ipc.bus import bus_call, from_variant
from strata.ipc.dbus_interface import BUS_NAME, INTERFACE, OBJECT_PATH
from tests.helpers import require_tool

READY_TIMEOUT_S = 90.0
# Every wait here allows at least this long, whatever a test asks: a wait only bounds a hang and
# is never a speed check (a busy 2-core CI machine can be that slow; speeds are `strata bench`'s).
WAIT_FLOOR_S = 60.0


def wait_s(timeout: float) -> float:
    """The time a wait of ``timeout`` seconds really allows (at least ``WAIT_FLOOR_S``)."""
    return max(timeout, WAIT_FLOOR_S)


BUS_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <listen>{listen}</listen>
  <auth>EXTERNAL</auth>
  {servicedir}
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
"""


class PrivateBus:
    """A private session bus; ``address`` goes into ``DBUS_SESSION_BUS_ADDRESS``. ``socket_path``
    makes it listen at that path, so that a new bus can later take the place of a killed one
    at the same address."""

    def __init__(
        self,
        tmp: Path,
        service_dir: Path | None = None,
        env: Mapping[str, str] = {},
        socket_path: Path | None = None,
    ) -> None:
        require_tool("dbus-daemon")
        tmp.mkdir(parents=True, exist_ok=True)
        servicedir = f"<servicedir>{service_dir}</servicedir>" if service_dir else ""
        listen = f"unix:path={socket_path}" if socket_path else f"unix:tmpdir={tmp}"
        config = tmp / "bus.conf"
        config.write_text(BUS_CONFIG.format(listen=listen, servicedir=servicedir))
        self.proc = subprocess.Popen(
            ["dbus-daemon", f"--config-file={config}", "--print-address=1", "--print-pid=1",
             "--nofork"],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
        )  # fmt: skip
        assert self.proc.stdout is not None
        self.address = self.proc.stdout.readline().strip()
        self.pid = int(self.proc.stdout.readline().strip())
        if not self.address:
            raise RuntimeError("dbus-daemon printed no address")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def kill(self) -> None:
        """The bus dies at once (SIGKILL): every connection on it ends."""
        self.proc.kill()
        self.proc.wait(5)


def write_simulated(path: Path, total_mib: int, tenants: Sequence[tuple[int, int]] = ()) -> None:
    """Atomically write the simulated device: ``tenants`` as (pid, MiB) pairs."""
    data = {
        "total_mib": total_mib,
        "tenants": [{"pid": pid, "name": f"tenant-{pid}", "mib": mib} for pid, mib in tenants],
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def daemon_env(tmp: Path, extra: Mapping[str, str] = {}) -> dict[str, str]:
    """The environment of a daemon or client under test: private XDG dirs, no STRATA_* leaks."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "DBUS_"))}
    runtime = tmp / "runtime"
    runtime.mkdir(parents=True, exist_ok=True, mode=0o700)
    env.update(
        XDG_CONFIG_HOME=str(tmp / "config"),
        XDG_CACHE_HOME=str(tmp / "cache"),
        XDG_STATE_HOME=str(tmp / "state"),
        XDG_RUNTIME_DIR=str(runtime),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


class StrataDaemon:
    """``strata serve`` as a subprocess. ``args`` are extra command-line options. ``command``
    replaces ``python -m strata serve --port 0 --log-level debug`` (e.g. a unit's ExecStart=)."""

    def __init__(
        self,
        tmp: Path,
        args: Sequence[str] = (),
        env: Mapping[str, str] = {},
        wait: str = "ready",
        command: Sequence[str] | None = None,
    ) -> None:
        self.tmp = tmp
        self.log_path = tmp / f"daemon-{time.monotonic_ns()}.log"
        self._log = self.log_path.open("w")
        self.env = daemon_env(tmp, env)
        if command is None:
            command = [sys.executable, "-m", "strata", "serve", "--port", "0", "--log-level",
                       "debug"]  # fmt: skip
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [*command, *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
        )  # fmt: skip
        self.url = ""
        if wait in ("listening", "ready"):
            self.wait_listening()
        if wait == "ready":
            self.wait_ready()

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_listening(self, timeout: float = READY_TIMEOUT_S) -> str:
        timeout = wait_s(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log.splitlines():
                if "listening on http://" in line:
                    self.url = line.rsplit("listening on ", 1)[1].strip()
                    return self.url
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log}")
            time.sleep(0.05)
        raise TimeoutError(f"daemon did not listen within {timeout} s:\n{self.log}")

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        timeout = wait_s(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log}")
            time.sleep(0.05)
        raise TimeoutError(f"daemon not ready within {timeout} s:\n{self.log}")

    def status(self) -> dict[str, Any]:
        r = httpx.get(self.url + "/v1/vram", timeout=5)
        r.raise_for_status()
        return r.json()

    def wait_for(self, predicate: Any, timeout: float, what: str) -> dict[str, Any]:
        """Poll the status until ``predicate(status)`` holds; returns that status."""
        timeout = wait_s(timeout)
        deadline = time.monotonic() + timeout
        status = self.status()
        while not predicate(status):
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not reached in {timeout} s; last status {status}")
            time.sleep(0.05)
            status = self.status()
        return status

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(wait_s(timeout))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@contextmanager
def running(tmp: Path, *args: str, **kw: Any) -> Iterator[StrataDaemon]:
    d = StrataDaemon(tmp, args, **kw)
    try:
        yield d
    finally:
        d.stop()


def take(items: queue.Queue[Any], timeout: float, what: Callable[[], str]) -> Any:
    """The next item of a queue a reader thread fills; an AssertionError saying ``what()`` when
    none comes in ``wait_s(timeout)``."""
    timeout = wait_s(timeout)
    try:
        return items.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"{what()} in {timeout} s") from None


class StatusEvents:
    """``GET /v1/vram/events`` read in a thread: each event as (name, id or None, data parsed),
    in arrival order; ``ended`` once the server closed the stream cleanly, ``error`` if it broke.
    """

    def __init__(self, url: str, headers: Mapping[str, str] = {}) -> None:
        self.events: queue.Queue[tuple[str, int | None, Any]] = queue.Queue()
        self.seen: list[tuple[str, int | None, Any]] = []
        self.status_code: int | None = None
        self.ended = threading.Event()
        self.error: BaseException | None = None
        self._client = httpx.Client(timeout=httpx.Timeout(10, read=None))
        self._thread = threading.Thread(target=self._read, args=(url, dict(headers)), daemon=True)
        self._thread.start()

    def _read(self, url: str, headers: dict[str, str]) -> None:
        try:
            with self._client.stream("GET", url + "/v1/vram/events", headers=headers) as r:
                self.status_code = r.status_code
                name, ident, data = "message", None, []
                for line in r.iter_lines():
                    if line == "":
                        if data:
                            self.events.put((name, ident, json.loads("\n".join(data))))
                        name, ident, data = "message", None, []
                    elif line.startswith("event: "):
                        name = line[7:]
                    elif line.startswith("id: "):
                        ident = int(line[4:])
                    elif line.startswith("data: "):
                        data.append(line[6:])
        except BaseException as e:  # what broke the stream, for the test to show
            self.error = e
        finally:
            self.ended.set()

    def next(self, timeout: float = 30) -> tuple[str, int | None, Any]:
        event = take(self.events, timeout, lambda: f"no event (error {self.error!r})")
        self.seen.append(event)
        return event

    def wait_status(self, predicate: Any, timeout: float, what: str) -> dict[str, Any]:
        """The first status event (from here on) whose data passes ``predicate``."""
        deadline = time.monotonic() + wait_s(timeout)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{what}: no such status event; seen {self.seen[-3:]}")
            name, _, data = self.next(left)
            if name == "status" and predicate(data):
                return data

    def close(self) -> None:
        self._client.close()


# -- D-Bus: helpers for test_dbus, test_ctl and test_gamemode -----------------------------------

CLIENTS = Path(__file__).with_name("dbus_clients.py")


def bus_env(bus: PrivateBus) -> dict[str, str]:
    """The environment entry that puts a daemon or a client on ``bus``."""
    return {"DBUS_SESSION_BUS_ADDRESS": bus.address}


def simulated_device_args(
    vram_file: Path,
    model: Path | None,
    *,
    cache_mib: int = 48,
    reserve_mib: int = 0,
    stable_ms: int = 500,
    period_ms: int = 100,
) -> list[str]:
    """``strata serve`` options for ``model`` (None: the built-in demo) on the simulated device
    described by ``vram_file``: 2 MiB chunks, a fast control loop, half the cache elastic (the
    tests' sizes were worked out with a core of half the cache)."""
    chosen = ["--model", str(model)] if model is not None else []
    return [
        *chosen, "--device", "cpu", "--vram-monitor", "simulated",
        "--simulated-vram-file", str(vram_file), "--cache-mib", str(cache_mib),
        "--elastic-tail-mib", str(cache_mib // 2),
        "--elastic-reserve-mib", str(reserve_mib), "--arena-chunk-mib", "2",
        "--elastic-stable-ms", str(stable_ms), "--elastic-period-ms", str(period_ms),
    ]  # fmt: skip


def strata_ctl_command() -> list[str]:
    """The installed ``strata-ctl`` console script beside this Python, else the module."""
    script = Path(sys.executable).with_name("strata-ctl")
    return [str(script)] if script.exists() else [sys.executable, "-m", "strata.ipc.ctl"]


def grew_after_the_stable_time(log: str, stable_s: float) -> bool:
    """Whether the daemon's log has a growth decided once the room had lasted ``stable_s``: the
    policy's own clock says how long it waited, not the test's."""
    return f"(the room lasted {stable_s:g} s)" in log


def strata_ctl(
    *argv: str, env: Mapping[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*strata_ctl_command(), *argv],
        env=dict(env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class ClientProcess:
    """A program of ``dbus_clients.py`` (or any command) as a subprocess whose stdout lines are
    read with a timeout."""

    def __init__(
        self, argv: Sequence[str], env: Mapping[str, str], *, new_session: bool = False
    ) -> None:
        self.proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,  # never the terminal: strata-ctl treats that differently
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(env),
            start_new_session=new_session,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    @classmethod
    def program(cls, bus: PrivateBus, tmp: Path, *argv: str) -> ClientProcess:
        return cls([sys.executable, str(CLIENTS), *argv], daemon_env(tmp, bus_env(bus)))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def line(self, timeout: float = 15) -> str:
        line = take(self.lines, timeout, lambda: f"no output; so far {self.seen}")
        self.seen.append(line)
        return line

    def wait_line(self, predicate: Any, timeout: float = 15) -> str:
        deadline = time.monotonic() + wait_s(timeout)
        while True:
            line = self.line(max(0.01, deadline - time.monotonic()))
            if predicate(line):
                return line

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


class BusClient:
    """A dbus-fast connection inside the test: calls ``org.strata.Strata1`` and records its
    signals, each with its arrival time (``time.perf_counter()``)."""

    def __init__(self, bus: Any) -> None:
        self.bus = bus
        self.signals: list[tuple[float, str, list[Any]]] = []
        self._new = asyncio.Event()

    @classmethod
    async def connect(cls, address: str) -> BusClient:
        client = cls(await MessageBus(bus_address=address).connect())
        client.bus.add_message_handler(client._on_message)
        await client.dbus("AddMatch", "s", [f"type='signal',sender='{BUS_NAME}'"])
        return client

    def _on_message(self, msg: Any) -> None:
        if msg.message_type == MessageType.SIGNAL and msg.path == OBJECT_PATH:
            self.signals.append((time.perf_counter(), msg.member, from_variant(msg.body)))
            self._new.set()

    async def dbus(self, member: str, signature: str = "", body: list[Any] | None = None) -> Any:
        return await bus_call(self.bus, member, signature, body)

    async def call(self, member: str, signature: str = "", body: list[Any] | None = None) -> Any:
        """The raw reply (a method return or an error) of an org.strata.Vram1 method."""
        return await self.bus.call(
            Message(destination=BUS_NAME, path=OBJECT_PATH, interface=INTERFACE, member=member,
                    signature=signature, body=body or [])
        )  # fmt: skip

    async def strata(self, member: str, signature: str = "", body: list[Any] | None = None) -> Any:
        """An org.strata.Vram1 method's reply body; an error reply raises ``DBusError``."""
        return await bus_call(self.bus, member, signature, body, destination=BUS_NAME,
                              path=OBJECT_PATH, interface=INTERFACE)  # fmt: skip

    async def status(self) -> dict[str, Any]:
        (status,) = await self.strata("GetStatus")
        return from_variant(status)

    async def prop(self, name: str) -> Any:
        (value,) = await bus_call(
            self.bus, "Get", "ss", [INTERFACE, name], destination=BUS_NAME, path=OBJECT_PATH,
            interface="org.freedesktop.DBus.Properties",
        )  # fmt: skip
        return from_variant(value)

    async def strata_props(self) -> dict[str, Any]:
        """Every property of org.strata.Vram1 (``GetAll``), unpacked."""
        (values,) = await bus_call(
            self.bus, "GetAll", "s", [INTERFACE], destination=BUS_NAME, path=OBJECT_PATH,
            interface="org.freedesktop.DBus.Properties",
        )  # fmt: skip
        return from_variant(values)

    async def wait_signal(
        self, member: str, predicate: Any = lambda body: True, timeout: float = 30, start: int = 0
    ) -> tuple[float, list[Any]]:
        """The first signal ``member`` (from index ``start`` of ``signals``) whose body passes."""
        timeout = wait_s(timeout)
        deadline = time.perf_counter() + timeout
        seen = start
        while True:
            for t, name, body in self.signals[seen:]:
                if name == member and predicate(body):
                    return t, body
            seen = len(self.signals)
            left = deadline - time.perf_counter()
            if left <= 0:
                raise AssertionError(f"no {member} in {timeout} s; signals: {self.signals}")
            self._new.clear()
            try:
                await asyncio.wait_for(self._new.wait(), left)
            except TimeoutError:
                pass

    async def wait_status(self, predicate: Any, timeout: float, what: str) -> dict[str, Any]:
        timeout = wait_s(timeout)
        deadline = time.perf_counter() + timeout
        status = await self.status()
        while not predicate(status):
            if time.perf_counter() > deadline:
                raise AssertionError(f"{what} not reached in {timeout} s; last status {status}")
            await asyncio.sleep(0.02)
            status = await self.status()
        return status

    def close(self) -> None:
        self.bus.disconnect()
