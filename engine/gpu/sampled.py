"""Sampled steps: a request's sampler (``engine.sampling.sample``) queued right after each decode
step, on the step's logits, writing the chosen token as the next step's input and into the ring
slot the host reads. With graphs it is captured once per request as a small CUDA graph of its
own (the decode graph stays the greedy one every request shares), so a sampled step, like a
greedy one, runs ahead of the host. The host reads the sampler's output row (token, logprobs) in
one copy per step."""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from strata.engine.gpu.buffers import StepBuffers
from strata.engine.sampling import SamplingState, TokenLogprob, sample

log = logging.getLogger(__name__)


@triton.jit
def _place_kernel(token, tok, ring, step):
    t = tl.load(token).to(tl.int32)
    tl.store(tok, t)
    tl.store(ring + (tl.load(step) - 1) % 2, t)


def place(token: torch.Tensor, tok: torch.Tensor, ring: torch.Tensor, step: torch.Tensor) -> None:
    """tok <- token, ring[(step - 1) % 2] <- token: the step that ``advance`` counted last gets
    the sampled token instead of its argmax."""
    _place_kernel[(1,)](token, tok, ring, step, num_warps=1)


class SampledSteps:
    """The GPU runner's sampled tail of a step: ``bind`` a request's state, ``run`` after each
    step (``GpuRunner.finish``), ``read`` its row once the step's event has passed. Everything
    here runs in inference mode (the request's state may have been made there)."""

    def __init__(self, buf: StepBuffers) -> None:
        self.buf = buf
        self.state: SamplingState | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.host: torch.Tensor | None = None  # two pinned rows: the ring of sampled outputs

    @property
    def bound(self) -> bool:
        return self.state is not None

    @torch.inference_mode()
    def bind(self, state: SamplingState, graphs: bool) -> None:
        """Sample with ``state`` after each step from now on; captured as a graph when
        ``graphs`` (its draws and window stay as they were: the warm-up's are undone)."""
        if state is self.state:
            return
        self.unbind()
        dev = self.buf.logits.device
        self.state = state
        self.host = torch.zeros(2, state.out.numel(), dtype=torch.float64,
                                pin_memory=dev.type == "cuda")  # fmt: skip
        if not graphs or dev.type != "cuda":
            return
        saved = state.snapshot()
        try:
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # compile and allocate outside the capture
                sample(state, self.buf.logits)
            torch.cuda.current_stream(dev).wait_stream(side)
            state.restore(saved)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._body()
            self.graph = graph
        except Exception as e:  # an op that cannot be captured: the same ops, eagerly
            log.warning("sampled steps run without a CUDA graph: %s", e)
            torch.cuda.synchronize(dev)
            state.restore(saved)
            self.graph = None

    def unbind(self) -> None:
        self.state, self.graph, self.host = None, None, None

    def _body(self) -> None:
        assert self.state is not None
        b = self.buf
        place(sample(self.state, b.logits), b.tok, b.ring, b.step_no)

    @torch.inference_mode()
    def run(self) -> None:
        """Queue the sampler on the step's logits (as they are now: after a grammar's mask)."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self._body()

    @torch.inference_mode()
    def copy(self, slot: int) -> None:
        """Queue the copy of the output row into host row ``slot``."""
        assert self.state is not None and self.host is not None
        self.host[slot].copy_(self.state.out, non_blocking=True)

    @torch.inference_mode()
    def read(self, slot: int) -> tuple[int, TokenLogprob | None]:
        """The token (and log-probabilities) of host row ``slot``, once its copy is done."""
        assert self.state is not None and self.host is not None
        return self.state.read(self.host[slot].tolist())
