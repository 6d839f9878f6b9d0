"""Copies ahead (``prefetch_experts``): each layer's likely experts, predicted from the residual
stream a layer early (its router on it), copied from their RAM homes into staging slots on side
streams while the main stream computes, so the link has work from the moment each guess is made.
The layer's expert kernels wait for its copies; a chosen RAM expert that no copy brought is
copied late (``kernels.prefetch.copy_missed``)."""

from __future__ import annotations

import torch

from strata.engine.experts import ExpertProvider
from strata.engine.experts.host import HostTier
from strata.engine.gpu.buffers import ExpertGeometry, StepBuffers, aligned
from strata.engine.gpu.tables import FastPathError
from strata.engine.kernels import MISSING, moe, prefetch


class CopiesAhead:
    def __init__(self, buf: StepBuffers, geometry: ExpertGeometry, n_layer: int,
                 n_expert: int, n_used: int) -> None:  # fmt: skip
        self.buf, self.geometry = buf, geometry
        self.n_layer, self.n_expert, self.n_used = n_layer, n_expert, n_used
        self.device = dev = buf.anchor.device
        self.p = 0  # predicted experts each layer copies ahead (0: none)
        self.bytes = geometry.copy_bytes
        # two streams, odd and even layers apart: a layer's copies never wait for the previous
        # layer's to end (nor for its expert kernels). High priority: their few programs start
        # first.
        cuda = dev.type == "cuda"
        self.sides = [torch.cuda.Stream(dev, priority=-1) for _ in range(2)] if cuda else []
        self.set(0)

    def set(self, p: int) -> None:
        """Copy up to ``p`` of each layer's predicted experts ahead (0: never), in two sets of p
        staging slots, then two of k for the chosen RAM experts no copy ahead brought."""
        E, K, L, dev = self.n_expert, self.n_used, self.n_layer, self.device
        if not 0 <= p <= E:
            raise ValueError(f"prefetch_experts={p}: must be between 0 and the model's {E} experts")
        self.p = p
        self.logits = torch.zeros(E, dtype=torch.float32, device=dev)
        self.ids = torch.full((L, max(p, 1)), -1, dtype=torch.int32, device=dev)
        self.src = torch.full((L, max(p, 1)), MISSING, dtype=torch.int64, device=dev)
        self.stats = torch.zeros(L, 2, dtype=torch.int64, device=dev)
        sb = self.geometry.staging_bytes
        self.staging = aligned(max(2 * (p + K), 1) * sb, dev)
        self.base = self.buf.offset(self.staging)
        self.late_base = self.base + 2 * p * sb
        self.done = [torch.cuda.Event() for _ in range(L)] if self.sides else []

    def check(self, tier: HostTier | None) -> None:
        """The host tier's slots hold a whole copy of any layer's expert."""
        if self.p and tier is not None and tier.slot_bytes < max(self.bytes):
            raise FastPathError(
                f"host slots of {tier.slot_bytes} bytes are smaller than a copy ahead of "
                f"{max(self.bytes)}"
            )

    def stage_at(self, layer: int) -> int:
        return self.base + (layer % 2) * self.p * self.geometry.staging_bytes

    def copy(self, layer: int, homes: torch.Tensor) -> None:
        """Queue the copies of ``layer``'s predicted experts (``self.logits`` holds its router
        on the stream as it is now) that live in RAM into the layer's staging set, on the side
        stream of its parity."""
        ids, src = self.ids[layer], self.src[layer]
        prefetch.predict(self.logits, homes, ids, src)
        args = (self.buf.anchor, ids, src, self.stage_at(layer), self.bytes[layer],
                self.geometry.staging_bytes)  # fmt: skip
        if not self.sides:
            prefetch.copy_experts(*args)
            return
        side = self.sides[layer % 2]
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            prefetch.copy_experts(*args)
            self.done[layer].record(side)

    def prefetched(self, layer: int) -> moe.Prefetched:
        """What the layer's routing reads of its copies ahead."""
        return moe.Prefetched(
            self.ids[layer], self.stage_at(layer), self.geometry.staging_bytes, self.stats[layer]
        )

    def land(self, layer: int, homes: torch.Tensor) -> None:
        """After the layer's routing: copy the chosen RAM experts no copy ahead brought, and
        make the main stream wait for the layer's copies ahead."""
        b, sb = self.buf, self.geometry.staging_bytes
        late = self.late_base + (layer % 2) * self.n_used * sb
        prefetch.copy_missed(
            b.anchor, b.ids[layer], b.eoffs[layer], homes, self.ids[layer], late,
            self.bytes[layer], sb,
        )  # fmt: skip
        if self.sides:
            torch.cuda.current_stream(self.device).wait_event(self.done[layer])

    def count(self, provider: ExpertProvider) -> None:
        """Copies ahead made and chosen (a chosen one is counted as the read of its RAM home
        already: the kernels read its copy instead), and the bytes of the unchosen ones, which
        crossed PCIe for nothing."""
        if not self.p:
            return
        made = self.stats.to("cpu", copy=True).tolist()
        self.stats.zero_()
        stats = provider.stats
        for layer, (n, used) in enumerate(made):
            stats.prefetched += n
            stats.prefetch_used += used
            stats.bytes_prefetched_unused += (n - used) * self.geometry.expert_bytes[layer]

    def zero(self) -> None:
        if self.p:
            self.stats.zero_()
