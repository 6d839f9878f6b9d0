"""The Gated DeltaNet hybrids (qwen35moe, qwen3next) on the reference path against llama.cpp, on
tiny files of both (``strata.engine.synth_hybrid``: 2 DeltaNet and 2 gated-attention layers,
v heads twice the k heads, partial rotary; qwen35moe's rope sections leave the fourth section's
pairs unrotated).

F32: logits within 1e-4 relative (max|a−b| / max|b|) of llama.cpp's at every position of a
200-token prompt (more than three of llama.cpp's 64-token DeltaNet chunks) and the same greedy
tokens. Q8_0 and llama.cpp's Q4_K_M: top-1 agreement with llama.cpp of at least 97% over 256
positions, as the other architectures' quantised files, and within 1e-4 of llama.cpp in F32 on
the same weights dequantised (the yardstick of a quantised file). Then the state: chunks of
several sizes against one token per step, and a rewind that restores it bit for bit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import numpy as np
import pytest
import torch
from hybrid_files import ARCHS, HybridFiles, dequantised_copy
from reference import relative_error, top1_agreement
from tiny_models import LlamaCppMissing

from strata.engine.errors import ModelLoadError
from strata.engine.generate import Engine
from strata.engine.options import EngineOptions
from strata.engine.params import SamplingParams
from strata.engine.synth_hybrid import HybridSpec, write_hybrid

N_VOCAB = 2682  # the test vocabulary (synth.vocab_for)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> HybridFiles:
    return HybridFiles(tmp_path_factory.mktemp("hybrid"))


@pytest.fixture(scope="module")
def engines(files: HybridFiles):
    cache: dict[tuple[str, str], Engine] = {}

    def get(arch: str, kind: str = "F32") -> Engine:
        if (arch, kind) not in cache:
            path = file(files, arch, kind)
            opts = EngineOptions(kv_cache_type="f32", threads=2, context_length=1024)
            cache[arch, kind] = Engine.load(path, opts)
        return cache[arch, kind]

    return get


def skip_without_llama_cpp(reason: str) -> NoReturn:
    """A skip, or a failure under CI (as the model tests' conftest does)."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must run the llama.cpp parity tests)")
    pytest.skip(reason)


def file(files: HybridFiles, arch: str, kind: str) -> Path:
    try:
        return files.path(arch, kind)
    except LlamaCppMissing as e:
        skip_without_llama_cpp(str(e))


def sequence(n: int, seed: int = 7) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, N_VOCAB - 40, n)]  # no control tokens


def llama_cpp_logits(llm, tokens: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)], dtype=np.float64)


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_logits_and_greedy_tokens_match_llama_cpp(arch, files, engines, llama_cpp_ref):
    engine, llm = engines(arch), llama_cpp_ref(files.path(arch, "F32"))
    tokens = sequence(200)
    ours = engine.sequences.logits_all(tokens).double().numpy()
    theirs = llama_cpp_logits(llm, tokens)
    rel = relative_error(ours, theirs)
    print(f"\n{arch} F32 vs llama.cpp over 200 positions: rel error {rel:.3g}")
    assert rel < 1e-4
    assert top1_agreement(ours, theirs) == 1.0

    prompt = tokens[:40]
    got = engine.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0)).tokens
    llm.reset()
    llm.eval(prompt)
    want = []
    for _ in range(24):
        want.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([want[-1]])
    assert list(got) == want


@pytest.mark.parametrize("kind", ("Q8_0", "Q4_K_M"))
@pytest.mark.parametrize("arch", ARCHS)
def test_quantised_files_agree_with_llama_cpp(arch, kind, files, engines, llama_cpp_ref):
    engine, path = engines(arch, kind), file(files, arch, kind)
    tokens = sequence(256, seed=11)
    ours = engine.sequences.logits_all(tokens).double().numpy()
    # the yardstick: llama.cpp in float32 on the same weights, dequantised (llama.cpp's own
    # quantised products round the activations to 8 bits first)
    exact = dequantised_copy(path, path.with_suffix(".f32.gguf"))
    rel = relative_error(ours, llama_cpp_logits(llama_cpp_ref(exact), tokens))
    top1 = top1_agreement(ours, llama_cpp_logits(llama_cpp_ref(path), tokens))
    print(f"\n{arch} {kind}: rel error vs its weights in F32 {rel:.3g}, top-1 vs llama.cpp "
          f"{top1:.1%} over 256 positions")  # fmt: skip
    assert rel < 1e-4
    assert top1 >= 0.97


@pytest.mark.parametrize("arch", ARCHS)
def test_chunks_of_several_sizes_equal_one_token_per_step(arch, engines):
    seqs = engines(arch).sequences
    tokens = sequence(80, seed=3)
    one_shot = seqs.logits_all(tokens)
    uneven = seqs.logits_all(tokens, chunks=[1, 7, 33, 3, 29, 7])
    seqs.rewind(0)
    step_by_step = torch.stack([seqs.feed([t]) for t in tokens])
    assert relative_error(uneven.numpy(), one_shot.numpy()) < 1e-5
    assert relative_error(step_by_step.numpy(), one_shot.numpy()) < 1e-5


