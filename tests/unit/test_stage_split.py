"""The pure part of the layer stages: the split (given or automatic), the checks of the options,
and the sharing of one budget. No torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from strata.engine.errors import EngineError
from strata.engine.stages import (
    check_layer_split,
    describe_split,
    layer_ranges,
    per_device,
    share_budget,
    split_layers,
)

GiB = 2**30


def test_the_module_imports_no_torch() -> None:
    code = "import sys, strata.engine.stages; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("n_layer", "free", "want"),
    [
        (48, [24 * GiB, 12 * GiB], (32, 16)),  # in proportion to the free memory
        (48, [12 * GiB, 12 * GiB], (24, 24)),
        (5, [GiB, GiB], (3, 2)),  # the earlier device first among equal remainders
        (48, [None, 12 * GiB], (24, 24)),  # a reading unknown: equal
        (6, [0, 0, 0], (2, 2, 2)),  # nothing known to be free: equal
        (4, [100 * GiB, 0, 0], (2, 1, 1)),  # at least one layer each
        (3, [GiB, GiB, GiB], (1, 1, 1)),
        (7, [GiB], (7,)),
    ],
)
def test_the_automatic_split(n_layer: int, free: list[int | None], want: tuple[int, ...]) -> None:
    got = split_layers(n_layer, free)
    assert got == want
    assert sum(got) == n_layer and min(got) >= 1


def test_the_automatic_split_always_places_every_layer() -> None:
    for n_layer in range(2, 40):
        for a in range(0, 9):
            for b in range(0, 9):
                got = split_layers(n_layer, [a * GiB, b * GiB])
                assert sum(got) == n_layer and min(got) >= 1
                if a and b:  # never further than one layer from the exact share
                    exact = 1 + (n_layer - 2) * a / (a + b)
                    assert abs(got[0] - exact) < 1 + 1e-9


def test_more_devices_than_layers_is_an_error() -> None:
    with pytest.raises(EngineError, match="3 devices for a model of 2 layers"):
        split_layers(2, [GiB, GiB, GiB])


def test_a_bad_free_reading_is_an_error_naming_it() -> None:
    with pytest.raises(EngineError, match="-5"):
        split_layers(4, [GiB, -5])


def test_a_given_split_is_checked_against_the_model() -> None:
    assert check_layer_split([3, 1], 4, 2) == (3, 1)
    cases = [
        ([4], 2, "one count per device \\(2 devices\\), the model has 4 layers"),
        ([3, 3], 2, "add up to 6, but the model has 4 layers"),
        ([4, 0], 2, "at least 1 \\(got 0\\); the model has 4 layers"),
        ([2, -2, 4], 3, "got -2"),
        ([True, 3], 2, "got True"),
        ([2.0, 2], 2, "got 2.0"),
    ]
    for split, n_devices, message in cases:
        with pytest.raises(EngineError, match=f"layer_split=\\[.*\\].*{message}"):
            check_layer_split(split, 4, n_devices)


def test_ranges_and_their_log_line() -> None:
    ranges = layer_ranges([24, 24])
    assert ranges == [range(0, 24), range(24, 48)]
    assert describe_split(ranges, ["cuda:0", "cuda:1"]) == "layers 0-23 on cuda:0, 24-47 on cuda:1"
    assert describe_split(layer_ranges([1, 2]), ["cpu", "cpu"]) == "layers 0 on cpu, 1-2 on cpu"


def test_one_callable_or_one_per_device() -> None:
    def f() -> int:
        return 1

    assert per_device("free_vram", f, 2) == [f, f]
    assert per_device("free_vram", None, 3) == [None, None, None]
    assert per_device("free_vram", [f, None], 2) == [f, None]
    with pytest.raises(EngineError, match="free_vram: 3 given, but there are 2 devices"):
        per_device("free_vram", [f, f, f], 2)
    with pytest.raises(EngineError, match="arena_factory=5"):
        per_device("arena_factory", 5, 2)  # type: ignore[arg-type]


def test_one_budget_shared_never_beyond_it() -> None:
    assert share_budget(100, [30, 50]) == [30, 50]  # enough for all: what each asks
    assert share_budget(60, [30, 90]) == [15, 45]  # short: in proportion
    assert share_budget(0, [30, 90]) == [0, 0]
    assert share_budget(10, [0, 0]) == [0, 0]
    for total in range(0, 50):
        for a in range(0, 20):
            got = share_budget(total, [a, 2 * a + 1, 7])
            assert sum(got) <= total and all(g >= 0 for g in got)
    with pytest.raises(ValueError, match="-1"):
        share_budget(-1, [1])
