"""Random-weight GGUF files of the hybrid architectures (Gated DeltaNet + gated attention):
``qwen35moe`` (Qwen3.5/3.6) and ``qwen3next`` (Qwen3-Next), in the layout llama.cpp reads.

Small files only (the tensors are built in memory): tests choose the shapes. The weights follow
``strata.engine.synth``'s recipe — each tensor from its own generator seeded by (seed, name), so
the F32 and Q8_0 files of one seed hold the same weights rounded differently; layer outputs
scaled by ``LAYER_GAIN``; the output matrix echoing each token's embedding onto one successor
(``ECHO_GAIN``) and muting control tokens — so llama.cpp's activation rounding does not flip
greedy choices. The DeltaNet's own parameters are drawn where the real models have them: a
decay rate ``-A`` between 0.05 and 1, ``dt_bias`` around 0, β and α projections that put σ(β)
and softplus(α + dt_bias) in their middle ranges, a short causal convolution.

A file of a layout llama.cpp reads is what it writes: ``qwen35moe`` stores q/k/v of a DeltaNet
layer as one ``attn_qkv`` matrix, z as ``attn_gate``, β and α apart, v heads in the tiled order
llama.cpp broadcasts k heads over; ``qwen3next`` stores β and α interleaved per k head in one
``ssm_ba`` matrix and repeats k heads to their v heads by groups.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from strata.engine.synth import (
    ECHO_GAIN,
    GENERATOR_VERSION,
    LAYER_GAIN,
    OUTPUT_GAIN,
    ROUTER_GAIN,
    muted_token_ids,
    vocab_for,
)
from strata.engine.vocab import Vocab, pad_vocab

log = logging.getLogger(__name__)

ARCHS = ("qwen35moe", "qwen3next")
TYPES = (Q.F32, Q.F16, Q.Q8_0)

# A chat template that renders as Qwen3.5's does (written here, not copied): ChatML messages,
# tools in the system turn, calls as <tool_call> JSON, tool results as user turns; the thoughts
# of assistant turns after the last user message kept in <think> blocks, earlier ones dropped;
# the generation prompt opens a thought (or writes an empty one with enable_thinking false).
QWEN35_TEMPLATE = r"""{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n\nYou may call functions. Their signatures, in <tools></tools>:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nCall one as <tool_call>\n{"name": <name>, "arguments": <json>}\n' }}
{{- '</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
{%- elif m.role == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- if loop.index0 > ns.last_user and m.reasoning_content %}
{{- '<think>\n' + m.reasoning_content.strip() + '\n</think>\n\n' }}
{%- endif %}
{{- (m.content or '') }}
{%- for call in m.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{{- '\n<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}
{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- elif m.role != 'system' %}
{{- raise_exception('unsupported role: ' + m.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\n\n</think>\n\n' }}
{%- else %}{{- '<think>\n' }}{%- endif %}
{%- endif %}
"""


@dataclass(frozen=True)
class HybridSpec:
    """The shapes of a hybrid model. DeltaNet layers: ``ssm_n_group`` k heads and
    ``ssm_dt_rank`` v heads, each of ``ssm_d_state`` values (llama.cpp's one head size for k and
    v), a causal convolution of ``ssm_d_conv`` taps; every ``full_attention_interval``-th layer
    is gated attention, rotating the first ``n_rot`` of each head's ``head_dim`` values
    (``rope_sections``: the interleaved multi-section layout of ``qwen35moe``)."""

    arch: str
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_rot: int = 32
    rope_sections: tuple[int, int, int, int] = (5, 5, 4, 2)
    full_attention_interval: int = 2
    ssm_d_conv: int = 4
    ssm_d_state: int = 64
    ssm_n_group: int = 2
    ssm_dt_rank: int = 4
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 512
    n_ff_shexp: int = 512
    context_length: int = 4096
    rope_theta: float = 1e7
    rms_eps: float = 1e-6
    n_mtp: int = 0  # next-token-prediction blocks after the trunk (llama.cpp's converter adds them)
    chat_template: str | None = QWEN35_TEMPLATE  # None: the vocabulary's own
    extra: dict[str, object] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch={self.arch!r} is not one of {ARCHS}")
        if self.ssm_dt_rank % self.ssm_n_group:
            raise ValueError(
                f"ssm_dt_rank={self.ssm_dt_rank} v heads are not a multiple of "
                f"ssm_n_group={self.ssm_n_group} k heads"
            )
        if self.n_head % self.n_head_kv:
            raise ValueError(
                f"n_head={self.n_head} is not a multiple of n_head_kv={self.n_head_kv}"
            )
        if self.n_rot % 2 or self.n_rot > self.head_dim:
            raise ValueError(f"n_rot={self.n_rot}: must be even and at most head_dim")
        if sum(self.rope_sections) > self.n_rot // 2:
            raise ValueError(f"rope_sections={self.rope_sections} exceed n_rot/2={self.n_rot // 2}")

    def is_recurrent(self, i: int) -> bool:
        return i < self.n_layer and (i + 1) % self.full_attention_interval != 0

    @property
    def key_dim(self) -> int:
        return self.ssm_n_group * self.ssm_d_state

    @property
    def value_dim(self) -> int:
        return self.ssm_dt_rank * self.ssm_d_state

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode()), 35])


def _normal(seed: int, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0):
    return (_rng(seed, name).standard_normal(shape) * std + mean).astype(np.float32)


Plan = list[tuple[str, tuple[int, ...], float, float]]  # (name, numpy shape, std, mean)


def _layer_plan(s: HybridSpec, i: int) -> Plan:
    """Layer ``i``'s tensors: name, shape (numpy order: GGUF ``ne`` reversed), the std and mean
    of its normal draw (``ssm_a`` is drawn apart: ``_draw``)."""
    d, p = s.n_embd, f"blk.{i}."
    t: Plan = []

    def w(name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> None:
        t.append((p + name, shape, std, mean))

    w("attn_norm.weight", (d,), 0.1, 1.0)
    w("post_attention_norm.weight", (d,), 0.1, 1.0)
    if s.is_recurrent(i):
        hv = s.ssm_dt_rank
        qkv = (s.conv_dim, d)
        if s.arch == "qwen3next" and s.extra.get("legacy_ssm_in"):
            w("ssm_in.weight", (2 * s.key_dim + 2 * s.value_dim, d), d**-0.5)
        else:
            w("attn_qkv.weight", qkv, d**-0.5)
            w("attn_gate.weight", (s.value_dim, d), d**-0.5)
        w("ssm_conv1d.weight", (s.conv_dim, s.ssm_d_conv), 0.5)
        w("ssm_dt.bias", (hv,), 0.3)
        w("ssm_a", (hv,), 0.0)  # the converter stores -exp(A_log): a rate in [0.05, 1), negated
        if s.arch == "qwen3next":
            w("ssm_ba.weight", (2 * hv, d), d**-0.5)  # per k head: its β rows, then its α rows
        else:
            w("ssm_beta.weight", (hv, d), d**-0.5)
            w("ssm_alpha.weight", (hv, d), d**-0.5)
        w("ssm_norm.weight", (s.ssm_d_state,), 0.1, 1.0)
        w("ssm_out.weight", (d, s.value_dim), LAYER_GAIN * s.value_dim**-0.5)
    else:
        q = s.n_head * s.head_dim
        w("attn_q.weight", (2 * q, d), d**-0.5)  # per head: its query, then its gate
        w("attn_k.weight", (s.n_head_kv * s.head_dim, d), d**-0.5)
        w("attn_v.weight", (s.n_head_kv * s.head_dim, d), d**-0.5)
        w("attn_q_norm.weight", (s.head_dim,), 0.1, 1.0)
        w("attn_k_norm.weight", (s.head_dim,), 0.1, 1.0)
        w("attn_output.weight", (d, q), LAYER_GAIN * q**-0.5)
    if i >= s.n_layer:  # an MTP block: gated attention and the experts, and its own inputs
        w("nextn.eh_proj.weight", (d, 2 * d), (2 * d) ** -0.5)
        w("nextn.enorm.weight", (d,), 0.1, 1.0)
        w("nextn.hnorm.weight", (d,), 0.1, 1.0)
    E, ff, sh = s.n_expert, s.n_ff_exp, s.n_ff_shexp
    w("ffn_gate_inp.weight", (E, d), ROUTER_GAIN * d**-0.5)
    w("ffn_gate_exps.weight", (E, ff, d), d**-0.5)
    w("ffn_up_exps.weight", (E, ff, d), d**-0.5)
    w("ffn_down_exps.weight", (E, d, ff), LAYER_GAIN * ff**-0.5)
    w("ffn_gate_inp_shexp.weight", (d,), d**-0.5)
    w("ffn_gate_shexp.weight", (sh, d), d**-0.5)
    w("ffn_up_shexp.weight", (sh, d), d**-0.5)
    w("ffn_down_shexp.weight", (d, sh), LAYER_GAIN * sh**-0.5)
    return t


def _draw(seed: int, name: str, shape: tuple[int, ...], std: float, mean: float) -> np.ndarray:
    if name.endswith(".ssm_a"):
        return -_rng(seed, name).uniform(0.05, 1.0, shape).astype(np.float32)
    return _normal(seed, name, shape, std, mean)


def _layer_tensors(s: HybridSpec, i: int, seed: int) -> dict[str, np.ndarray]:
    """Layer ``i``'s tensors, every one float32."""
    return {name: _draw(seed, name, *rest) for name, *rest in _layer_plan(s, i)}


def _output(s: HybridSpec, embd: np.ndarray, muted: np.ndarray, seed: int) -> np.ndarray:
    n_vocab = embd.shape[0]
    out = _normal(seed, "output.weight", (n_vocab, s.n_embd), OUTPUT_GAIN * s.n_embd**-0.5)
    speakable = np.setdiff1d(np.arange(n_vocab), muted)
    order = _rng(seed, "echo").permutation(speakable)
    # the row of each token's successor in one cycle echoes that token's embedding
    out[np.roll(order, -1)] += np.float32(ECHO_GAIN / s.n_embd) * embd[order]
    out[muted] *= np.float32(1e-3)
    return out


def tensors(s: HybridSpec, vocab: Vocab, seed: int) -> dict[str, np.ndarray]:
    """Every tensor of the model, float32, in file order."""
    n_vocab = len(vocab.tokens)
    embd = _normal(seed, "token_embd.weight", (n_vocab, s.n_embd), 1.0)
    out = {"token_embd.weight": embd}
    for i in range(s.n_layer + s.n_mtp):
        out |= _layer_tensors(s, i, seed)
    out["output_norm.weight"] = _normal(seed, "output_norm.weight", (s.n_embd,), 0.1, 1.0)
    out["output.weight"] = _output(s, embd, muted_token_ids(vocab), seed)
    return out


def _stays_f32(name: str, x: np.ndarray) -> bool:
    # llama.cpp's tools keep 1-D tensors, the router, the convolution and the DeltaNet's small
    # per-head projections in F32
    return x.ndim == 1 or "ffn_gate_inp" in name or "ssm_conv1d" in name


def _encode(name: str, x: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q]:
    if qtype is Q.F32 or _stays_f32(name, x):
        return x, Q.F32
    if qtype is Q.F16:
        return x.astype(np.float16), Q.F16
    if x.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        raise ValueError(f"{name}: rows of {x.shape[-1]} do not fill {qtype.name} blocks")
    return gguf.quants.quantize(x, qtype), qtype


def _metadata(
    w: gguf.GGUFWriter, s: HybridSpec, qtype: Q, n_vocab: int, seed: int,
    file_type: gguf.LlamaFileType | None = None,
) -> None:  # fmt: skip
    w.add_type("model")
    w.add_name(f"strata synthetic {s.arch} (random weights)")
    w.add_context_length(s.context_length)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer + s.n_mtp)
    if s.n_mtp:
        w.add_nextn_predict_layers(s.n_mtp)
    w.add_feed_forward_length(s.n_ff_exp * s.n_expert_used)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_rope_dimension_count(s.n_rot)
    if s.arch == "qwen35moe":
        w.add_rope_dimension_sections(list(s.rope_sections))
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_expert_count(s.n_expert)
    w.add_expert_used_count(s.n_expert_used)
    w.add_expert_feed_forward_length(s.n_ff_exp)
    w.add_expert_shared_feed_forward_length(s.n_ff_shexp)
    w.add_ssm_conv_kernel(s.ssm_d_conv)
    w.add_ssm_state_size(s.ssm_d_state)
    w.add_ssm_group_count(s.ssm_n_group)
    w.add_ssm_time_step_rank(s.ssm_dt_rank)
    w.add_ssm_inner_size(s.value_dim)
    w.add_full_attention_interval(s.full_attention_interval)
    by_type = {Q.F32: gguf.LlamaFileType.ALL_F32, Q.F16: gguf.LlamaFileType.MOSTLY_F16,
               Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}  # fmt: skip
    w.add_file_type(file_type if file_type is not None else by_type[qtype])
    if qtype is not Q.F32:
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value in s.extra.items():  # overrides (tests of damaged files)
        if key.startswith(s.arch + "."):
            sub = _value_type(value[0]) if isinstance(value, list) and value else None
            w.kv_data[0][key] = gguf.GGUFValue(value, _value_type(value), sub)
    w.add_uint32("strata.synth.generator_version", GENERATOR_VERSION)
    w.add_uint64("strata.synth.seed", seed)


def _value_type(value: object) -> gguf.GGUFValueType:
    if isinstance(value, list):
        return gguf.GGUFValueType.ARRAY
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT32
    if isinstance(value, str):
        return gguf.GGUFValueType.STRING
    return gguf.GGUFValueType.UINT32


def write_hybrid(
    path: str | os.PathLike[str],
    spec: HybridSpec,
    qtype: Q = Q.F32,
    seed: int = 0,
    vocab: Vocab | None = None,
    drop: tuple[str, ...] = (),
) -> Path:
    """Write a random-weight ``spec`` file to ``path`` (atomically), every matrix in ``qtype``
    (F32, F16 or Q8_0; norms, the router and the convolution F32). ``drop``: tensors left out
    (tests of a damaged file)."""
    if qtype not in TYPES:
        raise ValueError(f"type {qtype.name}: the hybrid writer writes {[t.name for t in TYPES]}")
    path = Path(path)
    vocab = vocab if vocab is not None else vocab_for("qwen3moe")
    if spec.chat_template is not None:
        from dataclasses import replace

        vocab = replace(vocab, chat_template=spec.chat_template)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        w = gguf.GGUFWriter(tmp, spec.arch)
        _metadata(w, spec, qtype, len(vocab.tokens), seed)
        vocab.write(w)
        for name, x in tensors(spec, vocab, seed).items():
            if name in drop:
                continue
            data, t = _encode(name, x, qtype)
            w.add_tensor(name, data, raw_dtype=t)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        tmp.chmod(0o644)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    log.info("wrote %s (%s, %s)", path, spec.arch, qtype.name)
    return path


# --- the bench's presets: the real shapes, streamed -----------------------------------------

# Qwen3.6-35B-A3B and Qwen3-Next-80B-A3B (the MTP block kept: one more MoE layer); experts'
# gate/up Q4_K, down Q5_K, attention, DeltaNet projections and the shared expert Q8_0, output
# Q6_K, the embeddings Q4_K; norms, routers and the convolution F32.
_REAL = dict(n_embd=2048, n_head=16, n_head_kv=2, head_dim=256, n_rot=64,
             full_attention_interval=4, ssm_d_conv=4, ssm_d_state=128, ssm_n_group=16,
             ssm_dt_rank=32, n_ff_exp=512, n_ff_shexp=512, context_length=262144,
             rope_theta=1e7, n_mtp=1)  # fmt: skip
PRESETS: dict[str, tuple[HybridSpec, int]] = {  # the spec and the vocabulary's size
    "qwen3.6-35b-a3b": (
        HybridSpec(
            "qwen35moe",
            n_layer=40,
            n_expert=256,
            n_expert_used=8,
            rope_sections=(11, 11, 10, 0),
            **_REAL,
        ),  # type: ignore[arg-type]
        248320,
    ),
    "qwen3-next-80b-a3b": (
        HybridSpec(
            "qwen3next",
            n_layer=48,
            n_expert=512,
            n_expert_used=10,
            rope_sections=(0, 0, 0, 0),
            **_REAL,
        ),  # type: ignore[arg-type]
        151936,
    ),
}
PRESET_SEED = 0


def preset_type(name: str, shape: tuple[int, ...]) -> Q:
    """A preset's type for the tensor ``name`` of numpy shape ``shape``."""
    if len(shape) == 1 or "ffn_gate_inp" in name or "ssm_conv1d" in name:
        return Q.F32
    if name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):
        return Q.Q4_K
    if name.endswith("ffn_down_exps.weight"):
        return Q.Q5_K
    if name == "output.weight":
        return Q.Q6_K
    if name == "token_embd.weight":
        return Q.Q4_K
    return Q.Q8_0


def preset_plan(s: HybridSpec, n_vocab: int) -> list[tuple[str, tuple[int, ...], float, float, Q]]:
    """Every tensor of a streamed file in file order: name, numpy shape, std, mean, type."""
    d = s.n_embd
    plan: Plan = [("token_embd.weight", (n_vocab, d), 1.0, 0.0)]
    for i in range(s.n_layer + s.n_mtp):
        plan += _layer_plan(s, i)
    plan += [("output_norm.weight", (d,), 0.1, 1.0),
             ("output.weight", (n_vocab, d), OUTPUT_GAIN * d**-0.5, 0.0)]  # fmt: skip
    return [(n, shape, std, mean, preset_type(n, shape)) for n, shape, std, mean in plan]


def _nbytes(shape: tuple[int, ...], qtype: Q) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise ValueError(f"rows of {shape[-1]} values do not fill {qtype.name} blocks of {block}")
    return int(np.prod(shape[:-1])) * shape[-1] // block * size


def _stream(name: str, shape: tuple[int, ...], std: float, mean: float, qtype: Q, seed: int,
            muted: np.ndarray):  # fmt: skip
    """The tensor's bytes in row chunks: floats (F32, or rounded to Q8_0) or random blocks of a
    K-quant with their scales set for the std (``synth``'s recipe; the output's muted rows
    scaled down). No echo structure: random blocks carry none."""
    from strata.engine.synth import CHUNK_ELEMENTS, MUTE_SCALE, _random_blocks, _unit_std

    if qtype is Q.F32:
        yield _draw(seed, name, shape, std, mean)
        return
    rng = _rng(seed, name)
    ne0, n_rows = shape[-1], int(np.prod(shape[:-1]))
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    step = max(1, CHUNK_ELEMENTS // ne0)
    for r0 in range(0, n_rows, step):
        rows = min(step, n_rows - r0)
        if qtype is Q.Q8_0:
            w = rng.standard_normal((rows, ne0), dtype=np.float32) * np.float32(std)
            yield gguf.quants.quantize(w + np.float32(mean), qtype)
            continue
        per_row = ne0 // block
        scale = rng.uniform(0.5, 1.5, rows * per_row).reshape(rows, per_row)
        dd = (std / _unit_std(qtype) * scale).astype(np.float32)  # dd: [R, blocks per row]
        if name == "output.weight":
            mute = muted[(muted >= r0) & (muted < r0 + rows)] - r0
            dd[mute] *= np.float32(MUTE_SCALE)
        yield _random_blocks(rng, qtype, rows * per_row, dd.reshape(-1))


def write_streamed(
    path: str | os.PathLike[str],
    spec: HybridSpec,
    n_vocab: int,
    seed: int = PRESET_SEED,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write ``spec`` with the presets' types (``preset_type``) to ``path`` (atomically), tensor
    by tensor in row chunks: files of tens of GiB never sit in memory. The vocabulary is the
    test one padded to ``n_vocab`` tokens, with Qwen3.5's template."""
    from dataclasses import replace

    path = Path(path)
    vocab = replace(pad_vocab(vocab_for("qwen3moe"), n_vocab), chat_template=QWEN35_TEMPLATE)
    plan = preset_plan(spec, n_vocab)
    sizes = [_nbytes(shape, qtype) for _, shape, *_, qtype in plan]
    total, done = sum(sizes), 0
    muted = muted_token_ids(vocab)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        w = gguf.GGUFWriter(tmp, spec.arch)
        _metadata(w, spec, Q.Q8_0, n_vocab, seed, gguf.LlamaFileType.MOSTLY_Q4_K_M)
        vocab.write(w)
        for (name, shape, *_, qtype), n in zip(plan, sizes, strict=True):
            byte_shape = (*shape[:-1], n // int(np.prod(shape[:-1])))
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), n, qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        assert w.fout is not None and len(w.fout) == 1
        fout = w.fout[0]
        for (name, shape, std, mean, qtype), n in zip(plan, sizes, strict=True):
            w.write_padding(fout, fout.tell())
            written = 0
            for chunk in _stream(name, shape, std, mean, qtype, seed, muted):
                chunk.tofile(fout)
                written += chunk.nbytes
                if progress is not None:
                    progress(done + written, total)
            if written != n:
                raise AssertionError(f"{name}: wrote {written} bytes, expected {n}")
            done += written
            w.write_padding(fout, written)
        w.close()
        tmp.chmod(0o644)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    log.info("wrote %s (%s, %.2f GiB)", path, spec.arch, total / 2**30)
    return path


def preset_bytes(name: str) -> int:
    """The tensor bytes of preset ``name`` (without writing it)."""
    spec, n_vocab = PRESETS[name]
    return sum(_nbytes(shape, qtype) for _, shape, *_, qtype in preset_plan(spec, n_vocab))


def ensure(
    name: str, cache_dir: str | os.PathLike[str], progress: Callable[[int, int], None] | None = None
) -> Path:
    """The preset ``name`` under ``cache_dir``, written once (atomically) and reused."""
    if name not in PRESETS:
        raise ValueError(f"unknown hybrid preset {name!r}; presets: {sorted(PRESETS)}")
    spec, n_vocab = PRESETS[name]
    knobs = (GENERATOR_VERSION, spec, n_vocab, PRESET_SEED, QWEN35_TEMPLATE, LAYER_GAIN,
             preset_plan(spec, n_vocab))  # fmt: skip
    key = hashlib.sha256(repr(knobs).encode()).hexdigest()[:10]
    path = Path(cache_dir) / f"{name}-g{GENERATOR_VERSION}-{key}.gguf"
    if path.is_file():
        return path
    return write_streamed(path, spec, n_vocab, PRESET_SEED, progress)
