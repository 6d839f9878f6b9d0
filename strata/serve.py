"""``strata serve``: the composition root that wires the daemon (``strata.daemon.service``) to its
edges — HTTP (``daemon.http``), D-Bus and GameMode (``strata.ipc``), systemd's notifications —
and runs them on one asyncio loop until SIGTERM/SIGINT. It sits above ``daemon`` and ``ipc`` so
that neither imports the other's start-up: the daemon knows nothing of D-Bus.

Exit codes (``strata.errors``): 0 after SIGTERM/SIGINT, 1 when another instance runs or the port
is taken, 2 for a configuration error or a model that cannot be loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from strata.daemon.config import LoadedConfig, StrataConfig
from strata.daemon.describe import describe_path
from strata.daemon.sdnotify import Notifier, http_status, watchdog_loop
from strata.daemon.service import (
    Daemon,
    acquire_instance_lock,
    bind_socket,
    build,
    log_progress,
)
from strata.engine.errors import EngineError
from strata.errors import EXIT_CONFIG, EXIT_RUNTIME, ServiceError
from strata.ipc.dbus import DbusEdge, start_dbus
from strata.ipc.gamemode import GameModeWatcher, start_gamemode

log = logging.getLogger("strata.daemon.service")  # the name the daemon's log lines always had

STOP_TIMEOUT_S = 4.0  # SIGTERM to exit: well inside systemd's and the tests' 5 s
LOAD_STEP_TIMEOUT_S = 300.0  # each load step gives systemd's start timeout this much more time
READY_PROBE_TIMEOUT_S = 10.0  # model loaded to /health answering 200 on our own socket
FEED_PERIOD_S = 0.5  # the status is looked at this often for changes no event announces

Started = Callable[[Daemon, asyncio.Event], None]


@dataclass
class _Wired:
    """What start-up made, for the shutdown to undo in order."""

    lock_fd: int
    sock: socket.socket
    daemon: Daemon
    close_monitor: Callable[[], None]
    dbus: DbusEdge | None
    gamemode: GameModeWatcher | None


# -- telling systemd (sd_notify) ----------------------------------------------------------------


def _progress_to(notifier: Notifier) -> Callable[[int, int, str], None]:
    """Load progress, logged and sent as ``STATUS=`` with more start time for each step (engine
    thread): a large model may load for longer than ``TimeoutStartSec=``, a hung step may not."""

    def progress(done: int, total: int, what: str) -> None:
        log_progress(done, total, what)
        notifier.status(f"loading ({done}/{total}): {what}")
        notifier.extend_timeout(LOAD_STEP_TIMEOUT_S)

    return progress


def _status_text(daemon: Daemon, cache_mib: int | None = None, free_mib: int | None = None) -> str:
    status = daemon.read_status()
    cache_mib = status.cache_mib if cache_mib is None else cache_mib
    free_mib = status.free_mib if free_mib is None else free_mib
    free = f", {free_mib} MiB VRAM free" if free_mib is not None else ""
    return f"serving {daemon.model_id} on {daemon.device}: expert cache {cache_mib} MiB{free}"


async def _announce_ready(daemon: Daemon, notifier: Notifier, host: str, port: int) -> None:
    """``READY=1`` once a real ``GET /health`` on our own socket answers 200."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + READY_PROBE_TIMEOUT_S
    while (code := await http_status(host, port, "/health")) != 200:
        if loop.time() > deadline:
            log.error("GET /health does not answer 200 (last: %s): not telling systemd", code)
            notifier.status(f"the HTTP endpoint does not answer (GET /health: {code})")
            return
        await asyncio.sleep(0.05)
    notifier.ready(_status_text(daemon))

    def on_event(name: str, fields: dict[str, Any]) -> None:
        if name == "cache_resized" and fields.get("device", 0) == 0:
            notifier.status(_status_text(daemon, fields["cache_mib"], fields["free_mib"]))

    daemon.controller.listeners.append(on_event)


# -- the main loop ------------------------------------------------------------------------------


async def _wire(config: StrataConfig, notifier: Notifier) -> _Wired:
    """One instance (the lock), the socket, the daemon's objects, the D-Bus edge (the name is
    owned while the model loads: State says "loading") and GameMode's watcher."""
    from strata.vmm.errors import MonitorError

    lock_fd = acquire_instance_lock()
    try:
        sock = bind_socket(config.host, config.port)
        daemon, close_monitor = build(config, _progress_to(notifier))
        edge = await start_dbus(daemon)
        gamemode = None
        if config.gamemode_reserve_mib is not None:
            gamemode = await start_gamemode(daemon, edge, config.gamemode_reserve_mib)
    except MonitorError as e:
        os.close(lock_fd)
        raise ServiceError(str(e), EXIT_CONFIG) from None
    except BaseException:
        os.close(lock_fd)
        raise
    return _Wired(lock_fd, sock, daemon, close_monitor, edge, gamemode)


