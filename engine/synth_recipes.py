"""Synthetic files in the types of the files people download: llama.cpp's Q2_K and Q3_K_M recipes,
an IQ4_NL / IQ3_S expert mix like Unsloth's dynamic IQ3 files, and ``MXFP4_MOE``, on
Qwen3-30B-A3B's shapes (``strata bench --synthetic qwen3-30b-a3b-q2k`` and the others below).

``synth`` writes them: this module gives it the types' random blocks (the scale fields to set, from
each type's description) and each recipe's type per tensor, and names the presets. The choices per
tensor follow llama.cpp's quantiser (``llama_tensor_get_type_impl`` in ``llama-quant.cpp``) for a
model of 128 experts and 8 query heads per K/V head (Qwen3-30B-A3B's): no tensor is quantised
differently because of the 8-expert rules, and every row length is a multiple of 256, so nothing
falls back to a 32-element type.

- **Q2_K**: Q2_K by default; attn_v Q4_K (grouped-query attention of 4 or more); attn_output and
  ffn_down(_exps) Q3_K; output Q6_K.
- **Q3_K_M**: Q3_K by default; attn_v Q5_K on the first two layers, Q4_K after; ffn_down(_exps)
  Q5_K on the first n_layer / 16 layers, Q4_K after; attn_output Q4_K; output Q6_K.
- **MXFP4_MOE**: the 3-D expert tensors MXFP4, every other matrix Q8_0 (output and token
  embedding included).
- **IQ3_S / IQ4_NL**: expert gate and up IQ3_S and down IQ4_NL, but IQ4_NL for all three on the
  layers llama.cpp's *_M recipes give more bits (so a file holds experts of two sizes); attention
  IQ4_NL with attn_v Q5_K (llama.cpp's IQ4_NL choice), token embedding Q4_K, output Q6_K.

Norms and the router stay F32 in every recipe, as llama.cpp leaves them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import gguf
import numpy as np

from strata.engine.quant import grids, kquants, legacy
from strata.engine.quant.format import Format

Q = gguf.GGMLQuantizationType
FT = gguf.LlamaFileType


def _f16_scales(f: Format, *mults: tuple[str, float]) -> tuple[tuple[int, float], ...]:
    return tuple((f.field(name).at, mult) for name, mult in mults)


# The random blocks of the types synth writes as blocks: (byte offset of an f16 scale field, its
# multiple of d). Mins centre the values around zero for uniform random quants and scales:
# Q4_1 / Q5_1 add m = -7.5 d / -15.5 d to d q; Q2_K subtracts dmin * mn (mn ~ 7.5 on average)
# from d * sc * q (~ 7.5 * 1.5 d), so dmin = 1.5 d. The others are symmetric already.
BLOCK_SCALES: dict[Q, tuple[tuple[int, float], ...]] = {
    Q.Q4_1: _f16_scales(legacy.Q4_1, ("d", 1.0), ("m", -7.5)),
    Q.Q5_0: _f16_scales(legacy.Q5_0, ("d", 1.0)),
    Q.Q5_1: _f16_scales(legacy.Q5_1, ("d", 1.0), ("m", -15.5)),
    Q.IQ4_NL: _f16_scales(legacy.IQ4_NL, ("d", 1.0)),
    Q.MXFP4: (),  # its scale is an exponent byte: fix_blocks
    Q.Q2_K: _f16_scales(kquants.Q2_K, ("d", 1.0), ("dm", 1.5)),
    Q.Q3_K: _f16_scales(kquants.Q3_K, ("d", 1.0)),
    Q.IQ3_XXS: _f16_scales(grids.IQ3_XXS, ("d", 1.0)),
    Q.IQ3_S: _f16_scales(grids.IQ3_S, ("d", 1.0)),
}
_MXFP4_E = legacy.MXFP4.field("e").at


def fix_blocks(qtype: Q, blocks: np.ndarray, d: np.ndarray) -> None:
    """Set the scale fields of random ``blocks`` [N, type_size] that are not halves: MXFP4's
    exponent byte, the power of two nearest ``d`` [N] (its value is 2^(e - 128) * level)."""
    if qtype == Q.MXFP4:
        e = np.rint(np.log2(np.maximum(d, np.float32(2.0**-100)))) + 128
        blocks[:, _MXFP4_E] = np.clip(e, 2, 254).astype(np.uint8)


# -- the recipes: a tensor's type from its role (``attn_q``, ``ffn_down_exps``, ...) and layer ----

Choice = Callable[[str, int | None, int], Q]


def _role(name: str) -> tuple[str, int | None]:
    """``blk.3.attn_q.weight`` -> ("attn_q", 3); ``output.weight`` -> ("output", None)."""
    parts = name.split(".")
    if parts[0] == "blk":
        return parts[2], int(parts[1])
    return parts[0], None


def _more_bits(layer: int, n_layer: int) -> bool:
    """llama.cpp's layers of more bits in the *_M recipes (synth.use_more_bits, not imported
    here: synth imports this module)."""
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


def _q2_k(role: str, layer: int | None, n_layer: int) -> Q:
    return {
        "output": Q.Q6_K,
        "attn_v": Q.Q4_K,
        "attn_output": Q.Q3_K,
        "ffn_down_exps": Q.Q3_K,
    }.get(role, Q.Q2_K)


def _q3_k_m(role: str, layer: int | None, n_layer: int) -> Q:
    if role == "attn_v":
        return Q.Q5_K if layer is not None and layer < 2 else Q.Q4_K
    if role == "ffn_down_exps":
        return Q.Q5_K if layer is not None and layer < n_layer // 16 else Q.Q4_K
    return {"output": Q.Q6_K, "attn_output": Q.Q4_K}.get(role, Q.Q3_K)


def _mxfp4_moe(role: str, layer: int | None, n_layer: int) -> Q:
    return Q.MXFP4 if role.endswith("_exps") else Q.Q8_0


def _iq3s_iq4nl(role: str, layer: int | None, n_layer: int) -> Q:
    if role in ("ffn_gate_exps", "ffn_up_exps"):
        assert layer is not None
        return Q.IQ4_NL if _more_bits(layer, n_layer) else Q.IQ3_S
    return {"token_embd": Q.Q4_K, "output": Q.Q6_K, "attn_v": Q.Q5_K}.get(role, Q.IQ4_NL)


# A plan whose file type has a recipe here gets the recipe's type for every tensor (its own
# fields then only say the main types, what TypePlan.types() reports).
RECIPES: dict[FT, Choice] = {
    FT.MOSTLY_Q2_K: _q2_k,
    FT.MOSTLY_Q3_K_M: _q3_k_m,
    FT.MOSTLY_MXFP4_MOE: _mxfp4_moe,
    FT.MOSTLY_IQ3_S: _iq3s_iq4nl,
}
_KEPT = ("norm", "ffn_gate_inp")  # roles every recipe leaves as they are (F32)


def tensor_type(file_type: FT | None, name: str, n_layer: int, default: Q) -> Q:
    """The type the recipe of ``file_type`` gives tensor ``name`` (``default``: a file type
    without a recipe, or a norm or the router, which stay as the plan has them)."""
    recipe = RECIPES.get(file_type) if file_type is not None else None
    if recipe is None:
        return default
    role, layer = _role(name)
    if role.endswith(_KEPT):
        return default
    return recipe(role, layer, n_layer)


def apply(file_type: FT | None, descs: list, n_layer: int) -> list:
    """synth's tensor descriptions with the types the recipe of ``file_type`` gives them
    (unchanged: a file type without one)."""
    if file_type not in RECIPES:
        return descs
    return [replace(x, qtype=tensor_type(file_type, x.name, n_layer, x.qtype)) for x in descs]


def register(presets: dict, preset_types: dict, plan: type) -> None:
    """Add the presets below to synth's (``plan``: synth.TypePlan, not imported here)."""
    for name, (base, fields) in PRESETS.items():
        presets[name], preset_types[name] = presets[base], plan(**fields)


