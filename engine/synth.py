"""Random-weight GGUF files in the exact layout llama.cpp reads (qwen3moe and Mixtral-style llama).

Used for the test models, the built-in demo model and full-size synthetic files (a Qwen3-30B-A3B-
shaped Q4_K file of ~16 GiB). Written with the ``gguf`` package alone; gpt-oss by synth_gpt_oss.

Weights are random but *healthy*: std ~ 1/sqrt(fan_in), norms near 1 and a router wide enough that
every expert gets traffic and top-k margins are not all tiny. The model is also made *confident*,
because llama.cpp rounds activations to 8 bits before quantised dot products (~1% noise per
matmul) and a random model's near-ties would then flip its greedy choice at ~5-10% of positions:
attention and expert outputs are scaled down (LAYER_GAIN) so the residual stream stays dominated
by the exact embedding lookup, and each output row echoes the embedding of its predecessor in one
fixed cycle through the vocabulary (ECHO_GAIN), a bigram prior that wins by several logits. The
layers still move every logit by tens of percent, so any numerical bug shows, while top-1 choices
survive the rounding. Each tensor draws from its own generator seeded by (seed, tensor name), so
the F32, F16, BF16 and Q8_0 files of one seed hold the same underlying weights, rounded
differently. Float types and Q8_0/Q4_0 come from random floats;
K-quants and IQ4_XS are random blocks whose fp16 scale fields (d, dmin) are overwritten with small
finite values, which any reader can run and which cost no quantisation time.

Tensor data is streamed: header, metadata and tensor infos first, then each tensor in chunks of
rows straight to the file, so writing a 16 GiB file needs a few hundred MiB of RAM.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from enum import StrEnum
from functools import cache
from pathlib import Path
from typing import IO, TYPE_CHECKING

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, QK_K, TENSOR_NAMES, GGMLQuantizationType, LlamaFileType
from gguf import MODEL_TENSOR as MT

from strata.engine import synth_gpt_oss, synth_recipes
from strata.engine.vocab import pad_vocab

if TYPE_CHECKING:
    from strata.engine.vocab import Vocab

log = logging.getLogger(__name__)

Q = GGMLQuantizationType
Progress = Callable[[int, int], None]
# A plan for what follows what, in place of the one cycle (see ``write_model``): from the
# vocabulary, the muted ids and the seed, pred: [V, k], the tokens each token follows (-1: none)
Successors = Callable[["Vocab", np.ndarray, int], np.ndarray]

# Bump whenever the bytes written for a given (spec, plan, vocab, seed) change: cached files carry
# it in their name, so a new generator never reuses an old file.
GENERATOR_VERSION = 1

ARCHS = ("qwen3moe", "llama")
FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})
# Types quantised from random floats with gguf.quants (cheap, exact reference values).
FROM_FLOATS = frozenset({Q.Q8_0, Q.Q4_0})
# Types produced as random blocks: (byte offset of an fp16 scale field, its multiple of d).
# dmin = 7.5 d (Q4_K) or 15.5 d (Q5_K) centres d*sc*q - dmin*m around zero for uniform random
# q and 6-bit sc, m; Q6_K and IQ4_XS are symmetric already.
RANDOM_BLOCK_SCALES: dict[Q, tuple[tuple[int, float], ...]] = {
    Q.Q4_K: ((0, 1.0), (2, 7.5)),
    Q.Q5_K: ((0, 1.0), (2, 15.5)),
    Q.Q6_K: ((QK_K // 2 + QK_K // 4 + QK_K // 16, 1.0),),  # d after ql, qh and the scales
    Q.IQ4_XS: ((0, 1.0),),
    **synth_recipes.BLOCK_SCALES,  # the other types' (and synth_recipes.fix_blocks)
}
SUPPORTED_TYPES = FLOAT_TYPES | FROM_FLOATS | frozenset(RANDOM_BLOCK_SCALES)

# Output rows of end-of-generation and other control tokens are scaled by this, so their logit is
# ~0 while the best of thousands of random logits is several sigma above 0: greedy decoding never
# ends early or emits template tokens (the demo ends its answers by a plan of its own, demo.py).
MUTE_SCALE = 1e-3
CHUNK_ELEMENTS = 1 << 24  # rows generated per step: ~64 MiB of float32 scratch
ROUTER_GAIN = 3.0  # router logits ~ N(0, 3^2): every expert used
OUTPUT_GAIN = 2.0  # the random part of the logits ~ N(0, 2^2)
# Measured on the tiny models' llama.cpp Q4_K_M and Q6_K files over 256 positions, exact fp64
# reference vs. one emulating llama.cpp's activation rounding: (LAYER_GAIN, ECHO_GAIN) = (1, 0)
# agreed on 90-96% of top-1 choices, (0.5, 12) on 98-100%, (0.5, 16) on 100% of all four.
LAYER_GAIN = 0.5  # scales attn_output and ffn_down_exps
ECHO_GAIN = 16.0  # logits the successor of the current token gains from the bigram echo
ECHO_MAX_ELEMENTS = 1 << 26  # keep token_embd in memory for the echo only up to 256 MiB


@dataclass(frozen=True)
class ModelSpec:
    """The shapes of a MoE model: ``arch`` is ``qwen3moe``, or ``llama`` with experts (Mixtral)."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    context_length: int
    rope_theta: float
    rms_eps: float
    vocab_size: int | None = None  # pad the vocab with unused tokens up to this size

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch={self.arch!r} is not one of {ARCHS}")
        for name in ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_expert"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.n_ff_exp < 1 or self.context_length < 1:
            raise ValueError("n_ff_exp and context_length must be >= 1")
        if self.n_head % self.n_head_kv:
            raise ValueError(
                f"n_head={self.n_head} is not a multiple of n_head_kv={self.n_head_kv}"
            )
        if not 1 <= self.n_expert_used <= self.n_expert:
            raise ValueError(f"n_expert_used={self.n_expert_used} not in [1, {self.n_expert}]")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


