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


class NearTies:
    """The reference path's routing choices on a near-tie, recorded to be imposed on the fast
    path. A prompt row whose k-th and (k+1)-th router logits lie within ``margin`` at some
    layer may choose the other expert under the fast path's float16 products (they move a
    router logit by ~1e-3); that row is then another function of its input, and every later
    row that attends to it sees its other key and value (the tiny gpt-oss files: such a flip
    moved the next rows' logits by 4e-2). ``pin`` makes the fast path's chunks choose the
    reference's experts on exactly those rows and layers (the weights from its own logits), so
    the comparison measures the products' rounding at every row and no row is left out."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, chunks: list[int], margin: float) -> None:
        from strata.engine.ops import reference as ops
        from strata.engine.weights import linear

        self.chunks, self.pinned = chunks, 0
        self.calls: list[dict[int, torch.Tensor]] = []  # a route call's tied rows -> their ids
        real = ops.route

        def recording(x, router, spec, bias=None):
            logits = linear(x, router) + (0 if bias is None else bias)  # [T, E]
            top = torch.topk(logits.float(), spec.n_used + 1, dim=-1)
            close = (top.values[:, -2] - top.values[:, -1]).abs() < margin
            tied = torch.nonzero(close).flatten().tolist()
            self.calls.append({i: top.indices[i, :-1].cpu() for i in tied})
            return real(x, router, spec, bias)

        monkeypatch.setattr(ops, "route", recording)

    def rows(self, n_layer: int) -> set[int]:
        """The prompt rows that routed on a near-tie at some layer (the chunks' calls are
        n_layer each, in order)."""
        out: set[int] = set()
        for c, tied in enumerate(self.calls):
            at = sum(self.chunks[: c // n_layer])  # the chunk's first row
            out.update(at + i for i in tied)
        return out

    def pin(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The GPU path's chunk routing (``gpu.oss.route``) from here on takes the recorded
        ids on the recorded rows, call by call in the reference's order."""
        from strata.engine.gpu import oss

        real, calls = oss.route, iter(self.calls)

        def pinned(logits, k, spec):
            wts, ids = real(logits, k, spec)
            tied = next(calls, None)
            assert tied is not None, "the fast path routed more chunks than the reference"
            if not tied:
                return wts, ids
            ids = ids.clone()
            for i, want in tied.items():
                ids[i] = want.to(ids.device)
            self.pinned += 1
            chosen = logits.gather(-1, ids)
            if spec.softmax_after_topk:
                return torch.softmax(chosen, dim=-1), ids
            probs = torch.softmax(logits, dim=-1).gather(-1, ids)
            return (probs / probs.sum(dim=-1, keepdim=True) if spec.norm_topk else probs), ids

        monkeypatch.setattr(oss, "route", pinned)

    def check_pinned(self) -> None:
        """Every recorded call with a near-tie was pinned (the fast path routed through
        ``gpu.oss.route`` as often as the reference did)."""
        assert self.pinned == sum(1 for tied in self.calls if tied), (
            f"{self.pinned} chunk routings pinned of {sum(1 for t in self.calls if t)} near-ties"
        )
