"""A stage's expert tables on the device: where the kernels find each expert of its layers.

Three int64 tables of ``layers x experts`` byte offsets from the step buffers' anchor: every
home the kernels may read (``table``: VRAM slots and page-locked RAM homes), the VRAM slots
alone (``vram``: prompt chunks copy the RAM ones into VRAM instead of reading them over PCIe
tile by tile) and the RAM homes alone (``homes``: what copies ahead and the CPU's share take).
The cache's arena slots never move; the tables are rewritten (one copy, in stream order) when
the cache changes, at safe points only, from the plan (``experts.table``) checked against the
slots' tags."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from strata.engine.experts.cache import ExpertCache
from strata.engine.experts.host import HostTier
from strata.engine.experts.slots import ExpertKey
from strata.engine.experts.table import (
    FILE,
    HOST,
    VRAM,
    ExpertTablePlan,
    device_rows,
    plan_table,
    replan_entries,
)
from strata.engine.kernels import MISSING

log = logging.getLogger(__name__)


class FastPathError(RuntimeError):
    """The GPU kernels cannot serve this model here; the message says why."""


class ExpertTables:
    def __init__(self, n_layer: int, n_expert: int, first: int, anchor: torch.Tensor) -> None:
        L, E, dev = n_layer, n_expert, anchor.device
        self.n_layer, self.n_expert, self.first = L, E, first
        self.anchor, self.device = anchor, dev
        self.table = torch.full((L * E,), MISSING, dtype=torch.int64, device=dev)
        self.vram = torch.full((L * E,), MISSING, dtype=torch.int64, device=dev)
        self.homes = torch.full((L * E,), MISSING, dtype=torch.int64, device=dev)
        # each layer's RAM homes as (expert, host slot), in host slot order
        self.host_homes: list[list[tuple[int, int]]] = [[] for _ in range(L)]
        self.tier: HostTier | None = None
        self.host_count = 0
        self.plan: ExpertTablePlan = plan_table(L, E, None, lambda s: MISSING)
        self._said = False  # whether the log has said how steps run (graph or staging)

    @property
    def complete(self) -> bool:
        """Every expert has a home the kernels read (no step stages a miss)."""
        return self.plan.complete

    def layer(self, t: torch.Tensor, layer: int) -> torch.Tensor:
        """Local ``layer``'s row of the table ``t``."""
        return t[layer * self.n_expert : (layer + 1) * self.n_expert]

    def rebuild(self, cache: ExpertCache | None) -> None:
        """Plan every entry from the cache's slot table and its host tier's (tags checked) and
        copy the tables over (no cache: every expert is read from the file)."""
        L, E = self.n_layer, self.n_expert
        was_complete = self.plan.complete
        if cache is None:
            self.plan = plan_table(L, E, None, lambda s: MISSING)
        else:
            tier = cache.tier
            if tier is not None and self.device.type == "cuda" and not tier.pinned:
                raise FastPathError("the host tier is not page-locked: the GPU cannot read it")
            anchor = self.anchor.data_ptr()
            offset = lambda s: cache.slot_address(s) - anchor  # noqa: E731
            host = None if tier is None else (lambda s: tier.address(s) - anchor)
            self.plan = plan_table(
                L, E, cache.table, offset, None if tier is None else tier.table, host, self.first
            )
        self._write(cache)
        if self.plan.complete != was_complete or not self._said:
            self._said = True
            self._say()

    def replan(self, cache: ExpertCache, keys: Sequence[ExpertKey]) -> bool:
        """Plan and write the entries of ``keys`` alone (an exchange touched only them); False,
        with nothing changed, where the plan's completeness would change (then ``rebuild``)."""
        tier = cache.tier
        anchor = self.anchor.data_ptr()
        plan, changed = replan_entries(
            self.plan, keys, cache.table, lambda s: cache.slot_address(s) - anchor,
            None if tier is None else tier.table,
            None if tier is None else (lambda s: tier.address(s) - anchor), self.first,
        )  # fmt: skip
        if plan.complete != self.plan.complete:
            return False
        self.plan = plan
        idx = sorted(changed)
        dev = self._upload([idx, *device_rows(changed[i] for i in idx)])
        for dst, row in zip(self._tables, dev[1:], strict=True):
            dst.index_copy_(0, dev[0], row)
        E = self.n_expert
        for layer in {i // E for i in idx}:
            gone = {i % E for i in idx if i // E == layer}
            homes = [(e, h) for e, h in self.host_homes[layer] if e not in gone]
            for i in idx:
                if i // E == layer and changed[i][1] == HOST:
                    assert tier is not None
                    home = tier.table.slot_of((self.first + layer, i % E))
                    assert home is not None
                    homes.append((i % E, home))
            self.host_homes[layer] = sorted(homes, key=lambda es: es[1])
        self.host_count = plan.count(HOST)
        return True

    @property
    def _tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tables ``device_rows`` gives the rows of, in its order."""
        return self.table, self.vram, self.homes

    def _upload(self, rows: list[list[int]]) -> torch.Tensor:
        """``rows`` as one int64 tensor on the device, queued in stream order with no wait (from
        page-locked memory on a GPU: behind a resize's copies)."""
        src = torch.tensor(rows, dtype=torch.int64)
        if self.device.type == "cuda":
            src = src.pin_memory()
        return src.to(self.device, non_blocking=True)

    def _write(self, cache: ExpertCache | None) -> None:
        plan = self.plan
        dev = self._upload(list(device_rows(zip(plan.offsets, plan.where, strict=True))))
        for dst, row in zip(self._tables, dev, strict=True):
            dst.copy_(row)
        self.tier = cache.tier if cache is not None else None
        self.host_homes = [[] for _ in range(self.n_layer)]
        self.host_count = plan.count(HOST)
        if self.tier is not None:
            for slot, tag in self.tier.table:
                self.host_homes[tag.layer - self.first].append((tag.expert, slot))
            for homes in self.host_homes:
                homes.sort(key=lambda es: es[1])  # host slot order: neighbours copy as one

    def _say(self) -> None:
        vram, host = self.plan.count(VRAM), self.plan.count(HOST)
        if self.plan.complete:
            log.info(
                "every expert has a home the kernels read (%d in VRAM, %d in RAM over PCIe): "
                "decode steps stage nothing", vram, host,
            )  # fmt: skip
        else:
            log.info(
                "%d experts in VRAM, %d in RAM, %d only on the file: decode steps run eagerly "
                "and stage each miss from the file", vram, host, self.plan.count(FILE),
            )  # fmt: skip
