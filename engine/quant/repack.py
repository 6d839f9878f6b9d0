"""The kernel layout: quantised weights repacked once so a matrix-vector kernel reads them at full
bandwidth, keeping the exact values.

A GGUF block interleaves its fields (Q4_K: d, dmin, 12 bytes of packed 6-bit scales, 128 bytes of
nibbles), so a row of a matrix is a run of 144-byte records whose parts a kernel must pick apart
with narrow, unaligned loads. Repacked, a matrix of ``rows`` x ``cols`` is a few **planes**, one
per field, each ``[rows, blocks per row * bytes per block]`` and starting ``PLANE_ALIGN``-aligned:
the quants of a row are contiguous (wide coalesced loads), the small fields sit in their own
planes, and the packed 6-bit scales and mins are unpacked to one byte each. A plane may instead
be one fixed run of bytes per matrix (``Plane.fixed_bytes``: IQ4_XS's table of levels), so a
kernel finds it in the matrix's own bytes.

The quants are reordered so that a kernel tile of one **unit** (32 consecutive elements: a
K-quant or IQ4_XS sub-block, a whole Q4_0 block; u counts them from the row's start) is simple:
in every 4-bit plane byte ``16 u + k`` holds element ``32 u + k`` in its low nibble and element
``32 u + 16 + k`` in its high nibble (Q4_K, Q5_K, IQ4_XS, Q4_0: one scale per unit; Q6_K's low
bits: groups 2u and 2u + 1, whose scales sit at ``u`` and ``8 + u`` of a block's scale plane).
Q6_K's high two bits of element ``64 g + 16 t + m`` are bits ``2t`` of byte ``16 g + m`` of its
``qh`` plane; Q5_K's fifth bits are one little-endian uint32 per unit, bit j of word u for
element ``32 u + j``. Per type, in plane order (bytes per block):

- Q4_K: qs 128 (nibbles), sc 8, mn 8 (6-bit scales and mins, a byte each), d 2, dm 2 (f16).
- Q5_K: qs 128 (low 4 bits, as Q4_K), qh 32 (fifth bits), sc 8, mn 8, dd 4 (f16 d then dmin).
- Q6_K: ql 128, qh 64, sc 16 (int8: even groups, then odd ones), d 2.
- IQ4_XS: qs 128 (level indices), sc 8 (int8: the 6-bit scale - 32), d 2, and lv: the 16
  IQ4_NL levels as float32, 64 bytes once per matrix.
- Q8_0: qs 32 (int8), d 2. Q4_0: qs 16, d 2. F32, F16, BF16: one plane, the file's bytes.

Nothing is rounded on the way: dequantising a repacked matrix gives the reference's values bit
for bit (``dequantize_repacked`` here does the reference's products in the reference's order, and
the tests compare it with ``reference.dequantize`` on every type).

This module is the format's one description (the planes and their order) and its torch twin; the
Triton kernels that repack on a GPU and read the planes compute the same offsets from the same
rule (``plane offset = sum of the earlier planes, each rounded up to PLANE_ALIGN``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import gguf
import torch

from strata.engine.quant import reference
from strata.engine.quant.reference import check_args

Q = gguf.GGMLQuantizationType
QK_K = gguf.QK_K
PLANE_ALIGN = 256  # every plane starts on a 256-byte boundary (16-byte vector loads and more)


@dataclass(frozen=True)
class Plane:
    """One field of every block, gathered. ``src`` is the byte range of a raw block it copies
    (``None``: computed from the block, e.g. the unpacked scales). A plane with ``fixed_bytes``
    is instead that many bytes once per matrix, whatever its shape (``block_bytes`` 0: a row
    holds none of it; its bytes are ``FIXED_PLANES[qtype, name]``)."""

    name: str
    block_bytes: int
    src: tuple[int, int] | None
    fixed_bytes: int = 0


_K4 = 2 * reference.F16_SIZE  # Q4_K / Q5_K: where the 12 bytes of packed scales start
_K5_QH = _K4 + reference.K_SCALE_SIZE  # Q5_K: where the 32 bytes of fifth bits start
PLANES: dict[Q, tuple[Plane, ...]] = {
    Q.Q4_K: (
        Plane("qs", QK_K // 2, None),  # reordered nibbles (module docstring)
        Plane("sc", QK_K // 32, None),  # 6-bit scales, one byte each
        Plane("mn", QK_K // 32, None),  # 6-bit mins
        Plane("d", 2, (0, 2)),
        Plane("dm", 2, (2, 4)),
    ),
    Q.Q5_K: (
        Plane("qs", QK_K // 2, None),  # low 4 bits, reordered as Q4_K's
        Plane("qh", QK_K // 8, None),  # fifth bits: a uint32 per sub-block
        Plane("sc", QK_K // 32, None),
        Plane("mn", QK_K // 32, None),
        Plane("dd", 4, (0, 4)),  # d, dmin
    ),
    Q.Q6_K: (
        Plane("ql", QK_K // 2, None),  # reordered low 4 bits
        Plane("qh", QK_K // 4, None),  # reordered high 2 bits
        Plane("sc", QK_K // 16, None),  # int8 scales: even groups, then odd ones
        Plane("d", 2, (208, 210)),
    ),
    Q.IQ4_XS: (
        Plane("qs", QK_K // 2, (8, 136)),  # the file's order is the unit order already
        Plane("sc", QK_K // 32, None),  # int8: the 6-bit scale - 32
        Plane("d", 2, (0, 2)),
        Plane("lv", 0, None, fixed_bytes=4 * len(reference.IQ4_NL_LEVELS)),  # float32 levels
    ),
    Q.Q8_0: (
        Plane("qs", 32, (2, 34)),
        Plane("d", 2, (0, 2)),
    ),
    Q.Q4_0: (
        Plane("qs", 16, (2, 18)),  # the file's order is the unit order already
        Plane("d", 2, (0, 2)),
    ),
    # plain floats are their own kernel layout: one plane, the file's bytes
    Q.F32: (Plane("w", 4, (0, 4)),),
    Q.F16: (Plane("w", 2, (0, 2)),),
    Q.BF16: (Plane("w", 2, (0, 2)),),
}
# The bytes of each per-matrix plane: [fixed_bytes] uint8.
FIXED_PLANES: dict[tuple[Q, str], torch.Tensor] = {
    (Q.IQ4_XS, "lv"): torch.tensor(reference.IQ4_NL_LEVELS, dtype=torch.float32).view(torch.uint8)
}
REPACKED_TYPES: frozenset[Q] = frozenset(PLANES)

# The plane sizes (bytes per block; a fixed plane's bytes per matrix) that the Triton kernels
# (``repack_kernels``, ``kernels.dot``, ``kernels.gemm``) are written for: they compute offsets
# from these numbers, so a change to PLANES must fail here first, at import.
KERNEL_PLANE_BYTES: dict[Q, tuple[tuple[int, int], ...]] = {
    Q.Q4_K: ((128, 0), (8, 0), (8, 0), (2, 0), (2, 0)),
    Q.Q5_K: ((128, 0), (32, 0), (8, 0), (8, 0), (4, 0)),
    Q.Q6_K: ((128, 0), (64, 0), (16, 0), (2, 0)),
    Q.IQ4_XS: ((128, 0), (8, 0), (2, 0), (0, 64)),
    Q.Q8_0: ((32, 0), (2, 0)),
    Q.Q4_0: ((16, 0), (2, 0)),
}
for _qtype, _sizes in KERNEL_PLANE_BYTES.items():
    assert tuple((p.block_bytes, p.fixed_bytes) for p in PLANES[_qtype]) == _sizes, _qtype
FLOAT_TYPES: frozenset[Q] = frozenset({Q.F32, Q.F16, Q.BF16})

for _qtype, _planes in PLANES.items():  # the planes hold exactly a block's bytes (or more)
    assert sum(p.block_bytes for p in _planes) >= gguf.GGML_QUANT_SIZES[_qtype][1]
    for _p in _planes:
        assert (_p.block_bytes == 0) == (_p.fixed_bytes > 0), (_qtype.name, _p.name)
        assert not _p.fixed_bytes or FIXED_PLANES[_qtype, _p.name].numel() == _p.fixed_bytes


def align(n: int, to: int = PLANE_ALIGN) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class RepackedLayout:
    """Where each plane of a ``rows`` x ``cols`` matrix of ``qtype`` lives in its buffer."""

    qtype: Q
    rows: int
    cols: int
    offsets: tuple[int, ...]  # byte offset of each plane, in PLANES order
    row_bytes: tuple[int, ...]  # bytes of one row in each plane
    nbytes: int

    @property
    def blocks_per_row(self) -> int:
        return self.cols // gguf.GGML_QUANT_SIZES[self.qtype][0]

    def plane(self, data: torch.Tensor, name: str) -> torch.Tensor:
        """The plane ``name`` of ``data`` as ``[rows, row bytes]`` uint8 (a view), or
        ``[fixed_bytes]`` for a plane of one run per matrix."""
        for p, off, rb in zip(PLANES[self.qtype], self.offsets, self.row_bytes, strict=True):
            if p.name != name:
                continue
            if p.fixed_bytes:
                return data[off : off + p.fixed_bytes]
            return data[off : off + self.rows * rb].view(self.rows, rb)
        raise KeyError(f"{self.qtype.name} has no plane {name!r}")


def repacked_layout(qtype: Q | int, shape: Sequence[int]) -> RepackedLayout:
    """The layout of a 2-D matrix (torch order: rows, then the quantised dimension). A 1-D
    weight is one row. Raises naming the type or the shape when it cannot be repacked."""
    qtype = Q(qtype)
    if qtype not in PLANES:
        names = ", ".join(t.name for t in sorted(PLANES))
        raise ValueError(f"{qtype.name} has no kernel layout (types with one: {names})")
    dims = tuple(shape)
    if len(dims) == 1:
        dims = (1, dims[0])
    if len(dims) != 2:
        raise ValueError(f"shape {tuple(shape)} of {qtype.name}: only matrices are repacked")
    rows, cols = dims
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if cols % block:
        raise ValueError(f"shape {dims} of {qtype.name}: {cols} is not a multiple of {block}")
    nb = cols // block
    offsets, row_bytes, at = [], [], 0
    for p in PLANES[qtype]:
        at = align(at)
        offsets.append(at)
        row_bytes.append(nb * p.block_bytes)
        at += rows * nb * p.block_bytes + p.fixed_bytes
    return RepackedLayout(qtype, rows, cols, tuple(offsets), tuple(row_bytes), at)


# ---------------------------------------------------------------------------------------------
# The torch twin: repack raw GGUF bytes, and dequantise a repacked buffer.


def repack(raw: torch.Tensor, qtype: Q | int, shape: Sequence[int]) -> torch.Tensor:
    """Raw GGUF bytes of a matrix -> its kernel layout: [nbytes] uint8 on ``raw``'s device
    (padding between planes is zero)."""
    qtype, _ = check_args(raw, qtype, shape)
    lay = repacked_layout(qtype, shape)
    out = torch.zeros(lay.nbytes, dtype=torch.uint8, device=raw.device)
    type_size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = raw.reshape(lay.rows * lay.blocks_per_row, type_size)  # [N * nb, type_size]
    computed = {}
    if qtype in (Q.Q4_K, Q.Q5_K):
        sc, mn = reference._scale_min_k4(blocks[:, _K4 : _K4 + reference.K_SCALE_SIZE])
        qs_at = _K5_QH + (QK_K // 8 if qtype == Q.Q5_K else 0)
        qs = blocks[:, qs_at:].reshape(-1, 4, 32)
        q = torch.stack((qs & 0x0F, qs >> 4), dim=2).reshape(-1, 8, 2, 16)  # element 32s + 16h + k
        computed = {"qs": q[:, :, 0] | (q[:, :, 1] << 4), "sc": sc, "mn": mn}
        if qtype == Q.Q5_K:  # bit s of raw qh byte e -> bit e % 8 of byte 4 s + e // 8
            qh = blocks[:, _K5_QH : _K5_QH + QK_K // 8]  # [NB, 32]
            shifts = torch.arange(8, dtype=torch.uint8, device=raw.device)
            bits = (qh[:, None, :] >> shifts[:, None]) & 0x01  # [NB, s, e]
            words = (bits.reshape(-1, 8, 4, 8) << shifts).sum(dim=3, dtype=torch.uint8)
            computed["qh"] = words  # [NB, 8 sub-blocks, 4 bytes]
    elif qtype == Q.IQ4_XS:
        computed = {"sc": _iq4_xs_scales(blocks).to(torch.int8).view(torch.uint8)}
    elif qtype == Q.Q6_K:
        q = _q6_values(blocks)  # [NB, 256] in 0..63
        pairs = q.reshape(-1, 8, 2, 16)
        high = (q >> 4).reshape(-1, 4, 4, 16)  # [NB, g, t, m]: element 64 g + 16 t + m
        shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=raw.device)[:, None]
        sc = blocks[:, 192:208]
        computed = {
            "ql": (pairs[:, :, 0] & 0x0F) | ((pairs[:, :, 1] & 0x0F) << 4),
            "qh": (high << shifts).sum(dim=2, dtype=torch.uint8),
            "sc": torch.cat((sc[:, 0::2], sc[:, 1::2]), dim=1),
        }
    for p in PLANES[qtype]:
        if p.fixed_bytes:
            lay.plane(out, p.name).copy_(FIXED_PLANES[qtype, p.name])
            continue
        values = computed[p.name] if p.src is None else blocks[:, p.src[0] : p.src[1]]
        dst = lay.plane(out, p.name)
        dst.copy_(values.reshape(dst.shape))
    return out


def _iq4_xs_scales(blocks: torch.Tensor) -> torch.Tensor:
    """The signed scales (6 bits - 32) of the 8 sub-blocks of raw IQ4_XS blocks: [NB, 8] int32.
    Low 4 bits: nibble j % 2 of scales_l[j // 2] (bytes 4..7); high 2: bits 2j of scales_h."""
    sh = blocks[:, 2].to(torch.int32) | (blocks[:, 3].to(torch.int32) << 8)  # [NB]
    j = torch.arange(QK_K // 32, dtype=torch.int32, device=blocks.device)
    high = (sh[:, None] >> (2 * j)) & 0x03
    low = torch.stack((blocks[:, 4:8] & 0x0F, blocks[:, 4:8] >> 4), dim=2).reshape(-1, 8)
    return (low.to(torch.int32) | (high << 4)) - 32


def _q6_values(blocks: torch.Tensor) -> torch.Tensor:
    """The 6-bit quants (before the - 32) of raw Q6_K blocks, in element order: [NB, 256] uint8."""
    n = blocks.shape[0]
    ql = blocks[:, :128].reshape(n, 2, 64)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    low = torch.stack((ql & 0x0F, ql >> 4), dim=2).reshape(n, QK_K)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=blocks.device)[:, None]
    high = ((qh >> shifts) & 0x03).reshape(n, QK_K)
    return low | (high << 4)


def dequantize_repacked(
    data: torch.Tensor,
    qtype: Q | int,
    shape: Sequence[int],
    rows: slice | torch.Tensor | None = None,
) -> torch.Tensor:
    """A repacked matrix (or the rows ``rows`` of it: a slice or a tensor of row numbers) as
    float32: bit-identical to ``reference.dequantize`` of the raw bytes it was made from."""
    lay = repacked_layout(qtype, shape)
    if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() < lay.nbytes:
        raise ValueError(
            f"repacked {lay.qtype.name} {tuple(shape)} needs a 1-D uint8 buffer of "
            f"{lay.nbytes} bytes, got {data.dtype} {tuple(data.shape)}"
        )
    sel = rows if rows is not None else slice(0, lay.rows)
    if isinstance(sel, slice):
        n = len(range(*sel.indices(lay.rows)))
    else:
        sel = sel.to(device=data.device, dtype=torch.long)
        n = sel.numel()

    def plane(name: str) -> torch.Tensor:  # [n, row bytes]
        return lay.plane(data, name)[sel]

    qt, nb = lay.qtype, lay.blocks_per_row
    if qt in FLOAT_TYPES:
        w = plane("w").contiguous().reshape(-1)
        return reference.dequantize(w, qt, (n, lay.cols))
    if qt == Q.Q5_K:  # d and dmin side by side: [n, nb, 1] each
        d, dm = plane("dd").contiguous().view(torch.float16).float().reshape(n, nb, 2, 1).unbind(2)
    else:
        d = plane("d").contiguous().view(torch.float16).float()[:, :, None]  # [n, nb, 1]
    if qt == Q.Q8_0:
        q = plane("qs").view(torch.int8).float().reshape(n, nb, 32)
        return (q * d).reshape(n, lay.cols)
    if qt == Q.Q4_0:
        qs = plane("qs").reshape(n, nb, 16)
        q = torch.cat((qs & 0x0F, qs >> 4), dim=2)  # [n, nb, 32]
        return (d * (q.to(torch.int8) - 8).float()).reshape(n, lay.cols)
    if qt == Q.IQ4_XS:
        qs = plane("qs").reshape(n, nb, 8, 16)
        idx = torch.cat((qs & 0x0F, qs >> 4), dim=3).long()  # [n, nb, 8, 32]
        levels = lay.plane(data, "lv").view(torch.float32)  # [16], from the matrix's own bytes
        dl = (d * plane("sc").view(torch.int8).float().reshape(n, nb, 8))[..., None]
        return (dl * levels[idx]).reshape(n, lay.cols)  # (d * scale) * level, as the reference
    if qt in (Q.Q4_K, Q.Q5_K):
        qs = plane("qs").reshape(n, nb, 8, 16)
        q = torch.cat((qs & 0x0F, qs >> 4), dim=3)  # [n, nb, 8, 32]
        if qt == Q.Q5_K:  # bit i of qh byte 4s + b: element 32s + 8b + i
            qh = plane("qh").reshape(n, nb, 8, 4, 1)
            shifts = torch.arange(8, dtype=torch.uint8, device=data.device)
            q |= ((qh >> shifts) & 0x01).reshape(n, nb, 8, 32) << 4
        else:
            dm = plane("dm").contiguous().view(torch.float16).float()[:, :, None]
        q = q.float()
        d_sub = (d * plane("sc").reshape(n, nb, 8).float())[..., None]  # [n, nb, 8, 1]
        m_sub = (dm * plane("mn").reshape(n, nb, 8).float())[..., None]
        q.mul_(d_sub)  # (q * d_sub) - m_sub: the reference's two roundings
        q.sub_(m_sub)
        return q.reshape(n, lay.cols)
    if qt == Q.Q6_K:
        ql = plane("ql").reshape(n, nb, 8, 1, 16)
        low = torch.cat((ql & 0x0F, ql >> 4), dim=3).reshape(n, nb, QK_K)
        qh = plane("qh").reshape(n, nb, 4, 1, 16)
        shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=data.device)[:, None]
        high = ((qh >> shifts) & 0x03).reshape(n, nb, QK_K)
        q = ((low | (high << 4)).to(torch.int8) - 32).float().reshape(n, nb, 16, 16)
        sc = plane("sc").view(torch.int8).float().reshape(n, nb, 2, 8)
        scales = sc.transpose(2, 3).reshape(n, nb, 16)  # back to group order
        return ((d * scales)[..., None] * q).reshape(n, lay.cols)
    raise AssertionError(f"no dequantiser for repacked {qt.name}")  # PLANES and this agree
