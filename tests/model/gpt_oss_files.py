"""The tiny gpt-oss test files (``strata.engine.synth_gpt_oss``), each written once per module:
F32 and MXFP4_MOE from the writer, Q4_K_M and Q3_K_M from llama.cpp's own quantiser on the F32
file. The shapes: 5 layers (more than the window pattern's period of 2), a window of 16
positions, 6 query heads of 64 over 2 K/V heads, n_embd 160 and expert rows of 96 (neither a
multiple of 256: llama.cpp's K-quant recipes fall back to 32-element types there), YaRN over an
original context of 256 (its ramp crosses the rotation pairs). The MXFP4_MOE file is the bench
presets' writer on these shapes, its vocabulary padded with unused tokens as theirs is."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny_models import LlamaCppMissing, llama_cpp_quantize, load_llama_cpp

from strata.engine.synth_gpt_oss import GptOssSpec, write_gpt_oss

SPEC = GptOssSpec(n_layer=5, n_embd=160, n_head=6, n_head_kv=2, n_ff_exp=96, sliding_window=16)
WRITTEN = ("F32", "Q8_0", "MXFP4_MOE")


class GptOssFiles:
    def __init__(self, root: Path, spec: GptOssSpec = SPEC) -> None:
        self.root, self.spec = root, spec
        self._paths: dict[str, Path] = {}

    def path(self, kind: str = "F32") -> Path:
        if kind not in self._paths:
            self._paths[kind] = self._build(kind)
        return self._paths[kind]

    def _build(self, kind: str) -> Path:
        dst = self.root / f"tiny-gpt-oss-{kind}.gguf"
        if kind == "MXFP4_MOE":
            return write_gpt_oss(dst, replace(self.spec, vocab_size=3000), kind)
        if kind in WRITTEN:
            return write_gpt_oss(dst, self.spec, kind)
        try:
            llama_cpp = load_llama_cpp()
        except ImportError as e:
            raise LlamaCppMissing(f"{dst.name} needs llama.cpp's quantiser: {e}") from e
        return llama_cpp_quantize(llama_cpp, self.path("F32"), dst, kind)


def near_ties(monkeypatch: pytest.MonkeyPatch, n_layer: int, chunks: list[int],
               margin: float) -> set[int]:  # fmt: skip
    """Install a recorder of the reference path's routing; returns the set it fills with the
    prompt rows whose k-th and (k+1)-th router logits lie within ``margin`` at some layer."""
    from strata.engine.ops import reference as ops
    from strata.engine.weights import linear

    real, rows, calls = ops.route, set(), [0]

    def recording(x, router, spec, bias=None):
        logits = linear(x, router) + (0 if bias is None else bias)  # [T, E]
        top = torch.topk(logits.float(), spec.n_used + 1, dim=-1).values
        at = sum(chunks[: calls[0] // n_layer])  # the chunk's first row
        calls[0] += 1
        close = (top[:, -2] - top[:, -1]).abs() < margin
        rows.update(at + int(i) for i in torch.nonzero(close).flatten())
        return real(x, router, spec, bias)

    monkeypatch.setattr(ops, "route", recording)
    return rows
