"""An independent float64 forward pass for qwen3moe and Mixtral-style llama GGUF files.

The yardstick the engine is measured against. It imports nothing from ``strata.engine``: the file
is read with ``gguf.GGUFReader``, every tensor is dequantised with ``gguf.quants.dequantize`` and
the maths follows llama.cpp's graphs (``src/models/qwen3moe.cpp``, ``src/models/llama.cpp``,
``llm_graph_context::build_moe_ffn``) in float64, teacher-forced over the whole sequence with a
full causal mask and no K/V cache. It is itself checked against llama.cpp on the F32 files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import gguf
import numpy as np


@dataclass(frozen=True)
class RefConfig:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    n_expert: int
    n_expert_used: int
    rope_theta: float
    rms_eps: float

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def neox(self) -> bool:
        # llama.cpp's llama_model_rope_type: qwen3moe rotates halves (NEOX), llama rotates
        # adjacent pairs (NORM, GPT-J style).
        return self.arch == "qwen3moe"


@dataclass
class Routing:
    """What the routers chose over a sequence: per layer the top-k expert ids and the margin
    between the k-th and (k+1)-th router logit of each token."""

    n_expert: int
    topk: list[np.ndarray] = field(default_factory=list)  # per layer: [T, k] expert ids
    margins: list[np.ndarray] = field(default_factory=list)  # per layer: [T]

    @property
    def min_margin(self) -> float:
        return float(min(m.min() for m in self.margins))

    def unused_experts(self) -> dict[int, list[int]]:
        """Layer -> the experts no token of the sequence was routed to (empty when all were)."""
        out = {}
        for layer, ids in enumerate(self.topk):
            unused = sorted(set(range(self.n_expert)) - set(ids.ravel().tolist()))
            if unused:
                out[layer] = unused
        return out


class RefModel:
    """A GGUF file's weights as float64 arrays (numpy order: GGUF ``ne`` reversed).

    ``emulate_rounding`` rounds each matmul's input the way llama.cpp's CPU backend does before a
    quantised dot product (see ``round_activations``); off, the forward is exact float64. The
    emulation is approximate: values that float64 and llama.cpp's float32 put on different sides
    of a rounding boundary round differently. On the tiny Q4_K_M/Q6_K mixtral files it cut the
    max relative error against llama.cpp from ~7e-2 to ~5e-3, not to 1e-4; for F16/BF16 files it
    does not help at all (every F16 ulp is a boundary). A diagnostic, not a parity target.
    """

    def __init__(self, path: str | Path, emulate_rounding: bool = False) -> None:
        self.path = Path(path)
        self.emulate_rounding = emulate_rounding
        self.reader = gguf.GGUFReader(self.path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self._cache: dict[str, np.ndarray] = {}

    def meta(self, key: str, default: object = None) -> object:
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    @cached_property
    def config(self) -> RefConfig:
        arch = str(self.meta("general.architecture"))
        if arch not in ("qwen3moe", "llama"):
            raise ValueError(f"reference: unsupported architecture {arch!r}")

        def key(name: str, default: object = None) -> object:
            v = self.meta(f"{arch}.{name}", default)
            if v is None:
                raise ValueError(f"reference: {self.path} has no {arch}.{name}")
            return v

        n_embd, n_head = int(key("embedding_length")), int(key("attention.head_count"))
        head_dim = int(key("attention.key_length", n_embd // n_head))
        return RefConfig(
            arch=arch,
            n_layer=int(key("block_count")),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=int(key("attention.head_count_kv", n_head)),
            head_dim=head_dim,
            n_rot=int(key("rope.dimension_count", head_dim)),
            n_expert=int(key("expert_count")),
            n_expert_used=int(key("expert_used_count")),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rms_eps=float(key("attention.layer_norm_rms_epsilon")),
        )

    def w(self, name: str) -> np.ndarray:
        """The dequantised tensor ``name`` (``.weight`` implied) as float64."""
        if name not in self._cache:
            t = self.tensors[f"{name}.weight"]
            shape = tuple(int(n) for n in reversed(t.shape))
            x = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            self._cache[name] = np.asarray(x, dtype=np.float64).reshape(shape)
        return self._cache[name]

    def mm(self, x: np.ndarray, name: str) -> np.ndarray:
        """x @ W.T for the 2-D weight ``name``: x: [T, K] -> [T, N]."""
        if self.emulate_rounding:
            x = round_activations(x, self.tensors[f"{name}.weight"].tensor_type)
        return x @ self.w(name).T

    @cached_property
    def token_types(self) -> np.ndarray:
        return np.asarray(self.meta("tokenizer.ggml.token_type"), dtype=np.int64)

    def normal_token_ids(self) -> np.ndarray:
        """Ids of the vocabulary's NORMAL tokens (no control, byte, unused ones)."""
        return np.flatnonzero(self.token_types == int(gguf.TokenType.NORMAL))

    def test_sequence(self, n: int = 64, seed: int = 1234) -> list[int]:
        """A deterministic teacher-forcing sequence: BOS when the file adds one, then random
        NORMAL tokens."""
        rng = np.random.default_rng(seed)
        bos = self.meta("tokenizer.ggml.bos_token_id")
        head = [int(bos)] if self.meta("tokenizer.ggml.add_bos_token", False) else []
        body = rng.choice(self.normal_token_ids(), size=n - len(head), replace=True)
        return head + [int(t) for t in body]

    # --- the forward pass -------------------------------------------------------------------

    def forward(self, tokens: Sequence[int], routing: Routing | None = None) -> np.ndarray:
        """Logits [T, V] for every position of ``tokens`` (teacher-forced, causal)."""
        c = self.config
        x = self.w("token_embd")[np.asarray(tokens)]  # x: [T, D]
        for il in range(c.n_layer):
            x = x + self._attention(il, rms_norm(x, self.w(f"blk.{il}.attn_norm"), c.rms_eps))
            h = rms_norm(x, self.w(f"blk.{il}.ffn_norm"), c.rms_eps)  # h: [T, D]
            x = x + self._moe(il, h, routing)
        x = rms_norm(x, self.w("output_norm"), c.rms_eps)
        return self.mm(x, "output")  # [T, V]

    def forward_with_routing(self, tokens: Sequence[int]) -> tuple[np.ndarray, Routing]:
        routing = Routing(self.config.n_expert)
        return self.forward(tokens, routing), routing

    def _attention(self, il: int, h: np.ndarray) -> np.ndarray:
        c, p = self.config, f"blk.{il}"
        T = h.shape[0]
        q = self.mm(h, f"{p}.attn_q").reshape(T, c.n_head, c.head_dim)  # q: [T, H, Dh]
        k = self.mm(h, f"{p}.attn_k").reshape(T, c.n_head_kv, c.head_dim)  # k: [T, Hkv, Dh]
        v = self.mm(h, f"{p}.attn_v").reshape(T, c.n_head_kv, c.head_dim)  # v: [T, Hkv, Dh]
        if c.arch == "qwen3moe":  # per-head RMSNorm over head_dim, before RoPE
            q = rms_norm(q, self.w(f"{p}.attn_q_norm"), c.rms_eps)
            k = rms_norm(k, self.w(f"{p}.attn_k_norm"), c.rms_eps)
        pos = np.arange(T)
        q = rope(q, pos, c.n_rot, c.rope_theta, c.neox)
        k = rope(k, pos, c.n_rot, c.rope_theta, c.neox)
        group = c.n_head // c.n_head_kv  # query head h reads kv head h // group
        k = np.repeat(k, group, axis=1)  # k: [T, H, Dh]
        v = np.repeat(v, group, axis=1)  # v: [T, H, Dh]
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(c.head_dim)  # scores: [H, T, T]
        scores = np.where(np.tril(np.ones((T, T), dtype=bool)), scores, -np.inf)
        out = np.einsum("hqk,khd->qhd", softmax(scores), v).reshape(T, c.q_dim)  # out: [T, H*Dh]
        return self.mm(out, f"{p}.attn_output")  # [T, D]

    def _moe(self, il: int, h: np.ndarray, routing: Routing | None) -> np.ndarray:
        c, p = self.config, f"blk.{il}"
        logits = self.mm(h, f"{p}.ffn_gate_inp")  # logits: [T, E]
        probs = softmax(logits)
        order = np.argsort(-logits, axis=-1, kind="stable")
        ids = order[:, : c.n_expert_used]  # ids: [T, k]
        weights = np.take_along_axis(probs, ids, axis=-1)  # weights: [T, k]
        weights = weights / weights.sum(axis=-1, keepdims=True)
        if routing is not None:
            routing.topk.append(ids)
            routing.margins.append(_margins(logits, order, c.n_expert_used))
        gate, up = self.w(f"{p}.ffn_gate_exps"), self.w(f"{p}.ffn_up_exps")  # [E, F, D]
        down = self.w(f"{p}.ffn_down_exps")  # down: [E, D, F]
        h_gu = self._round(h, f"{p}.ffn_gate_exps")  # gate and up share their input and type
        out = np.zeros_like(h)  # out: [T, D]
        for e in np.unique(ids):
            rows, slot = np.nonzero(ids == e)
            he = h_gu[rows]  # he: [n, D]
            act = silu(he @ gate[e].T) * (he @ up[e].T)  # act: [n, F]
            act = self._round(act, f"{p}.ffn_down_exps")
            out[rows] += weights[rows, slot, None] * (act @ down[e].T)
        return out

    def _round(self, x: np.ndarray, name: str) -> np.ndarray:
        if not self.emulate_rounding:
            return x
        return round_activations(x, self.tensors[f"{name}.weight"].tensor_type)


