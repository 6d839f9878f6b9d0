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
the input's sum). The quantised types with 32-element units assemble their values four a word
(masks and shifts a word, not an element; Q8_0's int8 + 128 one XOR a word), and a byte
becomes a float by one byte permute and an exact subtraction (``unit_kernels.byte_float``):
no narrow conversion, an instruction at an eighth of the issue rate. IQ4_XS, IQ4_NL and MXFP4
look up four nibbles' levels with three byte permutes (``unit_kernels.level_dot``, no load).
Every type with units of 32 elements (all but the floats) shares ``k_tile``'s structure.
Q4_K, Q5_K, Q6_K, IQ4_XS, Q4_0 and Q8_0 (a unit a block: its 32 bytes as two halves of 16, as
a nibble type's low and high nibbles) have inner loops of their own; the gathered types (Q4_1,
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

import gguf
import triton
import triton.language as tl

from strata.engine.kernels.columns import grid_tile
from strata.engine.kernels.inputs import (
    BF16,
    F16,
    F32,
    IQ4_XS,
    Q4_0,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_0,
    _f16_plane,
    xin,
)
from strata.engine.quant.format import UNIT32
from strata.engine.quant.formats import FORMATS
from strata.engine.quant.unit_kernels import (
    IQ3_S,
    IQ3_XXS,
    K_UNITS,
    byte_dots,
    fifth_bits,
    level_dot,
    nibble_dots,
    unit_bytes,
    unit_dot,
    words,
)

Q = gguf.GGMLQuantizationType
SIGN_BYTES: tl.constexpr = tl.constexpr(-0x7F7F7F80)  # 0x80808080 as int32

# the types whose units are 32 elements, k_tile's: every type but the plain floats (dot_rows
# and moe._down_kernel test those inline); the gathered ones through unit_halves
UNIT32_TYPES = frozenset(q for q, f in FORMATS.items() if f.kernel == UNIT32)


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
    16 + k of the uint32 word u; IQ4_XS: nibbles index the 16 levels (``level_dot``). Q4_0: a
    unit is a block, its d at u. Q8_0: a unit is a block, its 32 int8 at 32u (bytes 32u + k
    and 32u + 16 + k are elements 32u + k and 32u + 16 + k), its d at u. Q6_K: the bytes
    hold the low 4 bits, bits 4(u % 2) (+ 2) of qh byte 16(u // 2) + k the high 2, and the
    scales sit at 16(u // 8) + u % 8 (+ 8).
    FLAT, w0, uf: the quants' loads as ``unit_bytes`` makes them flat."""
    nb: tl.constexpr = NK // K_UNITS  # 256-element blocks per row (the K-quants and IQ4_XS)
    m2 = rmask[:, None] & um[None, :]
    qr = r * (NK * 16)  # a row's quants
    db = (r * nb)[:, None] + (u // K_UNITS)[None, :]  # [BN, T]: each unit's 256-block
    if QT == Q4_K:
        q = unit_bytes(wp, w0, uf, qr, u, um, rmask, 16, 1, 16, NK, FLAT).to(tl.int32)
        dl, dh = nibble_dots(q, xl, xh)  # [BN, T]
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
        f_lo, f_hi = fifth_bits(tl.load(hp + s_at, mask=m2, other=0))  # (hw: [BN, T])
        qw = words(q)
        dl, dh = byte_dots((qw & 0x0F0F0F0F) | f_lo, ((qw >> 4) & 0x0F0F0F0F) | f_hi, xl, xh, 0.0)
        sc = tl.load(wp[None, :] + o2 + s_at, mask=m2, other=0).to(tl.float32)
        mn = tl.load(wp[None, :] + o3 + s_at, mask=m2, other=0).to(tl.float32)
        ddp = _f16_plane(wp[None, :], o4) + 2 * db  # d, then dmin
        d = tl.load(ddp, mask=m2, other=0).to(tl.float32)
        dm = tl.load(ddp + 1, mask=m2, other=0).to(tl.float32)
        out = (d * sc) * (dl + dh) - (dm * mn) * sx[None, :]
    elif QT == IQ4_XS:
        q = unit_bytes(wp, w0, uf, qr, u, um, rmask, 16, 1, 16, NK, FLAT).to(tl.int32)
        s_at = _unit_at(r, u, NK)
        dot = level_dot(q, xl, xh)  # (masked: d is 0)
        sc = tl.load(wp[None, :] + o1 + s_at, mask=m2, other=0).to(tl.int8, bitcast=True)
        d = tl.load(_f16_plane(wp[None, :], o2) + db, mask=m2, other=0).to(tl.float32)
        out = (d * sc.to(tl.float32)) * dot
    elif QT == Q4_0:
        q = unit_bytes(wp, w0, uf, qr, u, um, rmask, 16, 1, 16, NK, FLAT).to(tl.int32)
        dl, dh = nibble_dots(q, xl, xh)
        s_at = _unit_at(r, u, NK)
        d = tl.load(_f16_plane(wp[None, :], o1) + s_at, mask=m2, other=0).to(tl.float32)
        # sum of d (q - 8) x over the block = d (q . x - 8 sum(x))
        out = d * ((dl + dh) - 8.0 * sx[None, :])
    elif QT == Q8_0:
        q8r = r * (NK * 32)  # a row's quants: a block's 32 bytes a unit
        lo = unit_bytes(wp, w0, uf, q8r, u, um, rmask, 32, 1, 16, NK, FLAT)
        hi = unit_bytes(wp, w0, uf, q8r + 16, u, um, rmask, 32, 1, 16, NK, FLAT)
        # int8 + 128 is the byte with its top bit flipped: four a word, one XOR
        lo = words(lo.to(tl.int32)) ^ SIGN_BYTES
        hi = words(hi.to(tl.int32)) ^ SIGN_BYTES
        dl, dh = byte_dots(lo, hi, xl, xh, 128.0)
        d = tl.load(_f16_plane(wp[None, :], o1) + _unit_at(r, u, NK), mask=m2, other=0)
        out = d.to(tl.float32) * (dl + dh)
    elif QT == Q6_K:
        ql = unit_bytes(wp, w0, uf, qr, u, um, rmask, 16, 1, 16, NK, FLAT).to(tl.int32)
        qh = unit_bytes(wp, w0, uf, o1 + r * (NK * 8), u, um, rmask, 16, 2, 16, NK, FLAT)
        # four elements a word: their high bits 2 (u % 2) .. + 1 (the low half's) and + 2 .. + 3
        # (the high half's) of each qh byte, moved to bits 4-5 of each byte
        qs = words(qh.to(tl.int32)) >> (4 * (u % 2))[None, :, None]
        qlw = words(ql)
        lo = (qlw & 0x0F0F0F0F) | ((qs << 4) & 0x30303030)
        hi = ((qlw >> 4) & 0x0F0F0F0F) | ((qs << 2) & 0x30303030)
        dl, dh = byte_dots(lo, hi, xl, xh, 32.0)
        s6 = (r * (NK * 2))[:, None] + (16 * (u // 8) + u % 8)[None, :]
        s_lo = tl.load(wp[None, :] + o2 + s6, mask=m2, other=0).to(tl.int8, bitcast=True)
        s_hi = tl.load(wp[None, :] + o2 + s6 + 8, mask=m2, other=0).to(tl.int8, bitcast=True)
        d = tl.load(_f16_plane(wp[None, :], o3) + db, mask=m2, other=0).to(tl.float32)
        out = d * (s_lo.to(tl.float32) * dl + s_hi.to(tl.float32) * dh)
    else:  # the gathered types: their tiles in quant.unit_kernels
        out = unit_dot(wp, o1, o2, o3, o4, r, rmask, u, um, NK, QT, xl, xh, sx, w0, uf, FLAT)
    return out


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
    NU: tl.constexpr = K // (8 if QT == F32 or QT == F16 or QT == BF16 else 32)
    u = u0 + tl.arange(0, T)
    um = u < NU
    wp = w + tl.zeros([T], tl.int32)
    if QT == F32 or QT == F16 or QT == BF16:
        uf = u0 + tl.arange(0, T * 8) // 8
        return float_tile(wp, r, rmask, u, um, K, x, nw, rms, 8 * u, QT, XIN, w, uf, True)
    elif QT == IQ3_XXS or QT == IQ3_S:
        return grid_tile(wp, o1, o2, o3, o4, r, rmask, u, um, K // 32, QT, x, nw, rms, 32 * u, XIN)
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
    NU: tl.constexpr = K // (8 if QT == F32 or QT == F16 or QT == BF16 else 32)
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
               NK: tl.constexpr, x, QT: tl.constexpr):  # fmt: skip
    """One step of ``dot_rows2``'s single pass: units u0 .. u0 + T - 1 of both matrices with
    the same input, ([BN, T], [BN, T]), through ``k_tile`` (the input tile loaded once for
    both)."""
    u = u0 + tl.arange(0, T)
    um = u < NK
    wp = w + tl.zeros([T], tl.int32)
    vp = v + tl.zeros([T], tl.int32)
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
    ONE_PASS: tl.constexpr = (
        QT != F32 and QT != F16 and QT != BF16 and QT != IQ3_XXS and QT != IQ3_S
    )  # fmt: skip
    if ONE_PASS:
        r = rows.to(tl.int64)
        NK: tl.constexpr = K // 32
        FULL: tl.constexpr = NK // T if TAIL > 0 else (NK + T - 1) // T
        acc_a = tl.zeros([BN, T], tl.float32)
        acc_b = tl.zeros([BN, T], tl.float32)
        for i in tl.static_range(FULL):
            ya, yb = _pair_step(w, o1, o2, o3, o4, v, p1, p2, p3, p4, r, rmask, i * T, T, NK, x,
                                QT)  # fmt: skip
            acc_a += ya
            acc_b += yb
        a = tl.sum(acc_a, 1)
        c = tl.sum(acc_b, 1)
        if TAIL > 0:
            ya, yb = _pair_step(w, o1, o2, o3, o4, v, p1, p2, p3, p4, r, rmask, FULL * T, TAIL,
                                NK, x, QT)  # fmt: skip
            a += tl.sum(ya, 1)
            c += tl.sum(yb, 1)
    else:
        a = dot_rows(w, o1, o2, o3, o4, rows, rmask, K, x, x, 1.0, QT, False, BN, T, TAIL)
        c = dot_rows(v, p1, p2, p3, p4, rows, rmask, K, x, x, 1.0, QT, False, BN, T, TAIL)
    return a, c


def unit_elements(qtype: int) -> int:
    """Elements of one unit of ``dot_rows``'s tiles: 32 (a K-quant or IQ sub-block, a block of
    the 32-element types and Q8_0) or 8 (plain floats: 16 or 32 bytes)."""
    return 32 if qtype in {int(t) for t in UNIT32_TYPES} else 8


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
    "MAX_UNITS",
    "UNIT32_TYPES",
    "dot_rows",
    "dot_rows2",
    "float_tile",
    "k_input",
    "k_tile",
    "launch_regs",
    "plane_offsets",
    "step_warps",
    "steps",
    "unit_elements",
    "warps_for",
]
