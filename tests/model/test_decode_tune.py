"""``STRATA_DECODE_TUNE``: the decode launches' cuts overridden by name for a bench run, every
bad value refused with its name, on any device."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # (the kernels it imports then run in the interpreter)
    os.environ.setdefault("TRITON_INTERPRET", "1")
from strata.engine.gpu.decode import TUNED, Tune, tunes

CUDA = torch.device("cuda", 0)  # (only its type is read: no GPU is touched)


def test_the_table_stands_without_an_override() -> None:
    assert tunes(None, CUDA) == TUNED and tunes(" , ", CUDA) == TUNED


def test_an_override_replaces_the_ops_it_names_and_leaves_the_rest() -> None:
    got = tunes("down=4:8:128:2, o=16:8 ,gate_up=2::96", CUDA)
    assert got["down"] == Tune(4, 8, 128, 2)
    assert got["o"] == Tune(16, 8) and got["gate_up"] == Tune(2, None, 96)
    assert {k: v for k, v in got.items() if k not in ("down", "o", "gate_up")} == {
        k: v for k, v in TUNED.items() if k not in ("down", "o", "gate_up")
    }
    assert got["down"].kw() == {"bn": 4, "num_warps": 8, "maxnreg": 128, "ept": 2}
    assert "ept" not in got["o"].kw()
    assert [str(got[k]) for k in ("down", "o", "gate_up")] == ["4:8:128:2", "16:8", "2::96"]
    assert tunes(",".join(f"{k}={t}" for k, t in got.items()), CUDA) == got  # it reads back


def test_the_interpreter_keeps_its_own_cuts_but_still_checks_the_value() -> None:
    cpu = torch.device("cpu")
    got = tunes("down=4:8", cpu)
    assert set(got) == set(TUNED) and all(t.warps is None and t.bn > 8 for t in got.values())
    with pytest.raises(ValueError, match="STRATA_DECODE_TUNE"):
        tunes("down=3", cpu)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("mlp=4", "'mlp=4' is not op=bn:warps:regs:ept"),
        ("down", "'down' is not op=bn:warps:regs:ept"),
        ("down=:8", "want bn[:warps[:regs[:ept]]], bn a number"),
        ("down=4:8:128:2:1", "want bn[:warps[:regs[:ept]]]"),
        ("down=4:x", "the fields are numbers"),
        ("down=3", "down rows per program 3: a power of two up to 64"),
        ("qkv=128", "qkv rows per program 128"),
        ("o=8:3", "o warps 3: 1, 2, 4, 8 or 16"),
        ("head=4:8:300", "head register cap 300: 16 to 255"),
        ("gate_up=4:::2", "gate_up: experts side by side are down's alone"),
    ],
)
def test_a_bad_override_names_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError) as e:
        tunes(text, CUDA)
    assert "STRATA_DECODE_TUNE" in str(e.value) and says in str(e.value)


def test_the_decode_path_line_names_the_cuts_an_override_changed() -> None:
    from types import SimpleNamespace

    from strata.engine.gpu.decode import DecodeOps

    def ops(tuned: dict[str, Tune], device: torch.device) -> SimpleNamespace:
        anchor = SimpleNamespace(device=device)
        return SimpleNamespace(tuned=tuned, p=SimpleNamespace(buf=SimpleNamespace(anchor=anchor)))

    changed = tunes("down=2::128:2", CUDA)
    assert DecodeOps.cuts_changed(ops(changed, CUDA)) == (  # type: ignore[arg-type]
        "; cuts from STRATA_DECODE_TUNE: down=2::128:2"
    )
    assert DecodeOps.cuts_changed(ops(dict(TUNED), CUDA)) == ""  # type: ignore[arg-type]
    cpu = torch.device("cpu")
    assert DecodeOps.cuts_changed(ops(tunes(None, cpu), cpu)) == ""  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("STRATA_DECODE_TUNE", "down=3", "down rows per program 3"),
        ("STRATA_PDL", "yes", "STRATA_PDL='yes': want 0"),
    ],
)
def test_a_bad_knob_stops_the_load_naming_it(monkeypatch, name, value, says) -> None:
    """Read before the GPU runners are built (an engine error: the CLI and the daemon report
    it as a setting): inside the build a bad value would only leave the reference path, with
    a warning."""
    from strata.engine.errors import KnobError
    from strata.engine.fast_path import build_gpu_runners
    from strata.engine.options import EngineOptions

    monkeypatch.setenv(name, value)
    with pytest.raises(KnobError, match=says):
        build_gpu_runners(None, [], [], lambda what: None, EngineOptions())  # type: ignore[arg-type]
