"""Where an expert's three byte runs sit in a slot (and in a staging buffer): one layout for
every place that holds a whole expert, so a hit and a miss read their bytes the same way."""

from __future__ import annotations

from strata.engine.gguf_index import ExpertBlob, GGUFIndex

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
