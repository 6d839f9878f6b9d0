"""Test-wide rules.

In CI (the environment variable ``CI`` set) a skipped test is a failure, unless it carries the
``gpu`` marker: a missing tool or test dependency must never pass silently. Everywhere, skips print
their reason (``-ra`` in pytest's options).
"""

from __future__ import annotations

import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("CI") and item.get_closest_marker("gpu") is None:
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, which must run every non-gpu test: {reason}"
