"""Expert uses counted on the device, handed to the provider at safe points.

A decode step's top-k kernel counts each chosen expert in ``steps``; a prompt chunk adds its
token assignments to ``prompts`` and the distinct experts it read to ``fetches``. ``flush``
hands the uses to the provider's usage counts and counts the reads in its stats by where each
expert's home was in the plan they ran under (the runner flushes before every plan change)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from strata.engine.experts import ExpertProvider
from strata.engine.experts.slots import ExpertKey
from strata.engine.experts.table import HOST, VRAM, ExpertTablePlan


class UseCounters:
    def __init__(self, n_layer: int, n_expert: int, first: int, expert_bytes: list[int],
                 device: torch.device) -> None:  # fmt: skip
        L, E = n_layer, n_expert
        self.n_expert, self.first, self.expert_bytes = E, first, expert_bytes
        self.steps = torch.zeros(L, E, dtype=torch.int32, device=device)
        self.prompts = torch.zeros(L, E, dtype=torch.int32, device=device)
        self.fetches = torch.zeros(L * E, dtype=torch.int64, device=device)
        self.dirty = False  # a step or a chunk ran since the last flush

    def flush(self, provider: ExpertProvider, plan: ExpertTablePlan) -> list[ExpertKey]:
        """Hand the uses to ``provider``'s counts and its stats (reads by home, under ``plan``):
        a decode step reads each chosen expert once, a prompt chunk each distinct one once.
        Nothing to do, and no wait for the device, when no step ran since the last flush."""
        if not self.dirty:
            return []
        self.dirty = False
        steps = self.steps.to("cpu", copy=True).reshape(-1)
        prompts = self.prompts.to("cpu", copy=True).reshape(-1)
        fetched = self.fetches.to("cpu", copy=True)
        self.zero()
        E, first = self.n_expert, self.first
        uses = dict(zip(*_nonzero(steps + prompts), strict=True))
        if uses:
            provider.record_counts({(first + i // E, i % E): int(n) for i, n in uses.items()})
        self._count_reads(provider, plan, dict(zip(*_nonzero(steps), strict=True)))
        self._count_reads(provider, plan, dict(zip(*_nonzero(fetched), strict=True)))
        return sorted((first + i // E, i % E) for i in uses)

    def zero(self) -> None:
        self.steps.zero_()
        self.prompts.zero_()
        self.fetches.zero_()

    def _count_reads(
        self, provider: ExpertProvider, plan: ExpertTablePlan, reads: dict[int, int]
    ) -> None:
        """reads: table entry -> times read."""
        stats, E = provider.stats, self.n_expert
        for i, n in reads.items():
            nbytes = n * self.expert_bytes[i // E]
            where = plan.where[i]
            if where == VRAM:
                stats.hits += n
                stats.bytes_from_cache += nbytes
            elif where == HOST:
                stats.misses += n
                stats.bytes_from_ram += nbytes
            else:
                stats.misses += n
                stats.bytes_from_file += nbytes

    @contextmanager
    def uncounted(self, provider: ExpertProvider, device: torch.device) -> Iterator[None]:
        """Steps run inside count nothing in the provider's stats nor here (they warm up, time
        or capture the kernels, not serve a request); waits for them at the end. The owners of
        other counts (copies ahead, the CPU's share) zero theirs too."""
        stats = provider.stats
        before = (stats.hits, stats.misses, stats.bytes_from_cache, stats.bytes_from_file)
        steps, prompts, fetches = self.steps.clone(), self.prompts.clone(), self.fetches.clone()
        dirty = self.dirty
        try:
            yield
        finally:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            stats.hits, stats.misses, stats.bytes_from_cache, stats.bytes_from_file = before
            self.steps.copy_(steps)
            self.prompts.copy_(prompts)
            self.fetches.copy_(fetches)
            self.dirty = dirty


def _nonzero(flat: torch.Tensor) -> tuple[list[int], list[int]]:
    idx = torch.nonzero(flat).flatten()
    return idx.tolist(), flat[idx].tolist()