def _margins(logits: np.ndarray, order: np.ndarray, k: int) -> np.ndarray:
    if k >= logits.shape[-1]:
        return np.full(logits.shape[0], np.inf)
    kth = np.take_along_axis(logits, order[:, k - 1 : k], axis=-1)[:, 0]
    nxt = np.take_along_axis(logits, order[:, k : k + 1], axis=-1)[:, 0]
    return kth - nxt


# The type llama.cpp's CPU backend converts a matmul's activations to, per weight type
# (ggml-cpu type_traits_cpu[...].vec_dot_type).
_VEC_DOT_Q8_0 = frozenset({gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0})
_VEC_DOT_Q8_K = frozenset(
    {
        gguf.GGMLQuantizationType.Q4_K,
        gguf.GGMLQuantizationType.Q5_K,
        gguf.GGMLQuantizationType.Q6_K,
        gguf.GGMLQuantizationType.IQ4_XS,
    }
)


def round_activations(x: np.ndarray, weight_type: gguf.GGMLQuantizationType) -> np.ndarray:
    """``x`` [..., K] as llama.cpp's CPU matmul sees it against a ``weight_type`` weight: F16 or
    BF16 for those weights, Q8_0 (32-blocks, fp16 scale) for Q8_0/Q4_0, Q8_K (256-blocks, fp32
    scale) for K-quants and IQ4_XS, unchanged for F32."""
    t = gguf.GGMLQuantizationType
    x32 = np.asarray(x, dtype=np.float32)
    if weight_type == t.F32:
        return x
    if weight_type == t.F16:
        return x32.astype(np.float16).astype(np.float64)
    if weight_type == t.BF16:
        return gguf.quants.dequantize(gguf.quants.quantize(x32, t.BF16), t.BF16).astype(np.float64)
    if weight_type in _VEC_DOT_Q8_0:
        return _round_q8_0(x32)
    if weight_type in _VEC_DOT_Q8_K:
        return _round_q8_k(x32)
    raise ValueError(f"reference: no activation rounding known for {weight_type.name}")


