"""The synthetic recipes of the types people download (``strata.engine.synth_recipes``): each
tensor of Qwen3-30B-A3B's shapes gets llama.cpp's choice (``llama-quant.cpp`` for 128 experts and
8 query heads per K/V head), the random blocks of every new type are finite with the intended
spread, and a tiny file of each recipe — experts of different types in one layer, and layers of
different expert sizes — loads and computes what the independent reference computes.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import pytest
from reference import RefModel, relative_error
from test_engine_parity import engine

from strata.engine import synth, synth_recipes
from strata.engine.synth import ModelSpec

Q = gguf.GGMLQuantizationType
QWEN = "qwen3-30b-a3b"
RECIPE_PRESETS = sorted(synth_recipes.PRESETS)


def types_by_role(preset: str) -> dict[str, Counter]:
    spec = synth.PRESETS[preset]
    descs = synth.tensor_descs(spec, synth.PRESET_TYPES[preset], spec.vocab_size)
    out: dict[str, Counter] = {}
    for x in descs:
        parts = x.name.split(".")
        role = parts[2] if parts[0] == "blk" else parts[0]
        out.setdefault(role, Counter())[x.qtype] += 1
    return out


def test_q2_k_follows_llama_cpp() -> None:
    t = types_by_role("qwen3-30b-a3b-q2k")
    assert t["attn_q"] == t["attn_k"] == t["ffn_gate_exps"] == t["ffn_up_exps"] == {Q.Q2_K: 48}
    assert t["attn_v"] == {Q.Q4_K: 48}  # grouped-query attention of 8 heads per K/V head
    assert t["attn_output"] == t["ffn_down_exps"] == {Q.Q3_K: 48}
    assert t["token_embd"] == {Q.Q2_K: 1} and t["output"] == {Q.Q6_K: 1}
    assert t["ffn_gate_inp"] == t["attn_norm"] == {Q.F32: 48}


def test_q3_k_m_follows_llama_cpp() -> None:
    t = types_by_role("qwen3-30b-a3b-q3km")
    assert t["attn_q"] == t["ffn_gate_exps"] == t["ffn_up_exps"] == {Q.Q3_K: 48}
    assert t["attn_v"] == {Q.Q5_K: 2, Q.Q4_K: 46}  # the first two layers
    assert t["ffn_down_exps"] == {Q.Q5_K: 3, Q.Q4_K: 45}  # layers below n_layer / 16
    assert t["attn_output"] == {Q.Q4_K: 48} and t["output"] == {Q.Q6_K: 1}


def test_mxfp4_moe_and_the_iq_mix() -> None:
    t = types_by_role("qwen3-30b-a3b-mxfp4moe")
    for role in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        assert t[role] == {Q.MXFP4: 48}
    for role in ("token_embd", "attn_q", "attn_k", "attn_v", "attn_output", "output"):
        assert set(t[role]) == {Q.Q8_0}
    t = types_by_role("qwen3-30b-a3b-iq3s-iq4nl")
    more = sum(synth.use_more_bits(i, 48) for i in range(48))
    assert t["ffn_gate_exps"] == t["ffn_up_exps"] == {Q.IQ4_NL: more, Q.IQ3_S: 48 - more}
    assert t["ffn_down_exps"] == {Q.IQ4_NL: 48}


def test_every_preset_is_on_qwen3_30b_shapes_and_named_for_the_bench() -> None:
    for name in RECIPE_PRESETS:
        assert synth.PRESETS[name] == synth.PRESETS[QWEN]
        plan = synth.PRESET_TYPES[name]
        assert plan.file_type in synth_recipes.RECIPES


@pytest.mark.parametrize("qtype", sorted(synth_recipes.BLOCK_SCALES), ids=lambda t: t.name)
def test_random_blocks_are_finite_and_spread_as_asked(qtype: Q) -> None:
    rng = np.random.default_rng(5)
    d = np.full(256, 0.01, np.float32)
    blocks = synth._random_blocks(rng, qtype, 256, d)
    values = gguf.quants.dequantize(blocks, qtype)
    assert np.isfinite(values).all()
    # synth scales d by the std of unit blocks: the spread must follow d (MXFP4: to a power of 2)
    std = float(values.std()) / (0.01 * synth._unit_std(qtype))
    assert 0.6 < std < 1.5, std


TINY = ModelSpec("qwen3moe", 4, 256, 4, 2, 64, 8, 2, 256, 4096, 1e6, 1e-6)


@pytest.mark.parametrize("preset", RECIPE_PRESETS)
def test_a_tiny_file_of_each_recipe_computes_what_the_reference_does(
    preset: str, tmp_path: Path
) -> None:
    plan = synth.PRESET_TYPES[preset]
    path = synth.write_model(tmp_path / "m.gguf", TINY, synth.vocab_for("qwen3moe"), plan, 0)
    ref = RefModel(path)
    tokens = ref.test_sequence(8)
    ours = engine(path).sequences.logits_all(tokens).double().numpy()
    assert relative_error(ours, ref.forward(tokens)) < 1e-4


def _three_types(role: str, layer: int | None, n_layer: int) -> Q:
    """gate, up and down of every layer in three different types; layers alternate sizes."""
    odd = layer is not None and layer % 2 == 1
    return {
        "ffn_gate_exps": Q.IQ3_S if odd else Q.Q2_K,
        "ffn_up_exps": Q.Q4_1 if odd else Q.IQ3_XXS,
        "ffn_down_exps": Q.MXFP4 if odd else Q.Q5_1,
    }.get(role, Q.Q8_0)


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ft = gguf.LlamaFileType.MOSTLY_IQ3_S
    with pytest.MonkeyPatch.context() as mp:  # a recipe of the test's own under a file type
        mp.setitem(synth_recipes.RECIPES, ft, _three_types)
        plan = synth.TypePlan(token_embd=Q.Q8_0, attn=Q.Q8_0, output=Q.Q8_0, file_type=ft)
        path = tmp_path_factory.mktemp("mixed") / "mixed.gguf"
        return synth.write_model(path, TINY, synth.vocab_for("qwen3moe"), plan, 0)


def test_gate_up_and_down_of_different_types_load_and_decode_on_every_path(mixed_file) -> None:
    import os

    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton", reason="Triton is not installed")
    from fastpath import cpu_share_tol, decode, fast_runner, reference_runner

    types = {t.name: t.tensor_type for t in gguf.GGUFReader(mixed_file).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] != types["blk.0.ffn_up_exps.weight"]
    ref = decode(reference_runner(mixed_file), 2, 11)
    # half the experts in VRAM slots, the rest in host homes, half of those on the CPU
    runner = fast_runner(mixed_file, 0.5, host=True, cpu_share=0.5)
    tol = cpu_share_tol(runner.gpu, 1e-4)  # the CPU's sums round otherwise (Q2_K: int8 input)
    fast = decode(runner, 2, 11)
    for a, b in zip(ref[1:], fast[1:], strict=True):
        assert float((a - b).abs().max() / a.abs().max()) < tol


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", *RECIPE_PRESETS])
def test_one_slot_size_wastes_less_than_the_size_class_bound(preset: str) -> None:
    # every expert of a layer has one kernel size; the cache's slots take the largest
    from strata.engine.quant.expert_layout import (
        RUN_ALIGN,
        SIZE_CLASS_WASTE,
        align,
        slot_waste,
    )
    from strata.engine.quant.repack import repacked_layout

    spec = synth.PRESETS[preset]
    per_layer: dict[int, list[int]] = {}
    for x in synth.tensor_descs(spec, synth.PRESET_TYPES[preset], spec.vocab_size):
        if x.name.endswith("_exps.weight"):
            assert x.layer is not None
            n = repacked_layout(x.qtype, x.shape[1:]).nbytes
            per_layer.setdefault(x.layer, []).append(align(n, RUN_ALIGN))
    sizes = [sum(runs) for runs in per_layer.values()]
    waste = slot_waste(sizes * spec.n_expert)
    print(f"\n{preset}: expert sizes {sorted(set(sizes))}, one slot size wastes {waste:.1%}")
    assert waste < SIZE_CLASS_WASTE


def test_a_mixed_files_waste_is_measured_on_its_index(mixed_file) -> None:
    from strata.engine.gguf_index import GGUFIndex
    from strata.engine.quant.expert_layout import kernel_layout, kernel_slot_waste

    index = GGUFIndex(mixed_file)
    sizes = {kernel_layout(b).nbytes for b in index.iter_experts()}
    assert len(sizes) == 2  # the layers alternate types
    assert 0 < kernel_slot_waste(index) < 1
