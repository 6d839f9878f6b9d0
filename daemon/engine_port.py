"""The daemon's one door into a loaded engine: what the engine thread (``worker.EngineWorker``)
and the control plane (``control_loop.ControlLoop``, ``control.VramController``) may ask of it.

``EnginePort`` is the interface, stage by stage (stage 0 is the first entry, as any other):
the status, a generation, each stage's expert cache (``CachePort``: its sizes and a resize),
each stage's budget (read and set), the K/V's bytes that share it, the refill a request's freed
K/V leaves room for, the listener told of resizes the engine makes itself, and closing.
``LoadedEngine`` is the real engine behind it; the unit tests' fakes sit behind the same
interface. Only this module reads the engine's parts (its stages, their caches and arenas, their
K/V): nothing else in the daemon chains into them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from strata.engine.experts.cache import ExpertCache, ResizeResult
    from strata.engine.generate import Engine
    from strata.engine.generation import GenerationResult, TokenLogprob
    from strata.engine.grammar import Constraint
    from strata.engine.params import SamplingParams
    from strata.engine.status import EngineStatus

# Told of a resize of a stage's cache (the result, and why it was made)
ResizeListener = Callable[["ResizeResult", str], None]


def first_if_none(number: int | None) -> int:
    """A device's (a stage's) number where a caller may name none: None is the first entry of
    the list, as ``strata-ctl``, ``POST /v1/vram`` and D-Bus's methods without a device take it."""
    return 0 if number is None else number


@dataclass(frozen=True)
class KvBytes:
    """A stage's K/V where it shares the cache's budget (else all zero): what it maps now, what
    it cannot give back now, and the reservation made for the whole context."""

    mapped: int = 0
    floor: int = 0
    reserved: int = 0


class CachePort(Protocol):
    """A stage's VRAM expert cache, as the daemon steers it."""

    @property
    def n_slots(self) -> int: ...
    @property
    def max_slots(self) -> int: ...
    @property
    def slot_bytes(self) -> int: ...
    @property
    def size_bytes(self) -> int: ...
    @property
    def mapped_bytes(self) -> int: ...  # the arena's mapped memory (whole chunks)
    @property
    def core_mapped_bytes(self) -> int: ...  # the core as the arena maps it
    @property
    def closed(self) -> bool: ...  # its memory given back (the engine is closing)
    def slots_for_bytes(self, nbytes: int) -> int: ...
    def mapped_bytes_for(self, n_slots: int) -> int: ...
    def resize(self, n_slots: int, max_shrink: int | None = None) -> ResizeResult: ...


class EnginePort(Protocol):
    """What the daemon asks of a loaded engine (module docstring). ``engine`` is the engine
    itself, for the API edges alone (its tokenizer, chat template and fit check)."""

    @property
    def engine(self) -> Engine: ...
    def stage_count(self) -> int: ...
    def status(self) -> EngineStatus: ...
    def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        on_text: Callable[[str], None] | None,
        cancelled: Callable[[], bool],
        safe_point: Callable[[], None],
        constraint: Constraint | None,
        show_special: frozenset[int],
        on_logprobs: Callable[[list[TokenLogprob]], None] | None,
        on_token: Callable[[], None],
    ) -> GenerationResult: ...
    def cache(self, stage: int) -> CachePort | None: ...
    def budget(self, stage: int) -> int | None: ...
    def set_budget(self, stage: int, budget_bytes: int) -> int: ...
    def kv_bytes(self, stage: int) -> KvBytes: ...
    def refill_slots(self, stage: int) -> int | None: ...
    def listen(self, stage: int, on_resized: ResizeListener) -> None: ...
    def save_profile(self) -> None: ...
    def close(self) -> None: ...


class _Cache:
    """An ``ExpertCache`` behind ``CachePort`` (its arena's bytes read here, not by callers)."""

    def __init__(self, cache: ExpertCache) -> None:
        self._cache = cache

    @property
    def n_slots(self) -> int:
        return self._cache.n_slots

    @property
    def max_slots(self) -> int:
        return self._cache.max_slots

    @property
    def slot_bytes(self) -> int:
        return self._cache.slot_bytes

    @property
    def size_bytes(self) -> int:
        return self._cache.size_bytes

    @property
    def mapped_bytes(self) -> int:
        return self._cache.arena.mapped_bytes

    @property
    def core_mapped_bytes(self) -> int:
        return self._cache.core_mapped_bytes

    @property
    def closed(self) -> bool:
        return bool(self._cache.arena.closed)

    def slots_for_bytes(self, nbytes: int) -> int:
        return self._cache.slots_for_bytes(nbytes)

    def mapped_bytes_for(self, n_slots: int) -> int:
        return self._cache.mapped_bytes_for(n_slots)

    def resize(self, n_slots: int, max_shrink: int | None = None) -> ResizeResult:
        return self._cache.resize(n_slots, max_shrink)


class LoadedEngine:
    """The real engine behind ``EnginePort``."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._caches = [None if s.cache is None else _Cache(s.cache) for s in engine.stages]

    @property
    def engine(self) -> Engine:
        return self._engine

    def stage_count(self) -> int:
        return len(self._caches)

    def status(self) -> EngineStatus:
        return self._engine.status()

    def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        on_text: Callable[[str], None] | None,
        cancelled: Callable[[], bool],
        safe_point: Callable[[], None],
        constraint: Constraint | None,
        show_special: frozenset[int],
        on_logprobs: Callable[[list[TokenLogprob]], None] | None,
        on_token: Callable[[], None],
    ) -> GenerationResult:
        return self._engine.generate(
            prompt, params, on_text=on_text, cancelled=cancelled, safe_point=safe_point,
            constraint=constraint, show_special=show_special, on_logprobs=on_logprobs,
            on_token=on_token,
        )  # fmt: skip

    def cache(self, stage: int) -> CachePort | None:
        return self._caches[self._number(stage)]

    def budget(self, stage: int) -> int | None:
        return self._engine.stages[self._number(stage)].budget

    def set_budget(self, stage: int, budget_bytes: int) -> int:
        return self._engine.set_budget(budget_bytes, stage=self._number(stage))

    def kv_bytes(self, stage: int) -> KvBytes:
        runner = self._engine.stages[self._number(stage)]
        if runner.budget is None or runner.kv.arena.closed:
            return KvBytes()
        kv = runner.kv
        return KvBytes(kv.mapped_bytes, kv.floor_bytes(), kv.arena.reserved_bytes)

    def refill_slots(self, stage: int) -> int | None:
        if self.budget(stage) is None:
            return None
        return self._engine.sequences.refill_slots(stage)

    def listen(self, stage: int, on_resized: ResizeListener) -> None:
        """``on_resized`` hears of the resizes the K/V's growth makes in ``stage``'s cache; the
        refill after a request is the worker's (in pieces), not the engine's at once."""
        self._engine.sequences.settle_grows = False
        self._engine.stages[self._number(stage)].on_cache_resized = on_resized

    def save_profile(self) -> None:
        self._engine.save_profile()

    def close(self) -> None:
        self._engine.close()

    def _number(self, stage: int) -> int:
        n = len(self._caches)
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < n:
            raise ValueError(f"stage={stage!r}: the engine has stages 0 to {n - 1}")
        return stage
