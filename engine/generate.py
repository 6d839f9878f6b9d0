"""Loading a GGUF model and generating from it: the engine's one public entry point.

``Engine.load`` reads the file, builds the tokenizer, chat template, model and runner. ``generate``
runs prefill and decode with sampling, stop tokens and strings, a streaming callback, and
cancellation at every safe point; optionally a grammar constrains the tokens (``engine.grammar``)
and each token's log-probability is reported.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from strata.engine import quant
from strata.engine.chat_template import ChatTemplate
from strata.engine.cpuinfo import default_threads
from strata.engine.devices import resolve_device
from strata.engine.errors import ContextOverflow, EngineError, ModelLoadError
from strata.engine.experts.cache import ExpertCache, model_key
from strata.engine.experts.profile import UsageProfile, profile_path
from strata.engine.experts.provider import ExpertProvider, FileExpertProvider
from strata.engine.gguf_index import GGUFIndex
from strata.engine.grammar import Constraint, Grammars
from strata.engine.layers.decoder import MoEDecoder
from strata.engine.models import architecture_module
from strata.engine.params import SamplingParams
from strata.engine.quant import REPACKED_TYPES
from strata.engine.runner import KVFull, Runner, SafePoint
from strata.engine.sampling import Sampler
from strata.engine.stages import (
    Stage,
    check_layer_split,
    describe_split,
    layer_ranges,
    per_device,
    share_budget,
    split_layers,
)
from strata.engine.tokenizer import Tokenizer
from strata.engine.vocab import Vocab
from strata.vmm.arena import ElasticArena
from strata.vmm.errors import VmmError

if TYPE_CHECKING:
    from strata.engine.fast_decode import FastDecoder
    from strata.engine.fast_stages import StagedDecoder
    from strata.vmm.pinned import Pinner

log = logging.getLogger(__name__)

DEFAULT_MAX_CONTEXT = 16384
MiB = 2**20

FinishReason = Literal["stop", "length", "cancelled"]
Progress = Callable[[int, int, str], None]  # (done, total, what)


@dataclass(frozen=True)
class EngineOptions:
    """The engine's share of the configuration (built from the daemon's config at the edge)."""

    context_length: int | None = None  # None: the model's (the K/V grows with the conversations)
    threads: int | None = None  # None: physical cores - 1
    prefill_chunk_tokens: int = 1024
    kv_cache_type: str = "f16"
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N": where the dense weights, K/V and compute live
    # expert cache budget; None: free VRAM - reserve_mib where free VRAM is known (a GPU, or the
    # daemon's monitor), else 0 (``automatic_cache_mib``)
    cache_mib: int | None = 0
    elastic_tail_mib: int | None = None  # None: three quarters of the cache (the core: a quarter)
    arena_chunk_mib: int = 32
    reserve_mib: int = 1024  # VRAM kept free when the cache size is automatic
    fast_decode: bool = True  # on a GPU: decode with the fused Triton kernels
    fast_prefill: bool = True  # and prompt chunks on tensor cores (with fast_decode only)
    enforce_eager: bool = False  # the same kernels without CUDA graphs
    # RAM for the host tier (the experts no VRAM slot holds); None: what is available less what
    # the desktop keeps (``host.default_budget_bytes``); 0: no tier, misses read from the file
    host_budget_mib: int | None = None
    # at each safe point where uses are handed over (every 64 decode steps and after a greedy
    # run), exchange up to this many hot RAM-homed experts with cold tail experts; 0: never
    adapt_swaps: int = 4
    # GPU decode: copy up to this many of each layer's predicted experts from RAM ahead of its
    # routing (``kernels.prefetch``); 0: never (on the H200 it made decode slower: docs)
    prefetch_experts: int = 0
    # GPU decode: the CPU's share (0 to 1) of each layer's chosen experts in RAM; None: chosen
    # at load by timing a few steps at each of ``fast_decode.CPU_SHARE_CANDIDATES`` (0 without
    # a GPU, or where ``prefetch_experts`` is set)
    cpu_share: float | None = None
    verify_experts: bool = False  # checksum experts at load; check every fill, move, and samples
    # conversations whose K/V is kept for a later request that extends one of them
    kv_keep_conversations: int = 4
    kv_fixed: bool = False  # map the K/V for the whole context at load (never grown or trimmed)
    # Stages (docs/multi-gpu.md): the layers split into contiguous runs, stage i on devices[i]
    # with its own expert cache, K/V and decode graph; None: one stage on ``device``
    devices: tuple[str, ...] | None = None
    # layers per stage, in order (one count per device, adding up to the model's layers);
    # None: in proportion to the memory each device has free
    layer_split: tuple[int, ...] | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and its ``top`` alternatives (id, log-probability),
    most likely first: log-softmax of the logits after the grammar mask, before the repeat
    penalty, temperature and truncation (the model's distribution over what was allowed)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens whose K/V an earlier request left (not computed again)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    first_token_s: float | None = None  # from the call to the first generated token
    seed: int | None = None
    token_times: list[float] = field(default_factory=list)  # monotonic time of each token
    logprobs: list[TokenLogprob] | None = None  # one per token when asked for
    mask_s: float = 0.0  # host time spent computing grammar masks

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    @property
    def decode_tok_s(self) -> float | None:
        # tokens after the first are the decode steps
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else None


# where an automatic cpu_share starts (the share the decode graph is captured with, then tuned)
AUTO_CPU_SHARE_START = 0.5


ArenaFactoryArg = (
    Callable[[int, int], ElasticArena] | Sequence[Callable[[int, int], ElasticArena] | None] | None
)
FreeVramArg = Callable[[], int | None] | Sequence[Callable[[], int | None] | None] | None


def _device_names(options: EngineOptions) -> list[str]:
    """The stages' devices: ``devices`` when given (at least one), else ``device`` alone."""
    if options.devices is None:
        if options.layer_split is not None:
            raise EngineError(
                f"layer_split={list(options.layer_split)}: needs devices (one count per device)"
            )
        return [options.device]
    if isinstance(options.devices, str) or not options.devices:
        raise EngineError(f"devices={options.devices!r}: expected a list of at least one device")
    for name in options.devices:
        if not isinstance(name, str):
            raise EngineError(f"devices={list(options.devices)!r}: {name!r} is not a device name")
    return list(options.devices)