# The presets, as synth takes them: name -> (the preset whose shapes it has, TypePlan fields).
# The plan's own fields name the recipe's main types (what TypePlan.types() reports); the recipe
# decides every tensor.
PRESETS: dict[str, tuple[str, dict[str, object]]] = {
    "qwen3-30b-a3b-q2k": (
        "qwen3-30b-a3b",
        dict(token_embd=Q.Q2_K, attn=Q.Q2_K, attn_v=Q.Q4_K, experts_gate_up=Q.Q2_K,
             experts_down=Q.Q3_K, output=Q.Q6_K, file_type=FT.MOSTLY_Q2_K),
    ),
    "qwen3-30b-a3b-q3km": (
        "qwen3-30b-a3b",
        dict(token_embd=Q.Q3_K, attn=Q.Q3_K, attn_v=Q.Q5_K, experts_gate_up=Q.Q3_K,
             experts_down=Q.Q4_K, output=Q.Q6_K, file_type=FT.MOSTLY_Q3_K_M),
    ),
    "qwen3-30b-a3b-iq3s-iq4nl": (
        "qwen3-30b-a3b",
        dict(token_embd=Q.Q4_K, attn=Q.IQ4_NL, attn_v=Q.Q5_K, experts_gate_up=Q.IQ3_S,
             experts_down=Q.IQ4_NL, output=Q.Q6_K, file_type=FT.MOSTLY_IQ3_S),
    ),
    "qwen3-30b-a3b-mxfp4moe": (
        "qwen3-30b-a3b",
        dict(token_embd=Q.Q8_0, attn=Q.Q8_0, experts_gate_up=Q.MXFP4, experts_down=Q.MXFP4,
             output=Q.Q8_0, file_type=FT.MOSTLY_MXFP4_MOE),
    ),
}  # fmt: skip
