"""The prefill's matrix products against their torch twins: the dense product over every
repacked type (ragged row counts, the residual add, strided and float16 outputs), the grouping
of a chunk's assignments by expert, and the grouped gate/up and down products over an expert
table, with ragged expert loads (one expert to all of them, from no token to every token of the
chunk) and a MISSING expert skipped.

Compiled on a GPU; in Triton's interpreter on CPU tensors elsewhere (CI), on small shapes.
Outputs start as NaN, so an element a kernel forgets to write fails. Tolerance: the products run
in float16 (the activations and the dequantised weights rounded to it) with float32 sums, against
float32 products of the reference values: 2e-3 of the output's norm (measured near 3e-4).
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from quantdata import random_bytes

from strata.engine.quant import repack
from strata.engine.quant.repack import REPACKED_TYPES, align, repacked_layout

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed")
from strata.engine.experts.table import MISSING
from strata.engine.kernels import gemm

Q = gguf.GGMLQuantizationType
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = 2e-3
ON_GPU = DEVICE.type == "cuda"


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(11)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    assert not got.isnan().any(), "an output element was not written"
    return float((got - want).norm() / want.norm())


def matrix(qtype: Q, rows: int, cols: int, rng: np.random.Generator):
    raw = torch.from_numpy(random_bytes(qtype, (rows, cols), rng))
    lay = repacked_layout(qtype, (rows, cols))
    return repack.repack(raw, qtype, (rows, cols)).to(DEVICE), lay


def halves(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE) * scale).half()


# An expert's input as a model's RMSNorm gives it, small enough that SiLU(gate) * up of the random
# test weights (values up to ~40 for IQ4_XS) stays inside float16's range, as a real model's does.
H_SCALE = 0.25


# -- the dense product -------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", sorted(REPACKED_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 5, 70] if ON_GPU else [1, 5])
def test_gemm_matches_dequantise_then_multiply(qtype, m, rng) -> None:
    N, K = (200, 768) if ON_GPU else (40, 512)
    w, lay = matrix(qtype, N, K, rng)
    a = halves(m, K)
    y = torch.full((m, N), float("nan"), device=DEVICE)
    gemm.gemm(y, a, w, lay)
    assert rel_err(y, gemm.gemm_reference(a, w, lay)) < TOL


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.F32], ids=lambda t: t.name)
def test_gemm_on_a_dimension_not_a_multiple_of_the_step(qtype, rng) -> None:
    w, lay = matrix(qtype, 24, 96, rng)  # 3 units of 32: a step of 4 or 8 units is masked
    a = halves(3, 96)
    y = torch.full((3, 24), float("nan"), device=DEVICE)
    gemm.gemm(y, a, w, lay)
    assert rel_err(y, gemm.gemm_reference(a, w, lay)) < TOL


def test_gemm_adds_into_a_strided_view_and_writes_float16(rng) -> None:
    w, lay = matrix(Q.Q4_K, 48, 256, rng)
    a = halves(6, 256)
    want = gemm.gemm_reference(a, w, lay)
    wide = torch.randn(6, 100, device=DEVICE)
    base = wide.clone()
    gemm.gemm(wide[:, 30:78], a, w, lay, add=True)
    assert rel_err(wide[:, 30:78], base[:, 30:78] + want) < TOL
    assert torch.equal(wide[:, :30], base[:, :30]) and torch.equal(wide[:, 78:], base[:, 78:])
    y16 = torch.full((6, 48), float("nan"), dtype=torch.float16, device=DEVICE)
    gemm.gemm(y16, a, w, lay)
    assert rel_err(y16, want) < TOL


def test_gemm_rejects_what_does_not_fit(rng) -> None:
    w, lay = matrix(Q.Q8_0, 16, 64, rng)
    with pytest.raises(ValueError, match="activations must be float16"):
        gemm.gemm(torch.empty(2, 16, device=DEVICE), torch.randn(2, 64, device=DEVICE), w, lay)
    with pytest.raises(ValueError, match="32 activation columns cannot feed a 64-column"):
        gemm.gemm(torch.empty(2, 16, device=DEVICE), halves(2, 32), w, lay)
    with pytest.raises(ValueError, match=r"cannot hold a \[2, 16\] product"):
        gemm.gemm(torch.empty(2, 8, device=DEVICE), halves(2, 64), w, lay)


# -- grouping by expert ------------------------------------------------------------------------


def check_groups(ids: torch.Tensor, E: int, bm: int) -> gemm.Groups:
    g = gemm.group_by_expert(ids.to(DEVICE), E, bm)
    T, k = ids.shape
    rows, blocks = g.rows.cpu().tolist(), g.blocks.cpu().tolist()
    flat = ids.reshape(-1).tolist()
    assert len(rows) == gemm.max_sorted_rows(T * k, E, bm) and len(blocks) == len(rows) // bm
    assert g.counts.cpu().tolist() == [flat.count(e) for e in range(E)]
    seen = []
    for b, e in enumerate(blocks):
        mine = [a for a in rows[b * bm : (b + 1) * bm] if a != T * k]
        if e < 0:
            assert not mine, "a padding block holds assignments"
        assert all(flat[a] == e for a in mine), "an assignment in another expert's block"
        seen += mine
    assert sorted(seen) == list(range(T * k)), "each assignment exactly once"
    used = [e for e in blocks if e >= 0]
    assert used == sorted(used), "blocks in expert order"
    return g


@pytest.mark.parametrize("bm", [16, 32])
def test_grouping_covers_every_assignment_once_in_expert_blocks(bm) -> None:
    gen = torch.Generator().manual_seed(3)
    for T, k, E in [(1, 1, 4), (7, 2, 8), (40, 8, 128), (100, 4, 16)]:
        scores = torch.rand(T, E, generator=gen)
        check_groups(torch.topk(scores, k, dim=1).indices, E, bm)


def test_grouping_of_every_token_on_the_same_experts() -> None:
    ids = torch.tensor([[5, 2]] * 33)  # two experts take the whole chunk, the others nothing
    g = check_groups(ids, 8, 16)
    assert sorted(set(g.blocks.cpu().tolist()) - {-1}) == [2, 5]


# -- the grouped products ----------------------------------------------------------------------


class Slots:
    """E experts (gate, up, down repacked) in slots of one buffer, in a shuffled order; the table
    gives each one's offset from the anchor, as the expert tables do."""

    def __init__(
        self, E: int, D: int, F: int, tg: Q, td: Q, rng: np.random.Generator, below: bool = False
    ) -> None:
        """``below``: the slots lie below the anchor, so every offset is negative."""
        self.gate = repacked_layout(tg, (F, D))
        self.down = repacked_layout(td, (D, F))
        self.up_off = align(self.gate.nbytes)
        self.down_off = self.up_off + align(self.gate.nbytes)
        slot = align(self.down_off + self.down.nbytes)
        self.arena = torch.zeros(E * slot + 256, dtype=torch.uint8, device=DEVICE)
        self.anchor = self.arena[E * slot :] if below else self.arena[:256]
        first = 0 if below else 256
        perm = torch.randperm(E).tolist()
        self.dense = []
        offsets = []
        for e in range(E):
            at = first + perm[e] * slot
            mats = [(0, tg, (F, D)), (self.up_off, tg, (F, D)), (self.down_off, td, (D, F))]
            dense = []
            for off, qt, shape in mats:
                raw = torch.from_numpy(random_bytes(qt, shape, rng))
                n = repacked_layout(qt, shape).nbytes
                self.arena[at + off : at + off + n] = repack.repack(raw, qt, shape).to(DEVICE)
                data = self.arena[at + off : at + off + n]
                dense.append(repack.dequantize_repacked(data, qt, shape))
            self.dense.append(dense)
            offsets.append(at - (E * slot if below else 0))
        self.table = torch.tensor(offsets, dtype=torch.int64, device=DEVICE)