class Kind(StrEnum):
    """What a tensor is, for choosing its type and its initialisation."""

    TOKEN_EMBD = "token_embd"
    ATTN = "attn"  # attn_q, attn_k, attn_output
    ATTN_V = "attn_v"
    NORM = "norm"  # every 1-D tensor
    ROUTER = "router"  # ffn_gate_inp
    EXPERTS_GATE_UP = "experts_gate_up"
    EXPERTS_DOWN = "experts_down"
    OUTPUT = "output"


def use_more_bits(layer: int, n_layer: int) -> bool:
    """llama.cpp's choice of layers that get more bits in the *_M K-quant recipes."""
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


@dataclass(frozen=True)
class TypePlan:
    """The GGML type of each tensor kind. ``*_more_bits`` override ``attn_v`` / ``experts_down``
    on the layers llama.cpp's Q4_K_M recipe gives more bits (see ``use_more_bits``)."""

    token_embd: Q = Q.F32
    attn: Q = Q.F32
    norm: Q = Q.F32
    router: Q = Q.F32
    experts_gate_up: Q = Q.F32
    experts_down: Q = Q.F32
    output: Q = Q.F32
    attn_v: Q | None = None  # None: same as attn
    attn_v_more_bits: Q | None = None
    experts_down_more_bits: Q | None = None
    file_type: LlamaFileType | None = None  # None: derived from the expert types

    @classmethod
    def uniform(cls, qtype: Q) -> TypePlan:
        """Every matrix in ``qtype``; norms and the router stay F32 (llama.cpp's tools do too)."""
        return cls(
            token_embd=qtype,
            attn=qtype,
            experts_gate_up=qtype,
            experts_down=qtype,
            output=qtype,
        )

    def type_of(self, kind: Kind, layer: int | None = None, n_layer: int = 1) -> Q:
        more = layer is not None and use_more_bits(layer, n_layer)
        if kind is Kind.ATTN_V:
            if more and self.attn_v_more_bits is not None:
                return self.attn_v_more_bits
            return self.attn if self.attn_v is None else self.attn_v
        if kind is Kind.EXPERTS_DOWN and more and self.experts_down_more_bits is not None:
            return self.experts_down_more_bits
        return getattr(self, kind.value)

    def types(self) -> frozenset[Q]:
        maybe = (self.attn_v, self.attn_v_more_bits, self.experts_down_more_bits)
        fixed = (self.token_embd, self.attn, self.norm, self.router, self.experts_gate_up)
        return frozenset((*fixed, self.experts_down, self.output)) | {
            t for t in maybe if t is not None
        }

    def guessed_file_type(self) -> LlamaFileType:
        if self.file_type is not None:
            return self.file_type
        mixed = self.experts_down_more_bits is not None or self.attn_v_more_bits is not None
        by_type = {
            Q.F32: LlamaFileType.ALL_F32,
            Q.F16: LlamaFileType.MOSTLY_F16,
            Q.BF16: LlamaFileType.MOSTLY_BF16,
            Q.Q8_0: LlamaFileType.MOSTLY_Q8_0,
            Q.Q4_0: LlamaFileType.MOSTLY_Q4_0,
            Q.Q4_K: LlamaFileType.MOSTLY_Q4_K_M if mixed else LlamaFileType.MOSTLY_Q4_K_S,
            Q.Q5_K: LlamaFileType.MOSTLY_Q5_K_M if mixed else LlamaFileType.MOSTLY_Q5_K_S,
            Q.Q6_K: LlamaFileType.MOSTLY_Q6_K,
            Q.IQ4_XS: LlamaFileType.MOSTLY_IQ4_XS,
        }
        return by_type.get(self.experts_gate_up, LlamaFileType.GUESSED)


