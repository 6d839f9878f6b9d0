"""The real daemon as a subprocess, on a private session bus, with a simulated VRAM device.

``PrivateBus`` starts ``dbus-daemon --print-address --print-pid`` with its own configuration (and
an optional activation directory). ``StrataDaemon`` starts ``python -m strata serve --port 0`` with
private XDG directories, waits until ``/health`` says ready (or only until it listens), and keeps
the daemon's log; the ``daemon_log_on_failure`` fixture prints it when a test fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.helpers import require_tool

READY_TIMEOUT_S = 90.0

BUS_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <listen>unix:tmpdir={tmp}</listen>
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
    """A private session bus; ``address`` goes into ``DBUS_SESSION_BUS_ADDRESS``."""

    def __init__(self, tmp: Path, service_dir: Path | None = None, env: Mapping[str, str] = {}):
        require_tool("dbus-daemon")
        tmp.mkdir(parents=True, exist_ok=True)
        servicedir = f"<servicedir>{service_dir}</servicedir>" if service_dir else ""
        config = tmp / "bus.conf"
        config.write_text(BUS_CONFIG.format(tmp=tmp, servicedir=servicedir))
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
    """``strata serve`` as a subprocess. ``args`` are extra command-line options."""

    def __init__(
        self,
        tmp: Path,
        args: Sequence[str] = (),
        env: Mapping[str, str] = {},
        wait: str = "ready",
    ) -> None:
        self.tmp = tmp
        self.log_path = tmp / f"daemon-{time.monotonic_ns()}.log"
        self._log = self.log_path.open("w")
        self.env = daemon_env(tmp, env)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "strata", "serve", "--port", "0", "--log-level", "debug",
             *args],
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
                self.proc.wait(timeout)
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
