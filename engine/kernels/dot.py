"""The inner loop every decode kernel shares: dot products of some rows of a repacked matrix with
one float32 vector, dequantising in registers.

``dot_rows`` reads BN rows of a matrix in the kernel layout of ``strata.engine.quant.repack``
(its planes at byte offsets o1..o4 after ``w``, as ``repacked_layout`` gives them) and returns
their products with the input, [BN] float32. The input is ``x`` itself, or ``x`` transformed on
the way in (``XIN``: an RMSNorm, an output gate or a SwiGLU, ``xin``), so a kernel need not
wait for another launch to write the vector first.
``dot_rows2`` does two matrices of one type against the same input (an expert's gate and up) in
one pass, loading each input tile once.

How it stays near the memory bandwidth. A step's tile is [BN rows, T units, 16 bytes]: the
threads of a program run along the row (one 32-element unit each, T up to 256, so a whole row of
the model's matrices in one step; a row that one step would leave many threads idle in, as
gpt-oss's 90 units in 128, runs as a step of 64 and one of 32: ``steps``), reading 16
contiguous bytes each, and every thread holds all BN rows of its unit, so each input value it
loads serves BN rows. K is a compile-time constant and the steps are unrolled; each thread
reduces its own unit in registers and the rows are summed across threads once, at the end.
The K-quants use the factored form (per sub-block: scale times the integer dot minus min times
the input's sum), and integers become floats by an OR and an exact subtraction
(``unit_kernels.u_float``) where the compiler would otherwise convert a narrow integer, an
instruction at an eighth of the issue rate.
Every type with units of 32 elements (all but Q8_0 and the floats) shares ``k_tile``'s
structure; IQ4_XS picks its levels out of packed words (``unit_kernels.nl_level``, no load).
Q4_K, Q5_K, Q6_K, IQ4_XS and Q4_0 have inner loops of their own; the gathered types (Q4_1,
Q5_0, Q5_1, IQ4_NL, MXFP4, Q2_K, Q3_K) theirs in ``quant.unit_kernels.unit_dot`` (factored
where the type allows). The grid types (IQ3_XXS, IQ3_S) are ``grid_tile``'s: a unit's grid
rows are words read from the matrix's own table, and its tiles are [units, rows], the input
a column at a time (compiled for sm_90, Qwen3-30B-A3B's gate/up, down and attention q take
94, 48 and 56 registers a thread under Triton 3.6 as IQ3_S, where per-element gathers in
[rows, units, 16] tiles took 255 with a 200-byte stack, 234 and 184).
That is the same function as "dequantise, then multiply" up to float rounding; the callers'
tests bound the difference.
"""

from __future__ import annotations

import os

import gguf
import triton
import triton.language as tl

from strata.engine.quant.format import Q8 as Q8_KIND
from strata.engine.quant.format import UNIT32
from strata.engine.quant.formats import FORMATS
from strata.engine.quant.unit_kernels import (
    IQ3_S,
    IQ3_XXS,
    IQ3S_HS,
    IQ3S_QS,
    IQ3S_SC,
    IQ3S_SG,
    IQ3XXS_SS,
    IQ4_NL,
    K2_QS,
    K_UNITS,
    MXFP4,
    Q2_K,
    Q2K_SC,
    Q3_K,
    Q3K_HM,
    Q3K_SC,
    Q4_1,
    Q5_0,
    Q5_1,
    SIGN_BIT,
    _e8m0_half,
    mxfp4_signed,
    nl_level,
    u_float,
    unit_bytes,
    unit_dot,
)

Q = gguf.GGMLQuantizationType
# GGML type ids the kernels dispatch on (constexpr), from gguf's table.
F32: tl.constexpr = tl.constexpr(int(Q.F32))
F16: tl.constexpr = tl.constexpr(int(Q.F16))
BF16: tl.constexpr = tl.constexpr(int(Q.BF16))
Q8_0: tl.constexpr = tl.constexpr(int(Q.Q8_0))
Q4_0: tl.constexpr = tl.constexpr(int(Q.Q4_0))
Q4_K: tl.constexpr = tl.constexpr(int(Q.Q4_K))
Q5_K: tl.constexpr = tl.constexpr(int(Q.Q5_K))
Q6_K: tl.constexpr = tl.constexpr(int(Q.Q6_K))
IQ4_XS: tl.constexpr = tl.constexpr(int(Q.IQ4_XS))
# (the gathered types' ids, Q4_1 .. IQ3_S, are ``unit_kernels``')

# Triton's interpreter (CI, on the CPU) runs a program at a time in Python: there, fewer and wider
# programs test the same code in a fraction of the time. On a GPU the tuned sizes apply.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _cols_from_env() -> bool:
    """``STRATA_DECODE_COLS``: 1 reads the nibble types (``NIBBLES``), Q6_K and Q8_0 in the
    decode kernels with ``kcols_tile``, ``k6cols_tile`` and ``q8cols_tile`` (column tiles, the
    input a column at a time), 0 or unset with ``k_tile``, ``unit_dot`` and ``q8_tile``. A
    developer's switch for an A/B on a GPU until the bench says which is faster; another value
    is refused with its name."""
    value = os.environ.get("STRATA_DECODE_COLS", "0")
    if value not in ("0", "1"):
        raise ValueError(f"STRATA_DECODE_COLS={value!r}: want 1 (column tiles) or 0")
    return value == "1"


COLS: tl.constexpr = tl.constexpr(_cols_from_env())

# the types whose units are 32 elements, k_tile's: every type but Q8_0 and the plain floats
# (dot_rows and moe._down_kernel test those two inline); the gathered ones through unit_halves
UNIT32_TYPES = frozenset(q for q, f in FORMATS.items() if f.kernel == UNIT32)
assert {Q.Q8_0} == {q for q, f in FORMATS.items() if f.kernel == Q8_KIND}


# What the kernels' input is (``XIN``, a constexpr; ``nw`` the second vector it reads): x as it
# is; RMSNorm'd, x * rms * nw; gated, x * σ(nw) (gated attention's output); SwiGLU'd,
# SiLU(x) * nw (an FFN's activation, x its gate half and nw its up half). False and True are
# XIN_PLAIN and XIN_NORM. The gate and the SwiGLU are written as the element-wise launches they
# replaced wrote them, so they round alike.
XIN_PLAIN: tl.constexpr = tl.constexpr(0)
XIN_NORM: tl.constexpr = tl.constexpr(1)
XIN_GATE: tl.constexpr = tl.constexpr(2)
XIN_SWIGLU: tl.constexpr = tl.constexpr(3)


@triton.jit
def xin(x, nw, rms, offs, mask, XIN: tl.constexpr):
    """The input at ``offs``: x, x * rms * nw (the reference's RMSNorm, in its order),
    x * σ(nw) or SiLU(x) * nw, by ``XIN``."""
    v = tl.load(x + offs, mask=mask, other=0.0)
    if XIN == XIN_NORM:
        v = v * rms * tl.load(nw + offs, mask=mask, other=0.0)
    elif XIN == XIN_GATE:
        v = v / (1.0 + tl.exp(-tl.load(nw + offs, mask=mask, other=0.0)))
    elif XIN == XIN_SWIGLU:
        v = v / (1.0 + tl.exp(-v)) * tl.load(nw + offs, mask=mask, other=0.0)
    return v