@dataclass(frozen=True)
class TensorDesc:
    """One tensor to write: ``shape`` in numpy order (GGUF ``ne`` reversed)."""

    name: str
    kind: Kind
    shape: tuple[int, ...]
    qtype: Q
    std: float  # init std (NORM: spread around 1)
    layer: int | None = None
    row_dim: str = "n_embd"  # the spec dimension that is ne0, for error messages

    @property
    def ne0(self) -> int:
        return self.shape[-1]

    @property
    def n_rows(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64))

    @property
    def row_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return self.ne0 // block * size

    @property
    def nbytes(self) -> int:
        return self.n_rows * self.row_bytes


def _name(t: MT, layer: int | None = None) -> str:
    base = TENSOR_NAMES[t]
    return (base.format(bid=layer) if layer is not None else base) + ".weight"


def _layer_descs(spec: ModelSpec, types: TypePlan, i: int) -> list[TensorDesc]:
    d, ff, E = spec.n_embd, spec.n_ff_exp, spec.n_expert
    rows = [  # (tensor, kind, shape, init std, the spec dimension that is ne0)
        (MT.ATTN_NORM, Kind.NORM, (d,), 0.1, "n_embd"),
        (MT.ATTN_Q, Kind.ATTN, (spec.q_dim, d), d**-0.5, "n_embd"),
        (MT.ATTN_K, Kind.ATTN, (spec.kv_dim, d), d**-0.5, "n_embd"),
        (MT.ATTN_V, Kind.ATTN_V, (spec.kv_dim, d), d**-0.5, "n_embd"),
        (MT.ATTN_OUT, Kind.ATTN, (d, spec.q_dim), LAYER_GAIN * spec.q_dim**-0.5, "n_head*head_dim"),
    ]
    if spec.arch == "qwen3moe":
        rows.append((MT.ATTN_Q_NORM, Kind.NORM, (spec.head_dim,), 0.1, "head_dim"))
        rows.append((MT.ATTN_K_NORM, Kind.NORM, (spec.head_dim,), 0.1, "head_dim"))
    rows += [
        (MT.FFN_NORM, Kind.NORM, (d,), 0.1, "n_embd"),
        (MT.FFN_GATE_INP, Kind.ROUTER, (E, d), ROUTER_GAIN * d**-0.5, "n_embd"),
        (MT.FFN_GATE_EXP, Kind.EXPERTS_GATE_UP, (E, ff, d), d**-0.5, "n_embd"),
        (MT.FFN_UP_EXP, Kind.EXPERTS_GATE_UP, (E, ff, d), d**-0.5, "n_embd"),
        (MT.FFN_DOWN_EXP, Kind.EXPERTS_DOWN, (E, d, ff), LAYER_GAIN * ff**-0.5, "n_ff_exp"),
    ]
    return [
        TensorDesc(_name(mt, i), kind, shape, types.type_of(kind, i, spec.n_layer), std, i, dim)
        for mt, kind, shape, std, dim in rows
    ]


