"""The grid types: IQ3_XXS and IQ3_S, each described once (``quant/format.py``).

A grid type stores, per 4 elements, an index into a table of 4-value magnitude patterns (the
grid), plus signs and a scale per 32 elements. The grids are gguf-py's tables (``gguf.quants``
builds them from ggml's), kept as fixed planes of the repacked matrix (one byte per value: the
magnitudes are small odd or even integers), so a kernel reads them from the matrix's own bytes.
The unpacks do gguf-py's float32 products in its order: (scale * grid value) * sign.

- IQ3_XXS (256 elements): d f16 | qs 64 grid indices (256 x 4 grid) | 8 little-endian uint32,
  one per 32 elements: bits 28..31 the scale s (d * (0.5 + s) * 0.5), bits 7i..7i+6 the index
  of the sign pattern of its i-th 8 elements in ggml's ksigns table (a fixed plane too).
- IQ3_S (256 elements): d f16 | qs 64 low 8 bits of grid indices (512 x 4 grid) | qh 8 (bit
  i % 8 of byte i // 8: index i's ninth bit) | signs 32 (bit e % 8 of byte e // 8: element e
  negative) | scales 4 (nibble j % 2 of byte j // 2: the 32 elements j's s, d * (1 + 2 s)).

The planes are the file's fields gathered (IQ3_S's qh, signs and scales side by side as one),
then the tables.
"""

from __future__ import annotations

import gguf
import gguf.quants
import numpy as np
import torch

from strata.engine.quant.format import (
    Format,
    Plane,
    Q,
    copied,
    f16,
    fields,
    part,
    shifts,
    table_tensor,
    view,
)

QK_K = gguf.QK_K


def _grid_bytes(cls: type) -> bytes:
    """gguf-py's grid of ``cls`` as one byte per value, rows of 4: [rows * 4] bytes."""
    cls.init_grid()
    grid = np.asarray(cls.grid).reshape(-1)
    assert (grid == grid.astype(np.uint8)).all()
    return grid.astype(np.uint8).tobytes()


IQ3_XXS_GRID = _grid_bytes(gguf.quants.IQ3_XXS)  # 256 x 4
IQ3_S_GRID = _grid_bytes(gguf.quants.IQ3_S)  # 512 x 4
KSIGNS = bytes(gguf.quants.IQ2_XXS.ksigns)  # 128 sign patterns: bit i set = element i negative


def _grid(table: bytes, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` of a grid: [..., 4] float32."""
    g = table_tensor(table, idx.device).reshape(-1, 4).float()
    return g[idx.long()]


def _signs(bits: torch.Tensor) -> torch.Tensor:
    """Sign bits (uint8, 0 or 1) -> +1.0 or -1.0."""
    return torch.where(bits == 0, 1.0, -1.0).to(torch.float32)


# -- IQ3_XXS ------------------------------------------------------------------------------------

_IQ3_XXS = fields(("d", 2), ("qs", QK_K // 4), ("ss", QK_K // 8))


def _unpack_iq3_xxs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ss = view(part(blocks, _IQ3_XXS[2]), torch.int32)  # [N, 8]
    s = ((ss >> 28) & 0x0F).float()
    db = (f16(blocks, 0) * (0.5 + s) * 0.5).reshape(n, 8, 1, 1)
    at = torch.tensor([0, 7, 14, 21], dtype=torch.int32, device=blocks.device)
    sidx = ((ss[:, :, None] >> at) & 0x7F).long()  # [N, 8, 4]
    pattern = table_tensor(KSIGNS, blocks.device)[sidx]  # [N, 8, 4] uint8
    signs = _signs((pattern[..., None] >> shifts(1, 8, pattern)[:, 0]) & 1)  # [N, 8, 4, 8]
    grid = _grid(IQ3_XXS_GRID, part(blocks, _IQ3_XXS[1])).reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, QK_K)


IQ3_XXS = Format(
    Q.IQ3_XXS,
    QK_K,
    _IQ3_XXS,
    (
        copied(_IQ3_XXS[1]),
        copied(_IQ3_XXS[2]),
        copied(_IQ3_XXS[0]),
        Plane("grid", 0, None, fixed_bytes=len(IQ3_XXS_GRID)),
        Plane("ks", 0, None, fixed_bytes=len(KSIGNS)),
    ),
    _unpack_iq3_xxs,
    tables={"grid": IQ3_XXS_GRID, "ks": KSIGNS},
)


# -- IQ3_S --------------------------------------------------------------------------------------

_IQ3_S = fields(("d", 2), ("qs", QK_K // 4), ("qh", QK_K // 32), ("sg", QK_K // 8), ("sc", 4))


def _unpack_iq3_s(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    sc = part(blocks, _IQ3_S[4])  # [N, 4]
    s = ((sc[:, :, None] >> shifts(4, 2, sc)[:, 0]) & 0x0F).reshape(n, 8)
    db = (f16(blocks, 0) * (1 + 2 * s).float()).reshape(n, 8, 1, 1)
    sg = part(blocks, _IQ3_S[3])  # [N, 32]
    signs = _signs((sg[:, :, None] >> shifts(1, 8, sg)[:, 0]) & 1).reshape(n, 8, 4, 8)
    qh = part(blocks, _IQ3_S[2])  # [N, 8]
    high = ((qh[:, :, None] >> shifts(1, 8, qh)[:, 0]) & 1).reshape(n, 64).to(torch.int32)
    idx = part(blocks, _IQ3_S[1]).to(torch.int32) | (high << 8)  # [N, 64] in 0..511
    grid = _grid(IQ3_S_GRID, idx).reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, QK_K)


IQ3_S = Format(
    Q.IQ3_S,
    QK_K,
    _IQ3_S,
    (
        copied(_IQ3_S[1]),
        Plane("hs", _IQ3_S[4].end - _IQ3_S[2].at, (_IQ3_S[2].at, _IQ3_S[4].end)),  # qh|sg|sc
        copied(_IQ3_S[0]),
        Plane("grid", 0, None, fixed_bytes=len(IQ3_S_GRID)),
    ),
    _unpack_iq3_s,
    tables={"grid": IQ3_S_GRID},
)

FORMATS = (IQ3_XXS, IQ3_S)
