"""The torch reference dequantisers against gguf-py's numpy ones, block for block.

Every supported type is compared bit for bit (int32 views of the float32 results, so even the
sign of a zero must agree): the torch code performs the same float32 products in the same order
as ``gguf.quants``, so no type needs an ulp of slack.
"""

from __future__ import annotations

import gguf
import gguf.quants
import numpy as np
import pytest
import torch
from quantdata import assert_bit_identical, gguf_reference, random_bytes

from strata.engine.errors import UnsupportedQuantType
from strata.engine.quant import SUPPORTED_TYPES, dequantize, tensor_nbytes

Q = gguf.GGMLQuantizationType
QK_K = gguf.QK_K
ALL_TYPES = sorted(SUPPORTED_TYPES)
EXPERT_SHAPE = (4, 512, 256)  # 4 experts, 512 rows, ne0 256


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240607)


def test_supported_types_are_the_documented_eighteen() -> None:
    names = {t.name for t in SUPPORTED_TYPES}
    assert names == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS",
                     "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "IQ3_S", "IQ3_XXS",
                     "MXFP4"}  # fmt: skip


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_random_valid_blocks_match_gguf_bit_for_bit(qtype: Q, rng: np.random.Generator) -> None:
    block_size = gguf.GGML_QUANT_SIZES[qtype][0]
    shape = (64, 4 * max(block_size, QK_K))  # 64 rows of several blocks each
    raw = random_bytes(qtype, shape, rng)
    got = dequantize(torch.from_numpy(raw), qtype, shape)
    assert_bit_identical(got, gguf_reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_expert_tensor_and_one_experts_byte_run_match_gguf(
    qtype: Q, rng: np.random.Generator
) -> None:
    raw = random_bytes(qtype, EXPERT_SHAPE, rng)
    data = torch.from_numpy(raw)
    whole = dequantize(data, qtype, EXPERT_SHAPE)
    assert_bit_identical(whole, gguf_reference(raw, qtype, EXPERT_SHAPE))

    one = tensor_nbytes(qtype, EXPERT_SHAPE[1:])
    assert one * EXPERT_SHAPE[0] == data.numel()
    for expert in (1, EXPERT_SHAPE[0] - 1):
        run = data[expert * one : (expert + 1) * one]  # a view into the whole tensor's bytes
        got = dequantize(run, qtype, EXPERT_SHAPE[1:])
        assert torch.equal(got.view(torch.int32), whole[expert].view(torch.int32))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=lambda t: t.name)
def test_gguf_quantized_real_weights_round_trip_like_gguf(
    qtype: Q, rng: np.random.Generator
) -> None:
    weights = (rng.standard_normal((96, 512)) * 0.02).astype(np.float32)
    raw = gguf.quants.quantize(weights, qtype)  # [96, bytes per row] uint8
    got = dequantize(torch.from_numpy(raw.reshape(-1)), qtype, weights.shape)
    assert_bit_identical(got, gguf.quants.dequantize(raw, qtype))
    # and it is the weights, within one quantisation step of each block (absmax / 127 or / 8)
    levels = {Q.Q8_0: 127, Q.Q4_0: 8}[qtype]
    block_size = gguf.GGML_QUANT_SIZES[qtype][0]
    blocks = torch.from_numpy(weights).reshape(-1, block_size)
    step = blocks.abs().amax(dim=1, keepdim=True) / levels
    assert ((got.reshape(-1, block_size) - blocks).abs() <= step * 1.01).all()


def test_byte_run_at_an_odd_offset_gives_the_same_values(rng: np.random.Generator) -> None:
    # A run cut out of a larger buffer at an odd byte offset cannot be viewed as f16 in place.
    for qtype in (Q.F32, Q.BF16, Q.Q4_K, Q.IQ4_XS):
        shape = (8, QK_K)
        raw = random_bytes(qtype, shape, rng)
        padded = torch.zeros(raw.size + 1, dtype=torch.uint8)
        padded[1:] = torch.from_numpy(raw)
        got = dequantize(padded[1:], qtype, shape)
        assert_bit_identical(got, gguf_reference(raw, qtype, shape))


