"""Torch reference dequantisers for GGUF tensors, checked bit for bit against ``gguf.quants``.

Every function here is plain vectorised torch: it runs on whatever device the bytes are on (CPU or
CUDA) and never loops over blocks in Python. The GPU kernels are checked against these.

Arithmetic follows ``gguf.quants`` operation by operation (same products, same order, no fused
multiply-add), so the results are bit-identical to it, not just close.
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Callable, Sequence

import gguf
import gguf.quants
import torch

from strata.engine.errors import UnsupportedQuantType

__all__ = ["SUPPORTED_TYPES", "check_args", "dequantize", "tensor_nbytes"]

# Fields wider than a byte are read by viewing the bytes as wider integers, which is only right on
# a little-endian host (GGUF is little-endian; so are x86-64, arm64 and every CUDA device).
assert sys.byteorder == "little", "strata.engine.quant.reference needs a little-endian host"

Q = gguf.GGMLQuantizationType
QK_K = gguf.QK_K
K_SCALE_SIZE = 12  # packed 6-bit scales and mins of the 8 sub-blocks of Q4_K / Q5_K
F16_SIZE = 2  # every block scale below is one IEEE half

# The 16 non-linear levels of IQ4_NL / IQ4_XS (ggml's kvalues_iq4nl), from gguf-py's table.
IQ4_NL_LEVELS: tuple[int, ...] = tuple(gguf.quants.IQ4_NL.kvalues)

# ---------------------------------------------------------------------------------------------
# Byte views. A slice of a block ([N, k] out of [N, type_size]) is strided; torch can view it as
# a wider dtype when its offset and strides are multiples of the new item size. Otherwise (an odd
# offset into a shared buffer, say) the slice is copied first: the values are the same either way.


def _view(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """b: [..., k * itemsize] uint8 -> [..., k] dtype (little-endian reinterpretation)."""
    size = dtype.itemsize
    aligned = (
        b.stride(-1) == 1
        and b.storage_offset() % size == 0
        and all(s % size == 0 for s in b.stride()[:-1])
    )
    if not aligned:
        b = b.clone(memory_format=torch.contiguous_format)  # new storage, offset 0
    return b.view(dtype)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The half at byte ``at`` of each block, as float32. blocks: [N, S] -> [N, 1]"""
    return _view(blocks[:, at : at + F16_SIZE], torch.float16).float()


def _nibbles(b: torch.Tensor, dim: int) -> torch.Tensor:
    """Low then high nibble of each byte, stacked as a new axis at ``dim``. b: uint8"""
    return torch.stack((b & 0x0F, b >> 4), dim=dim)


def _shifts(bits: int, count: int, like: torch.Tensor) -> torch.Tensor:
    """[0, bits, 2*bits, ...] (count entries) as a uint8 column on ``like``'s device: [count, 1]"""
    return torch.arange(0, bits * count, bits, dtype=torch.uint8, device=like.device)[:, None]


# ---------------------------------------------------------------------------------------------
# One unpacker per type: blocks [N, type_size] uint8 -> [N, block_size] float32.


def _unpack_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # blocks: [N, 34] = d f16 | 32 x int8
    d = _f16(blocks, 0)  # [N, 1]
    q = blocks[:, F16_SIZE:].view(torch.int8)  # [N, 32]
    return q.float() * d


def _unpack_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # blocks: [N, 18] = d f16 | 16 bytes; element i is the low nibble of byte i, 16+i its high
    n = blocks.shape[0]
    d = _f16(blocks, 0)  # [N, 1]
    q = _nibbles(blocks[:, F16_SIZE:], dim=1).reshape(n, -1)  # [N, 32] in 0..15
    return d * (q.to(torch.int8) - 8).float()


def _scale_min_k4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


# Q4_K / Q5_K: d f16 | dmin f16 | 12 bytes of packed scales | (Q5_K: 32 bytes qh) | 128 bytes qs
_K4_SCALES = 2 * F16_SIZE
_K4_AFTER_SCALES = _K4_SCALES + K_SCALE_SIZE


