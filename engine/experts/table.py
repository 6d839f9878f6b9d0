"""The expert tables the GPU decode kernels read, planned on the host (plain Python, no torch).

Per layer, expert -> the byte offset of its bytes from the decoder's anchor address: an arena
slot for a cached expert, the device address of its page-locked host home for the rest (the
kernels read it over PCIe), ``MISSING`` for an expert left on the file.
A kernel reads an expert only through its layer's table, so the table must never point at bytes
that are not that expert's: it is built from the slot table, checking every slot's tag against
the expert that maps to it, and rewritten (one copy) only at safe points.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from strata.engine.experts.slots import SlotTable

MISSING = -1  # no home the kernels may read: a step that routes to it stages the expert first
# Offsets are multiples of 256 (slots and homes are 256-byte aligned, and so is the anchor), so a
# home below the anchor (a negative offset) never reads as MISSING.

VRAM, HOST, FILE = 0, 1, 2  # where an expert's home is (``ExpertTablePlan.where``)


@dataclass(frozen=True)
class ExpertTablePlan:
    """``offsets[layer * n_expert + expert]``: bytes from the anchor, or ``MISSING``."""

    n_layer: int
    n_expert: int
    offsets: tuple[int, ...]
    where: tuple[int, ...] = ()  # VRAM, HOST or FILE per entry (empty: from the offsets alone)

    def __post_init__(self) -> None:
        if not self.where:
            object.__setattr__(
                self, "where", tuple(FILE if o == MISSING else VRAM for o in self.offsets)
            )

    @property
    def resident(self) -> int:
        """Experts with a home the kernels read (a slot or a page-locked host home)."""
        return sum(1 for o in self.offsets if o != MISSING)

    def count(self, where: int) -> int:
        return sum(1 for w in self.where if w == where)

    def home(self, layer: int, expert: int) -> int:
        """VRAM, HOST or FILE: where (layer, expert) is read from."""
        return self.where[layer * self.n_expert + expert]

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
    host: SlotTable | None = None,
    host_offset: Callable[[int], int] | None = None,
    first_layer: int = 0,
) -> ExpertTablePlan:
    """The table for the cache state ``slots`` (None: no cache, every expert MISSING) and, when
    given, the host tier's slot table ``host``. ``slot_offset(slot)`` (``host_offset(slot)``) is
    where a slot's (host slot's) bytes start, from the anchor. Raises ``SlotTagMismatch`` naming
    (layer, expert) if a slot's tag disagrees with the expert mapped to it, and ValueError if an
    expert has two homes: a corrupt table is an error, never a plausible wrong answer.
    ``first_layer``: the model layer of the table's first (a stage's tables cover its layers
    ``first_layer .. first_layer + n_layer - 1``, entry ``(layer - first_layer) * n_expert``)."""
    if n_layer < 1 or n_expert < 1:
        raise ValueError(f"an expert table of {n_layer} layers x {n_expert} experts is empty")
    offsets = [MISSING] * (n_layer * n_expert)
    where = [FILE] * (n_layer * n_expert)
    tiers = [(slots, slot_offset, VRAM, "slot"), (host, host_offset, HOST, "host slot")]
    for table, offset_of, kind, name in tiers:
        if table is None:
            continue
        assert offset_of is not None
        for i in range(n_layer * n_expert):
            key = (first_layer + i // n_expert, i % n_expert)
            slot = table.slot_of(key)
            if slot is None:
                continue
            table.check(slot, key)
            if where[i] != FILE:
                raise ValueError(
                    f"(layer {key[0]}, expert {key[1]}) has two homes: a VRAM slot and {name} "
                    f"{slot}"
                )
            offset = offset_of(slot)
            if offset == MISSING:
                raise ValueError(f"{name} {slot} maps to the reserved offset {MISSING}")
            offsets[i], where[i] = offset, kind
    return ExpertTablePlan(n_layer, n_expert, tuple(offsets), tuple(where))
