"""The engine's one public entry point: ``Engine.load`` (the steps are ``engine.loader``'s),
prompts and chat templates, the budget and the K/V's status, and ``generate`` (one
``engine.generation.Generation`` run to its end: prefill and decode with sampling, stop tokens
and strings, a streaming callback, and cancellation at every safe point; optionally a grammar
constrains the tokens, ``engine.grammar``, and each token's log-probability is reported).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from strata.engine import loader
from strata.engine.chat_template import ChatTemplate
from strata.engine.errors import ContextOverflow, EngineError
from strata.engine.experts.cache import ExpertCache, model_key
from strata.engine.experts.profile import UsageProfile
from strata.engine.experts.provider import ExpertProvider
from strata.engine.generation import Generation, GenerationResult, TokenLogprob
from strata.engine.gguf_index import GGUFIndex
from strata.engine.grammar import Constraint, Grammars
from strata.engine.loader import ArenaFactoryArg, FreeVramArg, Progress
from strata.engine.options import EngineOptions
from strata.engine.params import SamplingParams
from strata.engine.sequences import SafePoint, Sequences
from strata.engine.status import EngineStatus, stage_status
from strata.engine.step import StageRunner
from strata.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        index: GGUFIndex,
        tokenizer: Tokenizer,
        template: ChatTemplate | None,
        sequences: Sequences,
        profile_file: Path | None = None,
    ) -> None:
        self.index = index
        self.tokenizer = tokenizer
        self.template = template
        self.sequences = sequences
        self.profile_file = profile_file
        self.grammars = Grammars(tokenizer, sequences.model.shape.vocab_size)
        self._tools_rendered: bool | None = None

    def save_profile(self) -> None:
        """Merge this run's expert usage (every stage's) into the saved profile (atomically;
        errors are logged, never fatal: a profile only speeds up the next start)."""
        self.sequences.flush_usage()
        providers = [stage.provider for stage in self.sequences.stages]
        if self.profile_file is None or not any(p.totals for p in providers):
            return
        key = model_key(self.index)
        profile = UsageProfile.load(self.profile_file, key)
        # the stages' layers are disjoint: their counts never overlap
        profile.merge({k: float(v) for p in providers for k, v in p.totals.items()})
        try:
            profile.save(self.profile_file)
        except OSError as e:
            log.warning("could not save the expert usage profile %s: %s", self.profile_file, e)
            return
        for p in providers:
            p.totals.clear()
        log.debug("saved the expert usage profile %s", self.profile_file)

    @property
    def stages(self) -> list[StageRunner]:
        """The stages, in layer order (one without ``devices``)."""
        return self.sequences.stages

    def _stage(self, stage: int) -> StageRunner:
        n = len(self.sequences.stages)
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < n:
            raise EngineError(f"stage={stage!r}: the engine has stages 0 to {n - 1}")
        return self.sequences.stages[stage]

    @property
    def provider(self) -> ExpertProvider:
        """The first stage's expert provider (the only one without ``devices``)."""
        return self.sequences.stages[0].provider

    @property
    def cache(self) -> ExpertCache | None:
        return self.sequences.stages[0].cache

    def decode_path(self) -> str:
        """How decode steps run, for the log and the bench: a line of text."""
        return self.sequences.decode_path()

    def prefill_path(self) -> str:
        """How prompt chunks run: a line of text."""
        return self.sequences.prefill_path()

    def close(self) -> None:
        """Give every stage's memory back: its cache's (the arena is unmapped and released),
        the pinned staging buffers of expert misses, and its K/V's."""
        loader.release(self.sequences)

    @property
    def model_id(self) -> str:
        return self.index.name

    @property
    def n_ctx(self) -> int:
        return self.sequences.n_ctx

    @classmethod
    def load(
        cls,
        path: str | Path,
        options: EngineOptions | None = None,
        state_dir: Path | None = None,
        progress: Progress | None = None,
        arena_factory: ArenaFactoryArg = None,
        free_vram: FreeVramArg = None,
    ) -> Engine:
        """Open ``path``; a reason it cannot serve is a :class:`ModelLoadError` naming the file.
        ``free_vram()``: the bytes free on the device the cache lives on, read when the cache is
        sized (the daemon passes its monitor's reading); where it gives None, CUDA's on a GPU.
        With ``options.devices``, ``arena_factory`` and ``free_vram`` are one callable for
        every stage or a sequence of one per device (stage i gets element i). The steps are
        ``loader.load``'s."""
        got = loader.load(path, options, state_dir, progress, arena_factory, free_vram)
        return cls(got.index, got.tokenizer, got.template, got.sequences, got.profile_file)

    # -- prompts --------------------------------------------------------------------------------

    def encode_prompt(self, text: str) -> list[int]:
        """A raw completion prompt: BOS as the file's ``add_bos_token`` says."""
        return self.tokenizer.encode(text)

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        variables: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text; ``tools`` (OpenAI's tool objects) go to the template as ``tools``,
        as transformers and llama.cpp pass them; ``variables`` (``enable_thinking``,
        ``reasoning_effort``, a request's ``chat_template_kwargs``) become template variables."""
        if self.template is None:
            raise EngineError(
                f"{self.index.path.name} has no chat template (tokenizer.chat_template)"
            )
        extra = dict(variables or {})
        if tools:
            extra["tools"] = list(tools)
        return self.template.render(list(messages), add_generation_prompt=True, **extra)

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        variables: dict[str, Any] | None = None,
    ) -> list[int]:
        # The template writes BOS itself where the model wants one; encode never doubles it.
        return self.tokenizer.encode(self.render_chat(messages, tools, variables))

    @property
    def template_renders_tools(self) -> bool:
        """Whether the chat template writes the tools it is given into the prompt (a probe
        tool's name shows up in the rendering), as llama.cpp finds out."""
        if self._tools_rendered is None:
            probe = [{"type": "function", "function": {
                "name": "strata_probe_tool", "description": "probe",
                "parameters": {"type": "object", "properties": {}}}}]  # fmt: skip
            try:
                text = self.render_chat([{"role": "user", "content": "hi"}], probe)
            except EngineError:
                text = ""
            self._tools_rendered = "strata_probe_tool" in text
        return self._tools_rendered

    def check_fits(self, n_prompt: int, max_tokens: int) -> None:
        """A prompt and ``max_tokens`` beyond the context, or a prompt whose K/V cannot fit the
        VRAM budget even with the expert cache at its core, is a :class:`ContextOverflow`
        naming the numbers. (Generated tokens the budget has no room for end the generation,
        finish reason ``length``.)"""
        if n_prompt + max_tokens > self.n_ctx:
            raise ContextOverflow(
                f"prompt of {n_prompt} tokens + max_tokens {max_tokens} = "
                f"{n_prompt + max_tokens} exceeds the context length of {self.n_ctx} tokens"
            )
        fit = self.sequences.tokens_that_fit()
        if n_prompt + 1 > fit:
            seqs, MiB = self.sequences, loader.MiB
            # the stage whose budget fits the fewest tokens (the only one without stages)
            st = min(seqs.stages, key=lambda s: s.tokens_that_fit(seqs.n_ctx))
            limit = st.kv_limit_bytes() or 0
            need = st.kv.context_bytes(n_prompt + 1)
            where = f" of {st.describe()}" if len(seqs.stages) > 1 else ""
            raise ContextOverflow(
                f"prompt of {n_prompt} tokens needs {need / MiB:,.0f} MiB of K/V{where}; the "
                f"VRAM budget of {(st.budget or 0) / MiB:,.0f} MiB for the expert cache and the "
                f"K/V leaves {max(0, limit) / MiB:,.0f} MiB with the cache at its core: at most "
                f"{max(0, fit - 1)} prompt tokens fit"
            )

    def set_budget(self, budget: int, stage: int = 0) -> int:
        """At a safe point: the bytes ``stage``'s expert cache and K/V may hold together (the
        daemon's policy for that stage's device). The K/V's kept conversations go first;
        returns the slots that stage's cache should have (the caller resizes
        ``stages[stage].cache``)."""
        st = self._stage(stage)
        if st.cache is None:
            raise EngineError(f"stage {stage} has no expert cache: a budget needs one")
        return self.sequences.fit_budget(budget, stage)

    def kv_status(self, stage: int = 0) -> dict[str, int | list[int]]:
        """``stage``'s K/V and its share of that stage's budget, for the status and the
        metrics (``fits_tokens``: what fits every stage)."""
        st = self._stage(stage)
        out = st.kv.status()
        out["budget_bytes"] = st.budget if st.budget is not None else -1
        out["fits_tokens"] = self.sequences.tokens_that_fit()
        return out

    def status(self) -> EngineStatus:
        """Every stage's cache, host tier, K/V and fetches, and how steps run (the daemon's
        status is made from it)."""
        seqs = self.sequences
        return EngineStatus(
            model_id=self.model_id,
            n_ctx=self.n_ctx,
            stages=tuple(stage_status(stage) for stage in seqs.stages),
            fits_tokens=seqs.tokens_that_fit(),
            kv_tokens=len(seqs.tokens),
            tokenizer_cache_words=self.tokenizer.cache_words_limit,
            decode_path=seqs.decode_path(),
            prefill_path=seqs.prefill_path(),
            decodes_on_gpu=seqs.decodes_on_gpu,
        )

    # -- generation -----------------------------------------------------------------------------

    def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        on_text: Callable[[str], None] | None = None,
        cancelled: Callable[[], bool] | None = None,
        safe_point: SafePoint | None = None,
        *,
        constraint: Constraint | None = None,
        show_special: frozenset[int] = frozenset(),
        on_logprobs: Callable[[list[TokenLogprob]], None] | None = None,
        on_token: Callable[[], None] | None = None,
    ) -> GenerationResult:
        """Generate up to ``params.max_tokens`` tokens after ``prompt``.

        ``on_text`` receives text as it becomes final (never text that a stop string may still
        swallow); ``cancelled`` is polled at every safe point — between the prompt's chunks too —
        and ends the generation with ``finish_reason="cancelled"``; ``safe_point`` runs between
        steps (cache resizes).

        ``constraint``: only tokens its grammar allows are sampled (the mask is applied where the
        logits are, before every sampling filter); the generation ends (``stop``) as soon as the
        grammar is complete and nothing but an end token may follow, and ``max_tokens`` ending it
        before that is ``length``, with the output incomplete. ``show_special``: special tokens
        whose text the output keeps (a tool-call marker a parser needs). With
        ``params.logprobs``, each token's :class:`TokenLogprob` goes into ``result.logprobs``
        and, streaming, to ``on_logprobs`` just before the text that follows it. ``on_token``
        runs once per generated token, as it is generated (a counter for the live speed).
        """
        if not prompt:
            raise EngineError("the prompt is empty: it needs at least one token")
        self.check_fits(len(prompt), params.max_tokens)
        generation = Generation(
            self.sequences, self.tokenizer, prompt, params, cancelled, safe_point,
            constraint, show_special,
        )  # fmt: skip
        for event in generation:
            if event.token is not None and on_token is not None:
                on_token()
            if event.logprobs and on_logprobs is not None:
                on_logprobs(list(event.logprobs))
            if event.text and on_text is not None:
                on_text(event.text)
        return generation.result
