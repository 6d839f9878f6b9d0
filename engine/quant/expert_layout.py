"""Where an expert's three byte runs sit in a slot (and in a staging buffer): one layout for
every place that holds a whole expert, so a hit and a miss read their bytes the same way."""

from __future__ import annotations

from dataclasses import dataclass

from strata.engine.gguf_index import ExpertBlob, GGUFIndex
from strata.engine.quant.repack import RepackedLayout, repacked_layout

RUN_ALIGN = 256  # each run starts 256-byte aligned in its slot (fp16 fields, vector loads)


def align(n: int, to: int) -> int:
    return -(-n // to) * to


def run_offsets(blob: ExpertBlob) -> tuple[int, int, int]:
    """Where gate, up and down start inside a slot."""
    gate = 0
    up = align(blob.gate.nbytes, RUN_ALIGN)
    down = up + align(blob.up.nbytes, RUN_ALIGN)
    return gate, up, down


def packed_bytes(blob: ExpertBlob) -> int:
    """Bytes from the start of gate to the end of down, laid out by ``run_offsets``."""
    return run_offsets(blob)[2] + blob.down.nbytes


def slot_bytes_for(index: GGUFIndex) -> int:
    """One slot fits the largest expert (files mix types per layer, e.g. Q4_K_M's Q6_K downs)."""
    return align(max(packed_bytes(b) for b in index.iter_experts()), RUN_ALIGN)


# -- the kernel layout ------------------------------------------------------------------------
# For the GPU decode kernels a slot holds the expert's gate, up and down repacked
# (``strata.engine.quant.repack``), each matrix 256-byte aligned. Every expert of a layer has the
# same types and shapes, hence the same layout, so the kernels take the offsets once per layer.


@dataclass(frozen=True)
class KernelSlotLayout:
    gate: RepackedLayout
    up: RepackedLayout
    down: RepackedLayout
    up_offset: int
    down_offset: int

    @property
    def layouts(self) -> tuple[RepackedLayout, RepackedLayout, RepackedLayout]:
        return (self.gate, self.up, self.down)

    @property
    def offsets(self) -> tuple[int, int, int]:
        return (0, self.up_offset, self.down_offset)

    @property
    def nbytes(self) -> int:
        return self.down_offset + self.down.nbytes


def kernel_layout(blob: ExpertBlob) -> KernelSlotLayout:
    """Where an expert's repacked matrices sit in its slot. Raises ValueError naming the type
    when one of them has no kernel layout."""
    gate, up, down = (repacked_layout(r.qtype, r.shape) for r in blob.runs)
    up_offset = align(gate.nbytes, RUN_ALIGN)
    return KernelSlotLayout(gate, up, down, up_offset, up_offset + align(up.nbytes, RUN_ALIGN))


def kernel_slot_bytes_for(index: GGUFIndex) -> int:
    """A slot in the kernel layout fits the largest expert so laid out."""
    return align(max(kernel_layout(b).nbytes for b in index.iter_experts()), RUN_ALIGN)


def slot_waste(sizes: list[int]) -> float:
    """The share of a cache's bytes left unused when every expert (of kernel bytes ``sizes``)
    takes a slot of the largest size and the cache holds them in proportion: 0 for one size.
    Files mix types by layer (Q4_K_M's Q6_K downs, Q3_K_M's first layers, an IQ3_S/IQ4_NL mix),
    so their experts differ in size; one slot size serves while this stays below
    ``SIZE_CLASS_WASTE`` (the measured recipes: 0 to 8%), size classes would beyond it."""
    if not sizes:
        return 0.0
    top = max(sizes)
    return sum(top - s for s in sizes) / (top * len(sizes))


SIZE_CLASS_WASTE = 0.10


def kernel_slot_waste(index: GGUFIndex) -> float:
    """``slot_waste`` of a file's experts in the kernel layout."""
    return slot_waste([kernel_layout(b).nbytes for b in index.iter_experts()])
