"""The K/V cache: per layer, fixed-size pages of positions and a block table that says which
page holds which stretch of the sequence.

Position ``p`` lives in page ``block_table[p // page]`` at row ``p % page``. One conversation
uses the cache today, through the identity table, so the pages of a sequence are also contiguous
in memory and the reference path reads them as one slice; the decode kernels always go through
the table (a device copy of it), so a growing cache and several kept conversations later need no
kernel change.
"""

from __future__ import annotations

import torch

KV_DTYPES = {"f16": torch.float16, "f32": torch.float32}
PAGE_TOKENS = 64  # positions per page


class KVCache:
    def __init__(
        self,
        n_layer: int,
        n_ctx: int,
        n_head_kv: int,
        head_dim: int,
        kind: str = "f16",
        device: torch.device | str = "cpu",
        page: int = PAGE_TOKENS,
    ) -> None:
        if kind not in KV_DTYPES:
            raise ValueError(f"kv_cache_type {kind!r} is not one of {', '.join(KV_DTYPES)}")
        if page < 1:
            raise ValueError(f"K/V page of {page} positions: must be at least 1")
        self.n_ctx = n_ctx
        self.page = page
        self.dtype = KV_DTYPES[kind]
        self.n_pages = -(-n_ctx // page)
        rows = self.n_pages * page
        # k, v: [L, pages * page, Hkv, d], row = page number * page + offset in the page. Left
        # uninitialised: only positions [0, length) are ever read.
        shape = (n_layer, rows, n_head_kv, head_dim)
        self.k = torch.empty(shape, dtype=self.dtype, device=device)
        self.v = torch.empty(shape, dtype=self.dtype, device=device)
        self.pages: list[int] = list(range(self.n_pages))  # the block table, on the host
        self.block_table = torch.tensor(self.pages, dtype=torch.int32, device=device)
        self.length = 0  # positions [0, length) hold valid entries

    def _rows(self, start: int, end: int) -> slice | torch.Tensor:
        """The physical rows of positions [start, end): a slice where they are contiguous."""
        first, last = start // self.page, (end - 1) // self.page
        pages = self.pages[first : last + 1]
        if pages == list(range(pages[0], pages[0] + len(pages))):
            base = pages[0] * self.page - first * self.page
            return slice(base + start, base + end)
        pos = torch.arange(start, end)
        table = torch.tensor(self.pages, dtype=torch.long)
        return (table[pos // self.page] * self.page + pos % self.page).to(self.k.device)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [T, Hkv, d]
        end = start + k.shape[0]
        if end > self.n_ctx:
            raise ValueError(f"K/V write up to position {end} beyond the context of {self.n_ctx}")
        rows = self._rows(start, end)
        self.k[layer, rows] = k.to(self.dtype)
        self.v[layer, rows] = v.to(self.dtype)

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        # -> k, v: [end, Hkv, d] in float32
        rows = self._rows(0, end)
        return self.k[layer, rows].float(), self.v[layer, rows].float()

    def truncate(self, length: int) -> None:
        """Forget positions from ``length`` on (a prompt sharing a prefix reuses the rest)."""
        self.length = min(self.length, length)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    @staticmethod
    def nbytes_for(
        n_layer: int, n_ctx: int, n_head_kv: int, head_dim: int, kind: str, page: int = PAGE_TOKENS
    ) -> int:
        """What a cache of these sizes holds (K and V), before allocating it."""
        rows = -(-n_ctx // page) * page
        return 2 * n_layer * rows * n_head_kv * head_dim * KV_DTYPES[kind].itemsize