def _split(
    n_layer: int,
    options: EngineOptions,
    devices: Sequence[torch.device],
    frees: Sequence[Callable[[], int | None] | None],
) -> list[tuple[range, torch.device]]:
    """The stages' layer ranges and devices: ``layer_split`` as given (checked against the
    model), else in proportion to each device's free memory (``split_layers``)."""
    if options.devices is None:
        return [(range(n_layer), devices[0])]
    if options.layer_split is not None:
        counts = check_layer_split(options.layer_split, n_layer, len(devices))
    else:
        if len(devices) > n_layer:
            raise EngineError(
                f"devices={list(options.devices)}: {len(devices)} devices for a model of "
                f"{n_layer} layers (at least one layer each)"
            )
        free = [_free_bytes(d, f) for d, f in zip(devices, frees, strict=True)]
        counts = split_layers(n_layer, free)
    return list(zip(layer_ranges(counts), devices, strict=True))


def _fast_path_unavailable_all(
    index: GGUFIndex, devices: Sequence[torch.device], options: EngineOptions
) -> str | None:
    """Why decode steps cannot take the fused GPU kernels on every stage's device (one reason
    is enough: the stages run one way), or None when they can."""
    for dev in devices:
        if (why := fast_path_unavailable(index, dev, options)) is not None:
            return why if len(devices) == 1 else f"{dev}: {why}"
    return None


def _stage_cache_mib(options: EngineOptions, free: int | None, layers: int, n_layer: int) -> int:
    """A stage's expert cache budget: ``cache_mib`` shared among the stages in proportion to
    their layers (all of it with one stage), or automatic from the stage's device."""
    if options.devices is None or options.cache_mib is None:
        return automatic_cache_mib(options, free)
    return options.cache_mib * layers // n_layer


def _budget_free_room(runner: Runner, free: Sequence[int | None], reserve_mib: int) -> None:
    """An automatic budget takes the VRAM the cache left free too (less ``reserve_mib``), up to
    what every expert and the whole context's K/V need: with every expert cached the K/V grows
    into that room before the cache's tail yields anything. (A cache that took all the room
    leaves none; an explicit ``cache_mib`` is the budget as given; the daemon's policy moves the
    budget after load.)"""
    for st in runner.stages:
        if st.budget is None or st.cache is None or free[st.number] is None:
            continue
        room = max(0, free[st.number] - reserve_mib * MiB)
        ceiling = st.cache.mapped_bytes_for(st.cache.max_slots) + st.kv.arena.reserved_bytes
        st.budget = max(st.budget, min(st.budget + room, ceiling))


def _stage_tail(options: EngineOptions, layers: int, n_layer: int) -> int | None:
    """A stage's share of ``elastic_tail_mib`` in bytes (in proportion to its layers), or None."""
    if options.elastic_tail_mib is None:
        return None
    if options.devices is None:
        return options.elastic_tail_mib * MiB
    return options.elastic_tail_mib * MiB * layers // n_layer


