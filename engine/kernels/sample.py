"""The sampler's draw among the top candidates in one launch: top-k, top-p, min-p, temperature,
the counter-based uniform number and the inverse-CDF pick over at most ``CANDIDATES`` logits
sorted best first, then the token into the output row and the repeat-penalty window.

Its torch twin is ``engine.sampling._draw_torch``: the same steps as device operations (about
twenty-five launches where this is one). A request's sampler takes one of the two for all its
draws on a device (``engine.sampling.sample``), so its graph and its host steps agree bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lsr(z, s: tl.constexpr):
    # logical shift right of int64 words (>> keeps the sign)
    return (z >> s) & ((1 << (64 - s)) - 1)


@triton.jit
def _draw_kernel(
    vals, ids, keep, top_p, min_p, temperature, seed, draws, out, recent, at,
    golden, mix1, mix2,
    C: tl.constexpr, BLOCK: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    r = tl.arange(0, BLOCK)
    valid = r < C
    neg = float("-inf")
    v = tl.load(vals + r, mask=valid, other=neg).to(tl.float32)
    v = tl.where(r < tl.load(keep), v, neg)  # top-k
    # top-p: keep a candidate while the mass before it is below p (the first always stays)
    m = tl.max(v, 0)
    e = tl.exp(v - m)
    p = e / tl.sum(e, 0)
    before = tl.cumsum(p, 0) - p
    v = tl.where((before >= tl.load(top_p)) & (r > 0), neg, v)
    # min-p, against the best
    e = tl.exp(v - m)
    p = e / tl.sum(e, 0)
    v = tl.where(p < tl.load(min_p) * tl.max(p, 0), neg, v)
    z = v / tl.load(temperature)
    e = tl.exp(z - tl.max(z, 0))
    probs = e / tl.sum(e, 0)
    # the request's n-th uniform number: SplitMix64 of seed + n * golden, int64 words wrapping
    n = tl.load(draws)
    h = tl.load(seed) + n * golden
    h = (h ^ _lsr(h, 30)) * mix1
    h = (h ^ _lsr(h, 27)) * mix2
    h = h ^ _lsr(h, 31)
    u = _lsr(h, 11).to(tl.float64) * (1.0 / 9007199254740992.0)
    cum = tl.cumsum(probs.to(tl.float64), 0)
    target = tl.sum(probs.to(tl.float64), 0) * u
    pick = tl.sum(((cum <= target) & valid).to(tl.int32), 0)
    # rounding can put the target at the very top: never a candidate of probability 0
    last = tl.max(tl.where(probs > 0, r, 0), 0)
    pick = tl.minimum(pick, last)
    token = tl.sum(tl.where(r == pick, tl.load(ids + r, mask=valid, other=0), 0), 0)
    tl.store(draws, n + 1)
    tl.store(out, token.to(tl.float64))
    if WINDOW > 0:
        a = tl.load(at)
        tl.store(recent + a, token)
        tl.store(at, (a + 1) % WINDOW)


def draw(vals: torch.Tensor, ids: torch.Tensor, st, golden: int, mix1: int, mix2: int) -> None:
    """One draw of ``st`` (an ``engine.sampling.SamplingState``) among ``vals`` [C] (sorted best
    first) and their token ``ids``: the token into ``st.out[0]`` and the penalty window, the draw
    counted."""
    C = vals.numel()
    _draw_kernel[(1,)](
        vals, ids, st.keep, st.top_p, st.min_p, st.temperature, st.seed, st.draws, st.out,
        st.recent, st.at, golden, mix1, mix2,
        C=C, BLOCK=triton.next_power_of_2(C), WINDOW=st.window, num_warps=4,
    )  # fmt: skip
