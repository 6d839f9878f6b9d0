"""Torch reference dequantisers for GGUF tensors, checked bit for bit against ``gguf.quants``.

Each type's unpack is part of its one description (``quant/formats.py``); this module is the
entry point that checks a call and cuts the bytes into blocks. Every unpack is plain vectorised
torch: it runs on whatever device the bytes are on (CPU or CUDA) and never loops over blocks in
Python. The GPU kernels are checked against these.

Arithmetic follows ``gguf.quants`` operation by operation (same products, same order, no fused
multiply-add), so the results are bit-identical to it, not just close.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import gguf
import torch

from strata.engine.errors import UnsupportedQuantType
from strata.engine.quant.format import F16_SIZE
from strata.engine.quant.formats import FORMATS, SUPPORTED_NAMES, SUPPORTED_TYPES, fmt
from strata.engine.quant.kquants import K_SCALE_SIZE
from strata.engine.quant.legacy import IQ4_NL_LEVELS, MXFP4_LEVELS

__all__ = [
    "F16_SIZE",
    "IQ4_NL_LEVELS",
    "K_SCALE_SIZE",
    "MXFP4_LEVELS",
    "SUPPORTED_TYPES",
    "check_args",
    "dequantize",
    "tensor_nbytes",
]

Q = gguf.GGMLQuantizationType


def _known_type(qtype: gguf.GGMLQuantizationType | int) -> gguf.GGMLQuantizationType:
    try:
        qtype = Q(qtype)
    except ValueError:
        raise UnsupportedQuantType(
            f"quant type {qtype!r} is not a GGML type (supported: {SUPPORTED_NAMES})"
        ) from None
    if qtype not in gguf.GGML_QUANT_SIZES:
        raise UnsupportedQuantType(
            f"quant type {qtype.name} has no known block size (supported: {SUPPORTED_NAMES})"
        )
    return qtype


def _sizes(qtype: gguf.GGMLQuantizationType) -> tuple[int, int]:
    """(elements, bytes) of a block: the description's, or gguf's for a type without one."""
    if qtype in FORMATS:
        f = FORMATS[qtype]
        return f.block, f.type_size
    return gguf.GGML_QUANT_SIZES[qtype]


def _checked_shape(qtype: gguf.GGMLQuantizationType, shape: Sequence[int]) -> tuple[int, ...]:
    try:
        dims = tuple(operator.index(s) for s in shape)
    except TypeError:
        raise ValueError(f"shape {shape!r} for {qtype.name}: dimensions must be ints") from None
    if not dims or any(s < 0 for s in dims):
        raise ValueError(
            f"shape {dims} for {qtype.name}: need at least one dimension, none negative"
        )
    block_size = _sizes(qtype)[0]
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
    block_size, type_size = _sizes(qtype)
    return math.prod(dims) // block_size * type_size


def check_args(
    data: torch.Tensor, qtype: gguf.GGMLQuantizationType | int, shape: Sequence[int]
) -> tuple[gguf.GGMLQuantizationType, tuple[int, ...]]:
    """The type and dimensions of a ``dequantize`` call, or the error that names what is wrong."""
    qtype = _known_type(qtype)
    fmt(qtype)  # raises naming an unsupported type
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
    f = FORMATS[qtype]
    blocks = data.reshape(-1, f.type_size)  # [N, type_size]
    return f.unpack(blocks).reshape(dims)
