"""The expert tables the GPU decode kernels read, planned on the host (plain Python, no torch).

Per layer, expert -> the byte offset of its bytes from the decoder's anchor address: an arena
slot for a cached expert (and, once the host tier exists, a page-locked host home for the rest).
A kernel reads an expert only through its layer's table, so the table must never point at bytes
that are not that expert's: it is built from the slot table, checking every slot's tag against
the expert that maps to it, and rewritten (one copy) only at safe points.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from strata.engine.experts.slots import SlotTable

MISSING = -1  # no home the kernels may read: a step that routes to it stages the expert first


@dataclass(frozen=True)
class ExpertTablePlan:
    """``offsets[layer * n_expert + expert]``: bytes from the anchor, or ``MISSING``."""

    n_layer: int
    n_expert: int
    offsets: tuple[int, ...]

    @property
    def resident(self) -> int:
        return sum(1 for o in self.offsets if o != MISSING)

    @property
    def complete(self) -> bool:
        """Every expert has a home the kernels can read: a step needs no host in the loop."""
        return MISSING not in self.offsets

    def is_resident(self, layer: int, expert: int) -> bool:
        return self.offsets[layer * self.n_expert + expert] != MISSING


def plan_table(
    n_layer: int,
    n_expert: int,
    slots: SlotTable | None,
    slot_offset: Callable[[int], int],
) -> ExpertTablePlan:
    """The table for the cache state ``slots`` (None: no cache, every expert MISSING).
    ``slot_offset(slot)`` is where a slot's bytes start, from the anchor. Raises
    ``SlotTagMismatch`` naming (layer, expert) if a slot's tag disagrees with the expert mapped
    to it: a corrupt table is an error, never a plausible wrong answer."""
    if n_layer < 1 or n_expert < 1:
        raise ValueError(f"an expert table of {n_layer} layers x {n_expert} experts is empty")
    offsets = [MISSING] * (n_layer * n_expert)
    if slots is not None:
        for layer in range(n_layer):
            for expert in range(n_expert):
                slot = slots.slot_of((layer, expert))
                if slot is None:
                    continue
                slots.check(slot, (layer, expert))
                offset = slot_offset(slot)
                if offset == MISSING:
                    raise ValueError(f"slot {slot} maps to the reserved offset {MISSING}")
                offsets[layer * n_expert + expert] = offset
    return ExpertTablePlan(n_layer, n_expert, tuple(offsets))
