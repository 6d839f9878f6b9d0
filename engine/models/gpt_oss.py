"""gpt-oss (gpt-oss-20b, gpt-oss-120b; GGUF ``general.architecture`` ``gpt-oss``): grouped-query
attention with a learned sink logit per head, a sliding window on alternate layers (the window
and the pattern from the file), biases on q/k/v and the output projection, NeoX RoPE with YaRN;
routed experts chosen as the top k router logits (the router has a bias) weighted by a softmax
over those k, each expert a clamped SwiGLU (α 1.702, limit 7, up + 1) with biases on gate, up and
down. No q/k norms, no shared expert.

What llama.cpp reads, read here and checked: ``attention.sliding_window`` (required),
``attention.sliding_window_pattern`` (a period p — layer i has the window unless
i % p == p - 1, 2 by default — or one boolean per layer), ``rope.scaling.*`` (YaRN: factor,
original context, and the ext/attn factors and betas where the file gives them; llama.cpp's
defaults where it does not).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from strata.engine.errors import ModelLoadError
from strata.engine.gguf_index import GGUFIndex
from strata.engine.models import read_args
from strata.engine.models.base import ModelArgs, MoEModel
from strata.engine.ops import (
    AttentionSpec,
    AttentionWeights,
    ExpertBiases,
    ModelShape,
    MoEWeights,
    Ops,
    RopeSpec,
    RoutingSpec,
    SwigluOAI,
    YarnSpec,
)

DEFAULT_PATTERN = 2  # llama.cpp's period for gpt-oss: even layers windowed, odd ones full


@dataclass(frozen=True)
class GptOssArgs(ModelArgs):
    window: int = 0
    windowed: tuple[bool, ...] = ()
    yarn: YarnSpec | None = None
    qkv_bias: bool = True

    @property
    def attention(self) -> AttentionSpec:
        rope = RopeSpec(self.rope_theta, True, yarn=self.yarn)
        return AttentionSpec(self.n_head, self.n_head_kv, self.head_dim, self.rms_eps, rope)

    @property
    def routing(self) -> RoutingSpec:
        return RoutingSpec(
            self.n_expert, self.n_expert_used, False, self.rms_eps,
            softmax_after_topk=True, activation=SwigluOAI(),
        )  # fmt: skip

    def layer_attention(self, i: int) -> AttentionSpec:
        return replace(self.attention, window=self.window if self.windowed[i] else None)

    @property
    def shape(self) -> ModelShape:
        return replace(super().shape, windowed=self.windowed, window=self.window)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape (torch order) of every tensor the decoder reads."""
        d, q, kv = self.n_embd, self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        e, ff = self.n_expert, self.n_ff_exp
        out: dict[str, tuple[int, ...]] = {
            "token_embd.weight": (self.vocab_size, d),
            "output_norm.weight": (d,),
            "output.weight": (self.vocab_size, d),
        }
        for i in range(self.n_layer):
            p = f"blk.{i}."
            out |= {
                p + "attn_norm.weight": (d,),
                p + "attn_q.weight": (q, d),
                p + "attn_k.weight": (kv, d),
                p + "attn_v.weight": (kv, d),
                p + "attn_output.weight": (d, q),
                p + "attn_output.bias": (d,),
                p + "attn_sinks.weight": (self.n_head,),
                p + "post_attention_norm.weight": (d,),
                p + "ffn_gate_inp.weight": (e, d),
                p + "ffn_gate_inp.bias": (e,),
                p + "ffn_gate_exps.weight": (e, ff, d),
                p + "ffn_up_exps.weight": (e, ff, d),
                p + "ffn_down_exps.weight": (e, d, ff),
                p + "ffn_gate_exps.bias": (e, ff),
                p + "ffn_up_exps.bias": (e, ff),
                p + "ffn_down_exps.bias": (e, d),
            }
            if self.qkv_bias:
                out |= {p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,),
                        p + "attn_v.bias": (kv,)}  # fmt: skip
        return out


def _bad(index: GGUFIndex, name: str, value: object, expected: str) -> ModelLoadError:
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:60] + "…"
    return ModelLoadError(
        f"{index.path}: metadata key {index.arch}.{name} is {shown}, expected {expected}"
    )


