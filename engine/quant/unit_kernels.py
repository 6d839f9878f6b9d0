"""Triton decoders of the gathered types' repacked planes: one function per format that every
kernel reading those types shares (the dequantiser here in ``repack_kernels``, the prompt-chunk
GEMM of ``kernels.gemm``) and ``unit_dot``, the decode dot products' tile (``kernels.dot``;
the grid types' decode tile is ``kernels.columns.grid_tile``, on the constants here).

``unit_halves`` gives the values of units ``u`` (32 elements each, counted from a row's start)
of rows ``r`` as two float32 tiles ``[BN, T, 16]``: elements 32u + k (the low half) and
32u + 16 + k (the high half), k < 16, computed with the reference's products in its order, so a
launch with ``enable_fp_fusion=False`` is bit-identical to the reference. Plane offsets (o1..o4,
after the first plane at 0) come from ``repack.repacked_layout``; what each plane holds and how a
type's bits are ordered is said once, in the type's description (``quant/legacy.py``,
``quant/kquants.py``, ``quant/grids.py``), and the constants below come from those descriptions.

With ``TRITON_INTERPRET=1`` set before the import the decoders run on CPU tensors.
"""

from __future__ import annotations

import os

import gguf
import triton
import triton.language as tl

from strata.engine.quant import grids, kquants, legacy
from strata.engine.quant.format import Q
from strata.engine.quant.repack import GATHERED_TYPES

# GGML type ids the kernels dispatch on (constexpr), from gguf's table.
Q4_1: tl.constexpr = tl.constexpr(int(Q.Q4_1))
Q5_0: tl.constexpr = tl.constexpr(int(Q.Q5_0))
Q5_1: tl.constexpr = tl.constexpr(int(Q.Q5_1))
IQ4_NL: tl.constexpr = tl.constexpr(int(Q.IQ4_NL))
MXFP4: tl.constexpr = tl.constexpr(int(Q.MXFP4))
Q2_K: tl.constexpr = tl.constexpr(int(Q.Q2_K))
Q3_K: tl.constexpr = tl.constexpr(int(Q.Q3_K))
IQ3_XXS: tl.constexpr = tl.constexpr(int(Q.IQ3_XXS))
IQ3_S: tl.constexpr = tl.constexpr(int(Q.IQ3_S))
F32: tl.constexpr = tl.constexpr(int(Q.F32))  # (the plain floats: ``unit_bytes``'s pointers)
F16: tl.constexpr = tl.constexpr(int(Q.F16))
BF16: tl.constexpr = tl.constexpr(int(Q.BF16))

# The types ``unit_halves`` decodes: the gathered ones, less Q8_0 / Q4_0 and the plain floats,
# which the kernels read with tiles of their own.
HALVES_TYPES: frozenset[Q] = frozenset(GATHERED_TYPES) - {Q.Q8_0, Q.Q4_0, Q.F32, Q.F16, Q.BF16}


def _plane_bytes(f, name: str) -> tl.constexpr:
    return tl.constexpr(f.plane(name).block_bytes)


