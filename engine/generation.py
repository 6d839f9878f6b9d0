"""One generation: prefill, then one token per ``Generation.step()``, with sampling, look-ahead
greedy runs, grammar masks, log-probabilities, stop strings and the K/V's end.

``Engine.generate`` builds a :class:`Generation` and turns its :class:`TokenEvent` s into the
callbacks it takes; :class:`TextEmitter` turns tokens into final text (UTF-8 assembly, stop
strings held back, each token's log-probability handed over with the text that follows it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from strata.engine.grammar import Constraint
from strata.engine.params import SamplingParams
from strata.engine.sampling import Sampler, TokenLogprob
from strata.engine.sequences import KVFull, SafePoint, Sequences
from strata.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens whose K/V an earlier request left (not computed again)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    first_token_s: float | None = None  # from the call to the first generated token
    seed: int | None = None
    token_times: list[float] = field(default_factory=list)  # monotonic time of each token
    logprobs: list[TokenLogprob] | None = None  # one per token when asked for
    mask_s: float = 0.0  # host time spent computing grammar masks

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    @property
    def decode_tok_s(self) -> float | None:
        # tokens after the first are the decode steps
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else None


@dataclass(frozen=True)
class TokenEvent:
    """What one step made final. A generated token (``token``) and the text it completed
    (possibly none yet: a stop string or a UTF-8 sequence may still be under way), with the
    log-probabilities of the tokens that text comes from; the last event has no token and a
    ``finish_reason``, and carries the text held back until the end."""

    token: int | None
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()  # handed over just before ``text``
    finish_reason: FinishReason | None = None


Logprobs = tuple[TokenLogprob, ...]
Choice = tuple[int, TokenLogprob | None]  # a token and its log-probabilities, when asked for


class _Cancelled(Exception):
    """Raised at a prompt chunk's boundary when the caller cancelled (never leaves a step)."""


