"""The expert provider: the one seam between the MoE layer and where expert weights live.

The MoE layer asks ``provider.expert(layer, expert)`` for the three matrices of a routed expert and
calls ``provider.step()`` once per forward pass. The file provider here hands out views of the
memory-mapped GGUF (uploaded to the compute device when that is a GPU); the expert cache
(``cache.ExpertCache``) serves the same protocol from its arena slots.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

import torch

from strata.engine.experts.slots import ExpertKey, UsageCounts
from strata.engine.experts.staging import PinnedStager
from strata.engine.gguf_index import ExpertBlob, GGUFIndex
from strata.engine.quant import repack_into
from strata.engine.quant.expert_layout import kernel_layout, slot_bytes_for
from strata.engine.weights import QWeight, Weight

log = logging.getLogger(__name__)

# Decayed usage halves every this many forward steps: recent routing dominates what the cache
# keeps, without forgetting a whole conversation's worth of history at once.
USAGE_HALF_LIFE_STEPS = 1024


@dataclass(frozen=True)
class ExpertWeights:
    gate: Weight  # [F, D]
    up: Weight  # [F, D]
    down: Weight  # [D, F]


@dataclass
class ProviderStats:
    """Counters since the provider was made: expert fetches, and bytes read from each tier."""

    cached: bool = False  # whether a cache stands in front of RAM and the file at all
    hits: int = 0
    misses: int = 0
    bytes_from_cache: int = 0
    bytes_from_ram: int = 0
    bytes_from_file: int = 0
    # GPU decode: experts copied from RAM ahead of their layer's routing, and those then chosen
    prefetched: int = 0
    prefetch_used: int = 0
    bytes_prefetched_unused: int = 0  # not in bytes_from_ram: that counts what steps read
    # GPU decode with ``cpu_share``: chosen RAM experts the CPU computed (counted as misses and
    # in bytes_from_ram too: the CPU read them there, instead of the GPU over PCIe)
    cpu_computed: int = 0
    bytes_cpu: int = 0

    @property
    def hit_rate(self) -> float | None:
        total = self.hits + self.misses
        return self.hits / total if total else None


class ExpertProvider(Protocol):
    stats: ProviderStats
    usage: UsageCounts  # decayed counts: what is hot now
    totals: Counter[ExpertKey]  # plain counts of this run: what the profile keeps

    def expert(self, layer: int, expert: int) -> ExpertWeights: ...

    def record_counts(self, counts: dict[ExpertKey, int]) -> None: ...

    def step(self) -> None: ...

    def close(self) -> None: ...


class FileExpertProvider:
    """Every expert from the mapped file (no cache): each fetch is a miss served by the file."""

    def __init__(self, index: GGUFIndex, device: torch.device | str = "cpu") -> None:
        self.index = index
        self.device = torch.device(device)
        self.stats = ProviderStats(cached=False)
        self.usage = UsageCounts(USAGE_HALF_LIFE_STEPS)
        self.totals: Counter[ExpertKey] = Counter()
        self._stager: PinnedStager | None = None
        self._staging_off = self.device.type != "cuda"  # on the CPU a miss is a view, no copy

    def record(self, key: ExpertKey) -> None:
        self.usage.record((key,))
        self.totals[key] += 1

    def record_counts(self, counts: dict[ExpertKey, int]) -> None:
        """Uses counted elsewhere (on the device, by the decode kernels), handed over in bulk."""
        self.usage.record_counts(counts)
        self.totals.update(counts)

    def step(self) -> None:
        self.usage.tick()

    def expert(self, layer: int, expert: int) -> ExpertWeights:
        self.record((layer, expert))
        return self.from_file(self.index.expert(layer, expert))

    def from_file(self, blob: ExpertBlob) -> ExpertWeights:
        """The expert's runs from the mapped file (uploaded when computing on a GPU): a miss."""
        self.stats.misses += 1
        self.stats.bytes_from_file += blob.nbytes
        raw = self.upload(blob)
        gate, up, down = (QWeight.of_run(b, r) for b, r in zip(raw, blob.runs, strict=True))
        return ExpertWeights(gate, up, down)

    def upload_kernel(self, blob: ExpertBlob, dst: torch.Tensor) -> None:
        """Write the expert's kernel layout (its three matrices repacked) into ``dst``, a uint8
        slot of at least ``kernel_layout(blob).nbytes`` on the compute device."""
        lay = kernel_layout(blob)
        for off, m, src in zip(lay.offsets, lay.layouts, self.upload(blob), strict=True):
            repack_into(dst[off : off + m.nbytes], src, m)

    def upload(self, blob: ExpertBlob) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The expert's three GGUF byte runs on the compute device (through the pinned staging
        ring on a GPU; views of the mapped file on the CPU). Counts nothing."""
        stager = self._staging()
        if stager is not None:
            return stager.upload(blob)
        gate, up, down = (self.index.raw(r.offset, r.nbytes).to(self.device) for r in blob.runs)
        return gate, up, down

    def _staging(self) -> PinnedStager | None:
        if self._stager is None and not self._staging_off:
            try:
                self._stager = PinnedStager(self.index, self.device, slot_bytes_for(self.index))
            except RuntimeError as e:  # pinned memory refused (locked-memory limits, say)
                self._staging_off = True
                log.warning(
                    "no pinned staging buffers (%s): expert misses are copied from "
                    "pageable memory, synchronously",
                    e,
                )
            else:
                log.debug(
                    "expert misses staged through %d pinned buffers of %d bytes",
                    self._stager.depth,
                    self._stager.buffer_bytes,
                )
        return self._stager

    def close(self) -> None:
        """Finish the copies in flight and free the pinned buffers (a later miss makes new ones)."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None
