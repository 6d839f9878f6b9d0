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
    n_rot: int | None = None  # rotate the first n_rot values of a head (None: all of them)
    # the interleaved multi-section layout (Qwen3.5's "imrope"): rotation pair i belongs to
    # section t, h or w by i % 3 while i < 3 * that section's size, else to the fourth; a text
    # position fills the first three sections and leaves the fourth at position 0 (unrotated)
    sections: tuple[int, int, int, int] | None = None
    yarn: YarnSpec | None = None  # YaRN's interpolation of long contexts (gpt-oss)


@dataclass(frozen=True)
class YarnSpec:
    """YaRN, as llama.cpp's ``rope_yarn`` computes it: each rotation pair's angle mixes the
    interpolated one (position / ``factor``) and the original by a ramp over the pairs between
    the correction dimensions of ``beta_fast`` and ``beta_slow`` (times ``ext_factor``), and
    cos and sin are scaled by ``mscale``."""

    factor: float  # the context's stretch (1 / llama.cpp's freq_scale)
    orig_ctx: int  # the context the model was trained at before the stretch
    ext_factor: float = 1.0
    mscale: float = 1.0  # 1 + 0.1 ln(factor) unless the file says otherwise
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class AttentionSpec:
    """Grouped-query causal self-attention over the K/V cache, with RMSNorm before it."""

    n_head: int
    n_head_kv: int
    head_dim: int
    rms_eps: float
    rope: RopeSpec
    gated: bool = False  # the q projection gives each head its query, then a gate: out * σ(gate)
    # a sliding window: a query at position p sees keys p - window + 1 .. p (None: all before it)
    window: int | None = None

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


@dataclass(frozen=True)
class SwigluOAI:
    """gpt-oss's clamped SwiGLU: gate g clamped above at ``limit``, up u into [-limit, limit],
    out = g σ(alpha g) (u + 1)."""

    alpha: float = 1.702
    limit: float = 7.0


@dataclass(frozen=True)
class RoutingSpec:
    """A routed-expert block: softmax over ``n_expert`` router logits, the top ``n_used``,
    their weights renormalised to sum to 1 with ``norm_topk``; SwiGLU experts.
    ``softmax_after_topk``: the top ``n_used`` logits first, then a softmax over those alone
    (gpt-oss); ``activation``: the clamped SwiGLU instead of the plain one."""

    n_expert: int
    n_used: int
    norm_topk: bool
    rms_eps: float
    softmax_after_topk: bool = False
    activation: SwigluOAI | None = None


@dataclass(frozen=True)
class DeltaNetSpec:
    """A Gated DeltaNet layer (linear attention with a recurrent state per sequence): a causal
    convolution of ``conv_kernel`` taps over q|k|v, ``n_k_heads`` q/k heads and ``n_v_heads``
    v heads of ``head_dim`` values, a [head_dim, head_dim] state per v head. ``tiled_heads``:
    v head h reads k head h % n_k_heads (Qwen3.5's file order); else h // (n_v / n_k)."""

    n_k_heads: int
    n_v_heads: int
    head_dim: int
    conv_kernel: int
    rms_eps: float
    tiled_heads: bool

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


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
    delta_net: DeltaNetSpec | None = None  # the hybrids' linear-attention layers
    recurrent: tuple[bool, ...] = ()  # per layer: a DeltaNet layer (no K/V; a state)
    # per layer: attention over a sliding window of ``window`` positions (its K/V keeps only
    # that window's pages); () or False: over every position before it
    windowed: tuple[bool, ...] = ()
    window: int = 0


@dataclass(frozen=True)
class AttentionWeights:
    norm: torch.Tensor  # [D] the RMSNorm before attention
    q: Weight
    k: Weight
    v: Weight
    o: Weight
    q_norm: torch.Tensor | None = None  # [d] per-head RMSNorm (Qwen3)
    k_norm: torch.Tensor | None = None
    sinks: torch.Tensor | None = None  # [H] a learned logit per head beside the keys (gpt-oss)
    q_bias: torch.Tensor | None = None  # [H d] biases added by the projections
    k_bias: torch.Tensor | None = None  # [Hkv d]
    v_bias: torch.Tensor | None = None  # [Hkv d]
    o_bias: torch.Tensor | None = None  # [D]


@dataclass(frozen=True)
class DeltaNetWeights:
    norm: torch.Tensor  # [D] the RMSNorm before the layer
    qkv: Weight | None  # [2 Hk S + Hv S, D] q|k|v (None: a fused qkvz)
    z: Weight | None  # [Hv S, D] the output gate
    beta: Weight | None  # [Hv, D] (None: a fused ba)
    alpha: Weight | None  # [Hv, D]
    conv: torch.Tensor  # [C, K] the causal convolution's taps
    dt_bias: torch.Tensor  # [Hv]
    a: torch.Tensor  # [Hv] -exp(A_log): the decay rate, negative
    out_norm: torch.Tensor  # [S] the gated RMSNorm's weights
    out: Weight  # [D, Hv S]
    qkvz: Weight | None = None  # Qwen3-Next's older fused layout: per k head q, k, its v, its z
    ba: Weight | None = None  # Qwen3-Next: per k head its β rows, then its α rows


@dataclass(frozen=True)
class SharedExpert:
    """A dense SwiGLU expert every token takes, scaled by σ(gate · x)."""

    gate_inp: torch.Tensor  # [D]
    gate: Weight  # [F, D]
    up: Weight  # [F, D]
    down: Weight  # [D, F]


@dataclass(frozen=True)
class ExpertBiases:
    """The routed experts' biases (gpt-oss), small enough to live beside the dense weights:
    the cache holds the matrices only."""

    gate: torch.Tensor  # [E, F]
    up: torch.Tensor  # [E, F]
    down: torch.Tensor  # [E, D]


@dataclass(frozen=True)
class MoEWeights:
    norm: torch.Tensor  # [D] the RMSNorm before the block
    router: Weight  # [E, D]
    shared: SharedExpert | None = None
    router_bias: torch.Tensor | None = None  # [E]
    expert_bias: ExpertBiases | None = None


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

    def delta_net(
        self, x: torch.Tensor, layer: int, w: DeltaNetWeights, spec: DeltaNetSpec
    ) -> torch.Tensor: ...

    def head(self, x: torch.Tensor, w: HeadWeights) -> torch.Tensor: ...
