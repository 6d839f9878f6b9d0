"""Per-request sampling knobs and the sampler that applies them to one row of logits.

The order follows llama.cpp's default chain: repetition penalty → top-k → top-p → min-p →
temperature → draw. A temperature below ``MIN_TEMPERATURE`` (0.001) is greedy.

The logits may live on the GPU: every filter is a device operation and the step hands the host
one token id. The draw takes its uniform number from the request's own seeded generator on the
host, one per token, and picks by the cumulative distribution on the device, so a seeded request
gives the same text whether the step ran as a CUDA graph or eagerly.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from strata.engine.params import SamplingParams


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        self.seed = seed
        self._gen = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, history: Sequence[int]) -> int:
        # logits: [V] float32, on any device
        p = self.params
        recent = history[-p.repeat_last_n :] if p.repeat_last_n > 0 else []
        logits = apply_repeat_penalty(logits, recent, p.repeat_penalty)
        if p.greedy:
            return int(torch.argmax(logits))
        ids = None
        if 0 < p.top_k < logits.numel():
            # the k best as candidates (sorted, best first): the later filters see only them
            logits, ids = torch.topk(logits, p.top_k)
        logits = top_p(logits, p.top_p)
        logits = min_p(logits, p.min_p)
        probs = torch.softmax(logits / p.temperature, dim=-1)
        u = float(torch.rand((), generator=self._gen, dtype=torch.float64))
        pick = draw(probs, u)
        return int(ids[pick]) if ids is not None else pick


def draw(probs: torch.Tensor, u: float) -> int:
    """The index where the cumulative distribution first exceeds ``u`` in [0, 1) of the total;
    never one of probability 0."""
    cum = probs.double().cumsum(0)
    at = torch.searchsorted(cum, cum[-1:] * u, right=True)
    # rounding can put u * total at the very top: take the last index with any probability
    last = torch.nonzero(probs).max()
    return int(torch.minimum(at[0], last))


def apply_repeat_penalty(
    logits: torch.Tensor, recent: Sequence[int], penalty: float
) -> torch.Tensor:
    """llama.cpp's rule: a seen token's positive logit is divided by the penalty, a negative one
    multiplied by it."""
    if penalty == 1.0 or not recent:
        return logits
    ids = torch.tensor(sorted(set(recent)), dtype=torch.long, device=logits.device)
    out = logits.clone()
    seen = out[ids]
    out[ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
    return out


def top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.numel():
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``p``."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
    # keep a token when the mass before it is still below p (the first token always stays)
    drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= p
    drop_sorted[0] = False  # a p below float32's range would otherwise drop every token
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def min_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Drop tokens whose probability is below ``p`` times the most likely token's."""
    if p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < p * probs.max(), float("-inf"))
