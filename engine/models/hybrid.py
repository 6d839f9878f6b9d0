"""What the Gated DeltaNet hybrids (Qwen3.5/3.6 ``qwen35moe``, Qwen3-Next ``qwen3next``) share:
their hyper-parameters (``HybridArgs``: the layer pattern, the DeltaNet sizes, partial rotary,
the shared expert) read and checked, and the weights of both layer kinds (``HybridModel``).

A layer is a DeltaNet layer (``ops.delta_net``) or gated attention (``ops.attention`` with
``AttentionSpec.gated``), then the routed experts with a σ-gated shared expert (``ops.moe``).
The two files differ in the rotary layout (Qwen3.5's interleaved sections, Qwen3-Next's NeoX),
how k heads spread over v heads, and how the DeltaNet's input projections are stored.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from strata.engine.errors import ModelLoadError
from strata.engine.gguf_index import GGUFIndex
from strata.engine.models.base import ModelArgs, MoEModel
from strata.engine.ops import (
    AttentionSpec,
    AttentionWeights,
    DeltaNetSpec,
    DeltaNetWeights,
    ModelShape,
    MoEWeights,
    Ops,
    RopeSpec,
    SharedExpert,
)


@dataclass(frozen=True)
class HybridArgs(ModelArgs):
    n_rot: int = 0
    rope_sections: tuple[int, int, int, int] | None = None
    recurrent: tuple[bool, ...] = ()
    conv_kernel: int = 0
    ssm_state: int = 0  # the head size of q, k and v in DeltaNet layers
    ssm_k_heads: int = 0
    ssm_v_heads: int = 0
    n_ff_shexp: int = 0
    tiled_heads: bool = True
    qkvz_fused: bool = False  # Qwen3-Next's older ssm_in
    ba_fused: bool = False  # Qwen3-Next's ssm_ba

    @property
    def attention(self) -> AttentionSpec:
        rope = RopeSpec(self.rope_theta, True, self.n_rot, self.rope_sections)
        return AttentionSpec(
            self.n_head, self.n_head_kv, self.head_dim, self.rms_eps, rope, gated=True
        )

    @property
    def delta_net(self) -> DeltaNetSpec:
        return DeltaNetSpec(
            self.ssm_k_heads, self.ssm_v_heads, self.ssm_state, self.conv_kernel, self.rms_eps,
            self.tiled_heads,
        )  # fmt: skip

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
            delta_net=self.delta_net,
            recurrent=self.recurrent,
        )

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape (torch order) of every tensor the decoder reads."""
        d, e, ff, sh = self.n_embd, self.n_expert, self.n_ff_exp, self.n_ff_shexp
        dn = self.delta_net
        out: dict[str, tuple[int, ...]] = {
            "token_embd.weight": (self.vocab_size, d),
            "output_norm.weight": (d,),
            "output.weight": (self.vocab_size, d),
        }
        for i in range(self.n_layer):
            p = f"blk.{i}."
            out |= {p + "attn_norm.weight": (d,), p + "post_attention_norm.weight": (d,)}
            if self.recurrent[i]:
                hv = dn.n_v_heads
                if self.qkvz_fused:
                    out[p + "ssm_in.weight"] = (dn.conv_dim + dn.value_dim, d)
                else:
                    out |= {p + "attn_qkv.weight": (dn.conv_dim, d),
                            p + "attn_gate.weight": (dn.value_dim, d)}  # fmt: skip
                if self.ba_fused:
                    out[p + "ssm_ba.weight"] = (2 * hv, d)
                else:
                    out |= {p + "ssm_beta.weight": (hv, d), p + "ssm_alpha.weight": (hv, d)}
                out |= {
                    p + "ssm_conv1d.weight": (dn.conv_dim, dn.conv_kernel),
                    p + "ssm_dt.bias": (hv,),
                    p + "ssm_a": (hv,),
                    p + "ssm_norm.weight": (dn.head_dim,),
                    p + "ssm_out.weight": (d, dn.value_dim),
                }
            else:
                q = self.n_head * self.head_dim
                kv = self.n_head_kv * self.head_dim
                out |= {
                    p + "attn_q.weight": (2 * q, d),
                    p + "attn_k.weight": (kv, d),
                    p + "attn_v.weight": (kv, d),
                    p + "attn_q_norm.weight": (self.head_dim,),
                    p + "attn_k_norm.weight": (self.head_dim,),
                    p + "attn_output.weight": (d, q),
                }
            out |= {
                p + "ffn_gate_inp.weight": (e, d),
                p + "ffn_gate_exps.weight": (e, ff, d),
                p + "ffn_up_exps.weight": (e, ff, d),
                p + "ffn_down_exps.weight": (e, d, ff),
                p + "ffn_gate_inp_shexp.weight": (d,),
                p + "ffn_gate_shexp.weight": (sh, d),
                p + "ffn_up_shexp.weight": (sh, d),
                p + "ffn_down_shexp.weight": (d, sh),
            }
        return out


