"""What grows with requests, as ``/metrics`` reports it: plain data, importable by every edge
(the D-Bus edge too, which ``strata-ctl`` loads: nothing heavy here)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Bounded:
    """Something that grows with requests: its size now (None where it cannot be counted) and
    the most it can reach (None where no bound applies), in ``unit``."""

    name: str
    help: str
    size: int | None
    limit: int | None
    unit: str = ""


Sizes = Callable[[], list[Bounded]]
