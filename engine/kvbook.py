"""The K/V cache's bookkeeping: pages, who holds them, and the kept conversations. Plain Python.

The K/V lives in fixed-size *pages* of ``page`` positions (all layers' keys and values of those
positions), cut out of one reserved virtual range that is mapped in chunks from the bottom
(``engine.kv`` maps them; this module only counts). Page ``i`` occupies bytes
``[i * page_bytes, (i + 1) * page_bytes)``, so the pages usable are those wholly inside the
mapped part. Page 0 is the *sink*: never handed out, it is where the unused entries of a block
table point, so a padded prompt chunk's extra rows land there and nowhere else.

Holders:

* the **active sequence** (the conversation the runner computes): its tokens and the pages that
  hold them, position ``p`` in ``pages[p // page]``; it may own pages ahead of its tokens
  (reserved for the next chunk);
  between requests it is *idle* (``park``): its pages may then go, after every kept one, when
  the budget needs them (a lease waiting for room must not wait for the next request);
* the **kept** conversations: the tokens and pages of recent requests, most recently used last,
  at most ``keep`` of them. A new request starts from the one sharing the longest prefix with its
  prompt: the whole pages of that prefix are shared (a reference more each, no copy); the page
  the prompt goes on writing into is copied first if anyone else holds it (copy on write).

**A sliding window** (``window``: gpt-oss's alternate layers): a page then holds the positions of
one of two groups of layers — the full layers, whose pages (``Held.pages``) cover every position,
or the window layers (``Held.wpages``), whose pages behind the window go back to the free list as
the sequence advances (recycled; ``SINK`` stands where a page was let go). A conversation keeps
two windows: the one ending at its last position, and the one ending where its last prompt read
ended (``pin``): the next request re-renders the reply differently (harmony drops its analysis),
so its prompt diverges there, and the window layers can go on from that point. A prefix is
usable when the window before its end is held (``usable``); ``begin`` and ``truncate`` go back
to the longest usable one.

A page is free when nobody holds it. Trimming the mapped part moves pages in use above the new
top into free pages below it (``trim_plan`` / ``relocate``): the caller copies their bytes and
rewrites the block table, so every holder's list follows the move.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

SINK = 0  # the page unused block-table entries point at


class KVBookError(Exception):
    """A request the bookkeeping cannot carry out; the message names the numbers."""


@dataclass
class Held:
    """A conversation's tokens and the pages of their K/V (position p: ``pages[p // page]``)."""

    tokens: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    wpages: list[int] = field(default_factory=list)  # the window layers' (SINK: let go)
    pin: int = 0  # where the last prompt read ended: its window is kept
    swept: int = 0  # window pages below this index were let go (but the pin's)

    def all_pages(self) -> list[int]:
        return self.pages + [p for p in self.wpages if p != SINK]


def pages_for(tokens: int, page: int) -> int:
    return -(-tokens // page)


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int, step: int = 64) -> int:
    """The length of the longest common prefix of ``a`` and ``b``, at most ``limit``: compared a
    slice at a time (long prompts are compared at C speed), then token by token."""
    n = min(len(a), len(b), limit)
    i = 0
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


