"""Expert-cache bookkeeping: which slot holds which expert, how hot each expert is, how big the
cache is. Plain Python — no torch, no CUDA, no clock: the device side copies bytes and calls in.

The arena is a run of fixed-size slots. Slots ``[0, core_slots)`` are the fixed **core** (never
shrunk, never a swap victim); ``[core_slots, n_slots)`` is the elastic **tail**; the table can grow
up to ``max_slots`` (the arena's reservation).

Who changes the table when (the contract with the device side):

* **Fills** (``plan_fill``, ``plan_grow``, ``evict_for``) change no tag. The caller copies the
  expert's bytes into ``fill.slot`` and only then calls ``assign(fill.slot, fill.key)``. Until then
  the slot is empty and a lookup misses, so a fill that is late, fails or is dropped can never make
  a slot serve bytes that are not there. Execute (or drop) the fills of one plan before planning
  again: a second plan does not know about the first one's pending fills.
* **Shrinks** (``plan_shrink``) apply to the table at once: on return the table already shows the
  moved experts in their new slots, the removed slots cleared and ``n_slots`` lowered. The caller
  must execute every move (at a safe point, before the next lookup and before unmapping the
  removed slots). Every source is a removed slot and every destination a surviving one, so no move
  reads a slot another move writes: any order is safe, the returned one included. If a copy fails,
  call ``clear(move.dst)`` for that move and every move not yet executed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from strata.engine.errors import EngineError

ExpertKey = tuple[int, int]  # (layer, expert)

GiB = 1 << 30


class SlotTableError(EngineError, ValueError):
    """A request the slot table rejects (out of range, beyond the reservation, below the core);
    the message names the value and the bound, and the table is left unchanged."""


class SlotTagMismatch(EngineError):
    """A slot was about to be used for an expert it does not hold."""


@dataclass(frozen=True)
class Tag:
    """Identity of what a slot holds. ``generation`` is unique per assignment in a table."""

    layer: int
    expert: int
    generation: int

    @property
    def key(self) -> ExpertKey:
        return (self.layer, self.expert)


@dataclass(frozen=True)
class Move:
    """Copy slot ``src``'s bytes to slot ``dst``; ``dst`` then holds ``key``."""

    src: int
    dst: int
    key: ExpertKey


@dataclass(frozen=True)
class Fill:
    """Load ``key``'s bytes (from RAM or the file) into ``slot``, then ``assign(slot, key)``."""

    slot: int
    key: ExpertKey


def _describe(tag: Tag | None) -> str:
    if tag is None:
        return "nothing (empty slot)"
    return f"(layer {tag.layer}, expert {tag.expert}) generation {tag.generation}"


