"""The GPU dequantisation path (repack into the kernel layout, then the Triton dequantisers)
against the torch reference and gguf-py, bit for bit.

On a machine with CUDA the kernels are compiled and run on the GPU. Without one they run in
Triton's interpreter (``TRITON_INTERPRET=1``, set here before Triton is imported) on CPU tensors,
which executes the same kernel code with numpy: CI checks the kernels' indexing and arithmetic
that way, and the ``gpu`` tests check the compiled code and the dispatch in ``dequantize``.
"""

from __future__ import annotations

import logging
import os

import gguf
import numpy as np
import pytest
import torch
from quantdata import assert_bit_identical, gguf_reference, random_bytes

from strata.engine import quant
from strata.engine.quant import reference, tensor_nbytes
from strata.engine.quant.formats import fmt

# Triton reads this when its kernels are defined, i.e. when repack_kernels is imported just below.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
repack_kernels = pytest.importorskip(
    "strata.engine.quant.repack_kernels", reason="Triton is not installed"
)

Q = gguf.GGMLQuantizationType
QK_K = gguf.QK_K
KERNEL_TYPES = sorted(repack_kernels.KERNEL_TYPES)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261130)


def run_kernel(raw: np.ndarray | torch.Tensor, qtype: Q, shape: tuple[int, ...]) -> torch.Tensor:
    data = torch.as_tensor(raw).to(DEVICE)
    return quant._on_gpu(repack_kernels, data, qtype, shape)


def same_bits_or_both_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())).all())


def test_every_type_the_reference_reads_has_a_kernel() -> None:
    assert set(repack_kernels.KERNEL_TYPES) == set(reference.SUPPORTED_TYPES)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_kernel_matches_gguf_bit_for_bit_on_valid_blocks(
    qtype: Q, rng: np.random.Generator
) -> None:
    shape = (48, 4 * QK_K)  # 48 rows of four 256-element (or sixteen 32-element) blocks
    raw = random_bytes(qtype, shape, rng)
    assert_bit_identical(run_kernel(raw, qtype, shape), gguf_reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf * 0
def test_kernel_matches_reference_on_arbitrary_bytes(qtype: Q, rng: np.random.Generator) -> None:
    # every byte random: scales of any magnitude, infinities and NaNs included
    shape = (16, 2 * QK_K)
    raw = torch.from_numpy(rng.integers(0, 256, tensor_nbytes(qtype, shape), dtype=np.uint8))
    want = reference.dequantize(raw, qtype, shape)
    got = run_kernel(raw, qtype, shape)
    assert same_bits_or_both_nan(got, want)
    assert want.isfinite().any()  # the data did exercise ordinary values too


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_blocks", [1, 3, 17])
def test_block_counts_that_leave_a_partial_program(
    qtype: Q, n_blocks: int, rng: np.random.Generator
) -> None:
    block_size = fmt(qtype).block
    shape = (n_blocks * block_size,)
    raw = random_bytes(qtype, shape, rng)
    assert_bit_identical(run_kernel(raw, qtype, shape), gguf_reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.IQ4_XS], ids=lambda t: t.name)
def test_run_at_an_odd_byte_offset_reads_the_same_values(
    qtype: Q, rng: np.random.Generator
) -> None:
    shape = (4, QK_K)
    raw = random_bytes(qtype, shape, rng)
    padded = torch.zeros(raw.size + 3, dtype=torch.uint8)
    padded[1:-2] = torch.from_numpy(raw)
    data = padded.to(DEVICE)[1:-2]  # a view whose first byte is at an odd address
    got = run_kernel(data, qtype, shape)
    assert_bit_identical(got, gguf_reference(raw, qtype, shape))


@pytest.mark.gpu
def test_dequantize_on_cuda_launches_the_kernel(
    monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator
) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    calls: list[Q] = []
    real = repack_kernels.dequantize

    def counted(data: torch.Tensor, lay, *args, **kw) -> torch.Tensor:
        calls.append(lay.qtype)
        return real(data, lay, *args, **kw)

    monkeypatch.setattr(repack_kernels, "dequantize", counted)
    shape = (32, QK_K)
    for qtype in KERNEL_TYPES:
        raw = random_bytes(qtype, shape, rng)
        got = quant.dequantize(torch.from_numpy(raw).cuda(), qtype, shape)
        assert_bit_identical(got, gguf_reference(raw, qtype, shape))
    assert calls == KERNEL_TYPES
    assert quant.gpu_dequant_path().startswith("Triton")


@pytest.mark.gpu
def test_a_kernel_that_cannot_run_falls_back_to_the_reference_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, rng: np.random.Generator
) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")

    def broken(*args, **kw) -> torch.Tensor:
        raise RuntimeError("no compiler for this device\nsecond line")

    monkeypatch.setattr(repack_kernels, "dequantize", broken)
    monkeypatch.setattr(quant, "_proven", set())
    monkeypatch.setattr(quant, "_disabled", None)
    shape = (8, QK_K)
    raw = random_bytes(Q.Q4_K, shape, rng)
    with caplog.at_level(logging.WARNING, logger="strata.engine.quant"):
        got = quant.dequantize(torch.from_numpy(raw).cuda(), Q.Q4_K, shape)
    assert_bit_identical(got, gguf_reference(raw, Q.Q4_K, shape))
    assert "Triton Q4_K kernels failed (RuntimeError: no compiler for this device)" in caplog.text
    assert quant.gpu_dequant_path().startswith("torch reference (Triton kernels failed")
