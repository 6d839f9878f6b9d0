"""The independent reference forward against llama.cpp, and the health of every test model."""

from __future__ import annotations

import numpy as np
import pytest
from reference import RefModel, relative_error, top1_agreement

N_TOKENS = 64
MODELS = ("qwen3moe", "mixtral")
KINDS = ("F32", "F16", "BF16", "Q8_0", "Q4_K_M", "Q6_K")


def llama_cpp_logits(llm, tokens: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)], dtype=np.float64)  # [T, V]


@pytest.mark.parametrize("model", MODELS)
def test_reference_matches_llama_cpp_on_f32(model, tiny_models, llama_cpp_ref):
    path = tiny_models.path(model, "F32")
    ref = RefModel(path)
    tokens = ref.test_sequence(N_TOKENS)
    ours = ref.forward(tokens)
    theirs = llama_cpp_logits(llama_cpp_ref(path), tokens)
    assert ours.shape == theirs.shape == (N_TOKENS, len(ref.token_types))
    rel, top1 = relative_error(ours, theirs), top1_agreement(ours, theirs)
    print(
        f"{model} F32 reference vs llama.cpp over {N_TOKENS} tokens: rel={rel:.3g} top1={top1:.3f}"
    )
    assert rel < 1e-4
    assert top1 == 1.0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("model", MODELS)
def test_test_model_is_healthy(model, kind, tiny_models):
    """Over the test sequence every expert of every layer gets a token and the greedy choice
    varies; the smallest top-k router margin is printed (it bounds how much numerical noise
    a forward may carry before routing flips)."""
    ref = RefModel(tiny_models.path(model, kind))
    logits, routing = ref.forward_with_routing(ref.test_sequence(N_TOKENS))
    assert np.isfinite(logits).all()
    distinct = len(np.unique(logits.argmax(axis=-1)))
    print(
        f"{model} {kind}: min top-{ref.config.n_expert_used} router margin "
        f"{routing.min_margin:.4g}, {distinct} distinct top-1 tokens"
    )
    assert routing.unused_experts() == {}, "experts no token was routed to (layer -> ids)"
    assert distinct >= 10
    assert routing.min_margin > 0


def test_routing_report_names_unused_experts(tiny_models):
    ref = RefModel(tiny_models.path("mixtral", "F32"))
    _, routing = ref.forward_with_routing(ref.test_sequence(2))
    assert len(routing.topk) == ref.config.n_layer
    assert all(ids.shape == (2, ref.config.n_expert_used) for ids in routing.topk)
    unused = routing.unused_experts()  # two tokens can reach at most 4 of 8 experts
    assert set(unused) == set(range(ref.config.n_layer))
    assert all(len(ids) >= ref.config.n_expert - 4 for ids in unused.values())