def _bad(index: GGUFIndex, name: str, value: object, expected: str) -> ModelLoadError:
    return ModelLoadError(
        f"{index.path}: metadata key {index.arch}.{name} is {value!r}, expected {expected}"
    )


def _count(index: GGUFIndex, name: str, default: object = ...) -> int:
    value = index.key(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(index, name, value, "a whole number of at least 1")
    return value


def _pattern(index: GGUFIndex, n_layer: int, n_trunk: int) -> tuple[bool, ...]:
    """Which of the ``n_layer`` blocks are DeltaNet layers: the file's list, else every layer of
    the first ``n_trunk`` but each ``full_attention_interval``-th (llama.cpp's default: 4); the
    next-token-prediction blocks after the trunk are attention blocks."""
    listed = index.key("attention.recurrent_layers", None)
    if listed is not None:
        if (
            not isinstance(listed, list)
            or len(listed) < n_layer
            or any(not isinstance(v, bool | int) for v in listed)
        ):
            raise _bad(index, "attention.recurrent_layers", listed, f"{n_layer} booleans")
        pattern = tuple(bool(v) for v in listed[:n_layer])
    else:
        every = _count(index, "full_attention_interval", 4)
        pattern = tuple(i < n_trunk and (i + 1) % every != 0 for i in range(n_layer))
    if all(pattern[:n_trunk]) or not any(pattern[:n_trunk]):
        kind = "DeltaNet" if all(pattern) else "attention"
        raise ModelLoadError(
            f"{index.path}: every layer is a {kind} layer (attention.recurrent_layers or "
            "full_attention_interval): a hybrid file has both kinds"
        )
    return pattern


def read_hybrid(index: GGUFIndex, tiled_heads: bool, sections: bool) -> HybridArgs:
    """``HybridArgs`` from ``index``'s keys, each checked (``sections``: the file must carry
    ``rope.dimension_sections``, the interleaved layout)."""
    from strata.engine.models import read_args

    n_layer = _count(index, "block_count")
    # next-token-prediction (MTP) blocks after the trunk: read and checked, never run
    n_mtp = index.key("nextn_predict_layers", 0)
    if isinstance(n_mtp, bool) or not isinstance(n_mtp, int) or not 0 <= n_mtp < n_layer:
        raise _bad(index, "nextn_predict_layers", n_mtp, f"0 to block_count - 1 ({n_layer - 1})")
    head_dim = _count(index, "attention.key_length")
    value_length = _count(index, "attention.value_length", head_dim)
    if value_length != head_dim:
        raise _bad(index, "attention.value_length", value_length, f"key_length {head_dim}")
    n_rot = _count(index, "rope.dimension_count", head_dim)
    if n_rot > head_dim or n_rot % 2:
        raise _bad(index, "rope.dimension_count", n_rot, f"even and at most key_length {head_dim}")
    rope_sections = None
    if sections:
        raw = index.key("rope.dimension_sections")
        if (
            not isinstance(raw, list)
            or len(raw) < 3
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in raw)
            or sum(raw[:4]) == 0
            or sum(raw[:4]) > n_rot // 2
        ):
            want = f"3 or 4 sizes >= 0 adding up to 1..{n_rot // 2} rotation pairs"
            raise _bad(index, "rope.dimension_sections", raw, want)
        rope_sections = tuple([*raw, 0][:4])
    state = _count(index, "ssm.state_size")
    k_heads = _count(index, "ssm.group_count")
    v_heads = _count(index, "ssm.time_step_rank")
    if v_heads % k_heads:
        raise _bad(index, "ssm.time_step_rank", v_heads, f"a multiple of group_count {k_heads}")
    inner = _count(index, "ssm.inner_size")
    if inner != state * v_heads:
        raise _bad(index, "ssm.inner_size", inner,
                   f"state_size × time_step_rank = {state * v_heads}")  # fmt: skip
    scale = index.key("expert_weights_scale", 0.0)
    if not isinstance(scale, int | float) or scale not in (0, 1):
        raise _bad(index, "expert_weights_scale", scale, "absent, 0 or 1 (no scaling)")
    shexp = index.info("blk.0.ffn_gate_shexp.weight") if (
        "blk.0.ffn_gate_shexp.weight" in index.tensors) else None  # fmt: skip
    if shexp is None:
        raise ModelLoadError(f"{index.path}: tensor blk.0.ffn_gate_shexp.weight is missing")
    n_ff_shexp = _count(index, "expert_shared_feed_forward_length", shexp.shape[0])
    args = read_args(
        index, HybridArgs,
        rope_neox=True, qk_norm=True, norm_topk=True,
        n_rot=n_rot, rope_sections=rope_sections,
        recurrent=_pattern(index, n_layer, n_layer - n_mtp),
        conv_kernel=_count(index, "ssm.conv_kernel"), ssm_state=state,
        ssm_k_heads=k_heads, ssm_v_heads=v_heads, n_ff_shexp=n_ff_shexp,
        tiled_heads=tiled_heads,
        qkvz_fused=not tiled_heads and any(n.endswith(".ssm_in.weight") for n in index.tensors),
        ba_fused=not tiled_heads,
    )  # fmt: skip
    ff = index.key("expert_feed_forward_length", None)
    if ff is not None and ff != args.n_ff_exp:
        raise _bad(index, "expert_feed_forward_length", ff,
                   f"the experts' {args.n_ff_exp} rows (ffn_gate_exps)")  # fmt: skip
    assert isinstance(args, HybridArgs)
    if n_mtp:  # the blocks were checked; the model is the trunk
        args = replace(args, n_layer=n_layer - n_mtp, recurrent=args.recurrent[: n_layer - n_mtp])
    return args


