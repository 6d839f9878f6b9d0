"""How the automatic ``cpu_share`` picks a share from its timings (``gpu.cpu_share``): the rounds'
order and the choice from each share's median. The timing itself needs a GPU
(``tests/model/test_host_tier_gpu.py``)."""

from __future__ import annotations

import pytest

from strata.engine.gpu.cpu_share import (
    CPU_SHARE_CANDIDATES,
    CPU_SHARE_SLACK,
    check_timing,
    choose_share,
    round_orders,
    timing_note,
)


def test_rounds_alternate_direction_and_visit_every_share_each_round() -> None:
    orders = round_orders(CPU_SHARE_CANDIDATES, 3)
    assert orders[0] == list(CPU_SHARE_CANDIDATES)
    assert orders[1] == list(reversed(CPU_SHARE_CANDIDATES))
    assert orders[2] == orders[0]
    # no share is timed right after the same neighbour in every round
    firsts = {o[0] for o in orders}
    assert len(firsts) == 2


def test_one_slow_round_does_not_decide_the_share() -> None:
    # 0.5 is fastest in two rounds of three; one outlier (a page fault, a desktop burst) in its
    # first round would have lost it the choice had a single timing been kept
    times = {0.0: [15.5, 15.4, 15.6], 0.375: [13.5, 14.9, 14.8], 0.5: [19.3, 12.1, 12.0]}
    assert choose_share(times, slack=0.0) == 0.5


def test_the_smallest_share_within_the_slack_of_the_fastest_is_kept() -> None:
    times = {0.0: [14.0], 0.25: [12.3], 0.375: [12.0], 0.5: [11.9]}
    # 0.25 is 3.4% slower than 0.5; 0.375 is 0.8% slower: the smaller of those within 3%
    assert choose_share(times, slack=0.03) == 0.375
    assert choose_share(times, slack=0.05) == 0.25
    assert choose_share(times, slack=0.0) == 0.5
    assert 0 < CPU_SHARE_SLACK < 0.1


def test_the_plain_step_wins_where_the_cpu_buys_nothing() -> None:
    assert choose_share({0.0: [10.0, 10.1], 0.25: [10.05, 10.0], 0.5: [12.0, 12.5]}) == 0.0


@pytest.mark.parametrize(
    ("times", "slack", "what"),
    [({}, 0.03, "at least one timing"), ({0.0: [1.0], 0.5: []}, 0.03, "at least one timing"),
     ({0.0: [1.0]}, -0.1, "slack -0.1"), ({0.0: [1.0]}, 1.0, "slack 1.0")],
)  # fmt: skip
def test_bad_timings_or_slack_are_refused_naming_what(times, slack, what) -> None:
    with pytest.raises(ValueError, match=what):
        choose_share(times, slack=slack)


@pytest.mark.parametrize(
    ("candidates", "steps", "rounds", "what"),
    [((0.0, 1.5), 4, 3, "candidate 1.5"), ((-0.25,), 4, 3, "candidate -0.25"),
     ((True,), 4, 3, "candidate True"), ((0.5,), 0, 3, "steps 0"), ((0.5,), 4, 0, "rounds 0")],
)  # fmt: skip
def test_a_bad_timing_is_refused_naming_the_value(candidates, steps, rounds, what) -> None:
    with pytest.raises(ValueError, match=what):
        check_timing(candidates, steps, rounds)


def test_the_log_line_names_the_share_kept_and_each_median_and_range() -> None:
    note = timing_note(0.375, {0.0: [15.5, 15.4, 15.6], 0.375: [13.5, 14.9, 14.8]}, 4)
    assert note.startswith("cpu_share 0.375, chosen by timing 3 rounds of 4 steps")
    assert "0: 15.50 (15.40-15.60)" in note and "0.375: 14.80 (13.50-14.90)" in note
    assert "within 3% of the fastest" in note
