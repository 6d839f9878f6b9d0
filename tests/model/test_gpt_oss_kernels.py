"""gpt-oss's pieces in the GPU kernels against the reference operations, one tiny shape each
(in Triton's interpreter off a GPU): decode attention over a sliding window with a sink logit
per head, the matvec's bias, the router's softmax after the top-k (its bias in the logits), the
decode experts' biases and clamped SwiGLU, and the grouped prompt-chunk products' likewise.
Tolerances as the files these kernels' other tests live in (``test_decode_kernels``,
``test_prefill_kernels``)."""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
from test_decode_kernels import DEVICE, TOL, Experts, mat, nan, rel_err
from test_prefill_kernels import TOL as TOL_CHUNK
from test_prefill_kernels import Slots, halves

from strata.engine.kernels import attention as at
from strata.engine.kernels import gemm, moe
from strata.engine.kernels.matvec import matvec, matvec_reference
from strata.engine.ops import RoutingSpec, SwigluOAI
from strata.engine.ops.reference import route, swiglu_oai


class Dense:
    """A float32 matrix as ``weights.linear`` reads one."""

    def __init__(self, m: torch.Tensor) -> None:
        self.m, self.shape = m, tuple(m.shape)

    def dequant(self) -> torch.Tensor:
        return self.m


Q = gguf.GGMLQuantizationType
OAI = SwigluOAI()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(11)


