"""Integration fixtures: the daemon's log is printed when a test that ran one fails."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import PrivateBus, StrataDaemon


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "fuzz: the hostile-request corpus replayed against one real daemon (test_fuzz_corpus.py; "
        "select it with -m fuzz)",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.stash[_FAILED] = report.failed


_FAILED = pytest.StashKey[bool]()


@pytest.fixture
def daemons(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[list[StrataDaemon]]:
    """Daemons a test starts go in this list: stopped afterwards, logs shown on failure."""
    started: list[StrataDaemon] = []
    yield started
    for d in started:
        d.stop()
    if request.node.stash.get(_FAILED, False):
        for d in started:
            print(f"\n----- daemon log {d.log_path} -----\n{d.log}")


@pytest.fixture
def bus(tmp_path: Path) -> Iterator[PrivateBus]:
    b = PrivateBus(tmp_path / "bus")
    yield b
    b.close()


@pytest.fixture(scope="module")
def module_bus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateBus]:
    """One private bus for a module's shared daemon and the tests that talk to it."""
    b = PrivateBus(tmp_path_factory.mktemp("bus"))
    yield b
    b.close()


@pytest.fixture(autouse=True)
def _no_user_session_bus(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test talks to the user's own session bus: a daemon run in-process would otherwise take
    ``org.strata.Strata1`` there (or fail because the user's Strata has it). An address that
    leads nowhere also stops the fallback to ``$XDG_RUNTIME_DIR/bus``. Tests that want a bus
    start a ``PrivateBus`` and pass its address explicitly."""
    monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", "unix:path=/nonexistent/strata-test-no-bus")


@pytest.fixture
def logs_on_failure(request: pytest.FixtureRequest) -> Iterator[list[StrataDaemon]]:
    """Daemons of a wider scope (a module's shared daemon) whose log a failing test prints."""
    shown: list[StrataDaemon] = []
    yield shown
    if request.node.stash.get(_FAILED, False):
        for d in shown:
            print(f"\n----- daemon log {d.log_path} -----\n{d.log}")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic tiny-qwen3moe GGUF: 32 experts of 1.5 MiB (48 MiB of routed experts)."""
    from strata.engine.synth import ensure_synthetic

    return ensure_synthetic("tiny-qwen3moe", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def slow_loading_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a 151,936-token vocabulary (Qwen3's): seconds of loading, so that the
    "loading" state (503 from /health, State on D-Bus, no READY=1) can be observed."""
    import dataclasses

    from strata.engine import synth

    spec = dataclasses.replace(synth.PRESETS["tiny-qwen3moe"], vocab_size=151_936)
    path = tmp_path_factory.mktemp("models") / "big-vocab.gguf"
    types = synth.TypePlan.uniform(synth.Q.F16)
    return synth.write_model(path, spec, synth.vocab_for("qwen3moe"), types, seed=3)


@pytest.fixture(autouse=True)
def _daemon_logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a failed test, the last 80 lines of each daemon it used (module fixtures too)."""
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed == failed:
        return
    for name, value in getattr(request.node, "funcargs", {}).items():
        if isinstance(value, StrataDaemon):
            print(f"\n----- daemon log of {name} (last 80 lines) -----")
            print("\n".join(value.log.splitlines()[-80:]))
