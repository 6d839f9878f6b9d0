"""The reference stage runner: the model file's layers with the reference operations
(``ops.reference``), on any device. What the GPU runner's numbers are checked against, and what
runs where the GPU kernels cannot (the CPU, a type without a kernel, a failed build)."""

from __future__ import annotations

import torch

from strata.engine.experts import ExpertProvider
from strata.engine.kv import KVCache
from strata.engine.models.base import MoEModel
from strata.engine.ops.reference import RefOps, Rope
from strata.engine.step import Batch, StageRunner


class ReferenceRunner(StageRunner):
    def __init__(self, model: MoEModel, number: int, kv: KVCache, provider: ExpertProvider) -> None:
        super().__init__(model, number, kv, provider)
        spec = model.attention_spec
        self.rope = Rope(spec.head_dim, spec.rope)  # its tables follow the stage's device

    def run(self, batch: Batch, x: torch.Tensor | None = None) -> torch.Tensor:
        return reference_step(self, self.rope, batch, x)


def reference_step(
    stage: StageRunner, rope: Rope, batch: Batch, x: torch.Tensor | None
) -> torch.Tensor:
    """``batch`` through ``stage``'s layers with the reference operations (also the GPU
    runner's prompt chunks where its tensor-core path is off)."""
    seq = batch.one
    if seq.end > stage.kv.n_ctx:
        raise ValueError(
            f"{len(seq.tokens)} tokens at position {seq.start} do not fit the context "
            f"of {stage.kv.n_ctx}"
        )
    model, state = stage.model, stage.kv.state
    kv_slots = state_slots = None
    if model.shape.recurrent:
        kv_slots = {layer: i for i, layer in enumerate(model.kv_layers(stage.layers))}
        state_slots = {layer: i for i, layer in enumerate(model.state_layers(stage.layers))}
    if state is not None:
        if state.dirty or len(state.tokens) != seq.start:
            held = "a failed step's" if state.dirty else f"{len(state.tokens)} positions'"
            raise RuntimeError(
                f"the recurrent state holds {held} state, the step starts at {seq.start}"
            )
        state.begin_step()
    ops = RefOps(
        seq.tensor(stage.device), seq.start, stage.kv, stage.layers.start, stage.provider,
        rope, last_only=batch.last_only, kv_slots=kv_slots, state=state,
        state_slots=state_slots,
    )  # fmt: skip
    out = model.forward(ops, stage.layers, x)
    stage.kv.length = seq.end
    return out
