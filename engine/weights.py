"""Quantised weights that stay quantised: a byte view plus the type and shape to read it with.

``QWeight`` holds the file's own encoding; ``RepackedWeight`` the kernel layout of
``strata.engine.quant.repack`` (what the GPU decode kernels read). Both dequantise to the same
float32 values, bit for bit, so the reference path computes with either."""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch

from strata.engine.gguf_index import ExpertRun, GGUFIndex, TensorInfo
from strata.engine.quant import (
    RepackedLayout,
    dequantize,
    dequantize_repacked,
    repack_into,
    repacked_layout,
    tensor_nbytes,
)


@dataclass(frozen=True)
class QWeight:
    """A weight matrix (or vector) kept in its file encoding; ``dequant()`` gives float32."""

    raw: torch.Tensor  # [nbytes] uint8, usually a view of the mapped file or of an arena slot
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # torch order, last dim along the quant blocks

    @classmethod
    def of_tensor(cls, index: GGUFIndex, info: TensorInfo) -> QWeight:
        return cls(index.raw(info.offset, info.nbytes), info.qtype, info.shape)

    @classmethod
    def of_run(cls, raw: torch.Tensor, run: ExpertRun) -> QWeight:
        return cls(raw, run.qtype, run.shape)

    def to(self, device: torch.device) -> QWeight:
        """The same weight with its bytes on ``device`` (no copy when already there)."""
        if self.raw.device == device:
            return self
        return QWeight(self.raw.to(device), self.qtype, self.shape)

    def dequant(self) -> torch.Tensor:
        return dequantize(self.raw, self.qtype, self.shape)

    @property
    def row_bytes(self) -> int:
        return tensor_nbytes(self.qtype, (1, self.shape[-1]))

    def row_block(self, start: int, stop: int) -> QWeight:
        """Rows [start, stop) of a 2-D weight, still quantised (a view, no copy)."""
        rb = self.row_bytes
        return QWeight(self.raw[start * rb : stop * rb], self.qtype, (stop - start, self.shape[1]))

    def dequant_rows(self, start: int, stop: int) -> torch.Tensor:
        return self.row_block(start, stop).dequant()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantise only the rows ``ids`` of a 2-D weight (an embedding lookup)."""
        # ids: [T] -> out: [T, ne0]
        n_rows, ne0 = self.shape
        by_row = self.raw.view(n_rows, self.row_bytes)
        picked = by_row.index_select(0, ids.to(by_row.device)).reshape(-1)
        return dequantize(picked, self.qtype, (len(ids), ne0))


@dataclass(frozen=True)
class RepackedWeight:
    """A matrix in the kernel layout: ``data`` holds ``layout.nbytes`` bytes (its own buffer, or
    a view of an expert's slot)."""

    data: torch.Tensor  # [>= layout.nbytes] uint8
    layout: RepackedLayout

    @classmethod
    def repack(
        cls,
        raw: torch.Tensor,
        qtype: gguf.GGMLQuantizationType,
        shape: tuple[int, ...],
        out: torch.Tensor | None = None,
    ) -> RepackedWeight:
        """Repack the GGUF bytes ``raw`` (on the device the weight is to live on) into ``out``
        or a new buffer."""
        lay = repacked_layout(qtype, shape)
        if out is None:
            out = torch.empty(lay.nbytes, dtype=torch.uint8, device=raw.device)
        repack_into(out, raw, lay)
        return cls(out, lay)

    @property
    def qtype(self) -> gguf.GGMLQuantizationType:
        return self.layout.qtype

    @property
    def shape(self) -> tuple[int, int]:
        return (self.layout.rows, self.layout.cols)

    def dequant(self) -> torch.Tensor:
        return dequantize_repacked(self.data, self.layout)

    def dequant_rows(self, start: int, stop: int) -> torch.Tensor:
        return dequantize_repacked(self.data, self.layout, start, stop - start)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] -> out: [T, cols]
        return dequantize_repacked(self.data, self.layout, ids=ids.to(self.data.device))


Weight = QWeight | RepackedWeight


# A weight larger than this many elements is dequantised in blocks of rows, so that a 150k-token
# output matrix never exists in float32 all at once (its temporaries would take gigabytes).
BLOCK_ELEMENTS = 1 << 24


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    # x: [T, in], w: [out, in] -> [T, out]
    n_out, n_in = w.shape
    if n_out * n_in <= BLOCK_ELEMENTS:
        return x @ w.dequant().T
    step = max(1, BLOCK_ELEMENTS // n_in)
    out = torch.empty(x.shape[0], n_out, dtype=x.dtype, device=x.device)
    for r in range(0, n_out, step):
        stop = min(r + step, n_out)
        out[:, r:stop] = x @ w.dequant_rows(r, stop).T
    return out