def _k4_affine(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Apply the Q4_K / Q5_K per-sub-block affine map. q: [N, 8, 32] uint8 -> [N, 256] float32"""
    n = blocks.shape[0]
    d = _f16(blocks, 0)  # [N, 1]
    dmin = _f16(blocks, F16_SIZE)  # [N, 1]
    scale, mins = _scale_min_k4(blocks[:, _K4_SCALES:_K4_AFTER_SCALES])  # [N, 8] each
    d_sub = (d * scale.float())[:, :, None]  # [N, 8, 1]
    m_sub = (dmin * mins.float())[:, :, None]  # [N, 8, 1]
    out = q.float()  # [N, 8, 32]
    out.mul_(d_sub)  # two separate roundings, as gguf: (d_sub * q) - m_sub
    out.sub_(m_sub)
    return out.reshape(n, QK_K)


def _unpack_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # blocks: [N, 144]; qs [N, 128] = 4 groups of 32 bytes; group g holds sub-block 2g in its low
    # nibbles and sub-block 2g+1 in its high nibbles
    n = blocks.shape[0]
    qs = blocks[:, _K4_AFTER_SCALES:].reshape(n, QK_K // 64, 32)  # [N, 4, 32]
    q = _nibbles(qs, dim=2).reshape(n, QK_K // 32, 32)  # [N, 8, 32]
    return _k4_affine(blocks, q)


def _unpack_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # blocks: [N, 176]; low 4 bits as Q4_K; bit j of qh byte i is the 5th bit of element i of
    # sub-block j
    n = blocks.shape[0]
    qh = blocks[:, _K4_AFTER_SCALES : _K4_AFTER_SCALES + QK_K // 8]  # [N, 32]
    qs = blocks[:, _K4_AFTER_SCALES + QK_K // 8 :].reshape(n, QK_K // 64, 32)  # [N, 4, 32]
    low = _nibbles(qs, dim=2).reshape(n, QK_K // 32, 32)  # [N, 8, 32]
    high = (qh[:, None, :] >> _shifts(1, QK_K // 32, qh)) & 0x01  # [N, 8, 32]
    return _k4_affine(blocks, low | (high << 4))


def _unpack_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # blocks: [N, 210] = ql 128 | qh 64 | 16 x int8 scales | d f16. Two halves of 128 elements;
    # in half h, element i takes nibble i // 64 of ql byte 64h + i % 64 as its low 4 bits and bits
    # 2 * (i // 32) of qh byte 32h + i % 32 as its high 2 bits; q - 32 is in -32..31.
    n = blocks.shape[0]
    ql_end, qh_end = QK_K // 2, QK_K // 2 + QK_K // 4
    sc_end = qh_end + QK_K // 16
    ql = blocks[:, :ql_end].reshape(n, 2, 64)  # [N, 2, 64]
    qh = blocks[:, ql_end:qh_end].reshape(n, 2, 1, 32)  # [N, 2, 1, 32]
    low = _nibbles(ql, dim=2).reshape(n, QK_K)  # [N, 2, 2, 64] -> [N, 256]
    high = ((qh >> _shifts(2, 4, qh)) & 0x03).reshape(n, QK_K)  # [N, 2, 4, 32] -> [N, 256]
    q = ((low | (high << 4)).to(torch.int8) - 32).float().reshape(n, QK_K // 16, 16)  # [N, 16, 16]
    scales = blocks[:, qh_end:sc_end].view(torch.int8).float()  # [N, 16]
    d = _f16(blocks, sc_end)  # [N, 1]
    return ((d * scales)[:, :, None] * q).reshape(n, QK_K)


def _unpack_iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    # blocks: [N, 136] = d f16 | scales_h u16 | scales_l 4 bytes | qs 128. Sub-block j (of 8) has
    # a 6-bit scale: low 4 bits = nibble j % 2 of scales_l[j // 2], high 2 bits = bits 2j of
    # scales_h; scale - 32 is signed. Its 32 elements are the low then the high nibbles of qs
    # bytes 16j..16j+15, each an index into the IQ4_NL level table.
    n = blocks.shape[0]
    sh_at = F16_SIZE
    sl_at = sh_at + 2
    qs_at = sl_at + QK_K // 64
    d = _f16(blocks, 0)  # [N, 1]
    scales_h = _view(blocks[:, sh_at:sl_at], torch.int16).to(torch.int32)  # [N, 1]
    high = (
        scales_h >> (2 * torch.arange(QK_K // 32, dtype=torch.int32, device=blocks.device))
    ) & 0x03  # [N, 8]
    low = _nibbles(blocks[:, sl_at:qs_at], dim=2).reshape(n, QK_K // 32)  # [N, 8]
    scale = (low.to(torch.int32) | (high << 4)) - 32  # [N, 8] in -32..31
    dl = (d * scale.float())[:, :, None]  # [N, 8, 1]
    qs = blocks[:, qs_at:].reshape(n, QK_K // 32, 16)  # [N, 8, 16]
    idx = _nibbles(qs, dim=2).reshape(n, QK_K // 32, 32)  # [N, 8, 32]
    levels = torch.tensor(IQ4_NL_LEVELS, dtype=torch.float32, device=blocks.device)  # [16]
    return (dl * levels[idx.long()]).reshape(n, QK_K)


_UNPACK: dict[gguf.GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q8_0: _unpack_q8_0,
    Q.Q4_0: _unpack_q4_0,
    Q.Q4_K: _unpack_q4_k,
    Q.Q5_K: _unpack_q5_k,
    Q.Q6_K: _unpack_q6_k,
    Q.IQ4_XS: _unpack_iq4_xs,
}

# Each layout above, summed up, must be the size gguf gives the type.
assert _K4_AFTER_SCALES + QK_K // 2 == gguf.GGML_QUANT_SIZES[Q.Q4_K][1]
assert _K4_AFTER_SCALES + QK_K // 8 + QK_K // 2 == gguf.GGML_QUANT_SIZES[Q.Q5_K][1]
assert QK_K // 2 + QK_K // 4 + QK_K // 16 + F16_SIZE == gguf.GGML_QUANT_SIZES[Q.Q6_K][1]
assert F16_SIZE + 2 + QK_K // 64 + QK_K // 2 == gguf.GGML_QUANT_SIZES[Q.IQ4_XS][1]


# Plain float types: the whole byte run is the values. -> [n] float32, a fresh tensor.
def _plain_f32(data: torch.Tensor) -> torch.Tensor:
    return _view(data, torch.float32).clone()


def _plain_f16(data: torch.Tensor) -> torch.Tensor:
    return _view(data, torch.float16).float()


def _plain_bf16(data: torch.Tensor) -> torch.Tensor:
    # bf16 is the top half of an f32: shift the bits up (exact, NaN payloads included)
    return (_view(data, torch.int16).to(torch.int32) << 16).view(torch.float32)


_PLAIN: dict[gguf.GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.F32: _plain_f32,
    Q.F16: _plain_f16,
    Q.BF16: _plain_bf16,
}

SUPPORTED_TYPES: frozenset[gguf.GGMLQuantizationType] = frozenset(_PLAIN) | frozenset(_UNPACK)
_SUPPORTED_NAMES = ", ".join(t.name for t in sorted(SUPPORTED_TYPES))


# ---------------------------------------------------------------------------------------------
# Public API


def _known_type(qtype: gguf.GGMLQuantizationType | int) -> gguf.GGMLQuantizationType:
    try:
        qtype = Q(qtype)
    except ValueError:
        raise UnsupportedQuantType(
            f"quant type {qtype!r} is not a GGML type (supported: {_SUPPORTED_NAMES})"
        ) from None
    if qtype not in gguf.GGML_QUANT_SIZES:
        raise UnsupportedQuantType(
            f"quant type {qtype.name} has no known block size (supported: {_SUPPORTED_NAMES})"
        )
    return qtype


def _checked_shape(qtype: gguf.GGMLQuantizationType, shape: Sequence[int]) -> tuple[int, ...]:
    try:
        dims = tuple(operator.index(s) for s in shape)
    except TypeError:
        raise ValueError(f"shape {shape!r} for {qtype.name}: dimensions must be ints") from None
    if not dims or any(s < 0 for s in dims):
        raise ValueError(
            f"shape {dims} for {qtype.name}: need at least one dimension, none negative"
        )
    block_size = gguf.GGML_QUANT_SIZES[qtype][0]
    if dims[-1] % block_size:
        raise ValueError(
            f"shape {dims} for {qtype.name}: last dimension {dims[-1]} is not a multiple of "
            f"the block size {block_size}"
        )
    return dims


def tensor_nbytes(qtype: gguf.GGMLQuantizationType, shape: Sequence[int]) -> int:
    """Bytes a tensor of logical ``shape`` (torch order, quant blocks along the last dim) takes.

    Works for every type gguf knows a block size for, supported here or not, so an index can
    size tensors it will never dequantise. Raises ValueError for a shape the type cannot hold.
    """
    qtype = _known_type(qtype)
    dims = _checked_shape(qtype, shape)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return math.prod(dims) // block_size * type_size


def check_args(
    data: torch.Tensor, qtype: gguf.GGMLQuantizationType | int, shape: Sequence[int]
) -> tuple[gguf.GGMLQuantizationType, tuple[int, ...]]:
    """The type and dimensions of a ``dequantize`` call, or the error that names what is wrong."""
    qtype = _known_type(qtype)
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedQuantType(
            f"quant type {qtype.name} is not supported (supported: {_SUPPORTED_NAMES})"
        )
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(
            f"data for {qtype.name} must be a 1-D uint8 tensor, got {data.dtype} "
            f"with shape {tuple(data.shape)}"
        )
    dims = _checked_shape(qtype, shape)
    nbytes = tensor_nbytes(qtype, dims)
    if data.numel() != nbytes:
        raise ValueError(
            f"shape {dims} of {qtype.name} takes {nbytes} bytes, but data holds {data.numel()}"
        )
    return qtype, dims


def dequantize(
    data: torch.Tensor, qtype: gguf.GGMLQuantizationType, shape: Sequence[int]
) -> torch.Tensor:
    """Dequantise the raw bytes of one GGUF tensor (or a byte run of one, e.g. one expert).

    data: [nbytes] uint8 on any device. shape: the logical shape in torch order (reversed GGUF
    ``ne``); quant blocks run along the last dim. Returns a new float32 tensor of ``shape`` on
    ``data``'s device; it never aliases ``data``.
    """
    qtype, dims = check_args(data, qtype, shape)
    if data.numel() == 0:
        return torch.empty(dims, dtype=torch.float32, device=data.device)
    if qtype in _PLAIN:
        return _PLAIN[qtype](data).reshape(dims)
    type_size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = data.reshape(-1, type_size)  # [N, type_size]
    return _UNPACK[qtype](blocks).reshape(dims)
