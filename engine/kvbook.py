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

A page is free when nobody holds it. Trimming the mapped part moves pages in use above the new
top into free pages below it (``trim_plan`` / ``relocate``): the caller copies their bytes and
rewrites the block table, so every holder's list follows the move.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

SINK = 0  # the page unused block-table entries point at


class KVBookError(Exception):
    """A request the bookkeeping cannot carry out; the message names the numbers."""


@dataclass
class Held:
    """A conversation's tokens and the pages of their K/V (position p: ``pages[p // page]``)."""

    tokens: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)


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

    def __init__(self, page: int, page_bytes: int, chunk_bytes: int, max_pages: int, keep: int):
        for name, v, least in (
            ("page", page, 1), ("page_bytes", page_bytes, 1), ("chunk_bytes", chunk_bytes, 1),
            ("max_pages", max_pages, 2), ("kv_keep_conversations", keep, 0),
        ):  # fmt: skip
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise KVBookError(f"{name}={v!r}: expected a whole number of at least {least}")
        self.page, self.page_bytes, self.chunk_bytes = page, page_bytes, chunk_bytes
        self.max_pages, self.keep = max_pages, keep
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
            n = common_prefix(held.tokens, prompt, limit)
            if n > best_n:
                best, best_n = held, n
        seq = Held(list(prompt[:best_n]), [])
        if best is not None:
            seq.pages = best.pages[: pages_for(best_n, self.page)]
            self._hold(seq.pages)
            if best is not previous:
                self.kept.remove(best)
                self.kept.append(best)  # the most recently used
        self.active, self.idle = seq, False
        self._keep(previous)
        return best_n

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
        del held.pages[ahead:]
        if not n:
            self._drop(held.pages)
            return
        for other in self.kept:
            if len(other.tokens) >= n and common_prefix(other.tokens, held.tokens, n) == n:
                self._drop(held.pages)  # already covered by a kept one
                return
        covered = [o for o in self.kept if common_prefix(o.tokens, held.tokens, len(o.tokens))
                   == len(o.tokens)]  # fmt: skip
        for other in covered:
            self.kept.remove(other)
            self._drop(other.pages)
        self.kept.append(held)
        while len(self.kept) > self.keep:
            self.evict()

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
            self._drop(self.kept.pop(0).pages)
        elif self.idle:
            self.truncate(0)
        return len(self._free) - before

    def pages_needed(self, length: int) -> int:
        """Pages the active sequence must get for positions up to ``length``: new pages, and a
        copy of each shared page it will write into."""
        seq, page = self.active, self.page
        have = len(seq.pages)
        want = pages_for(length, page)
        first = len(seq.tokens) // page
        shared = sum(1 for i in range(first, min(have, want)) if self.refs[seq.pages[i]] > 1)
        return max(0, want - have) + shared

    def reserve(self, length: int) -> list[tuple[int, int]]:
        """Give the active sequence pages for positions up to ``length``; returns the copies
        (source page, new page) to make before writing: shared pages it writes into from now on
        (copy on write). ``pages_needed(length)`` pages must be free."""
        self.idle = False
        need = self.pages_needed(length)
        if need > len(self._free):
            raise KVBookError(
                f"{need} K/V pages needed for {length} positions, {len(self._free)} free"
            )
        seq, page = self.active, self.page
        copies = []
        for i in range(len(seq.tokens) // page, min(len(seq.pages), pages_for(length, page))):
            src = seq.pages[i]
            if self.refs[src] > 1:
                dst = self._alloc()
                self._drop([src])
                seq.pages[i] = dst
                copies.append((src, dst))
        while len(seq.pages) < pages_for(length, page):
            seq.pages.append(self._alloc())
        return copies

    def extend(self, tokens: Sequence[int]) -> None:
        """The active sequence's K/V now holds ``tokens`` more (its pages were reserved)."""
        seq = self.active
        n = len(seq.tokens) + len(tokens)
        if pages_for(n, self.page) > len(seq.pages):
            raise KVBookError(f"{n} positions written with pages for {len(seq.pages) * self.page}")
        seq.tokens.extend(tokens)

    def truncate(self, length: int) -> None:
        """Forget the active sequence's positions from ``length`` on (its pages past them go)."""
        seq = self.active
        del seq.tokens[length:]
        keep = pages_for(len(seq.tokens), self.page)
        self._drop(seq.pages[keep:])
        del seq.pages[keep:]

    def table(self, n: int) -> list[int]:
        """The active sequence's block table padded to ``n`` entries with the sink."""
        pages = self.active.pages
        if len(pages) > n:
            raise KVBookError(f"{len(pages)} pages do not fit a block table of {n}")
        return pages + [SINK] * (n - len(pages))

    # -- what is held ----------------------------------------------------------------------------

    def active_pages(self) -> int:
        return len(self.active.pages)

    def evictable_pages(self) -> int:
        """Pages that evicting everything ``evict`` may let go would free: the kept
        conversations' own, and the idle active sequence's."""
        if self.idle:
            return self.used_pages - 1  # all but the sink
        return self.kept_only_pages()

    def kept_only_pages(self) -> int:
        """Pages only kept conversations hold: what evicting all of them would free."""
        active = set(self.active.pages)
        only = {p for h in self.kept for p in h.pages if p not in active}
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

    def check(self) -> None:
        """Every reference accounted for (a test's and a debug aid): raises on a mismatch."""
        counts = [0] * self.max_pages
        counts[SINK] = 1
        for held in (self.active, *self.kept):
            for p in held.pages:
                counts[p] += 1
        if counts != self.refs:
            bad = next(i for i, (a, b) in enumerate(zip(counts, self.refs, strict=True)) if a != b)
            raise KVBookError(f"page {bad}: {self.refs[bad]} references, {counts[bad]} holders")
        free = sorted(self._free)
        want = [p for p in range(self.mapped) if not self.refs[p]]
        if free != want:
            raise KVBookError(f"the free list {free[:8]}... differs from the free pages {want[:8]}")
