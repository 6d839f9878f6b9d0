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


MAX_GRAPHS = 4  # sampler graphs kept, by the shapes they were captured for


class SampledSteps:
    """The GPU runner's sampled tail of a step: ``bind`` a request's state, ``run`` after each
    step (``GpuRunner.finish``), ``read`` its row once the step's event has passed. A graph is
    captured once per shape of sampler (``SamplingState.key``) and kept, with the state it reads,
    for the next request of that shape, which loads its own values into that state. Everything
    here runs in inference mode (the request's state may have been made there)."""

    def __init__(self, buf: StepBuffers) -> None:
        self.buf = buf
        self.state: SamplingState | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.host: torch.Tensor | None = None  # two pinned rows: the ring of sampled outputs
        # captured graphs by key, oldest first: (the state each reads, the graph, its rows)
        self.kept: dict[tuple, tuple[SamplingState, torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def bound(self) -> bool:
        return self.state is not None

    @torch.inference_mode()
    def bind(self, state: SamplingState, graphs: bool) -> SamplingState:
        """Sample with ``state``'s knobs and running state after each step from now on, as a
        graph when ``graphs``. Returns the state the steps use from now on: a kept graph's, with
        ``state``'s values loaded, or ``state`` itself; the request draws from it on its host
        steps too."""
        if state is self.state:
            return state
        self.unbind()
        dev = self.buf.logits.device
        kept = self.kept.pop(state.key, None) if graphs else None
        if kept is not None:
            kept[0].load(state)
            self.kept[state.key] = kept  # the newest now
            self.state, self.graph, self.host = kept
            return kept[0]
        self.state = state
        self.host = torch.zeros(2, state.out.numel(), dtype=torch.float64,
                                pin_memory=dev.type == "cuda")  # fmt: skip
        if graphs and dev.type == "cuda":
            self.graph = self._capture(state, dev)
            if self.graph is not None:
                if len(self.kept) >= MAX_GRAPHS:
                    self.kept.pop(next(iter(self.kept)))
                self.kept[state.key] = (state, self.graph, self.host)
        return state

    def _capture(self, state: SamplingState, dev: torch.device) -> torch.cuda.CUDAGraph | None:
        """``state``'s sampler as a graph (its draws and window stay as they were: the
        warm-up's are undone); None where it cannot be captured (it then runs eagerly)."""
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
                self._body(state)
            return graph
        except Exception as e:  # an op that cannot be captured: the same ops, eagerly
            log.warning("sampled steps run without a CUDA graph: %s", e)
            torch.cuda.synchronize(dev)
            state.restore(saved)
            return None

    def unbind(self) -> None:
        self.state, self.graph, self.host = None, None, None

    def close(self) -> None:
        self.unbind()
        self.kept.clear()

    def _body(self, state: SamplingState) -> None:
        b = self.buf
        place(sample(state, b.logits), b.tok, b.ring, b.step_no)

    @torch.inference_mode()
    def run(self) -> None:
        """Queue the sampler on the step's logits (as they are now: after a grammar's mask)."""
        if self.graph is not None:
            self.graph.replay()
        else:
            assert self.state is not None
            self._body(self.state)

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
