"""Per-request sampling: the knobs and running state of one request's sampler as tensors on the
logits' device, and ``sample``, the one implementation every path runs.

The order follows llama.cpp's default chain: repetition penalty → top-k → top-p → min-p →
temperature → draw. A temperature below ``MIN_TEMPERATURE`` (0.001), or top-k 1, is greedy.

``sample`` is made of device operations with shapes fixed per request and no value read back to
the host, so the GPU runner captures it as a small CUDA graph that runs after each decode step
and writes the chosen token as the next step's input: a sampled step never waits for the host.
The host's own steps (the first token after a prompt, steps that stage a missing expert, the CPU
reference runner) call the same function eagerly on the same state, so a seeded request gives
the same tokens with graphs on and off, and across any mix of the two.

Randomness is counter-based: the uniform number of a request's n-th draw is a hash of (seed, n)
(SplitMix64, integer arithmetic that is exact on every device), so no generator state lives on
the host and the draws do not depend on which path made them.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from strata.engine.params import SamplingParams

# top_k up to this many samples from the k best of one top-CANDIDATES selection; a larger top_k,
# or none, sorts the whole vocabulary
CANDIDATES = 256

_U64 = 1 << 64


def _signed(v: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    return v - _U64 if v >= 1 << 63 else v


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and its ``top`` alternatives (id, log-probability),
    most likely first: log-softmax of the logits after the grammar mask, before the repeat
    penalty, temperature and truncation (the model's distribution over what was allowed)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def uniform_reference(seed: int, n: int) -> float:
    """The request's n-th uniform number in [0, 1), in plain Python (what ``uniform`` computes on
    a device)."""
    z = (seed + n * (_GOLDEN % _U64)) % _U64
    z = ((z ^ (z >> 30)) * (_MIX1 % _U64)) % _U64
    z = ((z ^ (z >> 27)) * (_MIX2 % _U64)) % _U64
    z ^= z >> 31
    return (z >> 11) * 2.0**-53


def _lsr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical shift right of int64 words (torch's >> keeps the sign)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def uniform(seed: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """SplitMix64 of ``seed + n·golden`` as a float64 in [0, 1): int64 [1] tensors in, [1] out.
    int64 arithmetic wraps around on every device torch runs on, so the bits are the same."""
    z = seed + n * _GOLDEN
    z = (z ^ _lsr(z, 30)) * _MIX1
    z = (z ^ _lsr(z, 27)) * _MIX2
    z = z ^ _lsr(z, 31)
    return _lsr(z, 11).double() * 2.0**-53


class SamplingState:
    """One request's sampler on ``device`` for a vocabulary of ``vocab`` tokens: its knobs and
    running state (draws made, the repeat-penalty window) in tensors whose addresses never
    change, and ``out``, where each sample leaves [token, logprob, top ids…, top logprobs…]
    (float64: the host reads one row per token)."""

    def __init__(
        self, params: SamplingParams, seed: int, history: Sequence[int], vocab: int,
        device: torch.device, banned: Sequence[int] = (),
    ) -> None:  # fmt: skip
        p, dev = params, device
        self.vocab = vocab
        # tokens never chosen (the end-of-generation ones under ignore_eos)
        self.banned = torch.tensor(sorted(set(banned)), dtype=torch.int64, device=dev)
        # how many candidates the draw sorts: 0 greedy, CANDIDATES or the whole vocabulary
        if p.greedy:
            self.candidates = 0
        elif 0 < p.top_k <= min(CANDIDATES, vocab):
            self.candidates = min(CANDIDATES, vocab)
        else:
            self.candidates = vocab
        self.window = p.repeat_last_n if p.repeat_penalty != 1.0 else 0
        self.top_n = -1 if p.logprobs is None else min(p.logprobs, vocab)
        i64, f32 = torch.int64, torch.float32

        def scalar(v: float, dtype: torch.dtype = f32) -> torch.Tensor:
            return torch.tensor([v], dtype=dtype, device=dev)

        self.seed = scalar(_signed(seed % _U64), i64)
        self.draws = torch.zeros(1, dtype=i64, device=dev)
        k = p.top_k if 0 < p.top_k <= self.candidates else self.candidates
        self.keep = scalar(k, i64)
        # "off" as a bound nothing reaches (a cumulative sum can round past 1.0)
        self.top_p = scalar(p.top_p if p.top_p < 1.0 else 2.0)
        self.min_p = scalar(p.min_p)
        self.temperature = scalar(max(p.temperature, 1e-3))
        self.penalty = scalar(p.repeat_penalty)
        self.rank = torch.arange(max(self.candidates, 1), dtype=i64, device=dev)
        # the last `window` tokens, a ring whose unused slots hold `vocab` (a padding row)
        self.recent = torch.full((max(self.window, 1),), vocab, dtype=i64, device=dev)
        self.at = torch.zeros(1, dtype=i64, device=dev)
        if self.window:
            last = list(history)[-self.window :]
            if last:
                self.recent[: len(last)] = torch.tensor(last, dtype=i64)
            self.at.fill_(len(last) % self.window)
        self.out = torch.zeros(2 + 2 * max(self.top_n, 0), dtype=torch.float64, device=dev)

    _VALUES = ("seed", "draws", "keep", "top_p", "min_p", "temperature", "penalty", "recent",
               "at", "banned", "out")  # fmt: skip

    @property
    def key(self) -> tuple:
        """What fixes the shapes of ``sample``'s operations: states of one key can share a
        captured graph (``load`` one into the other)."""
        return (self.vocab, self.candidates, self.window, self.top_n, self.banned.numel(),
                self.out.device)  # fmt: skip

    def load(self, other: SamplingState) -> None:
        """Take ``other``'s knobs and running state (of the same ``key``), in place."""
        if other.key != self.key:
            raise ValueError(f"a sampler state of {other.key} cannot load into {self.key}")
        for name in self._VALUES:
            getattr(self, name).copy_(getattr(other, name))

    def snapshot(self) -> tuple[torch.Tensor, ...]:
        return tuple(t.clone() for t in (self.draws, self.recent, self.at))

    def restore(self, saved: tuple[torch.Tensor, ...]) -> None:
        for t, v in zip((self.draws, self.recent, self.at), saved, strict=True):
            t.copy_(v)

    def read(self, row: Sequence[float]) -> tuple[int, TokenLogprob | None]:
        """(token, its log-probability entry or None) from a copy of ``out``."""
        token = int(row[0])
        if self.top_n < 0:
            return token, None
        n = self.top_n
        ids, lps = row[2 : 2 + n], row[2 + n : 2 + 2 * n]
        top = tuple((int(i), float(v)) for i, v in zip(ids, lps, strict=True) if v != float("-inf"))
        return token, TokenLogprob(token, float(row[1]), top)


