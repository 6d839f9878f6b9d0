"""The runner owns all compute state — the model, its K/V cache, the thread count and, on a GPU,
the fast decoder with its buffers, expert tables, graph and prefill path — and runs the two kinds
of step: prefill chunks and decode steps (the fast decoder's where there is one, else the
reference path's). Every step boundary is a *safe point*, where the caller may resize the expert
cache or cancel."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from strata.engine.errors import ContextOverflow
from strata.engine.kv import KVCache
from strata.engine.layers.decoder import MoEDecoder

if TYPE_CHECKING:
    from strata.engine.fast_decode import FastDecoder
    from strata.engine.grammar import Constraint, TokenMask

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
        self.decoder: FastDecoder | None = None  # set by Engine.load on the GPU fast path
        self._token_mask: TokenMask | None = None  # built on the first constrained step

    @torch.inference_mode()
    def feed(self, ids: Sequence[int], safe_point: SafePoint | None = None) -> torch.Tensor:
        """Append ``ids`` after what the cache holds; return the logits of the last one: [V]
        float32, on the model's device (a fresh tensor: later steps do not change it)."""
        if not ids:
            raise ValueError("feed needs at least one token")
        start = len(self.tokens)
        if start + len(ids) > self.n_ctx:
            raise ContextOverflow(
                f"{start + len(ids)} tokens do not fit the context of {self.n_ctx} tokens"
            )
        if len(ids) == 1 and self.decoder is not None:
            logits = self.decoder.step(int(ids[0]), start).clone()
            self.tokens.append(int(ids[0]))
            self.kv.length = start + 1
            self.steps += 1
            if safe_point is not None:
                safe_point()
            return logits
        logits = None
        for i in range(0, len(ids), self.prefill_chunk):
            chunk = list(ids[i : i + self.prefill_chunk])
            logits = self._chunk(chunk, len(self.tokens), last_only=True)
            self.tokens.extend(chunk)
            self.steps += 1
            if safe_point is not None:
                safe_point()
        assert logits is not None
        self._prompt_done()
        return logits[-1].float()

    @torch.inference_mode()
    def mask_logits(self, logits: torch.Tensor, constraint: Constraint) -> torch.Tensor:
        """``logits`` [V] (a step's, on the model's device) with every token ``constraint``
        forbids at -inf, in place. The host computes the bitmask — while the device may still be
        running the step that produces ``logits``, as nothing here waits for it — and one copy
        and one masked fill on the device apply it. The decode graph is not involved: it is
        replayed as always, and the mask applies to the logits it leaves."""
        mask = self._mask_for(logits)
        if not constraint.fill(mask.host):
            return logits
        return mask.apply(logits)

    def _mask_for(self, logits: torch.Tensor) -> TokenMask:
        """The runner's token mask, sized for ``logits`` [V] on their device."""
        from strata.engine.grammar import TokenMask

        mask = self._token_mask
        if mask is None or mask.word.numel() != logits.numel():
            mask = self._token_mask = TokenMask(logits.numel(), logits.device)
        return mask

    def _prompt_done(self) -> None:
        """The prefill path counts a prompt's expert uses on the device: hand them over (one
        copy per prompt), so the profile and the hit rate see them."""
        if self.decoder is not None and self.decoder.prefill is not None:
            self.decoder.flush_usage()

    def _chunk(self, ids: Sequence[int], start: int, last_only: bool = False) -> torch.Tensor:
        """One prefill chunk at ``start``: on tensor cores where the fast decoder has a prefill
        path, else the reference forward. [T, V] logits (or [1, V])."""
        x = torch.tensor(list(ids), dtype=torch.long, device=self.model.device)
        prefill = self.decoder.prefill if self.decoder is not None else None
        if prefill is not None:
            return prefill.forward(x, start, last_only)
        return self.model.forward(x, start, self.kv, last_only=last_only)

    def prefill_path(self) -> str:
        """How prompt chunks run, for the log and the bench: a line of text."""
        if self.decoder is not None and self.decoder.prefill is not None:
            return "matrix products on tensor cores over the repacked weights, grouped by expert"
        return "reference path (dequantise, then multiply; one launch per expert matrix)"

    def can_look_ahead(self) -> bool:
        """Whether ``greedy`` can run steps ahead of the host now."""
        return self.decoder is not None and self.decoder.can_look_ahead

    def greedy(
        self,
        token: int,
        limit: int,
        safe_point: SafePoint | None = None,
        constraint: Constraint | None = None,
    ) -> Iterator[int]:
        """Greedy decoding from ``token``, one step ahead of the caller: each ``next()`` feeds the
        token given last (``token``, then each one yielded) and yields its argmax successor,
        while the step after it already runs. ``limit``: most tokens to yield. It ends early,
        leaving the last yielded token *unfed*, when steps can no longer run ahead (a shrink left
        an expert without a readable home, the context is full): the caller then goes on with
        ``feed``. A token it yields and the caller never asks past is never fed either. The same
        tokens as ``feed`` and an argmax would give, bit for bit (the same kernels).

        ``constraint`` (accepted up to ``token``; the caller accepts each token yielded before
        asking for the next): the argmax is over the tokens its grammar allows. Step n + 1 still
        runs while the caller handles token n; its mask, which needs token n, is computed
        meanwhile and applied to its logits on the device before its token is chosen. A grammar
        that fails ends the run with the token yielded last unfed (``feed`` then shows the
        error)."""
        dec = self.decoder
        if dec is None or not dec.can_look_ahead:
            raise RuntimeError("greedy look-ahead needs the fast decoder with every expert home")
        pos = len(self.tokens)
        if pos + 1 > self.n_ctx:
            raise ContextOverflow(f"{pos + 1} tokens do not fit the context of {self.n_ctx} tokens")
        masked = None if constraint is None else self._masked_pick(constraint, dec)
        pick = None if masked is None else masked()
        if constraint is not None and constraint.error is not None:
            return
        dec.begin(token, pos)
        dec.launch(0, pick)
        self._fed(token, dec)
        n = 0
        try:
            while True:
                ahead = n + 1 < limit and len(self.tokens) + 1 <= self.n_ctx and dec.can_look_ahead
                if ahead and masked is None:
                    dec.launch(n + 1)  # feeds step n's token: runs while the caller handles it
                elif ahead:
                    dec.run_ahead()  # its token waits for the mask that token n decides
                nxt = dec.result(n)
                if safe_point is not None:
                    safe_point()
                yield nxt
                if not ahead:
                    return
                if masked is not None:
                    pick = masked()
                    if constraint is not None and constraint.error is not None:
                        return
                    dec.finish(n + 1, pick)
                self._fed(nxt, dec)
                n += 1
        finally:
            dec.adapt()

    def _masked_pick(
        self, constraint: Constraint, dec: FastDecoder
    ) -> Callable[[], Callable[[torch.Tensor, int], None] | None]:
        """A function that computes the grammar's mask for the next step on the host and returns
        how to choose that step's token on the device (None when the step is free)."""
        from strata.engine.kernels.step import choose

        mask = self._mask_for(dec.logits)

        def pick(logits: torch.Tensor, slot: int) -> None:
            with torch.inference_mode():  # the decoder's buffers are inference tensors
                choose(mask.apply(logits), dec.tok, dec.ring, slot)

        return lambda: pick if constraint.fill(mask.host) else None

    def _fed(self, token: int, dec: FastDecoder) -> None:
        self.tokens.append(int(token))
        self.kv.length = len(self.tokens)
        self.steps += 1
        dec.accept()

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

    def flush_usage(self) -> None:
        """Expert uses counted on the device reach the provider's counts (the fast decoder)."""
        if self.decoder is not None:
            self.decoder.flush_usage()

    def close_decoder(self) -> None:
        if self.decoder is not None:
            self.decoder.close()
            self.decoder = None

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
            out.append(self._chunk(ids[pos : pos + n], pos))
            self.tokens.extend(ids[pos : pos + n])
            pos += n
        self._prompt_done()
        return torch.cat(out).float().cpu()
