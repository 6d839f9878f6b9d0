"""The prompt chunk's flash-attention kernel (``kernels.chunk_attention``, gpt-oss's layers:
sinks, a sliding window on every other layer) against ``gpu.oss.attend_reference`` and a
float64 computation of the same formula, in Triton's interpreter off a GPU on tiny shapes (heads
of 64, 3 or 2 query heads per K/V head, pages of 16, a chunk starting mid-page after a prefix of
several pages, a window of 16), and on the GPU on gpt-oss-20b's shapes.

Tolerance: for a float16 K/V the products' inputs are rounded to float16 (q and the softmax
weights; float32 sums), against float32 (``attend_reference``) or float64 products: 1e-3 of
the output's norm (measured 2-3e-4). A float32 K/V's products are float32-accurate (3xTF32 on
the GPU, float32 in the interpreter: 3e-7 measured), held to the same bound.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed")
from strata.engine.gpu import oss
from strata.engine.kernels.chunk_attention import chunk_attention
from strata.engine.kv import KVCache

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = 1e-3
WINDOW = 16


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    assert not got.isnan().any(), "an output element was not written"
    return float((got - want).norm() / want.norm())


class Chunk:
    """A K/V of two layers (a window layer, a full one) holding a prefix of ``start``
    positions, and a chunk of T more: its q [T, H, d], k, v [T, Hkv, d] and positions."""

    def __init__(self, kind: str, H: int, HKV: int, D: int, page: int, start: int, T: int,
                 window: int, device: torch.device = DEVICE) -> None:  # fmt: skip
        g = torch.Generator().manual_seed(start + T)
        S = start + T
        self.kv = KVCache(2, S + page, HKV, D, kind, device, page=page, keep=1,
                          chunk_bytes=2 << 20, windowed=(True, False), window=window)  # fmt: skip
        self.kv.begin([])
        self.kv.grow(self.kv.bytes_to_map(self.kv.pages_short(S)))
        self.kv.prepare(S)
        for layer in range(2):
            k, v = torch.randn(2, start, HKV, D, generator=g).to(device)
            self.kv.write(layer, 0, k, v)
        self.q = torch.randn(T, H, D, generator=g).to(device)
        self.k, self.v = torch.randn(2, T, HKV, D, generator=g).to(device)
        self.pos = torch.arange(start, S, device=device)
        self.sinks = (torch.randn(H, generator=g) * 2).to(device)
        self.start, self.window = start, window

    def run(self, fn, layer: int, sinks: bool) -> torch.Tensor:
        window = self.window if self.kv.windowed[layer] else None
        return fn(self.kv, layer, self.q, self.k, self.v, self.pos, self.start, window,
                  self.sinks if sinks else None)  # fmt: skip


def truth(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
          window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """The formula in float64, one query row at a time: q [T, H, d], keys and values
    [S, Hkv, d] in position order -> [T, H * d]."""
    T, H, D = q.shape
    G = H // keys.shape[1]
    out = torch.empty(T, H, D, dtype=torch.float64)
    for t in range(T):
        p = start + t
        lo = 0 if window is None else max(0, p - window + 1)
        k = keys[lo : p + 1].double().repeat_interleave(G, 1)  # [n, H, d]
        v = values[lo : p + 1].double().repeat_interleave(G, 1)
        s = torch.einsum("hd,nhd->hn", q[t].double(), k) / math.sqrt(D)  # [H, n]
        if sinks is not None:
            s = torch.cat((s, sinks.double()[:, None]), 1)
        w = torch.softmax(s, 1)[:, : p + 1 - lo]
        out[t] = torch.einsum("hn,nhd->hd", w, v)
    return out.view(T, H * D)


@pytest.mark.parametrize("kind", ["f16", "f32"])
def test_attend_is_its_reference_with_a_window_and_sinks_or_without(kind) -> None:
    c = Chunk(kind, H=6, HKV=2, D=64, page=16, start=37, T=29, window=WINDOW)
    for layer, sinks in ((0, True), (1, True), (1, False), (0, False)):  # window / full
        want = c.run(oss.attend_reference, layer, sinks)
        got = c.run(oss.attend, layer, sinks)
        assert rel_err(got, want) < TOL, (layer, sinks)
        # the kernel ran (in the interpreter too), at the default tile sizes
        keys, values = c.kv.layer(layer)
        table = c.kv.window_table if layer == 0 else c.kv.block_table
        window = WINDOW if layer == 0 else None
        s = c.sinks if sinks else None
        assert torch.equal(got, chunk_attention(c.q, keys, values, table, c.start, window, s))
        if sinks:  # the sinks took their share
            assert rel_err(c.run(oss.attend_reference, layer, False), want) > 10 * TOL


def paged(kind: str, page: int, n_pages: int, HKV: int, D: int, seed: int):
    """A pool [pages, 2 slots, K|V, page, Hkv, d] of random rows and a block table over it in a
    random page order; -> (pool, table, slot 1's keys and values as the kernel reads them)."""
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float16 if kind == "f16" else torch.float32
    pool = torch.randn(n_pages, 2, 2, page, HKV, D, generator=g).to(dtype).to(DEVICE)
    table = torch.randperm(n_pages, generator=g).int().to(DEVICE)
    return pool, table, pool[:, 1, 0], pool[:, 1, 1]


def in_order(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """A [pages, page, Hkv, d] view's rows in position order through the table."""
    return x[table.long()].flatten(0, 1).cpu()


@pytest.mark.parametrize("blocks", [(16, 16), (32, 32)], ids=["one-page-blocks", "gathered"])
def test_tiles_of_many_row_and_key_blocks_are_the_formula(blocks) -> None:
    """Small tiles: several row blocks, several key blocks a row (a block within one page, or
    key blocks across pages, each row's page looked up), pages out of order, GQA 2."""
    H, HKV, D, page, start, T = 4, 2, 64, 16, 41, 30
    _, table, keys, values = paged("f16", page, 5, HKV, D, seed=1)
    q = torch.randn(T, H, D, device=DEVICE)
    sinks = torch.randn(H, device=DEVICE) * 2
    K, V = in_order(keys, table), in_order(values, table)
    for window, s in ((WINDOW, sinks), (None, sinks), (None, None), (WINDOW, None)):
        got = chunk_attention(q, keys, values, table, start, window, s, *blocks)
        want = truth(q.cpu(), K, V, start, window, None if s is None else s.cpu())
        assert rel_err(got, want) < TOL, (window, s is not None)


def test_a_window_layer_reads_no_key_before_its_window() -> None:
    H, HKV, D, page, start, T = 4, 2, 64, 16, 45, 20
    pool, table, keys, values = paged("f16", page, 5, HKV, D, seed=2)
    q = torch.randn(T, H, D, device=DEVICE)
    sinks = torch.randn(H, device=DEVICE)
    before = chunk_attention(q, keys, values, table, start, WINDOW, sinks, 16, 16)
    rows = table.long()  # position p: pool[rows[p // page], 1, :, p % page]
    for p in range(start - WINDOW + 1):  # before the first row's window: never read
        pool[rows[p // page], 1, :, p % page] = float("nan")
    after = chunk_attention(q, keys, values, table, start, WINDOW, sinks, 16, 16)
    assert torch.equal(after, before)
    last = start + T - 1  # before the last row's window: other values, the same last row
    for p in range(last - WINDOW + 1):
        pool[rows[p // page], 1, :, p % page] = torch.randn(2, HKV, D, device=DEVICE).half()
    after = chunk_attention(q, keys, values, table, start, WINDOW, sinks, 16, 16)
    assert torch.equal(after[-1], before[-1])
    assert not torch.equal(after[0], before[0])  # the first row's window moved


def test_bad_inputs_are_named() -> None:
    _, table, keys, values = paged("f16", 16, 2, 2, 64, seed=3)
    q = torch.randn(8, 4, 64, device=DEVICE)
    cases = [
        ((q, keys, values, table, 0, 0), "window 0"),
        ((q, keys, values, table, 0, None, torch.zeros(3, device=DEVICE)), "3 sink logits"),
        ((q, keys, values, table, 30), "positions up to 38"),
        ((q, keys, values, table.long(), 0), "expected int32"),
        ((torch.randn(8, 3, 64, device=DEVICE), keys, values, table, 0), "evenly"),
        ((q, keys, values.float(), table, 0), "two views"),
        ((q, keys, values, table, -1), "chunk start -1"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            chunk_attention(*args)
    q48 = torch.randn(8, 4, 48, device=DEVICE)
    _, _, k48, v48 = paged("f16", 16, 2, 2, 48, seed=3)
    with pytest.raises(ValueError, match="head_dim 48"):
        chunk_attention(q48, k48, v48, table, 0)
    for bm, bn in ((4, 16), (24, 16), (16, 8)):  # under the group's 8 heads, not a power of two
        with pytest.raises(ValueError, match=f"block_m {bm}, block_n {bn}"):
            chunk_attention(torch.randn(8, 16, 64, device=DEVICE), keys, values, table, 0,
                            block_m=bm, block_n=bn)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA")
@pytest.mark.parametrize("start", [0, 1000])
def test_gpt_oss_20b_shapes_on_the_gpu(start) -> None:
    """64 query heads over 8 K/V heads of 64, a window of 128, a chunk of 512 (a float16 K/V
    in pages of 64): the kernel against the torch form, the same bits twice."""
    c = Chunk("f16", H=64, HKV=8, D=64, page=64, start=start, T=512, window=128)
    for layer in (0, 1):
        want = c.run(oss.attend_reference, layer, True)
        got = c.run(oss.attend, layer, True)
        assert rel_err(got, want) < TOL, layer
        assert torch.equal(c.run(oss.attend, layer, True), got)
