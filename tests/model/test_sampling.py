"""Sampling on fixed logits: each filter keeps exactly what it should, the seed decides the draw."""

from __future__ import annotations

import math

import pytest
import torch

from strata.engine.params import SamplingParams
from strata.engine.sampling import (
    Sampler,
    SamplingState,
    apply_repeat_penalty,
    min_p,
    reference_distribution,
    sample,
    top_k,
    top_p,
    uniform,
    uniform_reference,
)

# probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 (as logits)
PROBS = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
LOGITS = PROBS.log()


def kept(logits: torch.Tensor) -> list[int]:
    return torch.nonzero(torch.isfinite(logits)).flatten().tolist()


def test_top_k_keeps_the_k_most_likely() -> None:
    assert kept(top_k(LOGITS, 2)) == [0, 1]
    assert kept(top_k(LOGITS, 0)) == [0, 1, 2, 3, 4]  # 0 is off


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    assert kept(top_p(LOGITS, 0.5)) == [0]
    assert kept(top_p(LOGITS, 0.6)) == [0, 1]
    assert kept(top_p(LOGITS, 0.8)) == [0, 1, 2]
    assert kept(top_p(LOGITS, 1.0)) == [0, 1, 2, 3, 4]


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    assert kept(min_p(LOGITS, 0.3)) == [0, 1]  # 0.25 >= 0.3 * 0.5
    assert kept(min_p(LOGITS, 0.26)) == [0, 1]  # 0.125 < 0.13
    assert kept(min_p(LOGITS, 0.24)) == [0, 1, 2]  # 0.125 >= 0.12
    assert kept(min_p(LOGITS, 0.0)) == [0, 1, 2, 3, 4]


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 3.0])
    out = apply_repeat_penalty(logits, [0, 1, 1], 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0, 3.0]
    assert apply_repeat_penalty(logits, [0, 1], 1.0) is logits  # 1.0 is off


def test_repeat_penalty_can_change_the_greedy_choice() -> None:
    logits = torch.tensor([3.0, 2.0, 0.0])
    greedy = SamplingParams(temperature=0.0, repeat_penalty=2.0)
    assert Sampler(greedy)(logits, history=[]) == 0
    assert Sampler(greedy)(logits, history=[0]) == 1


def test_top_k_one_equals_greedy() -> None:
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        logits = torch.randn(50, generator=gen)
        hot = Sampler(SamplingParams(temperature=1.5, top_k=1, seed=7))
        assert hot(logits, []) == int(torch.argmax(logits))


def test_same_seed_same_draws_and_another_seed_differs() -> None:
    logits = torch.zeros(1000)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    a, b = Sampler(params), Sampler(params)
    draws_a = [a(logits, []) for _ in range(30)]
    assert draws_a == [b(logits, []) for _ in range(30)]
    c = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=43))
    assert draws_a != [c(logits, []) for _ in range(30)]


def test_draws_follow_the_filtered_distribution() -> None:
    params = SamplingParams(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0, seed=1)
    s = Sampler(params)
    counts = torch.zeros(5)
    for _ in range(4000):
        counts[s(LOGITS, [])] += 1
    assert counts[3] == counts[4] == 0  # outside top-p 0.8
    freq = counts / counts.sum()
    # renormalised over {0, 1, 2}: 4/7, 2/7, 1/7
    assert torch.allclose(freq[:3], torch.tensor([4 / 7, 2 / 7, 1 / 7]), atol=0.03)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", 1.0),
        ("repeat_penalty", 0.0),
        ("repeat_penalty", 1e-40),  # seen logits divided by it would overflow to inf
        ("repeat_penalty", 0.009),
        ("repeat_penalty", 101.0),
        ("seed", -5),
        ("max_tokens", True),
    ],
)
def test_invalid_sampling_values_raise_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: invalid value"):
        SamplingParams(**{field: value})


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"^stop: invalid value"):
        SamplingParams(stop=("",))


@pytest.mark.parametrize("tiny", [1e-40, 1e-300, 5e-324])
def test_values_at_the_edge_of_floats_sample_finite_numbers(tiny: float) -> None:
    logits = torch.tensor([30.0, 29.0, -5.0, 2.0])
    # a temperature below the floor is greedy (logits / 1e-40 would be inf)
    assert SamplingParams(temperature=tiny).greedy
    assert Sampler(SamplingParams(temperature=tiny, seed=1))(logits, []) == 0
    # a top_p below float32's range keeps the most likely token, not none
    kept = top_p(logits, tiny)
    assert torch.isfinite(kept).tolist() == [True, False, False, False]
    for field in ("top_p", "min_p"):
        assert Sampler(SamplingParams(**{field: tiny}, seed=2))(logits, []) in range(4)


