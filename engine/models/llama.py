"""Llama-architecture MoE files (Mixtral 8x7B / 8x22B, written with ``ffn_*_exps``): GQA without
q/k norms, normal (pairwise) RoPE, softmax top-k routing renormalised over the chosen experts."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from strata.engine.errors import ModelLoadError
from strata.engine.experts import ExpertProvider
from strata.engine.gguf_index import GGUFIndex
from strata.engine.layers.decoder import DecoderArgs, MoEDecoder
from strata.engine.models import read_args


class ModelArgs(DecoderArgs):
    @classmethod
    def from_index(cls, index: GGUFIndex) -> DecoderArgs:
        if "blk.0.ffn_gate_exps.weight" not in index.tensors:
            if "blk.0.ffn_gate.0.weight" in index.tensors:
                raise ModelLoadError(
                    f"{index.path}: Mixtral file with one tensor per expert (an old conversion); "
                    "re-convert it with a current llama.cpp so experts are merged into ffn_*_exps"
                )
            raise ModelLoadError(f"{index.path}: a dense llama file; Strata serves MoE models")
        return read_args(index, rope_neox=False, qk_norm=False, norm_topk=True)


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
