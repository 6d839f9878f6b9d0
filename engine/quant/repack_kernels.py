"""Triton twins of ``repack.py``: repack raw GGUF blocks into the kernel layout (one launch per
matrix) and dequantise a repacked matrix, or some of its rows, to float32.

The repack kernels are byte moves plus the K-quant scale and Q5_K fifth-bit unpacking (and, for
IQ4_XS, the matrix's table of levels, written by the first program); the dequantisers do the
reference's products in its order with ``enable_fp_fusion=False``, so both are bit-identical to
the torch twins (the tests check it, in Triton's interpreter on CI and compiled on a GPU). Plane
offsets come from ``repack.repacked_layout``; bytes per block of each plane from ``repack.PLANES``.

Import through ``strata.engine.kernels`` (which falls back when Triton is missing); with
``TRITON_INTERPRET=1`` set before the import the kernels run on CPU tensors.
"""

from __future__ import annotations

import contextlib

import gguf
import torch
import triton
import triton.language as tl

from strata.engine.quant import kquants, legacy, unit_kernels
from strata.engine.quant.repack import (
    FLOAT_TYPES,
    GATHERED_TYPES,
    RepackedLayout,
    gather_into,
    repacked_layout,
)

Q = gguf.GGMLQuantizationType

# The block sizes and field offsets the kernels below read, from the types' descriptions.
Q4K_TS: tl.constexpr = tl.constexpr(kquants.Q4_K.type_size)
Q5K_TS: tl.constexpr = tl.constexpr(kquants.Q5_K.type_size)
Q6K_TS: tl.constexpr = tl.constexpr(kquants.Q6_K.type_size)
IQ4XS_TS: tl.constexpr = tl.constexpr(kquants.IQ4_XS.type_size)
Q8_0_TS: tl.constexpr = tl.constexpr(legacy.Q8_0.type_size)
Q4_0_TS: tl.constexpr = tl.constexpr(legacy.Q4_0.type_size)
K4_SCALES: tl.constexpr = tl.constexpr(kquants.Q4_K.field("scales").at)
Q4K_QS: tl.constexpr = tl.constexpr(kquants.Q4_K.field("qs").at)
Q5K_QS: tl.constexpr = tl.constexpr(kquants.Q5_K.field("qs").at)
Q5K_QH: tl.constexpr = tl.constexpr(kquants.Q5_K.field("qh").at)
Q6K_QH: tl.constexpr = tl.constexpr(kquants.Q6_K.field("qh").at)
Q6K_SC: tl.constexpr = tl.constexpr(kquants.Q6_K.field("sc").at)
Q6K_D: tl.constexpr = tl.constexpr(kquants.Q6_K.field("d").at)
IQ4XS_SH: tl.constexpr = tl.constexpr(kquants.IQ4_XS.field("sh").at)
IQ4XS_SL: tl.constexpr = tl.constexpr(kquants.IQ4_XS.field("sl").at)
IQ4XS_QS: tl.constexpr = tl.constexpr(kquants.IQ4_XS.field("qs").at)


@triton.jit
def _blocks(n_blocks, BPP: tl.constexpr):
    blk = (tl.program_id(0) * BPP + tl.arange(0, BPP))[:, None].to(tl.int64)
    return blk, blk < n_blocks


@triton.jit
def _copy(src, dst, blk, ok, at: tl.constexpr, n: tl.constexpr, NP: tl.constexpr, ts):
    """Bytes [at, at + n) of each block (``ts`` bytes) to row ``blk`` of a plane of n-byte rows."""
    j = tl.arange(0, NP)[None, :]
    m = ok & (j < n)
    tl.store(dst + blk * n + j, tl.load(src + blk * ts + at + j, mask=m, other=0), mask=m)


