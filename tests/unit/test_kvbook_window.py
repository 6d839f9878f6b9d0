"""The K/V bookkeeping of a sliding window (gpt-oss): the window layers' pages behind the window
go back to the free list as a sequence advances; the window where the last prompt read ended is
kept; a prefix is reused only where the window before its end is held. Pure Python."""

from __future__ import annotations

import random

import pytest

from strata.engine.kvbook import SINK, KVBook, KVBookError, pages_for

PAGE, WINDOW = 4, 6


def book(keep: int = 2, max_pages: int = 64) -> KVBook:
    b = KVBook(PAGE, 100, 300, max_pages, keep, window=WINDOW)
    b.set_mapped(b.bytes_for(max_pages))
    return b


def read(b: KVBook, prompt: list[int], chunk: int = 5) -> int:
    """A request's prompt read in chunks (each chunk's window pages reserved as it comes), then
    marked as read. Returns the reused length."""
    reused = b.begin(prompt)
    pos = reused
    while pos < len(prompt):
        end = min(pos + chunk, len(prompt))
        b.reserve(end)
        b.extend(prompt[pos:end])
        pos = end
        b.check()
    b.mark_read()
    return reused


def decode(b: KVBook, tokens: list[int]) -> None:
    for t in tokens:
        b.reserve(len(b.active.tokens) + 1)
        b.extend([t])
        b.check()


def held_window(b: KVBook) -> list[int]:
    """Indexes of the window pages the active sequence holds."""
    return [i for i, p in enumerate(b.active.wpages) if p != SINK]


def test_a_window_keeps_only_the_pages_of_its_window() -> None:
    b = book()
    read(b, list(range(40)))
    # the window before position 40 is 34..39: pages 8 and 9; every full page is held
    assert held_window(b) == [8, 9]
    assert len(b.active.pages) == pages_for(40, PAGE)
    decode(b, list(range(100, 120)))  # the window moves on; the prompt's end stays kept
    n = len(b.active.tokens)
    want = set(range((n - WINDOW + 1) // PAGE, pages_for(n, PAGE))) | {8, 9}
    assert set(held_window(b)) == want
    assert b.used_pages == 1 + pages_for(n, PAGE) + len(want)


def test_pages_behind_the_window_are_used_again() -> None:
    b = book(max_pages=40)  # 40 pages: a sequence of 120 positions needs 30 full + the windows
    read(b, list(range(120)), chunk=7)
    assert len(b.active.pages) == 30 and b.used_pages <= 1 + 30 + 3
    assert b.free_pages >= 40 - (1 + 30 + 3)


def test_a_prompt_reserves_its_window_pages_chunk_by_chunk() -> None:
    b = book()
    b.begin(list(range(100)))
    need_all = b.pages_needed(100)
    need_first = b.pages_needed(100, window_end=5)
    assert need_first == pages_for(100, PAGE) + pages_for(5, PAGE) < need_all


def test_the_next_turn_goes_on_from_where_the_last_prompt_read_ended() -> None:
    b = book()
    prompt = list(range(30))
    read(b, prompt)
    reply = list(range(500, 540))
    decode(b, reply)  # 40 positions past the prompt: its window's pages went back
    # harmony re-renders the reply: the next prompt diverges right after the last prompt
    second = [*prompt, *range(900, 920)]
    assert read(b, second) == len(prompt)
    # diverging deep inside the reply: back to the latest prefix whose window is held
    b2 = book()
    read(b2, prompt)
    decode(b2, reply)
    third = [*prompt, *reply[:25], *range(900, 910)]
    reused = b2.begin(third)
    assert len(prompt) <= reused < len(prompt) + 25
    window = range(max(0, reused - WINDOW + 1) // PAGE, pages_for(reused, PAGE))
    assert all(b2.active.wpages[i] != SINK for i in window)
    b2.check()


def test_without_the_kept_window_the_reply_would_not_be_reused() -> None:
    b = book()
    prompt = list(range(30))
    b.begin(prompt)
    b.reserve(30)
    b.extend(prompt)  # read, but not marked as a prompt read: no window kept there
    decode(b, list(range(500, 540)))
    assert b.begin([*prompt, *range(900, 920)]) < len(prompt) - WINDOW


def test_truncate_goes_back_to_a_position_whose_window_is_held() -> None:
    b = book()
    read(b, list(range(20)))
    decode(b, list(range(100, 140)))
    assert b.truncate(58) == 58  # within the window: kept as asked
    kept = b.truncate(40)  # its window's pages went back
    assert kept <= 40
    window = range(max(0, kept - WINDOW + 1) // PAGE, pages_for(kept, PAGE))
    assert all(b.active.wpages[i] != SINK for i in window)
    b.check()
    assert b.truncate(0) == 0 and b.active.all_pages() == [] and b.used_pages == 1


def test_kept_conversations_and_trimming_carry_the_window_pages() -> None:
    rng = random.Random(1)
    b = book(keep=2, max_pages=80)
    for _ in range(12):  # requests that extend, diverge and start over
        base = list(b.active.tokens[: rng.randrange(0, len(b.active.tokens) + 1)])
        prompt = base + [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
        read(b, prompt, chunk=rng.randrange(1, 9))
        decode(b, [rng.randrange(1000) for _ in range(rng.randrange(0, 20))])
        b.park()
    moves = b.trim_plan(b.used_pages)
    assert moves is not None
    b.relocate(moves)
    b.set_mapped(b.bytes_for(b.used_pages))
    b.check()
    while b.evictable():
        b.evict()
    b.check()


def test_a_bad_window_is_an_error() -> None:
    with pytest.raises(KVBookError, match="window=-1"):
        KVBook(PAGE, 100, 300, 8, 2, window=-1)