def tensor_descs(spec: ModelSpec, types: TypePlan, n_vocab: int) -> list[TensorDesc]:
    """Every tensor of the model in file order, with its type checked against its row length."""
    d = spec.n_embd

    def top(mt: MT, kind: Kind, shape: tuple[int, ...], std: float) -> TensorDesc:
        return TensorDesc(_name(mt), kind, shape, types.type_of(kind), std)

    out = [top(MT.TOKEN_EMBD, Kind.TOKEN_EMBD, (n_vocab, d), 1.0)]
    for i in range(spec.n_layer):
        out += _layer_descs(spec, types, i)
    out.append(top(MT.OUTPUT_NORM, Kind.NORM, (d,), 0.1))
    out.append(top(MT.OUTPUT, Kind.OUTPUT, (n_vocab, d), OUTPUT_GAIN * d**-0.5))
    out = synth_recipes.apply(types.file_type, out, spec.n_layer)  # a type per tensor, if any
    for x in out:
        _check_type(x)
    return out


def _check_type(x: TensorDesc) -> None:
    if x.qtype not in SUPPORTED_TYPES:
        raise ValueError(f"{x.name}: type {x.qtype.name} is not one of the synthesizable types")
    if x.kind is Kind.NORM and x.qtype not in FLOAT_TYPES:
        raise ValueError(f"{x.name}: a 1-D norm must be F32, F16 or BF16, not {x.qtype.name}")
    block = GGML_QUANT_SIZES[x.qtype][0]
    if x.ne0 % block:
        raise ValueError(
            f"{x.row_dim}={x.ne0} is not a multiple of {block}, the block size of "
            f"{x.qtype.name} chosen for {x.name} ({x.kind.value})"
        )


# --- data generation ------------------------------------------------------------------------


def _tensor_rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


@cache
def _unit_std(qtype: Q) -> float:
    """Std of random blocks whose d field is 1: scales d so values get a target std."""
    blocks = _random_blocks(np.random.default_rng(0), qtype, 512, np.ones(512, np.float32))
    return float(gguf.quants.dequantize(blocks, qtype).std())