@triton.jit
def _k4_nibbles(base, dst, blk, ok, at: tl.constexpr):
    """Q4_K / Q5_K low 4 bits (the file's 128 bytes from ``at``) -> the unit-ordered plane.
    Byte 16 s + k <- element 32 s + k (low nibble) and 32 s + 16 + k (high): both of the
    file's byte (s // 2) * 32 + (0 or 16) + k, nibble s % 2."""
    t = tl.arange(0, 128)[None, :]
    s = t // 16
    k = t % 16
    p = base + at + (s // 2) * 32 + k
    sh = (s % 2) * 4
    lo = (tl.load(p, mask=ok, other=0).to(tl.int32) >> sh) & 0x0F
    hi = (tl.load(p + 16, mask=ok, other=0).to(tl.int32) >> sh) & 0x0F
    tl.store(dst + blk * 128 + t, (lo | (hi << 4)).to(tl.uint8), mask=ok)


@triton.jit
def _k4_scales(base, dst_sc, dst_mn, blk, ok):
    """The 12 packed bytes at base + 4 -> 8 scales and 8 mins (see reference._scale_min_k4)."""
    j = tl.arange(0, 8)[None, :]
    p = base + K4_SCALES
    low = j < 4
    a = tl.load(p + tl.where(low, j, j + 4), mask=ok, other=0).to(tl.int32)
    b = tl.load(p + tl.where(low, j + 4, j - 4), mask=ok, other=0).to(tl.int32)
    c = tl.load(p + j, mask=ok, other=0).to(tl.int32)
    scale = tl.where(low, a & 63, (a & 0x0F) | ((b >> 6) << 4))
    mins = tl.where(low, b & 63, (a >> 4) | ((c >> 6) << 4))
    tl.store(dst_sc + blk * 8 + j, scale.to(tl.uint8), mask=ok)
    tl.store(dst_mn + blk * 8 + j, mins.to(tl.uint8), mask=ok)


@triton.jit
def _repack_q4_k(src, dst, n_blocks, o_sc, o_mn, o_d, o_dm, BPP: tl.constexpr):
    blk, ok = _blocks(n_blocks, BPP)
    base = src + blk * Q4K_TS
    _copy(src, dst + o_d, blk, ok, 0, 2, 2, Q4K_TS)
    _copy(src, dst + o_dm, blk, ok, 2, 2, 2, Q4K_TS)
    _k4_nibbles(base, dst, blk, ok, Q4K_QS)
    _k4_scales(base, dst + o_sc, dst + o_mn, blk, ok)


@triton.jit
def _repack_q5_k(src, dst, n_blocks, o_qh, o_sc, o_mn, o_dd, BPP: tl.constexpr):
    blk, ok = _blocks(n_blocks, BPP)
    base = src + blk * Q5K_TS
    _copy(src, dst + o_dd, blk, ok, 0, 4, 4, Q5K_TS)
    _k4_nibbles(base, dst, blk, ok, Q5K_QS)
    _k4_scales(base, dst + o_sc, dst + o_mn, blk, ok)
    # qh byte 4 s + b, bit i <- the fifth bit of element 32 s + 8 b + i: bit s of the file's
    # qh byte 8 b + i (at 16)
    t = tl.arange(0, 32)[None, :]
    s = t // 4
    at = base + Q5K_QH + (t % 4) * 8
    qh = tl.zeros([BPP, 32], tl.int32)
    for i in tl.static_range(8):
        qh = qh | (((tl.load(at + i, mask=ok, other=0).to(tl.int32) >> s) & 1) << i)
    tl.store(dst + o_qh + blk * 32 + t, qh.to(tl.uint8), mask=ok)


@triton.jit
def _q6_low(base, e, ok):
    """Low 4 bits of element e of each raw Q6_K block: nibble (e % 128) // 64 of
    ql[64 (e // 128) + e % 64]."""
    r = e % 128
    v = tl.load(base + 64 * (e // 128) + r % 64, mask=ok, other=0).to(tl.int32)
    return (v >> ((r // 64) * 4)) & 0x0F


@triton.jit
def _q6_high(base, e, ok):
    """High 2 bits of element e: bits 2 ((e % 128) // 32) of qh[32 (e // 128) + e % 32]."""
    r = e % 128
    v = tl.load(base + Q6K_QH + 32 * (e // 128) + r % 32, mask=ok, other=0).to(tl.int32)
    return (v >> ((r // 32) * 2)) & 0x03


@triton.jit
def _repack_q6_k(src, dst, n_blocks, o_qh, o_sc, o_d, BPP: tl.constexpr):
    blk, ok = _blocks(n_blocks, BPP)
    base = src + blk * Q6K_TS
    _copy(src, dst + o_d, blk, ok, Q6K_D, 2, 2, Q6K_TS)
    t = tl.arange(0, 128)[None, :]  # ql byte 16 g + m: elements 32 g + m and 32 g + 16 + m
    e = (t // 16) * 32 + t % 16
    ql = _q6_low(base, e, ok) | (_q6_low(base, e + 16, ok) << 4)
    tl.store(dst + blk * 128 + t, ql.to(tl.uint8), mask=ok)
    u = tl.arange(0, 64)[None, :]  # qh byte 16 g + m: bits 2t of element 64 g + 16 t + m
    e = (u // 16) * 64 + u % 16
    qh = _q6_high(base, e, ok)
    qh = qh | (_q6_high(base, e + 16, ok) << 2)
    qh = qh | (_q6_high(base, e + 32, ok) << 4)
    qh = qh | (_q6_high(base, e + 48, ok) << 6)
    tl.store(dst + o_qh + blk * 64 + u, qh.to(tl.uint8), mask=ok)
    v = tl.arange(0, 16)[None, :]  # scales: groups 0, 2, .., 14, then 1, 3, .., 15
    sc = tl.load(base + Q6K_SC + 2 * (v % 8) + v // 8, mask=ok, other=0)
    tl.store(dst + o_sc + blk * 16 + v, sc, mask=ok)


@triton.jit
def _repack_q8_0(src, dst, n_blocks, o_d, BPP: tl.constexpr):
    blk, ok = _blocks(n_blocks, BPP)
    _copy(src, dst, blk, ok, 2, 32, 32, Q8_0_TS)
    _copy(src, dst + o_d, blk, ok, 0, 2, 2, Q8_0_TS)


@triton.jit
def _repack_q4_0(src, dst, n_blocks, o_d, BPP: tl.constexpr):
    blk, ok = _blocks(n_blocks, BPP)
    _copy(src, dst, blk, ok, 2, 16, 16, Q4_0_TS)
    _copy(src, dst + o_d, blk, ok, 0, 2, 2, Q4_0_TS)


@triton.jit
def _repack_iq4_xs(src, dst, n_blocks, o_sc, o_d, o_lv, BPP: tl.constexpr):
    blk, ok = _blocks(n_blocks, BPP)
    base = src + blk * IQ4XS_TS
    _copy(src, dst, blk, ok, IQ4XS_QS, 128, 128, IQ4XS_TS)
    _copy(src, dst + o_d, blk, ok, 0, 2, 2, IQ4XS_TS)
    # scale j: nibble j % 2 of scales_l[j // 2] (at 4), bits 2j of scales_h (at 2), minus 32
    j = tl.arange(0, 8)[None, :]
    lo = (tl.load(base + IQ4XS_SL + j // 2, mask=ok, other=0).to(tl.int32) >> ((j % 2) * 4)) & 0x0F
    hi = (tl.load(base + IQ4XS_SH + j // 4, mask=ok, other=0).to(tl.int32) >> ((j % 4) * 2)) & 0x03
    sc = ((lo | (hi << 4)) - 32) & 0xFF  # the int8's bits
    tl.store(dst + o_sc + blk * 8 + j, sc.to(tl.uint8), mask=ok)
    if tl.program_id(0) == 0:  # the matrix's one table of levels: 16 float32, little-endian
        b = tl.arange(0, 64)
        bits = unit_kernels.nl_level(b // 4).to(tl.int32, bitcast=True)
        tl.store(dst + o_lv + b, ((bits >> ((b % 4) * 8)) & 0xFF).to(tl.uint8))


# (kernel, blocks per program, whether it writes the table of IQ4_NL levels)
_REPACK = {
    Q.Q4_K: (_repack_q4_k, 8, False),
    Q.Q5_K: (_repack_q5_k, 8, False),
    Q.Q6_K: (_repack_q6_k, 8, False),
    Q.IQ4_XS: (_repack_iq4_xs, 8, True),
    Q.Q8_0: (_repack_q8_0, 32, False),
    Q.Q4_0: (_repack_q4_0, 32, False),
}
# Every type has a kernel layout; those without a repack kernel of their own are gathered
# (a strided copy per plane), and dequantised by ``unit_kernels``' decoders.
KERNEL_TYPES: frozenset[Q] = frozenset(_REPACK) | FLOAT_TYPES | GATHERED_TYPES


def _device(t: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def repack_into(dst: torch.Tensor, raw: torch.Tensor, lay: RepackedLayout) -> None:
    """Write the kernel layout of ``raw`` (a matrix's GGUF bytes, already checked against
    ``lay``) into ``dst`` ([>= lay.nbytes] uint8, same device), in one launch."""
    if lay.qtype in FLOAT_TYPES:
        dst[: raw.numel()].copy_(raw)
        return
    if lay.qtype not in _REPACK:
        gather_into(dst, raw, lay)
        return
    kernel, bpp, table = _REPACK[lay.qtype]
    n_blocks = lay.rows * lay.blocks_per_row
    if n_blocks == 0 and not table:
        return
    grid = (max(1, triton.cdiv(n_blocks, bpp)),)  # a table is written even for no rows
    with _device(raw):
        kernel[grid](raw, dst, n_blocks, *lay.offsets[1:], BPP=bpp)


def repack(raw: torch.Tensor, qtype: Q, shape: tuple[int, ...]) -> torch.Tensor:
    lay = repacked_layout(qtype, shape)
    out = torch.zeros(lay.nbytes, dtype=torch.uint8, device=raw.device)
    repack_into(out, raw.contiguous(), lay)
    return out


# ---------------------------------------------------------------------------------------------
# Dequantisers: program (r, c) writes output row r, elements [c * CB, (c + 1) * CB); the source
# row is ``rows[r]`` when HAS_IDS (an embedding lookup), else ``row0 + r``.


@triton.jit
def _elems(rows, row0, K, CB: tl.constexpr, HAS_IDS: tl.constexpr):
    r = tl.program_id(0)
    e = tl.program_id(1) * CB + tl.arange(0, CB)
    if HAS_IDS:
        src_row = tl.load(rows + r).to(tl.int64)
    else:
        src_row = (row0 + r).to(tl.int64)
    return r.to(tl.int64), src_row, e, e < K


@triton.jit
def _dq_q4_k(w, out, rows, row0, K, o_sc, o_mn, o_d, o_dm, CB: tl.constexpr, HAS_IDS: tl.constexpr):
    r, sr, e, ok = _elems(rows, row0, K, CB, HAS_IDS)
    nb = K // 256
    b = e // 256
    j = (e % 256) // 32  # sub-block
    k = e % 32
    byte = tl.load(w + sr * nb * 128 + b * 128 + 16 * j + k % 16, mask=ok, other=0).to(tl.int32)
    q = ((byte >> ((k // 16) * 4)) & 0x0F).to(tl.float32)
    sc = tl.load(w + o_sc + sr * nb * 8 + b * 8 + j, mask=ok, other=0).to(tl.float32)
    mn = tl.load(w + o_mn + sr * nb * 8 + b * 8 + j, mask=ok, other=0).to(tl.float32)
    dp = (w + o_d + sr * nb * 2 + b * 2).to(tl.pointer_type(tl.float16))
    mp = (w + o_dm + sr * nb * 2 + b * 2).to(tl.pointer_type(tl.float16))
    d = tl.load(dp, mask=ok, other=0).to(tl.float32)
    dm = tl.load(mp, mask=ok, other=0).to(tl.float32)
    tl.store(out + r * K + e, q * (d * sc) - dm * mn, mask=ok)


@triton.jit
def _dq_q5_k(w, out, rows, row0, K, o_qh, o_sc, o_mn, o_dd, CB: tl.constexpr,
             HAS_IDS: tl.constexpr):  # fmt: skip
    r, sr, e, ok = _elems(rows, row0, K, CB, HAS_IDS)
    nb = K // 256
    b = e // 256
    j = (e % 256) // 32  # sub-block
    k = e % 32
    byte = tl.load(w + sr * nb * 128 + b * 128 + 16 * j + k % 16, mask=ok, other=0).to(tl.int32)
    high = tl.load(w + o_qh + sr * nb * 32 + b * 32 + 4 * j + k // 8, mask=ok, other=0)
    high = (high.to(tl.int32) >> (k % 8)) & 1
    q = (((byte >> ((k // 16) * 4)) & 0x0F) | (high << 4)).to(tl.float32)
    sc = tl.load(w + o_sc + sr * nb * 8 + b * 8 + j, mask=ok, other=0).to(tl.float32)
    mn = tl.load(w + o_mn + sr * nb * 8 + b * 8 + j, mask=ok, other=0).to(tl.float32)
    dp = (w + o_dd + sr * nb * 4 + b * 4).to(tl.pointer_type(tl.float16))
    d = tl.load(dp, mask=ok, other=0).to(tl.float32)
    dm = tl.load(dp + 1, mask=ok, other=0).to(tl.float32)
    tl.store(out + r * K + e, q * (d * sc) - dm * mn, mask=ok)


@triton.jit
def _dq_iq4_xs(w, out, rows, row0, K, o_sc, o_d, o_lv, CB: tl.constexpr,
               HAS_IDS: tl.constexpr):  # fmt: skip
    r, sr, e, ok = _elems(rows, row0, K, CB, HAS_IDS)
    nb = K // 256
    b = e // 256
    j = (e % 256) // 32  # sub-block
    k = e % 32
    byte = tl.load(w + sr * nb * 128 + b * 128 + 16 * j + k % 16, mask=ok, other=0).to(tl.int32)
    idx = (byte >> ((k // 16) * 4)) & 0x0F
    level = tl.load((w + o_lv).to(tl.pointer_type(tl.float32)) + idx, mask=ok, other=0)
    sc = tl.load(w + o_sc + sr * nb * 8 + b * 8 + j, mask=ok, other=0)
    sc = sc.to(tl.int8, bitcast=True).to(tl.float32)
    dp = (w + o_d + sr * nb * 2 + b * 2).to(tl.pointer_type(tl.float16))
    d = tl.load(dp, mask=ok, other=0).to(tl.float32)
    tl.store(out + r * K + e, (d * sc) * level, mask=ok)


@triton.jit
def _dq_q4_0(w, out, rows, row0, K, o_d, CB: tl.constexpr, HAS_IDS: tl.constexpr):
    r, sr, e, ok = _elems(rows, row0, K, CB, HAS_IDS)
    nb = K // 32
    b = e // 32
    k = e % 32
    byte = tl.load(w + sr * nb * 16 + b * 16 + k % 16, mask=ok, other=0).to(tl.int32)
    q = (((byte >> ((k // 16) * 4)) & 0x0F) - 8).to(tl.float32)
    dp = (w + o_d + sr * nb * 2 + b * 2).to(tl.pointer_type(tl.float16))
    d = tl.load(dp, mask=ok, other=0).to(tl.float32)
    tl.store(out + r * K + e, d * q, mask=ok)


@triton.jit
def _dq_q6_k(w, out, rows, row0, K, o_qh, o_sc, o_d, CB: tl.constexpr, HAS_IDS: tl.constexpr):
    r, sr, e, ok = _elems(rows, row0, K, CB, HAS_IDS)
    nb = K // 256
    b = e // 256
    i = e % 256
    m = i % 16
    low = tl.load(w + sr * nb * 128 + b * 128 + 16 * (i // 32) + m, mask=ok, other=0)
    low = (low.to(tl.int32) >> (((i % 32) // 16) * 4)) & 0x0F
    high = tl.load(w + o_qh + sr * nb * 64 + b * 64 + 16 * (i // 64) + m, mask=ok, other=0)
    high = (high.to(tl.int32) >> (((i % 64) // 16) * 2)) & 0x03
    q = ((low | (high << 4)) - 32).to(tl.float32)
    g = i // 16  # scale group: stored at g // 2 (even g) or 8 + g // 2 (odd g)
    sc = tl.load(w + o_sc + sr * nb * 16 + b * 16 + g // 2 + 8 * (g % 2), mask=ok, other=0)
    sc = sc.to(tl.int8, bitcast=True).to(tl.float32)
    dp = (w + o_d + sr * nb * 2 + b * 2).to(tl.pointer_type(tl.float16))
    d = tl.load(dp, mask=ok, other=0).to(tl.float32)
    tl.store(out + r * K + e, (d * sc) * q, mask=ok)


@triton.jit
def _dq_q8_0(w, out, rows, row0, K, o_d, CB: tl.constexpr, HAS_IDS: tl.constexpr):
    r, sr, e, ok = _elems(rows, row0, K, CB, HAS_IDS)
    nb = K // 32
    q = tl.load(w + sr * K + e, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    dp = (w + o_d + sr * nb * 2 + (e // 32) * 2).to(tl.pointer_type(tl.float16))
    d = tl.load(dp, mask=ok, other=0).to(tl.float32)
    tl.store(out + r * K + e, q * d, mask=ok)


@triton.jit
def _dq_float(w, out, rows, row0, K, CB: tl.constexpr, HAS_IDS: tl.constexpr, QT: tl.constexpr):
    r, sr, e, ok = _elems(rows, row0, K, CB, HAS_IDS)
    if QT == 0:  # F32
        v = tl.load(w.to(tl.pointer_type(tl.float32)) + sr * K + e, mask=ok, other=0)
    elif QT == 1:  # F16
        v = tl.load(w.to(tl.pointer_type(tl.float16)) + sr * K + e, mask=ok, other=0)
        v = v.to(tl.float32)
    else:  # BF16: the top half of an f32
        v = tl.load(w.to(tl.pointer_type(tl.uint16)) + sr * K + e, mask=ok, other=0)
        v = (v.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    tl.store(out + r * K + e, v, mask=ok)


_DEQUANT = {
    Q.Q4_K: _dq_q4_k,
    Q.Q5_K: _dq_q5_k,
    Q.Q6_K: _dq_q6_k,
    Q.IQ4_XS: _dq_iq4_xs,
    Q.Q8_0: _dq_q8_0,
    Q.Q4_0: _dq_q4_0,
}
_CB = 1024  # elements per program
assert int(Q.F32) == 0 and int(Q.F16) == 1  # _dq_float's QT tests


def dequantize(
    data: torch.Tensor,
    lay: RepackedLayout,
    row0: int = 0,
    n_rows: int | None = None,
    ids: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ``[row0, row0 + n_rows)`` of the repacked matrix ``data`` (or the rows ``ids``,
    int32/int64 on the same device) as float32 [n, cols], in one launch; into ``out`` (float32,
    contiguous, n * cols values) when given."""
    n = len(ids) if ids is not None else (lay.rows - row0 if n_rows is None else n_rows)
    if ids is None and not (0 <= row0 and 0 <= n and row0 + n <= lay.rows):
        raise ValueError(f"rows [{row0}, {row0 + n}) are outside the {lay.rows} rows")
    if out is None:
        out = torch.empty(n, lay.cols, dtype=torch.float32, device=data.device)
    elif out.dtype != torch.float32 or out.numel() != n * lay.cols or not out.is_contiguous():
        raise ValueError(f"out must be {n * lay.cols} contiguous float32 values")
    if n == 0 or lay.cols == 0:
        return out
    grid = (n, triton.cdiv(lay.cols, _CB))
    rows = ids if ids is not None else data  # unused pointer when HAS_IDS is false
    args = (data, out, rows, row0, lay.cols)
    flags = {"CB": _CB, "HAS_IDS": ids is not None, "enable_fp_fusion": False}
    with _device(data):
        if lay.qtype in FLOAT_TYPES:
            _dq_float[grid](*args, QT=int(lay.qtype), **flags)
        elif lay.qtype in unit_kernels.HALVES_TYPES:
            unit_kernels.dequantize_launch(data, out, rows, row0, n, lay, ids is not None)
        else:
            _DEQUANT[lay.qtype][grid](*args, *lay.offsets[1:], **flags)
    return out
