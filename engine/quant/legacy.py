"""The plain floats and the types of 32-element blocks: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1, IQ4_NL and MXFP4, each described once (``quant/format.py``).

Every unpack is plain vectorised torch on any device, doing ``gguf.quants``' float32 products in
its order (no fused multiply-add), so the values are gguf-py's bit for bit. In every 4-bit type of
this family element k of a block is the low nibble of quant byte k and element 16 + k its high
nibble: the kernels' unit order already, so the repacked planes are the file's fields gathered
(the non-linear types add their 16 levels as float32, once per matrix).
"""

from __future__ import annotations

import gguf.quants
import torch

from strata.engine.quant.format import (
    FLOAT,
    Format,
    Plane,
    Q,
    bits_of,
    copied,
    f16,
    fields,
    float_table,
    nibbles,
    part,
    view,
)

# The 16 non-linear levels of IQ4_NL / IQ4_XS (ggml's kvalues_iq4nl) and MXFP4's e2m1 values,
# doubled (ggml's kvalues_mxfp4; the block's scale is halved to match), from gguf-py's tables.
IQ4_NL_LEVELS: tuple[int, ...] = tuple(gguf.quants.IQ4_NL.kvalues)
MXFP4_LEVELS: tuple[int, ...] = tuple(gguf.quants.MXFP4.kvalues)


def _quants(blocks: torch.Tensor, fmt_fields: tuple, name: str = "qs") -> torch.Tensor:
    """The 32 nibbles of a block's 16 quant bytes in element order: [N, 32] uint8."""
    qs = part(blocks, next(f for f in fmt_fields if f.name == name))
    return nibbles(qs, dim=1).reshape(qs.shape[0], 32)


def _fifth_bits(blocks: torch.Tensor, fmt_fields: tuple) -> torch.Tensor:
    """The 5th bit of each element: bit i of the little-endian uint32 qh. -> [N, 32] uint8"""
    qh = view(part(blocks, next(f for f in fmt_fields if f.name == "qh")), torch.int32)
    return bits_of(qh[:, 0], 32).to(torch.uint8)


# -- plain floats: a "block" is one value ------------------------------------------------------


def _unpack_f32(blocks: torch.Tensor) -> torch.Tensor:
    return view(blocks, torch.float32).clone()


def _unpack_f16(blocks: torch.Tensor) -> torch.Tensor:
    return view(blocks, torch.float16).float()


def _unpack_bf16(blocks: torch.Tensor) -> torch.Tensor:
    # bf16 is the top half of an f32: shift the bits up (exact, NaN payloads included)
    return (view(blocks, torch.int16).to(torch.int32) << 16).view(torch.float32)


def _float(qtype: Q, size: int, unpack) -> Format:
    f = fields(("w", size))
    return Format(qtype, 1, f, (copied(f[0]),), unpack, kernel=FLOAT)


F32 = _float(Q.F32, 4, _unpack_f32)
F16 = _float(Q.F16, 2, _unpack_f16)
BF16 = _float(Q.BF16, 2, _unpack_bf16)


# -- Q8_0: d f16 | 32 x int8; value = q * d -------------------------------------------------

_Q8_0 = fields(("d", 2), ("qs", 32))


def _unpack_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = f16(blocks, 0)  # [N, 1]
    return part(blocks, _Q8_0[1]).view(torch.int8).float() * d


Q8_0 = Format(Q.Q8_0, 32, _Q8_0, (copied(_Q8_0[1]), copied(_Q8_0[0])), _unpack_q8_0)


# -- Q4_0: d f16 | 16 bytes; value = d * (q - 8) ---------------------------------------------

_Q4_0 = fields(("d", 2), ("qs", 16))


def _unpack_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _quants(blocks, _Q4_0)  # [N, 32] in 0..15
    return f16(blocks, 0) * (q.to(torch.int8) - 8).float()


Q4_0 = Format(Q.Q4_0, 32, _Q4_0, (copied(_Q4_0[1]), copied(_Q4_0[0])), _unpack_q4_0)


# -- Q4_1: d f16 | m f16 | 16 bytes; value = (d * q) + m ----------------------------------------

_Q4_1 = fields(("d", 2), ("m", 2), ("qs", 16))


def _unpack_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _quants(blocks, _Q4_1).float()
    return (f16(blocks, 0) * q) + f16(blocks, 2)


Q4_1 = Format(
    Q.Q4_1, 32, _Q4_1, (copied(_Q4_1[2]), copied(_Q4_1[0]), copied(_Q4_1[1])), _unpack_q4_1
)


# -- Q5_0: d f16 | qh u32 (bit i: element i's 5th bit) | 16 bytes; value = d * (q - 16) ------

_Q5_0 = fields(("d", 2), ("qh", 4), ("qs", 16))


def _unpack_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _quants(blocks, _Q5_0) | (_fifth_bits(blocks, _Q5_0) << 4)  # [N, 32] in 0..31
    return f16(blocks, 0) * (q.to(torch.int8) - 16).float()


Q5_0 = Format(
    Q.Q5_0, 32, _Q5_0, (copied(_Q5_0[2]), copied(_Q5_0[1]), copied(_Q5_0[0])), _unpack_q5_0
)


# -- Q5_1: d f16 | m f16 | qh u32 | 16 bytes; value = (d * q) + m -------------------------------

_Q5_1 = fields(("d", 2), ("m", 2), ("qh", 4), ("qs", 16))


def _unpack_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    q = (_quants(blocks, _Q5_1) | (_fifth_bits(blocks, _Q5_1) << 4)).float()
    return (f16(blocks, 0) * q) + f16(blocks, 2)


Q5_1 = Format(
    Q.Q5_1,
    32,
    _Q5_1,
    (copied(_Q5_1[3]), copied(_Q5_1[2]), copied(_Q5_1[0]), copied(_Q5_1[1])),
    _unpack_q5_1,
)


# -- IQ4_NL: d f16 | 16 bytes of level indices; value = d * level ------------------------------

_IQ4_NL = fields(("d", 2), ("qs", 16))
LEVELS_PLANE = Plane("lv", 0, None, fixed_bytes=4 * 16)  # the 16 levels as float32


def levels(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _unpack_iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    idx = _quants(blocks, _IQ4_NL).long()
    return f16(blocks, 0) * levels(IQ4_NL_LEVELS, blocks.device)[idx]


IQ4_NL = Format(
    Q.IQ4_NL,
    32,
    _IQ4_NL,
    (copied(_IQ4_NL[1]), copied(_IQ4_NL[0]), LEVELS_PLANE),
    _unpack_iq4_nl,
    tables={"lv": float_table(IQ4_NL_LEVELS)},
)


# -- MXFP4: e (E8M0 exponent) | 16 bytes of e2m1 indices; value = half(2^(e-127)) * level -----

_MXFP4 = fields(("e", 1), ("qs", 16))


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """2^(e - 128) as float32, exactly (ggml's e8m0 to float, halved): the bits are
    (e - 1) << 23 for e >= 2, and the subnormals 2^-128 and 2^-127 for e = 0 and 1."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _unpack_mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    d = e8m0_half(blocks[:, :1])  # [N, 1]
    idx = _quants(blocks, _MXFP4).long()
    return d * levels(MXFP4_LEVELS, blocks.device)[idx]


MXFP4 = Format(
    Q.MXFP4,
    32,
    _MXFP4,
    (copied(_MXFP4[1]), copied(_MXFP4[0]), LEVELS_PLANE),
    _unpack_mxfp4,
    tables={"lv": float_table(MXFP4_LEVELS)},
)

FORMATS = (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4)