# -- the sampler every path runs: its draws, its window, its log-probabilities -----------------


def test_uniforms_are_the_reference_hash_on_every_device() -> None:
    for seed in (0, 1, 42, 2**63 - 1):
        for n in (0, 1, 7, 2**40):
            got = uniform(torch.tensor([seed]), torch.tensor([n]))
            assert got.item() == uniform_reference(seed, n)
    draws = [uniform_reference(5, n) for n in range(2000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.03  # mean of U(0,1): sd 0.0065 over 2000


def draw_counts(params: SamplingParams, logits: torch.Tensor, n: int,
                recent: list[int]) -> torch.Tensor:  # fmt: skip
    """Counts of ``n`` draws from one state, its window put back after each (the draws go on)."""
    state = SamplingState(params, params.seed or 0, recent, logits.numel(), logits.device)
    window = (state.recent.clone(), state.at.clone())
    counts = torch.zeros(logits.numel(), dtype=torch.float64)
    for _ in range(n):
        counts[int(sample(state, logits))] += 1
        state.recent.copy_(window[0])
        state.at.copy_(window[1])
    return counts


SAMPLERS = {
    "temperature": SamplingParams(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, seed=1),
    "top_k": SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0, seed=2),
    "top_k_full": SamplingParams(temperature=1.0, top_k=300, top_p=1.0, min_p=0.0, seed=2),
    "top_p": SamplingParams(temperature=1.0, top_k=0, top_p=0.6, min_p=0.0, seed=3),
    "min_p": SamplingParams(temperature=1.3, top_k=0, top_p=1.0, min_p=0.1, seed=4),
    "repeat_penalty": SamplingParams(
        temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.8, seed=5
    ),
    "bench": SamplingParams(
        temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1, seed=6
    ),
}


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_draws_follow_the_reference_distribution(name: str) -> None:
    # 3,000 draws from fixed logits: each token's count within 5 standard deviations of what
    # the reference filters give it (a false alarm about once in 10^5 runs per token; the
    # draws are seeded, so a run that passes always passes), and none where it gives none
    params = SAMPLERS[name]
    logits = torch.linspace(2.0, -2.0, 12)
    recent = [0, 3, 3]
    want = reference_distribution(logits, params, recent)
    n = 3000
    counts = draw_counts(params, logits, n, recent)
    assert torch.all(counts[want == 0] == 0), counts
    sd = (n * want * (1 - want)).sqrt()
    assert torch.all((counts - n * want).abs() <= 5 * sd + 1), (counts, n * want)


def test_the_window_penalises_what_the_request_generated_last() -> None:
    # greedy with a penalty over a window of 2: each token chosen is penalised for the next 2
    params = SamplingParams(temperature=0.0, repeat_penalty=100.0, repeat_last_n=2)
    s = Sampler(params, [])
    logits = torch.tensor([3.0, 2.0, 1.0, -1.0])
    assert [s(logits) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_logprobs_are_the_log_softmax_before_the_penalty() -> None:
    params = SamplingParams(temperature=0.0, repeat_penalty=4.0, logprobs=3)
    logits = torch.tensor([3.0, 2.0, 1.0, -1.0, 0.5])
    token, entry = Sampler(params, [0]).choose(logits)
    lp = torch.log_softmax(logits, -1)
    assert token == 1 and entry is not None
    assert entry.logprob == float(lp[1])
    assert entry.top == tuple((i, float(lp[i])) for i in (0, 1, 2))


def test_a_grammar_masked_token_is_never_listed() -> None:
    params = SamplingParams(temperature=1.0, top_k=0, logprobs=4, seed=9)
    logits = torch.tensor([1.0, float("-inf"), 0.5, float("-inf")])
    token, entry = Sampler(params).choose(logits)
    assert token in (0, 2) and entry is not None
    assert [i for i, _ in entry.top] == [0, 2]


def test_ignore_eos_never_chooses_a_banned_token() -> None:
    logits = torch.tensor([5.0, 1.0, 0.0, -1.0])  # token 0 is by far the likeliest
    greedy = Sampler(SamplingParams(temperature=0.0, ignore_eos=True), banned=[0])
    assert greedy.on_device and greedy(logits) == 1
    hot = Sampler(SamplingParams(temperature=2.0, top_k=0, seed=4), banned=[0])
    assert all(hot(logits) != 0 for _ in range(200))
    with pytest.raises(ValueError, match=r"^ignore_eos: invalid value"):
        SamplingParams(ignore_eos="yes")  # type: ignore[arg-type]