def moe_reference(slots: Slots, h: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor):
    """[T * k, D] each assignment's weighted expert output, from float32 products (SiLU(gate) *
    up rounded to float16 on the way to down, as the kernels store it)."""
    k = ids.shape[1]
    flat, flat_w = ids.reshape(-1).to(DEVICE), wts.reshape(-1).to(DEVICE)
    out = torch.empty(flat.numel(), slots.down.rows, device=DEVICE)
    for e in flat.unique().tolist():
        a = (flat == e).nonzero().flatten()
        g, u, dn = slots.dense[e]
        x = h.float()[a // k]
        act = torch.nn.functional.silu(x @ g.T) * (x @ u.T)
        out[a] = (act.half().float() @ dn.T) * flat_w[a, None]
    return out


CASES = [
    # (T, k, E, how the tokens choose)
    (1, 1, 4, "random"),  # one assignment
    (9, 2, 6, "random"),
    (24, 4, 8, "all"),  # every expert, each by many tokens
    (20, 2, 8, "two"),  # two experts take the whole chunk, six take nothing
]


def choose(T: int, k: int, E: int, how: str, gen: torch.Generator) -> torch.Tensor:
    if how == "two":
        return torch.tensor([[3, 6]] * T)
    if how == "all":
        return torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    return torch.topk(torch.rand(T, E, generator=gen), k, dim=1).indices


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-k{c[1]}-E{c[2]}-{c[3]}")
@pytest.mark.parametrize(
    ("tg", "td"),
    [(Q.Q4_K, Q.Q6_K), (Q.Q5_K, Q.Q6_K), (Q.IQ4_XS, Q.Q4_0), (Q.Q8_0, Q.F16)],
    ids=lambda t: t.name,
)
def test_grouped_gate_up_and_down_match_the_reference(case, tg, td, rng) -> None:
    T, k, E, how = case
    D, F = 256, 512
    slots = Slots(E, D, F, tg, td, rng)
    gen = torch.Generator().manual_seed(T * E)
    ids = choose(T, k, E, how, gen)
    wts = torch.rand(T, k, generator=gen)
    h = halves(T, D, scale=H_SCALE)
    tile = gemm.MOE_TILE
    g = gemm.group_by_expert(ids.to(DEVICE), E, tile.bm)
    act = torch.full((g.rows.numel(), F), float("nan"), dtype=torch.float16, device=DEVICE)
    y = torch.full((T * k, D), float("nan"), device=DEVICE)
    args = (slots.table, slots.anchor)
    gemm.moe_gate_up(act, h, g, *args, slots.gate, slots.gate, slots.up_off, tile)
    flat_w = wts.reshape(-1).to(DEVICE)
    gemm.moe_down(y, act, g, flat_w, *args, slots.down, slots.down_off, tile)
    assert rel_err(y, moe_reference(slots, h, ids, wts)) < TOL


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("below", [False, True], ids=["above", "below-the-anchor"])
def test_an_expert_without_a_home_is_skipped_then_run_alone(below, rng) -> None:
    # only MISSING (-1) is skipped: slots below the anchor have negative offsets and are read
    T, k, E, D, F = 12, 2, 4, 256, 256
    slots = Slots(E, D, F, Q.Q4_K, Q.Q4_K, rng, below)
    assert (slots.table < 0).all() == below
    ids = torch.tensor([[t % E, (t + 1) % E] for t in range(T)])
    wts = torch.rand(T, k)
    h = halves(T, D, scale=H_SCALE)
    tile = gemm.MOE_TILE
    g = gemm.group_by_expert(ids.to(DEVICE), E, tile.bm)
    act = torch.zeros(g.rows.numel(), F, dtype=torch.float16, device=DEVICE)
    y = torch.full((T * k, D), float("nan"), device=DEVICE)
    flat_w = wts.reshape(-1).to(DEVICE)
    lay = (slots.gate, slots.gate, slots.up_off)
    table = slots.table.clone()
    table[2] = MISSING
    gemm.moe_gate_up(act, h, g, table, slots.anchor, *lay, tile)
    gemm.moe_down(y, act, g, flat_w, table, slots.anchor, slots.down, slots.down_off, tile)
    of_2 = (ids.reshape(-1) == 2).to(DEVICE)
    assert y[of_2].isnan().all(), "a MISSING expert's rows were written"
    assert not y[~of_2].isnan().any()
    only_2 = torch.full_like(slots.table, MISSING)
    only_2[2] = slots.table[2]
    gemm.moe_gate_up(act, h, g, only_2, slots.anchor, *lay, tile)
    gemm.moe_down(y, act, g, flat_w, only_2, slots.anchor, slots.down, slots.down_off, tile)
    assert rel_err(y, moe_reference(slots, h, ids, wts)) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["random", "all", "one"])