class KVBook:
    """The pages of one K/V range (see the module doc). ``max_pages``: the pages the reservation
    holds; ``keep``: the most conversations kept for reuse besides the active one."""

    def __init__(
        self, page: int, page_bytes: int, chunk_bytes: int, max_pages: int, keep: int,
        window: int = 0,
    ) -> None:  # fmt: skip
        for name, v, least in (
            ("page", page, 1), ("page_bytes", page_bytes, 1), ("chunk_bytes", chunk_bytes, 1),
            ("max_pages", max_pages, 2), ("kv_keep_conversations", keep, 0),
        ):  # fmt: skip
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise KVBookError(f"{name}={v!r}: expected a whole number of at least {least}")
        self.page, self.page_bytes, self.chunk_bytes = page, page_bytes, chunk_bytes
        self.max_pages, self.keep = max_pages, keep
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise KVBookError(f"window={window!r}: expected a whole number of positions >= 0")
        self.window = window  # 0: no window layers
        self.refs = [0] * max_pages
        self.refs[SINK] = 1  # held for ever
        self.mapped = 0  # pages [0, mapped) are backed by memory
        self._free: list[int] = []  # a heap of free mapped pages: the lowest is handed out first
        self.active = Held()
        self.idle = False  # the active sequence's request has ended (``park``)
        self.kept: list[Held] = []  # least recently used first

    # -- memory ----------------------------------------------------------------------------------

    @property
    def reserved_bytes(self) -> int:
        """The virtual range to reserve: every page, rounded up to whole chunks."""
        return self.bytes_for(self.max_pages)

    def bytes_for(self, pages: int) -> int:
        """Mapped bytes (whole chunks) that hold pages [0, pages)."""
        return -(-pages * self.page_bytes // self.chunk_bytes) * self.chunk_bytes

    def pages_in(self, mapped_bytes: int) -> int:
        """The pages wholly inside ``mapped_bytes``."""
        return min(self.max_pages, mapped_bytes // self.page_bytes)

    def set_mapped(self, mapped_bytes: int) -> None:
        """The mapped part is now ``mapped_bytes``: its new pages are free; pages above it must
        be free already (``trim_plan`` moves the others first)."""
        n = self.pages_in(mapped_bytes)
        if n < self.mapped:
            held = [p for p in range(n, self.mapped) if self.refs[p]]
            if held:
                raise KVBookError(
                    f"cannot unmap pages {n}..{self.mapped - 1}: {len(held)} of them are in use "
                    f"(first {held[0]}); move them below first"
                )
            self._free = [p for p in self._free if p < n]
            heapq.heapify(self._free)
        else:
            for p in range(self.mapped, n):
                if not self.refs[p]:
                    heapq.heappush(self._free, p)
        self.mapped = n

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        """Pages someone holds (the sink included) among the mapped ones."""
        return self.mapped - len(self._free)

    def top_used(self) -> int:
        """One past the highest page in use (at least 1: the sink)."""
        top = self.mapped
        while top > 1 and not self.refs[top - 1]:
            top -= 1
        return max(top, 1)

    # -- pages -----------------------------------------------------------------------------------

    def _alloc(self) -> int:
        if not self._free:
            raise KVBookError(
                f"no free K/V page: {self.mapped} mapped, all in use; map more or evict first"
            )
        p = heapq.heappop(self._free)
        self.refs[p] = 1
        return p

    def _drop(self, pages: Sequence[int]) -> None:
        for p in pages:
            assert self.refs[p] > 0 and p != SINK, f"page {p} dropped more often than held"
            self.refs[p] -= 1
            if not self.refs[p] and p < self.mapped:
                heapq.heappush(self._free, p)

    def _hold(self, pages: Sequence[int]) -> None:
        for p in pages:
            assert self.refs[p] > 0, f"page {p} is free: it cannot be shared"
            self.refs[p] += 1

    # -- the active sequence ---------------------------------------------------------------------

    def begin(self, prompt: Sequence[int]) -> int:
        """Start the active sequence for ``prompt`` from the held conversation (kept, or the
        previous active one) that shares the longest prefix with it, at most ``len(prompt) - 1``
        tokens (the last is always computed, for its logits); returns that length. The previous
        active sequence is kept (at most ``keep``), unless a kept one already covers it."""
        limit = len(prompt) - 1
        previous = self.active
        sources = [*self.kept, previous]
        best, best_n = None, 0
        for held in sources:
            n = self.usable(held, common_prefix(held.tokens, prompt, limit))
            if n > best_n:
                best, best_n = held, n
        seq = Held(list(prompt[:best_n]), [])
        if best is not None:
            seq.pages = best.pages[: pages_for(best_n, self.page)]
            seq.wpages = best.wpages[: pages_for(best_n, self.page)]
            seq.pin = best.pin if best.pin <= best_n else 0
            self._hold(seq.all_pages())
            if best is not previous:
                self.kept.remove(best)
                self.kept.append(best)  # the most recently used
        self.active, self.idle = seq, False
        self._keep(previous)
        self._sweep(seq, full=True)
        return best_n

    # -- the window layers -----------------------------------------------------------------------

    def usable(self, held: Held, n: int) -> int:
        """The longest prefix of ``held``'s first ``n`` tokens the window layers can go on from:
        the window before its end held (every prefix without a window)."""
        if not self.window:
            return n
        while n > 0:
            lo = max(0, n - self.window + 1)
            needed = range(lo // self.page, pages_for(n, self.page))
            holes = [i for i in needed if i >= len(held.wpages) or held.wpages[i] == SINK]
            if not holes:
                return n
            n = min(n - 1, holes[-1] * self.page)  # end before the last hole, and retry
        return 0

    def _kept_window(self, held: Held, i: int) -> bool:
        """Whether window page ``i`` of ``held`` is in one of its two windows."""
        n, w, page = len(held.tokens), self.window, self.page
        for end in (n, held.pin):
            if end and (end - w + 1) // page <= i < pages_for(end, page) and i * page < end:
                return True
        return i * page >= n  # reserved ahead for what comes next

    def _sweep(self, held: Held, full: bool = False) -> None:
        """Let go of ``held``'s window pages behind both its windows (``full``: all of them;
        else those passed since the last sweep)."""
        if not self.window:
            return
        stop = max(0, len(held.tokens) - self.window + 1) // self.page
        for i in range(0 if full else held.swept, min(stop, len(held.wpages))):
            p = held.wpages[i]
            if p != SINK and not self._kept_window(held, i):
                self._drop([p])
                held.wpages[i] = SINK
        held.swept = max(held.swept, stop) if not full else stop

    def mark_read(self) -> None:
        """A prompt read ends here: the active sequence keeps the window ending here (and lets
        the previous prompt's go) until it advances past the next one."""
        self.active.pin = len(self.active.tokens)
        self._sweep(self.active, full=True)

    def park(self) -> None:
        """The active sequence's request has ended: its pages stay (the next prompt that
        extends it reuses them) but, after every kept conversation, may go when the budget
        needs them, until ``resume`` (or ``begin``)."""
        self.idle = True

    def resume(self) -> None:
        """The active sequence is in use again (it is about to grow): its pages stay."""
        self.idle = False

    def _keep(self, held: Held) -> None:
        """Keep ``held`` for reuse (dropping the kept ones it covers), or let it go."""
        n = len(held.tokens)
        ahead = pages_for(n, self.page)
        self._drop(held.pages[ahead:])  # pages reserved ahead go back
        self._drop([p for p in held.wpages[ahead:] if p != SINK])
        del held.pages[ahead:], held.wpages[ahead:]
        if not n:
            self._drop(held.all_pages())
            return
        for other in self.kept:
            if self._covers(other, held):
                self._drop(held.all_pages())  # already covered by a kept one
                return
        covered = [o for o in self.kept if self._covers(held, o)]
        for other in covered:
            self.kept.remove(other)
            self._drop(other.all_pages())
        self.kept.append(held)
        while len(self.kept) > self.keep:
            self.evict()

    def _covers(self, a: Held, b: Held) -> bool:
        """Whether ``a`` serves every prefix ``b`` serves: ``b``'s tokens start ``a``'s, and
        the window layers can go on from ``b``'s end (and its pin) in ``a`` too."""
        n = len(b.tokens)
        if len(a.tokens) < n or common_prefix(a.tokens, b.tokens, n) != n:
            return False
        return all(self.usable(a, end) == end for end in {n, b.pin} if end)

    def evictable(self) -> bool:
        """Whether ``evict`` has something to let go: a kept conversation, or an idle active
        sequence holding pages."""
        return bool(self.kept) or (self.idle and bool(self.active.pages))

    def evict(self) -> int:
        """Let the least recently used kept conversation go, or, when none is kept, the idle
        active sequence (``park``: it is forgotten); returns the pages that became free (0 when
        there is nothing to let go, or all its pages are shared with the active sequence)."""
        before = len(self._free)
        if self.kept:
            self._drop(self.kept.pop(0).all_pages())
        elif self.idle:
            self.truncate(0)
        return len(self._free) - before

    def pages_needed(self, length: int, window_end: int | None = None) -> int:
        """Pages the active sequence must get for positions up to ``length`` (the window
        layers': up to ``window_end``, by default ``length``): new pages, and a copy of each
        shared page it will write into."""
        return sum(1 for _ in self._wants(length, window_end))

    def _wants(self, length: int, window_end: int | None) -> Iterator[tuple[list[int], int]]:
        """(page list, index) of each page to give the active sequence: new or copied."""
        seq, page = self.active, self.page
        first = len(seq.tokens) // page
        groups = [(seq.pages, length)]
        if self.window:
            groups.append((seq.wpages, length if window_end is None else window_end))
        for pages, end in groups:
            for i in range(first, pages_for(end, page)):
                if i >= len(pages) or pages[i] == SINK or self.refs[pages[i]] > 1:
                    yield pages, i

    def reserve(self, length: int, window_end: int | None = None) -> list[tuple[int, int]]:
        """Give the active sequence pages for positions up to ``length``; returns the copies
        (source page, new page) to make before writing: shared pages it writes into from now on
        (copy on write). ``pages_needed(length)`` pages must be free."""
        self.idle = False
        wants = list(self._wants(length, window_end))
        if len(wants) > len(self._free):
            raise KVBookError(
                f"{len(wants)} K/V pages needed for {length} positions, {len(self._free)} free"
            )
        copies = []
        for pages, i in wants:
            while len(pages) <= i:
                pages.append(SINK)  # a window's pages may start past a hole
            src, dst = pages[i], self._alloc()
            if src != SINK:  # shared: copied, then written into
                self._drop([src])
                copies.append((src, dst))
            pages[i] = dst
        return copies

    def extend(self, tokens: Sequence[int]) -> None:
        """The active sequence's K/V now holds ``tokens`` more (its pages were reserved)."""
        seq = self.active
        n = len(seq.tokens) + len(tokens)
        if pages_for(n, self.page) > len(seq.pages):
            raise KVBookError(f"{n} positions written with pages for {len(seq.pages) * self.page}")
        seq.tokens.extend(tokens)
        self._sweep(seq)

    def truncate(self, length: int) -> int:
        """Forget the active sequence's positions from ``length`` on (its pages past them go),
        or from the longest usable prefix before it (``usable``); returns the length kept."""
        seq = self.active
        length = self.usable(seq, min(length, len(seq.tokens)))
        del seq.tokens[length:]
        keep = pages_for(len(seq.tokens), self.page)
        self._drop(seq.pages[keep:])
        self._drop([p for p in seq.wpages[keep:] if p != SINK])
        del seq.pages[keep:], seq.wpages[keep:]
        seq.pin = min(seq.pin, length)
        seq.swept = min(seq.swept, max(0, length - self.window + 1) // self.page)
        return length

    def table(self, n: int, window: bool = False) -> list[int]:
        """The active sequence's block table (``window``: its window layers') padded to ``n``
        entries with the sink."""
        pages = self.active.wpages if window else self.active.pages
        if len(pages) > n:
            raise KVBookError(f"{len(pages)} pages do not fit a block table of {n}")
        return pages + [SINK] * (n - len(pages))

    # -- what is held ----------------------------------------------------------------------------

    def active_pages(self) -> int:
        return len(self.active.all_pages())

    def evictable_pages(self) -> int:
        """Pages that evicting everything ``evict`` may let go would free: the kept
        conversations' own, and the idle active sequence's."""
        if self.idle:
            return self.used_pages - 1  # all but the sink
        return self.kept_only_pages()

    def kept_only_pages(self) -> int:
        """Pages only kept conversations hold: what evicting all of them would free."""
        active = set(self.active.all_pages())
        only = {p for h in self.kept for p in h.all_pages() if p not in active}
        return len(only)

    def kept_tokens(self) -> list[int]:
        return [len(h.tokens) for h in self.kept]

    # -- trimming --------------------------------------------------------------------------------

    def trim_plan(self, pages: int) -> list[tuple[int, int]] | None:
        """The moves (source, destination) that leave pages [pages, mapped) free, each page in
        use up there into the lowest free page below; None when the pages in use do not fit."""
        pages = max(pages, 1)
        above = [p for p in range(pages, self.mapped) if self.refs[p]]
        below = sorted(p for p in self._free if p < pages)
        if len(above) > len(below):
            return None
        return list(zip(above, below, strict=False))

    def relocate(self, moves: Sequence[tuple[int, int]]) -> None:
        """Each page ``src`` now lives in the free page ``dst`` (its bytes are copied): every
        holder's list follows."""
        where = dict(moves)
        for src, dst in moves:
            if not self.refs[src] or self.refs[dst] or src == SINK:
                raise KVBookError(f"cannot move page {src} (held {self.refs[src]}) to page {dst} "
                                  f"(held {self.refs[dst]})")  # fmt: skip
        taken = set(where.values())
        self._free = [p for p in self._free if p not in taken]
        for src, dst in moves:
            self.refs[dst], self.refs[src] = self.refs[src], 0
            self._free.append(src)
        heapq.heapify(self._free)
        for held in (self.active, *self.kept):
            held.pages = [where.get(p, p) for p in held.pages]
            held.wpages = [where.get(p, p) for p in held.wpages]

    def check(self) -> None:
        """Every reference accounted for (a test's and a debug aid): raises on a mismatch."""
        counts = [0] * self.max_pages
        counts[SINK] = 1
        for held in (self.active, *self.kept):
            for p in held.all_pages():
                counts[p] += 1
        if counts != self.refs:
            bad = next(i for i, (a, b) in enumerate(zip(counts, self.refs, strict=True)) if a != b)
            raise KVBookError(f"page {bad}: {self.refs[bad]} references, {counts[bad]} holders")
        free = sorted(self._free)
        want = [p for p in range(self.mapped) if not self.refs[p]]
        if free != want:
            raise KVBookError(f"the free list {free[:8]}... differs from the free pages {want[:8]}")
