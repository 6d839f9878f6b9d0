"""Each decode kernel against its torch twin: matvec (every type, one to three matrices, the
folded RMSNorm, output gate, SwiGLU and (gated) residual), q/k norm + RoPE + K/V write, split
attention over a paged cache, and the MoE routing, gate/up and down over an expert table.

Compiled on a GPU; in Triton's interpreter on CPU tensors elsewhere (CI), on small shapes. The
``gpu`` tests add the real model's largest and smallest matrices. Outputs start as NaN, so an
element a kernel forgets to write fails. Tolerances: float32 sums in another order than the
twin's, relative to the output's norm: 1e-5 (matvec, MoE), 1e-5 absolute (attention over a
float32 K/V, RoPE). Over a 16-bit K/V the attention's products run on tensor cores, q and the
softmax weights rounded to the K/V's type: 2e-3 absolute (unit-variance inputs; 7e-4 at most
on an H200).
"""

from __future__ import annotations

import math
import os

import gguf
import numpy as np
import pytest
import torch
from quantdata import random_bytes

from strata.engine.experts.table import MISSING
from strata.engine.ops import RopeSpec
from strata.engine.ops.reference import Rope, rms_norm
from strata.engine.quant import repack
from strata.engine.quant.repack import align, repacked_layout

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed")

from strata.engine.kernels import attention as at
from strata.engine.kernels import moe, prefetch
from strata.engine.kernels import rope as rp
from strata.engine.kernels.matvec import Mat, matvec, matvec_reference

Q = gguf.GGMLQuantizationType
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = 1e-5
TOL_ATTN_16 = 2e-3  # attention over a 16-bit K/V (see above)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    assert not got.isnan().any(), "an output element was not written"
    return float((got - want).norm() / want.norm())


def wrong_rows(got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> str:
    """Where ``got`` departs from ``want`` (for an assertion's message): the rows whose error is
    over ``tol`` of the largest value, the first few with both values."""
    got, want = got.double().cpu(), want.double().cpu()
    bad = ((got - want).abs() > tol * want.abs().max()) | got.isnan()
    rows = bad.nonzero().flatten().tolist()
    shown = ", ".join(f"{i}: {got[i].item():.6g} not {want[i].item():.6g}" for i in rows[:6])
    return f"{len(rows)} of {got.numel()} rows wrong ({shown})"


def mat(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> Mat:
    raw = torch.from_numpy(random_bytes(qtype, (rows, cols), rng))
    lay = repacked_layout(qtype, (rows, cols))
    return Mat(repack.repack(raw, qtype, (rows, cols)).to(DEVICE), lay)


def nan(*shape: int) -> torch.Tensor:
    return torch.full(shape, float("nan"), device=DEVICE)


# -- matvec ------------------------------------------------------------------------------------

MATVEC_CASES = [
    [Q.Q4_K],
    [Q.Q6_K],
    [Q.Q8_0],
    [Q.F32],
    [Q.F16],
    [Q.BF16],
    [Q.Q4_K, Q.Q8_0],
    [Q.Q4_K, Q.Q4_K, Q.Q6_K],  # attention's q, k and a Q4_K_M layer's v
    [Q.F16, Q.Q8_0, Q.F32],
    [Q.Q5_K],
    [Q.IQ4_XS],
    [Q.Q4_0],
    [Q.Q5_K, Q.Q5_K, Q.Q6_K],  # a Q5_K_M layer's q, k and v
    [Q.IQ4_XS, Q.Q4_0, Q.Q5_K],
    # Q8_0 first: on the H200 (Triton 3.6) a lone Q8_0 with the norm folded in failed where
    # Q8_0 after a Q4_K passed; a Q8_0 model's q, k and v are this launch
    [Q.Q8_0, Q.Q8_0, Q.Q8_0],
    [Q.Q8_0, Q.Q4_K],
]


@pytest.mark.parametrize("types", MATVEC_CASES, ids=lambda ts: "+".join(t.name for t in ts))
@pytest.mark.parametrize("with_norm", [False, True], ids=["plain", "rmsnorm"])
def test_matvec_matches_dequantise_then_multiply(types, with_norm, rng) -> None:
    K = 512
    mats = [mat(t, n, K, rng) for t, n in zip(types, [37, 16, 5], strict=False)]  # ragged rows
    x = torch.randn(K, device=DEVICE)
    norm = torch.rand(K, device=DEVICE) + 0.5 if with_norm else None
    y, h = nan(sum(m.rows for m in mats)), nan(K)
    matvec(y, x, mats, norm=norm, eps=1e-6, h_out=h if with_norm else None)
    want = matvec_reference(x, mats, norm, 1e-6)
    assert rel_err(y, want) < TOL, wrong_rows(y, want)
    if with_norm:
        assert rel_err(h, rms_norm(x, norm, 1e-6)) < 1e-6, wrong_rows(h, rms_norm(x, norm, 1e-6))


@pytest.mark.parametrize("bn", [1, 2, 4, 8])
@pytest.mark.parametrize("warps", [1, 2, 4])
@pytest.mark.parametrize("form", ["plain", "rmsnorm", "rmsnorm+h_out"])
def test_a_q8_0_matvec_at_every_cut(bn, warps, form, rng) -> None:
    """A lone Q8_0 matrix (ragged rows) at several rows a program and warps: on the H100 and
    the H200 (Triton 3.6), while Q8_0 was half blocks of 16, the launch that also stores its
    normalised input (``h_out``) at 4 rows and one warp left rows 2 and 3 of every program
    unwritten and every other cut passed (racecheck clean: the compiler's, not a race)."""
    K = 512
    m = mat(Q.Q8_0, 37, K, rng)
    x = torch.randn(K, device=DEVICE)
    norm = torch.rand(K, device=DEVICE) + 0.5 if form != "plain" else None
    y, h = nan(37), nan(K)
    h_out = h if form == "rmsnorm+h_out" else None
    matvec(y, x, [m], norm=norm, eps=1e-6, h_out=h_out, bn=bn, num_warps=warps)
    want = matvec_reference(x, [m], norm, 1e-6)
    assert rel_err(y, want) < TOL, wrong_rows(y, want)
    if h_out is not None:
        assert rel_err(h, rms_norm(x, norm, 1e-6)) < 1e-6


# The tiny models' dense launches (``tiny_models``: a width of 256; qwen3moe's 8 query heads of
# 64 and 2 K/V heads, mixtral's of 32; a vocabulary of 4096) at the cuts the GPU path gives them
# (``gpu.decode.TUNED``; the interpreter keeps its own): their Q8_0 files decode NaN on the H100
# and the H200 (Triton 3.6) with their routers in F32, so one of these launches is wrong there.
TINY_LAUNCHES = {
    "qkv-qwen3moe": ("qkv", [512, 128, 128], 256, "norm"),
    "qkv-mixtral": ("qkv", [256, 64, 64], 256, "norm"),
    "o-qwen3moe": ("o", [256], 512, "residual"),
    "o-mixtral": ("o", [256], 256, "residual"),
    "head": ("head", [4096], 256, "norm"),
}


@pytest.mark.parametrize("launch", list(TINY_LAUNCHES))
def test_the_tiny_models_q8_0_matvecs_at_their_cuts(launch, rng) -> None:
    from strata.engine.gpu.decode import tunes

    role, rows, K, form = TINY_LAUNCHES[launch]
    mats = [mat(Q.Q8_0, n, K, rng) for n in rows]
    x = torch.randn(K, device=DEVICE)
    norm = torch.rand(K, device=DEVICE) + 0.5 if form == "norm" else None
    residual = form == "residual"
    y = torch.randn(sum(rows), device=DEVICE) if residual else nan(sum(rows))
    want = matvec_reference(x, mats, norm, 1e-6) + (y if residual else 0)
    matvec(y, x, mats, norm=norm, eps=1e-6, residual=residual, **tunes(None, DEVICE)[role].kw())
    assert rel_err(y, want) < TOL, wrong_rows(y, want)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.F32, Q.BF16], ids=lambda t: t.name)
