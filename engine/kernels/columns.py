"""The decode kernels' column tiles: rows r [BN] x units u [T] of a repacked matrix dotted with
one input vector, held as tiles of units by rows with no third dimension, the input read a
column at a time. ``kernels.dot``'s row tiles hold [rows, units, elements] and change the
layout of the input tile and of every scale tile to meet them, each change a round trip through
shared memory behind a barrier; these change none (docs/gpu-decode.md, "Tiles of [units,
rows]"). The grid types (IQ3_XXS, IQ3_S) always take ``grid_tile``; the other quantised types
take ``kcols_tile``, ``k6cols_tile``, ``k23cols_tile`` and ``q8cols_tile`` with
``STRATA_DECODE_COLS=1`` (``inputs.COLS``). Each returns [BN, T] as the row tiles do.
"""

from __future__ import annotations

import gguf
import triton
import triton.language as tl

from strata.engine.kernels.inputs import (
    IQ4_XS,
    Q4_0,
    Q4_K,
    Q5_K,
    _f16_plane,
    xin,
)
from strata.engine.quant.unit_kernels import (
    IQ3_S,
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
)

Q = gguf.GGMLQuantizationType


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
