"""The GPU fast path over layer stages (``engine.stages``): one ``FastDecoder`` per stage.

Each stage's decoder owns its device's state — the fixed buffers, the expert tables of its layers
(planned from its own stage's cache and host tier only), its staging slots, its K/V and its
captured graph — and runs its layers; a step runs the stages in order, the hidden state copied
from one stage's ``x`` into the next's between them (one vector of ``n_embd`` floats; across
two GPUs a peer copy ordered after the first stage's work). The first stage embeds the token,
the last runs the output head. Prompt chunks go the same way through each stage's prefill path,
the chunk's hidden states handed over.

Steps do not run ahead of the host here (``can_look_ahead`` is False): the greedy look-ahead
chains a step's token into the next step on one device, and the stages' graphs are captured on
theirs; generation then feeds one token per step, with the same tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from strata.engine.devices import on_device
from strata.engine.experts.slots import ExpertKey
from strata.engine.fast_decode import FastDecoder
from strata.engine.layers.decoder import MoEDecoder
from strata.engine.stages import Stage

log = logging.getLogger(__name__)


class StagedDecoder:
    """The decode step and prompt chunks over every stage (see the module doc)."""

    can_look_ahead = False

    def __init__(self, model: MoEDecoder, stages: Sequence[Stage]) -> None:
        self.model = model
        self.parts: list[FastDecoder] = []
        for stage in stages:
            with on_device(stage.device):
                self.parts.append(FastDecoder(model, stage.kv, stage.number))
        self.device = self.parts[0].device
        self.prefill: StagedPrefill | None = StagedPrefill(self.parts)

    @property
    def logits(self) -> torch.Tensor:
        return self.parts[-1].logits

    @property
    def adapt_swaps(self) -> int:
        return self.parts[0].adapt_swaps

    @adapt_swaps.setter
    def adapt_swaps(self, n: int) -> None:
        for dec in self.parts:
            dec.adapt_swaps = n

    @property
    def graph_reason(self) -> str | None:
        """Why some stage's steps run eagerly (None: every stage replays its graph)."""
        for dec in self.parts:
            if dec.graph_reason is not None:
                return dec.graph_reason
        return None

    @graph_reason.setter
    def graph_reason(self, reason: str | None) -> None:
        for dec in self.parts:
            dec.graph_reason = reason

    def set_prefetch(self, p: int) -> None:
        for dec in self.parts:
            with on_device(dec.device):
                dec.set_prefetch(p)

    def set_cpu_share(self, share: float, threads: int) -> None:
        for dec in self.parts:
            with on_device(dec.device):
                dec.set_cpu_share(share, threads)

    @property
    def cpu_sharing(self) -> bool:
        return any(dec.cpu_sharing for dec in self.parts)

    def tune_cpu_share(self) -> list[float]:
        """Each stage's CPU share, chosen by timing that stage's steps (``FastDecoder``'s)."""
        chosen = []
        for dec in self.parts:
            with on_device(dec.device):
                chosen.append(dec.tune_cpu_share())
        return chosen

    def bind_stages(self) -> None:
        """Each stage's decoder serves its experts from its own stage's provider (reached
        through the layer -> stage map): the tables follow that cache from now on."""
        for dec in self.parts:
            with on_device(dec.device):
                dec.bind(self.model.provider_of(dec.first))

    def warm_up(self, on_layer: Callable[[int], None] | None = None) -> None:
        for dec in self.parts:
            with on_device(dec.device):
                dec.warm_up(on_layer)

    def capture(self) -> bool:
        ok = True
        for dec in self.parts:
            with on_device(dec.device):
                ok = dec.capture() and ok
        return ok

    def step(self, token: int, pos: int) -> torch.Tensor:
        """Logits of ``token`` at ``pos`` (the last stage's buffer [V], valid until the next
        step): each stage's step in turn, the hidden state handed from one to the next."""
        prev: FastDecoder | None = None
        for dec in self.parts:
            with on_device(dec.device):
                if prev is not None:
                    dec.x.copy_(prev.x)  # the hidden state to this stage (its graph's input)
                dec.run_step(token, pos)
            prev = dec
        for dec in self.parts:
            with on_device(dec.device):
                dec.after_step()
                dec.confirm_cpu()
        return self.logits

    def flush_usage(self) -> list[ExpertKey]:
        used: list[ExpertKey] = []
        for dec in self.parts:
            used += dec.flush_usage()
        return used

    def adapt(self) -> int:
        done = 0
        for dec in self.parts:
            with on_device(dec.device):
                done += dec.adapt()
        return done

    def describe(self) -> str:
        n = len(self.parts)
        if self.graph_reason is None:
            return f"fused Triton kernels, one CUDA graph per stage per step ({n} stages)"
        return f"fused Triton kernels over {n} stages, eager ({self.graph_reason})"

    def close(self) -> None:
        for dec in self.parts:
            dec.close()


class StagedPrefill:
    """Prompt chunks through each stage's prefill path, the chunk's hidden states handed
    from one stage to the next."""

    def __init__(self, parts: Sequence[FastDecoder]) -> None:
        self.parts = list(parts)

    def forward(self, tokens: torch.Tensor, start: int, last_only: bool = False) -> torch.Tensor:
        """As ``FastPrefill.forward``: the last stage's logits."""
        x: torch.Tensor | None = None
        for dec in self.parts:
            assert dec.prefill is not None
            with on_device(dec.device):
                x_in = None if x is None else x.to(dec.device)
                x = dec.prefill.forward(tokens.to(dec.device), start, last_only, x_in)
        assert x is not None
        return x

    def warm_up(self) -> None:
        for dec in self.parts:
            assert dec.prefill is not None
            with on_device(dec.device):
                dec.prefill.warm_up()

    def capture(self, chunk: int) -> bool:
        ok = True
        for dec in self.parts:
            assert dec.prefill is not None
            with on_device(dec.device):
                ok = dec.prefill.capture(chunk) and ok
        return ok
