"""The processors ``/proc/cpuinfo`` lists, parsed once for every reader: the CPU's name (the
bench), its physical cores (the default thread count) and what ``-march=native`` compiles for
(the CPU expert library's cache key). Plain Python."""

from __future__ import annotations

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