def _stage_free(
    devices: Sequence[torch.device], frees: Sequence[Callable[[], int | None] | None]
) -> list[int | None]:
    """Each stage's free memory for an automatic cache size: its device's reading, divided
    among the stages that read the same thing (two stages on one GPU, or sharing one
    ``free_vram``), so that together they never plan more than the device has."""
    keys = [id(f) if f is not None else str(d) for d, f in zip(devices, frees, strict=True)]
    out = []
    for d, f, key in zip(devices, frees, keys, strict=True):
        free = _free_bytes(d, f)
        out.append(None if free is None else free // keys.count(key))
    return out


def _host_shares(
    index: GGUFIndex,
    options: EngineOptions,
    split: Sequence[tuple[range, torch.device]],
    budgets_mib: Sequence[int],
    total: int,
    kernel: bool,
) -> list[int]:
    """The host tier's one RAM budget (bytes) shared among the stages: each asks for room for
    the experts its VRAM core cannot hold (what ``tier_slots`` would take), and a budget short
    of all of it is shared in proportion (``share_budget``). One stage: all of it."""
    if len(split) == 1:
        return [total]
    from strata.engine.experts.cache import owned_keys
    from strata.engine.experts.slots import plan_sizes
    from strata.engine.quant.expert_layout import kernel_slot_bytes_for, slot_bytes_for

    slot = kernel_slot_bytes_for(index) if kernel else slot_bytes_for(index)
    n_layer = sum(len(span) for span, _ in split)
    demands = []
    for (span, _), mib in zip(split, budgets_mib, strict=True):
        n = len(owned_keys(index, span))
        core = plan_sizes(mib * MiB, slot, n, _stage_tail(options, len(span), n_layer)).core_slots
        demands.append((n - core) * slot)
    return share_budget(total, demands)


def _configure_decoder(
    decoder: FastDecoder | StagedDecoder,
    model: MoEDecoder,
    options: EngineOptions,
    step: Callable[[str], None],
) -> None:
    """The options the fast decoder takes once the caches exist, its tables bound to them and
    its graph captured."""
    if options.adapt_swaps < 0:
        raise EngineError(f"adapt_swaps={options.adapt_swaps} is negative")
    decoder.adapt_swaps = options.adapt_swaps
    ahead = options.prefetch_experts
    if not isinstance(ahead, int) or not 0 <= ahead <= model.args.n_expert:
        raise EngineError(
            f"prefetch_experts={ahead}: must be between 0 and the model's "
            f"{model.args.n_expert} experts per layer"
        )
    decoder.set_prefetch(ahead)
    share = options.cpu_share
    auto = share is None
    if auto:  # tuned once the graph is captured, from a start worth capturing
        share = AUTO_CPU_SHARE_START if decoder.device.type == "cuda" and not ahead else 0.0
    elif isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        raise EngineError(f"cpu_share={share!r}: must be a number between 0 and 1")
    if share and ahead:
        raise EngineError(
            f"cpu_share={share} and prefetch_experts={ahead}: the CPU's share and the copies "
            "ahead both take the experts in RAM; set one of them to 0"
        )
    decoder.set_cpu_share(share, options.threads or default_threads())
    from strata.engine.fast_stages import StagedDecoder

    if isinstance(decoder, StagedDecoder):
        decoder.bind_stages()  # each stage's tables from its own stage's cache
    else:
        decoder.bind(model.provider)
    if not options.enforce_eager:
        step("capturing the decode step as a CUDA graph")
        decoder.capture()
    else:
        decoder.graph_reason = "enforce_eager is set"
    if auto and decoder.cpu_sharing:
        step("timing the CPU's share of the experts in RAM")
        decoder.tune_cpu_share()


def _release(runner: Runner, model: MoEDecoder) -> None:
    """A load that failed part way: every stage's cache and K/V go (nothing leaks)."""
    runner.close_decoder()
    for i, provider in enumerate(model.providers):
        provider.close()
        if isinstance(provider, ExpertCache):
            model.providers[i] = provider.file
    for stage in runner.stages:
        stage.budget = None
    runner.close_kv()


class Engine:
    def __init__(
        self,
        index: GGUFIndex,
        tokenizer: Tokenizer,
        template: ChatTemplate | None,
        runner: Runner,
        profile_file: Path | None = None,
    ) -> None:
        self.index = index
        self.tokenizer = tokenizer
        self.template = template
        self.runner = runner
        self.profile_file = profile_file
        self.grammars = Grammars(tokenizer, runner.model.args.vocab_size)
        self._tools_rendered: bool | None = None

    def save_profile(self) -> None:
        """Merge this run's expert usage (every stage's) into the saved profile (atomically;
        errors are logged, never fatal: a profile only speeds up the next start)."""
        self.runner.flush_usage()
        providers = self.runner.model.providers
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
    def stages(self) -> list[Stage]:
        """The stages, in layer order (one without ``devices``)."""
        return self.runner.stages

    def _stage(self, stage: int) -> Stage:
        n = len(self.runner.stages)
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < n:
            raise EngineError(f"stage={stage!r}: the engine has stages 0 to {n - 1}")
        return self.runner.stages[stage]

    @property
    def provider(self) -> ExpertProvider:
        return self.runner.model.provider

    @property
    def cache(self) -> ExpertCache | None:
        provider = self.runner.model.provider
        return provider if isinstance(provider, ExpertCache) else None

    def close(self) -> None:
        """Give every stage's memory back: its cache's (the arena is unmapped and released),
        the pinned staging buffers of expert misses, and its K/V's."""
        _release(self.runner, self.runner.model)

    @property
    def model_id(self) -> str:
        return self.index.path.stem

    @property
    def n_ctx(self) -> int:
        return self.runner.n_ctx

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
        every stage or a sequence of one per device (stage i gets element i)."""
        options = options or EngineOptions()
        report = progress or (lambda done, total, what: None)
        path = Path(path)
        total = 5

        def step(done: int, what: str) -> None:
            report(done, total, what)

        names = _device_names(options)
        factories = per_device("arena_factory", arena_factory, len(names))
        frees = per_device("free_vram", free_vram, len(names))
        step(0, "reading the GGUF index")
        index = GGUFIndex(path)
        module = architecture_module(index.arch)
        step(1, "building the tokenizer")
        try:
            vocab = Vocab.from_metadata(index.metadata)
            tokenizer = Tokenizer.from_vocab(vocab)
        except EngineError as e:
            raise ModelLoadError(f"{path}: {e}") from None
        template = None
        if vocab.chat_template:
            bos = vocab.tokens[vocab.bos_id] if vocab.bos_id is not None else ""
            eos = vocab.tokens[vocab.eos_id] if vocab.eos_id is not None else ""
            template = ChatTemplate(vocab.chat_template, bos_token=bos, eos_token=eos)
        devices = [resolve_device(name) for name in names]
        device = devices[0]
        split = _split(module.ModelArgs.from_index(index).n_layer, options, devices, frees)
        why_not = _fast_path_unavailable_all(index, devices, options)
        if why_not is None:
            total = 7  # and two more steps: compiling the kernels, capturing the graph
        elif any(d.type == "cuda" for d in devices):
            log.warning("decoding on the reference path (slow): %s", why_not)
        step(2, "mapping the weights" if why_not else "repacking the weights for the GPU kernels")

        def build_model(repack: bool) -> MoEDecoder:
            if options.devices is None:  # one stage: exactly as it always was
                return module.Model(index, FileExpertProvider(index, device), device, repack)
            files = [FileExpertProvider(index, d) for d in devices]
            return module.Model(index, files[0], device, repack, split, files)

        model = build_model(why_not is None)
        n_ctx = _context_length(model.args.context_length, options.context_length, path)
        threads = options.threads or default_threads()
        torch.set_num_threads(threads)
        step(3, "allocating the K/V cache")
        n_ctx = min(
            _check_kv_fits(
                model.args,
                n_ctx,
                options.kv_cache_type,
                dev,
                path,
                options.context_length is None,
                len(span),
            )
            for span, dev in split
        )
        kv_options = _kv_options(options, None)
        per_stage = [{"arena_factory": f} for f in factories]

        def build_runner() -> Runner:
            return Runner(
                model, n_ctx, options.kv_cache_type, options.prefill_chunk_tokens, per_stage,
                **kv_options,
            )  # fmt: skip

        runner = build_runner()
        decoder = None
        try:
            if why_not is None:
                decoder = _build_decoder(
                    model,
                    runner,
                    lambda what: step(4, what),
                    options.fast_prefill,
                    not options.enforce_eager,
                )
                if decoder is None:  # the kernels failed to build: the reference path, raw weights
                    runner.close_kv()
                    model = runner = None  # type: ignore[assignment]  # (their memory goes first)
                    torch.cuda.empty_cache()
                    model = build_model(False)
                    runner = build_runner()
            # The usage profile of earlier runs orders the cache's first fill.
            profile_file = profile_path(state_dir, model_key(index)) if state_dir else None
            profile = UsageProfile.load(profile_file, model_key(index)) if profile_file else None
            # The caches are sized last, so that an automatic size sees what the model holds.
            host_total = _host_budget_mib(options) * MiB
            free = _stage_free(devices, frees)
            budgets = [
                _stage_cache_mib(options, free[i], len(span), model.args.n_layer)
                for i, (span, _) in enumerate(split)
            ]
            hosts = _host_shares(index, options, split, budgets, host_total, decoder is not None)
            for st in runner.stages:
                budget, host_bytes = budgets[st.number], hosts[st.number]
                # On the GPU fast path the cache exists even at 0 MiB, for its host tier (the
                # decode graph reads misses there) and to grow into free VRAM later.
                if not (budget > 0 or (decoder is not None and host_bytes > 0)):
                    continue
                at = total - 2 if decoder else 4
                step(at, "filling the expert cache")
                try:
                    cache = ExpertCache.create(
                        index,
                        st.device,
                        budget * MiB,
                        _stage_tail(options, len(st.layers), model.args.n_layer),
                        options.arena_chunk_mib * MiB,
                        profile,
                        factories[st.number],
                        kernel=decoder is not None,
                        host_budget_bytes=host_bytes,
                        pinner=_pinner(st.device) if host_bytes > 0 else None,
                        progress=lambda done, n, what, at=at: report(at, total, what),
                        verify=options.verify_experts,
                        layers=None if options.devices is None else st.layers,
                    )
                except VmmError as e:  # page-locking refused or partial, no CUDA driver bindings
                    raise ModelLoadError(f"{path}: {e}") from None
                model.providers[st.number] = cache
                # One budget for the stage's cache and K/V: what they hold now (room beyond it
                # is added below, once the decoder's own buffers are allocated). The K/V grows
                # into it (the cache's tail yields), the daemon's policy moves it.
                st.budget = cache.arena.mapped_bytes + st.kv.mapped_bytes
            if decoder is not None:
                _configure_decoder(decoder, model, options, lambda what: step(total - 1, what))
                runner.decoder = decoder
            if options.cache_mib is None:
                _budget_free_room(runner, _stage_free(devices, frees), options.reserve_mib)
        except BaseException:
            if runner is not None:
                _release(runner, runner.model)
            raise
        step(total, "ready")
        log.info(
            "loaded %s: %s, %d layers, %d experts (top-%d), context %d, %d threads, K/V %s, on %s",
            path.name,
            index.arch,
            model.args.n_layer,
            model.args.n_expert,
            model.args.n_expert_used,
            n_ctx,
            threads,
            options.kv_cache_type,
            device if options.devices is None else ", ".join(str(d) for d in devices),
        )
        if options.devices is not None:
            log.info("%s", describe_split([r for r, _ in split], [str(d) for _, d in split]))
        if any(d.type == "cuda" for d in devices):
            log.info("GPU weights dequantised by %s", quant.gpu_dequant_path())
            log.info("GPU decode: %s", decode_path(runner))
            log.info("GPU prefill: %s", runner.prefill_path())
        return cls(index, tokenizer, template, runner, profile_file)

    # -- prompts --------------------------------------------------------------------------------

    def encode_prompt(self, text: str) -> list[int]:
        """A raw completion prompt: BOS as the file's ``add_bos_token`` says."""
        return self.tokenizer.encode(text)

    def render_chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> str:
        """The prompt text; ``tools`` (OpenAI's tool objects) go to the template as ``tools``,
        as transformers and llama.cpp pass them."""
        if self.template is None:
            raise EngineError(
                f"{self.index.path.name} has no chat template (tokenizer.chat_template)"
            )
        extra = {"tools": list(tools)} if tools else {}
        return self.template.render(list(messages), add_generation_prompt=True, **extra)

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int]:
        # The template writes BOS itself where the model wants one; encode never doubles it.
        return self.tokenizer.encode(self.render_chat(messages, tools))

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
        fit = self.runner.tokens_that_fit()
        if n_prompt + 1 > fit:
            runner, MiB = self.runner, 2**20
            # the stage whose budget fits the fewest tokens (the only one without stages)
            st = min(runner.stages, key=lambda s: s.tokens_that_fit(runner.n_ctx))
            limit = st.kv_limit_bytes() or 0
            need = st.kv.context_bytes(n_prompt + 1)
            where = f" of {st.describe()}" if len(runner.stages) > 1 else ""
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
        return self.runner.fit_budget(budget, stage)

    def kv_status(self, stage: int = 0) -> dict[str, int | list[int]]:
        """``stage``'s K/V and its share of that stage's budget, for the status and the
        metrics (``fits_tokens``: what fits every stage)."""
        st = self._stage(stage)
        out = st.kv.status()
        out["budget_bytes"] = st.budget if st.budget is not None else -1
        out["fits_tokens"] = self.runner.tokens_that_fit()
        return out

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
        sampler = Sampler(params)
        result = GenerationResult("", [], "length", len(prompt), seed=sampler.seed)
        stops = _StopMatcher(params.stop)
        # Invalid UTF-8 (a byte token a model emits out of sequence) is dropped, as
        # llama-cpp-python does, rather than shown as U+FFFD.
        decoder = self.tokenizer.stream_decoder(errors="ignore", keep=show_special)
        history = list(prompt)
        top_n = params.logprobs
        if top_n is not None:
            result.logprobs = []
        pending: list[TokenLogprob] = []  # logprobs not yet handed to on_logprobs

        def emit(text: str) -> None:
            if pending and on_logprobs is not None:
                on_logprobs(list(pending))
            pending.clear()
            if text and on_text is not None:
                on_text(text)

        def boundary() -> None:
            if safe_point is not None:
                safe_point()

        def prompt_boundary() -> None:  # a long prompt can be cancelled between its chunks
            boundary()
            if cancelled is not None and cancelled():
                raise _Cancelled

        t0 = time.monotonic()
        todo = self.runner.start(prompt)
        result.cached_tokens = len(prompt) - len(todo)
        try:
            logits = self.runner.feed(todo, prompt_boundary)
        except _Cancelled:  # the K/V keeps the chunks fed so far: a retry reuses them
            result.prefill_s = time.monotonic() - t0
            result.finish_reason = "cancelled"
            return result
        result.prefill_s = time.monotonic() - t0
        t_first = None
        # greedy without a repeat penalty needs nothing from the host between steps but a
        # grammar's mask: the fast decoder then runs one step ahead (Runner.greedy), and `token`
        # comes from it (under a grammar, step n+1 runs while the host computes its mask from
        # token n). Not with logprobs (they need the logits on the host).
        look_ahead = params.greedy and params.repeat_penalty == 1.0 and top_n is None
        steps: Iterator[int] | None = None
        token: int | None = None
        while True:
            if cancelled is not None and cancelled():
                result.finish_reason = "cancelled"
                break
            if token is None:
                if constraint is not None:
                    # the host computes the mask while the device still runs the step
                    logits = self.runner.mask_logits(logits, constraint)
                    if constraint.error is not None:
                        result.finish_reason = "stop"
                        break
                token = sampler(logits, history)
            now = time.monotonic()
            if t_first is None:
                t_first = now
                result.first_token_s = now - t0
            if token in self.tokenizer.eog_ids:
                result.finish_reason = "stop"
                break
            if top_n is not None:  # (no look-ahead then: `logits` are this token's)
                entry = token_logprob(logits, token, top_n)
                pending.append(entry)
                assert result.logprobs is not None
                result.logprobs.append(entry)
            result.tokens.append(token)
            result.token_times.append(now)
            if on_token is not None:
                on_token()
            history.append(token)
            if constraint is not None:
                constraint.accept(token)
            ready, hit = stops.push(decoder.push(token))
            if ready:
                emit(ready)
            result.text += ready
            if hit:
                result.finish_reason = "stop"
                break
            if constraint is not None and constraint.done:
                result.finish_reason = "stop"  # the grammar is complete: only an end may follow
                break
            if len(result.tokens) >= params.max_tokens:
                break
            if steps is None and look_ahead and self.runner.can_look_ahead():
                left = params.max_tokens - len(result.tokens)
                steps = self.runner.greedy(token, left, boundary, constraint)
            if steps is not None:
                nxt = next(steps, None)
                if nxt is not None:
                    token = nxt
                    continue
                steps = None  # the look-ahead ended: `token` is not fed yet
            try:
                logits = self.runner.feed([token], boundary)
            except KVFull as e:  # the budget has no room for one more position: as a context end
                log.warning("generation ends: %s", e)
                break
            token = None
        if steps is not None:
            steps.close()
        if not stops.hit:
            # what the stream decoder and the stop matcher still hold back is final now
            ready, hit = stops.push(decoder.flush())
            tail = ready if hit else ready + stops.flush()
            if hit:
                result.finish_reason = "stop"
            emit(tail)
            result.text += tail
        else:
            emit("")  # the logprobs of a stop string's tokens
        if t_first is not None:
            result.decode_s = time.monotonic() - t_first
        if constraint is not None:
            result.mask_s = constraint.mask_s
        self.runner.settle()
        return result