def _round_q8_0(x: np.ndarray) -> np.ndarray:
    b = x.reshape(-1, 32)  # b: [N, 32]
    amax = np.abs(b).max(axis=-1, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(b * inv)  # AVX2 path: multiply by 127/amax, round half to even
    d16 = d.astype(np.float16).astype(np.float64)
    return (q * d16).reshape(x.shape)


def _round_q8_k(x: np.ndarray) -> np.ndarray:
    b = x.reshape(-1, gguf.QK_K)  # b: [N, 256]
    arg = np.abs(b).argmax(axis=-1)[:, None]  # first index of the largest |x|
    mx = np.take_along_axis(b, arg, axis=-1)  # signed value of it
    with np.errstate(divide="ignore"):
        iscale = np.where(mx != 0, np.float32(-127) / mx, np.float32(0)).astype(np.float32)
    q = np.minimum(np.rint(b * iscale), 127)  # nearest_int rounds half to even
    with np.errstate(divide="ignore"):
        d = np.where(iscale != 0, np.float32(1) / iscale, np.float32(0)).astype(np.float32)
    return (q.astype(np.float64) * d).reshape(x.shape)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def rope_angles(pos: np.ndarray, n_rot: int, theta: float) -> np.ndarray:
    """Angles [T, n_rot/2] as ggml computes them: in float32, starting from the position and
    multiplying by base^(-2/n_rot) once per pair, so the reference carries ggml's rounding of the
    frequencies rather than exact ones."""
    scale = np.float32(np.float32(theta) ** np.float32(-2.0 / n_rot))
    ang = np.empty((len(pos), n_rot // 2), dtype=np.float32)  # ang: [T, n_rot/2]
    cur = pos.astype(np.float32)
    for i in range(n_rot // 2):
        ang[:, i] = cur
        cur = cur * scale
    return ang.astype(np.float64)


def rope(x: np.ndarray, pos: np.ndarray, n_rot: int, theta: float, neox: bool) -> np.ndarray:
    """Rotary embedding of x: [T, H, Dh] over its first n_rot dims; NEOX pairs (i, i + n_rot/2),
    NORM pairs (2i, 2i + 1)."""
    ang = rope_angles(pos, n_rot, theta)[:, None, :]  # ang: [T, 1, n_rot/2]
    cos, sin = np.cos(ang), np.sin(ang)
    out = x.copy()
    if neox:
        a, b = x[..., : n_rot // 2], x[..., n_rot // 2 : n_rot]
        out[..., : n_rot // 2] = a * cos - b * sin
        out[..., n_rot // 2 : n_rot] = a * sin + b * cos
    else:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * cos - b * sin
        out[..., 1:n_rot:2] = a * sin + b * cos
    return out


def reference_logits(path: str | Path, tokens: Sequence[int]) -> np.ndarray:
    """Logits [T, V] of the GGUF at ``path`` for ``tokens``."""
    return RefModel(path).forward(tokens)


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    """max|a - b| / max|b|: the issue's relative error, ``b`` being the yardstick."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def top1_agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Fraction of positions whose argmax agrees."""
    return float(np.mean(np.argmax(a, axis=-1) == np.argmax(b, axis=-1)))