# bytes per block of each plane the decoders step through, from the descriptions
Q4_BYTES: tl.constexpr = _plane_bytes(legacy.Q4_1, "qs")  # 16: 32 nibbles
assert all(f.plane("qs").block_bytes == 16 for f in (legacy.Q5_0, legacy.Q5_1, legacy.IQ4_NL))
assert legacy.MXFP4.plane("qs").block_bytes == 16
K2_QS: tl.constexpr = _plane_bytes(kquants.Q2_K, "qs")  # 64: 2 bits a value
assert kquants.Q3_K.plane("qs").block_bytes == K2_QS
Q2K_SC: tl.constexpr = _plane_bytes(kquants.Q2_K, "sc")  # 16: a scale and min per 16
Q3K_HM: tl.constexpr = _plane_bytes(kquants.Q3_K, "hm")  # 32
Q3K_SC: tl.constexpr = _plane_bytes(kquants.Q3_K, "sc")  # 12: 16 packed 6-bit scales
IQ3XXS_QS: tl.constexpr = _plane_bytes(grids.IQ3_XXS, "qs")  # 64: an index per 4
IQ3XXS_SS: tl.constexpr = _plane_bytes(grids.IQ3_XXS, "ss")  # 32: a word per unit
IQ3S_QS: tl.constexpr = _plane_bytes(grids.IQ3_S, "qs")  # 64
IQ3S_HS: tl.constexpr = _plane_bytes(grids.IQ3_S, "hs")  # 44: qh 8 | signs 32 | scales 4
IQ3S_SG: tl.constexpr = tl.constexpr(grids.IQ3_S.field("sg").at - grids.IQ3_S.field("qh").at)
IQ3S_SC: tl.constexpr = tl.constexpr(grids.IQ3_S.field("sc").at - grids.IQ3_S.field("qh").at)
K_UNITS: tl.constexpr = tl.constexpr(gguf.QK_K // 32)  # units in a 256-element block
assert all(f.units == K_UNITS for f in (kquants.Q2_K, kquants.Q3_K, grids.IQ3_S, grids.IQ3_XXS))


@triton.jit
def _elements(p, QT: tl.constexpr):
    """A matrix's uint8 pointer as one to its elements: the floats' own, else bytes."""
    if QT == F32:
        return p.to(tl.pointer_type(tl.float32))
    elif QT == F16:
        return p.to(tl.pointer_type(tl.float16))
    elif QT == BF16:
        return p.to(tl.pointer_type(tl.uint16))
    else:
        return p


@triton.jit
def _unit_offset(u, STEP: tl.constexpr, UDIV: tl.constexpr, STEP2: tl.constexpr,
                 UDIV2: tl.constexpr):  # fmt: skip
    """STEP * (u // UDIV) + STEP2 * ((u // UDIV2) % 2), the terms that are 0 or 1 left out."""
    if UDIV > 1:
        u_s = u // UDIV
    else:
        u_s = u
    if STEP2 > 0:
        return u_s * STEP + ((u // UDIV2) % 2) * STEP2
    else:
        return u_s * STEP


@triton.jit
def unit_bytes(wp, w0, uf, at_r, u, um, rmask, STEP: tl.constexpr, UDIV: tl.constexpr,
               W: tl.constexpr, NU: tl.constexpr, FLAT: tl.constexpr, QT: tl.constexpr = -1,
               STEP2: tl.constexpr = 0, UDIV2: tl.constexpr = 1):  # fmt: skip
    """[BN, T, W]: the W elements (bytes; the floats' own for F32, F16, BF16: ``QT``) at
    at_r[r] + STEP * (u // UDIV) + STEP2 * ((u // UDIV2) % 2) + k (k < W) of each row r and
    unit u, from the unit's matrix (wp: [T] pointers), masked by rmask and um.

    FLAT: loaded as a [BN, T * W] tile whose W elements of a unit are contiguous, then
    reshaped; w0 the matrix (a pointer, or [T * W] of them: each lane's unit's), uf [T * W]
    each lane's unit (u[lane // W], written so the compiler sees it constant over W lanes),
    the units past NU masked (a caller masks a lane by giving it such a unit). Loaded as
    [BN, T, W], the rows and the units are alike to Triton's layout choice (neither
    contiguous), and releases break that tie differently: 3.9 gives each thread all BN rows of
    its unit, as the kernels intend; 3.6 spreads the rows over the lanes, so every thread holds
    the input of BN units (compiled for sm_90: 252 registers a thread for Qwen3-30B-A3B's
    gate/up, not 84). Flat, the units are the contiguous dimension in both."""
    if FLAT:
        T: tl.constexpr = u.shape[0]
        BN: tl.constexpr = at_r.shape[0]
        at = (
            at_r[:, None]
            + (_unit_offset(uf, STEP, UDIV, STEP2, UDIV2) + tl.arange(0, T * W) % W)[None, :]
        )
        m = rmask[:, None] & (uf < NU)[None, :]
        v = tl.load(_elements(w0, QT) + at, mask=m, other=0)
        return tl.reshape(v, [BN, T, W])
    else:
        k = tl.arange(0, W)
        uo = _unit_offset(u, STEP, UDIV, STEP2, UDIV2)
        p = _elements(wp, QT)[None, :, None] + at_r[:, None, None] + uo[None, :, None]
        m3 = rmask[:, None, None] & um[None, :, None]
        return tl.load(p + k[None, None, :], mask=m3, other=0)


@triton.jit
def _f16(p, at, m):
    """The halves at byte offsets ``at`` from ``p`` (uint8 pointers), as float32."""
    return tl.load((p + 2 * at).to(tl.pointer_type(tl.float16)), mask=m, other=0).to(tl.float32)


@triton.jit
def _u8(p, at, m):
    return tl.load(p + at, mask=m, other=0).to(tl.int32)


@triton.jit
def _u32(p, at, m):
    return tl.load((p + 4 * at).to(tl.pointer_type(tl.uint32)), mask=m, other=0)


def _level_words(levels: tuple[int, ...]) -> tuple[tl.constexpr, ...]:
    """16 int8 levels as four int32 words, byte j of word i holding level 4i + j."""
    assert len(levels) == 16 and all(-128 <= v < 128 for v in levels)
    words = []
    for i in range(0, 16, 4):
        w = sum((v & 0xFF) << (8 * j) for j, v in enumerate(levels[i : i + 4]))
        words.append(tl.constexpr(w - (1 << 32) if w >= 1 << 31 else w))
    return tuple(words)


NL_W0, NL_W1, NL_W2, NL_W3 = _level_words(legacy.IQ4_NL_LEVELS)


def _biased_words(levels: tuple[int, ...]) -> tuple[tl.constexpr, ...]:
    """``_level_words`` of the levels plus 128 (0..255, each byte unsigned): ``level_dot``'s."""
    return _level_words(tuple(v + 128 - 256 * (v >= 0) for v in levels))


NLU_W0, NLU_W1, NLU_W2, NLU_W3 = _biased_words(legacy.IQ4_NL_LEVELS)
MXU_W0, MXU_W1, MXU_W2, MXU_W3 = _biased_words(legacy.MXFP4_LEVELS)
_INTERPRETED: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def prmt(a, b, c):
    """PTX ``prmt.b32`` (a byte permute, one instruction): byte i of the result is byte
    (c >> 4i) & 15 of the eight bytes of b:a (a's are 0-3), each selector's bit 3 clear (set,
    the hardware would copy the byte's sign instead). int32 tensors; in Triton's interpreter,
    the same from shifts."""
    if _INTERPRETED:
        out = a * 0
        for i in tl.static_range(4):
            s = (c >> (4 * i)) & 7
            v = tl.where(s < 4, a >> (8 * (s & 3)), b >> (8 * (s & 3))) & 0xFF
            out = out | (v << (8 * i))
        return out
    else:
        return tl.inline_asm_elementwise(
            "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True,
            pack=1,
        )  # fmt: skip


@triton.jit
def _level_pair(qs, ch, sh: tl.constexpr, MX: tl.constexpr):
    """Four levels plus 128, as the bytes of a word, of the four nibbles at bits sh .. sh + 15
    of the words (``level_dot``): each nibble's three low bits pick a byte of the low and of
    the high half of the table, its fourth which of the two."""
    sel = qs >> sh
    if MX:
        return prmt(prmt(MXU_W0, MXU_W1, sel), prmt(MXU_W2, MXU_W3, sel), ch >> sh)
    else:
        return prmt(prmt(NLU_W0, NLU_W1, sel), prmt(NLU_W2, NLU_W3, sel), ch >> sh)


@triton.jit
def byte_float(t, byte: tl.constexpr, bias: tl.constexpr):
    """Byte ``byte`` (0..3) of the int32 words t, less ``bias``, as float32, exactly: the byte
    put under the exponent of 2^23 (``u_float``'s) by one byte permute, and a subtraction.
    The selector is written into the instruction and the constant is the permute's first
    operand: as a register operand, or with the constant last, the compiler rematerialises a
    constant before each permute."""
    if _INTERPRETED:  # (the same value; a permute's emulation costs the interpreter more)
        return ((t >> (8 * byte)) & 0xFF).to(tl.float32) - bias
    elif byte == 0:
        f = _magic_prmt(t, "prmt.b32 $0, $1, $2, 0x3004;")
    elif byte == 1:
        f = _magic_prmt(t, "prmt.b32 $0, $1, $2, 0x3005;")
    elif byte == 2:
        f = _magic_prmt(t, "prmt.b32 $0, $1, $2, 0x3006;")
    else:
        f = _magic_prmt(t, "prmt.b32 $0, $1, $2, 0x3007;")
    return f.to(tl.float32, bitcast=True) - (TWO23 + bias)


@triton.jit
def _magic_prmt(t, asm: tl.constexpr):
    return tl.inline_asm_elementwise(
        asm, "=r,r,r", [t * 0 + MAGIC, t], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def _level(t, byte: tl.constexpr):
    """Byte ``byte`` of t, a level plus 128, as the float32 level."""
    return byte_float(t, byte, 128.0)


@triton.jit
def level_dot(q, xl, xh, MX: tl.constexpr = False):
    """A 16-level type's levels dotted with the input: IQ4_NL's (and IQ4_XS's), or with MX
    MXFP4's (its e2m1 values doubled). q [BN, T, 16] a unit's bytes (int32, byte k: element
    k's index in its low nibble, 16 + k's in its high one), xl, xh [T, 16] -> [BN, T], the sum
    of level(q & 15) xl + level(q >> 4) xh. Four bytes go into a word, and three byte permutes
    (PTX ``prmt``) look up four nibbles' levels at once, as llama.cpp's CUDA kernels do; a
    level becomes a float with one more permute and a subtraction (``nl_level``'s selects and
    conversion cost twice Q4_K's instructions an element)."""
    if _INTERPRETED:  # the levels an element at a time: the permutes are the GPU's, tested there
        if MX:
            lo, hi = mxfp4_level(q & 15), mxfp4_level(q >> 4)
        else:
            lo, hi = nl_level(q & 15), nl_level(q >> 4)
        return tl.sum(lo * xl[None, :, :], 2) + tl.sum(hi * xh[None, :, :], 2)
    w = words(q)  # bytes 4w .. 4w + 3: [BN, T, 4]
    qs = w & 0x77777777
    ch = ((w >> 1) & 0x44444444) | 0x32103210  # byte i from the low table or the high one
    t0 = _level_pair(qs, ch, 0, MX)  # the levels of b0's low, b0's high, b1's low, b1's high
    t1 = _level_pair(qs, ch, 16, MX)  # b2's and b3's
    l0, l1, l2, l3 = _quarters(xl[None, :, :])
    h0, h1, h2, h3 = _quarters(xh[None, :, :])
    acc = _level(t0, 0) * l0  # (a chain of fused multiply-adds)
    acc = _level(t0, 2) * l1 + acc
    acc = _level(t1, 0) * l2 + acc
    acc = _level(t1, 2) * l3 + acc
    acc = _level(t0, 1) * h0 + acc
    acc = _level(t0, 3) * h1 + acc
    acc = _level(t1, 1) * h2 + acc
    acc = _level(t1, 3) * h3 + acc
    return tl.sum(acc, 2)


@triton.jit
def words(q):
    """[BN, T, 16] bytes (int32, one a lane) -> [BN, T, 4] words, bytes 4w .. 4w + 3 in w (the
    compiler keeps the loaded words)."""
    if _INTERPRETED:  # (fewer operations for the interpreter, the same words)
        b = tl.reshape(q, [q.shape[0], q.shape[1], 4, 4]) << (8 * tl.arange(0, 4))
        return tl.sum(b, 3)
    b0, b1, b2, b3 = _quarters(q)
    return b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)


@triton.jit
def _bytes_dot(t, x0, x1, x2, x3, bias: tl.constexpr):
    """Bytes 0..3 of the words t, less bias, as floats, times x0..x3 ([1, T, 4] each), summed:
    four byte permutes, four subtractions, a multiply and three fused multiply-adds."""
    acc = byte_float(t, 0, bias) * x0
    acc = byte_float(t, 1, bias) * x1 + acc
    acc = byte_float(t, 2, bias) * x2 + acc
    acc = byte_float(t, 3, bias) * x3 + acc
    return tl.sum(acc, 2)


@triton.jit
def byte_dots(lo, hi, xl, xh, bias: tl.constexpr):
    """A unit's values as the bytes of words, less ``bias``, dotted with the input: lo, hi
    [BN, T, 4] (byte j of word w: element 4w + j of the low half, of the high half), xl, xh
    [T, 16] -> ([BN, T], [BN, T]). A byte permute, a subtraction and a fused multiply-add an
    element (``byte_float``)."""
    if _INTERPRETED:  # every byte at once (fewer operations for the interpreter)
        return _bytes_dot_interpreted(lo, xl, bias), _bytes_dot_interpreted(hi, xh, bias)
    l0, l1, l2, l3 = _quarters(xl[None, :, :])
    h0, h1, h2, h3 = _quarters(xh[None, :, :])
    return _bytes_dot(lo, l0, l1, l2, l3, bias), _bytes_dot(hi, h0, h1, h2, h3, bias)


@triton.jit
def _bytes_dot_interpreted(t, x, bias: tl.constexpr):
    """``_bytes_dot`` of words t [BN, T, 4] and x [T, 16] (element 4w + j: byte j of word w)."""
    b = (t[:, :, :, None] >> (8 * tl.arange(0, 4))[None, None, None, :]) & 0xFF
    v = tl.reshape(b, [t.shape[0], t.shape[1], 16]).to(tl.float32) - bias
    return tl.sum(v * x[None, :, :], 2)


@triton.jit
def nibble_dots(q, xl, xh):
    """The low and the high nibbles of a unit's bytes dotted with the input: q [BN, T, 16]
    (int32, byte k), xl, xh [T, 16] -> ([BN, T], [BN, T]), the sums of (q & 15) xl and
    (q >> 4) xh, from four bytes a word: a mask (and a shift) for four nibbles, then
    ``byte_dots``."""
    w = words(q)
    return byte_dots(w & 0x0F0F0F0F, (w >> 4) & 0x0F0F0F0F, xl, xh, 0.0)


@triton.jit
def fifth_bits(h):
    """A unit's fifth bits as ``byte_dots``' words: h [BN, T] holds element k's in bit k and
    16 + k's in bit 16 + k (Q5_0, Q5_1, Q5_K); -> ([BN, T, 4], [BN, T, 4]), bit 4 of byte j of
    word w set for element 4w + j (of the low half, of the high half). Four bits go to bits 4,
    12, 20, 28 by one multiplication: bit j's partial products land at j + 4 + 7i, never the
    same place twice, so nothing carries."""
    hw = h.to(tl.int32, bitcast=True)[:, :, None] >> (4 * tl.arange(0, 4))[None, None, :]
    lo = ((hw & 15) * 0x02040810) & 0x10101010
    hi = (((hw >> 16) & 15) * 0x02040810) & 0x10101010
    return lo, hi


@triton.jit
def _quarters(v):
    """[A, B, 16] -> four [A, B, 4]: elements 4w + j for j = 0, 1, 2, 3."""
    e, o = tl.split(tl.reshape(v, [v.shape[0], v.shape[1], 4, 2, 2]))  # (4w + 2i, 4w + 2i + 1)
    v0, v2 = tl.split(e)
    v1, v3 = tl.split(o)
    return v0, v1, v2, v3


assert legacy.MXFP4_LEVELS == (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


@triton.jit
def nl_level(q):
    """IQ4_NL's (and IQ4_XS's) level of index q (int32, 0..15) as float32: a byte of the packed
    words, picked with selects and shifts (the repack kernel writes IQ4_XS's table with it). A
    gather from a table in memory costs a load per element, and the pipeliner stages such
    loads as float32 tiles in shared memory."""
    w = tl.where(q < 8, tl.where(q < 4, NL_W0, NL_W1), tl.where(q < 12, NL_W2, NL_W3))
    b = (w >> (8 * (q & 3))) & 0xFF
    return ((b ^ 0x80) - 0x80).to(tl.float32)


@triton.jit
def mxfp4_level(q):
    """MXFP4's level of index q (int32, 0..15): its e2m1 value doubled (0 1 2 3 4 6 8 12, bit 3
    the sign), as float32 built from the bits: exponent e = bits 1-2, mantissa bit 0; e > 0 is
    2^e (1 + m / 2), e = 0 is 2m (exactly the levels' table, without a load)."""
    e = (q >> 1) & 3
    m = q & 1
    bits = tl.where(e > 0, ((e + 127) << 23) | (m << 22), m * 0x3F800000)
    bits = bits | tl.where((q & 7) != 0, (q & 8) << 28, 0)  # (index 8 is +0, as the table's)
    return bits.to(tl.float32, bitcast=True)


# 2^23 as float32 bits: (v | MAGIC), read as a float, is exactly 2^23 + v for 0 <= v < 2^23
# (``u_float``).
MAGIC: tl.constexpr = tl.constexpr(0x4B000000)
TWO23: tl.constexpr = tl.constexpr(8388608.0)


@triton.jit
def u_float(v, bias: tl.constexpr):
    """int32 v in [0, 2^23) -> float32(v - bias), exactly: an OR (integer pipe) and a
    subtraction (float pipe). Where the compiler would convert a narrow integer (I2F.S16 and
    the like, the conversion pipe's eighth of the issue rate) and the kernel is not already
    bound by its integer operations, this is cheaper; a 32-bit source converts with I2FP, as
    cheap as this."""
    return (v | MAGIC).to(tl.float32, bitcast=True) - (TWO23 + bias)


SIGN_BIT: tl.constexpr = tl.constexpr(-(1 << 31))
# e8m0 exponents above this scale every non-zero MXFP4 value past 2^72, an infinity in float16
E8M0_HI: tl.constexpr = tl.constexpr(200)
# MXFP4's doubled level magnitudes (0 1 2 3 4 6 8 12) as the nibbles of one word, nibble x for
# index x (its three low bits)
MX_MAGS: tl.constexpr = tl.constexpr(
    sum(v << (4 * x) for x, v in enumerate(legacy.MXFP4_LEVELS[:8])) - (1 << 32)
)


@triton.jit
def mxfp4_value(shift, sign, d, d_two23):
    """An MXFP4 element times its block's scale d (float32), as float32, from its index's three
    low bits times 4 (``shift``) and its sign in bit 31 of ``sign``; d_two23 = -2^23 d. The
    magnitude is a nibble of MX_MAGS, read as the float 2^23 + m (an OR), and one fused
    multiply-add gives (2^23 + m) d - 2^23 d = m d, exactly (a power of two apart, no rounding
    while d <= 2^72: ``mxfp4_scales``); the sign is set last, so no select. Index 8 gives -0
    where the table has +0: the same once in a float16 product (the dequantisation uses
    ``mxfp4_level``)."""
    mag = (MX_MAGS >> shift) & 15
    v = tl.fma((mag | MAGIC).to(tl.float32, bitcast=True), d, d_two23)
    return (v.to(tl.int32, bitcast=True) ^ (sign & SIGN_BIT)).to(tl.float32, bitcast=True)


@triton.jit
def mxfp4_scales(e):
    """``mxfp4_value``'s scales of e8m0 exponents e: 2^(e - 128) and -2^(e - 105), e capped at
    E8M0_HI (where every non-zero value is already far past float16's range)."""
    d = _e8m0_half(tl.minimum(e, E8M0_HI))
    return d, d * -TWO23


@triton.jit
def _e8m0_half(e):
    """2^(e - 128) as float32, exactly (legacy.e8m0_half): int32 e in 0..255."""
    bits = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _q3k_scale(wp3, o, blk, g, m):
    """Q3_K's signed 6-bit scale of group g (kquants.q3_k_scales) as float32."""
    lo = (_u8(wp3 + o, blk * Q3K_SC + g % 8, m) >> (4 * (g // 8))) & 0x0F
    hi = (_u8(wp3 + o, blk * Q3K_SC + 8 + g % 4, m) >> (2 * (g // 4))) & 0x03
    return u_float(lo | (hi << 4), 32.0)


@triton.jit
def _iq3_xxs_half(wp3, o1, o2, o3, o4, blk, j, t, m):
    """IQ3_XXS elements t (0..31) of unit j of blocks blk: (db * grid) * sign."""
    idx = _u8(wp3, blk * IQ3XXS_QS + 8 * j + t // 4, m)
    g = _u8(wp3 + o3, 4 * idx + t % 4, m).to(tl.float32)
    w = _u32(wp3 + o1, blk * (IQ3XXS_SS // 4) + j, m)
    s = (w >> 28).to(tl.float32)
    db = _f16(wp3 + o2, blk, m) * (0.5 + s) * 0.5
    pattern = _u8(wp3 + o4, ((w >> (7 * (t // 8))) & 0x7F).to(tl.int32), m)
    v = db * g
    return tl.where(((pattern >> (t % 8)) & 1) != 0, -v, v)


@triton.jit
def _iq3_s_half(wp3, o1, o2, o3, blk, j, t, m):
    """IQ3_S elements t (0..31) of unit j of blocks blk: (db * grid) * sign."""
    i = 8 * j + t // 4  # the grid index's number in the block
    hs = blk * IQ3S_HS
    high = (_u8(wp3 + o1, hs + j, m) >> (t // 4)) & 1
    idx = _u8(wp3, blk * IQ3S_QS + i, m) | (high << 8)
    g = _u8(wp3 + o3, 4 * idx + t % 4, m).to(tl.float32)
    s = (_u8(wp3 + o1, hs + IQ3S_SC + j // 2, m) >> (4 * (j % 2))) & 0x0F
    db = _f16(wp3 + o2, blk, m) * (1 + 2 * s).to(tl.float32)
    sign = (_u8(wp3 + o1, hs + IQ3S_SG + 4 * j + t // 8, m) >> (t % 8)) & 1
    v = db * g
    return tl.where(sign != 0, -v, v)


@triton.jit
def unit_halves(
    wp, o1, o2, o3, o4, r, rm, u, um, NK: tl.constexpr, QT: tl.constexpr, HALF: tl.constexpr = False
):
    """Rows r [BN] (int64) x units u [T] of the repacked ``QT`` matrix: the low and high halves
    of each unit as float32 ([BN, T, 16], [BN, T, 16]). wp: [T] uint8 pointers, each unit's
    matrix (one matrix, or several experts side by side); NK: units in a row. HALF: the caller
    rounds the values to float16, so a type may take a cheaper form whose float16 values are
    the same (MXFP4: ``mxfp4_value``)."""
    k = tl.arange(0, 16)[None, None, :]
    m3 = rm[:, None, None] & um[None, :, None]
    wp3 = wp[None, :, None]
    u3 = u[None, :, None]
    if QT == Q2_K or QT == Q3_K or QT == IQ3_XXS or QT == IQ3_S:
        blk = (r * (NK // K_UNITS))[:, None, None] + u3 // K_UNITS  # [BN, T, 1]
        j = u3 % K_UNITS  # the unit in its block
    else:
        blk = (r * NK)[:, None, None] + u3  # a unit is a block
        j = u3 * 0
    if QT == Q2_K or QT == Q3_K:
        # bits 2 (j % 4) of quant bytes 32 (j // 4) + k (low half) and + 16 + k (high half)
        at = blk * K2_QS + 32 * (j // 4) + k
        sh = 2 * (j % 4)
        q_lo = (_u8(wp3, at, m3) >> sh) & 3
        q_hi = (_u8(wp3, at + 16, m3) >> sh) & 3
        if QT == Q2_K:
            sc_lo = _u8(wp3 + o1, blk * Q2K_SC + 2 * j, m3)
            sc_hi = _u8(wp3 + o1, blk * Q2K_SC + 2 * j + 1, m3)
            d = _f16(wp3 + o2, blk, m3)
            dm = _f16(wp3 + o3, blk, m3)
            lo = (d * (sc_lo & 15).to(tl.float32)) * q_lo.to(tl.float32) - dm * (sc_lo >> 4).to(
                tl.float32
            )
            hi = (d * (sc_hi & 15).to(tl.float32)) * q_hi.to(tl.float32) - dm * (sc_hi >> 4).to(
                tl.float32
            )
        else:  # Q3_K: the third bit is bit j of hmask byte k (16 + k); where it is 0, q - 4
            h_lo = (_u8(wp3 + o1, blk * Q3K_HM + k, m3) >> j) & 1
            h_hi = (_u8(wp3 + o1, blk * Q3K_HM + 16 + k, m3) >> j) & 1
            d = _f16(wp3 + o3, blk, m3)
            # q + 4 h - 4 = (q | 4 h) - 4, as q < 4
            lo = (d * _q3k_scale(wp3, o2, blk, 2 * j, m3)) * u_float(q_lo | (h_lo << 2), 4.0)
            hi = (d * _q3k_scale(wp3, o2, blk, 2 * j + 1, m3)) * u_float(q_hi | (h_hi << 2), 4.0)
    elif QT == IQ3_XXS:
        lo = _iq3_xxs_half(wp3, o1, o2, o3, o4, blk, j, k, m3)
        hi = _iq3_xxs_half(wp3, o1, o2, o3, o4, blk, j, k + 16, m3)
    elif QT == IQ3_S:
        lo = _iq3_s_half(wp3, o1, o2, o3, blk, j, k, m3)
        hi = _iq3_s_half(wp3, o1, o2, o3, blk, j, k + 16, m3)
    else:  # blocks of 32: byte k holds element k (low nibble) and 16 + k (high nibble)
        q = _u8(wp3, blk * Q4_BYTES + k, m3)
        q_lo = q & 15
        q_hi = q >> 4
        if QT == Q5_0 or QT == Q5_1:  # the fifth bits: bit i of the unit's uint32
            h = _u32(wp3 + o1, blk, m3)
            q_lo = q_lo | (((h >> k) & 1) << 4).to(tl.int32)
            q_hi = q_hi | (((h >> (k + 16)) & 1) << 4).to(tl.int32)
        if QT == Q4_1:  # (d * q) + m
            d = _f16(wp3 + o1, blk, m3)
            mn = _f16(wp3 + o2, blk, m3)
            lo = (d * q_lo.to(tl.float32)) + mn
            hi = (d * q_hi.to(tl.float32)) + mn
        elif QT == Q5_1:
            d = _f16(wp3 + o2, blk, m3)
            mn = _f16(wp3 + o3, blk, m3)
            lo = (d * q_lo.to(tl.float32)) + mn
            hi = (d * q_hi.to(tl.float32)) + mn
        elif QT == Q5_0:  # d * (q - 16)
            d = _f16(wp3 + o2, blk, m3)
            lo = d * (q_lo - 16).to(tl.float32)
            hi = d * (q_hi - 16).to(tl.float32)
        elif QT == IQ4_NL:  # d * level
            d = _f16(wp3 + o1, blk, m3)
            lo = d * nl_level(q_lo)
            hi = d * nl_level(q_hi)
        elif HALF:  # MXFP4 for a float16 product
            d, d2 = mxfp4_scales(_u8(wp3 + o1, blk, m3))
            lo = mxfp4_value((q << 2) & 28, q << 28, d, d2)  # the low nibble: bits 0-2, sign 3
            hi = mxfp4_value((q >> 2) & 28, q << 24, d, d2)  # the high: bits 4-6, sign 7
        else:  # MXFP4: half(2^(e - 127)) * level
            d = _e8m0_half(_u8(wp3 + o1, blk, m3))
            lo = d * mxfp4_level(q_lo)
            hi = d * mxfp4_level(q_hi)
    return lo, hi


@triton.jit
def _dq_halves(w, out, rows, row0, o1, o2, o3, o4, NK: tl.constexpr, QT: tl.constexpr,
               S: tl.constexpr, HAS_IDS: tl.constexpr):  # fmt: skip
    """Program (r, c) writes output row r, units [c * S, (c + 1) * S) of it; its source row is
    ``rows[r]`` when HAS_IDS, else ``row0 + r``."""
    i = tl.program_id(0)
    if HAS_IDS:
        src = tl.load(rows + i).to(tl.int64)
    else:
        src = (row0 + i).to(tl.int64)
    u = tl.program_id(1) * S + tl.arange(0, S)
    um = u < NK
    r = src + tl.zeros([1], tl.int64)
    lo, hi = unit_halves(w + tl.zeros([S], tl.int32), o1, o2, o3, o4, r, r >= 0, u, um, NK, QT)
    k = tl.arange(0, 16)
    at = i.to(tl.int64) * (NK * 32) + (32 * u)[None, :, None] + k[None, None, :]
    m = um[None, :, None]
    tl.store(out + at, lo, mask=m)
    tl.store(out + at + 16, hi, mask=m)


def dequantize_launch(data, out, rows, row0: int, n: int, lay, has_ids: bool) -> None:
    """``repack_kernels.dequantize``'s launch for a type of ``HALVES_TYPES``."""
    nk = lay.cols // 32
    s = min(triton.next_power_of_2(max(nk, 1)), 32)
    o = (*lay.offsets[1:], *(0,) * (5 - len(lay.offsets)))
    _dq_halves[(n, triton.cdiv(nk, s))](
        data, out, rows, row0, *o, NK=nk, QT=int(lay.qtype), S=s, HAS_IDS=has_ids,
        enable_fp_fusion=False,
    )  # fmt: skip


@triton.jit
def unit_dot(wp, o1, o2, o3, o4, r, rm, u, um, NK: tl.constexpr, QT: tl.constexpr, xl, xh, sx,
             w0=None, uf=None, FLAT: tl.constexpr = False):  # fmt: skip
    """The decode kernels' tile of a gathered type: rows r [BN] x units u [T] dotted with the
    input halves xl, xh ([T, 16]: elements 32u + k and 32u + 16 + k; sx [T] their sums) ->
    [BN, T]. The scales come out of the sums where the type allows (a scale times an integer
    dot product, minus or plus a min times the input's sum). The grid types are not here: the
    decode kernels read them with ``kernels.columns.grid_tile``. FLAT, w0, uf: the quants' loads
    as ``unit_bytes`` makes them."""
    k = tl.arange(0, 16)[None, None, :]
    m3 = rm[:, None, None] & um[None, :, None]
    m2 = rm[:, None] & um[None, :]
    wp2 = wp[None, :]
    if QT == Q2_K or QT == Q3_K:
        blk2 = (r * (NK // K_UNITS))[:, None] + u[None, :] // K_UNITS  # [BN, T]
        j2 = (u % K_UNITS)[None, :]
        j = j2[:, :, None]
        if FLAT:  # the 32 bytes of units 4i .. 4i + 3 of a block, each unit its 2 bits
            qr = r * (NK // K_UNITS * K2_QS)
            b_lo = unit_bytes(wp, w0, uf, qr, u, um, rm, K2_QS, K_UNITS, 16, NK, True, -1, 32, 4)
            b_hi = unit_bytes(
                wp, w0, uf, qr + 16, u, um, rm, K2_QS, K_UNITS, 16, NK, True, -1, 32, 4
            )
        else:
            at = blk2[:, :, None] * K2_QS + 32 * (j // 4) + k
            b_lo = _u8(wp[None, :, None], at, m3)
            b_hi = _u8(wp[None, :, None], at + 16, m3)
        # four elements a word: the unit's 2 bits of each byte, masked a word at a time
        q_lo = (words(b_lo.to(tl.int32)) >> (2 * (j % 4))) & 0x03030303
        q_hi = (words(b_hi.to(tl.int32)) >> (2 * (j % 4))) & 0x03030303
        if QT == Q2_K:
            sc_lo = _u8(wp2 + o1, blk2 * Q2K_SC + 2 * j2, m2)
            sc_hi = _u8(wp2 + o1, blk2 * Q2K_SC + 2 * j2 + 1, m2)
            d = _f16(wp2 + o2, blk2, m2)
            dm = _f16(wp2 + o3, blk2, m2)
            s_lo = tl.sum(xl, 1)[None, :]
            s_hi = tl.sum(xh, 1)[None, :]
            dl, dh = byte_dots(q_lo, q_hi, xl, xh, 0.0)
            out = d * ((sc_lo & 15).to(tl.float32) * dl)
            out += d * ((sc_hi & 15).to(tl.float32) * dh)
            out -= dm * ((sc_lo >> 4).to(tl.float32) * s_lo + (sc_hi >> 4).to(tl.float32) * s_hi)
        else:  # Q3_K: q - 4 where the hmask bit is 0
            if FLAT:
                hr = o1 + r * (NK // K_UNITS * Q3K_HM)
                h_lo = unit_bytes(wp, w0, uf, hr, u, um, rm, Q3K_HM, K_UNITS, 16, NK, True)
                h_hi = unit_bytes(wp, w0, uf, hr + 16, u, um, rm, Q3K_HM, K_UNITS, 16, NK, True)
            else:
                blk = blk2[:, :, None]
                h_lo = _u8(wp[None, :, None] + o1, blk * Q3K_HM + k, m3)
                h_hi = _u8(wp[None, :, None] + o1, blk * Q3K_HM + 16 + k, m3)
            # (q | 4 h) - 4, as in unit_halves, four a word: bit j of each hmask byte to bit 2
            h_lo = ((words(h_lo.to(tl.int32)) >> j) & 0x01010101) << 2
            h_hi = ((words(h_hi.to(tl.int32)) >> j) & 0x01010101) << 2
            lo, hi = byte_dots(q_lo | h_lo, q_hi | h_hi, xl, xh, 4.0)
            d = _f16(wp2 + o3, blk2, m2)
            out = d * (_q3k_scale(wp2, o2, blk2, 2 * j2, m2) * lo)
            out += d * (_q3k_scale(wp2, o2, blk2, 2 * j2 + 1, m2) * hi)
    else:  # blocks of 32: a unit is a block
        blk2 = (r * NK)[:, None] + u[None, :]
        if FLAT:
            q = unit_bytes(wp, w0, uf, r * (NK * Q4_BYTES), u, um, rm, Q4_BYTES, 1, 16, NK, True)
            q = q.to(tl.int32)
        else:
            q = _u8(wp[None, :, None], blk2[:, :, None] * Q4_BYTES + k, m3)
        if QT == IQ4_NL:  # a scale times the levels' dot product
            out = _f16(wp2 + o1, blk2, m2) * level_dot(q, xl, xh)
        elif QT == MXFP4:  # the scale times the levels' dot product
            out = _e8m0_half(_u8(wp2 + o1, blk2, m2)) * level_dot(q, xl, xh, True)
        else:  # four elements a word (``byte_dots``)
            w = words(q)
            q_lo = w & 0x0F0F0F0F
            q_hi = (w >> 4) & 0x0F0F0F0F
            if QT == Q5_0 or QT == Q5_1:
                if FLAT:  # (a [BN, T] load: units contiguous)
                    h = _u32(wp2 + o1, blk2, m2)
                else:
                    h = tl.max(_u32(wp[None, :, None] + o1, blk2[:, :, None], m3), 2)
                f_lo, f_hi = fifth_bits(h)
                q_lo = q_lo | f_lo
                q_hi = q_hi | f_hi
            dl, dh = byte_dots(q_lo, q_hi, xl, xh, 0.0)
            dot = dl + dh
            if QT == Q4_1:  # sum of (d q + m) x = d (q . x) + m sum(x)
                out = _f16(wp2 + o1, blk2, m2) * dot + _f16(wp2 + o2, blk2, m2) * sx[None, :]
            elif QT == Q5_1:
                out = _f16(wp2 + o2, blk2, m2) * dot + _f16(wp2 + o3, blk2, m2) * sx[None, :]
            else:  # Q5_0: d (q . x - 16 sum(x))
                out = _f16(wp2 + o2, blk2, m2) * (dot - 16.0 * sx[None, :])
    return out
