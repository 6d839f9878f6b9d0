"""Test-wide rules.

In CI (the environment variable ``CI`` set) a skipped test is a failure, unless it carries the
``gpu`` marker or the ``isa`` marker (the CPU lacks the instructions: hardware, not a missing
tool): a missing tool or test dependency must never pass silently. Everywhere, skips print
their reason (``-ra`` in pytest's options).

A test that hangs ends the run with its threads' stacks (``faulthandler_timeout`` in
pyproject.toml); so does a thread a test left running, which would otherwise keep the finished
run's process alive: after the session, the process has ``EXIT_GRACE_S`` to end.
"""

from __future__ import annotations

import faulthandler
import os

import pytest

EXIT_GRACE_S = 120  # a hang guard, not a timing
_stderr: int | None = None  # the real standard error, taken before any test captures it


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    global _stderr
    _stderr = os.dup(2)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if _stderr is not None:
        # cancelled by nothing: the process ends first, or the stacks show what held it
        faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True, file=_stderr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    outcome = yield
    report = outcome.get_result()
    exempt = item.get_closest_marker("gpu") or item.get_closest_marker("isa")
    if report.skipped and os.environ.get("CI") and exempt is None:
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, which must run every non-gpu test: {reason}"