class HybridModel(MoEModel):
    """The weights of both layer kinds; each file's ``read_args`` says its layout."""

    args: HybridArgs

    def __init__(self, *a: object, **kw: object) -> None:
        super().__init__(*a, **kw)  # type: ignore[arg-type]
        self.delta_spec = self.args.delta_net

    def layer(self, ops: Ops, x: torch.Tensor, i: int) -> torch.Tensor:
        w = self.attn[i]
        if isinstance(w, DeltaNetWeights):
            x = ops.delta_net(x, i, w, self.delta_spec)
        else:
            x = ops.attention(x, i, w, self.attention_spec)
        return ops.moe(x, i, self.ffn[i], self.routing_spec)

    def attention_weights(self, i: int, device: torch.device) -> AttentionWeights:
        p = f"blk.{i}."
        if not self.args.recurrent[i]:
            return AttentionWeights(
                norm=self.vector(p + "attn_norm.weight", device),
                q=self.weight(p + "attn_q.weight", device),
                k=self.weight(p + "attn_k.weight", device),
                v=self.weight(p + "attn_v.weight", device),
                o=self.weight(p + "attn_output.weight", device),
                q_norm=self.vector(p + "attn_q_norm.weight", device),
                k_norm=self.vector(p + "attn_k_norm.weight", device),
            )
        a = self.args
        fused = a.qkvz_fused

        def opt(name: str, present: bool):
            return self.weight(p + name, device) if present else None

        return DeltaNetWeights(  # type: ignore[return-value]
            norm=self.vector(p + "attn_norm.weight", device),
            qkv=opt("attn_qkv.weight", not fused),
            z=opt("attn_gate.weight", not fused),
            beta=opt("ssm_beta.weight", not a.ba_fused),
            alpha=opt("ssm_alpha.weight", not a.ba_fused),
            conv=self.vector(p + "ssm_conv1d.weight", device),
            dt_bias=self.vector(p + "ssm_dt.bias", device),
            a=self.vector(p + "ssm_a", device),
            out_norm=self.vector(p + "ssm_norm.weight", device),
            out=self.weight(p + "ssm_out.weight", device),
            qkvz=opt("ssm_in.weight", fused),
            ba=opt("ssm_ba.weight", a.ba_fused),
        )

    def moe_weights(self, i: int, device: torch.device) -> MoEWeights:
        p = f"blk.{i}."
        shared = SharedExpert(
            gate_inp=self.vector(p + "ffn_gate_inp_shexp.weight", device),
            gate=self.weight(p + "ffn_gate_shexp.weight", device),
            up=self.weight(p + "ffn_up_shexp.weight", device),
            down=self.weight(p + "ffn_down_shexp.weight", device),
        )
        return MoEWeights(
            norm=self.vector(p + "post_attention_norm.weight", device),
            router=self.weight(p + "ffn_gate_inp.weight", device),
            shared=shared,
        )


def state_bytes(args: HybridArgs) -> int:
    """One sequence's recurrent state over every DeltaNet layer, in bytes (float32)."""
    dn = args.delta_net
    per_layer = (dn.conv_kernel - 1) * dn.conv_dim + dn.n_v_heads * dn.head_dim**2
    return 4 * per_layer * sum(args.recurrent)
