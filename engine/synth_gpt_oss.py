"""Random-weight gpt-oss GGUF files (GGUF architecture ``gpt-oss``) in the layout llama.cpp reads:
tiny ones for the tests (test-chosen shapes, F32 or Q8_0) and the bench's ``gpt-oss-20b`` and
``gpt-oss-120b`` presets (``strata bench --synthetic``), in llama.cpp's ``MXFP4_MOE`` file type:
the expert matrices MXFP4, every other matrix Q8_0, norms, sinks, biases and the router F32.

Tensor data is streamed (header and tensor infos first, then each tensor in chunks of rows), so a
59 GiB file needs a few hundred MiB of RAM. Each tensor draws from its own generator seeded by
(seed, name): the F32 and Q8_0 files of one seed hold the same weights rounded differently.
Float tensors come from normal draws; MXFP4 tensors are random blocks with an exponent near the
wanted scale. The weights follow ``synth``'s recipe for a confident random model (layer outputs
scaled down, each output row echoing its predecessor token's embedding, control tokens muted:
see ``synth``), with gpt-oss's own parameters where the real models have them: sink logits
around 0, small biases, a router bias, and expert weights large enough (``EXPERT_GAIN``) that
the clamped SwiGLU's limit of 7 is reached.

This module imports no other writer: ``synth`` dispatches its presets here.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from strata.engine.synth_recipes import BLOCK_SCALES, fix_blocks
from strata.engine.vocab import Vocab, build_bpe_vocab, pad_vocab

log = logging.getLogger(__name__)

Q = gguf.GGMLQuantizationType
FT = gguf.LlamaFileType
ARCH = "gpt-oss"
Progress = Callable[[int, int], None]

GENERATOR_VERSION = 1  # bump when the bytes of a given (spec, types, seed) change
CHUNK_ELEMENTS = 1 << 24
LAYER_GAIN = 0.5  # attn_output and ffn_down_exps (as synth)
ECHO_GAIN = 16.0
OUTPUT_GAIN = 2.0
ROUTER_GAIN = 3.0
MUTE_SCALE = 1e-3
EXPERT_GAIN = 4.0  # gate/up std × sqrt(n_embd): pre-activations of std 4, past the limit of 7
ECHO_MAX_ELEMENTS = 1 << 26
TYPES = ("F32", "Q8_0", "MXFP4_MOE")


@dataclass(frozen=True)
class GptOssSpec:
    """The shapes of a gpt-oss model. ``window_pattern``: layer i has the sliding window unless
    i % window_pattern == window_pattern - 1 (llama.cpp's reading of the period)."""

    n_layer: int = 4
    n_embd: int = 160
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 96
    context_length: int = 4096
    rope_theta: float = 150000.0
    rms_eps: float = 1e-5
    sliding_window: int = 16
    window_pattern: int = 2
    yarn_factor: float = 32.0
    yarn_orig_ctx: int = 256
    vocab_size: int | None = None  # pad the vocabulary with unused tokens up to this size

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_expert",
                     "n_ff_exp", "sliding_window", "yarn_orig_ctx"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.n_head % self.n_head_kv:
            raise ValueError(f"n_head={self.n_head} is not a multiple of n_head_kv")
        if not 1 <= self.n_expert_used <= self.n_expert:
            raise ValueError(f"n_expert_used={self.n_expert_used} not in [1, {self.n_expert}]")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    def windowed(self, i: int) -> bool:
        p = self.window_pattern
        return p == 0 or i % p < p - 1


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order (GGUF ne reversed)
    qtype: Q
    std: float
    mean: float = 0.0
    role: str = ""  # "embd", "output", or "" for the rest

    @property
    def n_rows(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64))

    @property
    def row_bytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return self.shape[-1] // block * size

    @property
    def nbytes(self) -> int:
        return self.n_rows * self.row_bytes


def _type_of(types: str, name: str, ndim: int) -> Q:
    """llama.cpp's choice for ``types``: 1-D tensors, biases and the router stay F32."""
    if types == "F32" or ndim == 1 or not name.endswith(".weight") or "ffn_gate_inp" in name:
        return Q.F32
    if types == "MXFP4_MOE" and "_exps" in name:
        return Q.MXFP4
    return Q.Q8_0


