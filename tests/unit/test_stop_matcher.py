"""The stop matcher against the semantics it replaced: the same text released after every piece,
the same cut, the same flag, on random texts and stop lists (a fixed seed) that overlap, are
prefixes of each other, sit inside each other and use characters of several UTF-8 bytes.

``Naive`` is the matcher as it was (``str.find`` for every stop, every tail checked against
every prefix): quadratic in the stops' lengths per piece, and the reference for what is released.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from strata.engine.generation import _StopMatcher

SEED = 16
ALPHABET = "abé日🙂"  # 1, 1, 2, 3 and 4 bytes of UTF-8: few letters, so stops overlap often


class Naive:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        self.pending += text
        first = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if first >= 0:
            out, self.pending = self.pending[:first], ""
            return out, True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def pieces(rng: random.Random, text: str) -> list[str]:
    """``text`` cut at random places, empty pieces included (a token that completes no
    character yields "")."""
    out, i = [], 0
    while i < len(text):
        n = rng.choice((0, 1, 1, 1, 2, 3, 7))
        out.append(text[i : i + n])
        i += n
    return out


def replay(stops: Sequence[str], parts: Sequence[str]) -> None:
    fast, naive = _StopMatcher(stops), Naive(stops)
    longest = max((len(s) for s in stops), default=1)
    for k, part in enumerate(parts):
        got, want = fast.push(part), naive.push(part)
        assert got == want, (stops, parts[: k + 1])
        assert len(fast.pending) <= max(0, longest - 1)
        if want[1]:
            assert fast.hit
            return
    assert not fast.hit
    assert fast.flush() == naive.flush(), (stops, parts)


def random_word(rng: random.Random, shortest: int, longest: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(shortest, longest)))


def test_random_texts_and_stops_release_what_the_naive_matcher_released() -> None:
    rng = random.Random(SEED)
    for _ in range(4000):
        stops = [random_word(rng, 1, 6) for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.3:  # a stop that begins, ends or contains another
            base = rng.choice(stops)
            before, after = random_word(rng, 0, 2), random_word(rng, 1, 3)
            stops.append(rng.choice((base + after, before + "a" + base, before + base + after)))
        text = random_word(rng, 0, 60)
        if rng.random() < 0.5:  # make a match likely, somewhere in the middle
            at = rng.randint(0, len(text))
            text = text[:at] + rng.choice(stops) + text[at:]
        replay(stops, pieces(rng, text))


CASES = [
    (["abcd", "bc"], ["abcd"]),  # the longer stop starts first: it wins
    (["abcd", "bc"], ["a", "b", "c"]),  # pushed one by one, "bc" completes first
    (["ab", "abc"], ["abc"]),  # a prefix of the other
    (["abab", "bab"], ["aba", "bab"]),  # overlapping, a match inside the held-back text
    (["aab"], ["a", "a", "a", "a", "b"]),  # the held-back tail slides
    (["日本語"], ["日本", "日本語です"]),  # several bytes per character
    (["🙂🙂x"], ["🙂", "🙂", "🙂", "x"]),
    (["é"], ["cafe", "é au lait"]),
    (["zz"], ["", "", "z", "", "a"]),
    ([], ["anything at all"]),
]


@pytest.mark.parametrize(("stops", "parts"), CASES, ids=[" ".join(c[0]) or "none" for c in CASES])
def test_cases_that_overlap_nest_and_span_pieces(stops: list[str], parts: list[str]) -> None:
    replay(stops, parts)


def test_a_long_text_of_near_misses_keeps_only_the_tail_it_may_need() -> None:
    # "a" * 255 + "b": every piece of "a"s could begin it, so 255 characters stay held back
    stop = "a" * 255 + "b"
    m = _StopMatcher([stop, "c" * 256])
    released = []
    for _ in range(2000):
        out, hit = m.push("a")
        assert not hit
        released.append(out)
        assert len(m.pending) <= 255
    assert "".join(released) == "a" * (2000 - 255)
    assert m.push("b") == ("", True)
