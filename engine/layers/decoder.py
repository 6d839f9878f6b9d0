"""The decoder stack that MoE architectures share: embed → N × (attention, MoE) → norm → logits.

Model files under ``engine/models`` read their hyper-parameters and say what differs (RoPE layout,
q/k norms, routing normalisation); the forward pass itself lives here once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from strata.engine.errors import ModelLoadError
from strata.engine.experts import ExpertProvider
from strata.engine.gguf_index import GGUFIndex
from strata.engine.kv import KVCache
from strata.engine.layers.attention import AttentionShape, AttentionWeights, attention
from strata.engine.layers.moe import MoEShape, moe
from strata.engine.layers.norm import rms_norm
from strata.engine.layers.rope import Rope
from strata.engine.layers.weights import QWeight, RepackedWeight, Weight, linear
from strata.engine.quant import REPACKED_TYPES

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
    ) -> None:
        self.index, self.args, self.provider = index, args, provider
        # Dense weights live on the compute device for the model's life (copied once, still
        # quantised); on the CPU they stay views of the mapped file.
        self.device = torch.device(device)
        self.repack = repack
        self.slow_tensors: list[str] = []
        self.embd = self._w("token_embd.weight")
        self.out_norm = self._vec("output_norm.weight")
        # Files with tied embeddings have no output.weight (llama.cpp then reuses token_embd).
        self.output = self._w("output.weight") if "output.weight" in index.tensors else self.embd
        self.blocks = [self._block(i) for i in range(args.n_layer)]
        self.rope = Rope(args.head_dim, args.rope_theta, neox=args.rope_neox)
        self.attn_shape = AttentionShape(args.n_head, args.n_head_kv, args.head_dim, args.rms_eps)
        self.moe_shape = MoEShape(args.n_expert, args.n_expert_used, args.norm_topk)
        if self.slow_tensors:
            log.warning(
                "%d dense tensors have no GPU kernel for their type and are dequantised before "
                "each product: %s",
                len(self.slow_tensors),
                ", ".join(self.slow_tensors),
            )

    def _w(self, name: str) -> Weight:
        info = self.index.info(name)
        w = QWeight.of_tensor(self.index, info).to(self.device)
        if not self.repack or len(info.shape) != 2:
            return w
        if info.qtype not in REPACKED_TYPES:
            self.slow_tensors.append(f"{name} ({info.qtype.name})")
            return w
        return RepackedWeight.repack(w.raw, info.qtype, info.shape)

    def _vec(self, name: str) -> torch.Tensor:
        return QWeight.of_tensor(self.index, self.index.info(name)).to(self.device).dequant()

    def _block(self, i: int) -> Block:
        p = f"blk.{i}."
        qk = self.args.qk_norm
        attn = AttentionWeights(
            q=self._w(p + "attn_q.weight"),
            k=self._w(p + "attn_k.weight"),
            v=self._w(p + "attn_v.weight"),
            o=self._w(p + "attn_output.weight"),
            q_norm=self._vec(p + "attn_q_norm.weight") if qk else None,
            k_norm=self._vec(p + "attn_k_norm.weight") if qk else None,
        )
        return Block(
            attn_norm=self._vec(p + "attn_norm.weight"),
            attn=attn,
            ffn_norm=self._vec(p + "ffn_norm.weight"),
            router=self._w(p + "ffn_gate_inp.weight"),
        )

    def new_kv(self, n_ctx: int, kind: str, **options: Any) -> KVCache:
        """The K/V cache for this model (``options``: ``KVCache``'s keywords)."""
        a = self.args
        return KVCache(a.n_layer, n_ctx, a.n_head_kv, a.head_dim, kind, self.device, **options)

    def forward(
        self, tokens: torch.Tensor, start: int, kv: KVCache, last_only: bool = False
    ) -> torch.Tensor:
        # tokens: [T] -> logits: [T, V] (or [1, V] with last_only)
        eps = self.args.rms_eps
        x = self.embd.rows(tokens)  # [T, D]
        for i, b in enumerate(self.blocks):
            h = rms_norm(x, b.attn_norm, eps)
            x = x + attention(h, b.attn, self.attn_shape, self.rope, kv, i, start)
            h = rms_norm(x, b.ffn_norm, eps)
            x = x + moe(h, b.router, self.moe_shape, self.provider, i)
        kv.length = start + tokens.shape[0]
        self.provider.step()
        if last_only:
            x = x[-1:]
        return linear(rms_norm(x, self.out_norm, eps), self.output)
