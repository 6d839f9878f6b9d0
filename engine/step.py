"""The step protocol: what one stage runner does with a batch of positions.

A model split over devices (``engine.stages``) is a list of ``StageRunner``s, one per stage, and
a short hand-off: each stage runs its layers on the hidden state the previous stage left, the
first embeds the tokens, the last returns the logits. Two implementations: the GPU runner
(``engine.gpu.runner``: fused kernels, CUDA graphs, expert tables) and the reference runner
(``engine.reference_runner``: plain torch, any device). Both run the model file's one definition
of a layer (``MoEModel.forward`` with their own ``Ops``).

A ``Batch`` is shaped for several sequences from the start; today's runners take one. Its kind
says what the positions are: one decode token per sequence, a prompt chunk, or a window of
several positions of one sequence whose logits are all wanted (speculative verification).

A runner owns every piece of state of its stage — its K/V, its expert provider (the only way to
its layers' experts), its budget, and on a GPU all device state — and delegates only to objects
it owns that never call back into it. Every step boundary is a *safe point*, where the caller
may resize a cache or cancel.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from strata.engine.devices import on_device

if TYPE_CHECKING:
    from strata.engine.experts import ExpertProvider
    from strata.engine.experts.cache import ExpertCache, ResizeResult
    from strata.engine.experts.slots import ExpertKey
    from strata.engine.kv import KVCache
    from strata.engine.models.base import MoEModel


class StepKind(enum.Enum):
    DECODE = "decode"  # one new token per sequence
    CHUNK = "chunk"  # a prompt chunk: the last position's logits (or every one's)
    VERIFY = "verify"  # several positions of one sequence, every position's logits


@dataclass(frozen=True)
class Seq:
    """One sequence's part of a step: ``tokens`` at positions ``start`` .. (its K/V holds the
    positions before ``start``)."""

    tokens: tuple[int, ...]
    start: int

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def tensor(self, device: torch.device) -> torch.Tensor:
        """The tokens as int64 [T] on ``device``."""
        return torch.tensor(self.tokens, dtype=torch.long, device=device)


@dataclass(frozen=True)
class Batch:
    kind: StepKind
    seqs: tuple[Seq, ...]
    last_only: bool = False  # a chunk's logits of its last position only

    @classmethod
    def decode(cls, token: int, pos: int) -> Batch:
        return cls(StepKind.DECODE, (Seq((int(token),), pos),), last_only=True)

    @classmethod
    def chunk(cls, tokens: Sequence[int], start: int, last_only: bool = False) -> Batch:
        return cls(StepKind.CHUNK, (Seq(tuple(int(t) for t in tokens), start),), last_only)

    @classmethod
    def verify(cls, tokens: Sequence[int], start: int) -> Batch:
        return cls(StepKind.VERIFY, (Seq(tuple(int(t) for t in tokens), start),))

    @property
    def one(self) -> Seq:
        """The batch's only sequence (today's runners run one)."""
        if len(self.seqs) != 1:
            raise ValueError(f"a batch of {len(self.seqs)} sequences: this runner takes one")
        return self.seqs[0]


class StageRunner(ABC):
    """One stage of the model: its layers on its device, with its K/V and expert provider.
    ``run`` steps a batch through its layers; ``end_step`` is the safe point after every
    stage ran it."""

    on_gpu = False  # a GpuRunner: the fused kernels, the greedy look-ahead ring

    def __init__(self, model: MoEModel, number: int, kv: KVCache, provider: ExpertProvider) -> None:
        self.model, self.number, self.kv, self.provider = model, number, kv, provider
        self.layers: range = model.spans[number]
        self.device: torch.device = model.stage_devices[number]
        self.is_first = self.layers.start == 0
        self.is_last = self.layers.stop == model.shape.n_layer
        # bytes for this stage's expert cache and K/V together (None: the K/V grows within its
        # reservation, as the memory allows; no cache then)
        self.budget: int | None = None
        # told of each cache resize the K/V's growth makes (the daemon's control plane)
        self.on_cache_resized: Callable[[ResizeResult, str], None] | None = None

    # -- steps ----------------------------------------------------------------------------------

    @abstractmethod
    def run(self, batch: Batch, x: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``batch`` through this stage's layers: from its tokens on the first stage (else
        from ``x``, the previous stage's hidden state), to logits on the last ([T, V] float32,
        or [1, V] with ``last_only``; a decode step's [1, V]); else the hidden state [T, D]
        for the next stage. What it returns may be the runner's own buffer, valid until its
        next step."""

    def end_step(self) -> None:
        """The step ran on every stage (a safe point): count it."""
        self.provider.step()

    def flush_usage(self) -> list[ExpertKey]:
        """Hand expert uses counted on the device to the provider's counts; the keys used."""
        return []

    def adapt(self) -> int:
        """At a safe point: let the cache follow the use counted so far; the exchanges made."""
        return 0

    def decode_path(self) -> str:
        return "reference path (dequantise, then multiply; one launch per expert matrix)"

    def prefill_path(self) -> str:
        return "reference path (dequantise, then multiply; one launch per expert matrix)"

    def close(self) -> None:  # noqa: B027 (a runner with no device state has nothing to close)
        """Let the device state go (the K/V and the provider are closed by their owner)."""

    def on(self) -> AbstractContextManager[object]:
        """A context making this stage's device current (kernels launch on the current GPU)."""
        return on_device(self.device)

    # -- the stage's cache and the K/V's room in its budget -----------------------------------

    @property
    def cache(self) -> ExpertCache | None:
        """This stage's expert cache (over its layers only; None: experts from the file)."""
        from strata.engine.experts.cache import ExpertCache

        return self.provider if isinstance(self.provider, ExpertCache) else None

    def owns(self, layer: int) -> bool:
        return layer in self.layers

    def budget_room(self) -> int | None:
        """Bytes the budget leaves unmapped (None: no budget)."""
        if self.budget is None:
            return None
        held = self.cache.arena.mapped_bytes if self.cache is not None else 0
        return self.budget - held - self.kv.mapped_bytes

    def kv_limit_bytes(self) -> int | None:
        """The most the K/V may map: the budget less the expert cache's core (None: no
        budget)."""
        if self.budget is None:
            return None
        cache = self.cache
        core = cache.mapped_bytes_for(cache.sizes.core_slots) if cache is not None else 0
        return self.budget - core

    def tokens_that_fit(self, n_ctx: int) -> int:
        """The longest sequence whose K/V fits the budget with the cache at its core (the
        sink page and whole chunks counted), at most ``n_ctx``."""
        limit = self.kv_limit_bytes()
        if limit is None:
            return n_ctx
        kv = self.kv
        usable = max(0, limit) // kv.chunk_bytes * kv.chunk_bytes
        pages = min(usable // kv.page_bytes, kv.book.max_pages) - 1  # less the sink
        return max(0, min(n_ctx, pages * kv.page))

    def refill_slots(self) -> int | None:
        """The cache's slots once its tail has taken the budget's room, when that is at least a
        chunk more than it has; else None."""
        cache, room = self.cache, self.budget_room()
        if cache is None or room is None or room < cache.arena.chunk_bytes:
            return None
        slots = cache.slots_for_bytes(cache.arena.mapped_bytes + room)
        return slots if slots > cache.n_slots else None

    def describe(self) -> str:
        r = self.layers
        span = f"{r.start}" if len(r) == 1 else f"{r.start}-{r.stop - 1}"
        return f"stage {self.number} (layers {span} on {self.device})"


def run_stages(stages: Sequence[StageRunner], batch: Batch) -> torch.Tensor:
    """``batch`` through every stage in order, the hidden state handed from one to the next
    (across two GPUs a peer copy ordered after the first stage's work); the last stage's
    logits. Then each stage's safe point."""
    if len(stages) == 1:  # one device: no hand-off, and no device switch on the decode path
        only = stages[0]
        x = only.run(batch)
        only.end_step()
        return x
    x = None
    for stage in stages:
        with stage.on():
            x = stage.run(batch, None if x is None else x.to(stage.device))
    for stage in stages:
        with stage.on():
            stage.end_step()
    assert x is not None
    return x
