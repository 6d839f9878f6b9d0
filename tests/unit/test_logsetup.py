"""Logging: the plain format on a terminal or file, syslog priorities when stderr is the journal."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from strata.daemon.logsetup import setup_logging, stderr_is_journal


def _journal_env_for(path: Path) -> dict[str, str]:
    st = os.stat(path)
    return {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}


@pytest.fixture
def stderr_file(tmp_path: Path) -> Iterator[Path]:
    """A file to stand in for stderr; tests swap it in themselves (pytest's capture swaps
    sys.stderr at the start of each phase, after fixtures ran)."""
    yield tmp_path / "stderr.log"
    logging.getLogger().handlers.clear()


def _swap_stderr(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stderr", path.open("w"))


def test_journal_stream_gets_priority_prefixes_and_no_timestamp(
    stderr_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _swap_stderr(stderr_file, monkeypatch)
    setup_logging("debug", _journal_env_for(stderr_file))
    log = logging.getLogger("strata.test")
    log.warning("room is short")
    log.info("resized\nsecond line")
    log.debug("detail")
    sys.stderr.flush()
    lines = stderr_file.read_text().splitlines()
    assert lines == [
        "<4>WARNING strata.test: room is short",
        "<6>INFO strata.test: resized",
        "<6>second line",
        "<7>DEBUG strata.test: detail",
    ]


def test_another_stream_keeps_the_plain_format(
    stderr_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _swap_stderr(stderr_file, monkeypatch)
    other = tmp_path / "other"
    other.write_text("")
    setup_logging("info", _journal_env_for(other))  # JOURNAL_STREAM names another file
    logging.getLogger("strata.test").warning("plain")
    sys.stderr.flush()
    (line,) = stderr_file.read_text().splitlines()
    assert line.endswith("WARNING strata.test: plain") and line[:4].isdigit()


@pytest.mark.parametrize("value", ["", "junk", "1:", ":2", "a:b"])
def test_malformed_journal_stream_is_not_the_journal(stderr_file: Path, value: str) -> None:
    stderr_file.write_text("")
    with stderr_file.open() as f:
        assert not stderr_is_journal(f, {"JOURNAL_STREAM": value})
