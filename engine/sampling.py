"""Per-request sampling knobs and the sampler that applies them to one row of logits.

The order follows llama.cpp's default chain: repetition penalty → top-k → top-p → min-p →
temperature → draw. A temperature of 0 (or below) is greedy.
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
        # logits: [V] float32
        p = self.params
        logits = apply_repeat_penalty(logits, history[-p.repeat_last_n :], p.repeat_penalty)
        if p.greedy:
            return int(torch.argmax(logits))
        logits = top_k(logits, p.top_k)
        logits = top_p(logits, p.top_p)
        logits = min_p(logits, p.min_p)
        probs = torch.softmax(logits / p.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self._gen))


def apply_repeat_penalty(
    logits: torch.Tensor, recent: Sequence[int], penalty: float
) -> torch.Tensor:
    """llama.cpp's rule: a seen token's positive logit is divided by the penalty, a negative one
    multiplied by it."""
    if penalty == 1.0 or not recent:
        return logits
    ids = torch.tensor(sorted(set(recent)), dtype=torch.long)
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
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def min_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Drop tokens whose probability is below ``p`` times the most likely token's."""
    if p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < p * probs.max(), float("-inf"))
