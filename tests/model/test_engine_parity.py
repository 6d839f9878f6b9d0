"""The engine computes what llama.cpp computes.

F32 files: logits within 1e-4 of llama.cpp's (relative error max|a−b| / max|b|) and identical greedy
continuations. Quantised files: within 1e-4 of the independent fp32 reference in reference.py
(which is itself checked against llama.cpp on the F32 files), and top-1 agreement with llama.cpp
of at least 97% over 256 positions. The numbers are printed (``pytest -s``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from reference import RefModel, relative_error, top1_agreement

from strata.engine.generate import Engine
from strata.engine.options import EngineOptions
from strata.engine.params import SamplingParams

ARCHS = ("qwen3moe", "mixtral")
QUANTISED = ("F16", "BF16", "Q8_0", "Q4_K_M", "Q6_K")


def engine(path: Path, kv: str = "f32") -> Engine:
    return Engine.load(path, EngineOptions(kv_cache_type=kv, threads=2, context_length=1024))


def llama_cpp_logits(llm: object, tokens: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)], dtype=np.float64)  # [T, V]


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_logits_match_llama_cpp(arch: str, tiny_models, llama_cpp_ref) -> None:
    path = tiny_models.path(arch, "F32")
    tokens = RefModel(path).test_sequence(64)
    ours = engine(path).sequences.logits_all(tokens).double().numpy()
    theirs = llama_cpp_logits(llama_cpp_ref(path), tokens)
    rel, top1 = relative_error(ours, theirs), top1_agreement(ours, theirs)
    print(f"\n{arch} F32 vs llama.cpp over 64 tokens: rel error {rel:.3g}, top-1 {top1:.1%}")
    assert rel < 1e-4
    assert top1 == 1.0


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_continuation_of_strata_generate_equals_llama_cpp(
    arch: str, tiny_models, llama_cpp_ref, tmp_path: Path
) -> None:
    path = tiny_models.path(arch, "F32")
    prompt = "The river flows past the old mill, and"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "strata", "generate", "--model", str(path), "--prompt", prompt,
         "--temperature", "0", "--max-tokens", "32", "--kv-cache-type", "f32"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    ours = proc.stdout.removesuffix("\n")
    llm = llama_cpp_ref(path)
    llm.reset()
    theirs = llm.create_completion(prompt, max_tokens=32, temperature=0.0)["choices"][0]["text"]
    assert "32 tokens" in proc.stderr
    assert ours == theirs


@pytest.mark.parametrize("arch", ARCHS)
def test_incremental_and_chunked_logits_equal_one_shot(arch: str, tiny_models) -> None:
    path = tiny_models.path(arch, "F32")
    tokens = RefModel(path).test_sequence(64)
    runner = engine(path).sequences
    one_shot = runner.logits_all(tokens)
    uneven = runner.logits_all(tokens, chunks=[1, 7, 16, 3, 29, 8])
    runner.rewind(0)
    step_by_step = torch.stack([runner.feed([t]) for t in tokens])
    assert relative_error(uneven.numpy(), one_shot.numpy()) < 1e-5
    assert relative_error(step_by_step.numpy(), one_shot.numpy()) < 1e-5


def test_prefill_chunk_size_does_not_change_generation(tiny_models) -> None:
    path = tiny_models.path("qwen3moe", "F32")
    params = SamplingParams(max_tokens=16, temperature=0.0)
    texts = []
    for chunk in (1, 5, 512):
        e = Engine.load(path, EngineOptions(kv_cache_type="f32", prefill_chunk_tokens=chunk))
        prompt = e.encode_prompt("A long enough prompt to be split into several prefill chunks.")
        texts.append(e.generate(prompt, params).tokens)
    assert texts[0] == texts[1] == texts[2]


@pytest.mark.parametrize("kind", QUANTISED)
@pytest.mark.parametrize("arch", ARCHS)
def test_quantised_files_match_reference_and_llama_cpp(
    arch: str, kind: str, tiny_models, llama_cpp_ref
) -> None:
    path = tiny_models.path(arch, kind)
    ref = RefModel(path)
    tokens = ref.test_sequence(256)
    ours = engine(path).sequences.logits_all(tokens).double().numpy()
    exact = ref.forward(tokens)
    theirs = llama_cpp_logits(llama_cpp_ref(path), tokens)
    rel_ref = relative_error(ours, exact)
    top1 = top1_agreement(ours, theirs)
    rel_llama = relative_error(ours, theirs)
    print(
        f"\n{arch} {kind}: rel error vs reference {rel_ref:.3g}; vs llama.cpp {rel_llama:.3g}, "
        f"top-1 {top1:.1%} over 256 positions"
    )
    assert rel_ref < 1e-4
    assert top1 >= 0.97


def test_default_f16_kv_cache_stays_close_to_f32(tiny_models) -> None:
    path = tiny_models.path("qwen3moe", "F32")
    tokens = RefModel(path).test_sequence(64)
    f32 = engine(path, "f32").sequences.logits_all(tokens).numpy()
    f16 = engine(path, "f16").sequences.logits_all(tokens).numpy()
    rel = relative_error(f16, f32)
    print(f"\nF16 K/V vs F32 K/V: rel error {rel:.3g}")
    assert 0 < rel < 5e-3  # F16 rounding is visible but small
