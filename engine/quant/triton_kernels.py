"""Triton dequantisers for the block-quantised GGUF types: one launch per weight.

The torch reference (``reference.py``) spends some thirty kernel launches on one weight; on a GPU
that is what a decode step waits for. Each kernel here reads a run of blocks and writes float32
in one launch. The arithmetic is the reference's, product for product and in the same order, and
every launch passes ``enable_fp_fusion=False`` so no multiply and add are fused into one rounding:
the results are bit-identical to the reference, hence to ``gguf.quants`` (the tests check both).

Bytes are read one at a time and wider fields (the f16 scales) are put together from them, so a
run may start at any byte offset (an expert's run inside an arena slot or a mapped file).

This module imports Triton at the top: import it only through ``strata.engine.quant``, which
falls back to the reference where Triton is missing. With ``TRITON_INTERPRET=1`` in the
environment before the import, the same kernels run on CPU tensors (how CI checks them).
"""

from __future__ import annotations

import contextlib

import gguf
import torch
import triton
import triton.language as tl

from strata.engine.quant.reference import IQ4_NL_LEVELS

Q = gguf.GGMLQuantizationType


def _level_words(levels: tuple[int, ...]) -> tuple[int, int]:
    """The 16 IQ4_NL levels (int8 values) as two int64s of eight bytes each, levels 0-7 and
    8-15, byte i of a word holding level 8w + i: a compile-time table the kernels index with a
    shift, so no device tensor of levels is kept anywhere."""
    assert len(levels) == 16 and all(-128 <= v < 128 for v in levels)
    words = []
    for w in range(2):
        word = sum((v & 0xFF) << (8 * i) for i, v in enumerate(levels[8 * w : 8 * w + 8]))
        words.append(word - (1 << 64) if word >= 1 << 63 else word)  # as a signed int64
    return words[0], words[1]


IQ4_LO, IQ4_HI = _level_words(IQ4_NL_LEVELS)


@triton.jit
def iq4_level(q, LO: tl.constexpr, HI: tl.constexpr):
    """IQ4_NL level number ``q`` (0..15, int) as float32, from the words of ``_level_words``."""
    word = tl.where(q < 8, LO, HI).to(tl.int64)
    byte = (word >> ((q % 8) * 8).to(tl.int64)) & 0xFF
    return ((byte ^ 0x80) - 0x80).to(tl.float32)  # the byte as a signed int8


