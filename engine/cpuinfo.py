"""The processors ``/proc/cpuinfo`` lists, parsed once for every reader: the CPU's name (the
bench), its physical cores (the default thread count) and what ``-march=native`` compiles for
(the CPU expert library's cache key). Plain Python."""

from __future__ import annotations

import os
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def processors(path: Path = CPUINFO) -> list[dict[str, str]]:
    """Each processor's block of ``path``, in order, as lower-cased keys to their values (runs
    of white space made one space); ``[]`` where the file cannot be read."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    blocks: list[dict[str, str]] = []
    block: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip().lower()
        if not key:  # a blank line ends a block
            if block:
                blocks.append(block)
            block = {}
        elif sep:
            block.setdefault(key, " ".join(value.split()))
    if block:
        blocks.append(block)
    return blocks


def physical_cores() -> int:
    """Physical cores (not hyper-threads) from /proc/cpuinfo, or the logical count as fallback."""
    pairs = {
        (p["physical id"], p["core id"])
        for p in processors()
        if "physical id" in p and "core id" in p
    }
    return len(pairs) or os.cpu_count() or 1


def default_threads() -> int:
    """The CPU expert kernels' default thread count: one per physical core but one."""
    return max(1, physical_cores() - 1)
