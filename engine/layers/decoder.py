"""The decoder stack that MoE architectures share: embed → N × (attention, MoE) → norm → logits.

Model files under ``engine/models`` read their hyper-parameters and say what differs (RoPE layout,
q/k norms, routing normalisation); the forward pass itself lives here once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from strata.engine.devices import on_device
from strata.engine.errors import ModelLoadError
from strata.engine.experts import ExpertProvider
from strata.engine.gguf_index import GGUFIndex
from strata.engine.kv import KVCache
from strata.engine.layers.attention import AttentionShape, AttentionWeights, attention
from strata.engine.layers.moe import MoEShape, moe
from strata.engine.layers.norm import rms_norm
from strata.engine.layers.rope import Rope
from strata.engine.quant import REPACKED_TYPES
from strata.engine.weights import QWeight, RepackedWeight, Weight, linear

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecoderArgs:
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
    def read(cls, index: GGUFIndex, **arch: object) -> DecoderArgs:
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


@dataclass(frozen=True)
class Block:
    attn_norm: torch.Tensor
    attn: AttentionWeights
    ffn_norm: torch.Tensor
    router: Weight


class MoEDecoder:
    """The dense weights (loaded once) and the expert provider; ``forward`` gives logits.

    With ``repack`` the dense matrices of a type that has one are held in the kernel layout
    (``RepackedWeight``, what the GPU decode kernels read); the others keep the file's encoding,
    and ``slow_tensors`` names them."""

    def __init__(
        self,
        index: GGUFIndex,
        args: DecoderArgs,
        provider: ExpertProvider,
        device: torch.device | str = "cpu",
        repack: bool = False,
        split: Sequence[tuple[range, torch.device]] | None = None,
        providers: Sequence[ExpertProvider] | None = None,
    ) -> None:
        self.index, self.args = index, args
        # Stages (``engine.stages``): contiguous layer ranges, each on its device, each with
        # its own expert provider; one stage on ``device`` without a ``split``. The embeddings
        # live on the first stage's device, the output norm and head on the last's.
        if split is None:
            split = [(range(args.n_layer), torch.device(device))]
        self.spans = [r for r, _ in split]
        self.stage_devices = [torch.device(d) for _, d in split]
        if [i for r in self.spans for i in r] != list(range(args.n_layer)):
            raise ValueError(f"stages {self.spans} do not cover layers 0-{args.n_layer - 1}")
        self.stage_of = [s for s, r in enumerate(self.spans) for _ in r]  # layer -> stage
        self.providers: list[ExpertProvider] = list(providers) if providers else [provider]
        if len(self.providers) != len(self.spans):
            raise ValueError(f"{len(self.providers)} expert providers for {len(self.spans)} stages")
        # Dense weights live on their layer's device for the model's life (copied once, still
        # quantised); on the CPU they stay views of the mapped file.
        self.device = self.stage_devices[0]
        self.out_device = self.stage_devices[-1]
        self.repack = repack
        self.slow_tensors: list[str] = []
        self.embd = self._w("token_embd.weight")
        self.out_norm = self._vec("output_norm.weight", self.out_device)
        # Files with tied embeddings have no output.weight (llama.cpp then reuses token_embd).
        if "output.weight" in index.tensors:
            self.output = self._w("output.weight", self.out_device)
        elif self.out_device != self.device:
            self.output = self._w("token_embd.weight", self.out_device)
        else:
            self.output = self.embd
        self.blocks = [self._block(i) for i in range(args.n_layer)]
        # one per stage: the tables follow their device
        self.ropes = [Rope(args.head_dim, args.rope_theta, neox=args.rope_neox) for _ in self.spans]
        self.rope = self.ropes[0]
        self.attn_shape = AttentionShape(args.n_head, args.n_head_kv, args.head_dim, args.rms_eps)
        self.moe_shape = MoEShape(args.n_expert, args.n_expert_used, args.norm_topk)
        if self.slow_tensors:
            log.warning(
                "%d dense tensors have no GPU kernel for their type and are dequantised before "
                "each product: %s",
                len(self.slow_tensors),
                ", ".join(self.slow_tensors),
            )

    @property
    def provider(self) -> ExpertProvider:
        """The first stage's expert provider (the only one without stages)."""
        return self.providers[0]

    @provider.setter
    def provider(self, provider: ExpertProvider) -> None:
        self.providers[0] = provider

    def provider_of(self, layer: int) -> ExpertProvider:
        """The expert provider of the stage that owns ``layer``: the only way to a layer's
        experts (one stage never reads another's slots)."""
        return self.providers[self.stage_of[layer]]

    def _w(self, name: str, device: torch.device | None = None) -> Weight:
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

    def _vec(self, name: str, device: torch.device | None = None) -> torch.Tensor:
        info = self.index.info(name)
        dev = device or self.device
        with on_device(dev):
            return QWeight.of_tensor(self.index, info).to(dev).dequant()

    def _block(self, i: int) -> Block:
        p = f"blk.{i}."
        qk = self.args.qk_norm
        dev = self.stage_devices[self.stage_of[i]]
        attn = AttentionWeights(
            q=self._w(p + "attn_q.weight", dev),
            k=self._w(p + "attn_k.weight", dev),
            v=self._w(p + "attn_v.weight", dev),
            o=self._w(p + "attn_output.weight", dev),
            q_norm=self._vec(p + "attn_q_norm.weight", dev) if qk else None,
            k_norm=self._vec(p + "attn_k_norm.weight", dev) if qk else None,
        )
        return Block(
            attn_norm=self._vec(p + "attn_norm.weight", dev),
            attn=attn,
            ffn_norm=self._vec(p + "ffn_norm.weight", dev),
            router=self._w(p + "ffn_gate_inp.weight", dev),
        )

    def new_kv(self, n_ctx: int, kind: str, stage: int = 0, **options: Any) -> KVCache:
        """The K/V cache of ``stage``'s layers, on its device (``options``: ``KVCache``'s
        keywords)."""
        a, n = self.args, len(self.spans[stage])
        dev = self.stage_devices[stage]
        return KVCache(n, n_ctx, a.n_head_kv, a.head_dim, kind, dev, **options)

    def forward(
        self,
        tokens: torch.Tensor,
        start: int,
        kv: KVCache | Sequence[KVCache],
        last_only: bool = False,
    ) -> torch.Tensor:
        # tokens: [T] -> logits: [T, V] (or [1, V] with last_only); kv: one per stage
        eps = self.args.rms_eps
        kvs = [kv] if isinstance(kv, KVCache) else list(kv)
        staged = len(self.spans) > 1
        x = self.embd.rows(tokens)  # [T, D]
        for s, dev in enumerate(self.stage_devices):
            x = x.to(dev)  # the hidden state to the next stage (no-op with one)
            # (kernels launch on the current GPU: each stage's on its own)
            with on_device(dev) if staged else nullcontext():
                x = self._stage_layers(x, s, kvs[s], start)
        for stage_kv in kvs:
            stage_kv.length = start + tokens.shape[0]
        for provider in self.providers:
            provider.step()
        if last_only:
            x = x[-1:]
        with on_device(self.out_device) if staged else nullcontext():
            return linear(rms_norm(x, self.out_norm, eps), self.output)

    def _stage_layers(self, x: torch.Tensor, s: int, kv: KVCache, start: int) -> torch.Tensor:
        # x: [T, D] -> [T, D] through stage s's layers, its K/V and its expert provider
        eps, span, provider, rope = (
            self.args.rms_eps,
            self.spans[s],
            self.providers[s],
            self.ropes[s],
        )
        for i in span:
            b = self.blocks[i]
            h = rms_norm(x, b.attn_norm, eps)
            x = x + attention(h, b.attn, self.attn_shape, rope, kv, i - span.start, start)
            h = rms_norm(x, b.ffn_norm, eps)
            x = x + moe(h, b.router, self.moe_shape, provider, i)
        return x
