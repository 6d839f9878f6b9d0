"""``verify_experts``'s book: each expert's checksum from its first copy at load, checked against
every later copy (after a fill, a move, an exchange, and on samples at use).

The book only sums and compares; the cache builds the views (where each copy lies) and drops
the copies the book finds wrong.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from strata.engine.experts.checksum import Checksummer
from strata.engine.experts.slots import ExpertKey

log = logging.getLogger(__name__)

Copy = tuple[ExpertKey, str, int]  # (expert, "slot" or "home", the slot it lies in)


class Verifier:
    """Checksums of expert copies against the first copy's (``enabled`` off: nothing is summed).
    ``corrupt`` counts the copies found wrong."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.sums: dict[ExpertKey, int] = {}
        self.corrupt = 0
        self._summer = Checksummer()

    def wants(self, copies: Sequence[Copy]) -> bool:
        """Whether ``check`` would sum anything of ``copies`` (build their views only then)."""
        return self.enabled and bool(copies)

    def known(self, copies: Sequence[Copy]) -> list[Copy]:
        """The copies whose experts have a checksum from load."""
        return [c for c in copies if c[0] in self.sums]

    def check(self, copies: Sequence[Copy], views: Sequence[torch.Tensor]) -> list[Copy]:
        """Sum each copy's bytes (``views``, one per copy, where it lies); the first copy of an
        expert records its sum, a later one that disagrees is counted, logged naming the
        expert, and returned (for the caller to drop)."""
        if not self.enabled or not copies:
            return []
        bad = []
        for copy, got in zip(copies, self._summer.checksums(views), strict=True):
            key, where, slot = copy
            if self.sums.setdefault(key, got) == got:
                continue
            bad.append(copy)
            self.corrupt += 1
            log.error(
                "(layer %d, expert %d): its bytes in %s %d do not match its checksum from load; "
                "that copy is dropped and never used, the expert is read from the file",
                key[0], key[1], "VRAM slot" if where == "slot" else "host slot", slot,
            )  # fmt: skip
        return bad

    def close(self) -> None:
        self._summer.close()
