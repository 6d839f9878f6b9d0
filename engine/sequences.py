"""The sequences the engine runs and the steps that advance them, over the stage runners
(``engine.step``): prompt chunks, decode steps, greedy runs one step ahead of the host. It keeps
the stages' K/V in step with each other (the same positions, the same kept conversations) and
makes room in them within each stage's budget. Every step boundary is a *safe point*, where the
caller may resize an expert cache or cancel."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from strata.engine.errors import ContextOverflow
from strata.engine.experts.cache import ExpertCache, ResizeResult
from strata.engine.kv import KVCache
from strata.engine.models.base import MoEModel
from strata.engine.recurrent import DEFAULT_CHECKPOINTS, RecurrentState
from strata.engine.step import Batch, StageRunner, run_stages

if TYPE_CHECKING:
    from strata.engine.gpu.runner import GpuRunner
    from strata.engine.grammar import Constraint, TokenMask
    from strata.engine.sampling import Sampler, TokenLogprob

log = logging.getLogger(__name__)

SafePoint = Callable[[], None]


class KVFull(ContextOverflow):
    """The K/V cannot get the pages a step needs: the VRAM budget is spent even with the expert
    cache at its core (the message has the numbers)."""


def new_kvs(
    model: MoEModel,
    n_ctx: int,
    kind: str,
    stage_options: Sequence[dict[str, Any]] | None = None,
    state_checkpoints: int = DEFAULT_CHECKPOINTS,
    **options: Any,
) -> list[KVCache]:
    """One K/V cache per stage, of its layers on its device (``stage_options``: per stage,
    ``KVCache`` keywords over ``options``, e.g. each stage's own arena factory); a hybrid's
    stages hold their DeltaNet layers' state beside the K/V, with up to ``state_checkpoints``
    checkpoints. Nothing leaks when one fails."""
    n = len(model.spans)
    per = list(stage_options) if stage_options is not None else [{}] * n
    if len(per) != n:
        raise ValueError(f"{len(per)} K/V option sets for {n} stages")
    shape = model.shape
    a, dn = shape.attention, shape.delta_net
    kvs: list[KVCache] = []
    try:
        for i, span in enumerate(model.spans):
            kw = {**options, **per[i]}
            dev = model.stage_devices[i]
            layers = model.kv_layers(span)
            n_kv = max(1, len(layers))  # (a stage of DeltaNet layers only: 1)
            if any(shape.windowed):  # the sliding window's layers keep their window's pages
                kw |= {"windowed": tuple(shape.windowed[j] for j in layers) or (False,),
                       "window": shape.window}  # fmt: skip
            kvs.append(KVCache(n_kv, n_ctx, a.n_head_kv, a.head_dim, kind, dev, **kw))
            if dn is not None:
                n_state = len(model.state_layers(span))
                kvs[-1].state = RecurrentState(dn, n_state, dev, state_checkpoints)
    except BaseException:
        for kv in kvs:
            kv.close()
        raise
    return kvs


class Sequences:
    """The active sequence (and the kept conversations in the K/V) over ``stages``, one runner
    per stage of ``model.spans``, in order."""

    def __init__(self, stages: Sequence[StageRunner], n_ctx: int, prefill_chunk: int) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {prefill_chunk}")
        if not stages:
            raise ValueError("no stage to run")
        self.stages: list[StageRunner] = list(stages)
        self.model = self.stages[0].model
        self.n_ctx = n_ctx
        self.prefill_chunk = prefill_chunk
        self.steps = 0  # forward calls so far (prefill chunks and decode steps)
        self._token_mask: TokenMask | None = None  # built on the first constrained step
        # after a request the cache grows into the room the K/V gave back at once; the daemon's
        # worker turns this off and grows it in pieces, between requests' steps (refill_slots)
        self.settle_grows = True
        # tokens that start a chat message (``<|im_start|>``): a hybrid's prompt chunks end
        # before each, and its recurrent state is checkpointed there for the next turn's reuse
        self.boundary_tokens: frozenset[int] = frozenset()
        self._boundaries: set[int] = set()
        self._reading = False  # the next feed reads the rest of a prompt (``start``)

    @property
    def gpu(self) -> GpuRunner | None:
        """The one GPU runner of a single-stage model (greedy look-ahead runs on it), or None."""
        only = self.stages[0]
        return only if len(self.stages) == 1 and only.on_gpu else None  # type: ignore[return-value]

    def replace_stages(self, stages: Sequence[StageRunner]) -> None:
        """Run on ``stages`` from now on (the same K/V and layers: the loader swaps reference
        runners for GPU ones, or back where the GPU kernels fail to build)."""
        assert [s.layers for s in stages] == [s.layers for s in self.stages]
        for new, old in zip(stages, self.stages, strict=True):
            new.budget, new.on_cache_resized = old.budget, old.on_cache_resized
        self.stages = list(stages)

    # -- the first stage's state, as callers that know one stage see it ---------------------

    @property
    def kv(self) -> KVCache:
        """The first stage's K/V (every stage's holds the same positions)."""
        return self.stages[0].kv

    @property
    def budget(self) -> int | None:
        """Bytes for the first stage's expert cache and K/V together (None: the K/V grows
        within its reservation, as the machine's memory allows; no cache then)."""
        return self.stages[0].budget

    @budget.setter
    def budget(self, value: int | None) -> None:
        self.stages[0].budget = value

    @property
    def on_cache_resized(self) -> Callable[[ResizeResult, str], None] | None:
        """Told of each resize of the first stage's cache that the K/V's growth makes."""
        return self.stages[0].on_cache_resized

    @on_cache_resized.setter
    def on_cache_resized(self, value: Callable[[ResizeResult, str], None] | None) -> None:
        self.stages[0].on_cache_resized = value

    @property
    def tokens(self) -> list[int]:
        """What the K/V cache holds for the active sequence, position by position."""
        return self.kv.tokens

    @property
    def cache(self) -> ExpertCache | None:
        return self.stages[0].cache

    def stage_of(self, layer: int) -> StageRunner:
        """The stage that owns ``layer``: its cache, K/V and device are the layer's."""
        return self.stages[self.model.stage_of[layer]]

    def close_kv(self) -> None:
        for stage in self.stages:
            stage.kv.close()

    # -- the K/V's room in the budget --------------------------------------------------------

    def budget_room(self, stage: int = 0) -> int | None:
        """Bytes the stage's budget leaves unmapped (None: no budget)."""
        return self.stages[stage].budget_room()

    def kv_limit_bytes(self, stage: int = 0) -> int | None:
        """The most the stage's K/V may map: its budget less its expert cache's core (None: no
        budget)."""
        return self.stages[stage].kv_limit_bytes()

    def tokens_that_fit(self) -> int:
        """The longest sequence whose K/V fits every stage's budget with each cache at its
        core (the sink page and whole chunks counted), at most the context."""
        return min(stage.tokens_that_fit(self.n_ctx) for stage in self.stages)

    def make_room(self, end: int, window_end: int | None = None) -> None:
        """Free pages for the active sequence up to position ``end`` in every stage's K/V (for
        the sliding window's layers up to ``window_end``, by default ``end``), at a
        safe point: from the stage's budget's unused room, then from the kept conversations
        (least recently used first; every stage drops the same one, so the stages keep the
        same conversations), then from the stage's expert cache's tail (its hottest experts
        move into colder slots first); :class:`KVFull` when even the cache at its core leaves
        too little."""
        for stage in self.stages:
            kv = stage.kv
            kv.book.resume()  # the active sequence grows: it is no longer idle, its pages stay
            while (short := kv.pages_short(end, window_end)) > 0:
                want = kv.bytes_to_map(short)
                room = stage.budget_room()
                if want and not kv.fixed and (room is None or room >= want):
                    if kv.grow(want):
                        continue
                if kv.book.kept:  # (never the active sequence: it is growing)
                    self._evict()
                    continue
                cache = stage.cache
                if want and room is not None and cache is not None:
                    slots = cache.slots_for_bytes(cache.arena.mapped_bytes - (want - room))
                    if slots < cache.n_slots:
                        result = cache.resize(slots)
                        if stage.on_cache_resized is not None:
                            stage.on_cache_resized(result, "K/V growth")
                        continue
                where = f" ({stage.describe()})" if len(self.stages) > 1 else ""
                raise kv_full(stage, end, short, where, self.tokens_that_fit())
        for stage in self.stages:
            stage.kv.prepare(end, window_end)

    def _evict(self) -> None:
        """Drop the least recently used kept conversation (or, none kept, the idle active
        sequence) from every stage's K/V."""
        for stage in self.stages:
            stage.kv.evict()

    def settle(self) -> int:
        """After a request: unmap each stage's K/V's free chunks above its pages in use, and
        (with ``settle_grows``) let each expert cache's tail grow into its budget's room at once
        (the hottest missing experts); returns the bytes the K/V gave back. The active sequence
        becomes idle: a budget cut before the next request may take its pages too."""
        freed = 0
        for stage in self.stages:
            stage.kv.book.park()
            freed += stage.kv.trim()
            slots = stage.refill_slots() if self.settle_grows else None
            if slots is not None and stage.cache is not None:
                result = stage.cache.resize(slots)
                if stage.on_cache_resized is not None:
                    stage.on_cache_resized(result, "room the K/V gave back")
        return freed

    def refill_slots(self, stage: int = 0) -> int | None:
        """The stage's cache's slots once its tail has taken the budget's room, when that is at
        least a chunk more than it has; else None."""
        return self.stages[stage].refill_slots()

    def fit_budget(self, budget: int, stage: int = 0) -> int:
        """A new budget for ``stage`` (the policy's target for its cache and K/V together): the
        kept conversations go first (least recently used; from every stage, which keep the same
        ones; then, between requests, the idle active sequence), the stage's K/V's free chunks
        are unmapped; then its cache takes what is left, never below its core. Returns the
        cache's slots to resize to (the caller resizes, in pieces). The active sequence of a
        running request keeps its pages."""
        st = self.stages[stage]
        st.budget = budget
        kv, cache = st.kv, st.cache
        assert cache is not None, "a budget needs an expert cache"
        while cache.mapped_bytes_for(cache.sizes.core_slots) + kv.mapped_bytes > budget:
            if not kv.book.evictable():
                break
            self._evict()
            kv.trim()
        kv.trim()
        return cache.slots_for_bytes(budget - kv.mapped_bytes)

    def _commit(self, tokens: list[int]) -> None:
        for stage in self.stages:
            stage.kv.commit(tokens)

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
        if len(ids) == 1 and self.decodes_on_gpu:
            self.make_room(start + 1)
            logits = run_stages(self.stages, Batch.decode(ids[0], start))[0].clone()
            self._commit([int(ids[0])])
            self.steps += 1
            if safe_point is not None:
                safe_point()
            return logits
        # the whole prompt's pages at once: a budget cut during its prefill (a lease) then
        # finds them in use, and waits or is refused, instead of failing the request midway
        # (the sliding window's layers: the first chunk's; each chunk recycles the pages behind)
        cuts = self._cuts(ids)
        self.make_room(start + len(ids), window_end=start + cuts[1])
        logits = None
        for i, j in itertools.pairwise(cuts):
            chunk = list(ids[i:j])
            logits = self._chunk(chunk, len(self.tokens), last_only=True)
            self._commit(chunk)
            self.steps += 1
            if j in self._boundaries or (j == len(ids) and len(ids) > 1):
                checkpoint_states(self.stages)  # the start of a message, the end of a prompt read
            if safe_point is not None:
                safe_point()
        assert logits is not None
        self._prompt_done()
        if len(ids) > 1 or self._reading:  # a prompt read: a sliding window keeps its end's
            for stage in self.stages:
                stage.kv.mark_read()
        self._reading = False
        return logits[-1].float()

    # -- the recurrent state (hybrid models) --------------------------------------------------

    @property
    def states(self) -> list[RecurrentState]:
        """Each stage's recurrent state (empty where the model has none)."""
        return [s.kv.state for s in self.stages if s.kv.state is not None]

    def _cuts(self, ids: Sequence[int]) -> list[int]:
        """Where a prompt's chunks end (``prompt_cuts``); a hybrid's checkpoints go at
        ``self._boundaries`` (the starts of messages)."""
        self._boundaries = set()
        if self.states and self.boundary_tokens:
            self._boundaries = {i for i, t in enumerate(ids) if i and t in self.boundary_tokens}
        return prompt_cuts(len(ids), self.prefill_chunk, self._boundaries)

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
        self.flush_usage()

    def _chunk(self, ids: Sequence[int], start: int, last_only: bool = False) -> torch.Tensor:
        """One prefill chunk at ``start`` through every stage. [T, V] logits (or [1, V])."""
        self.make_room(start + len(ids))
        return run_stages(self.stages, Batch.chunk(ids, start, last_only))

    @property
    def decodes_on_gpu(self) -> bool:
        """Whether decode steps run the GPU runners' kernels (else the reference operations,
        as prompt chunks)."""
        return all(s.on_gpu for s in self.stages)

    def decode_path(self) -> str:
        """How decode steps run, for the log and the bench: a line of text."""
        paths = [s.decode_path() for s in self.stages]
        if len(paths) > 1 and self.decodes_on_gpu:
            graphs = all(s.graph is not None for s in self.stages)  # type: ignore[attr-defined]
            n = len(paths)
            if graphs:
                return f"fused Triton kernels, one CUDA graph per stage per step ({n} stages)"
            reason = next(s.graph_reason for s in self.stages if s.graph is None)  # type: ignore[attr-defined]
            return f"fused Triton kernels over {n} stages, eager ({reason})"
        return paths[0]

    def prefill_path(self) -> str:
        """How prompt chunks run, for the log and the bench: a line of text."""
        return self.stages[0].prefill_path()

    def can_look_ahead(self) -> bool:
        """Whether ``greedy`` can run steps ahead of the host now (one GPU stage, every expert
        with a readable home)."""
        gpu = self.gpu
        return gpu is not None and gpu.can_look_ahead

    def greedy(
        self,
        token: int,
        limit: int,
        safe_point: SafePoint | None = None,
        constraint: Constraint | None = None,
    ) -> Iterator[int]:
        """``ahead`` with the step's own argmax choosing each token: the tokens alone."""
        for nxt, _ in self.ahead(token, limit, safe_point, constraint):
            yield nxt

    def ahead(
        self,
        token: int,
        limit: int,
        safe_point: SafePoint | None = None,
        constraint: Constraint | None = None,
        sampler: Sampler | None = None,
    ) -> Iterator[tuple[int, TokenLogprob | None]]:
        """Decoding from ``token``, one step ahead of the caller: each ``next()`` feeds the
        token given last (``token``, then each one yielded) and yields its successor (with its
        log-probabilities when ``sampler`` asks for them), while the step after it already runs.
        ``limit``: most tokens to yield. It ends early, leaving the last yielded token *unfed*,
        when steps can no longer run ahead (a shrink left an expert without a readable home, the
        context is full): the caller then goes on with ``feed``. A token it yields and the caller
        never asks past is never fed either.

        ``sampler`` (None, or one that is plain greedy: the step's argmax) chooses each token on
        the device right after its step (``gpu.sampled``), from the same state its host path
        draws with: the same tokens as ``feed`` and ``sampler.choose`` would give, bit for bit.

        ``constraint`` (accepted up to ``token``; the caller accepts each token yielded before
        asking for the next): only the tokens its grammar allows are chosen. Step n + 1 still
        runs while the caller handles token n; its mask, which needs token n, is computed
        meanwhile and applied to its logits on the device before its token is chosen. A grammar
        that fails ends the run with the token yielded last unfed (``feed`` then shows the
        error)."""
        dec = self.gpu
        if dec is None or not dec.can_look_ahead:
            raise RuntimeError("decoding ahead needs the GPU runner with every expert home")
        pos = len(self.tokens)
        if pos + 1 > self.n_ctx:
            raise ContextOverflow(f"{pos + 1} tokens do not fit the context of {self.n_ctx} tokens")
        sampled = sampler is not None and sampler.on_device
        if sampled:
            assert sampler is not None
            # the request draws from the state the steps use (a kept graph's) from now on
            state = sampler.state_on(dec.logits.device, dec.logits.numel())
            sampler.state = dec.sampled.bind(state, graphs=bool(dec.graphs))
        else:
            dec.sampled.unbind()
        chooser = self._chooser(constraint, dec, sampled)
        pick = chooser()
        if constraint is not None and constraint.error is not None:
            return
        self.make_room(pos + 1)
        dec.begin(token, pos)
        dec.launch(0, pick)
        self._fed(token, dec)
        masked = constraint is not None
        n = 0
        try:
            while True:
                ahead = (
                    n + 1 < limit
                    and len(self.tokens) + 1 <= self.n_ctx
                    and dec.can_look_ahead
                    and self._room_ahead(len(self.tokens) + 1)
                )
                if ahead and not masked:
                    dec.launch(n + 1, pick)  # feeds step n's token; runs while the caller has it
                elif ahead:
                    dec.run_ahead()  # its token waits for the mask that token n decides
                nxt = dec.result(n)
                if safe_point is not None:
                    safe_point()
                yield nxt
                if not ahead:
                    return
                if masked:
                    pick = chooser()
                    if constraint is not None and constraint.error is not None:
                        return
                    dec.finish(n + 1, pick)
                self._fed(nxt[0], dec)
                n += 1
        finally:
            dec.sampled.unbind()
            dec.adapt()

    def _chooser(
        self, constraint: Constraint | None, dec: GpuRunner, sampled: bool
    ) -> Callable[[], Callable[[torch.Tensor, int], None] | None]:
        """A function that computes the grammar's mask for the next step on the host (when there
        is a grammar) and returns how to choose that step's token on the device (None: the
        step's own argmax)."""
        from strata.engine.kernels.step import choose

        mask = None if constraint is None else self._mask_for(dec.logits)

        def pick(logits: torch.Tensor, slot: int, masks: bool) -> None:
            # as mask_logits: the mask's buffers may have been made there, in inference mode
            with torch.inference_mode():
                if masks:
                    assert mask is not None
                    mask.apply(logits)
                if sampled:
                    dec.sampled.run()
                else:
                    choose(logits, dec.buf.tok, dec.buf.ring, slot)

        def chooser() -> Callable[[torch.Tensor, int], None] | None:
            masks = mask is not None and constraint is not None and constraint.fill(mask.host)
            if not masks and not sampled:
                return None
            return lambda logits, slot: pick(logits, slot, masks)

        return chooser

    def _room_ahead(self, end: int) -> bool:
        """Pages up to ``end`` for a step run ahead; False (the look-ahead ends, and ``feed``
        meets the reason) where there is no room."""
        try:
            self.make_room(end)
        except KVFull:
            return False
        return True

    def _fed(self, token: int, dec: GpuRunner) -> None:
        self._commit([int(token)])
        self.steps += 1
        dec.accept()

    def start(self, prompt: Sequence[int]) -> list[int]:
        """Start from the longest prefix of ``prompt`` that a held conversation has in the K/V
        (the previous request's or a kept one's; at least its last token is recomputed, to get
        its logits); return the tokens still to feed."""
        held = [stage.kv.begin(list(prompt)) for stage in self.stages]
        # every stage's K/V holds the same conversations; a stage without sliding-window layers
        # may go on from a later position than one with them: all go back to the earliest
        while len(set(held)) > 1:
            held = [stage.kv.truncate(min(held)) for stage in self.stages]
        n = restore_states(self.stages, list(prompt[: held[0]]))
        self._reading = True
        return list(prompt[n:])

    def rewind(self, length: int) -> None:
        """Forget the active sequence from position ``length`` on. A hybrid's state goes back to
        its latest checkpoint at or before ``length`` and reads the tokens up to it again, one
        step per token as decoding read them (so a rewind into generated text restores the
        state bit for bit); so does a sliding window whose pages before ``length`` went back."""
        tokens = self.tokens[:length]
        kept = min(stage.kv.truncate(length) for stage in self.stages)
        for stage in self.stages:  # a window that cannot go on from ``length`` goes back
            stage.kv.truncate(kept)
        n = restore_states(self.stages, tokens[:kept])
        for t in tokens[n:]:
            self.feed([t])

    def flush_usage(self) -> list:
        """Expert uses counted on the device reach the providers' counts; the keys used."""
        used = []
        for stage in self.stages:
            used += stage.flush_usage()
        return used

    def adapt(self) -> int:
        """At a safe point: each stage's cache follows the use counted so far."""
        done = 0
        for stage in self.stages:
            with stage.on():
                done += stage.adapt()
        return done

    def close(self) -> None:
        """Let every stage's device state and K/V go (the providers are their owner's)."""
        for stage in self.stages:
            stage.close()
        self.close_kv()

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
            self._commit(list(ids[pos : pos + n]))
            pos += n
        self._prompt_done()
        return torch.cat(out).float().cpu()


