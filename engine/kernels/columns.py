"""The grid types' decode tile (IQ3_XXS, IQ3_S): rows r [BN] x units u [T] of a repacked matrix
dotted with one input vector, held as column tiles of units by rows with no third dimension, the
input read a column at a time (docs/gpu-decode.md, "The grid types' tile"). Returns [BN, T] as
``kernels.dot``'s row tiles do.

The same column form for the other quantised types (nibbles, Q6_K, Q2_K/Q3_K, Q8_0) compiled to
fewer registers and barriers than the row tiles, and ran Qwen3-30B-A3B at 102 tok/s on the H200
against the row tiles' 300 (2026-12-05), so they were removed. The likely cause, which the
register and barrier counts do not show: a column of the input is a load whose lanes are 32
elements apart (a unit each), 32 of them a unit, where the row tiles load the input contiguous.
This one stays for the grid types, whose row tiles spilled; it is not measured yet.
"""

from __future__ import annotations

import triton
import triton.language as tl

from strata.engine.kernels.inputs import xin
from strata.engine.quant.unit_kernels import (
    IQ3_S,
    IQ3S_HS,
    IQ3S_QS,
    IQ3S_SC,
    IQ3S_SG,
    IQ3XXS_SS,
    K_UNITS,
    SIGN_BIT,
    byte_float,
)


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
    # the grid row: 4 byte values, unmasked (a masked unit's index is 0, a row of the table)
    g = tl.load((wp2 + o3 + 4 * idx).to(tl.pointer_type(tl.int32)))
    for b in tl.static_range(4):  # element 4 (H + i) + b of the unit
        mag = byte_float(g, b, 0.0)
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