@triton.jit
def _f16_at(base, at: tl.constexpr, ok):
    """The little-endian IEEE half at byte ``at`` of each block, as float32. base: [B, 1]"""
    lo = tl.load(base + at, mask=ok, other=0).to(tl.uint16)
    hi = tl.load(base + at + 1, mask=ok, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _blocks(n_blocks, BPP: tl.constexpr, BS: tl.constexpr):
    """This program's block numbers [BPP, 1] (int64), their mask, and element numbers [1, BS]."""
    blk = (tl.program_id(0) * BPP + tl.arange(0, BPP))[:, None].to(tl.int64)
    return blk, blk < n_blocks, tl.arange(0, BS)[None, :]


@triton.jit
def _k4_scale_min(p, j, ok):
    """6-bit scale and min of sub-block j (0..7) from the 12 packed bytes at p (Q4_K, Q5_K).

    j < 4: scale = p[j] & 63, min = p[j + 4] & 63. j >= 4: the low 4 bits come from p[j + 4]
    (low nibble scale, high nibble min), the high 2 bits from the top of p[j - 4] (scale) and
    p[j] (min). Returns float32 [B, E] each.
    """
    low = j < 4
    a = tl.load(p + tl.where(low, j, j + 4), mask=ok, other=0).to(tl.int32)
    b = tl.load(p + tl.where(low, j + 4, j - 4), mask=ok, other=0).to(tl.int32)
    c = tl.load(p + j, mask=ok, other=0).to(tl.int32)
    scale = tl.where(low, a & 63, (a & 0x0F) | ((b >> 6) << 4))
    mins = tl.where(low, b & 63, (a >> 4) | ((c >> 6) << 4))
    return scale.to(tl.float32), mins.to(tl.float32)


@triton.jit
def _q4_k_kernel(src, dst, n_blocks, BPP: tl.constexpr):
    # block: d f16 | dmin f16 | 12 bytes scales | qs 128; 8 sub-blocks of 32; qs group g (32
    # bytes) holds sub-block 2g in its low nibbles, 2g+1 in its high ones
    blk, ok, e = _blocks(n_blocks, BPP, 256)
    base = src + blk * 144
    d = _f16_at(base, 0, ok)
    dmin = _f16_at(base, 2, ok)
    j = e // 32
    scale, mins = _k4_scale_min(base + 4, j, ok)
    byte = tl.load(base + 16 + (j // 2) * 32 + e % 32, mask=ok, other=0).to(tl.int32)
    q = ((byte >> ((j % 2) * 4)) & 0x0F).to(tl.float32)
    out = q * (d * scale) - dmin * mins  # two roundings: (q * d_sub) - m_sub, as gguf
    tl.store(dst + blk * 256 + e, out, mask=ok)


@triton.jit
def _q5_k_kernel(src, dst, n_blocks, BPP: tl.constexpr):
    # block: d | dmin | 12 bytes scales | qh 32 | qs 128; bit j of qh byte i is the 5th bit of
    # element i of sub-block j
    blk, ok, e = _blocks(n_blocks, BPP, 256)
    base = src + blk * 176
    d = _f16_at(base, 0, ok)
    dmin = _f16_at(base, 2, ok)
    j = e // 32
    i = e % 32
    scale, mins = _k4_scale_min(base + 4, j, ok)
    byte = tl.load(base + 48 + (j // 2) * 32 + i, mask=ok, other=0).to(tl.int32)
    high = (tl.load(base + 16 + i, mask=ok, other=0).to(tl.int32) >> j) & 1
    q = (((byte >> ((j % 2) * 4)) & 0x0F) | (high << 4)).to(tl.float32)
    out = q * (d * scale) - dmin * mins
    tl.store(dst + blk * 256 + e, out, mask=ok)


@triton.jit
def _q6_k_kernel(src, dst, n_blocks, BPP: tl.constexpr):
    # block: ql 128 | qh 64 | 16 int8 scales | d f16. Half h of 128 elements; element r of a
    # half: low 4 bits = nibble r // 64 of ql[64h + r % 64], high 2 bits = bits 2 * (r // 32)
    # of qh[32h + r % 32]; q - 32 in -32..31; scale = scales[e // 16]
    blk, ok, e = _blocks(n_blocks, BPP, 256)
    base = src + blk * 210
    h = e // 128
    r = e % 128
    low = tl.load(base + 64 * h + r % 64, mask=ok, other=0).to(tl.int32)
    low = (low >> ((r // 64) * 4)) & 0x0F
    high = tl.load(base + 128 + 32 * h + r % 32, mask=ok, other=0).to(tl.int32)
    high = (high >> ((r // 32) * 2)) & 0x03
    q = ((low | (high << 4)) - 32).to(tl.float32)
    sc = tl.load(base + 192 + e // 16, mask=ok, other=0).to(tl.int8, bitcast=True)
    d = _f16_at(base, 208, ok)
    out = (d * sc.to(tl.float32)) * q
    tl.store(dst + blk * 256 + e, out, mask=ok)


@triton.jit
def _q8_0_kernel(src, dst, n_blocks, BPP: tl.constexpr):
    # block: d f16 | 32 x int8
    blk, ok, e = _blocks(n_blocks, BPP, 32)
    base = src + blk * 34
    d = _f16_at(base, 0, ok)
    q = tl.load(base + 2 + e, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    tl.store(dst + blk * 32 + e, q * d, mask=ok)


@triton.jit
def _q4_0_kernel(src, dst, n_blocks, BPP: tl.constexpr):
    # block: d f16 | 16 bytes; element i is the low nibble of byte i, 16 + i its high nibble
    blk, ok, e = _blocks(n_blocks, BPP, 32)
    base = src + blk * 18
    d = _f16_at(base, 0, ok)
    byte = tl.load(base + 2 + e % 16, mask=ok, other=0).to(tl.int32)
    q = (((byte >> ((e // 16) * 4)) & 0x0F) - 8).to(tl.float32)
    tl.store(dst + blk * 32 + e, d * q, mask=ok)


@triton.jit
def _iq4_xs_kernel(src, dst, n_blocks, BPP: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr):
    # block: d f16 | scales_h u16 | scales_l 4 bytes | qs 128. Sub-block j: 6-bit scale with low
    # 4 bits = nibble j % 2 of scales_l[j // 2], high 2 bits = bits 2j of scales_h, minus 32.
    # Element c of sub-block j: nibble c // 16 of qs[16j + c % 16], an IQ4_NL level number.
    blk, ok, e = _blocks(n_blocks, BPP, 256)
    base = src + blk * 136
    d = _f16_at(base, 0, ok)
    j = e // 32
    c = e % 32
    sh = tl.load(base + 2, mask=ok, other=0).to(tl.int32)
    sh = sh | (tl.load(base + 3, mask=ok, other=0).to(tl.int32) << 8)
    sl = tl.load(base + 4 + j // 2, mask=ok, other=0).to(tl.int32)
    scale = (((sl >> ((j % 2) * 4)) & 0x0F) | (((sh >> (2 * j)) & 0x03) << 4)) - 32
    dl = d * scale.to(tl.float32)
    byte = tl.load(base + 8 + 16 * j + c % 16, mask=ok, other=0).to(tl.int32)
    level = iq4_level((byte >> ((c // 16) * 4)) & 0x0F, LO, HI)
    tl.store(dst + blk * 256 + e, dl * level, mask=ok)


# type -> (kernel, blocks per program). A program covers 1024 elements of a 256-element type
# (four blocks), 512 of a 32-element one.
_KERNELS = {
    Q.Q4_K: (_q4_k_kernel, 4),
    Q.Q5_K: (_q5_k_kernel, 4),
    Q.Q6_K: (_q6_k_kernel, 4),
    Q.Q8_0: (_q8_0_kernel, 16),
    Q.Q4_0: (_q4_0_kernel, 16),
    Q.IQ4_XS: (_iq4_xs_kernel, 4),
}
KERNEL_TYPES: frozenset[gguf.GGMLQuantizationType] = frozenset(_KERNELS)


def dequantize_blocks(data: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> torch.Tensor:
    """data: [n_blocks * type_size] contiguous uint8 -> [n_blocks * block_size] float32.

    The caller (``strata.engine.quant.dequantize``) has checked the type, the dtype and that the
    byte count is whole blocks.
    """
    kernel, bpp = _KERNELS[qtype]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = data.numel() // type_size
    out = torch.empty(n_blocks * block_size, dtype=torch.float32, device=data.device)
    if n_blocks == 0:
        return out
    if not data.is_contiguous():
        data = data.contiguous()
    grid = (triton.cdiv(n_blocks, bpp),)
    table = {"LO": IQ4_LO, "HI": IQ4_HI} if qtype == Q.IQ4_XS else {}
    with torch.cuda.device(data.device) if data.is_cuda else contextlib.nullcontext():
        kernel[grid](data, out, n_blocks, BPP=bpp, enable_fp_fusion=False, **table)
    return out
