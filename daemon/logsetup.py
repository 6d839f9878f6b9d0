"""The one logging format of every Strata command. Library code logs; only the CLI prints.

Under systemd, when stderr is the journal (``JOURNAL_STREAM`` names stderr's device and inode),
each line starts with its syslog priority (``<4>`` for a warning) and carries no timestamp: the
journal adds its own, and ``journalctl --user -u strata -p warning`` then filters by level.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import TextIO

FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
JOURNAL_FORMAT = "<%(priority)d>%(levelname)s %(name)s: %(message)s"
# logging level -> syslog priority (sd-daemon(3))
PRIORITIES = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}


class JournalFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        record.priority = next(
            (p for lvl, p in PRIORITIES.items() if record.levelno >= lvl), PRIORITIES[logging.DEBUG]
        )
        # one record, one journal entry: continuation lines keep the record's priority
        text = super().format(record)
        prefix = f"<{record.priority}>"
        return text.replace("\n", "\n" + prefix)


def stderr_is_journal(stream: TextIO, environ: Mapping[str, str]) -> bool:
    """Whether ``stream`` is the journal stream systemd named in ``JOURNAL_STREAM`` (dev:inode)."""
    value = environ.get("JOURNAL_STREAM", "")
    dev, _, ino = value.partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


def setup_logging(level: str, environ: Mapping[str, str] | None = None) -> None:
    """Send records at ``level`` and above to stderr (stdout carries only generated text)."""
    env = os.environ if environ is None else environ
    handler = logging.StreamHandler(sys.stderr)
    if stderr_is_journal(sys.stderr, env):
        handler.setFormatter(JournalFormatter(JOURNAL_FORMAT))
    else:
        handler.setFormatter(logging.Formatter(FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
