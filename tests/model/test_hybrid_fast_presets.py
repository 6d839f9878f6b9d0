"""The bench's hybrid presets (``strata bench --synthetic qwen3.6-35b-a3b`` and
``qwen3-next-80b-a3b``): the issue's shapes and types, with the MTP block kept, and what their
streamed writer makes read by llama.cpp (llama-cpp-python 0.3.36) and by Strata alike, on a
tiny spec of the same types: Strata's logits within 1e-4 of llama.cpp's on the same weights
dequantised to F32 (the yardstick of a quantised file, as ``test_hybrid``), llama.cpp's own
quantised products finite and mostly choosing the same tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from hybrid_files import dequantised_copy
from reference import relative_error, top1_agreement

from strata.engine.generate import Engine
from strata.engine.gguf_index import GGUFIndex
from strata.engine.options import EngineOptions
from strata.engine.synth_hybrid import ARCHS, PRESETS, HybridSpec, preset_bytes, write_streamed

GiB = 2**30


def test_the_presets_have_the_issues_shapes_and_types() -> None:
    from strata.bench.settings import SYNTHETIC_NAMES, synthetic_preset

    want = {"qwen3.6-35b-a3b": ("qwen35moe", 40, 256, 8, 248320),
            "qwen3-next-80b-a3b": ("qwen3next", 48, 512, 10, 151936)}  # fmt: skip
    for name, (arch, layers, experts, used, vocab) in want.items():
        assert name in SYNTHETIC_NAMES and synthetic_preset(name) == name
        spec, n_vocab = PRESETS[name]
        assert (spec.arch, spec.n_layer, spec.n_expert, spec.n_expert_used, n_vocab) == (
            arch, layers, experts, used, vocab)  # fmt: skip
        assert spec.n_mtp == 1 and spec.full_attention_interval == 4
        assert (spec.n_embd, spec.n_head, spec.n_head_kv, spec.head_dim, spec.n_rot) == (
            2048, 16, 2, 256, 64)  # fmt: skip
        assert (spec.ssm_n_group, spec.ssm_dt_rank, spec.ssm_d_state, spec.ssm_d_conv) == (
            16, 32, 128, 4)  # fmt: skip
    assert PRESETS["qwen3.6-35b-a3b"][0].rope_sections == (11, 11, 10, 0)
    # the issue's llama-bench file of Qwen3.6-35B-A3B's shapes was 20.26 GiB; with the MTP
    # block (one more MoE layer of 256 experts: ~0.49 GiB) it is 20.75
    assert abs(preset_bytes("qwen3.6-35b-a3b") / GiB - 20.75) < 0.01
    assert abs(preset_bytes("qwen3-next-80b-a3b") / GiB - 46.72) < 0.01


@pytest.mark.parametrize("arch", ARCHS)
def test_a_tiny_streamed_file_reads_the_same_in_llama_cpp(arch, tmp_path: Path, llama_cpp_ref):
    sections = (3, 3, 2, 0) if arch == "qwen35moe" else (0, 0, 0, 0)
    spec = HybridSpec(arch, n_rot=16, rope_sections=sections, n_ff_exp=256, n_ff_shexp=256,
                      full_attention_interval=2, n_mtp=1)  # fmt: skip
    path = write_streamed(tmp_path / f"{arch}.gguf", spec, n_vocab=3072)
    types = {t.name: t.qtype for t in GGUFIndex(path).tensors.values()}
    assert types["blk.0.ffn_gate_exps.weight"] is Q.Q4_K
    assert types["blk.0.ffn_down_exps.weight"] is Q.Q5_K
    assert types["output.weight"] is Q.Q6_K and types["blk.1.attn_q.weight"] is Q.Q8_0
    engine = Engine.load(path, EngineOptions(kv_cache_type="f32", threads=2, context_length=256))
    assert engine.sequences.model.shape.n_layer == 4  # the MTP block read, not run
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, 2600, 48)]
    ours = engine.sequences.logits_all(tokens).double().numpy()

    def theirs(p: Path) -> np.ndarray:
        llm = llama_cpp_ref(p)
        llm.reset()
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float64)

    exact = theirs(dequantised_copy(path, tmp_path / f"{arch}.f32.gguf"))
    quantised = theirs(path)
    assert np.isfinite(quantised).all()
    assert relative_error(ours, exact) < 1e-4
    assert top1_agreement(ours, quantised) >= 0.9


def test_the_benchs_ensure_synthetic_reaches_the_streamed_writer(tmp_path, monkeypatch) -> None:
    from strata.bench.settings import ensure_synthetic
    from strata.engine import synth_hybrid

    asked = []

    def write(path, spec, n_vocab, seed, progress):  # the real one writes 20 GiB
        asked.append((spec.arch, n_vocab))
        Path(path).write_bytes(b"")
        return Path(path)

    monkeypatch.setattr(synth_hybrid, "write_streamed", write)
    first = ensure_synthetic("qwen3.6-35b-a3b", tmp_path)
    assert asked == [("qwen35moe", 248320)] and first.name.startswith("qwen3.6-35b-a3b-g")
    assert ensure_synthetic("qwen3.6-35b-a3b", tmp_path) == first and len(asked) == 1  # reused