def kv_full(stage: StageRunner, end: int, short: int, where: str, fits: int) -> KVFull:
    """Why ``stage``'s K/V cannot get the ``short`` pages for positions up to ``end``."""
    kv, MiB = stage.kv, 2**20
    need = short * kv.page_bytes
    if stage.budget is None or not kv.bytes_to_map(short):
        return KVFull(
            f"{end} positions need {short} more K/V pages ({need / MiB:,.0f} MiB) than its "
            f"reservation of {kv.arena.reserved_bytes / MiB:,.0f} MiB or the memory holds{where}"
        )
    limit = stage.kv_limit_bytes()
    assert limit is not None
    return KVFull(
        f"{end} positions need {need / MiB:,.0f} MiB more K/V than the VRAM budget "
        f"leaves{where}: {stage.budget / MiB:,.0f} MiB for the expert cache and the K/V, "
        f"of which the cache's core keeps {(stage.budget - limit) / MiB:,.0f} MiB and the "
        f"K/V holds {kv.mapped_bytes / MiB:,.0f} MiB; at most {fits} tokens fit"
    )


# -- a hybrid's recurrent state over the stages ------------------------------------------------


def prompt_cuts(n: int, chunk: int, boundaries: set[int]) -> list[int]:
    """Where the chunks of an ``n``-token prompt start and end: every ``chunk`` tokens, and at
    each of ``boundaries`` (a checkpoint of the recurrent state goes there)."""
    cuts, i = [0], 0
    for b in [*sorted(boundaries), n]:
        while b - i > chunk:
            i += chunk
            cuts.append(i)
        if b > i:
            cuts.append(b)
            i = b
    return cuts


def checkpoint_states(stages: Sequence[StageRunner]) -> None:
    """Keep a copy of each stage's state after the tokens read so far, within the stage's
    budget (the oldest checkpoint makes room; none taken where even that is not enough)."""
    for stage in stages:
        state = stage.kv.state
        if state is None:
            continue
        room = stage.budget_room()
        full = len(state.checkpoints) >= state.max_checkpoints
        if room is not None and room < state.state_bytes and not full:
            if not state.checkpoints:
                log.debug("no room in the budget for a state checkpoint")
                return
            state.checkpoints.pop(0)
        state.checkpoint()


def restore_states(stages: Sequence[StageRunner], prefix: list[int]) -> int:
    """A hybrid's states set to the longest prefix of ``prefix`` they (or a checkpoint) hold,
    the K/V cut to the same length; returns it (``len(prefix)`` without a state)."""
    states = [s.kv.state for s in stages if s.kv.state is not None]
    if not states:
        return len(prefix)
    n = min(state.restore(prefix) for state in states)
    if any(len(state.tokens) != n for state in states):  # a checkpoint one stage lost
        n = min(state.restore(prefix[:n]) for state in states)
    if n < len(prefix):
        for stage in stages:
            stage.kv.truncate(n)
    return n
