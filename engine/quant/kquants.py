"""The 256-element super-block types: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS, each described once
(``quant/format.py``).

The unpacks do ``gguf.quants``' float32 products in its order, so the values are gguf-py's bit
for bit. Q4_K, Q5_K, Q6_K and IQ4_XS repack into unit-ordered planes with their scales unpacked
to a byte each (``quant/repack.py`` computes them); Q2_K and Q3_K keep the file's fields as
planes, which their kernel decoders read in the file's order: element e of a block is, with
n = e // 128, j = (e % 128) // 32 and l = e % 32, bits 2j of quant byte 32 n + l (Q3_K's
third bit: bit 4 n + j of hmask byte l), and its scale group is e // 16.
"""

from __future__ import annotations

import gguf
import torch

from strata.engine.quant.format import (
    F16_SIZE,
    Format,
    Plane,
    Q,
    copied,
    f16,
    fields,
    float_table,
    nibbles,
    part,
    shifts,
    view,
)
from strata.engine.quant.legacy import IQ4_NL_LEVELS, LEVELS_PLANE, levels

QK_K = gguf.QK_K
K_SCALE_SIZE = 12  # packed 6-bit scales and mins of the 8 sub-blocks of Q4_K / Q5_K


def scale_min_k4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 6-bit scales and mins of the 8 sub-blocks of a Q4_K / Q5_K block.

    packed: [N, 12] as three groups of 4 bytes (d, m, md). Sub-block j < 4: scale = d[j] & 63,
    min = m[j] & 63. Sub-block j >= 4: the low 4 bits come from md[j-4] (low nibble scale, high
    nibble min) and the high 2 bits from the top 2 bits of d[j-4] / m[j-4].
    Returns (scale, min), each [N, 8] uint8.
    """
    n = packed.shape[0]
    d, m, md = packed.reshape(n, 3, 4).unbind(dim=1)  # each [N, 4]
    scale = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)  # [N, 8]
    mins = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)  # [N, 8]
    return scale, mins


def _two_bits(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K / Q3_K quant bytes [N, 64] -> the 2-bit values in element order, [N, 16, 16]."""
    n = qs.shape[0]
    return ((qs.reshape(n, 2, 1, 32) >> shifts(2, 4, qs)) & 0x03).reshape(n, 16, 16)


# -- Q2_K: scales 16 (low nibble scale, high min) | qs 64 | d f16 | dmin f16 --------------------
# value = (d * sc) * q - (dmin * mn)