class SlotTable:
    """Expert -> slot and slot -> tag for one arena of fixed-size slots."""

    def __init__(self, core_slots: int, max_slots: int) -> None:
        if core_slots < 0:
            raise SlotTableError(f"core_slots={core_slots} is negative")
        if max_slots < core_slots:
            raise SlotTableError(f"max_slots={max_slots} is below core_slots={core_slots}")
        self.core_slots = core_slots
        self.max_slots = max_slots
        self._n_slots = core_slots
        self._tags: list[Tag | None] = [None] * max_slots
        self._slot_of: dict[ExpertKey, int] = {}
        self._next_generation = 0

    # -- lookups -------------------------------------------------------------------------------

    @property
    def n_slots(self) -> int:
        """Slots in use: ``[0, n_slots)``; changed only by ``plan_grow`` and ``plan_shrink``."""
        return self._n_slots

    def slot_of(self, key: ExpertKey) -> int | None:
        return self._slot_of.get(key)

    def tag(self, slot: int) -> Tag | None:
        self._check_slot(slot)
        return self._tags[slot]

    def check(self, slot: int, key: ExpertKey, generation: int | None = None) -> Tag:
        """The slot's tag, if it holds ``key`` (and, when given, that ``generation``)."""
        self._check_slot(slot)
        tag = self._tags[slot]
        if (
            tag is None
            or tag.key != tuple(key)
            or (generation is not None and tag.generation != generation)
        ):
            wanted = f"(layer {key[0]}, expert {key[1]})"
            if generation is not None:
                wanted += f" generation {generation}"
            raise SlotTagMismatch(f"slot {slot} was used for {wanted} but holds {_describe(tag)}")
        return tag

    def cached_keys(self) -> set[ExpertKey]:
        return set(self._slot_of)

    def free_slots(self) -> list[int]:
        """Empty slots in ``[0, n_slots)``, ascending."""
        return [s for s in range(self._n_slots) if self._tags[s] is None]

    def tail_slots(self) -> range:
        return range(self.core_slots, self._n_slots)

    def __len__(self) -> int:
        """Number of cached experts."""
        return len(self._slot_of)

    def __iter__(self) -> Iterator[tuple[int, Tag]]:
        """(slot, tag) for every occupied slot, ascending."""
        for slot in range(self._n_slots):
            tag = self._tags[slot]
            if tag is not None:
                yield slot, tag

    # -- single-slot changes -------------------------------------------------------------------

    def assign(self, slot: int, key: ExpertKey) -> Tag:
        """Record that ``slot`` now holds ``key`` (its bytes are already there); what the slot held
        before is dropped. A key already held by another slot is rejected (one home per expert)."""
        self._check_slot(slot)
        key = (int(key[0]), int(key[1]))
        other = self._slot_of.get(key)
        if other is not None and other != slot:
            raise SlotTableError(
                f"(layer {key[0]}, expert {key[1]}) is already in slot {other}; "
                f"clear it before assigning it to slot {slot}"
            )
        return self._set(slot, key)

    def clear(self, slot: int) -> None:
        self._check_slot(slot)
        self._drop(slot)

    # -- plans ---------------------------------------------------------------------------------

    def plan_fill(self, ranked: Sequence[ExpertKey]) -> list[Fill]:
        """Empty slots of ``[0, n_slots)`` (ascending, so the core first) paired with the first
        ``ranked`` keys not already cached. Changes nothing: copy, then ``assign``."""
        free, missing = self.free_slots(), self._missing(ranked)
        return [Fill(slot, key) for slot, key in zip(free, missing, strict=False)]

    def plan_grow(self, new_n_slots: int, ranked: Sequence[ExpertKey]) -> list[Fill]:
        """Open tail slots ``[n_slots, new_n_slots)`` (empty until assigned) and plan fills for
        them with the best-ranked missing experts. Sets ``n_slots``; no tag changes."""
        if not self._n_slots <= new_n_slots <= self.max_slots:
            raise SlotTableError(
                f"cannot grow to new_n_slots={new_n_slots}: it must lie between the current "
                f"n_slots={self._n_slots} and max_slots={self.max_slots}"
            )
        new = range(self._n_slots, new_n_slots)
        assert all(self._tags[s] is None for s in new), "slots beyond n_slots must be empty"
        self._n_slots = new_n_slots
        return [Fill(s, k) for s, k in zip(new, self._missing(ranked), strict=False)]

    def plan_shrink(self, new_n_slots: int, hotness: Mapping[ExpertKey, float]) -> list[Move]:
        """Remove slots ``[new_n_slots, n_slots)``, keeping their hottest experts.

        The removed experts, hottest first, go into the surviving tail slots, coldest (empty
        first) first, each only when strictly hotter than what that survivor holds; core slots are
        never a source or a destination. Experts left in removed slots are dropped. Applies to the
        table at once (see the module docstring): the caller must execute every returned move
        before the next lookup and before unmapping."""
        if not self.core_slots <= new_n_slots <= self._n_slots:
            raise SlotTableError(
                f"cannot shrink to new_n_slots={new_n_slots}: it must lie between "
                f"core_slots={self.core_slots} and the current n_slots={self._n_slots}"
            )

        def heat(key: ExpertKey) -> float:
            return float(hotness.get(key, 0.0))

        removed = [(s, t.key) for s in range(new_n_slots, self._n_slots) if (t := self._tags[s])]
        removed.sort(key=lambda sk: (-heat(sk[1]), sk[1]))
        survivors = []
        for s in range(self.core_slots, new_n_slots):
            t = self._tags[s]
            survivors.append((-math.inf if t is None else heat(t.key), s))
        survivors.sort()

        moves: list[Move] = []
        for (src, key), (dst_heat, dst) in zip(removed, survivors, strict=False):
            if heat(key) <= dst_heat:
                break  # hotness only falls along `removed` and rises along `survivors`
            moves.append(Move(src, dst, key))
        for move in moves:
            self._drop(move.src)
            self._set(move.dst, move.key)
        for slot in range(new_n_slots, self._n_slots):
            self._drop(slot)
        self._n_slots = new_n_slots
        return moves

    def evict_for(self, key: ExpertKey, hotness: Mapping[ExpertKey, float]) -> Fill | None:
        """Steady-state swap: a fill of ``key`` into an empty tail slot, or into the coldest tail
        slot when ``key`` is strictly hotter than what it holds (that expert is dropped now, so
        the slot is empty while the caller copies). ``None`` when ``key`` is cached, there is no
        tail, or every tail expert is at least as hot. Copy, then ``assign``."""
        key = (int(key[0]), int(key[1]))
        if key in self._slot_of or self.core_slots == self._n_slots:
            return None
        best: tuple[float, int] | None = None
        for s in self.tail_slots():
            t = self._tags[s]
            cand = (-math.inf if t is None else float(hotness.get(t.key, 0.0)), s)
            if best is None or cand < best:
                best = cand
        assert best is not None
        victim_heat, slot = best
        if float(hotness.get(key, 0.0)) <= victim_heat:
            return None
        self._drop(slot)
        return Fill(slot, key)

    # -- internals -----------------------------------------------------------------------------

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self._n_slots:
            raise SlotTableError(f"slot {slot} is out of range [0, n_slots={self._n_slots})")

    def _missing(self, ranked: Iterable[ExpertKey]) -> Iterator[ExpertKey]:
        seen: set[ExpertKey] = set()
        for k in ranked:
            key = (int(k[0]), int(k[1]))
            if key not in self._slot_of and key not in seen:
                seen.add(key)
                yield key

    def _set(self, slot: int, key: ExpertKey) -> Tag:
        self._drop(slot)
        tag = Tag(key[0], key[1], self._next_generation)
        self._next_generation += 1
        self._tags[slot] = tag
        self._slot_of[key] = slot
        return tag

    def _drop(self, slot: int) -> None:
        tag = self._tags[slot]
        if tag is not None:
            del self._slot_of[tag.key]
            self._tags[slot] = None