@pytest.mark.parametrize("window", [None, 16], ids=["full", "window-16"])
def test_decode_attention_with_sinks_over_a_window_is_the_references(window) -> None:
    H, HKV, D, page, n_pages, length = 6, 2, 64, 16, 8, 70
    torch.manual_seed(3)
    kc = torch.randn(n_pages * page, HKV, D, device=DEVICE)
    vc = torch.randn(n_pages * page, HKV, D, device=DEVICE)
    table = torch.randperm(n_pages).int().to(DEVICE)  # pages out of order
    q = torch.randn(H * D, device=DEVICE)
    sinks = torch.randn(H, device=DEVICE) * 3
    att = at.DecodeAttention(H, HKV, D, page, 4, DEVICE)
    out = nan(H * D)
    pos = torch.tensor([length - 1], dtype=torch.int32, device=DEVICE)
    att(out, q, kc, vc, table, pos, window=window, sinks=sinks)
    lo = 0 if window is None else length - window
    p = torch.arange(lo, length)
    rows = table.long().cpu()[p // page] * page + p % page
    want = at.attention_reference(q.view(H, D).cpu(), kc.cpu()[rows], vc.cpu()[rows],
                                  sinks.cpu())  # fmt: skip
    assert (out.cpu() - want).abs().max() < 1e-5
    plain = at.attention_reference(q.view(H, D).cpu(), kc.cpu()[rows], vc.cpu()[rows])
    assert (plain - want).abs().max() > 1e-3  # the sinks took their share
    with pytest.raises(ValueError, match="5 sink logits for 6 query heads"):
        att(out, q, kc, vc, table, pos, sinks=sinks[:5])
    with pytest.raises(ValueError, match="window 0"):
        att(out, q, kc, vc, table, pos, window=0)


def test_attention_reference_with_sinks_is_the_operations_formula() -> None:
    """The twin the kernel is checked against is the reference's sink column, on one query."""
    torch.manual_seed(4)
    H, HKV, D, S = 4, 2, 8, 5
    q, k, v = torch.randn(H, D), torch.randn(S, HKV, D), torch.randn(S, HKV, D)
    sinks = torch.randn(H)
    got = at.attention_reference(q, k, v, sinks).view(H, D)
    for h in range(H):
        s = k[:, h // 2] @ q[h] / math.sqrt(D)
        w = torch.exp(s) / (torch.exp(s).sum() + torch.exp(sinks[h]))
        assert torch.allclose(got[h], w @ v[:, h // 2], atol=1e-6)


def test_matvec_adds_the_bias_before_the_residual(rng) -> None:
    mats = [mat(Q.Q8_0, 48, 256, rng), mat(Q.Q4_K, 32, 256, rng), mat(Q.F32, 32, 256, rng)]
    x, norm = torch.randn(256, device=DEVICE), torch.rand(256, device=DEVICE) + 0.5
    bias = torch.randn(112, device=DEVICE)
    y = nan(112)
    matvec(y, x, mats, norm, 1e-6, bias=bias)
    assert rel_err(y, matvec_reference(x, mats, norm, 1e-6, bias)) < TOL  # (on the mats' device)
    o, b1 = mats[:1], bias[:48]
    y0 = torch.randn(48, device=DEVICE) * 10
    y1 = y0.clone()
    matvec(y1, x, o, residual=True, bias=b1)
    assert rel_err(y1 - y0, matvec_reference(x, o, bias=b1)) < TOL
    with pytest.raises(ValueError, match="a bias of 47"):
        matvec(y1, x, o, bias=b1[:47])


@pytest.mark.parametrize("k", [1, 4])
def test_route_takes_the_top_logits_then_a_softmax_over_them(k) -> None:
    E = 12
    torch.manual_seed(k)
    x, router, bias = torch.randn(1, 32), torch.randn(E, 32), torch.randn(E)
    logits = (x @ router.T + bias)[0].to(DEVICE)  # the router's matvec adds its bias
    table = torch.arange(E, dtype=torch.int64, device=DEVICE) * 512
    ids = torch.zeros(k, dtype=torch.int32, device=DEVICE)
    eoffs = torch.zeros(k, dtype=torch.int64, device=DEVICE)
    wts = nan(k)
    counts = torch.zeros(E, dtype=torch.int32, device=DEVICE)
    moe.route(logits, table, ids, wts, eoffs, counts, k, False, late=True)
    spec = RoutingSpec(E, k, False, 1e-6, softmax_after_topk=True)
    want_w, want_ids = route(x, Dense(router), spec, bias)  # type: ignore[arg-type]
    assert ids.cpu().tolist() == want_ids[0].tolist()
    assert (wts.cpu() - want_w[0]).abs().max() < 1e-6
    assert abs(float(wts.sum()) - 1) < 1e-6 and counts.sum() == k
    if k > 1:  # not the top k of a softmax over every expert
        assert (wts.cpu() - torch.softmax(logits.cpu(), -1)[want_ids[0]]).abs().max() > 1e-3


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_decode_experts_with_biases_and_the_clamped_swiglu(rng) -> None:
    E, D, F, k = 6, 256, 256, 3
    ex = Experts(E, D, F, Q.MXFP4, Q.Q8_0, rng)
    chosen = [E - 1, 2, 0]  # the expert in the staging buffer first
    ids = torch.tensor(chosen, dtype=torch.int32, device=DEVICE)
    wts = torch.rand(k, device=DEVICE)
    h = torch.randn(D, device=DEVICE) * 4  # large enough that the clamp is hit
    bg, bu, bd = (torch.randn(E, n, device=DEVICE) for n in (F, F, D))
    extras = moe.ExpertExtras(ids, bg, bu, bd, (OAI.alpha, OAI.limit))
    act = nan(k, F)
    eoffs = ex.table[ids.long()]
    moe.gate_up(act, h, eoffs, ex.anchor, ex.gate, ex.gate, ex.up_off, extras=extras)
    hc, ys, clamped = h.cpu(), [], 0
    for i, e in enumerate(chosen):
        g, u, dn = ex.dense[e]
        gl, ul = g @ hc + bg[e].cpu(), u @ hc + bu[e].cpu()
        clamped += int((gl > OAI.limit).sum() + (ul.abs() > OAI.limit).sum())
        a = swiglu_oai(gl, ul, OAI)
        assert rel_err(act[i], a) < TOL
        ys.append((dn @ a + bd[e].cpu()) * float(wts[i]))
    assert clamped > 0
    want = torch.stack(ys).sum(0)
    x0 = torch.randn(D, device=DEVICE) * float(want.abs().max())
    x = x0.clone()
    moe.down(x, act, eoffs, wts, ex.anchor, ex.down, ex.down_off, extras=extras)
    assert rel_err(x - x0, want) < TOL


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_grouped_chunk_products_with_biases_and_the_clamped_swiglu(rng) -> None:
    T, k, E, D, F = 9, 2, 6, 256, 256
    slots = Slots(E, D, F, Q.MXFP4, Q.Q8_0, rng)
    gen = torch.Generator().manual_seed(5)
    ids = torch.topk(torch.rand(T, E, generator=gen), k, dim=1).indices
    wts = torch.rand(T, k, generator=gen)
    h = halves(T, D, scale=4.0)
    bg, bu, bd = (torch.randn(E, n, generator=gen).to(DEVICE) for n in (F, F, D))
    tile = gemm.MOE_TILE
    g = gemm.group_by_expert(ids.to(DEVICE), E, tile.bm)
    act = torch.full((g.rows.numel(), F), float("nan"), dtype=torch.float16, device=DEVICE)
    y = torch.full((T * k, D), float("nan"), device=DEVICE)
    gemm.moe_gate_up(act, h, g, slots.table, slots.anchor, slots.gate, slots.gate, slots.up_off,
                     tile, (bg, bu), (OAI.alpha, OAI.limit))  # fmt: skip
    flat_w = wts.reshape(-1).to(DEVICE)
    gemm.moe_down(y, act, g, flat_w, slots.table, slots.anchor, slots.down, slots.down_off,
                  tile, bd)  # fmt: skip
    want = torch.empty(T * k, D, device=DEVICE)
    flat = ids.reshape(-1)
    for a in range(T * k):
        e = int(flat[a])
        gt, ut, dn = slots.dense[e]
        x = h.float()[a // k]
        s = swiglu_oai(x @ gt.T + bg[e], x @ ut.T + bu[e], OAI)
        want[a] = (s.half().float() @ dn.T + bd[e]) * flat_w[a]
    assert rel_err(y, want) < TOL_CHUNK
    with pytest.raises(ValueError, match="want contiguous float32"):
        gemm.moe_down(y, act, g, flat_w, slots.table, slots.anchor, slots.down,
                      slots.down_off, tile, bd[:, :100])  # fmt: skip
