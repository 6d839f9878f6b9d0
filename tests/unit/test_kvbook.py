"""The K/V bookkeeping: pages over mapped chunks, shared prefixes, kept conversations, trimming.
Pure Python, no torch."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from strata.engine import kvbook
from strata.engine.kvbook import SINK, KVBook, KVBookError, common_prefix

PAGE = 4


def book(max_pages: int = 32, keep: int = 2, mapped_pages: int | None = None) -> KVBook:
    b = KVBook(PAGE, 100, 300, max_pages, keep)  # a chunk holds three pages
    b.set_mapped(b.bytes_for(max_pages if mapped_pages is None else mapped_pages))
    return b


def run(b: KVBook, prompt: list[int], extra: int = 0) -> int:
    """What the runner does for a request: begin, reserve and write the rest, then ``extra``
    generated tokens one by one. Returns the reused length."""
    reused = b.begin(prompt)
    b.reserve(len(prompt))
    b.extend(prompt[reused:])
    for i in range(extra):
        b.reserve(len(b.active.tokens) + 1)
        b.extend([1000 + i])
    b.check()
    return reused


def test_the_module_imports_no_torch() -> None:
    tree = ast.parse(Path(kvbook.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in names if m.split(".")[0] in ("torch", "triton", "cuda")}


def test_bad_sizes_name_the_option() -> None:
    with pytest.raises(KVBookError, match="kv_keep_conversations=-1"):
        KVBook(PAGE, 100, 300, 8, -1)
    with pytest.raises(KVBookError, match="page=0"):
        KVBook(0, 100, 300, 8, 1)
    with pytest.raises(KVBookError, match="max_pages=True"):
        KVBook(PAGE, 100, 300, True, 1)  # type: ignore[arg-type]


def test_chunk_arithmetic() -> None:
    b = KVBook(PAGE, 100, 300, 10, 1)
    assert b.reserved_bytes == 1200  # ten pages of 100 bytes in chunks of 300
    assert b.bytes_for(4) == 600 and b.pages_in(600) == 6
    b.set_mapped(300)
    assert b.mapped == 3 and b.free_pages == 2  # the sink is never free
    assert b.used_pages == 1 and b.top_used() == 1


def test_pages_are_handed_out_lowest_first_and_come_back() -> None:
    b = book()
    assert run(b, list(range(10))) == 0
    assert b.active.pages == [1, 2, 3]
    b.truncate(5)
    assert b.active.pages == [1, 2] and b.active.tokens == list(range(5))
    b.check()


def test_a_second_turn_shares_its_prefix_pages_and_copies_the_page_it_writes() -> None:
    b = book()
    first = list(range(10))  # pages 1, 2 full, page 3 holds two positions
    run(b, first, extra=3)  # 13 positions: pages 1, 2, 3, 4
    turn2 = [*first, 1000, 1001, 1002, 50, 51, 52, 53]
    assert b.pages_needed(0) == 0
    reused = b.begin(turn2)
    assert reused == 13
    shared = b.active.pages
    assert shared == [1, 2, 3, 4]  # the kept conversation's pages, no copy
    assert all(b.refs[p] == 2 for p in shared)
    assert b.pages_needed(len(turn2)) == 1 + 1  # page 4 is written into: copied; page 5 new
    copies = b.reserve(len(turn2))
    assert copies == [(4, 5)]
    assert b.active.pages == [1, 2, 3, 5, 6] and b.refs[4] == 1
    b.extend(turn2[reused:])
    b.check()


def test_the_last_prompt_token_is_always_computed() -> None:
    b = book()
    run(b, [1, 2, 3, 4, 5])
    assert b.begin([1, 2, 3, 4, 5]) == 4
    assert b.begin([1, 2]) == 1


def test_two_interleaved_conversations_both_reuse_their_prefixes() -> None:
    b = book(keep=2)
    a1, c1 = [1] * 9, [2] * 9
    assert run(b, a1, extra=2) == 0
    assert run(b, c1, extra=2) == 0
    assert run(b, [*a1, 1000, 1001, 7, 7]) == 11
    assert run(b, [*c1, 1000, 1001, 9, 9]) == 11
    # kept: c's first turn (the active second turn may still diverge from it) and a's second
    # (which replaced a's first, a prefix of it)
    assert sorted(b.kept_tokens()) == [11, 13]
    assert len(b.active.tokens) == 13


def test_kept_conversations_are_bounded_and_least_recently_used_go_first() -> None:
    b = book(keep=2)
    for tok in (1, 2, 3, 4):
        run(b, [tok] * 6)
    # the active one is 4's; kept: 2's and 3's (1's was evicted)
    assert [h.tokens[0] for h in b.kept] == [2, 3]
    run(b, [2] * 6 + [9])  # reuses 2's: it becomes the most recently used, 3's goes
    assert [h.tokens[0] for h in b.kept] == [2, 4]
    assert b.evict() > 0 and [h.tokens[0] for h in b.kept] == [4]
    b.check()


def test_no_kept_conversation_still_reuses_the_previous_one() -> None:
    b = book(keep=0)
    run(b, [1, 2, 3, 4, 5, 6])
    assert run(b, [1, 2, 3, 4, 5, 6, 7]) == 6
    assert b.kept == []
    assert run(b, [9, 9]) == 0
    assert b.used_pages == 1 + 1  # the sink and the active sequence's page


def test_an_idle_active_sequence_goes_last_and_only_between_requests() -> None:
    b = book(keep=1)
    run(b, [1] * 6)
    run(b, [2] * 9)
    assert [h.tokens[0] for h in b.kept] == [1] and not b.idle
    assert b.evictable_pages() == b.kept_only_pages() == 2  # 1's two pages; 2's are in use
    b.park()  # the request ended
    assert b.evictable() and b.evictable_pages() == 2 + 3
    assert b.evict() == 2 and b.kept == []  # the kept one first
    assert b.active.tokens == [2] * 9, "the idle sequence stays while something else can go"
    assert b.evict() == 3 and b.active == type(b.active)() and not b.evictable()
    assert b.used_pages == 1 and b.evict() == 0  # the sink alone: nothing left to let go
    b.check()
    run(b, [2] * 10)  # nothing to reuse any more: computed from the start
    assert len(b.active.tokens) == 10 and not b.idle


def test_a_parked_sequence_is_in_use_again_once_it_grows() -> None:
    b = book(keep=0)
    run(b, [3] * 5)
    b.park()
    b.reserve(6)  # the same sequence goes on (a caller that feeds it again)
    assert not b.idle and not b.evictable() and b.evict() == 0
    assert b.active.tokens == [3] * 5
    b.park()
    assert run(b, [3] * 7) == 5 and not b.idle  # the next request reuses it
    b.park()
    b.resume()
    assert not b.evictable()
    b.check()


def test_a_kept_conversation_covered_by_a_longer_one_is_dropped() -> None:
    b = book(keep=4)
    run(b, [1] * 6)
    run(b, [1] * 6 + [2] * 3)  # extends the first: it replaces it when kept
    run(b, [5] * 3)
    assert [len(h.tokens) for h in b.kept] == [9]
    # and a shorter one already covered is not kept beside it
    run(b, [1] * 4 + [3])
    run(b, [6, 6])
    assert sorted(len(h.tokens) for h in b.kept) == [3, 5, 9]
    b.check()


def test_reserve_without_free_pages_is_an_error_naming_the_numbers() -> None:
    b = book(max_pages=6, mapped_pages=3)  # one chunk: the sink and two pages
    b.begin(list(range(20)))
    assert b.pages_needed(20) == 5
    with pytest.raises(KVBookError, match="5 K/V pages needed for 20 positions, 2 free"):
        b.reserve(20)
    b.check()


def test_trim_moves_pages_in_use_below_the_new_top() -> None:
    b = book(max_pages=12, keep=1)
    run(b, [1] * 12)  # pages 1, 2, 3
    run(b, [2] * 12)  # pages 4, 5, 6 (the first is kept)
    b.evict()  # pages 1..3 are free now, 4..6 in use
    assert b.top_used() == 7
    assert b.trim_plan(3) is None  # the sink and three pages do not fit in three
    moves = b.trim_plan(4)
    assert moves == [(4, 1), (5, 2), (6, 3)]
    b.relocate(moves)
    assert b.active.pages == [1, 2, 3]
    b.set_mapped(b.bytes_for(4))
    assert b.mapped == 6  # whole chunks: two of three pages
    b.check()


def test_unmapping_pages_in_use_is_refused() -> None:
    b = book(max_pages=12)
    run(b, [1] * 30)
    with pytest.raises(KVBookError, match="in use"):
        b.set_mapped(b.bytes_for(3))


def test_relocating_onto_a_page_in_use_is_refused() -> None:
    b = book()
    run(b, [1] * 12)
    with pytest.raises(KVBookError, match="cannot move page 1"):
        b.relocate([(1, 2)])


def test_the_table_pads_with_the_sink() -> None:
    b = book()
    run(b, [1] * 5)
    assert b.table(4) == [1, 2, SINK, SINK]
    with pytest.raises(KVBookError, match="do not fit"):
        b.table(1)


def test_common_prefix() -> None:
    a = list(range(300))
    assert common_prefix(a, a, 1000) == 300
    assert common_prefix(a, a, 7) == 7
    b = [*a[:130], -1, *a[131:]]
    assert common_prefix(a, b, 1000) == 130
    assert common_prefix([], a, 5) == 0


def test_random_sessions_keep_every_reference_accounted_for() -> None:
    rng = random.Random(19)
    b = book(max_pages=64, keep=3)
    convs: list[list[int]] = [[] for _ in range(5)]
    for _ in range(300):
        i = rng.randrange(5)
        if rng.random() < 0.2:
            convs[i] = convs[i][: rng.randrange(len(convs[i]) + 1)]  # an edit
        prompt = convs[i] + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
        need = len(prompt) + 3
        b.begin(prompt)
        while b.pages_needed(need) > b.free_pages and b.evict():
            pass
        if b.pages_needed(need) > b.free_pages:
            b.truncate(0)
            convs[i] = []
            continue
        reused = len(b.active.tokens)
        assert prompt[:reused] == b.active.tokens
        b.reserve(len(prompt))
        b.extend(prompt[reused:])
        for t in range(3):
            b.reserve(len(b.active.tokens) + 1)
            b.extend([t])
        convs[i] = list(b.active.tokens)
        b.check()
        b.park()  # the request ends
        if rng.random() < 0.1:  # a budget cut before the next one: everything held may go
            while b.evictable():
                b.evict()
            assert b.used_pages == 1 and not b.active.tokens
            b.check()
        if rng.random() < 0.3:  # a trim as far as the pages in use allow
            target = b.used_pages
            moves = b.trim_plan(target)
            assert moves is not None
            b.relocate(moves)
            b.set_mapped(b.bytes_for(max(target, 1)))
            b.check()
            b.set_mapped(b.bytes_for(64))