class Generation:
    """Generates up to ``params.max_tokens`` tokens after ``prompt`` (``Engine.generate`` says
    what each argument does). ``step()`` returns the next :class:`TokenEvent`, the last one with
    a ``finish_reason``, then None; ``result`` is complete once it has."""

    def __init__(
        self,
        sequences: Sequences,
        tokenizer: Tokenizer,
        prompt: Sequence[int],
        params: SamplingParams,
        cancelled: Callable[[], bool] | None = None,
        safe_point: SafePoint | None = None,
        constraint: Constraint | None = None,
        show_special: frozenset[int] = frozenset(),
    ) -> None:
        self.sequences, self.tokenizer, self.params = sequences, tokenizer, params
        self.prompt, self.history = list(prompt), list(prompt)
        self.cancelled, self.safe_point, self.constraint = cancelled, safe_point, constraint
        # under ignore_eos the end-of-generation tokens are never chosen
        banned = tokenizer.eog_ids if params.ignore_eos else ()
        self.sampler = Sampler(params, prompt, banned)
        self.result = GenerationResult("", [], "length", len(prompt), seed=self.sampler.seed)
        if params.logprobs is not None:
            self.result.logprobs = []
        self.text = TextEmitter(tokenizer, params.stop, show_special)
        # a step needs nothing from the host but a grammar's mask: where the GPU runner can,
        # it runs one step ahead (Sequences.ahead), choosing each token on the device with the
        # request's sampler (under a grammar, step n+1 runs while the host computes its mask
        # from token n)
        self._ahead: Iterator[Choice] | None = None  # the look-ahead's tokens
        self._logits: torch.Tensor | None = None  # the next token's, when sampled on the host
        self._token: Choice | None = None  # the next token, when the look-ahead chose it
        self._started = False
        self._ending: FinishReason | None = None  # the reason, once the last token is out
        self._done = False
        self._last = -1  # the last token recorded
        self._t0 = 0.0
        self._t_first: float | None = None

    def __iter__(self) -> Iterator[TokenEvent]:
        while (event := self.step()) is not None:
            yield event

    def step(self) -> TokenEvent | None:
        """The next token's event (or the last event, or None once that was returned)."""
        if self._done:
            return None
        if self._ending is not None:
            return self._finish(self._ending)
        if not self._started:
            self._started = True
            if not self._prefill():
                return self._cancelled_in_prefill()
        elif not self._advance():
            return self._finish("length")  # the budget has no room for one more position
        if self.cancelled is not None and self.cancelled():
            return self._finish("cancelled")
        choice = self._token if self._token is not None else self._sample()
        if choice is None:
            return self._finish("stop")  # the grammar cannot go on
        token, entry = choice
        now = time.monotonic()
        if self._t_first is None:
            self._t_first = now
            self.result.first_token_s = now - self._t0
        if token in self.tokenizer.eog_ids:
            return self._finish("stop")
        return self._record(token, entry, now)

    # -- the steps --------------------------------------------------------------------------

    def _boundary(self) -> None:
        if self.safe_point is not None:
            self.safe_point()

    def _prompt_boundary(self) -> None:  # a long prompt can be cancelled between its chunks
        self._boundary()
        if self.cancelled is not None and self.cancelled():
            raise _Cancelled

    def _prefill(self) -> bool:
        """The prompt's K/V (what an earlier request left is reused); False: cancelled."""
        self._t0 = time.monotonic()
        todo = self.sequences.start(self.prompt)
        self.result.cached_tokens = len(self.prompt) - len(todo)
        try:
            self._logits = self.sequences.feed(todo, self._prompt_boundary)
        except _Cancelled:  # the K/V keeps the chunks fed so far: a retry reuses them
            return False
        finally:
            self.result.prefill_s = time.monotonic() - self._t0
        return True

    def _sample(self) -> Choice | None:
        """The next token from the host's logits (masked by the grammar first), or None where
        the grammar has no way on."""
        assert self._logits is not None
        if self.constraint is not None:
            # the host computes the mask while the device still runs the step
            self._logits = self.sequences.mask_logits(self._logits, self.constraint)
            if self.constraint.error is not None:
                return None
        return self.sampler.choose(self._logits)

    def _record(self, token: int, entry: TokenLogprob | None, now: float) -> TokenEvent:
        """``token`` (and its log-probabilities, when asked for) into the result, the history,
        the grammar and the text; whether it ends the generation is the next step's."""
        result = self.result
        if entry is not None:
            assert result.logprobs is not None
            result.logprobs.append(entry)
        result.tokens.append(token)
        result.token_times.append(now)
        self.history.append(token)
        if self.constraint is not None:
            self.constraint.accept(token)
        text, logprobs, hit = self.text.push(token, entry)
        result.text += text
        self._ending = self._end_after(hit)
        self._last = token
        return TokenEvent(token, text, logprobs)

    def _end_after(self, hit: bool) -> FinishReason | None:
        if hit or (self.constraint is not None and self.constraint.done):
            return "stop"  # a stop string, or a complete grammar: only an end may follow
        if len(self.result.tokens) >= self.params.max_tokens:
            return "length"
        return None

    def _advance(self) -> bool:
        """The last token fed (its logits for the host to sample), or the look-ahead's next
        token taken; False where the K/V has no room for one more position."""
        if self._ahead is None and self.sequences.can_look_ahead():
            left = self.params.max_tokens - len(self.result.tokens)
            self._ahead = self.sequences.ahead(
                self._last, left, self._boundary, self.constraint, self.sampler
            )
        if self._ahead is not None:
            nxt = next(self._ahead, None)
            if nxt is not None:
                self._token = nxt
                return True
            self._ahead = None  # the look-ahead ended: the last token is not fed yet
        self._token = None
        try:
            self._logits = self.sequences.feed([self._last], self._boundary)
        except KVFull as e:  # as a context end
            log.warning("generation ends: %s", e)
            return False
        return True

    def _cancelled_in_prefill(self) -> TokenEvent:
        self._done = True
        self.result.finish_reason = "cancelled"
        return TokenEvent(None, finish_reason="cancelled")

    def _finish(self, reason: FinishReason) -> TokenEvent:
        """The last event: what the text held back, now final, and the reason."""
        self._done, result = True, self.result
        if self._ahead is not None:
            self._ahead.close()
        result.finish_reason = reason
        tail, logprobs, hit = self.text.finish()
        if hit:
            result.finish_reason = "stop"
        result.text += tail
        if self._t_first is not None:
            result.decode_s = time.monotonic() - self._t_first
        if self.constraint is not None:
            result.mask_s = self.constraint.mask_s
        self.sequences.settle()
        return TokenEvent(None, tail, logprobs, result.finish_reason)


