"""The expert provider: the one seam between the MoE layer and where expert weights live.

The MoE layer asks ``provider.expert(layer, expert)`` for the three matrices of a routed expert.
The file provider here hands out views of the memory-mapped GGUF; the expert cache (VRAM or host
arena, RAM complement) implements the same protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from strata.engine.gguf_index import GGUFIndex
from strata.engine.layers.weights import QWeight


@dataclass(frozen=True)
class ExpertWeights:
    gate: QWeight  # [F, D]
    up: QWeight  # [F, D]
    down: QWeight  # [D, F]


@dataclass
class ProviderStats:
    """Counters since the provider was made: expert fetches, and bytes read from each tier."""

    cached: bool = False  # whether a cache stands in front of RAM and the file at all
    hits: int = 0
    misses: int = 0
    bytes_from_cache: int = 0
    bytes_from_ram: int = 0
    bytes_from_file: int = 0

    @property
    def hit_rate(self) -> float | None:
        total = self.hits + self.misses
        return self.hits / total if total else None


class ExpertProvider(Protocol):
    stats: ProviderStats

    def expert(self, layer: int, expert: int) -> ExpertWeights: ...


class FileExpertProvider:
    """Every expert from the mapped file (no cache): each fetch is a miss served by the file."""

    def __init__(self, index: GGUFIndex, device: torch.device | str = "cpu") -> None:
        self.index = index
        self.device = torch.device(device)
        self.stats = ProviderStats(cached=False)

    def expert(self, layer: int, expert: int) -> ExpertWeights:
        blob = self.index.expert(layer, expert)
        self.stats.misses += 1
        self.stats.bytes_from_file += blob.nbytes
        gate, up, down = (
            QWeight.of_run(self.index.raw(r.offset, r.nbytes), r).to(self.device) for r in blob.runs
        )
        return ExpertWeights(gate, up, down)