def _random_blocks(rng: np.random.Generator, qtype: Q, n_blocks: int, d: np.ndarray) -> np.ndarray:
    """``n_blocks`` random blocks of ``qtype`` with scale fields d (and dmin) set from ``d``."""
    size = GGML_QUANT_SIZES[qtype][1]
    words = rng.bit_generator.random_raw(-(-n_blocks * size // 8))
    blocks = words.view(np.uint8)[: n_blocks * size].reshape(n_blocks, size)  # blocks: [N, S]
    for offset, mult in RANDOM_BLOCK_SCALES[qtype]:
        blocks[:, offset : offset + 2].view(np.float16)[:, 0] = (d * mult).astype(np.float16)
    synth_recipes.fix_blocks(qtype, blocks, d)
    return blocks


def _float_rows(rng: np.random.Generator, x: TensorDesc, rows: int) -> np.ndarray:
    w = rng.standard_normal((rows, x.ne0), dtype=np.float32)  # w: [R, ne0]
    w *= np.float32(x.std)
    if x.kind is Kind.NORM:
        w += np.float32(1.0)
    return w


@dataclass(frozen=True)
class _OutputShape:
    """How the output matrix departs from pure noise (see ``ECHO_GAIN`` and ``MUTE_SCALE``)."""

    muted: np.ndarray  # token ids whose rows are scaled by MUTE_SCALE
    # pred: [V] or [V, k], the token(s) whose successor is v, or -1
    pred: np.ndarray | None = None
    embd: np.ndarray | None = None  # embd: [V, D], token_embd as floats

    def apply(self, w: np.ndarray, r0: int) -> None:
        """Shape rows [r0, r0 + len(w)) of the output matrix (floats) in place."""
        if self.pred is not None and self.embd is not None:
            preds = self.pred[r0 : r0 + len(w)]
            for pred in preds.T if preds.ndim == 2 else (preds,):
                has = pred >= 0
                w[has] += np.float32(ECHO_GAIN / w.shape[1]) * self.embd[pred[has]]
        self.scale_muted(w, r0)

    def scale_muted(self, w: np.ndarray, r0: int) -> None:
        mute = self.muted[(self.muted >= r0) & (self.muted < r0 + len(w))] - r0
        if mute.size:
            w[mute] *= np.float32(MUTE_SCALE)


def _row_chunks(x: TensorDesc) -> Iterator[tuple[int, int]]:
    step = max(1, CHUNK_ELEMENTS // x.ne0)
    for r0 in range(0, x.n_rows, step):
        yield r0, min(step, x.n_rows - r0)


def _floats(x: TensorDesc, seed: int) -> np.ndarray:
    """The whole tensor as the floats its chunks are made from (before any rounding)."""
    rng = _tensor_rng(seed, x.name)
    return np.concatenate([_float_rows(rng, x, rows) for _, rows in _row_chunks(x)])


def _output_shape(
    descs: list[TensorDesc], seed: int, muted: np.ndarray, planned: np.ndarray | None = None
) -> _OutputShape:
    embd = next(x for x in descs if x.kind is Kind.TOKEN_EMBD)
    out = next(x for x in descs if x.kind is Kind.OUTPUT)
    if ECHO_GAIN == 0 or RANDOM_BLOCK_SCALES.keys() & {embd.qtype, out.qtype}:
        return _OutputShape(muted)  # random blocks carry no float structure to echo
    if embd.n_rows * embd.ne0 > ECHO_MAX_ELEMENTS:
        log.info("vocabulary too large to keep token_embd in memory: no echo structure")
        return _OutputShape(muted)
    n_vocab = out.n_rows
    if planned is not None:
        return _OutputShape(muted, planned, _floats(embd, seed))
    speakable = np.setdiff1d(np.arange(n_vocab), muted)
    # One cycle through every speakable token: greedy text never falls into a short loop.
    order = np.random.default_rng([seed, zlib.crc32(b"strata.synth.echo")]).permutation(speakable)
    pred = np.full(n_vocab, -1, dtype=np.int64)
    pred[np.roll(order, -1)] = order
    return _OutputShape(muted, pred, _floats(embd, seed))


def _chunks(x: TensorDesc, seed: int, shape: _OutputShape) -> Iterator[np.ndarray]:
    """The tensor's bytes in row chunks; the OUTPUT tensor gets ``shape`` applied."""
    rng = _tensor_rng(seed, x.name)
    block = GGML_QUANT_SIZES[x.qtype][0]
    for r0, rows in _row_chunks(x):
        if x.qtype in RANDOM_BLOCK_SCALES:
            per_row = x.ne0 // block
            d = x.std / _unit_std(x.qtype) * rng.uniform(0.5, 1.5, rows * per_row)
            d = d.astype(np.float32).reshape(rows, per_row)  # d: [R, blocks per row]
            if x.kind is Kind.OUTPUT:
                shape.scale_muted(d, r0)
            yield _random_blocks(rng, x.qtype, rows * per_row, d.reshape(-1))
            continue
        w = _float_rows(rng, x, rows)  # w: [R, ne0]
        if x.kind is Kind.OUTPUT:
            shape.apply(w, r0)
        if x.qtype is Q.F32:
            yield w
        elif x.qtype is Q.F16:
            yield w.astype(np.float16)
        else:
            yield gguf.quants.quantize(w, x.qtype)  # BF16, Q8_0, Q4_0: uint8 rows


def _add_metadata(w: gguf.GGUFWriter, spec: ModelSpec, types: TypePlan, n_vocab: int, seed: int):
    w.add_type("model")
    w.add_name(f"strata synthetic {spec.arch} (random weights)")
    w.add_description("Random weights written by strata.engine.synth; its text is meaningless.")
    w.add_context_length(spec.context_length)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_expert_count(spec.n_expert)
    w.add_expert_used_count(spec.n_expert_used)
    if spec.arch == "qwen3moe":
        # Qwen3 writes the dense-equivalent ffn size too; llama.cpp sizes experts from the second.
        w.add_feed_forward_length(spec.n_ff_exp * spec.n_expert_used)
        w.add_expert_feed_forward_length(spec.n_ff_exp)
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
    else:
        w.add_feed_forward_length(spec.n_ff_exp)
        w.add_rope_dimension_count(spec.head_dim)
        w.add_vocab_size(n_vocab)
        if spec.q_dim != spec.n_embd:
            w.add_key_length(spec.head_dim)
            w.add_value_length(spec.head_dim)
    w.add_file_type(types.guessed_file_type())
    if types.types() - FLOAT_TYPES:
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_uint32("strata.synth.generator_version", GENERATOR_VERSION)
    w.add_uint64("strata.synth.seed", seed)


# Bytes a terminal would act on (C0 controls but tab/newline/CR, and DEL): tokens that decode to
# them are muted too, so greedy demo text never carries an escape sequence.
_CONTROL_BYTES = frozenset(range(32)) - {9, 10, 13} | {127}


def _token_bytes(vocab: Vocab, i: int) -> bytes:
    text = vocab.tokens[i]
    if vocab.model == "gpt2":
        from strata.engine.vocab import unicode_to_byte

        table = unicode_to_byte()
        return bytes(table[c] for c in text if c in table)
    if vocab.token_types[i] == int(gguf.TokenType.BYTE) and text.startswith("<0x"):
        return bytes([int(text[3:5], 16)])
    return text.encode()


def token_bytes(vocab: Vocab, i: int) -> bytes:
    """The bytes token ``i`` stands for (a byte-level BPE's mapped characters undone)."""
    return _token_bytes(vocab, i)


def muted_token_ids(vocab: Vocab) -> np.ndarray:
    """The output rows ``write_model`` mutes: control and unused (padding) tokens, the
    end-of-generation ids and tokens that decode to terminal control bytes."""
    types = np.asarray(vocab.token_types)
    silent = (int(gguf.TokenType.CONTROL), int(gguf.TokenType.UNUSED))
    ids = set(np.flatnonzero(np.isin(types, silent)).tolist())
    ids |= {i for i in (vocab.eos_id, vocab.eot_id) if i is not None}
    normal = (int(gguf.TokenType.NORMAL), int(gguf.TokenType.BYTE))
    ids |= {
        i
        for i in np.flatnonzero(np.isin(types, normal)).tolist()
        if _CONTROL_BYTES.intersection(_token_bytes(vocab, i))
    }
    return np.array(sorted(ids), dtype=np.int64)


def write_model(
    path: str | os.PathLike[str],
    spec: ModelSpec,
    vocab: Vocab,
    types: TypePlan,
    seed: int,
    progress: Progress | None = None,
    *,
    mute_special: bool = True,
    successors: Successors | None = None,
) -> Path:
    """Write a random-weight GGUF for ``spec`` to ``path`` (atomically: temp file + rename).

    ``mute_special`` shrinks the output rows of control/end tokens (see ``MUTE_SCALE``).
    ``successors`` replaces the one cycle of the bigram echo with its own plan; a muted row the
    plan gives a predecessor (an end token that ends answers) is not muted.
    Raises ValueError, naming the dimension, when a tensor's row length does not fit its type.
    """
    path = Path(path)
    if spec.vocab_size is not None:
        vocab = pad_vocab(vocab, spec.vocab_size)
    n_vocab = len(vocab.tokens)
    descs = tensor_descs(spec, types, n_vocab)
    muted = muted_token_ids(vocab) if mute_special else np.zeros(0, np.int64)
    planned = None if successors is None else successors(vocab, muted, seed)
    if planned is not None:
        reached = np.flatnonzero((planned.reshape(len(planned), -1) >= 0).any(axis=1))
        muted = np.setdiff1d(muted, reached)
    shape = _output_shape(descs, seed, muted, planned)
    total = sum(x.nbytes for x in descs)
    log.info("writing %s: %s, %.1f MiB", path, spec, total / 2**20)
    t0 = time.monotonic()

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    tmp.chmod(0o644)  # mkstemp's 0600 would follow the file through the rename
    try:
        w = gguf.GGUFWriter(tmp, spec.arch)
        _add_metadata(w, spec, types, n_vocab, seed)
        vocab.write(w)
        for x in descs:
            w.add_tensor_info(
                x.name, (*x.shape[:-1], x.row_bytes), np.dtype(np.uint8), x.nbytes, x.qtype
            )
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        assert w.fout is not None and len(w.fout) == 1
        done = _stream_tensors(w, w.fout[0], descs, seed, shape, total, progress)
        w.close()
        assert done == total
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    log.info("wrote %s in %.1f s", path, time.monotonic() - t0)
    return path


def _stream_tensors(
    w: gguf.GGUFWriter,
    fout: IO[bytes],
    descs: list[TensorDesc],
    seed: int,
    shape: _OutputShape,
    total: int,
    progress: Progress | None,
) -> int:
    # GGUFWriter's own write_tensor_data wants each tensor whole; for multi-GiB files we write each
    # tensor's chunks ourselves with the same alignment rules (pad before, pad after).
    done = 0
    for x in descs:
        w.write_padding(fout, fout.tell())
        written = 0
        for chunk in _chunks(x, seed, shape):
            chunk.tofile(fout)
            written += chunk.nbytes
            done += chunk.nbytes
            if progress is not None:
                progress(done, total)
        if written != x.nbytes:
            raise AssertionError(f"{x.name}: wrote {written} bytes, expected {x.nbytes}")
        w.write_padding(fout, written)
    return done


# --- presets --------------------------------------------------------------------------------

PRESETS: dict[str, ModelSpec] = {
    # Test models: every dimension that feeds a K-quant row (n_embd, n_head*head_dim, n_ff_exp) is
    # a multiple of 256, n_ff_exp != n_embd so a transposed expert cannot go unnoticed, and the
    # experts total 48 MiB in F32 (> 8 chunks of 2 MiB).
    "tiny-qwen3moe": ModelSpec("qwen3moe", 4, 256, 8, 2, 64, 8, 2, 512, 4096, 1e6, 1e-6),
    "tiny-mixtral": ModelSpec("llama", 4, 256, 8, 2, 32, 8, 2, 512, 4096, 1e6, 1e-5),
    # The built-in demo: 16 experts top-4 per layer, ~50 M parameters, F16.
    "demo": ModelSpec("qwen3moe", 4, 512, 8, 2, 64, 16, 4, 256, 8192, 1e6, 1e-6),
    "qwen3-30b-a3b": ModelSpec(
        "qwen3moe", 48, 2048, 32, 4, 128, 128, 8, 768, 40960, 1e6, 1e-6, 151936
    ),
    "mixtral-8x7b": ModelSpec("llama", 32, 4096, 32, 8, 128, 8, 2, 14336, 32768, 1e6, 1e-5, 32000),
}
PRESETS["qwen3-30b-a3b-q4k"] = PRESETS["qwen3-30b-a3b-q5k"] = PRESETS["qwen3-30b-a3b"]

# llama.cpp's Q4_K_M recipe for these shapes: Q4_K by default, output Q6_K, attn_v and ffn_down
# Q6_K on the use_more_bits layers, router and norms untouched (F32).
Q4_K_M = TypePlan(
    token_embd=Q.Q4_K,
    attn=Q.Q4_K,
    experts_gate_up=Q.Q4_K,
    experts_down=Q.Q4_K,
    output=Q.Q6_K,
    attn_v_more_bits=Q.Q6_K,
    experts_down_more_bits=Q.Q6_K,
    file_type=LlamaFileType.MOSTLY_Q4_K_M,
)
# llama.cpp's Q5_K_M recipe, likewise: Q5_K by default, Q6_K where Q4_K_M has it.
Q5_K_M = TypePlan(
    token_embd=Q.Q5_K,
    attn=Q.Q5_K,
    experts_gate_up=Q.Q5_K,
    experts_down=Q.Q5_K,
    output=Q.Q6_K,
    attn_v_more_bits=Q.Q6_K,
    experts_down_more_bits=Q.Q6_K,
    file_type=LlamaFileType.MOSTLY_Q5_K_M,
)
PRESET_TYPES: dict[str, TypePlan] = {
    "tiny-qwen3moe": TypePlan.uniform(Q.F32),
    "tiny-mixtral": TypePlan.uniform(Q.F32),
    "demo": TypePlan.uniform(Q.F16),
    "qwen3-30b-a3b": Q4_K_M,
    "mixtral-8x7b": Q4_K_M,
    # Every expert tensor Q4_K (one expert size for the whole file); the rest as Q4_K_M would.
    "qwen3-30b-a3b-q4k": replace(Q4_K_M, experts_down_more_bits=None),
    "qwen3-30b-a3b-q5k": Q5_K_M,
}
synth_recipes.register(PRESETS, PRESET_TYPES, TypePlan)  # Q2_K, Q3_K_M, IQ3_S/IQ4_NL, MXFP4
PRESET_SEED = 0


def vocab_for(arch: str) -> Vocab:
    """The deterministic vocabulary a preset of ``arch`` gets: byte-level BPE or SentencePiece."""
    from strata.engine import vocab as vocab_mod

    return vocab_mod.build_bpe_vocab() if arch == "qwen3moe" else vocab_mod.build_spm_vocab()


def content_key(spec: ModelSpec, vocab: Vocab, types: TypePlan, seed: int, plan: str = "") -> str:
    """A short digest of everything that decides a file's bytes: cached files are named by it,
    so a changed vocabulary builder or generator never reuses a stale file. ``plan`` names a
    ``successors`` plan and its version (none: the one cycle)."""
    knobs = (MUTE_SCALE, ROUTER_GAIN, OUTPUT_GAIN, LAYER_GAIN, ECHO_GAIN, CHUNK_ELEMENTS)
    text = repr((GENERATOR_VERSION, spec, types, seed, knobs, vocab))
    if plan:
        text += repr(plan)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def ensure_model(
    cache_dir: str | os.PathLike[str],
    stem: str,
    spec: ModelSpec,
    vocab: Vocab,
    types: TypePlan,
    seed: int,
    progress: Progress | None = None,
    successors: tuple[str, Successors] | None = None,
) -> Path:
    """``cache_dir/<stem>-g<version>-<content key>.gguf``, written once (atomically) and reused.
    ``successors``: (its name and version, the plan), as ``write_model`` takes it."""
    key = content_key(spec, vocab, types, seed, successors[0] if successors else "")
    path = Path(cache_dir) / f"{stem}-g{GENERATOR_VERSION}-{key}.gguf"
    if path.is_file():
        log.debug("reusing %s", path)
        return path
    plan = successors[1] if successors else None
    return write_model(path, spec, vocab, types, seed, progress, successors=plan)


def ensure_synthetic(
    name: str, cache_dir: str | os.PathLike[str], progress: Progress | None = None
) -> Path:
    """The preset ``name`` as a GGUF under ``cache_dir``, written once (atomically) and reused."""
    if name in synth_gpt_oss.PRESETS:  # gpt-oss has a writer of its own
        return synth_gpt_oss.ensure(name, cache_dir, progress)
    if name not in PRESETS:
        names = sorted([*PRESETS, *synth_gpt_oss.PRESETS])
        raise ValueError(f"unknown synthetic model {name!r}; presets: {names}")
    spec = PRESETS[name]
    vocab = vocab_for(spec.arch)
    return ensure_model(cache_dir, name, spec, vocab, PRESET_TYPES[name], PRESET_SEED, progress)
