"""The kernel layout: quantised weights repacked once so a matrix-vector kernel reads them at full
bandwidth, keeping the exact values.

A GGUF block interleaves its fields (Q4_K: d, dmin, 12 bytes of packed 6-bit scales, 128 bytes of
nibbles), so a row of a matrix is a run of 144-byte records whose parts a kernel must pick apart
with narrow, unaligned loads. Repacked, a matrix of ``rows`` x ``cols`` is a few **planes**, one
per field, each ``[rows, blocks per row * bytes per block]`` and starting ``PLANE_ALIGN``-aligned:
the quants of a row are contiguous (wide coalesced loads), the small fields sit in their own
planes, and the Q4_K scales and mins are unpacked to one byte each.

The quants are also reordered so that a kernel tile of one sub-block is simple: in both K-quants
byte ``16 s + k`` of a block's low-bits plane holds element ``32 s + k`` in its low nibble and
element ``32 s + 16 + k`` in its high nibble (Q4_K: both of sub-block s, one scale; Q6_K: groups
2s and 2s + 1, whose scales sit at ``s`` and ``8 + s`` of the scale plane). Q6_K's high two bits
of element ``64 g + 16 t + m`` are bits ``2t`` of byte ``16 g + m`` of its ``qh`` plane.

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
    (``None``: computed from the block, the Q4_K scales and mins)."""

    name: str
    block_bytes: int
    src: tuple[int, int] | None


_K4 = 2 * reference.F16_SIZE  # Q4_K: where the 12 bytes of packed scales start
PLANES: dict[Q, tuple[Plane, ...]] = {
    Q.Q4_K: (
        Plane("qs", QK_K // 2, None),  # reordered nibbles (module docstring)
        Plane("sc", QK_K // 32, None),  # 6-bit scales, one byte each
        Plane("mn", QK_K // 32, None),  # 6-bit mins
        Plane("d", 2, (0, 2)),
        Plane("dm", 2, (2, 4)),
    ),
    Q.Q6_K: (
        Plane("ql", QK_K // 2, None),  # reordered low 4 bits
        Plane("qh", QK_K // 4, None),  # reordered high 2 bits
        Plane("sc", QK_K // 16, None),  # int8 scales: even groups, then odd ones
        Plane("d", 2, (208, 210)),
    ),
    Q.Q8_0: (
        Plane("qs", 32, (2, 34)),
        Plane("d", 2, (0, 2)),
    ),
    # plain floats are their own kernel layout: one plane, the file's bytes
    Q.F32: (Plane("w", 4, (0, 4)),),
    Q.F16: (Plane("w", 2, (0, 2)),),
    Q.BF16: (Plane("w", 2, (0, 2)),),
}
REPACKED_TYPES: frozenset[Q] = frozenset(PLANES)
FLOAT_TYPES: frozenset[Q] = frozenset({Q.F32, Q.F16, Q.BF16})

for _qtype, _planes in PLANES.items():  # the planes hold exactly a block's bytes (or more)
    assert sum(p.block_bytes for p in _planes) >= gguf.GGML_QUANT_SIZES[_qtype][1]


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
        """The plane ``name`` of ``data`` as ``[rows, row bytes]`` uint8 (a view)."""
        for p, off, rb in zip(PLANES[self.qtype], self.offsets, self.row_bytes, strict=True):
            if p.name == name:
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
        at += rows * nb * p.block_bytes
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
    if qtype == Q.Q4_K:
        sc, mn = reference._scale_min_k4(blocks[:, _K4 : _K4 + reference.K_SCALE_SIZE])
        qs = blocks[:, _K4 + reference.K_SCALE_SIZE :].reshape(-1, 4, 32)
        q = torch.stack((qs & 0x0F, qs >> 4), dim=2).reshape(-1, 8, 2, 16)  # element 32s + 16h + k
        computed = {"qs": q[:, :, 0] | (q[:, :, 1] << 4), "sc": sc, "mn": mn}
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
        values = computed[p.name] if p.src is None else blocks[:, p.src[0] : p.src[1]]
        lay.plane(out, p.name).copy_(values.reshape(lay.rows, -1))
    return out


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
    d = plane("d").contiguous().view(torch.float16).float()[:, :, None]  # [n, nb, 1]
    if qt == Q.Q8_0:
        q = plane("qs").view(torch.int8).float().reshape(n, nb, 32)
        return (q * d).reshape(n, lay.cols)
    if qt == Q.Q4_K:
        qs = plane("qs").reshape(n, nb, 8, 16)
        q = torch.cat((qs & 0x0F, qs >> 4), dim=3).float()  # [n, nb, 8, 32]
        dm = plane("dm").contiguous().view(torch.float16).float()[:, :, None]
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