_Q2_K = fields(("sc", QK_K // 16), ("qs", QK_K // 4), ("d", 2), ("dm", 2))


def _unpack_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    sc = part(blocks, _Q2_K[0])
    dl = (f16(blocks, _Q2_K[2].at) * (sc & 0x0F).float()).reshape(n, 16, 1)
    ml = (f16(blocks, _Q2_K[3].at) * (sc >> 4).float()).reshape(n, 16, 1)
    q = _two_bits(part(blocks, _Q2_K[1])).float()
    return (dl * q - ml).reshape(n, QK_K)


Q2_K = Format(Q.Q2_K, QK_K, _Q2_K, tuple(copied(_Q2_K[i]) for i in (1, 0, 2, 3)), _unpack_q2_k)


# -- Q3_K: hmask 32 | qs 64 | scales 12 (6-bit, packed) | d f16; value = (d * (sc - 32)) * q,
# q = low 2 bits - 4 where the hmask bit is 0

_Q3_K = fields(("hm", QK_K // 8), ("qs", QK_K // 4), ("sc", 12), ("d", 2))


def q3_k_scales(sc: torch.Tensor) -> torch.Tensor:
    """The 16 signed 6-bit scales of Q3_K blocks: [N, 12] -> [N, 16] int32 in -32..31. Group g:
    low 4 bits nibble g // 8 of byte g % 8, high 2 bits bits 2 (g // 4) of byte 8 + g % 4."""
    n = sc.shape[0]
    low = (sc[:, :8].reshape(n, 1, 8) >> shifts(4, 2, sc)).reshape(n, 16) & 0x0F
    high = (sc[:, 8:].reshape(n, 1, 4) >> shifts(2, 4, sc)).reshape(n, 16) & 0x03
    return (low | (high << 4)).to(torch.int32) - 32


def _unpack_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales = q3_k_scales(part(blocks, _Q3_K[2])).float()
    dl = (f16(blocks, _Q3_K[3].at) * scales).reshape(n, 16, 1)
    low = _two_bits(part(blocks, _Q3_K[1]))  # [N, 16, 16]
    hm = part(blocks, _Q3_K[0]).reshape(n, 1, 32)
    high = ((hm >> shifts(1, 8, hm)) & 0x01).reshape(n, 16, 16)  # bit e // 32 of byte e % 32
    q = (low.to(torch.int8) - ((high ^ 1) << 2).to(torch.int8)).float()
    return (dl * q).reshape(n, QK_K)


Q3_K = Format(Q.Q3_K, QK_K, _Q3_K, tuple(copied(_Q3_K[i]) for i in (1, 0, 2, 3)), _unpack_q3_k)


# -- Q4_K / Q5_K: d f16 | dmin f16 | 12 bytes of packed scales | (Q5_K: 32 bytes qh) | 128 qs ---

_Q4_K = fields(("d", 2), ("dm", 2), ("scales", K_SCALE_SIZE), ("qs", QK_K // 2))
_Q5_K = fields(("d", 2), ("dm", 2), ("scales", K_SCALE_SIZE), ("qh", QK_K // 8), ("qs", QK_K // 2))


def _k4_affine(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Apply the Q4_K / Q5_K per-sub-block affine map. q: [N, 8, 32] uint8 -> [N, 256] float32"""
    n = blocks.shape[0]
    d = f16(blocks, 0)  # [N, 1]
    dmin = f16(blocks, F16_SIZE)  # [N, 1]
    scale, mins = scale_min_k4(part(blocks, _Q4_K[2]))  # [N, 8] each
    d_sub = (d * scale.float())[:, :, None]  # [N, 8, 1]
    m_sub = (dmin * mins.float())[:, :, None]  # [N, 8, 1]
    out = q.float()  # [N, 8, 32]
    out.mul_(d_sub)  # two separate roundings, as gguf: (d_sub * q) - m_sub
    out.sub_(m_sub)
    return out.reshape(n, QK_K)


def _unpack_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # qs [N, 128] = 4 groups of 32 bytes; group g holds sub-block 2g in its low nibbles and
    # sub-block 2g+1 in its high nibbles
    n = blocks.shape[0]
    qs = part(blocks, _Q4_K[3]).reshape(n, QK_K // 64, 32)  # [N, 4, 32]
    return _k4_affine(blocks, nibbles(qs, dim=2).reshape(n, QK_K // 32, 32))


def _unpack_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # low 4 bits as Q4_K; bit j of qh byte i is the 5th bit of element i of sub-block j
    n = blocks.shape[0]
    qh = part(blocks, _Q5_K[3])  # [N, 32]
    qs = part(blocks, _Q5_K[4]).reshape(n, QK_K // 64, 32)  # [N, 4, 32]
    low = nibbles(qs, dim=2).reshape(n, QK_K // 32, 32)  # [N, 8, 32]
    high = (qh[:, None, :] >> shifts(1, QK_K // 32, qh)) & 0x01  # [N, 8, 32]
    return _k4_affine(blocks, low | (high << 4))


# Repacked (quant/repack.py): quants in unit order, the 6-bit scales and mins a byte each.
Q4_K = Format(
    Q.Q4_K,
    QK_K,
    _Q4_K,
    (
        Plane("qs", QK_K // 2, None),  # reordered nibbles
        Plane("sc", QK_K // 32, None),  # 6-bit scales, one byte each
        Plane("mn", QK_K // 32, None),  # 6-bit mins
        copied(_Q4_K[0]),
        copied(_Q4_K[1]),
    ),
    _unpack_q4_k,
)
Q5_K = Format(
    Q.Q5_K,
    QK_K,
    _Q5_K,
    (
        Plane("qs", QK_K // 2, None),  # low 4 bits, reordered as Q4_K's
        Plane("qh", QK_K // 8, None),  # fifth bits: a uint32 per sub-block
        Plane("sc", QK_K // 32, None),
        Plane("mn", QK_K // 32, None),
        Plane("dd", 4, (0, 4)),  # d, dmin
    ),
    _unpack_q5_k,
)


# -- Q6_K: ql 128 | qh 64 | 16 x int8 scales | d f16 -------------------------------------------

_Q6_K = fields(("ql", QK_K // 2), ("qh", QK_K // 4), ("sc", QK_K // 16), ("d", 2))


def q6_values(blocks: torch.Tensor) -> torch.Tensor:
    """The 6-bit quants (before the - 32) of raw Q6_K blocks, in element order: [NB, 256] uint8.
    Two halves of 128 elements; in half h, element i takes nibble i // 64 of ql byte
    64h + i % 64 as its low 4 bits and bits 2 * (i // 32) of qh byte 32h + i % 32 as its high 2."""
    n = blocks.shape[0]
    ql = part(blocks, _Q6_K[0]).reshape(n, 2, 64)
    qh = part(blocks, _Q6_K[1]).reshape(n, 2, 1, 32)
    low = nibbles(ql, dim=2).reshape(n, QK_K)
    high = ((qh >> shifts(2, 4, qh)) & 0x03).reshape(n, QK_K)
    return low | (high << 4)


def _unpack_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    q = (q6_values(blocks).to(torch.int8) - 32).float().reshape(n, QK_K // 16, 16)  # [N, 16, 16]
    scales = part(blocks, _Q6_K[2]).view(torch.int8).float()  # [N, 16]
    d = f16(blocks, _Q6_K[3].at)  # [N, 1]
    return ((d * scales)[:, :, None] * q).reshape(n, QK_K)


Q6_K = Format(
    Q.Q6_K,
    QK_K,
    _Q6_K,
    (
        Plane("ql", QK_K // 2, None),  # reordered low 4 bits
        Plane("qh", QK_K // 4, None),  # reordered high 2 bits
        Plane("sc", QK_K // 16, None),  # int8 scales: even groups, then odd ones
        copied(_Q6_K[3]),
    ),
    _unpack_q6_k,
)


# -- IQ4_XS: d f16 | scales_h u16 | scales_l 4 bytes | qs 128 ---------------------------------

_IQ4_XS = fields(("d", 2), ("sh", 2), ("sl", QK_K // 64), ("qs", QK_K // 2))


def iq4_xs_scales(blocks: torch.Tensor) -> torch.Tensor:
    """The signed scales (6 bits - 32) of the 8 sub-blocks of raw IQ4_XS blocks: [NB, 8] int32.
    Sub-block j: low 4 bits nibble j % 2 of scales_l[j // 2], high 2 bits bits 2j of scales_h."""
    n = blocks.shape[0]
    sh = view(part(blocks, _IQ4_XS[1]), torch.int16).to(torch.int32)  # [N, 1]
    j = torch.arange(QK_K // 32, dtype=torch.int32, device=blocks.device)
    high = (sh >> (2 * j)) & 0x03  # [N, 8]
    low = nibbles(part(blocks, _IQ4_XS[2]), dim=2).reshape(n, QK_K // 32)
    return (low.to(torch.int32) | (high << 4)) - 32


def _unpack_iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    # sub-block j's 32 elements are the low then the high nibbles of qs bytes 16j..16j+15, each
    # an index into the IQ4_NL level table
    n = blocks.shape[0]
    dl = (f16(blocks, 0) * iq4_xs_scales(blocks).float())[:, :, None]  # [N, 8, 1]
    qs = part(blocks, _IQ4_XS[3]).reshape(n, QK_K // 32, 16)
    idx = nibbles(qs, dim=2).reshape(n, QK_K // 32, 32)
    return (dl * levels(IQ4_NL_LEVELS, blocks.device)[idx.long()]).reshape(n, QK_K)


IQ4_XS = Format(
    Q.IQ4_XS,
    QK_K,
    _IQ4_XS,
    (
        copied(_IQ4_XS[3]),  # the file's order is the unit order already
        Plane("sc", QK_K // 32, None),  # int8: the 6-bit scale - 32
        copied(_IQ4_XS[0]),
        LEVELS_PLANE,
    ),
    _unpack_iq4_xs,
    tables={"lv": float_table(IQ4_NL_LEVELS)},
)

FORMATS = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS)
