"""The daemon: ``Daemon`` is the API every edge (HTTP, D-Bus, ``strata-ctl``) calls — reserve,
borrow, return, revoke, status — thin over the engine worker (``worker.EngineWorker``, the
engine's own thread) and one VRAM controller per device. ``build`` makes these objects from the
configuration; ``strata.serve`` (the composition root) wires them to their edges and runs them.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from strata import paths
from strata.daemon.bounded import Bounded
from strata.daemon.config import StrataConfig
from strata.daemon.control.control import ControlConfig, ControlGroup, Outcome, VramController
from strata.daemon.control.leases import (
    MAX_LEASES,
    Cookies,
    InvalidArgument,
    Lease,
    LeaseBook,
    is_int,
)
from strata.daemon.control.policy import PolicyConfig
from strata.daemon.engine_port import first_if_none
from strata.daemon.status import (
    BusStatus,
    DaemonFacts,
    LeaseStatus,
    Status,
    StatusJson,
    build_status,
    lease_status,
)
from strata.daemon.status_feed import StatusFeed
from strata.daemon.worker import EngineWorker, State
from strata.engine.status import EngineStatus
from strata.errors import EXIT_CONFIG, EXIT_RUNTIME, ServiceError

if TYPE_CHECKING:
    from strata.vmm.monitor import VramMonitor

log = logging.getLogger(__name__)

MiB = 2**20


@dataclass
class BusLink:
    """The D-Bus edge's connection as the status shows it; ``ipc.dbus`` keeps it current.

    ``state``: ``off`` (no session bus when the daemon started: HTTP only), ``up`` (on the bus,
    owning the name), ``down`` (the connection was lost: reconnecting with backoff)."""

    state: str = "off"
    problem: str | None = None  # why it is off or down, or what the last attempt met
    reconnects: int = 0  # connections re-established since start

    def status(self) -> BusStatus:
        return BusStatus(self.state, self.problem, self.reconnects)


class Daemon:
    """The daemon API: what HTTP, D-Bus and ``strata-ctl`` call. Thin over the worker and the
    control plane; ``status()`` is the one status schema all of them return.

    Devices are a list: one controller per device (``controllers``, in the order of
    ``devices``; one without a split). A call that names no device means device 0, the first
    entry (``controller`` is kept for readers that name none)."""

    def __init__(
        self,
        config: StrataConfig,
        worker: EngineWorker,
        controller: VramController,
        model_path: Path | None,
        device: str,
        controllers: list[VramController] | None = None,
        devices: list[str] | None = None,
    ) -> None:
        self.config = config
        self.worker = worker
        self.controllers = list(controllers) if controllers else [controller]
        self.controller = self.controllers[0]
        self.controls = ControlGroup(self.controllers)
        self.model_path = model_path
        self.device = device
        self.devices = list(devices) if devices else [device]  # each stage's compute device
        self.listen_url = ""
        self.stopping = False
        self.started = time.time()
        self.dbus = BusLink()
        # more counted sizes, from the edges (the D-Bus edge's watched callers)
        self.size_sources: list[Callable[[], list[Bounded]]] = []
        # the status over time: its history and the change events of GET /v1/vram/events
        self.feed = StatusFeed()
        self._model_id: tuple[Path | None, str] | None = None  # (the path, its name) once asked

    # -- state ----------------------------------------------------------------------------------

    @property
    def state(self) -> str:
        if self.stopping:
            return "stopping"
        return "ready" if self.worker.state == State.READY else "loading"

    @property
    def model_id(self) -> str:
        # a library model's name, else its file's; looked up once per model (it reads the folder)
        known = self._model_id
        if known is None or known[0] != self.model_path:
            from strata.daemon import library
            from strata.daemon.engine_setup import models_dir

            name = library.name_of(self.model_path, models_dir(self.config))
            self._model_id = known = (self.model_path, name)
        return known[1]

    # -- the VRAM API ---------------------------------------------------------------------------

    def controller_for(self, device: int | None) -> VramController:
        """The controller of device number ``device`` (None: the first). An unknown number is
        :class:`InvalidArgument` naming it and the devices there are."""
        device = first_if_none(device)
        if not is_int(device) or not 0 <= device < len(self.controllers):
            there = ", ".join(f"{i} ({name})" for i, name in enumerate(self.devices))
            raise InvalidArgument(
                f"device {device!r}: no such device; Strata runs on {len(self.devices)} "
                f"device(s): {there}"
            )
        return self.controllers[device]

    async def reserve(self, mib: int, device: int | None = None) -> Outcome:
        return await self.controller_for(device).set_reserve(mib)

    async def borrow(
        self,
        mib: int,
        owner: str,
        pid: int | None,
        app_id: str,
        reason: str,
        device: int | None = None,
    ) -> Lease:
        return await self.controller_for(device).borrow(mib, owner, pid, app_id, reason)

    def _holder(self, cookie: int) -> VramController:
        """The controller whose book holds ``cookie`` (device 0's when none does: its book then
        says the cookie is unknown, naming it)."""
        for c in self.controllers:
            if is_int(cookie) and c.book.get(cookie) is not None:
                return c
        return self.controller

    def return_lease(self, cookie: int, owner: str) -> Lease:
        return self._holder(cookie).return_lease(cookie, owner, "returned")

    def revoke(self, cookie: int) -> Lease:
        return self._holder(cookie).return_lease(cookie, None, "revoked")

    def owner_vanished(self, owner: str) -> list[Lease]:
        return [lease for c in self.controllers for lease in c.owner_vanished(owner)]

    async def set_hold(self, source: str, mib: int | None) -> None:
        """A hold (GameMode's) applies to every device: which one a game draws on is not
        known."""
        for c in self.controllers:
            await c.set_hold(source, mib)

    def leases(self) -> list[LeaseStatus]:
        """Every lease of every device, in cookie order."""
        leases = [lease for c in self.controllers for lease in lease_status(c)]
        return sorted(leases, key=lambda lease: lease.cookie)

    def all_leases(self) -> list[StatusJson]:
        """``leases()`` as the status lists them (JSON objects)."""
        return [dataclasses.asdict(lease) for lease in self.leases()]

    # -- what grows with requests ---------------------------------------------------------------

    def sizes(self) -> list[Bounded]:
        """Each buffer and cache on the engine's and the control plane's side that grows with
        requests: its size now and its bound (``/metrics`` shows them)."""
        out = [
            Bounded("engine_jobs", "generations handed to the engine and not started, those "
                    "whose client left included until the next one drops them",
                    self.worker.held(), self.config.max_queued_requests + 1),
            Bounded("leases", "leases in the books (every device's)",
                    sum(len(c.book.leases()) for c in self.controllers), MAX_LEASES),
        ]  # fmt: skip
        port = self.worker.port
        if port is not None:
            e = port.status()
            out += [
                Bounded("kv_tokens", "positions the K/V cache holds (the prefix a next prompt "
                        "may reuse)", e.kv_tokens, e.n_ctx, "tokens"),
                Bounded("tokenizer_cache_words", "words the tokenizer's BPE caches may hold "
                        "(the library does not count them; words of 256 bytes or more are never "
                        "cached)", None, e.tokenizer_cache_words, "words"),
            ]  # fmt: skip
            out += _kv_sizes(e)
        held = self.worker.allocator.held_bytes()
        out.append(Bounded("malloc_held_bytes", "memory the C allocator holds for the process "
                           "(its heaps and mapped blocks; handed back after each request): "
                           "reported, no bound of its own", held, None, "bytes"))  # fmt: skip
        out += self.feed.sizes(self.config.max_requests_in_progress)
        for source in list(self.size_sources):
            out += source()
        return out

    def publish_status(self) -> None:
        """Hand the status to the feed: an event if it changed, a history sample when due."""
        self.feed.update(time.time(), self.status())

    # -- status ---------------------------------------------------------------------------------

    def read_status(self) -> Status:
        """The status schema (docs/status.md), typed."""
        port = self.worker.port
        facts = DaemonFacts(
            state=self.state,
            model=self.model_id,
            model_path=str(self.model_path) if self.model_path else None,
            listen=self.listen_url,
            dbus=self.dbus.status(),
            elastic_reserve_mib=self.config.elastic_reserve_mib,
            busy=self.worker.busy,
            queued=self.worker.queued(),
            generated_tokens=self.worker.tokens,
        )
        engine_status = port.status() if port is not None else None
        return build_status(facts, engine_status, self.controllers, self.devices)

    def status(self) -> StatusJson:
        """The status schema as JSON values (what HTTP, D-Bus and ``strata-ctl`` return)."""
        return self.read_status().to_json()

    def status_layers(self, number: int) -> str:
        """`` layers A-B`` of stage ``number`` once the model is loaded, else ""."""
        port = self.worker.port
        if port is None:
            return ""
        stage = port.status().stages[number]
        last = stage.first_layer + stage.layers - 1
        return f" layers {stage.first_layer}-{last}" if stage.layers else ""


# -- start-up pieces ----------------------------------------------------------------------------


def acquire_instance_lock(environ: dict[str, str] | None = None) -> int:
    """One daemon per user: an flock on a file in the runtime directory. Returns the fd."""
    env = os.environ if environ is None else environ
    runtime = env.get("XDG_RUNTIME_DIR") or f"/tmp/strata-{os.getuid()}"
    Path(runtime).mkdir(parents=True, exist_ok=True, mode=0o700)
    path = Path(runtime) / "strata.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ServiceError(
            f"another strata serve is running (pid {holder}, lock {path})", EXIT_RUNTIME
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def bind_socket(host: str, port: int) -> socket.socket:
    """The HTTP server's listening socket. Its protocol is named TCP: asyncio turns Nagle's
    algorithm off on each connection only where the socket says so, and without that a
    response's body waited for the client's delayed ACK of its headers on a kept-alive
    connection (40 ms a request on Linux)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ServiceError(f"port {port} on {host} is already in use", EXIT_RUNTIME) from None
        raise ServiceError(f"cannot listen on {host}:{port}: {e.strerror}", EXIT_CONFIG) from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _monitor_kind(config: StrataConfig, device: str) -> str:
    if config.vram_monitor != "auto":
        return config.vram_monitor
    return "nvml" if device.startswith("cuda") else "none"


def build(
    config: StrataConfig, progress: Callable[[int, int, str], None] | None = None
) -> tuple[Daemon, Callable[[], None]]:
    """The daemon's objects, not started yet: worker, monitor, controller, API."""
    from strata.daemon.engine_port import LoadedEngine
    from strata.daemon.engine_setup import engine_options, model_path, resolve_device_name
    from strata.engine.generate import Engine

    split = config.devices is not None
    names = list(config.devices) if config.devices is not None else [config.device]
    names = [resolve_device_name(name) for name in names]
    device = names[0]
    for name in names:
        require_gpu_packages(name)
    controllers: list[VramController] = []
    monitors = _monitors(config, names, controllers)
    path = config.model

    def load() -> LoadedEngine:
        nonlocal path
        path = model_path(config)
        daemon.model_path = path
        options = engine_options(config, device)
        if split:  # one stage per device: each gets its own arena and its own free VRAM
            factories = [_arena_factory(m) for m in monitors]
            factory: Any = None if all(f is None for f in factories) else factories
            free: Any = [_free_vram(m) for m in monitors]
        else:
            factory, free = _arena_factory(monitors[0]), _free_vram(monitors[0])
        return LoadedEngine(Engine.load(
            path,
            options,
            state_dir=paths.state_dir(),
            arena_factory=factory,
            progress=progress or log_progress,
            free_vram=free,
        ))  # fmt: skip

    worker = EngineWorker(load)
    controllers += _controllers(config, worker, names, monitors)
    daemon = Daemon(config, worker, controllers[0], path, device, controllers, names)

    def close() -> None:
        for monitor in monitors:
            monitor.close()

    return daemon, close


def _monitors(
    config: StrataConfig, names: list[str], controllers: list[VramController]
) -> list[VramMonitor]:
    """One VRAM monitor per device (NVML finds a CUDA device by its index, then its UUID);
    each counts as Strata's what that device's controller, once made, says it holds."""
    from strata.vmm.monitor import create_monitor

    monitors: list[VramMonitor] = []

    def ours(number: int) -> Callable[[], int]:
        return lambda: controllers[number].ours_bytes() if len(controllers) > number else 0

    try:
        for number, (name, file) in enumerate(zip(names, config.simulated_files(), strict=True)):
            index = int(name.partition(":")[2] or 0) if name.startswith("cuda") else 0
            monitors.append(create_monitor(
                _monitor_kind(config, name), ours=ours(number), device_index=index,
                simulated_file=file,
            ))  # fmt: skip
    except BaseException:
        for monitor in monitors:
            monitor.close()
        raise
    return monitors


def _controllers(
    config: StrataConfig, worker: EngineWorker, names: list[str], monitors: list[VramMonitor]
) -> list[VramController]:
    """One VRAM controller per device, in device order: one cookie sequence and one set of
    listeners for them all."""
    policy = PolicyConfig(
        elastic_reserve_mib=config.elastic_reserve_mib,
        elastic_stable_ms=config.elastic_stable_ms,
        elastic_shrink_step_mib=config.elastic_shrink_step_mib,
        vram_max_mib=config.vram_max_mib,
        idle_release_ms=config.idle_release_s * 1000,
    )
    control = ControlConfig(
        period_ms=config.elastic_period_ms, borrow_timeout_ms=config.borrow_timeout_ms
    )
    cookies, listeners = Cookies(), []
    controllers = []
    for number, (name, monitor) in enumerate(zip(names, monitors, strict=True)):
        controller = VramController(
            worker, monitor, policy, control, _fixed_bytes(name), on_gpu=name.startswith("cuda"),
            stage=number, book=LeaseBook(cookies), listeners=listeners,
        )  # fmt: skip
        if len(names) > 1:
            controller.where = f"device {number}, {name}"
        controllers.append(controller)
    return controllers


def log_progress(done: int, total: int, what: str) -> None:
    log.info("loading (%d/%d): %s", done, total, what)


def require_gpu_packages(device: str) -> None:
    """On a GPU, the arena and the host tier need ``cuda-bindings``: without it the model could
    not load, so the daemon stops here with the package and the command that installs it."""
    if not device.startswith("cuda"):
        return
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError as e:
        from strata.hints import install_hint

        raise ServiceError(
            f"computing on {device} needs the cuda-bindings package for the VRAM arena ({e}); "
            f"{install_hint('cuda-bindings')}",
            EXIT_CONFIG,
        ) from None


def _free_vram(monitor: Any) -> Callable[[], int | None]:
    """Free VRAM as the monitor sees it, for the automatic cache size at load (the engine's
    ``automatic_cache_mib`` decides; None: the engine asks CUDA, or there is no VRAM)."""

    def free() -> int | None:
        sample = monitor.sample()
        return sample.free_bytes if sample is not None else None

    return free


def _arena_factory(monitor: Any) -> Callable[[int, int], Any] | None:
    """On the simulated device the host arena asks the device before committing a chunk, so a
    grow beyond simulated free memory stops short as on a full GPU."""
    if monitor.kind != "simulated":
        return None
    from strata.vmm.host_arena import HostArena

    return lambda reserved, chunk: HostArena(reserved, chunk, commit=monitor.commit_guard())


def _fixed_bytes(device: str) -> Callable[[], int]:
    """The engine's own device memory besides the arena (weights, K/V, workspaces)."""
    if not device.startswith("cuda"):
        return lambda: 0
    import torch

    dev = torch.device(device)
    return lambda: int(torch.cuda.memory_reserved(dev))


def _kv_sizes(status: EngineStatus) -> list[Bounded]:
    """The K/V's bytes (every stage's): what is mapped, within the reservation made for the
    whole context at load, and the kept conversations, at most ``kv_keep_conversations``."""
    kvs = [stage.kv for stage in status.stages if stage.kv is not None]
    if not kvs:
        return []
    reserved = sum(kv.reserved_bytes for kv in kvs)
    kept = len(kvs[0].kept_tokens)  # every stage keeps the same conversations
    return [
        Bounded("kv_bytes", "bytes of K/V mapped: the active conversation, the kept ones and "
                "free pages", sum(kv.mapped_bytes for kv in kvs), reserved, "bytes"),
        Bounded("kv_kept_bytes", "K/V bytes only kept conversations hold (the prefixes later "
                "prompts may reuse)", sum(kv.kept_bytes for kv in kvs), reserved, "bytes"),
        Bounded("kv_kept_conversations", "conversations kept for prefix reuse", kept,
                kvs[0].keep, "conversations"),
    ]  # fmt: skip