def test_matvec_on_a_dimension_not_a_multiple_of_the_inner_step(qtype, rng) -> None:
    K = 96  # three Q8_0 / Q4_0 blocks, not a multiple of eight blocks or of 256 floats
    m = mat(qtype, 19, K, rng)
    x = torch.randn(K, device=DEVICE)
    y = nan(19)
    matvec(y, x, [m])
    assert rel_err(y, matvec_reference(x, [m])) < TOL


def test_matvec_adds_the_residual(rng) -> None:
    m = mat(Q.Q4_K, 48, 1024, rng)
    x = torch.randn(1024, device=DEVICE)
    y0 = torch.randn(48, device=DEVICE)
    y = y0.clone()
    matvec(y, x, [m], residual=True)
    assert rel_err(y, y0 + matvec_reference(x, [m])) < TOL


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.F32], ids=lambda t: t.name)
def test_matvec_folds_the_hybrids_gate_swiglu_and_gated_residual(qtype, rng) -> None:
    """The gated attention's output gate (x · σ(gate)) and a shared expert's SwiGLU
    (SiLU(x) · up) on the input's way in, the shared expert's σ(h · v)-scaled residual add on
    the way out: each against torch, and each fold different from leaving it out."""
    K, N, D = 256, 24, 96
    m = mat(qtype, N, K, rng)
    x, g, u = (torch.randn(K, device=DEVICE) for _ in range(3))
    y = nan(N)
    matvec(y, x, [m], gate=g)
    want = matvec_reference(x * torch.sigmoid(g), [m])
    assert rel_err(y, want) < TOL and rel_err(y, matvec_reference(x, [m])) > 0.1
    assert rel_err(matvec_reference(x, [m], gate=g), want) < 1e-6
    matvec(y, x, [m], up=u)
    want = matvec_reference(torch.nn.functional.silu(x) * u, [m])
    assert rel_err(y, want) < TOL and rel_err(matvec_reference(x, [m], up=u), want) < 1e-6
    h = torch.randn(D, device=DEVICE)
    v = h * (0.4 / float(h @ h))  # h · v = 0.4: a gate of 0.6
    y0 = torch.randn(N, device=DEVICE)
    y = y0.clone()
    matvec(y, x, [m], residual=True, up=u, res_gate=(h, v))
    s = torch.sigmoid(h @ v)
    assert 0.05 < float(s) < 0.95, "a gate that scales"
    want = y0 + s * matvec_reference(torch.nn.functional.silu(x) * u, [m])
    assert rel_err(y, want) < TOL


