"""The fixed buffers a decode step reads and writes (a captured graph keeps their addresses),
the anchor every expert table's byte offsets count from, and the experts' slot geometry."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.engine.gguf_index import GGUFIndex
from strata.engine.kernels.step import argmax_scratch
from strata.engine.ops import ModelShape
from strata.engine.quant.expert_layout import RUN_ALIGN, KernelSlotLayout, align, kernel_layout


def aligned(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 buffer of ``nbytes`` whose first byte is RUN_ALIGN-aligned."""
    buf = torch.zeros(nbytes + RUN_ALIGN, dtype=torch.uint8, device=device)
    skip = -buf.data_ptr() % RUN_ALIGN
    return buf[skip : skip + nbytes]


@dataclass(frozen=True)
class ExpertGeometry:
    """Where a stage's experts' bytes are, layer by layer (local layer ``j`` is model layer
    ``first + j``): each layer's slot layout in the kernels' format, the bytes of one expert
    as the file holds it, and the size of a staging slot (the largest slot, aligned)."""

    first: int
    slot_layouts: list[KernelSlotLayout]
    expert_bytes: list[int]
    staging_bytes: int

    @classmethod
    def of(cls, index: GGUFIndex, layers: range) -> ExpertGeometry:
        slots = [kernel_layout(index.expert(layer, 0)) for layer in layers]
        return cls(
            first=layers.start,
            slot_layouts=slots,
            expert_bytes=[index.expert(layer, 0).nbytes for layer in layers],
            staging_bytes=align(max(s.nbytes for s in slots), RUN_ALIGN),
        )

    @property
    def copy_bytes(self) -> list[int]:
        """Bytes each layer's copy of a home moves: its slot layout, whole words."""
        return [align(lay.nbytes, RUN_ALIGN) for lay in self.slot_layouts]


class StepBuffers:
    """One stage's decode-step buffers on ``device`` for ``n_layer`` local layers."""

    def __init__(self, shape: ModelShape, n_layer: int, device: torch.device) -> None:
        a, r = shape.attention, shape.routing
        L, E, K, D = n_layer, r.n_expert, r.n_used, shape.n_embd
        f32, i32, dev = torch.float32, torch.int32, device
        self.anchor = aligned(RUN_ALIGN, dev)  # what the tables' offsets count from
        self.tok = torch.zeros(1, dtype=i32, device=dev)
        self.pos = torch.zeros(1, dtype=i32, device=dev)
        self.x = torch.zeros(D, dtype=f32, device=dev)  # the residual stream
        self.h = torch.zeros(D, dtype=f32, device=dev)  # its normalised copy for the experts
        self.qkv = torch.zeros(a.q_dim + 2 * a.kv_dim, dtype=f32, device=dev)
        self.attn_out = torch.zeros(a.q_dim, dtype=f32, device=dev)
        self.router_logits = torch.zeros(E, dtype=f32, device=dev)
        # the router matvec's ticket (``moe.Routing``): its last program routes; 0 between
        self.route_ticket = torch.zeros(1, dtype=i32, device=dev)
        self.ids = torch.zeros(L, K, dtype=i32, device=dev)
        self.wts = torch.zeros(L, K, dtype=f32, device=dev)
        self.eoffs = torch.zeros(L, K, dtype=torch.int64, device=dev)  # the chosen experts' slots
        self.act = torch.zeros(K, shape.n_ff_exp, dtype=f32, device=dev)
        self.logits = torch.zeros(shape.vocab_size, dtype=f32, device=dev)
        # each step's greedy token: a two-slot ring on the device, read into pinned host memory
        # after the step, so the host can let the next step run while it reads this one
        self.ring = torch.zeros(2, dtype=i32, device=dev)
        self.step_no = torch.zeros(1, dtype=i32, device=dev)
        self.argmax = argmax_scratch(dev)  # ``advance``'s running key and ticket
        cuda = dev.type == "cuda"
        self.ring_host = torch.zeros(2, dtype=i32, pin_memory=cuda)
        self.ring_done = [torch.cuda.Event() for _ in range(2)] if cuda else None

    def offset(self, t: torch.Tensor) -> int:
        """The byte offset of ``t``'s first element from the anchor."""
        return t.data_ptr() - self.anchor.data_ptr()