def tensor_list(s: GptOssSpec, types: str, n_vocab: int) -> list[_Tensor]:
    """Every tensor of the model in file order, its type checked against its row length."""
    if types not in TYPES:
        raise ValueError(f"types={types!r}: the gpt-oss writer writes {TYPES}")
    d, q, kv = s.n_embd, s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    E, ff = s.n_expert, s.n_ff_exp
    rows: list[tuple[str, tuple[int, ...], float, float, str]] = [
        ("token_embd.weight", (n_vocab, d), 1.0, 0.0, "embd")
    ]
    for i in range(s.n_layer):
        p = f"blk.{i}."
        rows += [
            (p + "attn_norm.weight", (d,), 0.1, 1.0, ""),
            (p + "attn_q.weight", (q, d), d**-0.5, 0.0, ""),
            (p + "attn_q.bias", (q,), 0.1, 0.0, ""),
            (p + "attn_k.weight", (kv, d), d**-0.5, 0.0, ""),
            (p + "attn_k.bias", (kv,), 0.1, 0.0, ""),
            (p + "attn_v.weight", (kv, d), d**-0.5, 0.0, ""),
            (p + "attn_v.bias", (kv,), 0.1, 0.0, ""),
            (p + "attn_output.weight", (d, q), LAYER_GAIN * q**-0.5, 0.0, ""),
            (p + "attn_output.bias", (d,), 0.02, 0.0, ""),
            (p + "attn_sinks.weight", (s.n_head,), 1.0, 0.0, ""),
            (p + "post_attention_norm.weight", (d,), 0.1, 1.0, ""),
            (p + "ffn_gate_inp.weight", (E, d), ROUTER_GAIN * d**-0.5, 0.0, ""),
            (p + "ffn_gate_inp.bias", (E,), 0.5, 0.0, ""),
            (p + "ffn_gate_exps.weight", (E, ff, d), EXPERT_GAIN * d**-0.5, 0.0, ""),
            (p + "ffn_gate_exps.bias", (E, ff), 0.5, 0.0, ""),
            (p + "ffn_up_exps.weight", (E, ff, d), EXPERT_GAIN * d**-0.5, 0.0, ""),
            (p + "ffn_up_exps.bias", (E, ff), 0.5, 0.0, ""),
            # down sees activations up to ~limit²: scaled so an expert's output stays small
            (p + "ffn_down_exps.weight", (E, d, ff), LAYER_GAIN * 0.1 * ff**-0.5, 0.0, ""),
            (p + "ffn_down_exps.bias", (E, d), 0.02, 0.0, ""),
        ]
    rows += [
        ("output_norm.weight", (d,), 0.1, 1.0, ""),
        ("output.weight", (n_vocab, d), OUTPUT_GAIN * d**-0.5, 0.0, "output"),
    ]
    out = []
    for name, shape, std, mean, role in rows:
        t = _Tensor(name, shape, _type_of(types, name, len(shape)), std, mean, role)
        block = gguf.GGML_QUANT_SIZES[t.qtype][0]
        if shape[-1] % block:
            raise ValueError(f"{name}: rows of {shape[-1]} do not fill {t.qtype.name} blocks")
        out.append(t)
    return out


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode()), 43])


