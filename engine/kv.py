"""The K/V cache: pages of positions in one reserved virtual range, mapped in chunks as
conversations need them and unmapped as they are freed; a block table says which page holds
which stretch of the active sequence.

Page ``i`` holds every layer's keys and values of ``page`` positions: ``[L, 2, page, Hkv, d]``
at byte ``i * page_bytes`` of an elastic arena (CUDA VMM on a GPU, the host arena on the CPU,
``vmm.arena``), whose base never moves. Position ``p`` of the active sequence lives in page
``block_table[p // page]`` at row ``p % page``; a layer's keys are a strided view of the pages
(``page_stride`` elements from one page to the next), so kernels keep the addresses they were
given (a captured decode graph stays valid as the K/V grows) and read the table and the
position from device memory. Which pages exist, who holds them and which conversations are kept
for reuse is ``kvbook.KVBook``'s bookkeeping; this class maps the memory it counts, copies the
pages it moves, and keeps the device's block table equal to the book's.

With a sliding window (``windowed``: per layer, ``window`` positions; gpt-oss), a page holds one
of two groups of layers: the full layers' K/V of its positions, or the window layers' (a page
holds as many layers as the larger group). The window layers have their own block table; their
pages behind the window go back to the free list as the sequence advances (``KVBook``), from the
one budget.

Unused block-table entries point at the sink page (``kvbook.SINK``): a padded prompt chunk's
extra rows land there, never in a page someone holds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from strata.engine.kvbook import SINK, KVBook, pages_for
from strata.engine.recurrent import RecurrentState
from strata.vmm.arena import ElasticArena, create_arena

log = logging.getLogger(__name__)

KV_DTYPES = {"f16": torch.float16, "f32": torch.float32}
PAGE_TOKENS = 64  # positions per page
DEFAULT_CHUNK_BYTES = 32 * 2**20
DEFAULT_KEEP = 4  # conversations kept for reuse besides the active one

ArenaFactory = Callable[[int, int], ElasticArena]  # (reserved bytes, chunk bytes)


def page_bytes_for(n_layer: int, n_head_kv: int, head_dim: int, kind: str, page: int) -> int:
    return 2 * n_layer * page * n_head_kv * head_dim * KV_DTYPES[kind].itemsize


class KVCache:
    """The paged K/V (module doc). ``keep``: conversations kept for reuse; ``chunk_bytes``: how
    the range maps and unmaps; ``fixed``: map pages for the whole context (and one page more
    per kept conversation's partial tail) at once and never trim (the growing K/V's control)."""

    def __init__(
        self,
        n_layer: int,
        n_ctx: int,
        n_head_kv: int,
        head_dim: int,
        kind: str = "f16",
        device: torch.device | str = "cpu",
        page: int = PAGE_TOKENS,
        *,
        keep: int = DEFAULT_KEEP,
        chunk_bytes: int | None = None,
        arena_factory: ArenaFactory | None = None,
        fixed: bool = False,
        windowed: tuple[bool, ...] = (),
        window: int = 0,
    ) -> None:
        if kind not in KV_DTYPES:
            raise ValueError(f"kv_cache_type {kind!r} is not one of {', '.join(KV_DTYPES)}")
        if page < 1:
            raise ValueError(f"K/V page of {page} positions: must be at least 1")
        if n_ctx < 1:
            raise ValueError(f"context_length {n_ctx}: must be at least 1")
        windowed = tuple(windowed) or (False,) * n_layer
        if len(windowed) != n_layer or (any(windowed) and window < 1):
            raise ValueError(
                f"K/V: {len(windowed)} window flags for {n_layer} layers, window {window}: "
                "one flag per layer, and a window of at least 1"
            )
        self.device = torch.device(device)
        self.n_ctx, self.page, self.n_layer = n_ctx, page, n_layer
        self.windowed, self.window = windowed, window if any(windowed) else 0
        # layer -> its place in its group's pages (full layers and window layers count apart)
        self.slot = [windowed[:i].count(windowed[i]) for i in range(n_layer)]
        self.n_slots = max(windowed.count(False), windowed.count(True))
        self.n_head_kv, self.head_dim = n_head_kv, head_dim
        self.dtype = KV_DTYPES[kind]
        self.fixed = fixed
        self.table_pages = pages_for(n_ctx, page)  # the block table's entries: a whole context
        self.page_bytes = page_bytes_for(self.n_slots, n_head_kv, head_dim, kind, page)
        self.page_stride = self.page_bytes // self.dtype.itemsize  # elements between pages
        self.row_stride = n_head_kv * head_dim  # elements between positions of a page
        chunk = chunk_bytes or DEFAULT_CHUNK_BYTES
        # the sink, a whole context for the active sequence, as much again for kept ones
        max_pages = 1 + 2 * self.table_pages
        if self.window:  # the window layers' pages: a window and a pinned one per sequence
            max_pages += (2 * pages_for(self.window, page) + 2) * (keep + 1) + self.table_pages
        self.book = KVBook(page, self.page_bytes, chunk, max_pages, keep, self.window)
        factory = arena_factory or _default_arena(self.device)
        self.arena = factory(self.book.reserved_bytes, chunk)
        self.pool = torch.empty(0)
        self.block_table = torch.zeros(self.table_pages, dtype=torch.int32, device=self.device)
        self.window_table = torch.zeros(
            self.table_pages if self.window else 0, dtype=torch.int32, device=self.device
        )
        self._table_synced: list[int] = []
        self._window_synced: list[int] = []
        self.length = 0  # kept for the kernels' callers; the book's active tokens are the truth
        # a hybrid's DeltaNet layers' states (and checkpoints) for the active sequence, in the
        # same budget: counted in mapped_bytes (``Sequences`` restores it on a rewind)
        self.state: RecurrentState | None = None
        try:
            # (a window's pages may hold a whole prompt chunk's positions for a moment)
            whole = self.table_pages * (2 if self.window else 1)
            first = 1 + whole if fixed else 1
            self._map(self.book.bytes_for(first))
            if self.book.mapped < first:
                raise torch.OutOfMemoryError(
                    f"K/V: mapped {self.arena.mapped_bytes} of the "
                    f"{self.book.bytes_for(first)} bytes asked for"
                )
        except BaseException:
            self.arena.close()
            raise

    # -- memory ----------------------------------------------------------------------------------

    @property
    def mapped_bytes(self) -> int:
        """The pages mapped, and the recurrent state with its checkpoints."""
        return self.arena.mapped_bytes + self.state_bytes

    @property
    def state_bytes(self) -> int:
        return 0 if self.state is None else self.state.nbytes

    @property
    def nbytes(self) -> int:
        return self.mapped_bytes

    @property
    def chunk_bytes(self) -> int:
        return self.arena.chunk_bytes

    def _map(self, target: int) -> None:
        """Map or unmap to ``target`` bytes (whole chunks); the book and the views follow."""
        target = min(target, self.arena.reserved_bytes)
        if target < self.arena.mapped_bytes:
            self.book.set_mapped(target)  # refuses while a page up there is held
            self.pool = self.pool[: self.book.mapped]
            self.arena.resize(target)
        elif target > self.arena.mapped_bytes:
            self.arena.resize(target)  # may map less: the memory ran out
            self.book.set_mapped(self.arena.mapped_bytes)
        else:
            return
        n = self.book.mapped
        shape = (n, self.n_slots, 2, self.page, self.n_head_kv, self.head_dim)
        self.pool = self.arena.view(0, n * self.page_bytes, self.dtype).view(shape)

    def bytes_to_map(self, pages: int) -> int:
        """The bytes to map more for ``pages`` more free pages (whole chunks; 0 when the
        reservation is full)."""
        want = self.book.bytes_for(self.book.mapped + pages)
        return max(0, min(want, self.arena.reserved_bytes) - self.arena.mapped_bytes)

    def grow(self, nbytes: int) -> int:
        """Map ``nbytes`` more (whole chunks); returns the bytes mapped."""
        before = self.arena.mapped_bytes
        self._map(before + nbytes)
        return self.arena.mapped_bytes - before

    def trim(self, keep_free_pages: int = 0) -> int:
        """Unmap the chunks above the pages in use (moving those up there into free pages
        below first), keeping ``keep_free_pages`` free pages mapped; returns the bytes unmapped.
        Never in a fixed K/V. At a safe point only."""
        if self.fixed:
            return 0
        target = max(1, self.book.used_pages + keep_free_pages)
        nbytes = self.book.bytes_for(target)
        if nbytes >= self.arena.mapped_bytes:
            return 0
        moves = self.book.trim_plan(self.book.pages_in(nbytes))
        assert moves is not None, "the pages in use fit below the target by construction"
        self._copy_pages(moves)
        self.book.relocate(moves)
        self._sync_table()
        before = self.arena.mapped_bytes
        self._map(nbytes)
        return before - self.arena.mapped_bytes

    def _copy_pages(self, moves: list[tuple[int, int]]) -> None:
        if not moves:
            return
        src = torch.tensor([s for s, _ in moves], device=self.device)
        dst = torch.tensor([d for _, d in moves], device=self.device)
        self.pool.index_copy_(0, dst, self.pool.index_select(0, src))

    def close(self) -> None:
        self.pool = torch.empty(0)
        self.state = None
        self.arena.close()

    # -- the active sequence ---------------------------------------------------------------------

    @property
    def tokens(self) -> list[int]:
        """The tokens whose K/V the active sequence holds, position by position."""
        return self.book.active.tokens

    def begin(self, prompt: list[int]) -> int:
        """Start the active sequence from the longest held prefix of ``prompt`` (see
        ``KVBook.begin``); returns its length."""
        n = self.book.begin(prompt)
        self.length = n
        self._sync_table()
        return n

    def pages_short(self, end: int, window_end: int | None = None) -> int:
        """Free pages missing for the active sequence to hold positions up to ``end`` (the
        window layers: up to ``window_end``, by default ``end``)."""
        return max(0, self.book.pages_needed(end, window_end) - self.book.free_pages)

    def prepare(self, end: int, window_end: int | None = None) -> None:
        """Pages for positions up to ``end`` (``pages_short`` must be 0): shared pages the
        sequence will write into are copied first, and the device table follows."""
        if end > self.n_ctx:
            raise ValueError(f"K/V up to position {end} beyond the context of {self.n_ctx}")
        if self.book.pages_needed(end, window_end) == 0:
            return
        self._copy_pages(self.book.reserve(end, window_end))
        self._sync_table()

    def commit(self, tokens: list[int]) -> None:
        """The K/V of ``tokens`` (after the active sequence's) is written (the window layers'
        pages behind the window go back)."""
        self.book.extend(tokens)
        self.length = len(self.book.active.tokens)
        if self.window:
            self._sync_table()
        if self.state is not None:
            self.state.advance(tokens)

    def mark_read(self) -> None:
        """A prompt read ends here: the window layers keep the window ending here until the
        next one (``KVBook.mark_read``)."""
        if self.window:
            self.book.mark_read()
            self._sync_table()

    def truncate(self, length: int) -> int:
        """Forget the active sequence's positions from ``length`` on (from an earlier one where
        the window layers cannot go on from ``length``); returns the length kept."""
        kept = self.book.truncate(length)
        self.length = len(self.book.active.tokens)
        self._sync_table()
        return kept

    def evict(self) -> int:
        """Let the least recently used kept conversation go, or the idle active sequence
        (``KVBook.evict``); returns the pages freed."""
        freed = self.book.evict()
        self.length = len(self.book.active.tokens)
        self._sync_table()
        return freed

    def _sync_table(self) -> None:
        table = self.book.table(self.table_pages)
        if table != self._table_synced:
            self.block_table.copy_(torch.tensor(table, dtype=torch.int32))
            self._table_synced = table
        if self.window:
            table = self.book.table(self.table_pages, window=True)
            if table != self._window_synced:
                self.window_table.copy_(torch.tensor(table, dtype=torch.int32))
                self._window_synced = table

    # -- reading and writing (the reference path, the prefill path) ------------------------------

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's keys and values as views of the pages, [pages, page, Hkv, d] each: what the
        decode kernels take as base addresses (``page_stride`` apart)."""
        j = self.slot[layer]
        return self.pool[:, j, 0], self.pool[:, j, 1]

    def _where(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, row) of positions [start, end) of ``layer``, through its group's table."""
        pos = torch.arange(start, end, device=self.device)
        table = self.window_table if self.windowed[layer] else self.block_table
        return table[pos // self.page].long(), pos % self.page

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [T, Hkv, d] at positions start..start+T-1 (their pages prepared)
        end = start + k.shape[0]
        if end > self.n_ctx:
            raise ValueError(f"K/V write up to position {end} beyond the context of {self.n_ctx}")
        if pages_for(end, self.page) > len(self.book.active.pages):
            raise ValueError(f"K/V write up to position {end}: its pages are not prepared")
        self._check_window(layer, start, end)
        pages, rows = self._where(layer, start, end)
        j = self.slot[layer]
        self.pool[pages, j, 0, rows] = k.to(self.dtype)
        self.pool[pages, j, 1, rows] = v.to(self.dtype)

    def read(self, layer: int, end: int, dtype: torch.dtype = torch.float32, begin: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        # -> k, v: [end - begin, Hkv, d] (a copy, gathered through the block table)
        self._check_window(layer, begin, end)
        pages, rows = self._where(layer, begin, end)
        j = self.slot[layer]
        return (self.pool[pages, j, 0, rows].to(dtype),
                self.pool[pages, j, 1, rows].to(dtype))  # fmt: skip

    def _check_window(self, layer: int, begin: int, end: int) -> None:
        """A window layer's positions [begin, end) are in pages it holds (a page let go behind
        the window is an error, never a plausible wrong answer)."""
        if not self.windowed[layer] or begin >= end:
            return
        held = self.book.active.wpages
        first, stop = begin // self.page, pages_for(end, self.page)
        if stop > len(held) or SINK in held[first:stop]:
            raise ValueError(
                f"K/V positions {begin}..{end - 1} of a layer with a window of {self.window}: "
                "not all in pages it holds"
            )

    # -- what it holds ---------------------------------------------------------------------------

    def status(self) -> dict[str, int | list[int]]:
        """Numbers for the status and the metrics (bytes and tokens)."""
        b = self.book
        return {
            "mapped_bytes": self.arena.mapped_bytes,
            "page_bytes": self.page_bytes,
            "active_tokens": len(b.active.tokens),
            "active_bytes": b.active_pages() * self.page_bytes,
            "kept_bytes": b.kept_only_pages() * self.page_bytes,
            "kept_tokens": b.kept_tokens(),
            "free_bytes": b.free_pages * self.page_bytes,
            **({} if self.state is None else self.state.status()),
        }

    def floor_bytes(self) -> int:
        """What the K/V cannot give back now: the pages the active sequence holds while its
        request runs (and the sink), packed down and in whole chunks. Kept conversations, an
        idle active sequence (between requests) and free pages can go."""
        b = self.book
        return b.bytes_for(max(1, b.used_pages - b.evictable_pages())) + self.state_bytes

    def context_bytes(self, tokens: int) -> int:
        """What ``tokens`` positions of one sequence need mapped (whole pages; the window
        layers' pages: a window and the one kept where the prompt read ended)."""
        pages = pages_for(tokens, self.page)
        if self.window:
            pages += min(pages, 2 * (pages_for(self.window, self.page) + 1))
        return pages * self.page_bytes

    @staticmethod
    def nbytes_for(
        n_layer: int, n_ctx: int, n_head_kv: int, head_dim: int, kind: str, page: int = PAGE_TOKENS
    ) -> int:
        """What a whole context of one sequence holds (K and V), before allocating it."""
        return pages_for(n_ctx, page) * page_bytes_for(n_layer, n_head_kv, head_dim, kind, page)


def _default_arena(device: torch.device) -> ArenaFactory:
    if device.type == "cuda":
        return lambda reserved, chunk: create_arena("cuda", reserved, chunk, device.index or 0)
    return lambda reserved, chunk: create_arena("host", reserved, chunk)
