"""What the engine says about itself: ``Engine.status()`` returns an :class:`EngineStatus`, one
:class:`StageStatus` per stage (its layers, its expert cache and host tier, its K/V and its share
of the budget, its expert fetches, how it decodes). Plain frozen dataclasses in bytes and tokens:
the daemon turns them into its status schema (``daemon.status``, docs/status.md) and never reads
the engine's parts itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from strata.engine.experts.host import drive_read_bytes

if TYPE_CHECKING:
    from strata.engine.experts.cache import ExpertCache
    from strata.engine.step import StageRunner

__all__ = [
    "CacheStatus",
    "EngineStatus",
    "ExpertFetches",
    "HostTierStatus",
    "KvStatus",
    "StageStatus",
    "drive_read_bytes",
    "stage_status",
]


@dataclass(frozen=True)
class HostTierStatus:
    """A stage's share of the RAM host tier."""

    nbytes: int  # bytes the tier holds: homes and the room kept for evictions
    slots: int  # host slots in all
    experts: int  # experts whose home is a host slot


@dataclass(frozen=True)
class CacheStatus:
    """A stage's VRAM expert cache."""

    mapped_bytes: int  # the arena's mapped memory
    core_bytes: int  # the fixed core: never shrunk
    size_bytes: int  # the slots in use now (core and tail)
    max_bytes: int  # every expert of the stage in a slot
    experts: int  # experts whose bytes are in their slot now
    max_experts: int  # the stage's routed experts (one slot each at most)
    file_experts: int  # experts with no home in VRAM or RAM
    swaps: int  # hot RAM experts exchanged with cold tail experts since start
    corrupt: int  # copies dropped since start for a checksum mismatch
    host: HostTierStatus | None  # None: no host tier
    arena: str  # the arena's kind: CudaArena (CUDA VMM) or HostArena


@dataclass(frozen=True)
class KvStatus:
    """A stage's K/V and its share of the budget it shares with the stage's cache."""

    mapped_bytes: int
    active_tokens: int  # positions of the active conversation
    active_bytes: int  # the pages the active conversation holds
    kept_bytes: int  # the pages only kept conversations hold
    kept_tokens: tuple[int, ...]  # each kept conversation's length, least recently used first
    reserved_bytes: int  # the reservation made for the whole context at load
    keep: int  # conversations kept at most
    budget_bytes: int | None  # cache + K/V; None: no budget (no cache)


@dataclass(frozen=True)
class ExpertFetches:
    """A stage's expert fetches since start."""

    cached: bool  # a cache stands in front of RAM and the file
    hits: int
    misses: int


@dataclass(frozen=True)
class StageStatus:
    number: int
    device: str  # the stage's compute device, as torch names it
    first_layer: int
    layers: int
    cache: CacheStatus | None  # None: experts come from RAM or the file
    kv: KvStatus | None  # None: the K/V is closed (the engine is shutting down)
    fetches: ExpertFetches
    decode_path: str  # how its decode steps run, a line of text


@dataclass(frozen=True)
class EngineStatus:
    model_id: str
    n_ctx: int
    stages: tuple[StageStatus, ...]  # in layer order; one without a split
    fits_tokens: int  # the longest prompt (plus one) whose K/V fits every stage's budget
    kv_tokens: int  # positions the K/V holds (the prefix a next prompt may reuse)
    tokenizer_cache_words: int  # words the tokenizer's BPE caches may hold
    decode_path: str  # how decode steps run, a line of text
    prefill_path: str  # how prompt chunks run
    decodes_on_gpu: bool  # decode steps run the GPU runners' kernels


def _cache_status(cache: ExpertCache) -> CacheStatus:
    tier = cache.tier_stats()
    host = None if tier is None else HostTierStatus(tier.bytes, tier.slots, tier.experts)
    return CacheStatus(
        mapped_bytes=cache.arena.mapped_bytes,
        core_bytes=cache.core_bytes,
        size_bytes=cache.size_bytes,
        max_bytes=cache.max_slots * cache.slot_bytes,
        experts=cache.cached_experts,
        max_experts=cache.max_slots,
        file_experts=cache.file_experts,
        swaps=cache.swaps,
        corrupt=cache.corrupt,
        host=host,
        arena=type(cache.arena).__name__,
    )


def stage_status(stage: StageRunner) -> StageStatus:
    """``stage``'s status, read between steps or while one runs (numbers may be a step old)."""
    kv = None
    if not stage.kv.arena.closed:
        s = stage.kv.status()
        kept = s["kept_tokens"]
        kv = KvStatus(
            mapped_bytes=int(s["mapped_bytes"]),  # type: ignore[arg-type]
            active_tokens=int(s["active_tokens"]),  # type: ignore[arg-type]
            active_bytes=int(s["active_bytes"]),  # type: ignore[arg-type]
            kept_bytes=int(s["kept_bytes"]),  # type: ignore[arg-type]
            kept_tokens=tuple(kept) if isinstance(kept, list) else (),
            reserved_bytes=stage.kv.arena.reserved_bytes,
            keep=stage.kv.book.keep,
            budget_bytes=stage.budget,
        )
    stats = stage.provider.stats
    return StageStatus(
        number=stage.number,
        device=str(stage.device),
        first_layer=stage.layers.start,
        layers=len(stage.layers),
        cache=_cache_status(stage.cache) if stage.cache is not None else None,
        kv=kv,
        fetches=ExpertFetches(stats.cached, stats.hits, stats.misses),
        decode_path=stage.decode_path(),
    )
