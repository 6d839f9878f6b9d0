"""The host tier's fill at load, and the mapped file's pages given back once an expert's bytes
have been copied into a slot or a home (so that RAM holds each expert once)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

from strata.engine.experts.host import HostTier, HostTierStats
from strata.engine.experts.slots import ExpertKey
from strata.engine.experts.verify import Copy
from strata.engine.gguf_index import ExpertBlob, GGUFIndex

log = logging.getLogger(__name__)

MiB = 2**20

Progress = Callable[[int, int, str], None]  # (done, total, what)


class FilePages:
    """Gives back the file's pages of experts whose runs were copied out; ``released_bytes``
    counts them. A refusal is logged, never fatal: the pages are only cache."""

    def __init__(self, index: GGUFIndex) -> None:
        self.index = index
        self.released_bytes = 0

    def _runs(self, keys: Iterable[ExpertKey]) -> list[tuple[int, int]]:
        return [(r.offset, r.nbytes) for k in keys for r in self.index.expert(*k).runs]

    def release(self, keys: Sequence[ExpertKey]) -> None:
        """Give back the pages of these experts' runs (their bytes are in a slot or a home)."""
        try:
            self.released_bytes += self.index.release(self._runs(keys))
        except OSError as e:
            log.warning("could not give back the file pages of %d experts: %s", len(keys), e)

    def sweep(self, held: Iterable[ExpertKey]) -> None:
        """Once the load has copied every expert it could: give back the pages of all the
        experts that have a home again (``held``). Each copy's pages went back after it, but the
        kernel's readahead for later copies brings back pages of runs already given back
        (measured: 3-13 MiB of 192 MiB on a test file, varying run to run). Not counted in
        ``released_bytes``: these are the same runs."""
        try:
            self.index.release(self._runs(held))
        except OSError as e:
            log.warning("could not give back the file pages read ahead at load: %s", e)


def fill_tier(
    tier: HostTier,
    want: Sequence[ExpertKey],
    index: GGUFIndex,
    write_home: Callable[[int, ExpertBlob], None],
    sync: Callable[[], None],
    verify: Callable[[Sequence[Copy]], object],
    pages: FilePages,
    progress: Progress | None = None,
) -> None:
    """Give ``want`` (the hottest experts no slot holds, at most the tier's slots) homes in the
    tier, layer by layer: write each home (``write_home(home, blob)``), wait for the device
    (``sync``) before the tags say so, check the copies (``verify``), then give the file's
    pages of the layer back. ``progress`` hears of each layer."""
    by_layer: dict[int, list[ExpertKey]] = {}
    for key in want:
        by_layer.setdefault(key[0], []).append(key)
    slots = iter(tier.take(len(want)))
    n_layers = len(by_layer)
    for n, layer in enumerate(sorted(by_layer), 1):
        keys = sorted(by_layer[layer])
        homes = [next(slots) for _ in keys]
        for home, key in zip(homes, keys, strict=True):
            write_home(home, index.expert(*key))
        sync()  # every byte is in its home before its tag says so
        for home, key in zip(homes, keys, strict=True):
            tier.assign(home, key)
        verify([(k, "home", h) for k, h in zip(keys, homes, strict=True)])
        pages.release(keys)
        if progress is not None:
            progress(n, n_layers, f"host tier: layer {n} of {n_layers}")


def log_tier(
    stats: HostTierStats | None, pinned: bool, file_experts: int, slot_bytes: int, released: int
) -> None:
    """Log where the experts no slot holds live after the load."""
    if stats is None:
        log.info("no host tier: the %d experts no slot holds are read from the file",
                 file_experts)  # fmt: skip
        return
    log.info(
        "host tier: %d experts in RAM (%.0f MiB%s), room for %d more (%.0f MiB); %d experts "
        "(%.0f MiB) beyond the RAM budget are read from the file; %.0f MiB of file pages "
        "given back",
        stats.experts,
        stats.expert_bytes / MiB,
        ", page-locked for the GPU" if pinned else "",
        stats.slots - stats.experts,
        (stats.slots - stats.experts) * stats.slot_bytes / MiB,
        stats.file_experts,
        stats.file_experts * slot_bytes / MiB,
        released / MiB,
    )
