"""One module per GGUF ``general.architecture``, each exporting ``ModelArgs`` and ``Model``.

:func:`read_args` is what every ``ModelArgs.from_index`` calls: the hyper-parameters, checked
before anything is built — each required key present and a positive whole number, the numbers
consistent with each other, the blocks and the tensors the decoder reads of the shapes and types
those numbers imply — so a damaged or mislabelled file is a :class:`ModelLoadError` naming the
file and the value at load, never a shape error at the first request.
"""

from __future__ import annotations

import importlib
import math
from types import ModuleType

from strata.engine.errors import ModelLoadError, UnsupportedArchitecture
from strata.engine.gguf_index import GGUFIndex
from strata.engine.models.base import ModelArgs
from strata.engine.quant import SUPPORTED_TYPES

SUPPORTED = ("qwen3moe", "llama", "qwen35moe", "qwen3next", "gpt-oss")
# architectures only the reference operations run yet, and why (the GPU path says so and falls
# back to the reference path on the same device)
REFERENCE_ONLY: dict[str, str] = {}

# {arch}.KEY that every supported file must carry, each a whole number >= 1
REQUIRED_COUNTS = (
    "block_count",
    "embedding_length",
    "attention.head_count",
    "expert_count",
    "expert_used_count",
    "context_length",
)
OPTIONAL_COUNTS = ("attention.head_count_kv", "attention.key_length")


def architecture_module(arch: str) -> ModuleType:
    """The module for ``arch``; an architecture without one is an error that names it."""
    if arch not in SUPPORTED:
        raise UnsupportedArchitecture(
            f"architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED)})"
        )
    # a module name cannot hold the hyphen of "gpt-oss"
    return importlib.import_module(f"{__name__}.{arch.replace('-', '_')}")


def read_args(index: GGUFIndex, args_class: type[ModelArgs] = ModelArgs, **arch: object
              ) -> ModelArgs:  # fmt: skip
    """The decoder's hyper-parameters from ``index``, checked against each other and the file's
    tensors (``arch``: what the architecture fixes, passed on to ``args_class.read``)."""
    if not index.experts:
        raise ModelLoadError(
            f"{index.path}: {index.arch} file without routed experts (no blk.N.ffn_*_exps "
            "tensors): Strata serves MoE models"
        )
    _check_metadata(index)
    args = args_class.read(index, **arch)
    _check_blocks(index, args)
    _check_tensors(index, args)
    return args


def _check_metadata(index: GGUFIndex) -> None:
    for name in (*REQUIRED_COUNTS, *OPTIONAL_COUNTS):
        value = index.key(name, None if name in OPTIONAL_COUNTS else ...)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise _bad_key(index, name, value, "a whole number")
        if value is not None and value < 1:
            raise _bad_key(index, name, value, "at least 1")
    for name, default in (("attention.layer_norm_rms_epsilon", ...), ("rope.freq_base", None)):
        value = index.key(name, default)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _bad_key(index, name, value, "a number")
        if not math.isfinite(value) or value <= 0:
            raise _bad_key(index, name, value, "a finite number above 0")
    heads = index.key("attention.head_count")
    kv_heads = index.key("attention.head_count_kv", heads)
    if kv_heads > heads or heads % kv_heads:
        raise _bad_key(
            index, "attention.head_count_kv", kv_heads, f"a divisor of head_count {heads}"
        )
    experts = index.key("expert_count")
    used = index.key("expert_used_count")
    if used > experts:
        raise _bad_key(index, "expert_used_count", used, f"at most expert_count {experts}")


def _bad_key(index: GGUFIndex, name: str, value: object, expected: str) -> ModelLoadError:
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:60] + "…"
    return ModelLoadError(
        f"{index.path}: metadata key {index.arch}.{name} is {shown}, expected {expected}"
    )


