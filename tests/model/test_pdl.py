"""``STRATA_PDL``: the decode kernels' programmatic dependent launch, on by default where the
GPU has it (sm_90 and later, compiled), off on the CPU and in the interpreter, and a value
other than 0 or 1 refused by name. That the logits are the same with it on and off is
``test_fast_decode_gpu``'s."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # (the kernels it imports then run in the interpreter)
    os.environ.setdefault("TRITON_INTERPRET", "1")
from strata.engine.kernels import pdl


def test_the_cpu_and_the_interpreter_launch_without_it(monkeypatch) -> None:
    monkeypatch.setenv(pdl.PDL_ENV, "1")
    assert pdl.pdl_launch(torch.device("cpu")) == {"PDL": False}
    assert not pdl.pdl_on(torch.device("cpu"))
    assert pdl.pdl_note(torch.device("cpu")) == ""


@pytest.mark.parametrize("value", ["", "yes", "2", "on"])
def test_a_value_other_than_0_or_1_is_refused_by_name(monkeypatch, value) -> None:
    monkeypatch.setenv(pdl.PDL_ENV, value)
    with pytest.raises(ValueError, match=f"STRATA_PDL={value.strip()!r}: want 0"):
        pdl.pdl_launch(torch.device("cpu"))


def test_0_turns_it_off_and_1_asks_for_it(monkeypatch) -> None:
    monkeypatch.setenv(pdl.PDL_ENV, "0")
    assert not pdl.pdl_wanted()
    monkeypatch.setenv(pdl.PDL_ENV, " 1 ")
    assert pdl.pdl_wanted()
    monkeypatch.delenv(pdl.PDL_ENV)
    assert pdl.pdl_wanted()
