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
- The gathered types (``GATHERED_TYPES``: every plane a field of the block copied, or a table):
  Q4_1 qs 16, d 2, m 2; Q5_0 qs 16, qh 4, d 2; Q5_1 qs 16, qh 4, d 2, m 2; IQ4_NL and MXFP4
  qs 16, d 2 (MXFP4: e 1), lv (their 16 levels as float32); Q2_K qs 64, sc 16, d 2, dm 2;
  Q3_K qs 64, hm 32, sc 12, d 2; IQ3_XXS qs 64, ss 32, d 2, grid 1024, ks 128; IQ3_S qs 64,
  hs 44 (qh, signs, scales), d 2, grid 2048. Their kernels read the file's order within a
  plane (``quant/legacy.py``, ``quant/kquants.py``, ``quant/grids.py`` say it per type).

Nothing is rounded on the way: dequantising a repacked matrix gives the reference's values bit
for bit (``dequantize_repacked`` here does the reference's products in the reference's order, or
for a gathered type puts the blocks back together for the type's own unpack; the tests compare
it with ``reference.dequantize`` on every type).

The planes are part of each type's one description (``quant/formats.py``); this module lays them
out and is their torch twin. The Triton kernels that repack on a GPU and read the planes compute
the same offsets from the same rule (``plane offset = sum of the earlier planes, each rounded up
to PLANE_ALIGN``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import gguf
import torch

from strata.engine.quant import kquants, reference
from strata.engine.quant.format import Plane, table_tensor
from strata.engine.quant.formats import FLOAT_TYPES, FORMATS, fmt
from strata.engine.quant.reference import check_args

__all__ = ["FLOAT_TYPES", "PLANES", "Plane", "RepackedLayout", "repack", "repacked_layout"]

Q = gguf.GGMLQuantizationType
QK_K = gguf.QK_K
PLANE_ALIGN = 256  # every plane starts on a 256-byte boundary (16-byte vector loads and more)

# Each type's planes, from its description (quant/formats.py).
PLANES: dict[Q, tuple[Plane, ...]] = {q: f.planes for q, f in FORMATS.items()}
# The bytes of each per-matrix plane: [fixed_bytes] uint8.
FIXED_PLANES: dict[tuple[Q, str], torch.Tensor] = {
    (q, name): table_tensor(t) for q, f in FORMATS.items() for name, t in f.tables.items()
}
REPACKED_TYPES: frozenset[Q] = frozenset(PLANES)
# Types whose every plane copies a field of the block (or is a fixed table): repacking gathers
# fields and dequantising puts the blocks back together for the type's own unpack.
GATHERED_TYPES: frozenset[Q] = frozenset(
    q for q, ps in PLANES.items() if all(p.src is not None or p.fixed_bytes for p in ps)
)
_K4 = kquants.Q4_K.field("scales").at  # Q4_K / Q5_K: where the 12 bytes of packed scales start
_K5_QH = kquants.Q5_K.field("qh").at  # Q5_K: where the 32 bytes of fifth bits start


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
        return self.cols // fmt(self.qtype).block

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
    block = fmt(qtype).block
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
    type_size = fmt(qtype).type_size
    blocks = raw.reshape(lay.rows * lay.blocks_per_row, type_size)  # [N * nb, type_size]
    computed = {}
    if qtype in (Q.Q4_K, Q.Q5_K):
        sc, mn = kquants.scale_min_k4(blocks[:, _K4 : _K4 + kquants.K_SCALE_SIZE])
        qs_at = fmt(qtype).field("qs").at
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
        computed = {"sc": kquants.iq4_xs_scales(blocks).to(torch.int8).view(torch.uint8)}
    elif qtype == Q.Q6_K:
        q = kquants.q6_values(blocks)  # [NB, 256] in 0..63
        pairs = q.reshape(-1, 8, 2, 16)
        high = (q >> 4).reshape(-1, 4, 4, 16)  # [NB, g, t, m]: element 64 g + 16 t + m
        shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=raw.device)[:, None]
        sc = blocks[:, kquants.Q6_K.field("sc").at : kquants.Q6_K.field("sc").end]
        computed = {
            "ql": (pairs[:, :, 0] & 0x0F) | ((pairs[:, :, 1] & 0x0F) << 4),
            "qh": (high << shifts).sum(dim=2, dtype=torch.uint8),
            "sc": torch.cat((sc[:, 0::2], sc[:, 1::2]), dim=1),
        }
    _write_planes(out, blocks, lay, computed)
    return out


def _write_planes(
    out: torch.Tensor, blocks: torch.Tensor, lay: RepackedLayout, computed: dict
) -> None:
    for p in PLANES[lay.qtype]:
        dst = lay.plane(out, p.name)
        if p.fixed_bytes:
            dst.copy_(FIXED_PLANES[lay.qtype, p.name])
            continue
        values = computed[p.name] if p.src is None else blocks[:, p.src[0] : p.src[1]]
        dst.copy_(values.reshape(dst.shape))


def gather_into(dst: torch.Tensor, raw: torch.Tensor, lay: RepackedLayout) -> None:
    """The kernel layout of a gathered type (``GATHERED_TYPES``) written into ``dst``
    ([>= lay.nbytes] uint8 on raw's device): a strided copy per plane, on any device."""
    if lay.qtype not in GATHERED_TYPES:
        raise ValueError(f"{lay.qtype.name} has computed planes: repack it with repack()")
    blocks = raw.reshape(lay.rows * lay.blocks_per_row, fmt(lay.qtype).type_size)
    _write_planes(dst, blocks, lay, {})


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
    if qt in GATHERED_TYPES and qt not in (Q.Q8_0, Q.Q4_0):
        return _ungathered(plane, qt, n, lay.cols)
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


def _ungathered(plane, qt: Q, n: int, cols: int) -> torch.Tensor:
    """A gathered type's rows: its planes put back into raw blocks, then its own unpack."""
    f = fmt(qt)
    nb = cols // f.block
    dev = plane(f.planes[0].name).device
    blocks = torch.empty(n * nb, f.type_size, dtype=torch.uint8, device=dev)
    for p in f.planes:
        if p.src is not None:
            blocks[:, p.src[0] : p.src[1]] = plane(p.name).reshape(n * nb, p.block_bytes)
    return f.unpack(blocks).reshape(n, cols)
