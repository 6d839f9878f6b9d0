"""The kernel layout: repacking keeps every value bit for bit, the Triton repackers and
dequantisers equal their torch twin, and a type or shape that cannot be repacked is an error
naming it.

The Triton kernels run compiled on a GPU, in Triton's interpreter (``TRITON_INTERPRET=1``) on
CPU tensors elsewhere.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from quantdata import assert_bit_identical, gguf_reference, random_bytes

from strata.engine.quant import reference, repack, tensor_nbytes
from strata.engine.quant.repack import PLANE_ALIGN, REPACKED_TYPES, repacked_layout

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
repack_kernels = pytest.importorskip(
    "strata.engine.quant.repack_kernels", reason="Triton is not installed"
)

Q = gguf.GGMLQuantizationType
QK_K = gguf.QK_K
TYPES = sorted(REPACKED_TYPES)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SHAPES = [(1, QK_K), (7, 2 * QK_K), (33, 3 * QK_K)]  # one row; odd row counts; 768 columns


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261201)


def arbitrary_bytes(qtype: Q, shape: tuple[int, int], rng: np.random.Generator) -> torch.Tensor:
    """Every byte random: scales of any magnitude, infinities and NaNs included."""
    return torch.from_numpy(rng.integers(0, 256, tensor_nbytes(qtype, shape), dtype=np.uint8))


def bits_or_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())).all())


def test_every_supported_type_has_a_kernel_layout() -> None:
    assert REPACKED_TYPES == reference.SUPPORTED_TYPES
    assert set(repack_kernels.KERNEL_TYPES) == REPACKED_TYPES


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_planes_are_aligned_disjoint_and_hold_every_field(qtype: Q, shape) -> None:
    lay = repacked_layout(qtype, shape)
    planes = repack.PLANES[qtype]
    sizes = [shape[0] * rb + p.fixed_bytes for p, rb in zip(planes, lay.row_bytes, strict=True)]
    ends = [off + n for off, n in zip(lay.offsets, sizes, strict=True)]
    assert all(off % PLANE_ALIGN == 0 for off in lay.offsets)
    assert all(end <= nxt for end, nxt in zip(ends, lay.offsets[1:], strict=False))
    assert lay.nbytes == ends[-1]
    # a plane is per block or per matrix, never both
    assert all((p.block_bytes == 0) == (p.fixed_bytes > 0) for p in planes)
    # nothing lost: at least the file's bytes, at most a few hundred more per plane
    raw = tensor_nbytes(qtype, shape)
    per_block = sum(p.block_bytes for p in planes)
    fixed = sum(p.fixed_bytes for p in planes)
    bound = raw // gguf.GGML_QUANT_SIZES[qtype][1] * per_block + fixed + 5 * 256
    assert raw <= lay.nbytes <= bound


def test_iq4_xs_levels_are_one_table_per_matrix_after_the_planes() -> None:
    small, big = repacked_layout(Q.IQ4_XS, (1, QK_K)), repacked_layout(Q.IQ4_XS, (33, 3 * QK_K))
    for lay in (small, big):
        assert [p.name for p in repack.PLANES[Q.IQ4_XS]] == ["qs", "sc", "d", "lv"]
        assert lay.row_bytes[3] == 0 and lay.nbytes == lay.offsets[3] + 64
        raw = torch.zeros(tensor_nbytes(Q.IQ4_XS, (lay.rows, lay.cols)), dtype=torch.uint8)
        packed = repack.repack(raw, Q.IQ4_XS, (lay.rows, lay.cols))
        levels = lay.plane(packed, "lv").view(torch.float32)
        assert levels.tolist() == list(reference.IQ4_NL_LEVELS)


def test_q5_k_fifth_bits_are_one_word_per_sub_block(rng: np.random.Generator) -> None:
    shape = (3, 2 * QK_K)
    raw = torch.from_numpy(random_bytes(Q.Q5_K, shape, rng))
    lay = repacked_layout(Q.Q5_K, shape)
    words = lay.plane(repack.repack(raw, Q.Q5_K, shape), "qh").contiguous().view(torch.int32)
    blocks = raw.reshape(-1, 176)
    for row, blk, s, j in [(0, 0, 0, 0), (1, 1, 7, 31), (2, 0, 3, 17), (2, 1, 5, 8)]:
        # the file: bit s of qh byte j (bytes 16..47) is the fifth bit of element 32 s + j
        want = (int(blocks[row * 2 + blk, 16 + j]) >> s) & 1
        assert (int(words[row, blk * 8 + s]) >> j) & 1 == want
    dd = lay.plane(repack.repack(raw, Q.Q5_K, shape), "dd").contiguous().view(torch.float16)
    assert torch.equal(
        dd[1, 2:4], blocks[3, 0:4].contiguous().view(torch.float16)
    )  # row 1, block 1


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_gives_the_reference_values_bit_for_bit(
    qtype: Q, shape, rng: np.random.Generator
) -> None:
    raw = random_bytes(qtype, shape, rng)
    packed = repack.repack(torch.from_numpy(raw), qtype, shape)
    got = repack.dequantize_repacked(packed, qtype, shape)
    assert_bit_identical(got, gguf_reference(raw, qtype, shape))
    # and any rows of it, by range or by number
    rows = torch.tensor([shape[0] - 1, 0, shape[0] // 2])
    want = reference.dequantize(torch.from_numpy(raw), qtype, shape)
    assert torch.equal(repack.dequantize_repacked(packed, qtype, shape, rows=rows), want[rows])
    part = repack.dequantize_repacked(packed, qtype, shape, rows=slice(shape[0] // 2, None))
    assert torch.equal(part, want[shape[0] // 2 :])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_round_trip_on_arbitrary_bytes_keeps_infinities_and_nans(
    qtype: Q, rng: np.random.Generator
) -> None:
    shape = (8, 2 * QK_K)
    raw = arbitrary_bytes(qtype, shape, rng)
    got = repack.dequantize_repacked(repack.repack(raw, qtype, shape), qtype, shape)
    assert bits_or_nan(got, reference.dequantize(raw, qtype, shape))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_repack_writes_the_twins_bytes(qtype: Q, shape, rng: np.random.Generator) -> None:
    raw = torch.from_numpy(random_bytes(qtype, shape, rng))
    want = repack.repack(raw, qtype, shape)
    lay = repacked_layout(qtype, shape)
    out = torch.full((lay.nbytes + 64,), 0xA5, dtype=torch.uint8, device=DEVICE)
    out[: lay.nbytes] = 0
    repack_kernels.repack_into(out, raw.to(DEVICE), lay)
    assert torch.equal(out[: lay.nbytes].cpu(), want)
    assert bool((out[lay.nbytes :] == 0xA5).all()), "wrote past the layout"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_triton_dequantiser_matches_the_reference_rows_and_ids(
    qtype: Q, rng: np.random.Generator
) -> None:
    shape = (9, 3 * QK_K)
    raw = arbitrary_bytes(qtype, shape, rng)
    want = reference.dequantize(raw, qtype, shape)
    lay = repacked_layout(qtype, shape)
    packed = repack.repack(raw, qtype, shape).to(DEVICE)
    assert bits_or_nan(repack_kernels.dequantize(packed, lay), want)
    assert bits_or_nan(repack_kernels.dequantize(packed, lay, 3, 4), want[3:7])
    ids = torch.tensor([8, 0, 0, 5], dtype=torch.int32, device=DEVICE)
    assert bits_or_nan(repack_kernels.dequantize(packed, lay, ids=ids), want[ids.long().cpu()])
    out = torch.full((2, shape[1]), float("nan"), device=DEVICE)
    repack_kernels.dequantize(packed, lay, ids=ids[:2], out=out)
    assert bits_or_nan(out, want[[8, 0]])


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0], ids=lambda t: t.name)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_32_element_blocks_on_rows_of_any_whole_block_count(
    qtype: Q, rng: np.random.Generator
) -> None:
    shape = (5, 96)  # three blocks a row: not a whole 256
    raw = arbitrary_bytes(qtype, shape, rng)
    want = reference.dequantize(raw, qtype, shape)
    lay = repacked_layout(qtype, shape)
    packed = repack.repack(raw, qtype, shape)
    assert bits_or_nan(repack.dequantize_repacked(packed, qtype, shape), want)
    out = torch.zeros(lay.nbytes, dtype=torch.uint8, device=DEVICE)
    repack_kernels.repack_into(out, raw.to(DEVICE), lay)
    assert torch.equal(out.cpu(), packed)
    assert bits_or_nan(repack_kernels.dequantize(out, lay), want)


def test_an_iq4_xs_matrix_of_no_rows_still_holds_its_levels() -> None:
    lay = repacked_layout(Q.IQ4_XS, (0, QK_K))
    out = torch.zeros(lay.nbytes, dtype=torch.uint8, device=DEVICE)
    repack_kernels.repack_into(out, torch.zeros(0, dtype=torch.uint8, device=DEVICE), lay)
    want = repack.repack(torch.zeros(0, dtype=torch.uint8), Q.IQ4_XS, (0, QK_K))
    assert torch.equal(out.cpu(), want) and bool(want.any())


def test_rows_outside_the_matrix_are_an_error() -> None:
    lay = repacked_layout(Q.Q8_0, (4, 32))
    data = torch.zeros(lay.nbytes, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match=r"rows \[3, 5\) are outside the 4 rows"):
        repack_kernels.dequantize(data, lay, 3, 2)


@pytest.mark.parametrize(
    ("qtype", "shape", "message"),
    [
        (Q.IQ2_XXS, (2, QK_K), "IQ2_XXS has no kernel layout"),
        (Q.Q4_K, (2, 100), "100 is not a multiple of 256"),
        (Q.Q8_0, (2, 3, 32), "only matrices are repacked"),
    ],
)
def test_what_cannot_be_repacked_is_named(qtype: Q, shape, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        repacked_layout(qtype, shape)


def test_dequantising_a_short_buffer_names_the_sizes() -> None:
    lay = repacked_layout(Q.Q4_K, (2, QK_K))
    with pytest.raises(ValueError, match=f"needs a 1-D uint8 buffer of {lay.nbytes} bytes"):
        repack.dequantize_repacked(torch.zeros(10, dtype=torch.uint8), Q.Q4_K, (2, QK_K))


def test_repack_into_rejects_a_destination_too_small(rng: np.random.Generator) -> None:
    from strata.engine.quant import repack_into

    shape = (2, QK_K)
    lay = repacked_layout(Q.Q6_K, shape)
    raw = torch.from_numpy(random_bytes(Q.Q6_K, shape, rng))
    with pytest.raises(ValueError, match=f"needs {lay.nbytes} uint8 bytes"):
        repack_into(torch.zeros(lay.nbytes - 1, dtype=torch.uint8), raw, lay)