def _check_blocks(index: GGUFIndex, args: ModelArgs) -> None:
    """The file's blocks are exactly ``blk.0`` to ``blk.{block_count - 1}``."""
    found = set()
    for name in index.tensors:
        parts = name.split(".")
        if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit():
            found.add(int(parts[1]))
    want = set(range(args.n_layer))
    if found != want:
        missing, extra = sorted(want - found), sorted(found - want)
        what = f"lacks blocks {_ranges(missing)}" if missing else ""
        what += " and " if missing and extra else ""
        what += f"has tensors of blocks {_ranges(extra)} beyond it" if extra else ""
        raise ModelLoadError(
            f"{index.path}: metadata key {index.arch}.block_count is {args.n_layer}, but the "
            f"file {what}"
        )


def _ranges(values: list[int]) -> str:
    if len(values) > 3 and values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    shown = ", ".join(str(v) for v in values[:8])
    return shown + (f", … ({len(values)} in all)" if len(values) > 8 else "")


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """The shape (torch order) of every tensor the decoder reads, from the hyper-parameters
    (an architecture whose layers differ says its own: ``args.tensor_shapes()``)."""
    own = getattr(args, "tensor_shapes", None)
    if own is not None:
        return own()
    d, q, kv = args.n_embd, args.n_head * args.head_dim, args.n_head_kv * args.head_dim
    e, ff = args.n_expert, args.n_ff_exp
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (args.vocab_size, d),
        "output_norm.weight": (d,),
        "output.weight": (args.vocab_size, d),
    }
    for i in range(args.n_layer):
        p = f"blk.{i}."
        shapes |= {
            p + "attn_norm.weight": (d,),
            p + "attn_q.weight": (q, d),
            p + "attn_k.weight": (kv, d),
            p + "attn_v.weight": (kv, d),
            p + "attn_output.weight": (d, q),
            p + "ffn_norm.weight": (d,),
            p + "ffn_gate_inp.weight": (e, d),
            p + "ffn_gate_exps.weight": (e, ff, d),
            p + "ffn_up_exps.weight": (e, ff, d),
            p + "ffn_down_exps.weight": (e, d, ff),
        }
        if args.qk_norm:
            shapes |= {p + "attn_q_norm.weight": (args.head_dim,),
                       p + "attn_k_norm.weight": (args.head_dim,)}  # fmt: skip
    return shapes


def _check_tensors(index: GGUFIndex, args: ModelArgs) -> None:
    vocab = index.metadata.get("tokenizer.ggml.tokens")
    if isinstance(vocab, list) and len(vocab) != args.vocab_size:
        raise ModelLoadError(
            f"{index.path}: tensor token_embd.weight has {args.vocab_size} rows, but the "
            f"vocabulary (tokenizer.ggml.tokens) has {len(vocab)} tokens"
        )
    optional = {"output.weight"}  # tied embeddings: llama.cpp then reuses token_embd
    for name, shape in expected_shapes(args).items():
        if name not in index.tensors:
            if name in optional:
                continue
            raise ModelLoadError(f"{index.path}: tensor {name} is missing")
        t = index.tensors[name]
        if t.shape != shape:
            raise ModelLoadError(
                f"{index.path}: tensor {name} has shape {t.shape}, but the metadata implies "
                f"{shape} ({_implied_by(name)})"
            )
        if t.qtype not in SUPPORTED_TYPES:
            supported = ", ".join(q.name for q in sorted(SUPPORTED_TYPES))
            raise ModelLoadError(
                f"{index.path}: tensor {name} is of type {t.qtype.name}, which Strata cannot "
                f"read (supported: {supported})"
            )


def _implied_by(name: str) -> str:
    if name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
        return "embedding_length, head_count and key_length"
    if name.endswith("norm.weight"):
        return "embedding_length"
    if "exps" in name or "gate_inp" in name:
        return "embedding_length, expert_count and the experts' feed-forward length"
    if "attn_q" in name or "attn_k" in name or "attn_v" in name or "attn_output" in name:
        return "embedding_length, head_count, head_count_kv and key_length"
    if name.startswith(("token_embd", "output.")):
        return "embedding_length and the vocabulary"
    return "embedding_length"
