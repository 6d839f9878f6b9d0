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

import logging
import os
import tempfile
import zlib
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
from strata.engine.vocab import Vocab

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


def _layer_tensors(s: HybridSpec, i: int, seed: int) -> dict[str, np.ndarray]:
    """Layer ``i``'s tensors (numpy order: GGUF ``ne`` reversed), every one float32."""
    d, p = s.n_embd, f"blk.{i}."
    t: dict[str, np.ndarray] = {}

    def w(name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> None:
        t[p + name] = _normal(seed, p + name, shape, std, mean)

    w("attn_norm.weight", (d,), 0.1, 1.0)
    w("post_attention_norm.weight", (d,), 0.1, 1.0)
    if s.is_recurrent(i):
        hv, hk = s.ssm_dt_rank, s.ssm_n_group
        qkv = (s.conv_dim, d)
        if s.arch == "qwen3next" and s.extra.get("legacy_ssm_in"):
            w("ssm_in.weight", (2 * s.key_dim + 2 * s.value_dim, d), d**-0.5)
        else:
            w("attn_qkv.weight", qkv, d**-0.5)
            w("attn_gate.weight", (s.value_dim, d), d**-0.5)
        w("ssm_conv1d.weight", (s.conv_dim, s.ssm_d_conv), 0.5)
        w("ssm_dt.bias", (hv,), 0.3)
        rate = _rng(seed, p + "ssm_a").uniform(0.05, 1.0, hv).astype(np.float32)
        t[p + "ssm_a"] = -rate  # the converter stores -exp(A_log)
        if s.arch == "qwen3next":
            w("ssm_ba.weight", (2 * hv, d), d**-0.5)  # per k head: its β rows, then its α rows
        else:
            w("ssm_beta.weight", (hv, d), d**-0.5)
            w("ssm_alpha.weight", (hv, d), d**-0.5)
        del hk
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


def _metadata(w: gguf.GGUFWriter, s: HybridSpec, qtype: Q, n_vocab: int, seed: int) -> None:
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
    w.add_file_type(by_type[qtype])
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