KEY_MIN: tl.constexpr = tl.constexpr(-(1 << 63))  # below every ``ordered_bits`` key


@triton.jit
def ordered_bits(v):
    """float32 v's bits as int32 that order as the floats do (a negative float's other 31 bits
    flipped; -0.0 made +0.0 first, so equal floats give equal keys): a value and an index
    packed in one int64 (the bits high) take one max where a max and a min of indices took
    two reductions."""
    bits = (v + 0.0).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def unordered_bits(bits):
    """The float32 whose ``ordered_bits`` are ``bits``."""
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def rms_scale(x, K: tl.constexpr, eps, BLOCK: tl.constexpr):
    """1 / sqrt(mean(x[:K]^2) + eps), as a scalar."""
    k = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for k0 in tl.static_range(0, K, BLOCK):
        v = tl.load(x + k0 + k, mask=k0 + k < K, other=0.0)
        acc += v * v
    return tl.rsqrt(tl.sum(acc, 0) / K + eps)


@triton.jit
def sigmoid_dot(h, v, D, BLOCK: tl.constexpr):
    """σ(h[:D] · v[:D]), as a scalar (a shared expert's gate); D need not be a constant."""
    k = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for d0 in range(0, D, BLOCK):
        m = d0 + k < D
        acc += tl.load(h + d0 + k, mask=m, other=0.0) * tl.load(v + d0 + k, mask=m, other=0.0)
    return 1.0 / (1.0 + tl.exp(-tl.sum(acc, 0)))


@triton.jit
def _f16_plane(w, off):
    return (w + off).to(tl.pointer_type(tl.float16))


@triton.jit
def k_input(x, nw, rms, xo, um, XIN: tl.constexpr):
    """The input of a K-quant tile: for each unit (32 elements from offset xo), elements
    xo + k and xo + 16 + k (k < 16), and each unit's sum. ([T, 16], [T, 16], [T])"""
    k = tl.arange(0, 16)
    at = xo[:, None] + k[None, :]
    xl = xin(x, nw, rms, at, um[:, None], XIN)
    xh = xin(x, nw, rms, at + 16, um[:, None], XIN)
    return xl, xh, tl.sum(xl + xh, 1)


@triton.jit
def _unit_at(r, u, NK: tl.constexpr):
    """[BN, T]: the entry of each (row, unit) in a plane of one entry per unit."""
    return (r * NK)[:, None] + u[None, :]