def test_matvec_refuses_folds_that_do_not_go_together(rng) -> None:
    m = mat(Q.Q8_0, 8, 64, rng)
    x, y = torch.randn(64, device=DEVICE), nan(8)
    with pytest.raises(ValueError, match="one transform of the input at most, got norm and up"):
        matvec(y, x, [m], norm=torch.ones(64, device=DEVICE), up=x)
    with pytest.raises(ValueError, match=r"gate: 32 torch\.float32 values for 64"):
        matvec(y, x, [m], gate=x[:32])
    with pytest.raises(ValueError, match="res_gate scales the residual add: it needs residual"):
        matvec(y, x, [m], res_gate=(x, x))
    with pytest.raises(ValueError, match="res_gate: h and v of one size"):
        matvec(y, x, [m], residual=True, res_gate=(x, x[:8]))
    assert y.isnan().all(), "a refused launch wrote nothing"


def test_matvec_rejects_what_does_not_fit(rng) -> None:
    m = mat(Q.Q8_0, 8, 64, rng)
    with pytest.raises(ValueError, match="8x64 matrix cannot multiply 32 inputs"):
        matvec(nan(8), torch.zeros(32, device=DEVICE), [m])
    with pytest.raises(ValueError, match="1 to 3 matrices, got 4"):
        matvec(nan(32), torch.zeros(64, device=DEVICE), [m] * 4)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("qtype", "rows", "cols"),
    [
        (Q.Q6_K, 151936, 2048),  # the output head: the largest
        (Q.F32, 128, 2048),  # the router: the smallest
        (Q.Q4_K, 4096, 2048),  # attention q
        (Q.Q4_K, 2048, 4096),  # attention output
    ],
)
def test_matvec_on_the_30b_models_matrices(qtype, rows, cols, rng) -> None:
    if DEVICE.type != "cuda":
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    m = mat(qtype, rows, cols, rng)
    x = torch.randn(cols, device=DEVICE)
    norm = torch.rand(cols, device=DEVICE) + 0.5
    y = nan(rows)
    matvec(y, x, [m], norm=norm, eps=1e-6)
    assert rel_err(y, matvec_reference(x, [m], norm, 1e-6)) < TOL


# -- q/k norm, RoPE, K/V write -------------------------------------------------------------------


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "pairs"])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk-norm", "no-norm"])
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float32], ids=["f16", "f32"])
def test_rope_store_matches_the_reference_layers(neox, qk_norm, kv_dtype) -> None:
    H, HKV, D, page, n_ctx = 4, 2, 32, 16, 64
    qkv = torch.randn((H + 2 * HKV) * D, device=DEVICE)
    cos, sin = rp.rope_tables(D, 1e6, n_ctx, DEVICE)
    qn, kn = torch.rand(D, device=DEVICE) + 0.5, torch.rand(D, device=DEVICE) + 0.5
    kc = torch.zeros(n_ctx, HKV, D, dtype=kv_dtype, device=DEVICE)
    vc = torch.zeros_like(kc)
    table = torch.tensor([3, 0, 1, 2], dtype=torch.int32, device=DEVICE)  # position 21: page 0
    pos = torch.tensor([21], dtype=torch.int32, device=DEVICE)
    before = qkv.clone().cpu()
    rp.rope_store(qkv, cos, sin, qn if qk_norm else None, kn if qk_norm else None, kc, vc,
                  table, pos, 1e-6, H, HKV, D, page, neox)  # fmt: skip
    q = before[: H * D].view(1, H, D)
    k = before[H * D : (H + HKV) * D].view(1, HKV, D)
    v = before[(H + HKV) * D :].view(HKV, D)
    if qk_norm:
        q, k = rms_norm(q, qn.cpu(), 1e-6), rms_norm(k, kn.cpu(), 1e-6)
    rope, at_pos = Rope(D, RopeSpec(1e6, neox)), torch.tensor([21])
    q, k = rope(q, at_pos), rope(k, at_pos)
    row = 0 * page + 21 % page
    assert (qkv[: H * D].cpu() - q.reshape(-1)).abs().max() < TOL
    assert (kc[row].float().cpu() - k[0].to(kv_dtype).float()).abs().max() < 1e-3
    assert torch.equal(vc[row].cpu(), v.to(kv_dtype))
    assert int(kc.float().ne(0).sum()) == int(kc[row].float().ne(0).sum()), "wrote another row"


