"""The command line moved to ``strata.cli`` (the composition root, above ``daemon`` and
``ipc``); this name stays for its importers outside the daemon (tests, installed console scripts
made before the move). A re-export only: tests/unit/test_daemon_layers.py allows nothing else."""

from strata.cli import main

__all__ = ["main"]