def test_a_rewind_restores_the_state_bit_for_bit(engines):
    seqs = engines("qwen35moe").sequences
    [state] = seqs.states
    prompt = sequence(70, seed=5)
    seqs.rewind(0)
    seqs.feed(prompt)  # a prompt read: its end is checkpointed
    after = []
    for t in sequence(12, seed=6):
        after.append((state.conv.clone(), state.ssm.clone(), seqs.feed([t])))
    # back into the generated tokens (a stop string, a cancel): the state as it was there
    seqs.rewind(70 + 5)
    assert len(seqs.tokens) == len(state.tokens) == 75
    conv, ssm, logits = after[5]
    assert torch.equal(state.conv, conv) and torch.equal(state.ssm, ssm)
    # and the next step computes what it computed then
    assert torch.equal(seqs.feed([sequence(12, seed=6)[5]]), logits)
    status = seqs.kv.status()
    assert status["state_bytes"] == state.nbytes > 0 and status["state_checkpoints"] >= 1


def test_damaged_hybrid_files_name_what_is_wrong(tmp_path: Path):
    spec = HybridSpec("qwen35moe", n_layer=2)
    gone = write_hybrid(tmp_path / "gone.gguf", spec, drop=("blk.0.ssm_a",))
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ssm_a is missing"):
        Engine.load(gone, EngineOptions(threads=1, context_length=64))
    bad = HybridSpec("qwen35moe", n_layer=2, extra={"qwen35moe.ssm.inner_size": 100})
    path = write_hybrid(tmp_path / "bad.gguf", bad)
    with pytest.raises(ModelLoadError, match=r"ssm\.inner_size is 100"):
        Engine.load(path, EngineOptions(threads=1, context_length=64))


@pytest.fixture(scope="module")
def chat(files: HybridFiles) -> Engine:
    """qwen35moe with the Qwen3.5-style template (``synth_hybrid.QWEN35_TEMPLATE``), its state
    checkpointed at every message start."""
    opts = EngineOptions(kv_cache_type="f32", threads=2, context_length=1024,
                         prefill_chunk_tokens=16)  # fmt: skip
    return Engine.load(files.path("qwen35moe", "F32"), opts)


def test_the_next_turn_after_a_reasoning_reply_reuses_all_but_its_last_message(chat):
    seqs = chat.sequences
    first = [{"role": "system", "content": "Answer in one word."},
             {"role": "user", "content": "Which colour is the sky on a clear day?"}]  # fmt: skip
    prompt = chat.encode_chat(first)
    seqs.feed(seqs.start(prompt))
    reply = chat.encode_prompt("The sky scatters blue light.\n</think>\n\nBlue.<|im_end|>")
    for t in reply:  # the reply, one decode step per token
        seqs.feed([t])
    second = [*first,
              {"role": "assistant", "content": "Blue.",
               "reasoning_content": "The sky scatters blue light."},
              {"role": "user", "content": "And at sunset?"}]  # fmt: skip
    again = chat.encode_chat(second)
    # the template drops the thought of the earlier reply: the prompts part inside it, and the
    # state is restored from the checkpoint at the start of that reply's message
    (im_start,) = chat.sequences.boundary_tokens
    starts = [i for i, t in enumerate(again) if t == im_start]
    todo = seqs.start(again)
    assert len(again) - len(todo) == starts[2]  # system and user reused, the reply read anew
    assert again[: starts[2]] == prompt[: starts[2]]
    logits = seqs.feed(todo)
    whole = seqs.logits_all(again)[-1]
    assert relative_error(logits.numpy(), whole.numpy()) < 1e-5


def test_a_prediction_blocks_experts_are_not_the_models(tmp_path: Path) -> None:
    """The MTP block's experts are never routed to: the index leaves them out, so the cache
    and its host tier hold the trunk's alone (holding them cost a Qwen3.6 file 0.49 GiB of
    slots, and a shrink that moved one to RAM found no layer for it in the GPU's tables)."""
    from strata.engine.gguf_index import GGUFIndex

    spec = HybridSpec("qwen35moe", n_layer=2, n_mtp=1, n_ff_exp=256, n_ff_shexp=256)
    path = write_hybrid(tmp_path / "mtp.gguf", spec)
    index = GGUFIndex(path)
    assert "blk.2.ffn_gate_exps.weight" in index.tensors  # the block is in the file
    assert {layer for layer, _ in index.experts} == {0, 1}
    assert len(index.experts) == 2 * spec.n_expert
    engine = Engine.load(path, EngineOptions(kv_cache_type="f32", threads=2, context_length=64,
                                             cache_mib=64))  # fmt: skip
    try:
        cache = engine.sequences.stages[0].provider
        assert {layer for layer, _ in cache.keys} == {0, 1}
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_a_file_with_a_prediction_block_runs_its_trunk(arch, tmp_path: Path, llama_cpp_ref):
    """llama.cpp's converter appends the next-token-prediction (MTP) block to the layers
    (``nextn_predict_layers``): read and checked, never run in the forward."""
    spec = HybridSpec(arch, n_layer=2, n_mtp=1, n_ff_exp=256, n_ff_shexp=256)
    path = write_hybrid(tmp_path / f"{arch}-mtp.gguf", spec)
    engine = Engine.load(path, EngineOptions(kv_cache_type="f32", threads=2, context_length=256))
    assert engine.sequences.model.shape.n_layer == 2
    tokens = sequence(70, seed=9)
    ours = engine.sequences.logits_all(tokens).double().numpy()
    assert relative_error(ours, llama_cpp_logits(llama_cpp_ref(path), tokens)) < 1e-4
