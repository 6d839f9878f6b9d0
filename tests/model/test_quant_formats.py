"""The types added with the one-description formats (Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4, Q2_K, Q3_K,
IQ3_XXS, IQ3_S): adversarial blocks against gguf-py bit for bit (extreme scales, every exponent,
every grid index and sign pattern), their descriptions against gguf's table, and each decode
kernel on them against the reference (matvec; gate/up and down over an expert table, gate and
up of different types). The random blocks, the repacked layout and the prefill GEMM of every
type are in ``test_quant``, ``test_repack`` and ``test_prefill_kernels``, which run over every
supported type.

Compiled on a GPU; in Triton's interpreter on CPU tensors elsewhere (CI), one tiny shape per
kernel. The ``gpu`` tests add the shapes of Qwen3-30B-A3B's experts.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from quantdata import assert_bit_identical, gguf_reference, random_bytes

from strata.engine.quant import dequantize, legacy, repack
from strata.engine.quant.formats import FORMATS, SUPPORTED_TYPES
from strata.engine.quant.repack import align, repacked_layout

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed")
import triton
import triton.language as tl

from strata.engine.kernels import gemm, moe
from strata.engine.kernels.dot import steps
from strata.engine.kernels.matvec import Mat, matvec, matvec_reference
from strata.engine.quant import unit_kernels

Q = gguf.GGMLQuantizationType
QK_K = gguf.QK_K
NEW_TYPES = [Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.MXFP4, Q.Q2_K, Q.Q3_K, Q.IQ3_XXS, Q.IQ3_S]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = 1e-5
# f16 scales at the edges: the largest finite, the smallest subnormal and normal, both zeros, 1
EXTREME_F16 = np.array([65504.0, -65504.0, 2.0**-24, 2.0**-14, 0.0, -0.0, 1.0], dtype=np.float16)
IDS = [t.name for t in NEW_TYPES]


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261204)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    assert not got.isnan().any(), "an output element was not written"
    return float((got - want).norm() / want.norm())


def test_every_description_matches_ggufs_block_sizes() -> None:
    from strata.engine.quant.unit_kernels import HALVES_TYPES

    assert set(NEW_TYPES) <= SUPPORTED_TYPES
    assert HALVES_TYPES == set(NEW_TYPES)  # the types read through quant.unit_kernels
    for q, f in FORMATS.items():
        assert (f.block, f.type_size) == gguf.GGML_QUANT_SIZES[q], q.name


def adversarial_blocks(qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Blocks [N, type_size]: random bytes, the f16 scales cycling through EXTREME_F16 (MXFP4:
    every exponent 0..255), and for the grid types every grid index and every sign pattern."""
    f = FORMATS[qtype]
    n = 512 if qtype == Q.IQ3_S else 256
    blocks = rng.integers(0, 256, (n, f.type_size), dtype=np.uint8)
    for fl in f.fields:
        if fl.name in ("d", "m", "dm") and fl.nbytes == 2:
            scales = np.resize(EXTREME_F16, n)
            rng.shuffle(scales)
            blocks[:, fl.at : fl.end] = scales.view(np.uint8).reshape(n, 2)
    if qtype == Q.MXFP4:
        blocks[:, 0] = np.arange(n) % 256
    if qtype == Q.IQ3_XXS:  # grid index i in block i, sign pattern i % 128 everywhere
        qs = f.field("qs")
        blocks[:, qs.at : qs.end] = (np.arange(n) % 256)[:, None]
        ss = f.field("ss")
        words = (np.arange(n, dtype=np.uint32) % 128) * 0x204081 | (np.arange(n) % 16 << 28)
        blocks[:, ss.at : ss.end] = (
            np.repeat(words.astype(np.uint32), 8).view(np.uint8).reshape(n, 32)
        )
    if qtype == Q.IQ3_S:  # grid index i (its ninth bit in qh) in block i
        qs, qh = f.field("qs"), f.field("qh")
        blocks[:, qs.at : qs.end] = (np.arange(n) & 0xFF)[:, None]
        blocks[:, qh.at : qh.end] = np.where(np.arange(n) >= 256, 0xFF, 0)[:, None]
    return blocks.reshape(-1)


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=IDS)
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_adversarial_blocks_match_gguf_bit_for_bit(qtype: Q, rng: np.random.Generator) -> None:
    raw = adversarial_blocks(qtype, rng)
    block = FORMATS[qtype].block
    shape = (raw.size // FORMATS[qtype].type_size * block // QK_K, QK_K)
    got = dequantize(torch.from_numpy(raw), qtype, shape)
    want = gguf_reference(raw, qtype, shape)
    nan = np.isnan(want)
    assert (got.isnan().numpy() == nan).all()
    assert_bit_identical(got.masked_fill(got.isnan(), 0.0), np.where(nan, 0.0, want))
    # and the repacked layout gives the same values, NaNs and infinities included
    back = repack.dequantize_repacked(
        repack.repack(torch.from_numpy(raw), qtype, shape), qtype, shape
    )
    assert torch.equal(back.isnan(), got.isnan())
    assert torch.equal(
        back.nan_to_num(0.0).view(torch.int32), got.nan_to_num(0.0).view(torch.int32)
    )


@triton.jit
def _mxfp4_f16(byte, e, out):
    # every (byte, exponent) pair of one program's row: the GEMM's float16 weights of both nibbles
    i = tl.program_id(0)
    b = tl.load(byte + tl.arange(0, 256)).to(tl.int32)
    d, d2 = unit_kernels.mxfp4_scales(tl.load(e + i).to(tl.int32) + tl.zeros([256], tl.int32))
    lo = unit_kernels.mxfp4_value((b << 2) & 28, b << 28, d, d2)
    hi = unit_kernels.mxfp4_value((b >> 2) & 28, b << 24, d, d2)
    tl.store(out + i * 512 + tl.arange(0, 256), lo.to(tl.float16))
    tl.store(out + i * 512 + 256 + tl.arange(0, 256), hi.to(tl.float16))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_mxfp4_values_of_the_gemm_round_to_the_references_float16() -> None:
    # the prefill GEMM's MXFP4 form (no select, the sign set last) against the reference's
    # d * level for every index and every e8m0 exponent, after the rounding to float16 that the
    # GEMM applies: equal values (index 8's -0 equals the table's +0), infinities included
    e = torch.arange(256, dtype=torch.uint8)
    b = torch.arange(256, dtype=torch.uint8)
    out = torch.empty(256, 512, dtype=torch.float16, device=DEVICE)
    _mxfp4_f16[(256,)](b.to(DEVICE), e.to(DEVICE), out)
    levels = torch.tensor(legacy.MXFP4_LEVELS, dtype=torch.float32)
    d = legacy.e8m0_half(e)[:, None]
    want = torch.cat([d * levels[(b & 15).long()], d * levels[(b >> 4).long()]], 1).half()
    assert not want.isnan().any()
    assert torch.equal(out.cpu(), want)


@triton.jit
def _prmt_kernel(a, b, c, out, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out + i, unit_kernels.prmt(tl.load(a + i), tl.load(b + i), tl.load(c + i)))


def test_prmt_is_ptxs_byte_permute(rng) -> None:
    # PTX prmt.b32 (the inline instruction on a GPU, its shifts in the interpreter): byte i of
    # the result is byte (c >> 4i) & 7 of b:a; negative words and every selector value
    n = 4096
    a, b = (rng.integers(-(2**31), 2**31, n, dtype=np.int64).astype(np.int32) for _ in "ab")
    c = rng.integers(0, 2**16, n, dtype=np.int64).astype(np.int32) & 0x7777
    c[:4096:8] = [0x3210, 0x7654, 0x0000, 0x7777, 0x4567, 0x0123, 0x7440, 0x3004] * 64
    got = torch.empty(n, dtype=torch.int32, device=DEVICE)
    args = [torch.from_numpy(v).to(DEVICE) for v in (a, b, c)]
    _prmt_kernel[(1,)](*args, got, N=n)
    eight = a.astype(np.uint32).astype(np.uint64) | (b.astype(np.uint32).astype(np.uint64) << 32)
    want = np.zeros(n, dtype=np.uint64)
    for i in range(4):
        sel = ((c >> (4 * i)) & 7).astype(np.uint64)
        want |= ((eight >> (8 * sel)) & 0xFF) << np.uint64(8 * i)
    assert np.array_equal(got.cpu().numpy().view(np.uint32), want.astype(np.uint32))


@triton.jit
def _level_dot_kernel(q, x, out, MX: tl.constexpr):
    # 16 units of one row: unit u's byte k is q[16u + k]; x: 32 elements a unit
    u = tl.arange(0, 16)
    k = tl.arange(0, 16)
    qb = tl.load(q + (16 * u)[None, :, None] + k[None, None, :]).to(tl.int32)  # [1, 16, 16]
    xl = tl.load(x + (32 * u)[:, None] + k[None, :])
    xh = tl.load(x + (32 * u)[:, None] + 16 + k[None, :])
    tl.store(out + u[None, :], unit_kernels.level_dot(qb, xl, xh, MX))


@pytest.mark.parametrize("qtype", [Q.IQ4_NL, Q.MXFP4], ids=lambda t: t.name)
def test_level_dot_reads_every_byte_as_two_levels(qtype) -> None:
    # the byte-permute lookup against the level table (IQ4_NL's; MXFP4's doubled e2m1 values)
    # for all 256 bytes, both nibbles: one element of every unit at a time (x one there, zero
    # elsewhere), so a level read for the wrong element or nibble shows, exactly
    table = legacy.IQ4_NL_LEVELS if qtype == Q.IQ4_NL else legacy.MXFP4_LEVELS
    q = torch.arange(256, dtype=torch.uint8)
    lv = torch.tensor(table, dtype=torch.float32)
    qu = q.view(16, 16).long()
    out = torch.empty(1, 16, device=DEVICE)
    for e in range(32):
        x = torch.zeros(16, 32)
        x[:, e] = 1.0
        _level_dot_kernel[(1,)](q.to(DEVICE), x.view(-1).to(DEVICE), out, MX=qtype == Q.MXFP4)
        want = lv[qu[:, e] & 15] if e < 16 else lv[qu[:, e - 16] >> 4]
        assert torch.equal(out.cpu()[0], want), e


def mat(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> Mat:
    raw = torch.from_numpy(random_bytes(qtype, (rows, cols), rng))
    lay = repacked_layout(qtype, (rows, cols))
    return Mat(repack.repack(raw, qtype, (rows, cols)).to(DEVICE), lay)


@pytest.mark.parametrize(
    "types",
    [NEW_TYPES[0:3], NEW_TYPES[3:6], NEW_TYPES[6:9]],
    ids=lambda ts: "+".join(t.name for t in ts),
)
def test_matvec_matches_dequantise_then_multiply(types, rng) -> None:
    K = 256
    mats = [mat(t, n, K, rng) for t, n in zip(types, [9, 4, 3], strict=True)]  # ragged rows
    x = torch.randn(K, device=DEVICE)
    norm = torch.rand(K, device=DEVICE) + 0.5
    y = torch.full((sum(m.rows for m in mats),), float("nan"), device=DEVICE)
    matvec(y, x, mats, norm=norm, eps=1e-6)
    assert rel_err(y, matvec_reference(x, mats, norm, 1e-6)) < TOL


class Experts:
    """E experts, gate, up and down each of its own type, in slots of one buffer (the kernel
    layout); the table gives each slot's offset from the anchor."""

    def __init__(self, E: int, D: int, F: int, types: tuple[Q, Q, Q], rng) -> None:
        tg, tu, td = types
        self.gate, self.up = repacked_layout(tg, (F, D)), repacked_layout(tu, (F, D))
        self.down = repacked_layout(td, (D, F))
        self.up_off = align(self.gate.nbytes)
        self.down_off = self.up_off + align(self.up.nbytes)
        slot = align(self.down_off + self.down.nbytes)
        self.arena = torch.zeros(E * slot, dtype=torch.uint8, device=DEVICE)
        self.dense = []
        for e in range(E):
            dense = []
            for off, lay in ((0, self.gate), (self.up_off, self.up), (self.down_off, self.down)):
                shape = (lay.rows, lay.cols)
                raw = torch.from_numpy(random_bytes(lay.qtype, shape, rng))
                packed = repack.repack(raw, lay.qtype, shape)
                self.arena[e * slot + off : e * slot + off + lay.nbytes] = packed.to(DEVICE)
                dense.append(repack.dequantize_repacked(packed, lay.qtype, shape))
            self.dense.append(dense)
        self.table = torch.arange(E, dtype=torch.int64, device=DEVICE) * slot


def run_experts(ex: Experts, chosen: list[int], D: int, F: int) -> None:
    k = len(chosen)
    ids = torch.tensor(chosen, device=DEVICE)
    wts = torch.rand(k, device=DEVICE)
    h = torch.randn(D, device=DEVICE)
    act = torch.full((k, F), float("nan"), device=DEVICE)
    eoffs = ex.table[ids]
    moe.gate_up(act, h, eoffs, ex.arena, ex.gate, ex.up, ex.up_off)
    hc, ys = h.cpu(), []
    for i, e in enumerate(chosen):
        g, u, dn = ex.dense[e]
        a = torch.nn.functional.silu(g @ hc) * (u @ hc)
        assert rel_err(act[i], a) < TOL
        ys.append((dn @ a) * float(wts[i]))
    want = torch.stack(ys).sum(0)
    x0 = torch.randn(D, device=DEVICE) * float(want.abs().max())
    for flat in (False, True):  # the quants as 3-D or as flat tiles (``unit_bytes``)
        x = x0.clone()
        moe.down(x, act, eoffs, wts, ex.arena, ex.down, ex.down_off, flat=flat)
        assert rel_err(x - x0, want) < TOL, f"flat={flat}"


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # SiLU of -big
@pytest.mark.parametrize(
    "types",
    [
        (Q.Q4_1, Q.Q5_0, Q.Q5_1),
        (Q.IQ4_NL, Q.IQ4_NL, Q.MXFP4),
        (Q.Q2_K, Q.Q3_K, Q.Q3_K),
        (Q.IQ3_XXS, Q.IQ3_S, Q.IQ3_S),
        (Q.IQ3_S, Q.IQ3_S, Q.Q2_K),  # one pass over the input for gate and up of one type
    ],
    ids=lambda ts: "+".join(t.name for t in ts),
)
def test_gate_up_and_down_match_the_reference_expert_sum(types, rng) -> None:
    D, F = 256, 256
    run_experts(Experts(3, D, F, types, rng), [2, 0], D, F)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", NEW_TYPES, ids=IDS)
def test_kernels_on_the_30b_models_expert_shapes(qtype, rng) -> None:
    if DEVICE.type != "cuda":
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    D, F = 2048, 768
    m = mat(qtype, 4096, D, rng)  # attention q's shape
    x = torch.randn(D, device=DEVICE)
    y = torch.full((4096,), float("nan"), device=DEVICE)
    matvec(y, x, [m])
    assert rel_err(y, matvec_reference(x, [m])) < TOL
    run_experts(Experts(16, D, F, (qtype, qtype, qtype), rng), [15, 3, 1, 0, 9, 7, 2, 11], D, F)


def test_rows_that_no_step_divides_end_in_a_narrower_step(rng) -> None:
    # gpt-oss's 2880 columns: 90 units of 32 in a step of 64 and one of 32 (not one of 128 with
    # 38 idle threads), Q8_0's too (a unit a block), F16's 360 of 8 in 256 + 128
    assert steps(Q.MXFP4, 2880) == (64, 32) and steps(Q.Q8_0, 2880) == (64, 32)
    assert steps(Q.F16, 2880) == (256, 128) and steps(Q.Q4_K, 2048) == (64, 0)
    assert steps(Q.Q4_K, 768) == (32, 0)  # under 64 units: one step, one warp, as before
    K = 2880
    mats = [mat(t, n, K, rng) for t, n in zip((Q.MXFP4, Q.Q8_0, Q.F16), [5, 3, 2], strict=True)]
    x = torch.randn(K, device=DEVICE)
    y = torch.full((10,), float("nan"), device=DEVICE)
    matvec(y, x, mats)
    assert rel_err(y, matvec_reference(x, mats)) < TOL
    # gate/up over 2880 columns, then down over 2880 (the experts' rows short, to stay small)
    run_experts(Experts(3, K, 32, (Q.MXFP4, Q.MXFP4, Q.Q8_0), rng), [2, 0], K, 32)
    run_experts(Experts(3, 64, K, (Q.Q8_0, Q.Q8_0, Q.MXFP4), rng), [1, 2], 64, K)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize(
    "types",
    [(Q.Q4_1, Q.Q5_1, Q.Q5_0), (Q.IQ4_NL, Q.MXFP4, Q.Q2_K), (Q.Q3_K, Q.IQ3_XXS, Q.IQ3_S)],
    ids=lambda ts: "+".join(t.name for t in ts),
)
def test_grouped_prefill_products_with_gate_and_up_of_different_types(types, rng) -> None:
    T, k, E, D, F = 6, 2, 3, 256, 256
    ex = Experts(E, D, F, types, rng)
    ids = torch.tensor([[t % E, (t + 1) % E] for t in range(T)])
    wts = torch.rand(T, k)
    h = (torch.randn(T, D, device=DEVICE) * 0.25).half()
    tile = gemm.MOE_TILE
    g = gemm.group_by_expert(ids.to(DEVICE), E, tile.bm)
    act = torch.full((g.rows.numel(), F), float("nan"), dtype=torch.float16, device=DEVICE)
    y = torch.full((T * k, D), float("nan"), device=DEVICE)
    gemm.moe_gate_up(act, h, g, ex.table, ex.arena, ex.gate, ex.up, ex.up_off, tile)
    flat_w = wts.reshape(-1).to(DEVICE)
    gemm.moe_down(y, act, g, flat_w, ex.table, ex.arena, ex.down, ex.down_off, tile)
    want = torch.empty(T * k, D)
    for a, e in enumerate(ids.reshape(-1).tolist()):
        gw, uw, dn = ex.dense[e]
        x = h[a // k].float().cpu()
        act_ref = torch.nn.functional.silu(gw @ x) * (uw @ x)
        want[a] = (dn @ act_ref.half().float()) * float(flat_w[a])
    assert rel_err(y, want) < 2e-3  # float16 products on tensor cores (test_prefill_kernels)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q5_0, Q.IQ4_NL, Q.MXFP4], ids=lambda t: t.name)
def test_rows_that_are_not_a_multiple_of_256_as_llama_cpps_fallbacks_write_them(qtype, rng):
    # gpt-oss's 2880 is 90 blocks of 32; here 3 blocks: a step of 4 units is masked
    K = 96
    m = mat(qtype, 5, K, rng)
    x = torch.randn(K, device=DEVICE)
    y = torch.full((5,), float("nan"), device=DEVICE)
    matvec(y, x, [m])
    assert rel_err(y, matvec_reference(x, [m])) < TOL
    h = (torch.randn(3, K, device=DEVICE) * 0.25).half()
    out = torch.full((3, 5), float("nan"), device=DEVICE)
    gemm.gemm(out, h, m.data, m.lay)
    assert rel_err(out, gemm.gemm_reference(h, m.data, m.lay)) < 2e-3


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("qtype", NEW_TYPES, ids=IDS)
def test_grouped_prefill_on_the_30b_models_expert_shapes(qtype, rng) -> None:
    if DEVICE.type != "cuda":
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    T, k, E, D, F = 64, 8, 16, 2048, 768
    ex = Experts(E, D, F, (qtype, qtype, qtype), rng)
    gen = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=gen)
    h = (torch.randn(T, D, device=DEVICE) * 0.25).half()
    tile = gemm.MOE_TILE
    g = gemm.group_by_expert(ids.to(DEVICE), E, tile.bm)
    act = torch.full((g.rows.numel(), F), float("nan"), dtype=torch.float16, device=DEVICE)
    y = torch.full((T * k, D), float("nan"), device=DEVICE)
    gemm.moe_gate_up(act, h, g, ex.table, ex.arena, ex.gate, ex.up, ex.up_off, tile)
    flat_w = wts.reshape(-1).to(DEVICE)
    gemm.moe_down(y, act, g, flat_w, ex.table, ex.arena, ex.down, ex.down_off, tile)
    want = torch.empty(T * k, D)
    for a, e in enumerate(ids.reshape(-1).tolist()):
        gw, uw, dn = ex.dense[e]
        x = h[a // k].float().cpu()
        act_ref = torch.nn.functional.silu(gw @ x) * (uw @ x)
        want[a] = (dn @ act_ref.half().float()) * float(flat_w[a])
    assert rel_err(y, want) < 2e-3
