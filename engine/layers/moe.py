"""The routed Mixture-of-Experts feed-forward block: the only place expert weights are read."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from strata.engine.experts import ExpertProvider
from strata.engine.layers.weights import QWeight, linear


@dataclass(frozen=True)
class MoEShape:
    n_expert: int
    n_expert_used: int
    norm_topk: bool  # renormalise the k chosen weights to sum to 1


def route(x: torch.Tensor, router: QWeight, shape: MoEShape) -> tuple[torch.Tensor, torch.Tensor]:
    # x: [T, D] -> weights: [T, K], ids: [T, K]
    probs = torch.softmax(linear(x, router), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, shape.n_expert_used, dim=-1)
    if shape.norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe(
    x: torch.Tensor,
    router: QWeight,
    shape: MoEShape,
    provider: ExpertProvider,
    layer: int,
) -> torch.Tensor:
    # x: [T, D] -> [T, D]
    weights, ids = route(x, router, shape)
    out = torch.zeros_like(x)
    # Each chosen expert is fetched (and dequantised) once per call, for all tokens routed to it.
    for e in torch.unique(ids).tolist():
        rows, slot = torch.nonzero(ids == e, as_tuple=True)  # tokens that chose e, and at which k
        w = provider.expert(layer, e)
        h = x[rows]  # [n, D]
        y = linear(F.silu(linear(h, w.gate)) * linear(h, w.up), w.down)  # [n, D]
        out.index_add_(0, rows, y * weights[rows, slot, None])
    return out
