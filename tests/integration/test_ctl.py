"""``strata-ctl`` as a user runs it, against the real daemon on a private bus.

One daemon serves the whole module (its start costs seconds); each test starts from a daemon with
no lease and returns what it borrowed. Sizes as in test_dbus: a 48 MiB cache (24 MiB core) and
the K/V's first 2 MiB chunk on a 602 MiB simulated device where another program holds 64 MiB, so
488 MiB are free and a lease of 512 MiB makes the cache shrink.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import (
    ClientProcess,
    PrivateBus,
    StrataDaemon,
    bus_env,
    daemon_env,
    simulated_device_args,
    strata_ctl,
    strata_ctl_command,
    write_simulated,
)


@pytest.fixture(scope="module")
def shared(
    module_bus: PrivateBus, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StrataDaemon]:
    tmp = tmp_path_factory.mktemp("strata")
    write_simulated(tmp / "device.json", 602, [(4242, 64)])  # 2 MiB: the K/V's first chunk
    d = StrataDaemon(tmp, simulated_device_args(tmp / "device.json", tiny_model),
                     env=bus_env(module_bus))  # fmt: skip
    yield d
    d.stop()


@pytest.fixture
def strata(shared: StrataDaemon, logs_on_failure: list[StrataDaemon]) -> StrataDaemon:
    """The module's daemon, with no lease left by an earlier test; its log shown on failure."""
    logs_on_failure.append(shared)
    shared.wait_for(lambda s: s["leases"] == [], 30, "no leases")
    return shared


@pytest.fixture
def env(module_bus: PrivateBus, tmp_path: Path) -> dict[str, str]:
    """A client's environment: on the module's bus."""
    return daemon_env(tmp_path, bus_env(module_bus))


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_status_prints_a_table_and_the_status_schema_as_json(
    strata: StrataDaemon, env: dict[str, str]
) -> None:
    r = strata_ctl("status", env=env)
    assert r.returncode == 0, r.stderr
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in r.stdout.splitlines())
    assert rows["state"] == "ready" and rows["model"] == strata.status()["model"]
    assert rows["device"].startswith("simulated")
    assert rows["cache"].startswith("48 MiB = core 24 MiB + tail 24 MiB")
    assert rows["free VRAM"].startswith("488 MiB of 602 MiB")
    assert rows["reserve"].startswith("0 MiB run-time")
    assert rows["borrowed"] == "0 MiB in 0 lease(s)"
    for argv in (["status", "--json"], ["--json", "status"]):
        r = strata_ctl(*argv, env=env)
        assert r.returncode == 0, r.stderr
        status = json.loads(r.stdout)
        http = strata.status()
        assert set(status) == {k for k, v in http.items() if v is not None}
        assert (status["state"], status["cache_mib"], status["leases"]) == ("ready", 48, [])
    r = strata_ctl("leases", env=env)
    assert (r.returncode, r.stdout.strip()) == (0, "no leases")
    r = strata_ctl("leases", "--json", env=env)
    assert (r.returncode, json.loads(r.stdout)) == (0, [])


def test_borrow_holds_the_lease_while_the_command_runs(
    strata: StrataDaemon, env: dict[str, str]
) -> None:
    proc = subprocess.Popen([*strata_ctl_command(), "borrow", "512", "--", "sleep", "5"], env=env,
                            stdin=subprocess.DEVNULL)  # fmt: skip
    # the lease is in the book before the engine thread has shrunk the cache for it, and free_mib
    # is the last check's: wait for all three
    status = strata.wait_for(
        lambda s: s["leases"] and s["cache_mib"] == 24 and s["free_mib"] >= 512, 10,
        "the lease and the shrink for it",
    )  # fmt: skip
    (lease,) = status["leases"]
    assert (lease["mib"], lease["app_id"], lease["reason"]) == (512, "sleep", "sleep 5")
    assert lease["pid"] == proc.pid
    assert proc.wait(60) == 0
    assert strata.status()["leases"] == []  # returned before strata-ctl exited


def test_borrow_exits_with_the_commands_code(strata: StrataDaemon, env: dict[str, str]) -> None:
    r = strata_ctl("borrow", "64", "--app-id", "org.example.Job", "--reason", "exit test", "--",
                   "sh", "-c", "exit 3", env=env)  # fmt: skip
    assert r.returncode == 3, r.stderr
    r = strata_ctl("borrow", "64", "--", "sh", "-c", "kill -TERM $$", env=env)
    assert r.returncode == 128 + signal.SIGTERM, r.stderr
    r = strata_ctl("borrow", "64", "--", "/nonexistent/program", env=env)
    assert r.returncode == 127 and "command not found: /nonexistent/program" in r.stderr
    assert strata.status()["leases"] == []


def test_sigkill_of_strata_ctl_returns_the_lease(strata: StrataDaemon, env: dict[str, str]) -> None:
    ctl = ClientProcess([*strata_ctl_command(), "borrow", "512", "--", "sleep", "30"], env,
                        new_session=True)  # fmt: skip
    try:
        strata.wait_for(lambda s: s["leases"], 10, "the lease")
        killed = time.monotonic()
        ctl.proc.send_signal(signal.SIGKILL)
        strata.wait_for(lambda s: s["leases"] == [], 30, "the lease returned")
        print(
            f"\nstrata-ctl SIGKILL to its lease gone: {(time.monotonic() - killed) * 1000:.0f} ms"
        )
    finally:
        os.killpg(ctl.proc.pid, signal.SIGKILL)  # the orphaned sleep
        ctl.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_are_forwarded_to_the_command_then_the_lease_returned(
    sig: signal.Signals, strata: StrataDaemon, env: dict[str, str]
) -> None:
    script = f"trap 'exit 7' {sig.name[3:]}; echo started; while :; do sleep 0.05; done"
    ctl = ClientProcess([*strata_ctl_command(), "borrow", "100", "--", "sh", "-c", script], env)
    try:
        assert ctl.line() == "started"
        assert strata.status()["leases"]
        ctl.proc.send_signal(sig)
        assert ctl.proc.wait(10) == 7
        assert strata.status()["leases"] == []
    finally:
        ctl.close()


