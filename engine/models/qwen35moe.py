"""Qwen3.5 / Qwen3.6 MoE (Qwen3.6-35B-A3B, Qwen3.5-122B-A10B, 397B-A17B): three of every four
layers Gated DeltaNet, the fourth gated attention with per-head q/k RMSNorm and partial rotary
embedding in the interleaved multi-section layout (``rope.dimension_sections``); routed experts
(softmax top-k, renormalised) with a σ-gated shared expert. The converter stores the v heads of a
DeltaNet layer tiled over the k heads (v head h reads k head h % n_k)."""

from __future__ import annotations

from strata.engine.gguf_index import GGUFIndex
from strata.engine.models.hybrid import HybridArgs, HybridModel, read_hybrid


class Model(HybridModel):
    @classmethod
    def read_args(cls, index: GGUFIndex) -> HybridArgs:
        return read_hybrid(index, tiled_heads=True, sections=True)