def token_logprob(logits: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
    """``token``'s log-probability under ``logits`` [V] and the ``top_n`` most likely tokens
    (those the grammar masked out, at -inf, are never listed). One copy to the host."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    if top_n > 0:
        vals, ids = torch.topk(lp, min(top_n, lp.numel()))
        both = torch.cat([lp[token : token + 1], vals]).tolist()
        top = tuple(
            (int(i), v) for i, v in zip(ids.tolist(), both[1:], strict=True) if v != float("-inf")
        )
        return TokenLogprob(token, both[0], top)
    return TokenLogprob(token, float(lp[token]))


def decode_path(runner: Runner) -> str:
    """How decode steps run, for the log and the bench: a line of text."""
    if runner.decoder is not None:
        return runner.decoder.describe()
    return "reference path (dequantise, then multiply; one launch per expert matrix)"


def fast_path_unavailable(
    index: GGUFIndex, device: torch.device, options: EngineOptions
) -> str | None:
    """Why decode steps cannot take the fused GPU kernels here, or None when they can."""
    if device.type != "cuda":
        return "the compute device is the CPU"
    if not options.fast_decode:
        return "fast_decode is off"
    from strata.engine.kernels import unavailable

    if (reason := unavailable()) is not None:
        return reason
    types = {r.qtype for b in index.iter_experts() for r in b.runs}
    slow = sorted(t.name for t in types - REPACKED_TYPES)
    if slow:
        return f"expert tensors of type {', '.join(slow)} have no decode kernel yet"
    head_dim = int(index.key("attention.key_length", 0)) or int(
        index.key("embedding_length")
    ) // int(index.key("attention.head_count"))
    if head_dim < 2 or head_dim & (head_dim - 1):
        return f"the head dimension {head_dim} is not a power of two"
    return None


def _build_decoder(
    model: MoEDecoder,
    runner: Runner,
    progress: Callable[[str], None],
    fast_prefill: bool = True,
    graphs: bool = True,
) -> FastDecoder | StagedDecoder | None:
    """The fast decoder with its kernels compiled (one eager step, and one prefill chunk), or
    None after a warning when they cannot be built here. Prefill kernels that fail to build
    leave the decoder without its prefill path (one warning): prompts take the reference path."""
    from strata.engine.fast_decode import FastDecoder
    from strata.engine.fast_stages import StagedDecoder

    n = model.args.n_layer
    decoder: FastDecoder | StagedDecoder
    try:
        if len(runner.stages) == 1:
            decoder = FastDecoder(model, runner.kv)
        else:  # one decoder per stage, each on its device with its own graph
            decoder = StagedDecoder(model, runner.stages)
        progress("compiling the GPU decode kernels (first start only: then cached)")
        decoder.warm_up(
            lambda layer: progress(f"compiling the GPU decode kernels: layer {layer + 1}/{n}")
        )
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # a compiler or driver that cannot build a kernel
        log.debug("building the fast decoder failed", exc_info=True)
        reason = f"{type(e).__name__}: {e}".splitlines()[0]
        log.warning(
            "the GPU decode kernels failed to build (%s): decoding on the reference path", reason
        )
        return None
    if not fast_prefill:
        decoder.prefill = None
        log.info("fast_prefill is off: prompt chunks take the reference path")
        return decoder
    try:
        progress("compiling the GPU prefill kernels (first start only: then cached)")
        assert decoder.prefill is not None
        decoder.prefill.warm_up()
        if graphs:
            progress(f"capturing {runner.prefill_chunk}-token prompt chunks as CUDA graphs")
            decoder.prefill.capture(runner.prefill_chunk)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # the same, for the tensor-core kernels alone
        log.debug("building the prefill kernels failed", exc_info=True)
        reason = f"{type(e).__name__}: {e}".splitlines()[0]
        log.warning(
            "the GPU prefill kernels failed to build (%s): prompt chunks take the reference "
            "path (dequantise, then multiply)",
            reason,
        )
        decoder.prefill = None
    return decoder


def automatic_cache_mib(options: EngineOptions, free_bytes: int | None) -> int:
    """The cache budget at load: ``cache_mib`` when given, else the free VRAM less
    ``reserve_mib`` where it is known, else 0 (the CPU: a host cache would only duplicate the
    file's pages). The one place this is decided; the daemon passes its monitor's reading."""
    if options.cache_mib is not None:
        return options.cache_mib
    if free_bytes is None:
        return 0
    return max(0, free_bytes // MiB - options.reserve_mib)


def _free_bytes(device: torch.device, free_vram: Callable[[], int | None] | None) -> int | None:
    if free_vram is not None and (free := free_vram()) is not None:
        return free
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def _host_budget_mib(options: EngineOptions) -> int:
    from strata.engine.experts.host import default_budget_bytes

    if options.host_budget_mib is not None:
        if options.host_budget_mib < 0:
            raise EngineError(f"host_budget_mib={options.host_budget_mib} is negative")
        return options.host_budget_mib
    return default_budget_bytes() // MiB


def _pinner(device: torch.device) -> Pinner | None:
    """What page-locks the host tier for ``device`` (None on the CPU: plain memory)."""
    if device.type != "cuda":
        return None
    from strata.vmm.pinned import CudaPinner

    return CudaPinner(device.index or 0)


def _kv_options(
    options: EngineOptions, arena_factory: Callable[[int, int], ElasticArena] | None
) -> dict[str, Any]:
    """``KVCache``'s keywords from the options: its arena's chunks and backend (the cache's)."""
    if options.kv_keep_conversations < 0:
        raise EngineError(f"kv_keep_conversations={options.kv_keep_conversations} is negative")
    return {
        "keep": options.kv_keep_conversations,
        "chunk_bytes": options.arena_chunk_mib * MiB,
        "arena_factory": arena_factory,
        "fixed": options.kv_fixed,
    }


def _check_kv_fits(
    args: Any,
    n_ctx: int,
    kind: str,
    device: torch.device,
    path: Path,
    default: bool,
    n_layer: int | None = None,
) -> int:
    """The context, checked against the device's memory before anything is allocated: one
    sequence of ``n_ctx`` positions whose K/V could not fit all of it is an error naming the
    option and both sizes (not an allocator's message from deep inside); a ``default`` context
    (the model's) is lowered to what fits instead, with a line in the log."""
    from strata.engine.kv import KV_DTYPES, KVCache, page_bytes_for

    if kind not in KV_DTYPES:
        return n_ctx  # the K/V cache names the bad type itself
    n_layer = args.n_layer if n_layer is None else n_layer  # a stage's layers
    need = KVCache.nbytes_for(n_layer, n_ctx, args.n_head_kv, args.head_dim, kind)
    if device.type == "cuda":
        have, where = torch.cuda.get_device_properties(device).total_memory, f"{device}'s memory"
    else:
        have, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the RAM"
    if need <= have:
        return n_ctx
    if default:
        from strata.engine.kv import PAGE_TOKENS

        page = page_bytes_for(n_layer, args.n_head_kv, args.head_dim, kind, PAGE_TOKENS)
        fits = max(PAGE_TOKENS, have // 2 // page * PAGE_TOKENS)
        log.warning(
            "the model's context of %d tokens needs %.1f GiB of K/V (%s), more than all of %s "
            "(%.1f GiB): context_length %d (half of it); set context_length to choose",
            n_ctx, need / 2**30, kind, where, have / 2**30, fits,
        )  # fmt: skip
        return fits
    raise ModelLoadError(
        f"{path}: context_length {n_ctx} needs a K/V cache of {need / 2**30:,.1f} GiB "
        f"({kind}), more than all of {where} ({have / 2**30:,.1f} GiB); the model was "
        f"trained for {args.context_length} tokens"
    )


def _context_length(model_ctx: int, asked: int | None, path: Path) -> int:
    """The model's context (from the GGUF; DEFAULT_MAX_CONTEXT where it says none), or the one
    asked for: the K/V grows with the conversations, so a long context costs only what is used."""
    if asked is None:
        return model_ctx if model_ctx > 0 else DEFAULT_MAX_CONTEXT
    if model_ctx > 0 and asked > model_ctx:
        log.warning(
            "context_length %d is beyond the %d tokens %s was trained for; quality may drop",
            asked,
            model_ctx,
            path.name,
        )
    return asked


class _Cancelled(Exception):
    """Raised at a prompt chunk's boundary when the caller cancelled (never leaves generate)."""


class _StopMatcher:
    """Holds back text that could still become a stop string; cuts at the first full match.

    An Aho–Corasick automaton over the stop strings: each character of generated text moves it
    one state (amortised over the text), so the work per piece is linear in the piece whatever
    the stops are, where looking for every stop in every tail was quadratic in their lengths. Its
    state is the longest tail of the text that is a prefix of some stop: exactly the text held
    back, so nothing is shown that a stop may still swallow. When the text completes matches, the
    one that starts first wins (a long stop that began earlier beats a short one inside it), as
    ``str.find`` with each stop would pick.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.pending = ""
        self.hit = False
        self._longest = max((len(s) for s in self.stops), default=0)
        # the trie of the stops: node 0 is the root; per node its children, failure link, depth
        # and the length of the longest stop that ends there (0: none)
        self._next: list[dict[str, int]] = [{}]
        self._fail = [0]
        self._depth = [0]
        self._out = [0]
        for s in self.stops:
            node = 0
            for c in s:
                child = self._next[node].get(c)
                if child is None:
                    child = len(self._next)
                    self._next[node][c] = child
                    self._next.append({})
                    self._fail.append(0)
                    self._depth.append(self._depth[node] + 1)
                    self._out.append(0)
                node = child
            self._out[node] = len(s)
        self._link()
        self._state = 0

    def _link(self) -> None:
        """Failure links, breadth first: a node's link is its longest proper suffix in the trie,
        and a node that ends no stop itself inherits the longest stop its link ends."""
        queue = list(self._next[0].values())
        for node in queue:  # the root's children keep the root as their link
            for c, child in self._next[node].items():
                self._fail[child] = self._step(self._fail[node], c)
                if not self._out[child]:
                    self._out[child] = self._out[self._fail[child]]
                queue.append(child)

    def _step(self, state: int, c: str) -> int:
        while state and c not in self._next[state]:
            state = self._fail[state]
        return self._next[state].get(c, 0)

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text now final, whether a stop string matched)."""
        if not self.stops:
            return text, False
        held = len(self.pending)
        state, first = self._state, -1
        for i, c in enumerate(text):
            state = self._step(state, c)
            end = held + i + 1  # of the match in pending + text, exclusive
            if self._out[state] and (first < 0 or end - self._out[state] < first):
                first = end - self._out[state]
            if first >= 0 and end - first >= self._longest - 1:
                break  # a match that starts before `first` would have ended by now
        if first >= 0:
            out = (self.pending + text)[:first]
            self.pending, self._state, self.hit = "", 0, True
            return out, True
        keep = self._depth[state]
        whole = self.pending + text
        cut = len(whole) - keep
        out, self.pending, self._state = whole[:cut], whole[cut:], state
        return out, False

    def flush(self, text: str = "") -> str:
        out, self.pending, self._state = self.pending + text, "", 0
        return out