def test_grouped_products_on_the_30b_models_shapes(how, rng) -> None:
    """Qwen3-30B-A3B's expert shapes (Q4_K gate/up, Q6_K down), 32 experts, a 256-token chunk:
    top-8 routing, every expert by many tokens, or the whole chunk on one expert."""
    if not ON_GPU:
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    T, E, D, F = 256, 32, 2048, 768
    k = 1 if how == "one" else 8
    slots = Slots(E, D, F, Q.Q4_K, Q.Q6_K, rng)
    gen = torch.Generator().manual_seed(5)
    ids = torch.zeros(T, 1, dtype=torch.long) if how == "one" else choose(T, k, E, how, gen)
    wts = torch.rand(T, k, generator=gen)
    h = halves(T, D, scale=H_SCALE)
    for tile in (gemm.MOE_TILE, gemm.Tile(64, 128, 4, 4, 3), gemm.Tile(16, 64, 2, 4, 2)):
        g = gemm.group_by_expert(ids.to(DEVICE), E, tile.bm)
        act = torch.full((g.rows.numel(), F), float("nan"), dtype=torch.float16, device=DEVICE)
        y = torch.full((T * k, D), float("nan"), device=DEVICE)
        gemm.moe_gate_up(act, h, g, slots.table, slots.anchor, slots.gate, slots.gate,
                         slots.up_off, tile)  # fmt: skip
        gemm.moe_down(y, act, g, wts.reshape(-1).to(DEVICE), slots.table, slots.anchor,
                      slots.down, slots.down_off, tile)  # fmt: skip
        assert rel_err(y, moe_reference(slots, h, ids, wts)) < TOL, tile