# -- usage counts ------------------------------------------------------------------------------


class _Hotness(Mapping[ExpertKey, float]):
    """Read-only live view of decayed counts (stored values divided by the current scale)."""

    def __init__(self, counts: UsageCounts) -> None:
        self._counts = counts

    def __getitem__(self, key: ExpertKey) -> float:
        return self._counts._raw[key] / self._counts._scale

    def __iter__(self) -> Iterator[ExpertKey]:
        return iter(self._counts._raw)

    def __len__(self) -> int:
        return len(self._counts._raw)


class UsageCounts:
    """Decayed per-expert use counts: each ``record`` adds 1 per key occurrence, and every
    ``half_life`` ``tick()``s all counts halve (the engine ticks once per forward step).

    Decay is O(1): counts are stored multiplied by a growing scale (a new record adds ``scale``),
    and are renormalised only when the scale gets large."""

    _RENORMALISE_AT = 2.0**64

    def __init__(self, half_life: float) -> None:
        if not half_life > 0:  # also rejects NaN
            raise ValueError(f"half_life={half_life} must be a positive number of ticks")
        self.half_life = half_life
        self._tick_factor = 0.5 ** (1.0 / half_life)  # 1.0 when half_life is inf: no decay
        self._raw: dict[ExpertKey, float] = {}
        self._scale = 1.0

    def record(self, keys: Iterable[ExpertKey]) -> None:
        raw, scale = self._raw, self._scale
        for k in keys:
            key = (int(k[0]), int(k[1]))
            raw[key] = raw.get(key, 0.0) + scale

    def record_counts(self, counts: Mapping[ExpertKey, int | float]) -> None:
        """``record`` with multiplicities: each key as if recorded ``count`` times now."""
        checked = []
        for k, n in counts.items():
            if isinstance(n, bool) or not isinstance(n, int | float) or not n >= 0:
                raise ValueError(f"count {n!r} for {k} is not a non-negative number")
            checked.append(((int(k[0]), int(k[1])), float(n)))
        raw, scale = self._raw, self._scale
        for key, n in checked:  # validated first, so a bad entry changes nothing
            raw[key] = raw.get(key, 0.0) + n * scale

    def tick(self) -> None:
        self.decay(self._tick_factor)

    def decay(self, factor: float) -> None:
        """Multiply every count by ``factor`` in [0, 1]; 0 forgets everything."""
        if not 0.0 <= factor <= 1.0:
            raise ValueError(f"decay factor={factor} must lie in [0, 1]")
        if factor == 0.0:
            self._raw.clear()
            self._scale = 1.0
            return
        self._scale /= factor
        if self._scale > self._RENORMALISE_AT:
            s = self._scale
            self._raw = {k: v / s for k, v in self._raw.items()}
            self._scale = 1.0

    def count(self, key: ExpertKey) -> float:
        return self._raw.get(key, 0.0) / self._scale

    @property
    def hotness(self) -> Mapping[ExpertKey, float]:
        """Live read-only view: key -> decayed count (keys never recorded are absent)."""
        return _Hotness(self)

    def ranked(self, all_keys: Iterable[ExpertKey]) -> list[ExpertKey]:
        """``all_keys`` by descending count; ties keep the order of ``all_keys`` (stable), so pass
        keys sorted by (layer, expert), or the profile's order for "most used, then the profile"."""
        raw = self._raw
        keys = [(int(k[0]), int(k[1])) for k in all_keys]
        return sorted(keys, key=lambda k: -raw.get(k, 0.0))

    def as_dict(self) -> dict[ExpertKey, float]:
        s = self._scale
        return {k: v / s for k, v in self._raw.items()}


