"""The runner owns all compute state — the model, its K/V cache, the thread count — and runs the
two kinds of step: prefill chunks and decode steps. Every step boundary is a *safe point*, where the
caller may resize the expert cache or cancel."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from strata.engine.errors import ContextOverflow
from strata.engine.kv import KVCache
from strata.engine.layers.decoder import MoEDecoder

log = logging.getLogger(__name__)

SafePoint = Callable[[], None]


class Runner:
    def __init__(self, model: MoEDecoder, n_ctx: int, kv_kind: str, prefill_chunk: int) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {prefill_chunk}")
        self.model = model
        self.n_ctx = n_ctx
        self.prefill_chunk = prefill_chunk
        self.kv: KVCache = model.new_kv(n_ctx, kv_kind)
        self.tokens: list[int] = []  # what the K/V cache holds, position by position
        self.steps = 0  # forward calls so far (prefill chunks and decode steps)

    @torch.inference_mode()
    def feed(self, ids: Sequence[int], safe_point: SafePoint | None = None) -> torch.Tensor:
        """Append ``ids`` after what the cache holds; return the logits of the last one: [V]."""
        if not ids:
            raise ValueError("feed needs at least one token")
        start = len(self.tokens)
        if start + len(ids) > self.n_ctx:
            raise ContextOverflow(
                f"{start + len(ids)} tokens do not fit the context of {self.n_ctx} tokens"
            )
        logits = None
        for i in range(0, len(ids), self.prefill_chunk):
            chunk = list(ids[i : i + self.prefill_chunk])
            x = torch.tensor(chunk, dtype=torch.long, device=self.model.device)
            logits = self.model.forward(x, len(self.tokens), self.kv, last_only=True)
            self.tokens.extend(chunk)
            self.steps += 1
            if safe_point is not None:
                safe_point()
        assert logits is not None
        return logits[-1].float().cpu()

    def start(self, prompt: Sequence[int]) -> list[int]:
        """Keep the longest cached prefix of ``prompt`` (at least its last token is recomputed, to
        get its logits); return the tokens still to feed."""
        common = 0
        limit = min(len(prompt) - 1, len(self.tokens))
        while common < limit and self.tokens[common] == prompt[common]:
            common += 1
        self.rewind(common)
        return list(prompt[common:])

    def rewind(self, length: int) -> None:
        del self.tokens[length:]
        self.kv.truncate(length)

    @torch.inference_mode()
    def logits_all(self, ids: Sequence[int], chunks: Sequence[int] | None = None) -> torch.Tensor:
        """Teacher-forced logits of every position, from an empty cache: [T, V]. ``chunks`` gives
        uneven chunk sizes (tests compare chunked, incremental and one-shot evaluation)."""
        self.rewind(0)
        sizes = list(chunks) if chunks else [len(ids)]
        if sum(sizes) != len(ids):
            raise ValueError(f"chunk sizes {sizes} do not add up to {len(ids)} tokens")
        out, pos = [], 0
        for n in sizes:
            x = torch.tensor(list(ids[pos : pos + n]), dtype=torch.long, device=self.model.device)
            out.append(self.model.forward(x, pos, self.kv))
            self.tokens.extend(ids[pos : pos + n])
            pos += n
        return torch.cat(out).float().cpu()
