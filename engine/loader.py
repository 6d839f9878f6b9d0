"""Loading a GGUF model: the file and its tokenizer, the devices and the layer split, the model,
its K/V and fast decoder, and the expert caches sized last (``Engine.load`` calls :func:`load`).

Each step is a method of :class:`_Loading`, which holds what the steps share; a load that fails
part way gives back everything it made (``release``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from strata.engine import quant
from strata.engine.chat_template import ChatTemplate
from strata.engine.cpuinfo import default_threads
from strata.engine.devices import resolve_device
from strata.engine.errors import EngineError, ModelLoadError
from strata.engine.experts.cache import ExpertCache, model_key
from strata.engine.experts.profile import UsageProfile, profile_path
from strata.engine.experts.provider import FileExpertProvider
from strata.engine.gguf_index import GGUFIndex
from strata.engine.layers.decoder import MoEDecoder
from strata.engine.models import architecture_module
from strata.engine.options import EngineOptions
from strata.engine.quant import REPACKED_TYPES
from strata.engine.runner import Runner
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

# The load's lines keep the name they have always had (what logs are filtered and tests capture by).
log = logging.getLogger("strata.engine.generate")

DEFAULT_MAX_CONTEXT = 16384
MiB = 2**20
# where an automatic cpu_share starts (the share the decode graph is captured with, then tuned)
AUTO_CPU_SHARE_START = 0.5

Progress = Callable[[int, int, str], None]  # (done, total, what)
ArenaFactory = Callable[[int, int], ElasticArena]
FreeVram = Callable[[], int | None]
ArenaFactoryArg = ArenaFactory | Sequence[ArenaFactory | None] | None
FreeVramArg = FreeVram | Sequence[FreeVram | None] | None
Split = list[tuple[range, torch.device]]


@dataclass
class Loaded:
    """What ``Engine`` is built from."""

    index: GGUFIndex
    tokenizer: Tokenizer
    template: ChatTemplate | None
    runner: Runner
    profile_file: Path | None


def load(
    path: str | Path,
    options: EngineOptions | None = None,
    state_dir: Path | None = None,
    progress: Progress | None = None,
    arena_factory: ArenaFactoryArg = None,
    free_vram: FreeVramArg = None,
) -> Loaded:
    """Open ``path``; a reason it cannot serve is a :class:`ModelLoadError` naming the file
    (``Engine.load`` says what the arguments are)."""
    options = options or EngineOptions()
    names = _device_names(options)
    loading = _Loading(
        Path(path),
        options,
        progress or (lambda done, total, what: None),
        per_device("arena_factory", arena_factory, len(names)),
        per_device("free_vram", free_vram, len(names)),
    )
    tokenizer, template = loading.open()
    loading.place(names)
    loading.build()
    try:
        decoder = loading.fast_path()
        profile_file = profile_path(state_dir, model_key(loading.index)) if state_dir else None
        loading.fill_caches(profile_file, decoder is not None)
        loading.configure(decoder)
    except BaseException:
        if loading.runner is not None:
            release(loading.runner, loading.runner.model)
        raise
    loading.step(loading.total, "ready")
    loading.log_loaded()
    assert loading.runner is not None
    return Loaded(loading.index, tokenizer, template, loading.runner, profile_file)


class _Loading:
    """One load's shared state, its steps in order: ``open``, ``place``, ``build``,
    ``fast_path``, ``fill_caches``, ``configure``."""

    index: GGUFIndex
    module: ModuleType
    devices: list[torch.device]
    split: Split
    why_not: str | None  # why decode steps take the reference path (None: the fused kernels)
    model: MoEDecoder
    runner: Runner | None = None
    n_ctx: int
    threads: int

    def __init__(
        self,
        path: Path,
        options: EngineOptions,
        report: Progress,
        factories: list[ArenaFactory | None],
        frees: list[FreeVram | None],
    ) -> None:
        self.path, self.options, self.report = path, options, report
        self.factories, self.frees = factories, frees
        self.total = 5

    def step(self, done: int, what: str) -> None:
        self.report(done, self.total, what)

    def open(self) -> tuple[Tokenizer, ChatTemplate | None]:
        """The GGUF index, its architecture's module, the tokenizer and the chat template."""
        self.step(0, "reading the GGUF index")
        self.index = GGUFIndex(self.path)
        self.module = architecture_module(self.index.arch)
        self.step(1, "building the tokenizer")
        try:
            vocab = Vocab.from_metadata(self.index.metadata)
            tokenizer = Tokenizer.from_vocab(vocab)
        except EngineError as e:
            raise ModelLoadError(f"{self.path}: {e}") from None
        template = None
        if vocab.chat_template:
            bos = vocab.tokens[vocab.bos_id] if vocab.bos_id is not None else ""
            eos = vocab.tokens[vocab.eos_id] if vocab.eos_id is not None else ""
            template = ChatTemplate(vocab.chat_template, bos_token=bos, eos_token=eos)
        return tokenizer, template

    def place(self, names: Sequence[str]) -> None:
        """The devices, the stages' layer split, and whether decode takes the fused kernels."""
        self.devices = [resolve_device(name) for name in names]
        n_layer = self.module.ModelArgs.from_index(self.index).n_layer
        self.split = _split(n_layer, self.options, self.devices, self.frees)
        self.why_not = _fast_path_unavailable_all(self.index, self.devices, self.options)
        if self.why_not is None:
            self.total = 7  # and two more steps: compiling the kernels, capturing the graph
        elif any(d.type == "cuda" for d in self.devices):
            log.warning("decoding on the reference path (slow): %s", self.why_not)

    def build(self) -> None:
        """The model (its weights repacked for the fused kernels where they run), the context
        checked against each stage's memory, and the runner with its K/V."""
        repack = "repacking the weights for the GPU kernels"
        self.step(2, "mapping the weights" if self.why_not else repack)
        self.model = self.build_model(self.why_not is None)
        options, args = self.options, self.model.args
        n_ctx = _context_length(args.context_length, options.context_length, self.path)
        self.threads = options.threads or default_threads()
        torch.set_num_threads(self.threads)
        self.step(3, "allocating the K/V cache")
        default = options.context_length is None
        kind = options.kv_cache_type
        self.n_ctx = min(
            _check_kv_fits(args, n_ctx, kind, dev, self.path, default, len(span))
            for span, dev in self.split
        )
        self.runner = self.build_runner()

    def build_model(self, repack: bool) -> MoEDecoder:
        index, device = self.index, self.devices[0]
        if self.options.devices is None:  # one stage: exactly as it always was
            return self.module.Model(index, FileExpertProvider(index, device), device, repack)
        files = [FileExpertProvider(index, d) for d in self.devices]
        return self.module.Model(index, files[0], device, repack, self.split, files)

    def build_runner(self) -> Runner:
        options = self.options
        per_stage = [{"arena_factory": f} for f in self.factories]
        return Runner(
            self.model, self.n_ctx, options.kv_cache_type, options.prefill_chunk_tokens, per_stage,
            **_kv_options(options, None),
        )  # fmt: skip

    def fast_path(self) -> FastDecoder | StagedDecoder | None:
        """The fast decoder with its kernels built; where they fail to build, the model is built
        again with raw weights for the reference path (None)."""
        if self.why_not is not None:
            return None
        assert self.runner is not None
        options = self.options

        def progress(what: str) -> None:
            self.step(4, what)

        graphs = not options.enforce_eager
        decoder = _build_decoder(self.model, self.runner, progress, options.fast_prefill, graphs)
        if decoder is None:  # the kernels failed to build: the reference path, raw weights
            self.runner.close_kv()
            del self.model
            self.runner = None  # (their memory goes first)
            torch.cuda.empty_cache()
            self.model = self.build_model(False)
            self.runner = self.build_runner()
        return decoder

    def fill_caches(self, profile_file: Path | None, kernel: bool) -> None:
        """Each stage's expert cache, sized last so that an automatic size sees what the model
        holds; the usage profile of earlier runs orders its first fill."""
        options, index, n_layer = self.options, self.index, self.model.args.n_layer
        profile = UsageProfile.load(profile_file, model_key(index)) if profile_file else None
        host_total = _host_budget_mib(options) * MiB
        free = _stage_free(self.devices, self.frees)
        budgets = [
            _stage_cache_mib(options, free[i], len(span), n_layer)
            for i, (span, _) in enumerate(self.split)
        ]
        hosts = _host_shares(index, options, self.split, budgets, host_total, kernel)
        assert self.runner is not None
        for st in self.runner.stages:
            budget, host_bytes = budgets[st.number], hosts[st.number]
            # On the GPU fast path the cache exists even at 0 MiB, for its host tier (the
            # decode graph reads misses there) and to grow into free VRAM later.
            if not (budget > 0 or (kernel and host_bytes > 0)):
                continue
            at = self.total - 2 if kernel else 4
            self.step(at, "filling the expert cache")
            cache = self._create_cache(st, budget, host_bytes, profile, kernel, at)
            self.model.providers[st.number] = cache
            # One budget for the stage's cache and K/V: what they hold now (room beyond it is
            # added by ``configure``, once the decoder's own buffers are allocated). The K/V
            # grows into it (the cache's tail yields), the daemon's policy moves it.
            st.budget = cache.arena.mapped_bytes + st.kv.mapped_bytes

    def _create_cache(
        self, st: Stage, budget: int, host: int, profile: UsageProfile | None, kernel: bool, at: int
    ) -> ExpertCache:
        options = self.options
        try:
            return ExpertCache.create(
                self.index,
                st.device,
                budget * MiB,
                _stage_tail(options, len(st.layers), self.model.args.n_layer),
                options.arena_chunk_mib * MiB,
                profile,
                self.factories[st.number],
                kernel=kernel,
                host_budget_bytes=host,
                pinner=_pinner(st.device) if host > 0 else None,
                progress=lambda done, n, what: self.report(at, self.total, what),
                verify=options.verify_experts,
                layers=None if options.devices is None else st.layers,
            )
        except VmmError as e:  # page-locking refused or partial, no CUDA driver bindings
            raise ModelLoadError(f"{self.path}: {e}") from None

    def configure(self, decoder: FastDecoder | StagedDecoder | None) -> None:
        """The fast decoder's options and graph, then an automatic budget's free room."""
        assert self.runner is not None
        if decoder is not None:
            _configure_decoder(
                decoder, self.model, self.options, lambda what: self.step(self.total - 1, what)
            )
            self.runner.decoder = decoder
        if self.options.cache_mib is None:
            free = _stage_free(self.devices, self.frees)
            _budget_free_room(self.runner, free, self.options.reserve_mib)

    def log_loaded(self) -> None:
        options, args, devices = self.options, self.model.args, self.devices
        log.info(
            "loaded %s: %s, %d layers, %d experts (top-%d), context %d, %d threads, K/V %s, on %s",
            self.path.name, self.index.arch, args.n_layer, args.n_expert, args.n_expert_used,
            self.n_ctx, self.threads, options.kv_cache_type,
            devices[0] if options.devices is None else ", ".join(str(d) for d in devices),
        )  # fmt: skip
        if options.devices is not None:
            split = self.split
            log.info("%s", describe_split([r for r, _ in split], [str(d) for _, d in split]))
        if any(d.type == "cuda" for d in devices):
            assert self.runner is not None
            log.info("GPU weights dequantised by %s", quant.gpu_dequant_path())
            log.info("GPU decode: %s", decode_path(self.runner))
            log.info("GPU prefill: %s", self.runner.prefill_path())


