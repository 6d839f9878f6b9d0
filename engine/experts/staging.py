"""Expert misses to the GPU through pinned host buffers, without stalling the stream.

``tensor.to("cuda")`` of mapped file memory is a synchronous copy from pageable memory: the host
waits for it, and the GPU, which had been running ahead of the host, runs dry while the next
kernels are launched. A miss happens once per routed expert and layer, so on a decode step with
nothing cached that wait happens hundreds of times.

Here a miss's three byte runs are packed (in the slot layout) into one of a ring of pinned
buffers and sent with one asynchronous copy on the compute stream, which the expert's kernels
then follow in stream order. A buffer is refilled only after the copy that read it has finished
(one CUDA event per buffer), so the host may run a ring's length ahead of the GPU.
"""

from __future__ import annotations

import torch

from strata.engine.gguf_index import ExpertBlob, GGUFIndex
from strata.engine.quant.expert_layout import packed_bytes, run_offsets

MiB = 2**20
# Pinned memory the ring may take in all: enough for two layers of misses of a 30B-A3B model
# (2.5 MiB experts) and for two whole experts of Mixtral 8x7B (100 MiB each, two buffers).
RING_BYTES = 64 * MiB
MIN_DEPTH, MAX_DEPTH = 2, 16


class PinnedStager:
    """Uploads whole experts from the mapped file to ``device`` through a ring of pinned buffers."""

    def __init__(self, index: GGUFIndex, device: torch.device, buffer_bytes: int) -> None:
        if device.type != "cuda":
            raise ValueError(f"pinned staging is for CUDA devices, not {device}")
        if buffer_bytes <= 0:
            raise ValueError(f"staging buffer of {buffer_bytes} bytes: must be positive")
        self.index, self.device, self.buffer_bytes = index, device, buffer_bytes
        depth = max(MIN_DEPTH, min(MAX_DEPTH, RING_BYTES // buffer_bytes))
        self.buffers = [
            torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(depth)
        ]
        self.events: list[torch.cuda.Event | None] = [None] * depth
        self.next = 0

    @property
    def depth(self) -> int:
        return len(self.buffers)

    def upload(self, blob: ExpertBlob) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The expert's gate, up and down runs on the device: views of one new device tensor."""
        n = packed_bytes(blob)
        if n > self.buffer_bytes:
            raise ValueError(
                f"expert of {n} bytes does not fit the {self.buffer_bytes}-byte staging buffer"
            )
        i = self.next
        self.next = (i + 1) % self.depth
        if (done := self.events[i]) is not None:
            done.synchronize()  # the copy that last read this buffer has finished
        buf = self.buffers[i]
        offsets = run_offsets(blob)
        for off, run in zip(offsets, blob.runs, strict=True):
            buf[off : off + run.nbytes].copy_(self.index.raw(run.offset, run.nbytes))
        dev = torch.empty(n, dtype=torch.uint8, device=self.device)
        dev.copy_(buf[:n], non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self.events[i] = event
        gate, up, down = (
            dev[off : off + run.nbytes] for off, run in zip(offsets, blob.runs, strict=True)
        )
        return gate, up, down

    def close(self) -> None:
        """Wait for every copy in flight, then let the pinned buffers go."""
        for event in self.events:
            if event is not None:
                event.synchronize()
        self.events = [None] * self.depth
        self.buffers = []
