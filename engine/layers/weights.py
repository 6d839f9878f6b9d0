"""Quantised weights that stay quantised: a byte view plus the type and shape to read it with."""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch

from strata.engine.gguf_index import ExpertRun, GGUFIndex, TensorInfo
from strata.engine.quant import dequantize, tensor_nbytes


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

    def dequant(self) -> torch.Tensor:
        return dequantize(self.raw, self.qtype, self.shape)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantise only the rows ``ids`` of a 2-D weight (an embedding lookup)."""
        # ids: [T] -> out: [T, ne0]
        n_rows, ne0 = self.shape
        row_bytes = tensor_nbytes(self.qtype, (1, ne0))
        by_row = self.raw.view(n_rows, row_bytes)
        picked = by_row.index_select(0, ids.to(by_row.device)).reshape(-1)
        return dequantize(picked, self.qtype, (len(ids), ne0))


def linear(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    # x: [T, in], w: [out, in] -> [T, out]
    return x @ w.dequant().T