async def _serve_until_stopped(
    wired: _Wired, notifier: Notifier, stop: asyncio.Event, host: str, port: int
) -> tuple[int, list[asyncio.Task[None]]]:
    """Wait for the model (or ``stop``); once loaded, run each device's control loop and tell
    systemd, then wait for ``stop``. The exit code (0, or why the model could not load) and
    the tasks the shutdown cancels."""
    daemon = wired.daemon
    ready = asyncio.wrap_future(daemon.worker.ready)
    stopped = asyncio.create_task(stop.wait())
    tasks: list[asyncio.Task[None]] = [stopped]
    done, _ = await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
    err = ready.exception() if ready in done else None
    if err is not None:
        log.error("cannot load the model: %s", err)
        notifier.status(f"cannot load the model: {err}")
        return (EXIT_CONFIG if isinstance(err, EngineError) else EXIT_RUNTIME), tasks
    if ready in done:
        log.info("ready: %s on %s", daemon.model_id, daemon.device)
        log.info("%s", describe_path(daemon))
        tasks += [
            asyncio.create_task(c.run(), name=f"vram-control-{c.stage}") for c in daemon.controllers
        ]
        # READY=1 last: the D-Bus name is owned (above) and GET /health answers 200 (below).
        if notifier.enabled:
            tasks.append(asyncio.create_task(_announce_ready(daemon, notifier, host, port)))
        await stopped
    return 0, tasks


async def _shut_down(
    wired: _Wired, server_task: asyncio.Task[None], should_exit: Callable[[], None]
) -> None:
    """The event streams send the "stopping" status and end (so no response holds the server
    up), the edges go (D-Bus: State "stopping", then the name), the engine stops."""
    daemon = wired.daemon
    daemon.feed.close(time.time(), daemon.status())
    if wired.gamemode is not None:
        await wired.gamemode.close()
    if wired.dbus is not None:
        await wired.dbus.close()  # leases end with the daemon
    should_exit()
    await asyncio.to_thread(daemon.worker.stop, STOP_TIMEOUT_S)
    with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
        await asyncio.wait_for(server_task, 1.0)
    wired.close_monitor()
    os.close(wired.lock_fd)


async def serve_async(config: StrataConfig, started: Started | None = None) -> int:
    """Run the daemon until SIGTERM/SIGINT (or ``stop`` is set); returns the exit code.
    ``started(daemon, stop)`` is called once everything is wired (tests run the daemon in-process
    through it)."""
    import uvicorn

    from strata.daemon.api.http import create_app

    notifier = Notifier.from_env()
    wired = await _wire(config, notifier)
    daemon = wired.daemon
    host, port = wired.sock.getsockname()[:2]
    daemon.listen_url = f"http://{host}:{port}"
    log.info("listening on %s", daemon.listen_url)
    watchdog = asyncio.create_task(watchdog_loop(notifier), name="sd-watchdog")
    notifier.status(f"loading the model; listening on {daemon.listen_url}")
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(daemon), log_config=None, lifespan="off", access_log=False,
            timeout_notify=30,
        )
    )  # fmt: skip
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(RuntimeError, ValueError):  # not the main thread: in-process
            loop.add_signal_handler(sig, stop.set)
    for controller in daemon.controllers:
        controller.bind(loop)
    # the controller's events (a reserve, a lease, a resize) reach the feed at once; the rest
    # (free memory, hit rate, a generation's start and end) within FEED_PERIOD_S
    daemon.controller.listeners.append(lambda name, fields: daemon.publish_status())
    feed_task = asyncio.create_task(_feed_loop(daemon), name="status-feed")
    server_task = asyncio.create_task(server.serve(sockets=[wired.sock]), name="http")
    daemon.worker.start()
    if started is not None:
        started(daemon, stop)
    code, tasks = await _serve_until_stopped(wired, notifier, stop, host, port)
    log.info("stopping")
    notifier.stopping()
    daemon.stopping = True
    for task in (*tasks, feed_task):
        task.cancel()

    def should_exit() -> None:
        server.should_exit = True

    await _shut_down(wired, server_task, should_exit)
    watchdog.cancel()
    notifier.close()
    log.info("stopped")
    return code


async def _feed_loop(daemon: Daemon) -> None:
    while True:
        try:
            daemon.publish_status()
        except Exception:
            log.exception("reading the status for its history failed")
        await asyncio.sleep(FEED_PERIOD_S)


def run(loaded: LoadedConfig) -> int:
    """``strata serve`` with the loaded configuration: the exit code."""
    try:
        return asyncio.run(serve_async(loaded.config))
    except ServiceError as e:
        log.error("%s", e)
        return e.code