def _row_chunks(t: _Tensor) -> Iterator[tuple[int, int]]:
    step = max(1, CHUNK_ELEMENTS // t.shape[-1])
    for r0 in range(0, t.n_rows, step):
        yield r0, min(step, t.n_rows - r0)


def _floats(t: _Tensor, rng: np.random.Generator, rows: int) -> np.ndarray:
    w = rng.standard_normal((rows, t.shape[-1]), dtype=np.float32)  # w: [R, ne0]
    w *= np.float32(t.std)
    if t.mean:
        w += np.float32(t.mean)
    return w


def _mxfp4_blocks(t: _Tensor, rng: np.random.Generator, rows: int) -> np.ndarray:
    """Random MXFP4 blocks whose exponent puts the values' spread near ``t.std`` (the 4-bit
    levels of E2M1 have a root mean square of about 3.3 for e = 128 - 1)."""
    per_row = t.shape[-1] // 32
    n = rows * per_row
    size = gguf.GGML_QUANT_SIZES[Q.MXFP4][1]
    blocks = rng.bit_generator.random_raw(-(-n * size // 8)).view(np.uint8)[: n * size]
    blocks = blocks.reshape(n, size).copy()
    assert BLOCK_SCALES[Q.MXFP4] == ()  # its scale is an exponent byte, set by fix_blocks
    d = (t.std / 3.3 * rng.uniform(0.7, 1.4, n)).astype(np.float32) * 2  # 2^(e-128) × level/2
    fix_blocks(Q.MXFP4, blocks, d)
    return blocks


@dataclass
class _Echo:
    """The output rows' departure from noise: each token's successor in one cycle echoes its
    embedding; control and unused tokens muted."""

    muted: np.ndarray
    pred: np.ndarray | None = None  # [V] the token whose successor is v, or -1
    embd: np.ndarray | None = None  # [V, D]

    def apply(self, w: np.ndarray, r0: int) -> None:
        if self.pred is not None and self.embd is not None:
            pred = self.pred[r0 : r0 + len(w)]
            has = pred >= 0
            w[has] += np.float32(ECHO_GAIN / w.shape[1]) * self.embd[pred[has]]
        mute = self.muted[(self.muted >= r0) & (self.muted < r0 + len(w))] - r0
        w[mute] *= np.float32(MUTE_SCALE)


def _muted(vocab: Vocab) -> np.ndarray:
    types = np.asarray(vocab.token_types)
    silent = (int(gguf.TokenType.CONTROL), int(gguf.TokenType.UNUSED))
    ids = set(np.flatnonzero(np.isin(types, silent)).tolist())
    ids |= {i for i in (vocab.eos_id, vocab.eot_id) if i is not None}
    return np.array(sorted(ids), dtype=np.int64)


def _echo(tensors: list[_Tensor], vocab: Vocab, seed: int) -> _Echo:
    muted = _muted(vocab)
    embd = tensors[0]
    if embd.qtype not in (Q.F32, Q.Q8_0) or embd.n_rows * embd.shape[-1] > ECHO_MAX_ELEMENTS:
        return _Echo(muted)
    floats = np.concatenate(
        [_floats(embd, rng, rows) for rng in [_rng(seed, embd.name)]
         for _, rows in _row_chunks(embd)]
    )  # fmt: skip
    speakable = np.setdiff1d(np.arange(embd.n_rows), muted)
    order = _rng(seed, "echo").permutation(speakable)
    pred = np.full(embd.n_rows, -1, dtype=np.int64)
    pred[np.roll(order, -1)] = order
    return _Echo(muted, pred, floats)


def _chunks(t: _Tensor, seed: int, echo: _Echo) -> Iterator[np.ndarray]:
    rng = _rng(seed, t.name)
    for r0, rows in _row_chunks(t):
        if t.qtype is Q.MXFP4:
            yield _mxfp4_blocks(t, rng, rows)
            continue
        w = _floats(t, rng, rows)
        if t.role == "output":
            echo.apply(w, r0)
        yield w if t.qtype is Q.F32 else gguf.quants.quantize(w, t.qtype)


def _metadata(w: gguf.GGUFWriter, s: GptOssSpec, types: str, seed: int) -> None:
    w.add_type("model")
    w.add_name("strata synthetic gpt-oss (random weights)")
    w.add_context_length(s.context_length)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff_exp)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(s.yarn_factor)
    w.add_rope_scaling_orig_ctx_len(s.yarn_orig_ctx)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_sliding_window(s.sliding_window)
    if s.window_pattern != 2:
        w.add_uint32(f"{ARCH}.attention.sliding_window_pattern", s.window_pattern)
    w.add_expert_count(s.n_expert)
    w.add_expert_used_count(s.n_expert_used)
    w.add_expert_feed_forward_length(s.n_ff_exp)
    w.add_file_type({"F32": FT.ALL_F32, "Q8_0": FT.MOSTLY_Q8_0,
                     "MXFP4_MOE": FT.MOSTLY_MXFP4_MOE}[types])  # fmt: skip
    if types != "F32":
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_uint32("strata.synth.generator_version", GENERATOR_VERSION)
    w.add_uint64("strata.synth.seed", seed)


def write_gpt_oss(
    path: str | os.PathLike[str],
    spec: GptOssSpec,
    types: str = "F32",
    seed: int = 0,
    vocab: Vocab | None = None,
    progress: Progress | None = None,
) -> Path:
    """Write a random-weight ``spec`` file to ``path`` (atomically) in ``types`` (F32, Q8_0 or
    MXFP4_MOE; norms, sinks, biases and the router F32)."""
    path = Path(path)
    vocab = vocab if vocab is not None else build_bpe_vocab()
    if spec.vocab_size is not None:
        vocab = pad_vocab(vocab, spec.vocab_size)
    tensors = tensor_list(spec, types, len(vocab.tokens))
    echo = _echo(tensors, vocab, seed)
    total = sum(t.nbytes for t in tensors)
    log.info("writing %s: %s %s, %.1f MiB", path, spec, types, total / 2**20)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    tmp.chmod(0o644)  # mkstemp's 0600 would follow the file through the rename
    try:
        w = gguf.GGUFWriter(tmp, ARCH)
        _metadata(w, spec, types, seed)
        vocab.write(w)
        for t in tensors:
            shape = (*t.shape[:-1], t.row_bytes)
            w.add_tensor_info(t.name, shape, np.dtype(np.uint8), t.nbytes, t.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        assert w.fout is not None and len(w.fout) == 1
        fout, done = w.fout[0], 0
        for t in tensors:
            w.write_padding(fout, fout.tell())
            written = 0
            for chunk in _chunks(t, seed, echo):
                chunk.tofile(fout)
                written += chunk.nbytes
                if progress is not None:
                    progress(done + written, total)
            if written != t.nbytes:
                raise AssertionError(f"{t.name}: wrote {written} bytes, expected {t.nbytes}")
            done += written
            w.write_padding(fout, written)
        w.close()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    log.info("wrote %s", path)
    return path


# The bench's presets: the shapes (gpt-oss-20b and -120b), llama.cpp's MXFP4_MOE types.
_REAL = dict(n_embd=2880, n_head=64, n_head_kv=8, head_dim=64, n_expert_used=4, n_ff_exp=2880,
             context_length=131072, rope_theta=150000.0, rms_eps=1e-5, sliding_window=128,
             yarn_factor=32.0, yarn_orig_ctx=4096, vocab_size=201088)  # fmt: skip
PRESETS: dict[str, GptOssSpec] = {
    "gpt-oss-20b": GptOssSpec(n_layer=24, n_expert=32, **_REAL),  # type: ignore[arg-type]
    "gpt-oss-120b": GptOssSpec(n_layer=36, n_expert=128, **_REAL),  # type: ignore[arg-type]
}
PRESET_TYPES = "MXFP4_MOE"
PRESET_SEED = 0


def ensure(name: str, cache_dir: str | os.PathLike[str], progress: Progress | None = None) -> Path:
    """The preset ``name`` under ``cache_dir``, written once (atomically) and reused."""
    if name not in PRESETS:
        raise ValueError(f"unknown gpt-oss preset {name!r}; presets: {sorted(PRESETS)}")
    spec, vocab = PRESETS[name], build_bpe_vocab()
    knobs = (GENERATOR_VERSION, spec, PRESET_TYPES, PRESET_SEED, vocab, EXPERT_GAIN, LAYER_GAIN)
    key = hashlib.sha256(repr(knobs).encode()).hexdigest()[:10]
    path = Path(cache_dir) / f"{name}-g{GENERATOR_VERSION}-{key}.gguf"
    if path.is_file():
        return path
    return write_gpt_oss(path, spec, PRESET_TYPES, PRESET_SEED, vocab, progress)