def _number(index: GGUFIndex, name: str, default: float, least: float = 0.0) -> float:
    value = index.key(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(index, name, value, "a finite number")
    if value < least:
        raise _bad(index, name, value, f"at least {least}")
    return float(value)


def _whole(index: GGUFIndex, name: str, default: object = ...) -> int:
    value = index.key(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(index, name, value, "a whole number of at least 1")
    return value


def _pattern(index: GGUFIndex, n_layer: int) -> tuple[bool, ...]:
    """Which layers have the window (llama.cpp's ``set_swa_pattern``, not dense first)."""
    raw = index.key("attention.sliding_window_pattern", DEFAULT_PATTERN)
    if isinstance(raw, list):
        if len(raw) < n_layer or any(not isinstance(v, bool | int) for v in raw):
            raise _bad(index, "attention.sliding_window_pattern", raw, f"{n_layer} booleans")
        return tuple(bool(v) for v in raw[:n_layer])
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
        raise _bad(index, "attention.sliding_window_pattern", raw, "a period >= 0 or booleans")
    return tuple(raw == 0 or i % raw < raw - 1 for i in range(n_layer))


def _yarn(index: GGUFIndex, context: int) -> YarnSpec | None:
    kind = index.key("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "yarn":
        raise _bad(index, "rope.scaling.type", kind, "'yarn' or none (gpt-oss files use YaRN)")
    factor = _number(index, "rope.scaling.factor", 1.0, least=1.0)
    orig = _whole(index, "rope.scaling.original_context_length", context)
    # llama.cpp's YaRN magnitude: (1 + 0.1 ln factor) × rope.scaling.attn_factor, unless the
    # converter stored the model's own attention factor
    mscale = index.key("rope.scaling.yarn_attn_factor", None)
    if mscale is None:
        mscale = 1.0 + 0.1 * math.log(factor)
    else:
        mscale = _number(index, "rope.scaling.yarn_attn_factor", 1.0)
    return YarnSpec(
        factor=factor,
        orig_ctx=orig,
        ext_factor=_number(index, "rope.scaling.yarn_ext_factor", 1.0),
        mscale=mscale * _number(index, "rope.scaling.attn_factor", 1.0),
        beta_fast=_number(index, "rope.scaling.yarn_beta_fast", 32.0),
        beta_slow=_number(index, "rope.scaling.yarn_beta_slow", 1.0),
    )


class Model(MoEModel):
    args: GptOssArgs

    @classmethod
    def read_args(cls, index: GGUFIndex) -> GptOssArgs:
        n_layer = _whole(index, "block_count")
        window = _whole(index, "attention.sliding_window")
        pattern = _pattern(index, n_layer)
        theta = index.key("rope.freq_base", 10000.0)
        swa_theta = index.key("rope.freq_base_swa", theta)
        if swa_theta != theta:
            raise _bad(index, "rope.freq_base_swa", swa_theta, f"rope.freq_base {theta}")
        scale = index.key("expert_weights_scale", 0.0)
        if not isinstance(scale, int | float) or scale not in (0, 1):
            raise _bad(index, "expert_weights_scale", scale, "absent, 0 or 1 (no scaling)")
        head_dim = _whole(index, "attention.key_length", index.key("embedding_length", 1)
                          // max(1, index.key("attention.head_count", 1)))  # fmt: skip
        value_length = _whole(index, "attention.value_length", head_dim)
        if value_length != head_dim:
            raise _bad(index, "attention.value_length", value_length, f"key_length {head_dim}")
        n_rot = _whole(index, "rope.dimension_count", head_dim)
        if n_rot != head_dim:
            raise _bad(index, "rope.dimension_count", n_rot, f"key_length {head_dim}")
        args = read_args(
            index, GptOssArgs, rope_neox=True, qk_norm=False, norm_topk=False,
            window=window, windowed=pattern, yarn=_yarn(index, int(index.key("context_length"))),
            qkv_bias="blk.0.attn_q.bias" in index.tensors,
        )  # fmt: skip
        ff = index.key("expert_feed_forward_length", None)
        if ff is not None and ff != args.n_ff_exp:
            raise _bad(index, "expert_feed_forward_length", ff,
                       f"the experts' {args.n_ff_exp} rows (ffn_gate_exps)")  # fmt: skip
        assert isinstance(args, GptOssArgs)
        return args

    def __init__(self, *a: object, **kw: object) -> None:
        super().__init__(*a, **kw)  # type: ignore[arg-type]
        self.layer_specs = [self.args.layer_attention(i) for i in range(self.args.n_layer)]

    def layer(self, ops: Ops, x: torch.Tensor, i: int) -> torch.Tensor:
        x = ops.attention(x, i, self.attn[i], self.layer_specs[i])
        return ops.moe(x, i, self.ffn[i], self.routing_spec)

    def attention_weights(self, i: int, device: torch.device) -> AttentionWeights:
        p = f"blk.{i}."
        bias = self.args.qkv_bias
        return AttentionWeights(
            norm=self.vector(p + "attn_norm.weight", device),
            q=self.weight(p + "attn_q.weight", device),
            k=self.weight(p + "attn_k.weight", device),
            v=self.weight(p + "attn_v.weight", device),
            o=self.weight(p + "attn_output.weight", device),
            sinks=self.vector(p + "attn_sinks.weight", device),
            q_bias=self.vector(p + "attn_q.bias", device) if bias else None,
            k_bias=self.vector(p + "attn_k.bias", device) if bias else None,
            v_bias=self.vector(p + "attn_v.bias", device) if bias else None,
            o_bias=self.vector(p + "attn_output.bias", device),
        )

    def moe_weights(self, i: int, device: torch.device) -> MoEWeights:
        p = f"blk.{i}."
        return MoEWeights(
            norm=self.vector(p + "post_attention_norm.weight", device),
            router=self.weight(p + "ffn_gate_inp.weight", device),
            router_bias=self.vector(p + "ffn_gate_inp.bias", device),
            expert_bias=ExpertBiases(
                gate=self.vector(p + "ffn_gate_exps.bias", device),
                up=self.vector(p + "ffn_up_exps.bias", device),
                down=self.vector(p + "ffn_down_exps.bias", device),
            ),
        )