@pytest.mark.parametrize(
    ("neox", "qk_norm", "kv_dtype"),
    [(True, True, torch.float16), (False, False, torch.float32), (True, False, torch.float32),
     (False, True, torch.float16)],
    ids=["neox-norm-f16", "pairs-f32", "neox-f32", "pairs-norm-f16"],
)  # fmt: skip
@pytest.mark.parametrize(("length", "window"), [(1, None), (37, None), (100, None), (100, 20)])
def test_attention_with_rotary_is_rope_store_then_attention(
    neox, qk_norm, kv_dtype, length, window
) -> None:
    """The one launch that norms and rotates q and k, writes the token's K/V and attends gives
    what ``rope_store`` then the attention give: the same K/V rows written (the token's alone),
    the same output within the float sums' order."""
    H, HKV, D, page, n_pages = 8, 2, 32, 16, 8
    torch.manual_seed(length)
    qkv = torch.randn((H + 2 * HKV) * D, device=DEVICE)
    cos, sin = rp.rope_tables(D, 1e6, page * n_pages, DEVICE)
    qn, kn = torch.rand(D, device=DEVICE) + 0.5, torch.rand(D, device=DEVICE) + 0.5
    norms = (qn, kn) if qk_norm else (None, None)
    kc = torch.randn(n_pages * page, HKV, D, device=DEVICE).to(kv_dtype)
    vc = torch.randn_like(kc)
    table = torch.randperm(n_pages).int().to(DEVICE)
    pos = torch.tensor([length - 1], dtype=torch.int32, device=DEVICE)
    # the two-launch form on copies
    qkv2, kc2, vc2 = qkv.clone(), kc.clone(), vc.clone()
    rp.rope_store(qkv2, cos, sin, *norms, kc2, vc2, table, pos, 1e-6, H, HKV, D, page, neox)
    want = nan(H * D)
    at.DecodeAttention(H, HKV, D, page, 4, DEVICE)(want, qkv2[: H * D], kc2, vc2, table, pos,
                                                   window=window)  # fmt: skip
    before, kc0, vc0 = qkv.clone(), kc.clone(), vc.clone()
    out = nan(H * D)
    rotary = at.Rotary(cos, sin, *norms, 1e-6, neox)
    at.DecodeAttention(H, HKV, D, page, 4, DEVICE)(out, qkv, kc, vc, table, pos, window=window,
                                                   rotary=rotary)  # fmt: skip
    assert torch.equal(qkv, before), "the projection is read, not written"
    row = int(table[(length - 1) // page]) * page + (length - 1) % page
    assert torch.equal(vc[row], vc2[row])
    k_tol = 1e-6 if kv_dtype == torch.float32 else 1e-3  # a norm's sum in another order
    assert (kc[row].float() - kc2[row].float()).abs().max() < k_tol
    others = torch.arange(n_pages * page, device=DEVICE) != row
    assert torch.equal(kc[others], kc0[others]) and torch.equal(vc[others], vc0[others])
    tol = TOL if kv_dtype == torch.float32 else TOL_ATTN_16
    assert not out.isnan().any() and (out - want).abs().max() < tol


def test_attention_with_rotary_refuses_what_it_cannot_read() -> None:
    H, HKV, D = 4, 2, 32
    cos, sin = rp.rope_tables(D, 1e6, 64, DEVICE)
    kc = torch.zeros(64, HKV, D, device=DEVICE)
    table = torch.arange(4, dtype=torch.int32, device=DEVICE)
    pos = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    att, out = at.DecodeAttention(H, HKV, D, 16, 4, DEVICE), nan(H * D)
    qkv = torch.randn((H + 2 * HKV) * D, device=DEVICE)
    with pytest.raises(ValueError, match=r"with rotary, q is q\|k\|v: 256 values"):
        att(out, qkv[: H * D], kc, kc, table, pos, rotary=at.Rotary(cos, sin, None, None, 0, True))
    with pytest.raises(ValueError, match=r"rotary cos: \[positions, 16\] float32"):
        att(out, qkv, kc, kc, table, pos, rotary=at.Rotary(cos[:, :8], sin, None, None, 0, True))
    with pytest.raises(ValueError, match="norms come together or not at all"):
        att(out, qkv, kc, kc, table, pos, rotary=at.Rotary(cos, sin, cos[0], None, 0, True))
    with pytest.raises(ValueError, match="rotary q norm: 16 weights for heads of 32"):
        att(out, qkv, kc, kc, table, pos, rotary=at.Rotary(cos, sin, cos[0], cos[0], 0, True))
    assert out.isnan().all() and not kc.any(), "a refused call wrote nothing"


# -- attention -------------------------------------------------------------------------------


@pytest.mark.parametrize(("H", "HKV", "D"), [(8, 2, 64), (4, 4, 32), (8, 1, 32), (32, 4, 128)])
@pytest.mark.parametrize("length", [1, 5, 17, 100, 128])
def test_split_attention_matches_softmax_attention(H, HKV, D, length) -> None:
    page, n_pages = 16, 8
    torch.manual_seed(length)
    kc = torch.randn(n_pages * page, HKV, D, device=DEVICE).half()
    vc = torch.randn(n_pages * page, HKV, D, device=DEVICE).half()
    table = torch.randperm(n_pages).int().to(DEVICE)  # pages out of order
    att = at.DecodeAttention(H, HKV, D, page, 8, DEVICE)
    q = torch.randn(H * D, device=DEVICE)
    out = nan(H * D)
    att(out, q, kc, vc, table, torch.tensor([length - 1], dtype=torch.int32, device=DEVICE))
    p = torch.arange(length)
    rows = table.long().cpu()[p // page] * page + p % page
    want = at.attention_reference(q.view(H, D).cpu(), kc.cpu()[rows], vc.cpu()[rows])
    assert (out.cpu() - want).abs().max() < TOL_ATTN_16


@pytest.mark.parametrize("length", [1, 40, 100])
def test_attention_and_rope_read_and_write_the_growing_kv_pages(length) -> None:
    # the K/V's own layout: a page holds every layer's K and V, so one layer's pages are
    # ``page_stride`` elements apart; the table's unused entries point at the sink (page 0)
    from strata.engine.kv import KVCache

    H, HKV, D, L, layer = 4, 2, 32, 3, 1
    chunk = 2 << 20 if DEVICE.type == "cuda" else 1 << 16  # CUDA maps 2 MiB at least
    kv = KVCache(L, 128, HKV, D, "f32", DEVICE, page=16, keep=1, chunk_bytes=chunk)

    def prepare(end: int) -> None:  # what the runner does: map chunks for the pages missing
        kv.grow(kv.bytes_to_map(kv.pages_short(end)))
        kv.prepare(end)

    try:
        kv.begin([1] * 3 + [2] * 60)  # another conversation holds the lowest pages first
        prepare(63)
        kv.commit([1] * 3 + [2] * 60)
        kv.begin([3] * length)
        prepare(length)
        assert kv.book.active.pages[0] > 4 and kv.page_stride > 16 * HKV * D
        kc, vc = kv.layer(layer)
        torch.manual_seed(length)
        k, v = (torch.randn(length, HKV, D, device=DEVICE) for _ in range(2))
        kv.write(layer, 0, k, v)
        pos = torch.tensor([length - 1], dtype=torch.int32, device=DEVICE)
        # RoPE's write of the last position lands where the reference path reads it
        qkv = torch.randn((H + 2 * HKV) * D, device=DEVICE)
        cos, sin = rp.rope_tables(D, 1e6, 128, DEVICE)
        rp.rope_store(qkv, cos, sin, None, None, kc, vc, kv.block_table, pos, 1e-6, H, HKV, D,
                      kv.page, True, kv.page_stride)  # fmt: skip
        keys, values = kv.read(layer, length)
        assert torch.equal(values[-1], qkv[(H + HKV) * D :].view(HKV, D).cpu().to(values))
        assert torch.equal(keys[:-1].cpu(), k[:-1].cpu()), "only the last row was written"
        att = at.DecodeAttention(H, HKV, D, kv.page, 4, DEVICE)
        q = torch.randn(H * D, device=DEVICE)
        out = nan(H * D)
        att(out, q, kc, vc, kv.block_table, pos, kv.page_stride)
        want = at.attention_reference(q.view(H, D).cpu(), keys.cpu(), values.cpu())
        assert (out.cpu() - want).abs().max() < TOL
    finally:
        kv.close()


def test_attention_rejects_uneven_groups() -> None:
    with pytest.raises(ValueError, match="6 query heads do not share 4 K/V heads"):
        at.DecodeAttention(6, 4, 32, 16, 8, DEVICE)


# -- MoE ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("norm", [True, False])
def test_route_picks_the_reference_top_k_and_counts_them(k, norm) -> None:
    E = 16
    logits = torch.randn(E, device=DEVICE)
    table = torch.arange(E, dtype=torch.int64, device=DEVICE) * 4096 - 8192
    ids = torch.zeros(k, dtype=torch.int32, device=DEVICE)
    eoffs = torch.zeros(k, dtype=torch.int64, device=DEVICE)
    wts = nan(k)
    counts = torch.full((E,), 3, dtype=torch.int32, device=DEVICE)
    moe.route(logits, table, ids, wts, eoffs, counts, k, norm)
    want_ids, want_w = moe.route_reference(logits.cpu(), k, norm)
    assert ids.cpu().tolist() == want_ids.tolist()
    assert eoffs.cpu().tolist() == (want_ids * 4096 - 8192).tolist()  # their table entries
    assert (wts.cpu() - want_w).abs().max() < 1e-6
    expected = torch.full((E,), 3, dtype=torch.int32)
    expected[want_ids] += 1
    assert torch.equal(counts.cpu(), expected)


@pytest.mark.parametrize("late", [False, True], ids=["softmax-first", "top-k-first"])
def test_route_takes_equal_values_lowest_id_first_negative_and_zero_ones_too(late) -> None:
    """The top k is one max a pick over (value, id) packed in an int64: equal values, a -0.0
    and a +0.0 among them, go lowest id first, and negative logits order as floats do."""
    E, k = 16, 7
    logits = torch.full((E,), -5.0)
    logits[[9, 5]] = torch.tensor([0.0, -0.0])  # equal: 5 first
    logits[[7, 3]] = -1.0
    logits[12] = -0.75
    table = torch.arange(E, dtype=torch.int64, device=DEVICE) * 512
    ids = torch.zeros(k, dtype=torch.int32, device=DEVICE)
    eoffs = torch.zeros(k, dtype=torch.int64, device=DEVICE)
    wts = nan(k)
    counts = torch.zeros(E, dtype=torch.int32, device=DEVICE)
    moe.route(logits.to(DEVICE), table, ids, wts, eoffs, counts, k, False, late=late)
    want = [5, 9, 12, 3, 7, 0, 1]
    assert ids.cpu().tolist() == want
    vals = logits[want]
    w = torch.softmax(vals, -1) if late else torch.softmax(logits, -1)[want]
    assert (wts.cpu() - w).abs().max() < 1e-6
    assert counts.cpu()[want].tolist() == [1] * k and int(counts.sum()) == k


@pytest.mark.parametrize("p", [1, 3, 8])
def test_predict_copies_ahead_the_top_p_with_ram_homes_only(p) -> None:
    E = 16
    logits = torch.randn(E, device=DEVICE)
    logits[4] = logits[8] = 10.0  # a tie: the lower id first, as route takes it
    logits[1] = 11.0  # the best, but in VRAM: its entry stays empty
    homes = torch.full((E,), MISSING, dtype=torch.int64, device=DEVICE)
    homes[::2] = torch.arange(0, E, 2, dtype=torch.int64) * 4096 - 8192  # below the anchor too
    pf_ids = torch.full((p,), 77, dtype=torch.int32, device=DEVICE)
    pf_src = torch.full((p,), 77, dtype=torch.int64, device=DEVICE)
    prefetch.predict(logits, homes, pf_ids, pf_src)
    want = prefetch.predict_reference(logits.cpu(), homes.cpu(), p)
    assert list(zip(pf_ids.cpu().tolist(), pf_src.cpu().tolist(), strict=True)) == want
    assert want[:3] == [(-1, MISSING), (4, 4 * 4096 - 8192), (8, 8 * 4096 - 8192)][:p]


def test_copies_ahead_land_in_their_staging_slots_and_route_reads_them() -> None:
    E, k, p, slot = 16, 4, 3, 4096

    def aligned(n: int) -> torch.Tensor:  # n zero bytes at a multiple of 256
        buf = torch.zeros(n + 256, dtype=torch.uint8, device=DEVICE)
        return buf[-buf.data_ptr() % 256 :][:n]

    anchor, stage = aligned(256), aligned(p * slot)
    homes_buf = aligned(E * slot)
    homes_buf.copy_(torch.randint(0, 255, (E * slot,), dtype=torch.uint8))
    at = lambda t: t.data_ptr() - anchor.data_ptr()  # noqa: E731
    homes = torch.tensor([at(homes_buf) + e * slot for e in range(E)], device=DEVICE)
    homes[1] = MISSING  # in VRAM
    logits = torch.linspace(1.0, 0.0, E, device=DEVICE)  # predicted: 0, 1, 2
    pf_ids = torch.zeros(p, dtype=torch.int32, device=DEVICE)
    pf_src = torch.zeros(p, dtype=torch.int64, device=DEVICE)
    prefetch.predict(logits, homes, pf_ids, pf_src)
    assert pf_ids.cpu().tolist() == [0, -1, 2]
    before = stage.clone()
    prefetch.copy_experts(anchor, pf_ids, pf_src, at(stage), slot - 256, slot)
    assert torch.equal(stage[: slot - 256], homes_buf[: slot - 256])
    assert torch.equal(stage[slot - 256 : 2 * slot], before[slot - 256 : 2 * slot])  # nothing else
    assert torch.equal(stage[2 * slot : 3 * slot - 256], homes_buf[2 * slot : 3 * slot - 256])
    # the routing chooses 3, 2, 0, 1 (the largest logits): 2 and 0 come from their copies
    route_logits = torch.tensor([3.0, 1.0, 4.0, 5.0] + [0.0] * (E - 4), device=DEVICE)
    table = homes.clone()
    table[1] = 123 * 256
    ids = torch.zeros(k, dtype=torch.int32, device=DEVICE)
    eoffs = torch.zeros(k, dtype=torch.int64, device=DEVICE)
    wts = nan(k)
    counts = torch.zeros(E, dtype=torch.int32, device=DEVICE)
    stats = torch.tensor([10, 4], dtype=torch.int64, device=DEVICE)
    pf = moe.Prefetched(pf_ids, at(stage), slot, stats)
    moe.route(route_logits, table, ids, wts, eoffs, counts, k, True, pf)
    assert ids.cpu().tolist() == [3, 2, 0, 1]
    assert eoffs.cpu().tolist() == [int(homes[3]), at(stage) + 2 * slot, at(stage), 123 * 256]
    assert stats.cpu().tolist() == [12, 6]  # two copies made, both chosen
    # the chosen expert in RAM that no copy brought (3) is copied now; the rest stay put
    late = aligned(k * slot)
    eo = eoffs.clone()
    prefetch.copy_missed(anchor, ids, eoffs, homes, pf_ids, at(late), slot - 256, slot)
    assert eoffs.cpu().tolist() == [at(late), *eo.cpu().tolist()[1:]]
    assert torch.equal(late[: slot - 256], homes_buf[3 * slot : 4 * slot - 256])
    assert not late[slot:].any()  # slots 1-3: nothing to copy
    with pytest.raises(ValueError, match="256-byte aligned"):
        prefetch.copy_experts(anchor, pf_ids, pf_src, at(stage) + 8, slot, slot)


class Experts:
    """E experts in slots of one buffer, in a shuffled order, and one in a separate buffer (as a
    staging slot is): the table gives each one's offset from the anchor."""

    def __init__(self, E: int, D: int, F: int, tg: Q, td: Q, rng: np.random.Generator) -> None:
        self.gate = repacked_layout(tg, (F, D))
        self.down = repacked_layout(td, (D, F))
        self.up_off = align(self.gate.nbytes)
        self.down_off = self.up_off + align(self.gate.nbytes)
        slot = align(self.down_off + self.down.nbytes)
        self.arena = torch.zeros(E * slot, dtype=torch.uint8, device=DEVICE)
        self.staging = torch.zeros(slot, dtype=torch.uint8, device=DEVICE)
        self.anchor = torch.zeros(256, dtype=torch.uint8, device=DEVICE)
        perm = torch.randperm(E).tolist()
        self.dense: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        offsets = []
        for e in range(E):
            at = perm[e] * slot
            where = self.staging if e == E - 1 else self.arena[at : at + slot]
            mats = [(0, tg, (F, D)), (self.up_off, tg, (F, D)), (self.down_off, td, (D, F))]
            dense = []
            for off, qt, shape in mats:
                raw = torch.from_numpy(random_bytes(qt, shape, rng))
                n = repacked_layout(qt, shape).nbytes
                where[off : off + n] = repack.repack(raw, qt, shape).to(DEVICE)
                dense.append(repack.dequantize_repacked(where[off : off + n].cpu(), qt, shape))
            self.dense[e] = tuple(dense)  # type: ignore[assignment]
            offsets.append(where.data_ptr() - self.anchor.data_ptr())
        self.table = torch.tensor(offsets, dtype=torch.int64, device=DEVICE)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # SiLU of -big
@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize(
    ("tg", "td"),
    [
        (Q.Q4_K, Q.Q6_K),
        (Q.Q4_K, Q.Q4_K),
        (Q.Q8_0, Q.F32),
        (Q.Q8_0, Q.Q8_0),  # the tiny Q8_0 models' experts (they decode NaN under Triton 3.6)
        (Q.F16, Q.BF16),
        (Q.Q5_K, Q.Q6_K),  # a Q5_K_M use_more_bits layer
        (Q.Q5_K, Q.Q5_K),
        (Q.IQ4_XS, Q.IQ4_XS),
        (Q.Q4_0, Q.Q4_0),
        (Q.IQ4_XS, Q.Q5_K),
    ],
    ids=lambda t: t.name,
)
def test_gate_up_and_down_match_the_reference_expert_sum(k, tg, td, rng) -> None:
    E, D, F = 12, 256, 512
    ex = Experts(E, D, F, tg, td, rng)
    chosen = [E - 1, *range(k - 1)]  # the expert in the staging buffer first
    ids = torch.tensor(chosen, dtype=torch.int32, device=DEVICE)
    wts = torch.rand(k, device=DEVICE)
    h = torch.randn(D, device=DEVICE)
    act = nan(k, F)
    eoffs = ex.table[ids.long()]
    moe.gate_up(act, h, eoffs, ex.anchor, ex.gate, ex.gate, ex.up_off)
    hc, ys = h.cpu(), []
    for i, e in enumerate(chosen):
        g, u, dn = ex.dense[e]
        a = torch.nn.functional.silu(g @ hc) * (u @ hc)
        assert rel_err(act[i], a) < TOL
        ys.append((dn @ a) * float(wts[i]))
    want = torch.stack(ys).sum(0)
    # a residual of the output's own magnitude: a larger one would cancel the digits compared
    x0 = torch.randn(D, device=DEVICE) * float(want.abs().max())
    for flat in (False, True):  # the quants as 3-D or as flat tiles (``unit_bytes``); with k = 3
        x = x0.clone()  # a step holds a fourth expert's lanes, which must count 0
        moe.down(x, act, eoffs, wts, ex.anchor, ex.down, ex.down_off, flat=flat)
        assert rel_err(x - x0, want) < TOL, f"flat={flat}"


@pytest.mark.parametrize("ept", [1, 2, 4])
def test_down_takes_fewer_experts_side_by_side_and_a_register_cap(ept, rng) -> None:
    """The cuts ``Tune`` offers (``gpu.decode``): experts side by side in a step, a register
    cap (compiled on a GPU; the interpreter takes and ignores it) give the same sum."""
    E, D, F, k = 6, 256, 256, 4
    ex = Experts(E, D, F, Q.Q4_K, Q.Q6_K, rng)
    ids = torch.tensor([5, 0, 2, 3], dtype=torch.int32, device=DEVICE)
    wts, act = torch.rand(k, device=DEVICE), torch.randn(k, F, device=DEVICE)
    eoffs = ex.table[ids.long()]
    want = sum(ex.dense[e][2] @ act[i].cpu() * float(wts[i]) for i, e in enumerate(ids.tolist()))
    x = torch.zeros(D, device=DEVICE)
    moe.down(x, act, eoffs, wts, ex.anchor, ex.down, ex.down_off, ept=ept, maxnreg=128)
    assert rel_err(x, want) < TOL
    with pytest.raises(ValueError, match="3 experts side by side: want a power of two up to 4"):
        moe.down(x, act, eoffs, wts, ex.anchor, ex.down, ex.down_off, ept=3)
    with pytest.raises(ValueError, match="a register cap of 300: want 16 to 255"):
        moe.down(x, act, eoffs, wts, ex.anchor, ex.down, ex.down_off, maxnreg=300)


@pytest.mark.gpu
def test_moe_on_the_30b_models_expert_shapes(rng) -> None:
    if DEVICE.type != "cuda":
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    E, D, F, k = 16, 2048, 768, 8
    ex = Experts(E, D, F, Q.Q4_K, Q.Q6_K, rng)
    ids = torch.tensor([15, 3, 1, 0, 9, 7, 2, 11], dtype=torch.int32, device=DEVICE)
    wts = torch.softmax(torch.randn(k, device=DEVICE), 0)
    h = torch.randn(D, device=DEVICE)
    act = nan(k, F)
    eoffs = ex.table[ids.long()]
    moe.gate_up(act, h, eoffs, ex.anchor, ex.gate, ex.gate, ex.up_off)
    x = torch.zeros(D, device=DEVICE)
    moe.down(x, act, eoffs, wts, ex.anchor, ex.down, ex.down_off)
    hc, ys = h.cpu(), []
    for i, e in enumerate(ids.tolist()):
        g, u, dn = ex.dense[e]
        a = torch.nn.functional.silu(g @ hc) * (u @ hc)
        ys.append((dn @ a) * float(wts[i]))
    assert rel_err(x, torch.stack(ys).sum(0)) < TOL


def test_attention_reference_is_the_layers_formula() -> None:
    # the twin against the engine's own attention arithmetic on one position
    H, HKV, D, S = 4, 2, 8, 5
    q, k, v = torch.randn(H, D), torch.randn(S, HKV, D), torch.randn(S, HKV, D)
    want = []
    for h in range(H):
        kk, vv = k[:, h // (H // HKV)], v[:, h // (H // HKV)]
        want.append(torch.softmax(kk @ q[h] / math.sqrt(D), 0) @ vv)
    assert torch.allclose(at.attention_reference(q, k, v), torch.cat(want), atol=1e-6)


# -- the sampler's one-launch draw ---------------------------------------------------------------


@pytest.mark.parametrize("window", [0, 3])
def test_the_draw_kernel_chooses_what_its_torch_twin_does(window: int) -> None:
    # 16 candidates sorted best first, every filter on: the same token, draw count and window
    # as the torch operations, over several draws of one state
    from strata.engine import sampling
    from strata.engine.kernels import sample as sk

    gen = torch.Generator().manual_seed(5)
    for case in range(4):
        params = sampling.SamplingParams(
            temperature=0.5 + case * 0.4, top_k=[0, 5, 12, 3][case],
            top_p=[1.0, 0.9, 0.6, 0.95][case], min_p=[0.0, 0.05, 0.1, 0.2][case],
            repeat_penalty=1.1 if window else 1.0, repeat_last_n=window, seed=100 + case,
        )  # fmt: skip
        states = [sampling.SamplingState(params, 100 + case, [1, 2], 64, DEVICE) for _ in range(2)]
        for a in states:
            a.candidates = 16
            a.rank = torch.arange(16, device=DEVICE)
            a.keep.fill_(params.top_k if params.top_k else 16)
        for _ in range(5):
            vals = torch.sort(torch.randn(16, generator=gen) * 3, descending=True).values
            ids = torch.randperm(64, generator=gen)[:16]
            vals, ids = vals.to(DEVICE), ids.to(DEVICE)
            sampling._draw_torch(states[0], vals, ids)
            sk.draw(vals, ids, states[1], sampling._GOLDEN, sampling._MIX1, sampling._MIX2)
            for name in ("out", "draws", "recent", "at"):
                got, want = getattr(states[1], name), getattr(states[0], name)
                assert torch.equal(got.cpu(), want.cpu()), (case, name, got, want)