def test_reserve_and_return_commands(strata: StrataDaemon, env: dict[str, str]) -> None:
    r = strata_ctl("reserve", "100", env=env)
    assert r.returncode == 0 and r.stdout.startswith("run-time reserve: 100 MiB"), r.stderr
    assert strata.status()["reserve_mib"] == 100
    assert strata_ctl("reserve", "0", env=env).returncode == 0
    assert strata.status()["reserve_mib"] == 0
    r = strata_ctl("reserve", "100000", env=env)
    assert r.returncode == 1 and "org.strata.Error.NotEnoughVram" in one_line_error(r)

    holder = ClientProcess([*strata_ctl_command(), "borrow", "100", "--", "sleep", "30"], env,
                           new_session=True)  # fmt: skip
    try:
        (lease,) = strata.wait_for(lambda s: s["leases"], 10, "the lease")["leases"]
        r = strata_ctl("leases", env=env)
        header, row = r.stdout.splitlines()
        assert header.split()[:3] == ["COOKIE", "MIB", "APP"]
        assert row.split()[:3] == [str(lease["cookie"]), "100", "sleep"]
        r = strata_ctl("return", str(lease["cookie"]), env=env)
        assert r.returncode == 0 and r.stdout.strip() == f"lease {lease['cookie']} returned"
        assert strata.status()["leases"] == []
        r = strata_ctl("return", str(lease["cookie"]), env=env)
        assert r.returncode == 1
        assert f"no lease with cookie {lease['cookie']}" in one_line_error(r)
    finally:
        os.killpg(holder.proc.pid, signal.SIGKILL)
        holder.close()


def test_watch_prints_resizes_leases_and_changes(strata: StrataDaemon, env: dict[str, str]) -> None:
    strata.wait_for(lambda s: s["cache_mib"] == 48, 10, "the full cache")
    watch = ClientProcess([*strata_ctl_command(), "watch"], env)
    try:
        assert "watching Strata: ready" in watch.line()
        r = strata_ctl("borrow", "512", "--", "true", env=env)
        assert r.returncode == 0, r.stderr
        watch.wait_line(lambda line: "CacheResized cache_mib=24 free_mib=512" in line)
        watch.wait_line(lambda line: "PropertiesChanged" in line and "BorrowedMiB=512" in line)
        watch.wait_line(lambda line: "LeaseReturned cookie=" in line and "why=returned" in line)
        watch.wait_line(lambda line: "PropertiesChanged BorrowedMiB=0 Leases=[]" in line)
        watch.wait_line(lambda line: "CacheResized cache_mib=48" in line)
        watch.proc.send_signal(signal.SIGINT)
        assert watch.proc.wait(5) == 0
    finally:
        watch.close()


def test_says_the_daemon_is_not_running(bus: PrivateBus, tmp_path: Path) -> None:
    r = strata_ctl("status", env=daemon_env(tmp_path, bus_env(bus)))
    assert r.returncode == 1
    line = one_line_error(r)
    assert line.startswith("strata-ctl: Strata is not running") and "org.strata.Strata1" in line
    r = strata_ctl("borrow", "10", "--", "true", env=daemon_env(tmp_path))  # no bus at all
    assert r.returncode == 1
    assert "no session bus" in one_line_error(r)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["reserve", "abc"], "'abc'"),
        (["reserve", "-1"], "'-1'"),
        (["borrow", "0", "--", "true"], "'0'"),
        (["borrow", "1.5", "--", "true"], "'1.5'"),
        (["borrow", "512"], "no COMMAND"),
        (["borrow", "512", "--timeout", "soon", "--", "true"], "'soon'"),
        (["return", "abc"], "'abc'"),
        (["return", "0"], "'0'"),
        (["return", "4294967296"], "'4294967296'"),
        (["status", "--", "x"], "'x'"),
        (["frobnicate"], "'frobnicate'"),
    ],
)
def test_bad_arguments_exit_2_naming_the_value(argv: list[str], named: str, tmp_path: Path) -> None:
    r = strata_ctl(*argv, env=daemon_env(tmp_path))
    assert r.returncode == 2, r.stderr
    assert named in one_line_error(r)


def test_output_into_a_reader_that_left_ends_quietly(
    strata: StrataDaemon, env: dict[str, str]
) -> None:
    """`strata-ctl --json status | head -1`: no traceback, and the shell's exit code for it."""
    from tests.integration.test_packaging import closed_pipe_run

    for argv in (["--json", "status"], ["status"], ["leases", "--json"]):
        r = closed_pipe_run([*strata_ctl_command(), *argv], env)
        assert (r.returncode, r.stderr) == (141, ""), (argv, r.stderr)
    r = subprocess.run(["sh", "-c", shlex.join(strata_ctl_command()) + " --json status | head -1"],
                       env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0 and r.stdout == "{\n" and r.stderr == "", r.stderr
