"""Quantised test data and the bit-for-bit comparison the dequantiser tests share."""

from __future__ import annotations

import gguf
import gguf.quants
import numpy as np
import torch

from strata.engine.quant import tensor_nbytes
from strata.engine.quant.formats import FORMATS

Q = gguf.GGMLQuantizationType

# Byte offsets of the f16 scale fields in each block (the rest of a block is any bytes at all),
# from the types' descriptions: d, m (a min) and dm (dmin).
F16_FIELDS: dict[Q, tuple[int, ...]] = {
    q: tuple(f.at for f in desc.fields if f.name in ("d", "m", "dm") and f.nbytes == 2)
    for q, desc in FORMATS.items()
}
MXFP4_EXPONENTS = (116, 126)  # random MXFP4 blocks: scales 2^-12 .. 2^-3, as the f16 ones


def random_bytes(qtype: Q, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Valid random data of ``shape``: [nbytes] uint8 with every float field finite and small."""
    n = int(np.prod(shape))
    if qtype == Q.F32:
        return rng.uniform(-4, 4, n).astype(np.float32).view(np.uint8)
    if qtype == Q.F16:
        return rng.uniform(-4, 4, n).astype(np.float16).view(np.uint8)
    if qtype == Q.BF16:
        # random bf16 bit patterns whose exponent is in 2**-63 .. 2**63 (finite, normal or zero)
        bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
        exp = rng.integers(64, 191, n, dtype=np.uint16)
        bits = (bits & np.uint16(0x807F)) | (exp << np.uint16(7))
        return bits.view(np.uint8)
    nbytes = tensor_nbytes(qtype, shape)
    type_size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, nbytes, dtype=np.uint8).reshape(-1, type_size)
    if qtype == Q.MXFP4:
        blocks[:, 0] = rng.integers(*MXFP4_EXPONENTS, len(blocks), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        scale = rng.uniform(-0.01, 0.01, len(blocks)).astype(np.float16)
        blocks[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def gguf_reference(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    """gguf-py's dequantisation of ``raw`` as a float32 array of ``shape``."""
    byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
    return gguf.quants.dequantize(raw.reshape(byte_shape), qtype).reshape(shape)


def assert_bit_identical(got: torch.Tensor, want: np.ndarray) -> None:
    assert got.dtype == torch.float32
    assert tuple(got.shape) == want.shape
    want_bits = torch.from_numpy(np.ascontiguousarray(want, dtype=np.float32).view(np.int32))
    got_bits = got.cpu().contiguous().view(torch.int32)
    differ = (got_bits != want_bits).nonzero()
    assert differ.numel() == 0, (
        f"{len(differ)} values differ, first at {differ[0].tolist()}: "
        f"{got.cpu()[tuple(differ[0])].item()!r} vs {want[tuple(differ[0].tolist())]!r}"
    )
