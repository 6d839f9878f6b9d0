"""Staging slots for experts with no home the kernels can read (the cache holds less than every
expert, and no host tier holds the rest): after a layer's routing the chosen ones are uploaded
from the file and repacked into these slots, and the kernels read them there. Steps that stage
run eagerly (the host decides what to upload); the numbers are the same as from a home."""

from __future__ import annotations

from collections.abc import Callable

import torch

from strata.engine.experts.provider import ExpertProvider, FileExpertProvider
from strata.engine.experts.table import ExpertTablePlan
from strata.engine.gguf_index import GGUFIndex
from strata.engine.gpu.buffers import ExpertGeometry, StepBuffers, aligned
from strata.engine.gpu.tables import FastPathError
from strata.engine.kernels import MISSING


def file_of(provider: ExpertProvider) -> FileExpertProvider:
    """The file behind ``provider`` (a cache's, or the file provider itself)."""
    from strata.engine.experts.cache import ExpertCache

    if isinstance(provider, ExpertCache):
        return provider.file
    if isinstance(provider, FileExpertProvider):
        return provider
    raise FastPathError(f"no file behind the expert provider {type(provider).__name__}")


class MissStaging:
    """``n_used`` staging slots (one layer's chosen experts) and their offsets from the anchor."""

    def __init__(self, buf: StepBuffers, geometry: ExpertGeometry, index: GGUFIndex,
                 n_used: int) -> None:  # fmt: skip
        self.buf, self.geometry, self.index = buf, geometry, index
        sb = geometry.staging_bytes
        self.slots = aligned(n_used * sb, buf.anchor.device)
        base = buf.offset(self.slots)
        self.offsets = [base + j * sb for j in range(n_used)]

    def _upload(self, file: FileExpertProvider, layer: int, expert: int, j: int) -> None:
        blob = self.index.expert(self.geometry.first + layer, expert)
        file.upload_kernel(blob, self.slots[j * self.geometry.staging_bytes :])

    def decode(self, layer: int, plan: ExpertTablePlan, file: FileExpertProvider) -> None:
        """After a decode step's routing of local ``layer``: stage each chosen expert that has no
        readable home and point its chosen-expert offset there (the table itself is not touched:
        it only ever holds homes)."""
        b = self.buf
        for j, e in enumerate(b.ids[layer].tolist()):
            if not plan.is_resident(layer, e):
                self._upload(file, layer, e, j)
                b.eoffs[layer, j].fill_(self.offsets[j])

    def chunk(self, layer: int, counts: torch.Tensor, plan: ExpertTablePlan,
              file: FileExpertProvider, run: Callable[[torch.Tensor], None]) -> None:  # fmt: skip
        """A prompt chunk's chosen experts (``counts`` [E] of local ``layer``) without a
        readable home, staged and run in rounds of the staging slots (the cached ones ran
        already; a table of MISSING skips them now)."""
        E = counts.numel()
        missing = [e for e, n in enumerate(counts.tolist()) if n and not plan.is_resident(layer, e)]
        slots = len(self.offsets)
        device = self.buf.anchor.device
        for i in range(0, len(missing), slots):
            offsets = [MISSING] * E
            for j, e in enumerate(missing[i : i + slots]):
                self._upload(file, layer, e, j)
                offsets[e] = self.offsets[j]
            run(torch.tensor(offsets, dtype=torch.int64).to(device, non_blocking=True))
