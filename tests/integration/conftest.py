"""Integration fixtures: the daemon's log is printed when a test that ran one fails."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import PrivateBus, StrataDaemon


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