def sample(st: SamplingState, logits: torch.Tensor) -> torch.Tensor:
    """Choose the next token from ``logits`` [V] (not changed) as ``st`` says; leave it, with
    its log-probabilities when asked for, in ``st.out``, count the draw, add the token to the
    repeat-penalty window, and return it (int64 [1], on the device). Nothing waits."""
    x = logits.float()
    if st.banned.numel():
        x = x.index_fill(0, st.banned, float("-inf"))
    if st.top_n >= 0:
        lp = torch.log_softmax(x, dim=-1)
    if st.window:
        x = _penalised(st, x)
    if st.candidates == 0:
        token = torch.argmax(x).view(1)
        st.out[0:1].copy_(token)
        _remember(st, token)
    else:
        if st.candidates < x.numel():
            vals, ids = torch.topk(x, st.candidates)
        else:
            vals, ids = torch.sort(x, descending=True)
        if x.is_cuda and st.candidates <= CANDIDATES and _kernel() is not None:
            _kernel().draw(vals, ids, st, _GOLDEN, _MIX1, _MIX2)  # type: ignore[union-attr]
        else:
            _draw_torch(st, vals, ids)
        token = st.out[0:1].long()
    if st.top_n >= 0:
        st.out[1:2].copy_(lp.gather(0, token))
        if st.top_n > 0:
            top, top_ids = torch.topk(lp, st.top_n)
            st.out[2 : 2 + st.top_n].copy_(top_ids)
            st.out[2 + st.top_n :].copy_(top)
    return token


def _kernel():  # the one-launch draw (``kernels.sample``) where Triton works; else None
    from strata.engine.kernels import unavailable

    if unavailable() is not None:
        return None
    from strata.engine.kernels import sample as kernel

    return kernel


