"""Llama-architecture MoE files (Mixtral 8x7B / 8x22B, written with ``ffn_*_exps``): GQA without
q/k norms, normal (pairwise) RoPE, softmax top-k routing renormalised over the chosen experts."""

from __future__ import annotations

import torch

from strata.engine.errors import ModelLoadError
from strata.engine.gguf_index import GGUFIndex
from strata.engine.models import read_args
from strata.engine.models.base import ModelArgs, MoEModel
from strata.engine.ops import Ops


class Model(MoEModel):
    @classmethod
    def read_args(cls, index: GGUFIndex) -> ModelArgs:
        if "blk.0.ffn_gate_exps.weight" not in index.tensors:
            if "blk.0.ffn_gate.0.weight" in index.tensors:
                raise ModelLoadError(
                    f"{index.path}: Mixtral file with one tensor per expert (an old conversion); "
                    "re-convert it with a current llama.cpp so experts are merged into ffn_*_exps"
                )
            raise ModelLoadError(f"{index.path}: a dense llama file; Strata serves MoE models")
        return read_args(index, rope_neox=False, qk_norm=False, norm_topk=True)

    def layer(self, ops: Ops, x: torch.Tensor, i: int) -> torch.Tensor:
        x = ops.attention(x, i, self.attn[i], self.attention_spec)
        return ops.moe(x, i, self.ffn[i], self.routing_spec)