# -- devices and the split -----------------------------------------------------------------------


def _device_names(options: EngineOptions) -> list[str]:
    """The stages' devices: ``devices`` when given (``EngineOptions`` checked them), else
    ``device`` alone."""
    return [options.device] if options.devices is None else list(options.devices)


def _split(
    n_layer: int,
    options: EngineOptions,
    devices: Sequence[torch.device],
    frees: Sequence[FreeVram | None],
) -> Split:
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


def _free_bytes(device: torch.device, free_vram: FreeVram | None) -> int | None:
    if free_vram is not None and (free := free_vram()) is not None:
        return free
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def _stage_free(
    devices: Sequence[torch.device], frees: Sequence[FreeVram | None]
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


# -- the caches' budgets -------------------------------------------------------------------------


def automatic_cache_mib(options: EngineOptions, free_bytes: int | None) -> int:
    """The cache budget at load: ``cache_mib`` when given, else the free VRAM less
    ``reserve_mib`` where it is known, else 0 (the CPU: a host cache would only duplicate the
    file's pages). The one place this is decided; the daemon passes its monitor's reading."""
    if options.cache_mib is not None:
        return options.cache_mib
    if free_bytes is None:
        return 0
    return max(0, free_bytes // MiB - options.reserve_mib)


def _stage_cache_mib(options: EngineOptions, free: int | None, layers: int, n_layer: int) -> int:
    """A stage's expert cache budget: ``cache_mib`` shared among the stages in proportion to
    their layers (all of it with one stage), or automatic from the stage's device."""
    if options.devices is None or options.cache_mib is None:
        return automatic_cache_mib(options, free)
    return options.cache_mib * layers // n_layer


def _stage_tail(options: EngineOptions, layers: int, n_layer: int) -> int | None:
    """A stage's share of ``elastic_tail_mib`` in bytes (in proportion to its layers), or None."""
    if options.elastic_tail_mib is None:
        return None
    if options.devices is None:
        return options.elastic_tail_mib * MiB
    return options.elastic_tail_mib * MiB * layers // n_layer


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


def _host_budget_mib(options: EngineOptions) -> int:
    from strata.engine.experts.host import default_budget_bytes

    if options.host_budget_mib is not None:  # (EngineOptions checked its bound)
        return options.host_budget_mib
    return default_budget_bytes() // MiB


def _host_shares(
    index: GGUFIndex,
    options: EngineOptions,
    split: Split,
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


def _pinner(device: torch.device) -> Pinner | None:
    """What page-locks the host tier for ``device`` (None on the CPU: plain memory)."""
    if device.type != "cuda":
        return None
    from strata.vmm.pinned import CudaPinner

    return CudaPinner(device.index or 0)


# -- the context and its K/V ---------------------------------------------------------------------


def _kv_options(options: EngineOptions, arena_factory: ArenaFactory | None) -> dict[str, Any]:
    """``KVCache``'s keywords from the options: its arena's chunks and backend (the cache's)."""
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
            asked, model_ctx, path.name,
        )  # fmt: skip
    return asked


# -- the fast path -------------------------------------------------------------------------------


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


def _fast_path_unavailable_all(
    index: GGUFIndex, devices: Sequence[torch.device], options: EngineOptions
) -> str | None:
    """Why decode steps cannot take the fused GPU kernels on every stage's device (one reason
    is enough: the stages run one way), or None when they can."""
    for dev in devices:
        if (why := fast_path_unavailable(index, dev, options)) is not None:
            return why if len(devices) == 1 else f"{dev}: {why}"
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


def _configure_decoder(
    decoder: FastDecoder | StagedDecoder,
    model: MoEDecoder,
    options: EngineOptions,
    step: Callable[[str], None],
) -> None:
    """The options the fast decoder takes once the caches exist, its tables bound to them and
    its graph captured. (``EngineOptions`` checked each option's bounds; what depends on the
    model, and on two options together, is checked here.)"""
    decoder.adapt_swaps = options.adapt_swaps
    ahead = options.prefetch_experts
    if ahead > model.args.n_expert:
        raise EngineError(
            f"prefetch_experts={ahead}: must be between 0 and the model's "
            f"{model.args.n_expert} experts per layer"
        )
    decoder.set_prefetch(ahead)
    share = options.cpu_share
    auto = share is None
    if share is None:  # tuned once the graph is captured, from a start worth capturing
        share = AUTO_CPU_SHARE_START if decoder.device.type == "cuda" and not ahead else 0.0
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


def release(runner: Runner, model: MoEDecoder) -> None:
    """A load that failed part way, or an engine closing: every stage's cache and K/V go
    (nothing leaks)."""
    runner.close_decoder()
    for i, provider in enumerate(model.providers):
        provider.close()
        if isinstance(provider, ExpertCache):
            model.providers[i] = provider.file
    for stage in runner.stages:
        stage.budget = None
    runner.close_kv()
