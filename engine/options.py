"""The engine's options: one table of defaults and bounds, checked once when they are built.

``daemon/config.py`` reads its engine options' defaults and bounds from here, so that
``EngineOptions()`` and the daemon's ``StrataConfig()`` agree; the engine checks what depends on
the model or the device (``prefetch_experts`` against its experts, a CUDA device that is absent)
at load. Imports nothing heavy: the configuration reads this module at every start.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from strata.engine.errors import EngineError


@dataclass(frozen=True)
class Bound:
    """The closed range a numeric option must lie in (None: no bound on that side)."""

    low: float | None = None
    high: float | None = None
    number: type = int  # int: whole numbers only; float: any real number

    def describe(self) -> str:
        kind = "a whole number" if self.number is int else "a number"
        if self.high is None:
            return f"must be {kind} >= {_num(self.low)}"
        return f"must be {kind} between {_num(self.low)} and {_num(self.high)}"


def _num(value: float | None) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


MAX_ADAPT_SWAPS = 256  # each swap holds one expert slot of VRAM while it passes through
MAX_PREFETCH_EXPERTS = 256  # two sets of staging slots of this many experts each: VRAM
MAX_KV_KEEP = 64  # each may hold a whole context of K/V pages (bounded by the budget)
# a GPU arena maps in 2 MiB granules (the configuration asks for a multiple of this); the host
# arena of the CPU device takes any whole MiB
ARENA_GRANULE_MIB = 2
KV_CACHE_TYPES = ("f16", "f32")

# The numeric options' bounds: the configuration's fields and ``EngineOptions`` read this one table.
BOUNDS: dict[str, Bound] = {
    "context_length": Bound(16),
    "threads": Bound(1, 1024),
    "prefill_chunk_tokens": Bound(1, 65536),
    "cache_mib": Bound(0),
    "elastic_tail_mib": Bound(0),
    "arena_chunk_mib": Bound(1, 1024),
    "reserve_mib": Bound(0),
    "host_budget_mib": Bound(0),
    "adapt_swaps": Bound(0, MAX_ADAPT_SWAPS),
    "prefetch_experts": Bound(0, MAX_PREFETCH_EXPERTS),
    "cpu_share": Bound(0.0, 1.0, float),
    "kv_keep_conversations": Bound(0, MAX_KV_KEEP),
}


@dataclass(frozen=True)
class EngineOptions:
    """The engine's share of the configuration (built from the daemon's config at the edge, with
    the same defaults); a bad value is an :class:`EngineError` naming the option and the value."""

    context_length: int | None = None  # None: the model's (the K/V grows with the conversations)
    threads: int | None = None  # None: physical cores - 1
    prefill_chunk_tokens: int = 1024
    kv_cache_type: str = "f16"
    # "cpu", "cuda" or "cuda:N": where the dense weights, K/V and compute live (the daemon's
    # ``device = "auto"`` is resolved to one of these at the edge, ``engine_setup``)
    device: str = "cpu"
    # expert cache budget; None: free VRAM - reserve_mib where free VRAM is known (a GPU, or the
    # daemon's monitor), else 0 (``loader.automatic_cache_mib``)
    cache_mib: int | None = None
    elastic_tail_mib: int | None = None  # None: three quarters of the cache (the core: a quarter)
    arena_chunk_mib: int = 32
    reserve_mib: int = 1024  # VRAM kept free when the cache size is automatic
    fast_decode: bool = True  # on a GPU: decode with the fused Triton kernels
    fast_prefill: bool = True  # and prompt chunks on tensor cores (with fast_decode only)
    enforce_eager: bool = False  # the same kernels without CUDA graphs
    # RAM for the host tier (the experts no VRAM slot holds); None: what is available less what
    # the desktop keeps (``host.default_budget_bytes``); 0: no tier, misses read from the file
    host_budget_mib: int | None = None
    # at each safe point where uses are handed over (every 64 decode steps and after a greedy
    # run), exchange up to this many hot RAM-homed experts with cold tail experts; 0: never
    adapt_swaps: int = 4
    # GPU decode: copy up to this many of each layer's predicted experts from RAM ahead of its
    # routing (``kernels.prefetch``); 0: never (on the H200 it made decode slower: docs)
    prefetch_experts: int = 0
    # GPU decode: the CPU's share (0 to 1) of each layer's chosen experts in RAM; None: chosen
    # at load by timing a few steps at each of ``fast_decode.CPU_SHARE_CANDIDATES`` (0 without
    # a GPU, or where ``prefetch_experts`` is set)
    cpu_share: float | None = None
    verify_experts: bool = False  # checksum experts at load; check every fill, move, and samples
    # conversations whose K/V is kept for a later request that extends one of them
    kv_keep_conversations: int = 4
    kv_fixed: bool = False  # map the K/V for the whole context at load (never grown or trimmed)
    # Stages (docs/multi-gpu.md): the layers split into contiguous runs, stage i on devices[i]
    # with its own expert cache, K/V and decode graph; None: one stage on ``device``
    devices: tuple[str, ...] | None = None
    # layers per stage, in order (one count per device, adding up to the model's layers);
    # None: in proportion to the memory each device has free
    layer_split: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in BOUNDS:
            check_bound(name, getattr(self, name), nullable=DEFAULTS[name] is None)
        if self.kv_cache_type not in KV_CACHE_TYPES:
            raise EngineError(
                f"kv_cache_type={self.kv_cache_type!r}: expected one of {', '.join(KV_CACHE_TYPES)}"
            )
        self._check_split()

    def _check_split(self) -> None:
        if self.devices is None:
            if self.layer_split is not None:
                raise EngineError(
                    f"layer_split={list(self.layer_split)}: needs devices (one count per device)"
                )
            return
        if isinstance(self.devices, str) or not self.devices:
            raise EngineError(f"devices={self.devices!r}: expected a list of at least one device")
        for name in self.devices:
            if not isinstance(name, str):
                raise EngineError(f"devices={list(self.devices)!r}: {name!r} is not a device name")


def check_bound(name: str, value: object, nullable: bool = False) -> None:
    """``value`` against ``BOUNDS[name]``: outside it (or not a number) is an
    :class:`EngineError` naming the option and the value. The runtime setters' guard too."""
    if value is None and nullable:
        return
    bound = BOUNDS[name]
    kinds = (int, float) if bound.number is float else (int,)
    ok = isinstance(value, kinds) and not isinstance(value, bool)
    if ok and bound.low is not None and value < bound.low:  # type: ignore[operator]
        ok = False
    if ok and bound.high is not None and value > bound.high:  # type: ignore[operator]
        ok = False
    if not ok:
        raise EngineError(f"{name}={value!r}: {bound.describe()}")


# Every option's default, by name: ``daemon/config.py`` reads its fields' defaults from here.
DEFAULTS: dict[str, object] = {f.name: f.default for f in fields(EngineOptions)}