class TextEmitter:
    """Tokens in, final text out: the token bytes assembled into UTF-8 (invalid UTF-8, a byte
    token a model emits out of sequence, is dropped as llama-cpp-python does, not shown as
    U+FFFD), text that may still become a stop string held back, and each token's
    log-probability handed over with the text that follows it."""

    def __init__(
        self, tokenizer: Tokenizer, stops: Sequence[str], show_special: frozenset[int]
    ) -> None:
        self.decoder = tokenizer.stream_decoder(errors="ignore", keep=show_special)
        self.stops = _StopMatcher(stops)
        self.pending: list[TokenLogprob] = []  # logprobs not yet handed over

    def push(self, token: int, entry: TokenLogprob | None) -> tuple[str, Logprobs, bool]:
        """(text now final, the logprobs handed over with it, whether a stop string matched)."""
        if entry is not None:
            self.pending.append(entry)
        text, hit = self.stops.push(self.decoder.push(token))
        return text, self._release() if text else (), hit

    def finish(self) -> tuple[str, Logprobs, bool]:
        """What the decoder and the stop matcher still hold back, final now (nothing after a
        stop string), with every logprob not yet handed over (a stop string's tokens')."""
        if self.stops.hit:
            return "", self._release(), False
        ready, hit = self.stops.push(self.decoder.flush())
        tail = ready if hit else ready + self.stops.flush()
        return tail, self._release(), hit

    def _release(self) -> Logprobs:
        out = tuple(self.pending)
        self.pending.clear()
        return out


class _StopMatcher:
    """Holds back text that could still become a stop string; cuts at the first full match.

    An Aho–Corasick automaton over the stop strings: each character of generated text moves it
    one state (amortised over the text), so the work per piece is linear in the piece whatever
    the stops are, where looking for every stop in every tail was quadratic in their lengths. Its
    state is the longest tail of the text that is a prefix of some stop: exactly the text held
    back, so nothing is shown that a stop may still swallow. When the text completes matches, the
    one that starts first wins (a long stop that began earlier beats a short one inside it), as
    ``str.find`` with each stop would pick.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.pending = ""
        self.hit = False
        self._longest = max((len(s) for s in self.stops), default=0)
        # the trie of the stops: node 0 is the root; per node its children, failure link, depth
        # and the length of the longest stop that ends there (0: none)
        self._next: list[dict[str, int]] = [{}]
        self._fail = [0]
        self._depth = [0]
        self._out = [0]
        for s in self.stops:
            self._insert(s)
        self._link()
        self._state = 0

    def _insert(self, s: str) -> None:
        node = 0
        for c in s:
            child = self._next[node].get(c)
            if child is None:
                child = len(self._next)
                self._next[node][c] = child
                self._next.append({})
                self._fail.append(0)
                self._depth.append(self._depth[node] + 1)
                self._out.append(0)
            node = child
        self._out[node] = len(s)

    def _link(self) -> None:
        """Failure links, breadth first: a node's link is its longest proper suffix in the trie,
        and a node that ends no stop itself inherits the longest stop its link ends."""
        queue = list(self._next[0].values())
        for node in queue:  # the root's children keep the root as their link
            for c, child in self._next[node].items():
                self._fail[child] = self._step(self._fail[node], c)
                if not self._out[child]:
                    self._out[child] = self._out[self._fail[child]]
                queue.append(child)

    def _step(self, state: int, c: str) -> int:
        while state and c not in self._next[state]:
            state = self._fail[state]
        return self._next[state].get(c, 0)

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text now final, whether a stop string matched)."""
        if not self.stops:
            return text, False
        held = len(self.pending)
        state, first = self._state, -1
        for i, c in enumerate(text):
            state = self._step(state, c)
            end = held + i + 1  # of the match in pending + text, exclusive
            if self._out[state] and (first < 0 or end - self._out[state] < first):
                first = end - self._out[state]
            if first >= 0 and end - first >= self._longest - 1:
                break  # a match that starts before `first` would have ended by now
        if first >= 0:
            out = (self.pending + text)[:first]
            self.pending, self._state, self.hit = "", 0, True
            return out, True
        keep = self._depth[state]
        whole = self.pending + text
        cut = len(whole) - keep
        out, self.pending, self._state = whole[:cut], whole[cut:], state
        return out, False

    def flush(self, text: str = "") -> str:
        out, self.pending, self._state = self.pending + text, "", 0
        return out