@triton.jit
def k_tile(wp, o1, o2, o3, o4, r, rmask, u, um, NK: tl.constexpr, QT: tl.constexpr, xl, xh, sx,
           w0=None, uf=None, FLAT: tl.constexpr = False):  # fmt: skip
    """One tile of a type with units of 32 elements: rows r (BN) x units u (T of them, counted
    from their rows' start; a row has NK; wp: [T] pointers to each unit's matrix) dotted with
    the input tile: [BN, T]. Byte 16u + k of the quants holds elements 32u + k and 32u + 16 + k.

    Q4_K, Q5_K, IQ4_XS: one scale (and min) per unit, at u; Q5_K's fifth bits: bits k and
    16 + k of the uint32 word u; IQ4_XS: nibbles index the 16 levels (``nl_level``). Q4_0: a
    unit is a block, its d at u. Q6_K: the bytes hold the low 4 bits, bits 4(u % 2) (+ 2) of qh byte
    16(u // 2) + k the high 2, and the scales sit at 16(u // 8) + u % 8 (+ 8).
    FLAT, w0, uf: the quants' loads as ``unit_bytes`` makes them flat."""
    nb: tl.constexpr = NK // K_UNITS  # 256-element blocks per row (the K-quants and IQ4_XS)
    k = tl.arange(0, 16)
    m2 = rmask[:, None] & um[None, :]
    qr = r * (NK * 16)  # a row's quants
    db = (r * nb)[:, None] + (u // K_UNITS)[None, :]  # [BN, T]: each unit's 256-block
    if QT == Q4_K:
        q = unit_bytes(wp, w0, uf, qr, u, um, rmask, 16, 1, 16, NK, FLAT).to(tl.int32)
        dl = tl.sum(u_float(q & 15, 0.0) * xl[None, :, :], 2)  # [BN, T]
        dh = tl.sum(u_float(q >> 4, 0.0) * xh[None, :, :], 2)
        s_at = _unit_at(r, u, NK)
        sc = tl.load(wp[None, :] + o1 + s_at, mask=m2, other=0).to(tl.float32)
        mn = tl.load(wp[None, :] + o2 + s_at, mask=m2, other=0).to(tl.float32)
        d = tl.load(_f16_plane(wp[None, :], o3) + db, mask=m2, other=0).to(tl.float32)
        dm = tl.load(_f16_plane(wp[None, :], o4) + db, mask=m2, other=0).to(tl.float32)
        # sum of q * (d sc) - dm mn over the unit = (d sc) (q . x) - (dm mn) sum(x)
        out = (d * sc) * (dl + dh) - (dm * mn) * sx[None, :]
    elif QT == Q5_K:
        q = unit_bytes(wp, w0, uf, qr, u, um, rmask, 16, 1, 16, NK, FLAT).to(tl.int32)
        s_at = _unit_at(r, u, NK)
        hp = (wp[None, :] + o1).to(tl.pointer_type(tl.uint32))
        hw = tl.load(hp + s_at, mask=m2, other=0).to(tl.int32, bitcast=True)  # [BN, T]
        h = hw[:, :, None] >> k[None, None, :]  # bit 0: element k's fifth bit; 16: 16 + k's
        lo = (q & 15) | ((h << 4) & 16)
        hi = (q >> 4) | ((h >> 12) & 16)
        dl = tl.sum(u_float(lo, 0.0) * xl[None, :, :], 2)
        dh = tl.sum(u_float(hi, 0.0) * xh[None, :, :], 2)
        sc = tl.load(wp[None, :] + o2 + s_at, mask=m2, other=0).to(tl.float32)
        mn = tl.load(wp[None, :] + o3 + s_at, mask=m2, other=0).to(tl.float32)
        ddp = _f16_plane(wp[None, :], o4) + 2 * db  # d, then dmin
        d = tl.load(ddp, mask=m2, other=0).to(tl.float32)
        dm = tl.load(ddp + 1, mask=m2, other=0).to(tl.float32)
        out = (d * sc) * (dl + dh) - (dm * mn) * sx[None, :]
    elif QT == IQ4_XS:
        q = unit_bytes(wp, w0, uf, qr, u, um, rmask, 16, 1, 16, NK, FLAT).to(tl.int32)
        s_at = _unit_at(r, u, NK)
        dl = tl.sum(nl_level(q & 15) * xl[None, :, :], 2)  # (masked: d is 0)
        dh = tl.sum(nl_level(q >> 4) * xh[None, :, :], 2)
        sc = tl.load(wp[None, :] + o1 + s_at, mask=m2, other=0).to(tl.int8, bitcast=True)
        d = tl.load(_f16_plane(wp[None, :], o2) + db, mask=m2, other=0).to(tl.float32)
        out = (d * sc.to(tl.float32)) * (dl + dh)
    elif QT == Q4_0:
        q = unit_bytes(wp, w0, uf, qr, u, um, rmask, 16, 1, 16, NK, FLAT).to(tl.int32)
        dl = tl.sum(u_float(q & 15, 0.0) * xl[None, :, :], 2)
        dh = tl.sum(u_float(q >> 4, 0.0) * xh[None, :, :], 2)
        s_at = _unit_at(r, u, NK)
        d = tl.load(_f16_plane(wp[None, :], o1) + s_at, mask=m2, other=0).to(tl.float32)
        # sum of d (q - 8) x over the block = d (q . x - 8 sum(x))
        out = d * ((dl + dh) - 8.0 * sx[None, :])
    elif QT == Q6_K:
        ql = unit_bytes(wp, w0, uf, qr, u, um, rmask, 16, 1, 16, NK, FLAT).to(tl.int32)
        qh = unit_bytes(wp, w0, uf, o1 + r * (NK * 8), u, um, rmask, 16, 2, 16, NK, FLAT)
        qh = qh.to(tl.int32)
        sh = (4 * (u % 2))[None, :, None]
        lo = (ql & 15) | (((qh >> sh) & 3) << 4)
        hi = (ql >> 4) | (((qh >> (sh + 2)) & 3) << 4)
        dl = tl.sum(u_float(lo, 32.0) * xl[None, :, :], 2)
        dh = tl.sum(u_float(hi, 32.0) * xh[None, :, :], 2)
        s6 = (r * (NK * 2))[:, None] + (16 * (u // 8) + u % 8)[None, :]
        s_lo = tl.load(wp[None, :] + o2 + s6, mask=m2, other=0).to(tl.int8, bitcast=True)
        s_hi = tl.load(wp[None, :] + o2 + s6 + 8, mask=m2, other=0).to(tl.int8, bitcast=True)
        d = tl.load(_f16_plane(wp[None, :], o3) + db, mask=m2, other=0).to(tl.float32)
        out = d * (s_lo.to(tl.float32) * dl + s_hi.to(tl.float32) * dh)
    else:  # the gathered types: their tiles in quant.unit_kernels
        out = unit_dot(wp, o1, o2, o3, o4, r, rmask, u, um, NK, QT, xl, xh, sx, w0, uf, FLAT)
    return out


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


# The column tiles' orientation. Triton lays a tile's threads along its most contiguous
# dimension; between two of equal contiguity (a tile's rows and its units, in gathers and
# scale loads) 3.6 takes the first and 3.9 the last. The tiles put the units there, so each
# thread holds its unit of every row: [units, rows] before 3.9, [rows, units] from it.
UNITS_FIRST: tl.constexpr = tl.constexpr(_release(triton.__version__) < (3, 9))


@triton.jit
def _per_unit(v):
    """[T] along the column tiles' unit dimension."""
    if UNITS_FIRST:
        return v[:, None]
    else:
        return v[None, :]


@triton.jit
def _per_row(v):
    """[BN] along the column tiles' row dimension."""
    if UNITS_FIRST:
        return v[None, :]
    else:
        return v[:, None]


@triton.jit
def _as_rows_units(t):
    """A column tile as [BN, T], the form the kernels sum."""
    if UNITS_FIRST:
        return tl.trans(t)
    else:
        return t


@triton.jit
def _word(p, at, m):
    """int32 words at word offsets ``at`` from the byte pointers ``p``."""
    return tl.load((p + 4 * at).to(tl.pointer_type(tl.int32)), mask=m, other=0)


@triton.jit
def _byte(p, at, m):
    return tl.load(p + at, mask=m, other=0).to(tl.int32)


@triton.jit
def _grid_entry(acc, wp2, o3, q, high, i: tl.constexpr, H: tl.constexpr, m2, sw, x, nw, rms,
                xo, um, XIN: tl.constexpr, QT: tl.constexpr):  # fmt: skip
    """acc (a column tile) + grid entry H + i of each unit (its 4 elements, signed) times the input:
    the entry's index is byte i of the word q (IQ3_S: its ninth bit, bit H + i of ``high``)."""
    idx = (q >> (8 * i)) & 0xFF
    if QT == IQ3_S:
        idx |= ((high >> (H + i)) & 1) << 8
    g = _word(wp2 + o3, idx, m2)  # the grid row: 4 byte values
    for b in tl.static_range(4):  # element 4 (H + i) + b of the unit
        mag = u_float((g >> (8 * b)) & 0xFF, 0.0)
        neg = (sw << (31 - 4 * (H + i) - b)) & SIGN_BIT
        v = (mag.to(tl.int32, bitcast=True) ^ neg).to(tl.float32, bitcast=True)
        acc += v * _per_unit(xin(x, nw, rms, xo + 4 * (H + i) + b, um, XIN))
    return acc


@triton.jit
def grid_tile(wp, o1, o2, o3, o4, r, rmask, u, um, NK: tl.constexpr, QT: tl.constexpr, x, nw,
              rms, xo, XIN: tl.constexpr):  # fmt: skip
    """IQ3_XXS and IQ3_S: rows r [BN] x units u [T] (32 elements each, the input of unit u from
    offset xo[u], transformed as ``xin``) dotted: [BN, T], as db * sum(grid * sign * x) a
    unit. A unit's eight grid indices are two words, its grid rows eight word loads and its 32
    signs one word, so no address is made per element. Computed as column tiles (units by rows,
    oriented as ``UNITS_FIRST`` says) with the input a column at a time ([T]), so every tile
    has the units along the threads and a thread's rows in its registers, and no tile changes
    its layout."""
    m2 = _per_unit(um) & _per_row(rmask)
    wp2 = _per_unit(wp)
    blk = _per_row(r * (NK // K_UNITS)) + _per_unit(u // K_UNITS)
    j = _per_unit(u % K_UNITS)
    q0 = _word(wp2, blk * (IQ3S_QS // 4) + 2 * j, m2)  # 8 index bytes a unit (both types)
    q1 = _word(wp2, blk * (IQ3S_QS // 4) + 2 * j + 1, m2)
    if QT == IQ3_S:
        hs = blk * IQ3S_HS
        # the unit's byte of ninth bits out of its word (a byte load here, contiguous over the
        # units, would be vectorised: 4 units a thread, and every tile's layout with it)
        high = (_word(wp2 + o1, hs // 4 + j // 4, m2) >> (8 * (j % 4))) & 0xFF
        sw = _word(wp2 + o1, (hs + IQ3S_SG) // 4 + j, m2)  # bit t: element t negative
        s = (_byte(wp2 + o1, hs + IQ3S_SC + j // 2, m2) >> (4 * (j % 2))) & 0x0F
        d = tl.load((wp2 + o2 + 2 * blk).to(tl.pointer_type(tl.float16)), mask=m2, other=0)
        db = d.to(tl.float32) * (1 + 2 * s).to(tl.float32)
    else:  # IQ3_XXS: the unit's word holds its scale and four sign patterns' indices
        high = q0  # (unread)
        w = _word(wp2 + o1, blk * (IQ3XXS_SS // 4) + j, m2)
        d = tl.load((wp2 + o2 + 2 * blk).to(tl.pointer_type(tl.float16)), mask=m2, other=0)
        db = d.to(tl.float32) * (0.5 + ((w >> 28) & 0x0F).to(tl.float32)) * 0.5
        sw = _byte(wp2 + o4, w & 0x7F, m2)
        sw |= _byte(wp2 + o4, (w >> 7) & 0x7F, m2) << 8
        sw |= _byte(wp2 + o4, (w >> 14) & 0x7F, m2) << 16
        sw |= _byte(wp2 + o4, (w >> 21) & 0x7F, m2) << 24
    acc = tl.zeros(m2.shape, tl.float32)
    for i in tl.static_range(4):
        acc = _grid_entry(acc, wp2, o3, q0, high, i, 0, m2, sw, x, nw, rms, xo, um, XIN, QT)
    for i in tl.static_range(4):
        acc = _grid_entry(acc, wp2, o3, q1, high, i, 4, m2, sw, x, nw, rms, xo, um, XIN, QT)
    return _as_rows_units(db * acc)


@triton.jit
def _words4(p, at, m2):
    """The 4 words from word offsets at (a column tile) of the byte pointers p (one a unit): one
    16-byte load, as four tiles of at's shape."""
    w = tl.load((p[:, :, None]).to(tl.pointer_type(tl.int32)) + at[:, :, None]
                + tl.arange(0, 4)[None, None, :], mask=m2[:, :, None], other=0)  # fmt: skip
    a, b = tl.split(tl.reshape(w, [w.shape[0], w.shape[1], 2, 2]))
    w0, w2 = tl.split(a)
    w1, w3 = tl.split(b)
    return w0, w1, w2, w3


@triton.jit
def _byte_of_words(p, at, m2):
    """The bytes at byte offsets at (a column tile; 4-aligned planes) out of their words: a byte
    load contiguous over the units would be vectorised, 4 units a thread."""
    return ((_word(p, at // 4, m2) >> (8 * (at % 4)).to(tl.int32)) & 0xFF).to(tl.int32)


# The types whose units are 16 bytes of nibbles (element k low, 16 + k high), the column tiles'
# ``kcols_tile``: a bit per type id, so a kernel tests ``(NIBBLES >> QT) & 1`` at compile time
_NIBBLE_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4)
NIBBLES: tl.constexpr = tl.constexpr(sum(1 << int(t) for t in _NIBBLE_TYPES))


@triton.jit
def _nib_value(v, QT: tl.constexpr):
    """A nibble's (or Q5's 5-bit) value as float32: its level for IQ4_NL, IQ4_XS and MXFP4
    (times 2 for MXFP4: its scale is halved), else itself; the scale comes after the sum."""
    if QT == IQ4_NL or QT == IQ4_XS:
        return nl_level(v)
    elif QT == MXFP4:
        return mxfp4_signed(v)
    else:
        return u_float(v, 0.0)


@triton.jit
def _nibble_dots(acc, acc2, sx, q, q2, h, h2, wi: tl.constexpr, x, nw, rms, xo, um,
                 XIN: tl.constexpr, TWO: tl.constexpr, QT: tl.constexpr):  # fmt: skip
    """(acc, acc2, sx) (column tiles and [T]) + the 8 elements of quant word wi (bytes 4 wi + b:
    elements 4 wi + b in the low nibbles, 16 + 4 wi + b in the high) of one matrix (q), or of
    two (TWO: q2 too, the same input), times the input, and the input's sum. Q5_K, Q5_0, Q5_1:
    element e's fifth bit is bit e of the unit's word h (h2)."""
    FIFTH: tl.constexpr = QT == Q5_K or QT == Q5_0 or QT == Q5_1
    for b in tl.static_range(4):
        for hi in tl.static_range(2):  # element 16 hi + 4 wi + b of the unit
            xc = xin(x, nw, rms, xo + 16 * hi + 4 * wi + b, um, XIN)
            sx += xc
            v = (q >> (8 * b + 4 * hi)) & 15
            if FIFTH:
                v |= ((h >> (16 * hi + 4 * wi + b)) & 1) << 4
            acc += _nib_value(v, QT) * _per_unit(xc)
            if TWO:
                v2 = (q2 >> (8 * b + 4 * hi)) & 15
                if FIFTH:
                    v2 |= ((h2 >> (16 * hi + 4 * wi + b)) & 1) << 4
                acc2 += _nib_value(v2, QT) * _per_unit(xc)
    return acc, acc2, sx


@triton.jit
def _scattered(at, m2):
    """Offsets at (a column tile, masked by m2) as the compiler may not prove contiguous over
    the units: loads of one value a unit from consecutive addresses would otherwise be
    vectorised, several units a thread, and every tile's layout would follow them. (A select
    against a constant has no contiguity; ``tl.max_contiguous`` did not hold through every
    use.)"""
    return tl.where(m2, at, 0)


@triton.jit
def _per_unit_half(p, at, m2):
    """Halves a unit at unit offsets at (contiguous over the units: said not to be, or they
    would be vectorised, several units a thread), as float32."""
    return tl.load(_f16_plane(p, 0) + _scattered(at, m2), mask=m2, other=0).to(tl.float32)


@triton.jit
def _k_fifth(wp2, o1, rr, uu, m2, NK: tl.constexpr, QT: tl.constexpr):
    """The word of fifth bits a unit of Q5_K, Q5_0 and Q5_1 (a column tile; else zeros,
    unread)."""
    s_at = rr * NK + uu
    if QT == Q5_K or QT == Q5_0 or QT == Q5_1:
        return _word(wp2 + o1, _scattered(s_at, m2), m2)
    else:
        return s_at.to(tl.int32) * 0


@triton.jit
def _k_scale(wp2, o1, o2, o3, o4, rr, uu, m2, NK: tl.constexpr, QT: tl.constexpr):
    """(a, c) of each unit (column tiles): its dot product is a * (values . x) + c * sum(x)."""
    s_at = rr * NK + uu
    db = rr * (NK // K_UNITS) + uu // K_UNITS  # a unit's 256-block (the K-quants, IQ4_XS)
    if QT == Q4_K:
        sc = _byte_of_words(wp2 + o1, s_at, m2).to(tl.float32)
        mn = _byte_of_words(wp2 + o2, s_at, m2).to(tl.float32)
        d = tl.load(_f16_plane(wp2, o3) + db, mask=m2, other=0).to(tl.float32)
        dm = tl.load(_f16_plane(wp2, o4) + db, mask=m2, other=0).to(tl.float32)
        return d * sc, -(dm * mn)
    elif QT == Q5_K:
        sc = _byte_of_words(wp2 + o2, s_at, m2).to(tl.float32)
        mn = _byte_of_words(wp2 + o3, s_at, m2).to(tl.float32)
        ddp = _f16_plane(wp2, o4) + 2 * db  # d, then dmin
        d = tl.load(ddp, mask=m2, other=0).to(tl.float32)
        dm = tl.load(ddp + 1, mask=m2, other=0).to(tl.float32)
        return d * sc, -(dm * mn)
    elif QT == IQ4_XS:
        sc = _byte_of_words(wp2 + o1, s_at, m2).to(tl.int8).to(tl.float32)
        d = tl.load(_f16_plane(wp2, o2) + db, mask=m2, other=0).to(tl.float32)
        return d * sc, 0.0 * sc
    elif QT == MXFP4:
        d = _e8m0_half(_byte_of_words(wp2 + o1, s_at, m2))
        return d, 0.0 * d
    elif QT == Q4_0:  # d (q - 8): a unit is a block
        d = _per_unit_half(wp2 + o1, s_at, m2)
        return d, -8.0 * d
    elif QT == Q4_1:  # d q + m
        return _per_unit_half(wp2 + o1, s_at, m2), _per_unit_half(wp2 + o2, s_at, m2)
    elif QT == Q5_0:  # d (q - 16)
        d = _per_unit_half(wp2 + o2, s_at, m2)
        return d, -16.0 * d
    elif QT == Q5_1:
        return _per_unit_half(wp2 + o2, s_at, m2), _per_unit_half(wp2 + o3, s_at, m2)
    else:  # IQ4_NL: d * level
        d = _per_unit_half(wp2 + o1, s_at, m2)
        return d, 0.0 * d


@triton.jit
def kcols_tile(wp, o1, o2, o3, o4, r, rmask, u, um, NK: tl.constexpr, QT: tl.constexpr, x, nw,
               rms, xo, XIN: tl.constexpr, vp=None, p1=0, p2=0, p3=0, p4=0,
               TWO: tl.constexpr = False):  # fmt: skip
    """Q4_K or Q5_K rows r [BN] x units u [T] dotted with the input (from offsets xo, as
    ``xin``): [BN, T] (TWO: and the same of a second matrix of the type at vp, planes p1..p4,
    in one pass over the input). As ``grid_tile``: column tiles, the input a column at a time,
    no tile changes its layout (compiled for sm_90 under Triton 3.6, Qwen3-30B-A3B's Q4_K
    gate/up has 7 barriers, not 33; ``COLS``)."""
    m2 = _per_unit(um) & _per_row(rmask)
    rr = _per_row(r)
    uu = _per_unit(u)
    at = rr * (NK * 4) + 4 * uu
    wp2 = _per_unit(wp)
    q0, q1, q2, q3 = _words4(wp2, at, m2)
    h = _k_fifth(wp2, o1, rr, uu, m2, NK, QT)
    v0, v1, v2, v3 = q0, q1, q2, q3
    h2 = h
    if TWO:
        vp2 = _per_unit(vp)
        v0, v1, v2, v3 = _words4(vp2, at, m2)
        h2 = _k_fifth(vp2, p1, rr, uu, m2, NK, QT)
    acc = tl.zeros(m2.shape, tl.float32)
    acc2 = tl.zeros(m2.shape, tl.float32)
    sx = tl.zeros(u.shape, tl.float32)
    acc, acc2, sx = _nibble_dots(acc, acc2, sx, q0, v0, h, h2, 0, x, nw, rms, xo, um, XIN, TWO, QT)
    acc, acc2, sx = _nibble_dots(acc, acc2, sx, q1, v1, h, h2, 1, x, nw, rms, xo, um, XIN, TWO, QT)
    acc, acc2, sx = _nibble_dots(acc, acc2, sx, q2, v2, h, h2, 2, x, nw, rms, xo, um, XIN, TWO, QT)
    acc, acc2, sx = _nibble_dots(acc, acc2, sx, q3, v3, h, h2, 3, x, nw, rms, xo, um, XIN, TWO, QT)
    a, c = _k_scale(wp2, o1, o2, o3, o4, rr, uu, m2, NK, QT)
    out = _as_rows_units(a * acc + c * _per_unit(sx))
    out2 = out
    if TWO:
        a2, c2 = _k_scale(vp2, p1, p2, p3, p4, rr, uu, m2, NK, QT)
        out2 = _as_rows_units(a2 * acc2 + c2 * _per_unit(sx))
    return out, out2


@triton.jit
def _q6_dots(dl, dh, ql, qh, sh, wi: tl.constexpr, x, nw, rms, xo, um, XIN: tl.constexpr):
    """(dl, dh) (column tiles) + Q6_K word wi's 8 elements (4 wi + b in the low half,
    16 + 4 wi + b in the high) times the input: the low 4 bits from the ql word, the high 2
    from the qh word at bit sh (+ 2 for the high half), minus 32."""
    for b in tl.static_range(4):
        lw = ql >> (8 * b)
        hw = qh >> (8 * b)
        lo = (lw & 15) | (((hw >> sh) & 3) << 4)
        hi = ((lw >> 4) & 15) | (((hw >> (sh + 2)) & 3) << 4)
        dl += u_float(lo, 32.0) * _per_unit(xin(x, nw, rms, xo + 4 * wi + b, um, XIN))
        dh += u_float(hi, 32.0) * _per_unit(xin(x, nw, rms, xo + 16 + 4 * wi + b, um, XIN))
    return dl, dh


@triton.jit
def k6cols_tile(wp, o1, o2, o3, r, rmask, u, um, NK: tl.constexpr, x, nw, rms, xo,
                XIN: tl.constexpr):  # fmt: skip
    """Q6_K as ``kcols_tile`` reads Q4_K: [BN, T]. A unit's low bits are four words (bytes
    16 u + k), its high bits four words shared with the unit beside it (bits 4 (u % 2) and
    + 2 of qh bytes 16 (u // 2) + k), its two scales bytes of their words."""
    m2 = _per_unit(um) & _per_row(rmask)
    rr = _per_row(r)
    uu = _per_unit(u)
    wp2 = _per_unit(wp)
    q0, q1, q2, q3 = _words4(wp2, rr * (NK * 4) + 4 * uu, m2)
    h0, h1, h2, h3 = _words4(wp2 + o1, rr * (NK * 2) + 4 * (uu // 2), m2)
    sh = 4 * (uu % 2)
    dl = tl.zeros(m2.shape, tl.float32)
    dh = tl.zeros(m2.shape, tl.float32)
    dl, dh = _q6_dots(dl, dh, q0, h0, sh, 0, x, nw, rms, xo, um, XIN)
    dl, dh = _q6_dots(dl, dh, q1, h1, sh, 1, x, nw, rms, xo, um, XIN)
    dl, dh = _q6_dots(dl, dh, q2, h2, sh, 2, x, nw, rms, xo, um, XIN)
    dl, dh = _q6_dots(dl, dh, q3, h3, sh, 3, x, nw, rms, xo, um, XIN)
    s6 = rr * (NK * 2) + 16 * (uu // K_UNITS) + uu % K_UNITS
    s_lo = _byte_of_words(wp2 + o2, s6, m2).to(tl.int8).to(tl.float32)
    s_hi = _byte_of_words(wp2 + o2, s6 + 8, m2).to(tl.int8).to(tl.float32)
    d = tl.load(_f16_plane(wp2, o3) + rr * (NK // K_UNITS) + uu // K_UNITS, mask=m2, other=0)
    return _as_rows_units(d.to(tl.float32) * (s_lo * dl + s_hi * dh))


@triton.jit
def _crumb_dots(dq, sx, q, h, wi: tl.constexpr, sh, j, x, nw, rms, xo, um, XIN: tl.constexpr,
                QT: tl.constexpr):  # fmt: skip
    """(dq, sx) + 4 elements of a Q2_K / Q3_K half unit (column tiles; xo its first element):
    element 4 wi + b is bits sh of byte b of the quant word q (Q3_K: its third bit, bit j of
    byte b of the hmask word h; 0 means minus 4), times the input, and the input's sum."""
    for b in tl.static_range(4):
        xc = xin(x, nw, rms, xo + 4 * wi + b, um, XIN)
        sx += xc
        v = (q >> (8 * b + sh)) & 3
        if QT == Q3_K:
            v = u_float(v | (((h >> (8 * b + j)) & 1) << 2), 4.0)
        else:
            v = u_float(v, 0.0)
        dq += v * _per_unit(xc)
    return dq, sx


@triton.jit
def _crumb_half(wp2, o1, qat, hat, sh, j, m2, x, nw, rms, xo, um, XIN: tl.constexpr,
                QT: tl.constexpr):  # fmt: skip
    """A Q2_K / Q3_K half unit (16 elements from xo; its quants' 16 bytes at word offset qat,
    Q3_K's hmask bytes at hat after o1): (its dot with the input, the input's sum)."""
    q0, q1, q2, q3 = _words4(wp2, qat, m2)
    h0, h1, h2, h3 = q0, q1, q2, q3
    if QT == Q3_K:
        h0, h1, h2, h3 = _words4(wp2 + o1, hat, m2)
    dq = tl.zeros(m2.shape, tl.float32)
    sx = tl.zeros(xo.shape, tl.float32)
    dq, sx = _crumb_dots(dq, sx, q0, h0, 0, sh, j, x, nw, rms, xo, um, XIN, QT)
    dq, sx = _crumb_dots(dq, sx, q1, h1, 1, sh, j, x, nw, rms, xo, um, XIN, QT)
    dq, sx = _crumb_dots(dq, sx, q2, h2, 2, sh, j, x, nw, rms, xo, um, XIN, QT)
    dq, sx = _crumb_dots(dq, sx, q3, h3, 3, sh, j, x, nw, rms, xo, um, XIN, QT)
    return dq, sx


@triton.jit
def _q3k_scale6(wp2, o, blk, g, m2):
    """Q3_K's signed 6-bit scale of group g (column tiles), its bytes out of their words."""
    lo = (_byte_of_words(wp2 + o, blk * Q3K_SC + g % 8, m2) >> (4 * (g // 8))) & 0x0F
    hi = (_byte_of_words(wp2 + o, blk * Q3K_SC + 8 + g % 4, m2) >> (2 * (g // 4))) & 0x03
    return u_float((lo | (hi << 4)).to(tl.int32), 32.0)


@triton.jit
def k23cols_tile(wp, o1, o2, o3, r, rmask, u, um, NK: tl.constexpr, QT: tl.constexpr, x, nw,
                 rms, xo, XIN: tl.constexpr):  # fmt: skip
    """Q2_K and Q3_K as ``kcols_tile`` reads the nibble types: [BN, T]. Unit j of a block is
    bits 2 (j % 4) of the 32 quant bytes 32 (j // 4) + k (two 16-byte loads, one a half unit;
    Q3_K's third bits bit j of the block's 32 hmask bytes), a scale (and Q2_K's min) a half."""
    m2 = _per_unit(um) & _per_row(rmask)
    rr = _per_row(r)
    uu = _per_unit(u)
    wp2 = _per_unit(wp)
    blk = rr * (NK // K_UNITS) + uu // K_UNITS
    j = uu % K_UNITS
    qat = blk * (K2_QS // 4) + 8 * (j // 4)  # the unit's 32 quant bytes, in words
    hat = blk * (Q3K_HM // 4)
    sh = (2 * (j % 4)).to(tl.int32)
    jj = j.to(tl.int32)
    d_lo, s_lo = _crumb_half(wp2, o1, qat, hat, sh, jj, m2, x, nw, rms, xo, um, XIN, QT)
    d_hi, s_hi = _crumb_half(wp2, o1, qat + 4, hat + 4, sh, jj, m2, x, nw, rms, xo + 16, um,
                             XIN, QT)  # fmt: skip
    if QT == Q2_K:  # (d sc) q - dmin mn, a scale and a min a half unit (a byte each)
        sc_lo = _byte_of_words(wp2 + o1, blk * Q2K_SC + 2 * j, m2)
        sc_hi = _byte_of_words(wp2 + o1, blk * Q2K_SC + 2 * j + 1, m2)
        d = tl.load(_f16_plane(wp2, o2) + blk, mask=m2, other=0).to(tl.float32)
        dm = tl.load(_f16_plane(wp2, o3) + blk, mask=m2, other=0).to(tl.float32)
        out = d * ((sc_lo & 15).to(tl.float32) * d_lo + (sc_hi & 15).to(tl.float32) * d_hi)
        out -= dm * ((sc_lo >> 4).to(tl.float32) * _per_unit(s_lo)
                     + (sc_hi >> 4).to(tl.float32) * _per_unit(s_hi))  # fmt: skip
    else:  # Q3_K: d s q, a signed 6-bit scale a half unit
        d = tl.load(_f16_plane(wp2, o3) + blk, mask=m2, other=0).to(tl.float32)
        out = d * (_q3k_scale6(wp2, o2, blk, 2 * j, m2) * d_lo
                   + _q3k_scale6(wp2, o2, blk, 2 * j + 1, m2) * d_hi)  # fmt: skip
    return _as_rows_units(out)


@triton.jit
def q8cols_tile(wp, o_d, r, rmask, u, um, K: tl.constexpr, x, nw, rms, xo, XIN: tl.constexpr):
    """Q8_0 (units of 16 elements, half a block) as ``kcols_tile`` reads Q4_K: a unit's 16
    bytes are four words from one 16-byte load, the input a column at a time. [BN, T]."""
    m2 = _per_unit(um) & _per_row(rmask)
    rr = _per_row(r)
    uu = _per_unit(u)
    wp2 = _per_unit(wp)
    q0, q1, q2, q3 = _words4(wp2, rr * (K // 4) + 4 * uu, m2)
    acc = tl.zeros(m2.shape, tl.float32)
    acc = _int8_dots(acc, q0, 0, x, nw, rms, xo, um, XIN)
    acc = _int8_dots(acc, q1, 1, x, nw, rms, xo, um, XIN)
    acc = _int8_dots(acc, q2, 2, x, nw, rms, xo, um, XIN)
    acc = _int8_dots(acc, q3, 3, x, nw, rms, xo, um, XIN)
    d = tl.load(_f16_plane(wp2, o_d) + rr * (K // 32) + uu // 2, mask=m2, other=0)
    return _as_rows_units(d.to(tl.float32) * acc)


@triton.jit
def _int8_dots(acc, q, wi: tl.constexpr, x, nw, rms, xo, um, XIN: tl.constexpr):
    """acc (a column tile) + the 4 signed bytes of quant word wi (elements 4 wi + b) times
    the input."""
    for b in tl.static_range(4):
        v = (q << (24 - 8 * b)) >> 24  # byte b, sign-extended
        acc += u_float(v + 128, 128.0) * _per_unit(xin(x, nw, rms, xo + 4 * wi + b, um, XIN))
    return acc


@triton.jit
def q8_tile(wp, o_d, r, rmask, u, um, K: tl.constexpr, x, nw, rms, xo, XIN: tl.constexpr,
            w0=None, uf=None, FLAT: tl.constexpr = False):  # fmt: skip
    """Q8_0, units of 16 elements (half a block; the input of unit u from offset xo): [BN, T].
    FLAT, w0, uf: as ``unit_bytes``."""
    k = tl.arange(0, 16)
    q = unit_bytes(wp, w0, uf, r * K, u, um, rmask, 16, 1, 16, K // 16, FLAT)
    f = u_float(q.to(tl.int8, bitcast=True).to(tl.int32) + 128, 128.0)
    xv = xin(x, nw, rms, xo[:, None] + k[None, :], um[:, None], XIN)
    db = (r * (K // 32))[:, None] + (u // 2)[None, :]
    d = tl.load(_f16_plane(wp[None, :], o_d) + db, mask=rmask[:, None] & um[None, :], other=0)
    return d.to(tl.float32) * tl.sum(f * xv[None, :, :], 2)


@triton.jit
def float_tile(wp, r, rmask, u, um, K: tl.constexpr, x, nw, rms, xo, QT: tl.constexpr,
               XIN: tl.constexpr, w0=None, uf=None, FLAT: tl.constexpr = False):  # fmt: skip
    """Plain floats, units of 8 elements: [BN, T]. FLAT, w0, uf: as ``unit_bytes``."""
    k = tl.arange(0, 8)
    v = unit_bytes(wp, w0, uf, r * K, u, um, rmask, 8, 1, 8, K // 8, FLAT, QT)
    if QT == F16:
        v = v.to(tl.float32)
    elif QT == BF16:  # the top half of an f32
        v = (v.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    xv = xin(x, nw, rms, xo[:, None] + k[None, :], um[:, None], XIN)
    return tl.sum(v * xv[None, :, :], 2)


@triton.jit
def _row_tile(w, o1, o2, o3, o4, r, rmask, u0, T: tl.constexpr, K: tl.constexpr, x, nw, rms,
              QT: tl.constexpr, XIN: tl.constexpr):  # fmt: skip
    """Rows r x units u0 .. u0 + T - 1 of the ``QT`` matrix at w dotted with the input: [BN, T]
    (its quants loaded flat: ``unit_bytes``)."""
    NU: tl.constexpr = K // (
        16 if QT == Q8_0 else 8 if QT == F32 or QT == F16 or QT == BF16 else 32
    )
    u = u0 + tl.arange(0, T)
    um = u < NU
    wp = w + tl.zeros([T], tl.int32)
    if QT == Q8_0 and COLS:
        return q8cols_tile(wp, o1, r, rmask, u, um, K, x, nw, rms, 16 * u, XIN)
    elif QT == Q8_0:
        uf = u0 + tl.arange(0, T * 16) // 16
        return q8_tile(wp, o1, r, rmask, u, um, K, x, nw, rms, 16 * u, XIN, w, uf, True)
    elif QT == F32 or QT == F16 or QT == BF16:
        uf = u0 + tl.arange(0, T * 8) // 8
        return float_tile(wp, r, rmask, u, um, K, x, nw, rms, 8 * u, QT, XIN, w, uf, True)
    elif QT == IQ3_XXS or QT == IQ3_S:
        return grid_tile(wp, o1, o2, o3, o4, r, rmask, u, um, K // 32, QT, x, nw, rms, 32 * u, XIN)
    elif (NIBBLES >> QT) & 1 and COLS:
        return kcols_tile(wp, o1, o2, o3, o4, r, rmask, u, um, K // 32, QT, x, nw, rms, 32 * u,
                          XIN)[0]  # fmt: skip
    elif (QT == Q2_K or QT == Q3_K) and COLS:
        return k23cols_tile(wp, o1, o2, o3, r, rmask, u, um, K // 32, QT, x, nw, rms, 32 * u, XIN)
    elif QT == Q6_K and COLS:
        return k6cols_tile(wp, o1, o2, o3, r, rmask, u, um, K // 32, x, nw, rms, 32 * u, XIN)
    else:  # units of 32 elements
        uf = u0 + tl.arange(0, T * 16) // 16
        xl, xh, sx = k_input(x, nw, rms, 32 * u, um, XIN)
        return k_tile(wp, o1, o2, o3, o4, r, rmask, u, um, K // 32, QT, xl, xh, sx, w, uf, True)


@triton.jit
def dot_rows(w, o1, o2, o3, o4, rows, rmask, K: tl.constexpr, x, nw, rms, QT: tl.constexpr,
             XIN: tl.constexpr, BN: tl.constexpr, T: tl.constexpr,
             TAIL: tl.constexpr = 0):  # fmt: skip
    """[BN] float32: rows ``rows`` (masked by ``rmask``) of the repacked ``QT`` matrix at ``w``
    (uint8 pointer; planes at w + o1..o4) times the input (x as ``XIN`` says: ``xin``).
    Steps of T units (``unit_elements`` each), unrolled; with TAIL (``steps``), the rest of a
    row that T does not divide in one narrower step, else in one more of T, masked."""
    r = rows.to(tl.int64)
    NU: tl.constexpr = K // (
        16 if QT == Q8_0 else 8 if QT == F32 or QT == F16 or QT == BF16 else 32
    )
    FULL: tl.constexpr = NU // T if TAIL > 0 else (NU + T - 1) // T  # steps of T
    acc = tl.zeros([BN, T], tl.float32)
    for i in tl.static_range(FULL):
        acc += _row_tile(w, o1, o2, o3, o4, r, rmask, i * T, T, K, x, nw, rms, QT, XIN)
    out = tl.sum(acc, 1)
    if TAIL > 0:
        out += tl.sum(
            _row_tile(w, o1, o2, o3, o4, r, rmask, FULL * T, TAIL, K, x, nw, rms, QT, XIN), 1
        )
    return out


@triton.jit
def _pair_step(w, o1, o2, o3, o4, v, p1, p2, p3, p4, r, rmask, u0, T: tl.constexpr,
               NK: tl.constexpr, x, QT: tl.constexpr, COLUMNS: tl.constexpr):  # fmt: skip
    """One step of ``dot_rows2``'s single pass: units u0 .. u0 + T - 1 of both matrices with
    the same input, ([BN, T], [BN, T]); COLUMNS: ``kcols_tile``'s column tiles, else
    ``k_tile``'s (the input tile loaded once for both)."""
    u = u0 + tl.arange(0, T)
    um = u < NK
    wp = w + tl.zeros([T], tl.int32)
    vp = v + tl.zeros([T], tl.int32)
    if COLUMNS:
        return kcols_tile(wp, o1, o2, o3, o4, r, rmask, u, um, NK, QT, x, x, 1.0, 32 * u, False,
                          vp, p1, p2, p3, p4, True)  # fmt: skip
    else:
        xl, xh, sx = k_input(x, x, 1.0, 32 * u, um, False)
        uf = u0 + tl.arange(0, T * 16) // 16
        ya = k_tile(wp, o1, o2, o3, o4, r, rmask, u, um, NK, QT, xl, xh, sx, w, uf, True)
        yb = k_tile(vp, p1, p2, p3, p4, r, rmask, u, um, NK, QT, xl, xh, sx, v, uf, True)
        return ya, yb


@triton.jit
def dot_rows2(w, o1, o2, o3, o4, v, p1, p2, p3, p4, rows, rmask, K: tl.constexpr, x,
              QT: tl.constexpr, BN: tl.constexpr, T: tl.constexpr,
              TAIL: tl.constexpr = 0):  # fmt: skip
    """``dot_rows`` of two matrices of one type (at w and v) with the same input, in one pass
    where the type's tiles allow (each input value loaded once): ([BN], [BN])."""
    COLUMNS: tl.constexpr = (NIBBLES >> QT) & 1 and COLS  # ``kcols_tile``'s, both at once
    ONE_PASS: tl.constexpr = COLUMNS or (
        QT != Q8_0 and QT != F32 and QT != F16 and QT != BF16 and QT != IQ3_XXS and QT != IQ3_S
        and not ((QT == Q6_K or QT == Q2_K or QT == Q3_K) and COLS)
    )  # fmt: skip
    if ONE_PASS:
        r = rows.to(tl.int64)
        NK: tl.constexpr = K // 32
        FULL: tl.constexpr = NK // T if TAIL > 0 else (NK + T - 1) // T
        acc_a = tl.zeros([BN, T], tl.float32)
        acc_b = tl.zeros([BN, T], tl.float32)
        for i in tl.static_range(FULL):
            ya, yb = _pair_step(w, o1, o2, o3, o4, v, p1, p2, p3, p4, r, rmask, i * T, T, NK, x,
                                QT, COLUMNS)  # fmt: skip
            acc_a += ya
            acc_b += yb
        a = tl.sum(acc_a, 1)
        c = tl.sum(acc_b, 1)
        if TAIL > 0:
            ya, yb = _pair_step(w, o1, o2, o3, o4, v, p1, p2, p3, p4, r, rmask, FULL * T, TAIL,
                                NK, x, QT, COLUMNS)  # fmt: skip
            a += tl.sum(ya, 1)
            c += tl.sum(yb, 1)
    else:
        a = dot_rows(w, o1, o2, o3, o4, rows, rmask, K, x, x, 1.0, QT, False, BN, T, TAIL)
        c = dot_rows(v, p1, p2, p3, p4, rows, rmask, K, x, x, 1.0, QT, False, BN, T, TAIL)
    return a, c


def unit_elements(qtype: int) -> int:
    """Elements of one unit of ``dot_rows``'s tiles: 32 (a K-quant or IQ sub-block, a block of
    the 32-element types), 16 (half a Q8_0 block) or 8 (plain floats: 16 or 32 bytes)."""
    if qtype in {int(t) for t in UNIT32_TYPES}:
        return 32
    if qtype == int(Q.Q8_0):
        return 16
    return 8


MAX_UNITS = 256  # units per step: 8 warps of 32 threads, one unit each


def steps(qtype: int, cols: int) -> tuple[int, int]:
    """(T, TAIL): a row's units in steps of T (a power of two, at most MAX_UNITS) and, where T
    does not divide them, the rest in one last step of TAIL units (a smaller power of two), or
    TAIL = 0 (the rest in one more step of T, masked, or none). A step's T is also its
    threads (``warps_for``), so units past the row's end are threads with nothing to do: a row
    of 90 units (gpt-oss's 2880 columns) in one step of 128 idles 30% of them, in 64 + 32 6%.
    Rows of fewer than 64 units keep one step (of at most one warp: a narrower step would not
    free a thread)."""
    n = max(1, cols // unit_elements(qtype))
    t = min(triton.next_power_of_2(n), MAX_UNITS)
    if n < 64 or n % t == 0:
        return t, 0
    t = min(1 << (n.bit_length() - 1), MAX_UNITS)  # the largest power of two <= n
    tail = triton.next_power_of_2(n % t) if n % t else 0
    return (t, 0) if tail in (0, t) else (t, tail)


def warps_for(units: int) -> int:
    """One thread per unit of a step: up to 8 warps."""
    return max(1, min(8, units // 32))


def step_warps(t: int, tail: int) -> int:
    """The warps of a row in ``steps`` (T, TAIL): as many as one step of the whole row would
    have (128 threads for 64 + 32 units), so a thread holds half a step's tile, not all of it:
    compiled for sm_90, gpt-oss-20b's gate/up at 64 + 32 units takes 128 registers in four
    warps (Triton 3.6; 72 in 3.9) against 255 in two."""
    return warps_for(triton.next_power_of_2(t + tail))


def launch_regs(maxnreg: int | None) -> dict[str, int]:
    """A launch's register cap as Triton's launch option (none: the compiler's choice)."""
    if maxnreg is None:
        return {}
    if not 16 <= maxnreg <= 255:
        raise ValueError(f"a register cap of {maxnreg}: want 16 to 255 a thread")
    return {"maxnreg": maxnreg}


def plane_offsets(offsets: tuple[int, ...]) -> tuple[int, int, int, int]:
    """A layout's offsets after the first plane, padded to the four ``dot_rows`` takes."""
    rest = tuple(offsets[1:])
    assert len(rest) <= 4, "dot_rows reads at most five planes"
    return (*rest, *(0,) * (4 - len(rest)))  # type: ignore[return-value]


__all__ = [
    "UNIT32_TYPES",
    "XIN_GATE",
    "XIN_NORM",
    "XIN_PLAIN",
    "XIN_SWIGLU",
    "dot_rows",
    "dot_rows2",
    "launch_regs",
    "plane_offsets",
    "rms_scale",
    "sigmoid_dot",
    "step_warps",
    "steps",
    "warps_for",
    "xin",
]
