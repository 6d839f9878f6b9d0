"""The profile's RMSNorm launch (``bench/split_norm``) against the reference's, in Triton's
interpreter on CPU tensors where there is no GPU: float32 in another order, 1e-6 of the output's
norm; and bad arguments named."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed")

from strata.bench.split_norm import rms_norm
from strata.engine.kernels.matvec import rms_norm_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("K", [2048, 300])  # whole slices, and a last one cut short
def test_the_norm_launch_is_the_references_norm(K: int) -> None:
    gen = torch.Generator().manual_seed(K)
    x, w = (torch.randn(K, generator=gen).to(DEVICE) for _ in range(2))
    out = torch.full_like(x, float("nan"))
    rms_norm(x, w, 1e-6, out)
    want = rms_norm_reference(x.double(), w.double(), 1e-6)
    assert float((out.double() - want).norm() / want.norm()) < 1e-6


def test_the_norm_launch_names_what_it_cannot_take() -> None:
    x = torch.zeros(64, device=DEVICE)
    with pytest.raises(ValueError, match="float32 x, weight and out of one size"):
        rms_norm(x, torch.zeros(32, device=DEVICE), 1e-6, torch.empty_like(x))
    with pytest.raises(ValueError, match="float16"):
        rms_norm(x, torch.zeros(64, device=DEVICE), 1e-6, torch.empty(64, dtype=torch.float16))
