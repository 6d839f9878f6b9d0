"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): GQA with per-head q/k RMSNorm, NeoX RoPE, softmax
top-k routing with renormalised weights, SwiGLU experts, no shared expert."""

from __future__ import annotations

import torch

from strata.engine.gguf_index import GGUFIndex
from strata.engine.models import read_args
from strata.engine.models.base import ModelArgs, MoEModel
from strata.engine.ops import Ops


class Model(MoEModel):
    @classmethod
    def read_args(cls, index: GGUFIndex) -> ModelArgs:
        # llama.cpp always renormalises Qwen3-MoE's top-k weights (norm_topk_prob in HF configs).
        return read_args(index, rope_neox=True, qk_norm=True, norm_topk=True)

    def layer(self, ops: Ops, x: torch.Tensor, i: int) -> torch.Tensor:
        x = ops.attention(x, i, self.attn[i], self.attention_spec)
        return ops.moe(x, i, self.ffn[i], self.routing_spec)
