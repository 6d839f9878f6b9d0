"""What every MoE architecture's file builds on: its hyper-parameters (``ModelArgs``) and the
weights of a decoder stack (``MoEModel``) whose layers the file defines once, in operations
(``engine.ops``).

``MoEModel.forward(ops, layers, x)`` runs a range of layers with one runner's operations: the
first stage embeds, the last runs the output head. The model holds weights only — no K/V, no
expert provider, no device state of a runner: those belong to the runner of each stage, which
passes them to its operations.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from strata.engine.devices import on_device
from strata.engine.errors import ModelLoadError
from strata.engine.gguf_index import GGUFIndex
from strata.engine.ops import (
    AttentionSpec,
    AttentionWeights,
    HeadWeights,
    ModelShape,
    MoEWeights,
    Ops,
    RopeSpec,
    RoutingSpec,
)
from strata.engine.quant import REPACKED_TYPES
from strata.engine.weights import QWeight, RepackedWeight, Weight

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelArgs:
    """An architecture's hyper-parameters, read from the ``{arch}.*`` keys of its file. Read
    only here and in the model files: everything else takes ``ModelShape`` and the specs."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    context_length: int
    rope_theta: float
    rms_eps: float
    vocab_size: int
    rope_neox: bool
    qk_norm: bool
    norm_topk: bool = True

    @classmethod
    def read(cls, index: GGUFIndex, **arch: object) -> ModelArgs:
        """Hyper-parameters from the ``{arch}.*`` keys every llama.cpp MoE file carries."""
        n_head = int(index.key("attention.head_count"))
        n_embd = int(index.key("embedding_length"))
        head_dim = int(index.key("attention.key_length", n_embd // n_head))
        n_expert = int(index.key("expert_count", 0))
        if n_expert == 0:
            raise ModelLoadError(f"{index.path}: {index.arch} file without routed experts")
        gate = index.info("blk.0.ffn_gate_exps.weight")
        embd = index.info("token_embd.weight")
        return cls(
            n_layer=int(index.key("block_count")),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=int(index.key("attention.head_count_kv", n_head)),
            head_dim=head_dim,
            n_expert=n_expert,
            n_expert_used=int(index.key("expert_used_count")),
            n_ff_exp=gate.shape[1],
            context_length=int(index.key("context_length")),
            rope_theta=float(index.key("rope.freq_base", 10000.0)),
            rms_eps=float(index.key("attention.layer_norm_rms_epsilon")),
            vocab_size=embd.shape[0],
            **arch,  # type: ignore[arg-type]
        )

    @property
    def attention(self) -> AttentionSpec:
        rope = RopeSpec(self.rope_theta, self.rope_neox)
        return AttentionSpec(self.n_head, self.n_head_kv, self.head_dim, self.rms_eps, rope)

    @property
    def routing(self) -> RoutingSpec:
        return RoutingSpec(self.n_expert, self.n_expert_used, self.norm_topk, self.rms_eps)

    @property
    def shape(self) -> ModelShape:
        return ModelShape(
            n_layer=self.n_layer,
            n_embd=self.n_embd,
            n_ff_exp=self.n_ff_exp,
            vocab_size=self.vocab_size,
            context_length=self.context_length,
            rms_eps=self.rms_eps,
            attention=self.attention,
            routing=self.routing,
        )


class MoEModel(ABC):
    """The dense weights of a decoder stack (loaded once, each on its stage's device) and the
    forward pass over them, its layer defined by the architecture's file (``layer``).

    ``split``: the stages, contiguous layer ranges each on its device (one stage on ``device``
    without one); the embeddings live on the first stage's device, the output norm and head on
    the last's. With ``repack`` the dense matrices of a type that has one are held in the kernel
    layout (``RepackedWeight``, what the GPU kernels read); the others keep the file's encoding,
    and ``slow_tensors`` names them."""

    def __init__(
        self,
        index: GGUFIndex,
        device: torch.device | str = "cpu",
        repack: bool = False,
        split: Sequence[tuple[range, torch.device]] | None = None,
    ) -> None:
        self.index = index
        self.args = args = self.read_args(index)
        self.shape = args.shape
        self.attention_spec, self.routing_spec = args.attention, args.routing
        if split is None:
            split = [(range(args.n_layer), torch.device(device))]
        self.spans = [r for r, _ in split]
        self.stage_devices = [torch.device(d) for _, d in split]
        if [i for r in self.spans for i in r] != list(range(args.n_layer)):
            raise ValueError(f"stages {self.spans} do not cover layers 0-{args.n_layer - 1}")
        self.stage_of = [s for s, r in enumerate(self.spans) for _ in r]  # layer -> stage
        self.device, self.out_device = self.stage_devices[0], self.stage_devices[-1]
        self.repack = repack
        self.slow_tensors: list[str] = []
        # Dense weights live on their layer's device for the model's life (copied once, still
        # quantised); on the CPU they stay views of the mapped file.
        self.embd = self.weight("token_embd.weight")
        # Files with tied embeddings have no output.weight (llama.cpp then reuses token_embd).
        if "output.weight" in index.tensors:
            output = self.weight("output.weight", self.out_device)
        elif self.out_device != self.device:
            output = self.weight("token_embd.weight", self.out_device)
        else:
            output = self.embd
        self.head = HeadWeights(
            self.vector("output_norm.weight", self.out_device), output, args.rms_eps
        )
        self.attn: list[AttentionWeights] = []
        self.ffn: list[MoEWeights] = []
        for i in range(args.n_layer):
            dev = self.stage_devices[self.stage_of[i]]
            self.attn.append(self.attention_weights(i, dev))
            self.ffn.append(self.moe_weights(i, dev))
        if self.slow_tensors:
            log.warning(
                "%d dense tensors have no GPU kernel for their type and are dequantised before "
                "each product: %s",
                len(self.slow_tensors),
                ", ".join(self.slow_tensors),
            )

    @classmethod
    @abstractmethod
    def read_args(cls, index: GGUFIndex) -> ModelArgs:
        """The architecture's hyper-parameters from ``index``, checked (``models.read_args``)."""

    @classmethod
    def read_shape(cls, index: GGUFIndex) -> ModelShape:
        """The sizes of the model in ``index`` (checked), without loading a weight."""
        return cls.read_args(index).shape

    # -- the forward pass ---------------------------------------------------------------------

    def forward(self, ops: Ops, layers: range, x: torch.Tensor | None = None) -> torch.Tensor:
        """``layers`` with ``ops``: from the embeddings when the range starts the model (else
        from ``x``, the previous stage's output), to the logits when it ends it (else the
        hidden state for the next stage)."""
        if layers.start == 0:
            x = ops.embed(self.embd)
        assert x is not None, "a later stage starts from the previous stage's hidden state"
        for i in layers:
            x = self.layer(ops, x, i)
        if layers.stop == self.shape.n_layer:
            x = ops.head(x, self.head)
        return x

    @abstractmethod
    def layer(self, ops: Ops, x: torch.Tensor, i: int) -> torch.Tensor:
        """What layer ``i`` does to the residual stream ``x``, in operations."""

    def kv_layers(self, span: range) -> list[int]:
        """The layers of ``span`` that keep K/V: all but a hybrid's recurrent ones."""
        recurrent = self.shape.recurrent
        return [i for i in span if not (recurrent and recurrent[i])]

    def state_layers(self, span: range) -> list[int]:
        """The layers of ``span`` that keep a recurrent state instead (a hybrid's DeltaNet)."""
        recurrent = self.shape.recurrent
        return [i for i in span if recurrent and recurrent[i]]

    # -- the weights --------------------------------------------------------------------------

    def attention_weights(self, i: int, device: torch.device) -> AttentionWeights:
        p = f"blk.{i}."
        qk = self.args.qk_norm
        return AttentionWeights(
            norm=self.vector(p + "attn_norm.weight", device),
            q=self.weight(p + "attn_q.weight", device),
            k=self.weight(p + "attn_k.weight", device),
            v=self.weight(p + "attn_v.weight", device),
            o=self.weight(p + "attn_output.weight", device),
            q_norm=self.vector(p + "attn_q_norm.weight", device) if qk else None,
            k_norm=self.vector(p + "attn_k_norm.weight", device) if qk else None,
        )

    def moe_weights(self, i: int, device: torch.device) -> MoEWeights:
        p = f"blk.{i}."
        return MoEWeights(
            norm=self.vector(p + "ffn_norm.weight", device),
            router=self.weight(p + "ffn_gate_inp.weight", device),
        )

    def weight(self, name: str, device: torch.device | None = None) -> Weight:
        """A matrix of the file on ``device`` (the first stage's by default): repacked for the
        kernels where ``repack`` is set and its type has a kernel layout."""
        info = self.index.info(name)
        dev = device or self.device
        w = QWeight.of_tensor(self.index, info).to(dev)
        if not self.repack or len(info.shape) != 2:
            return w
        if info.qtype not in REPACKED_TYPES:
            self.slow_tensors.append(f"{name} ({info.qtype.name})")
            return w
        with on_device(dev):  # the repack kernels launch on the current device
            return RepackedWeight.repack(w.raw, info.qtype, info.shape)

    def vector(self, name: str, device: torch.device | None = None) -> torch.Tensor:
        """A vector of the file (a norm's weights), dequantised to float32 on ``device``."""
        info = self.index.info(name)
        dev = device or self.device
        with on_device(dev):
            return QWeight.of_tensor(self.index, info).to(dev).dequant()
