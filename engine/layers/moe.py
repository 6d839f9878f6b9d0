"""The routed Mixture-of-Experts feed-forward block: the only place expert weights are read."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from strata.engine.experts import ExpertProvider
from strata.engine.weights import Weight, linear


@dataclass(frozen=True)
class MoEShape:
    n_expert: int
    n_expert_used: int
    norm_topk: bool  # renormalise the k chosen weights to sum to 1


def route(x: torch.Tensor, router: Weight, shape: MoEShape) -> tuple[torch.Tensor, torch.Tensor]:
    # x: [T, D] -> weights: [T, K], ids: [T, K]
    probs = torch.softmax(linear(x, router), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, shape.n_expert_used, dim=-1)
    if shape.norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe(
    x: torch.Tensor,
    router: Weight,
    shape: MoEShape,
    provider: ExpertProvider,
    layer: int,
) -> torch.Tensor:
    # x: [T, D] -> [T, D]
    T, D = x.shape
    K = shape.n_expert_used
    weights, ids = route(x, router, shape)  # [T, K] each
    # The T*K (token, choice) assignments grouped by expert: one host sync per layer (the counts),
    # then each chosen expert is fetched (and dequantised) once, for all of its tokens.
    flat = ids.reshape(-1)  # [T*K], assignment a = t*K + k
    order = torch.argsort(flat, stable=True)  # [T*K] assignments in expert order
    counts = torch.bincount(flat, minlength=shape.n_expert).tolist()
    xs = x.index_select(0, order // K)  # [T*K, D] each assignment's token
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        w = provider.expert(layer, e)
        h = xs[start : start + n]  # [n, D]
        ys[start : start + n] = linear(F.silu(linear(h, w.gate)) * linear(h, w.up), w.down)
        start += n
    y = torch.empty_like(ys).index_copy_(0, order, ys)  # [T*K, D] back in (t, k) order
    # the K outputs of each token summed in a fixed order: the same bits whatever is cached
    return (y.view(T, K, D) * weights[:, :, None]).sum(dim=1)