def test_result_never_aliases_the_input_bytes(rng: np.random.Generator) -> None:
    raw = torch.from_numpy(random_bytes(Q.F32, (4, 32), rng))
    out = dequantize(raw, Q.F32, (4, 32))
    before = raw.clone()
    out.fill_(0.0)
    assert torch.equal(raw, before)


def test_empty_tensor_dequantises_to_empty() -> None:
    out = dequantize(torch.empty(0, dtype=torch.uint8), Q.Q4_K, (0, QK_K))
    assert out.shape == (0, QK_K) and out.dtype == torch.float32


@pytest.mark.parametrize(
    ("qtype", "shape", "nbytes"),
    [
        (Q.F32, (3, 5), 60),
        (Q.BF16, (7,), 14),
        (Q.Q8_0, (2, 64), 2 * 2 * 34),
        (Q.Q4_0, (32,), 18),
        (Q.Q4_K, (4, 512, 256), 4 * 512 * 144),
        (Q.Q5_K, (256,), 176),
        (Q.Q6_K, (2, 256), 420),
        (Q.IQ4_XS, (3, 512), 3 * 2 * 136),
        (Q.Q2_K, (1, 256), 84),
        (Q.IQ2_XXS, (1, 256), 66),  # sizes are known for types we cannot dequantise too
    ],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_tensor_nbytes_counts_blocks_times_type_size(
    qtype: Q, shape: tuple[int, ...], nbytes: int
) -> None:
    assert tensor_nbytes(qtype, shape) == nbytes


def test_unsupported_type_raises_naming_it() -> None:
    data = torch.zeros(66, dtype=torch.uint8)
    with pytest.raises(UnsupportedQuantType, match=r"quant type IQ2_XXS is not supported.*Q4_K"):
        dequantize(data, Q.IQ2_XXS, (256,))


def test_unknown_type_number_raises_unsupported() -> None:
    with pytest.raises(UnsupportedQuantType, match="9999"):
        dequantize(torch.zeros(4, dtype=torch.uint8), 9999, (1,))  # type: ignore[arg-type]


def test_last_dim_not_a_block_multiple_raises_naming_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"\(4, 100\).*Q4_K.*100.*256"):
        dequantize(torch.zeros(1000, dtype=torch.uint8), Q.Q4_K, (4, 100))
    with pytest.raises(ValueError, match=r"\(48,\).*Q8_0.*48.*32"):
        tensor_nbytes(Q.Q8_0, (48,))


def test_wrong_byte_count_raises_naming_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"\(2, 256\).*Q6_K.*420.*419"):
        dequantize(torch.zeros(419, dtype=torch.uint8), Q.Q6_K, (2, 256))


def test_data_that_is_not_flat_uint8_raises() -> None:
    with pytest.raises(ValueError, match="1-D uint8"):
        dequantize(torch.zeros(8, dtype=torch.float32), Q.F32, (8,))
    with pytest.raises(ValueError, match="1-D uint8"):
        dequantize(torch.zeros(2, 16, dtype=torch.uint8), Q.F32, (8,))


def test_negative_or_missing_dims_raise() -> None:
    with pytest.raises(ValueError, match="negative"):
        tensor_nbytes(Q.F32, (-1, 4))
    with pytest.raises(ValueError, match="at least one dimension"):
        tensor_nbytes(Q.F32, ())


@pytest.mark.gpu
def test_cuda_tensors_match_gguf_bit_for_bit(rng: np.random.Generator) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    for qtype in ALL_TYPES:
        raw = random_bytes(qtype, EXPERT_SHAPE, rng)
        data = torch.from_numpy(raw).cuda()
        got = dequantize(data, qtype, EXPERT_SHAPE)
        assert got.device == data.device, qtype.name
        assert_bit_identical(got, gguf_reference(raw, qtype, EXPERT_SHAPE))
        one = tensor_nbytes(qtype, EXPERT_SHAPE[1:])
        run = dequantize(data[one : 2 * one], qtype, EXPERT_SHAPE[1:])
        assert torch.equal(run.view(torch.int32), got[1].view(torch.int32)), qtype.name
