"""Qwen3-Next (Qwen3-Next-80B-A3B, Qwen3-Coder-Next): the hybrid of ``qwen35moe`` with NeoX
partial rotary embedding, k heads repeated to the v heads by groups (v head h reads k head
h // (n_v / n_k)), and β/α stored together per k head (``ssm_ba``); older files also fuse q, k, v
and z per k head (``ssm_in``), which the operation splits."""

from __future__ import annotations

from strata.engine.gguf_index import GGUFIndex
from strata.engine.models.hybrid import HybridArgs, HybridModel, read_hybrid


class Model(HybridModel):
    @classmethod
    def read_args(cls, index: GGUFIndex) -> HybridArgs:
        return read_hybrid(index, tiled_heads=False, sections=False)
