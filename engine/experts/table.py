"""The expert tables the GPU decode kernels read, planned on the host (plain Python, no torch).

Per layer, expert -> the byte offset of its bytes from the decoder's anchor address: an arena
slot for a cached expert, the device address of its page-locked host home for the rest (the
kernels read it over PCIe), ``MISSING`` for an expert left on the file.
A kernel reads an expert only through its layer's table, so the table must never point at bytes
that are not that expert's: it is built from the slot table, checking every slot's tag against
the expert that maps to it, and rewritten (one copy) only at safe points.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from strata.engine.experts.slots import SlotTable
from strata.engine.kernels import MISSING

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
    homes = _Homes(slots, slot_offset, host, host_offset)
    offsets, where = [MISSING] * (n_layer * n_expert), [FILE] * (n_layer * n_expert)
    for i in range(n_layer * n_expert):
        offsets[i], where[i] = homes.entry((first_layer + i // n_expert, i % n_expert))
    return ExpertTablePlan(n_layer, n_expert, tuple(offsets), tuple(where))


def replan_entries(
    plan: ExpertTablePlan,
    keys: Iterable[tuple[int, int]],
    slots: SlotTable | None,
    slot_offset: Callable[[int], int],
    host: SlotTable | None = None,
    host_offset: Callable[[int], int] | None = None,
    first_layer: int = 0,
) -> tuple[ExpertTablePlan, dict[int, tuple[int, int]]]:
    """``plan`` with the entries of ``keys`` (layer, expert) planned again from the slot tables,
    with ``plan_table``'s checks, the rest kept: for a change that touched only those experts
    (an exchange). Returns the new plan and the changed entries (index -> (offset, where))."""
    homes = _Homes(slots, slot_offset, host, host_offset)
    offsets, where = list(plan.offsets), list(plan.where)
    changed = {}
    for key in keys:
        layer = key[0] - first_layer
        if not (0 <= layer < plan.n_layer and 0 <= key[1] < plan.n_expert):
            raise ValueError(f"(layer {key[0]}, expert {key[1]}) is not in this table")
        i = layer * plan.n_expert + key[1]
        offsets[i], where[i] = entry = homes.entry(key)
        changed[i] = entry
    return ExpertTablePlan(plan.n_layer, plan.n_expert, tuple(offsets), tuple(where)), changed


def device_rows(
    entries: Iterable[tuple[int, int]],
) -> tuple[list[int], list[int], list[int]]:
    """The three tables the kernels read, from (offset, where) entries: every home; the VRAM
    homes alone; the host homes alone (``MISSING`` for the others in each)."""
    offsets: list[int] = []
    vram: list[int] = []
    host: list[int] = []
    for offset, where in entries:
        offsets.append(offset)
        vram.append(offset if where == VRAM else MISSING)
        host.append(offset if where == HOST else MISSING)
    return offsets, vram, host


class _Homes:
    """Where one expert is read from, by the slot tables: the offset and VRAM, HOST or FILE."""

    def __init__(
        self,
        slots: SlotTable | None,
        slot_offset: Callable[[int], int],
        host: SlotTable | None,
        host_offset: Callable[[int], int] | None,
    ) -> None:
        self.tiers = [(slots, slot_offset, VRAM, "slot"), (host, host_offset, HOST, "host slot")]

    def entry(self, key: tuple[int, int]) -> tuple[int, int]:
        """Raises ``SlotTagMismatch`` naming (layer, expert) if a slot's tag disagrees with the
        expert mapped to it, and ValueError if the expert has two homes."""
        found = (MISSING, FILE)
        for table, offset_of, kind, name in self.tiers:
            if table is None:
                continue
            slot = table.slot_of(key)
            if slot is None:
                continue
            table.check(slot, key)
            if found[1] != FILE:
                raise ValueError(
                    f"(layer {key[0]}, expert {key[1]}) has two homes: a VRAM slot and {name} "
                    f"{slot}"
                )
            assert offset_of is not None
            offset = offset_of(slot)
            if offset == MISSING:
                raise ValueError(f"{name} {slot} maps to the reserved offset {MISSING}")
            found = (offset, kind)
        return found
