"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): GQA with per-head q/k RMSNorm, NeoX RoPE, softmax
top-k routing with renormalised weights, SwiGLU experts, no shared expert."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from strata.engine.experts import ExpertProvider
from strata.engine.gguf_index import GGUFIndex
from strata.engine.layers.decoder import DecoderArgs, MoEDecoder
from strata.engine.models import read_args


class ModelArgs(DecoderArgs):
    @classmethod
    def from_index(cls, index: GGUFIndex) -> DecoderArgs:
        # llama.cpp always renormalises Qwen3-MoE's top-k weights (norm_topk_prob in HF configs).
        return read_args(index, rope_neox=True, qk_norm=True, norm_topk=True)


class Model(MoEDecoder):
    def __init__(
        self,
        index: GGUFIndex,
        provider: ExpertProvider,
        device: torch.device | str = "cpu",
        repack: bool = False,
        split: Sequence[tuple[range, torch.device]] | None = None,
        providers: Sequence[ExpertProvider] | None = None,
    ) -> None:
        args = ModelArgs.from_index(index)
        super().__init__(index, args, provider, device, repack, split, providers)
