"""The daemon's exit codes and the error that carries one: where the daemon (which raises it while
starting) and its edges (the D-Bus edge, when the bus name is taken) both can import them.

Exit codes of ``strata serve``: 0 after SIGTERM/SIGINT, 1 when another instance runs or the port
is taken (a run-time failure), 2 for a configuration error or a model that cannot be loaded (the
systemd unit does not restart on 2).
"""

from __future__ import annotations

EXIT_RUNTIME = 1
EXIT_CONFIG = 2


class ServiceError(Exception):
    """A reason the daemon cannot start; ``code`` is its exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code
