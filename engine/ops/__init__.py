"""The operations a model file composes its layers of, and what they take.

A model file (``engine/models``) says what one layer does in terms of these operations; each
runner brings its own implementation of them (``Ops``): the reference one (``ops.reference``,
plain torch, any device), the GPU decode step's (``gpu.decode``: fused Triton kernels on fixed
buffers, captured as one CUDA graph) and the GPU prompt chunk's (``gpu.chunk``: tensor-core
products). The reference runner, the decode graphs and the prompt chunks therefore all run the
one definition of the forward pass.

Architecture differences are parameters of an operation (``AttentionSpec``, ``RoutingSpec``:
the RoPE layout, q/k norms, top-k renormalisation) or operations of their own; no runner or
kernel reads an architecture's hyper-parameters (``ModelArgs``) — they take ``ModelShape``
(sizes) and the specs. The expert cache plugs into one place: the routed-expert operation, which
reads experts through its runner's expert tables (GPU) or its stage's expert provider
(reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from strata.engine.weights import Weight


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    neox: bool  # dimension i rotates with i + d/2 (Qwen); else 2i with 2i + 1 (Llama, Mixtral)


@dataclass(frozen=True)
class AttentionSpec:
    """Grouped-query causal self-attention over the K/V cache, with RMSNorm before it."""

    n_head: int
    n_head_kv: int
    head_dim: int
    rms_eps: float
    rope: RopeSpec

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


@dataclass(frozen=True)
class RoutingSpec:
    """A routed-expert block: softmax over ``n_expert`` router logits, the top ``n_used``,
    their weights renormalised to sum to 1 with ``norm_topk``; SwiGLU experts."""

    n_expert: int
    n_used: int
    norm_topk: bool
    rms_eps: float


@dataclass(frozen=True)
class ModelShape:
    """The sizes a runner allocates its buffers by (no architecture's flags)."""

    n_layer: int
    n_embd: int
    n_ff_exp: int
    vocab_size: int
    context_length: int
    rms_eps: float
    attention: AttentionSpec
    routing: RoutingSpec


@dataclass(frozen=True)
class AttentionWeights:
    norm: torch.Tensor  # [D] the RMSNorm before attention
    q: Weight
    k: Weight
    v: Weight
    o: Weight
    q_norm: torch.Tensor | None = None  # [d] per-head RMSNorm (Qwen3)
    k_norm: torch.Tensor | None = None


@dataclass(frozen=True)
class MoEWeights:
    norm: torch.Tensor  # [D] the RMSNorm before the block
    router: Weight  # [E, D]


@dataclass(frozen=True)
class HeadWeights:
    norm: torch.Tensor  # [D] the output norm
    output: Weight  # [V, D]
    rms_eps: float


class Ops(Protocol):
    """One runner's implementation of the operations. ``x`` is the residual stream of the
    positions the step runs (its shape and where it lives are the runner's business); each
    operation adds its block's output to it and returns the stream. ``layer``: the model's
    layer index."""

    def embed(self, embd: Weight) -> torch.Tensor: ...

    def attention(
        self, x: torch.Tensor, layer: int, w: AttentionWeights, spec: AttentionSpec
    ) -> torch.Tensor: ...

    def moe(
        self, x: torch.Tensor, layer: int, w: MoEWeights, spec: RoutingSpec
    ) -> torch.Tensor: ...

    def head(self, x: torch.Tensor, w: HeadWeights) -> torch.Tensor: ...