# -- sizes -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheSizes:
    total_slots: int
    core_slots: int
    tail_slots: int
    effective_bytes: int  # total_slots * slot_bytes: what the cache really takes


def plan_sizes(
    budget_bytes: int,
    slot_bytes: int,
    n_experts: int,
    tail_bytes: int | None = None,
    max_tail_bytes: int | None = None,
) -> CacheSizes:
    """The most whole slots that fit ``budget_bytes``, at most one per expert (``n_experts``);
    the last ``tail_bytes`` of them are the elastic tail, rounded up to whole slots (so at least
    the asked bytes are elastic) and at most every slot; the default leaves the core at most a
    quarter of the slots (rounded down), so most of the cache can be lent, but at most
    ``max_tail_bytes`` when given (rounded down: the cap is hard). The rest is the core. A zero
    budget gives zero slots; the caller logs ``effective_bytes``."""
    for name, value in (
        ("budget_bytes", budget_bytes),
        ("n_experts", n_experts),
        ("max_tail_bytes", 0 if max_tail_bytes is None else max_tail_bytes),
    ):
        if value < 0:
            raise ValueError(f"{name}={value} is negative")
    if slot_bytes <= 0:
        raise ValueError(f"slot_bytes={slot_bytes} must be positive")
    if tail_bytes is not None:
        if tail_bytes < 0:
            raise ValueError(f"tail_bytes={tail_bytes} is negative")
        if tail_bytes > budget_bytes:
            raise ValueError(
                f"tail_bytes={tail_bytes} is larger than the cache budget budget_bytes="
                f"{budget_bytes}"
            )
    total = min(budget_bytes // slot_bytes, n_experts)
    effective = total * slot_bytes
    if tail_bytes is None:  # all but a quarter, never beyond max_tail_bytes
        tail = total - total // 4
        if max_tail_bytes is not None:
            tail = min(tail, max_tail_bytes // slot_bytes)
    else:
        tail = min(-(-tail_bytes // slot_bytes), total)
    return CacheSizes(total, total - tail, tail, effective)