def _draw_torch(st: SamplingState, vals: torch.Tensor, ids: torch.Tensor) -> None:
    """One draw among ``vals`` [C] (sorted best first) and their token ``ids``, in torch
    operations: the token into ``st.out[0]`` and the window, the draw counted (what
    ``kernels.sample.draw`` does in one launch)."""
    vals = vals.masked_fill(st.rank >= st.keep, float("-inf"))  # top-k
    p = torch.softmax(vals, dim=-1)
    # top-p: keep a token while the mass before it is below p (the first always stays)
    before = p.cumsum(0) - p
    vals = vals.masked_fill((before >= st.top_p) & (st.rank > 0), float("-inf"))
    p = torch.softmax(vals, dim=-1)  # min-p, against the best (the first, sorted)
    vals = vals.masked_fill(p < st.min_p * p[0], float("-inf"))
    probs = torch.softmax(vals / st.temperature, dim=-1)
    pick = _draw(probs, uniform(st.seed, st.draws), st.rank)
    st.draws.add_(1)
    token = ids.gather(0, pick)
    st.out[0:1].copy_(token)
    _remember(st, token)


def _remember(st: SamplingState, token: torch.Tensor) -> None:
    """``token`` into the repeat-penalty window (a ring of the last ``window`` tokens)."""
    if st.window:
        st.recent.scatter_(0, st.at, token)
        st.at.add_(1).remainder_(st.window)


def _penalised(st: SamplingState, x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's rule on the window's tokens: a positive logit divided by the penalty, a
    negative one multiplied by it (once per token, however often it occurs)."""
    padded = torch.cat([x, x.new_zeros(1)])  # the window's free slots point at the pad
    seen = padded.gather(0, st.recent)
    hit = torch.where(seen > 0, seen / st.penalty, seen * st.penalty)
    return padded.scatter(0, st.recent, hit)[: x.numel()]


def _draw(probs: torch.Tensor, u: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """The index [1] where the cumulative distribution first exceeds ``u`` of the total; never
    one of probability 0."""
    cum = probs.double().cumsum(0)
    at = torch.searchsorted(cum, cum[-1:] * u, right=True)
    # rounding can put u * total at the very top: take the last index with any probability
    last = (rank * (probs > 0)).max().view(1)
    return torch.minimum(at, last)


class Sampler:
    """A request's sampler: ``choose(logits)`` on the host's path; ``state_on`` gives the state
    the GPU runner's sampled steps share (one state per request, whichever path draws)."""

    def __init__(self, params: SamplingParams, history: Sequence[int] = (),
                 banned: Sequence[int] = ()) -> None:  # fmt: skip
        self.params = params
        self.banned = tuple(banned)
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        self.seed = seed
        self.history = list(history)
        self.state: SamplingState | None = None

    @property
    def on_device(self) -> bool:
        """Whether a step run ahead needs this sampler (else the step's own argmax serves)."""
        p = self.params
        return not (p.greedy and self.state_window == 0 and p.logprobs is None and not self.banned)

    @property
    def state_window(self) -> int:
        p = self.params
        return p.repeat_last_n if p.repeat_penalty != 1.0 else 0

    def state_on(self, device: torch.device, vocab: int) -> SamplingState:
        st = self.state
        if st is None:
            st = self.state = SamplingState(
                self.params, self.seed, self.history, vocab, device, self.banned
            )
        elif st.vocab != vocab or st.out.device != device:
            raise ValueError(
                f"the sampler's state is for {st.vocab} tokens on {st.out.device}, "
                f"not {vocab} on {device}"
            )
        return st

    @torch.inference_mode()
    def choose(self, logits: torch.Tensor) -> tuple[int, TokenLogprob | None]:
        """The next token from ``logits`` [V] (and its log-probabilities when asked for)."""
        st = self.state_on(logits.device, logits.numel())
        sample(st, logits)
        return st.read(st.out.tolist())

    def __call__(self, logits: torch.Tensor, history: Sequence[int] = ()) -> int:
        """The next token (``history`` is read only by the first call: the state keeps the
        window from then on)."""
        if self.state is None and history:
            self.history = list(history)
        return self.choose(logits)[0]


def apply_repeat_penalty(
    logits: torch.Tensor, recent: Sequence[int], penalty: float
) -> torch.Tensor:
    """llama.cpp's rule: a seen token's positive logit is divided by the penalty, a negative one
    multiplied by it (the reference the sampler's window is tested against)."""
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


def reference_distribution(logits: torch.Tensor, params: SamplingParams,
                           recent: Sequence[int] = ()) -> torch.Tensor:  # fmt: skip
    """The probability of each token under ``params`` by the filter functions above (float64
    [V]): what ``sample``'s draws must follow."""
    x = apply_repeat_penalty(logits.double(), recent, params.repeat_penalty)
    if params.greedy:
        out = torch.zeros_like(x)
        out[torch.argmax(x)] = 1.0
        return out
    x = min_p(top_p(top_k(x, params.top_k), params.top_p), params.min_p)
    return torch.softmax(x / params.temperature, dim=-1)
