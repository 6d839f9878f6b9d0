"""Loading a GGUF model: the file and its tokenizer, the devices and the layer split, the model,
its K/V and stage runners, and the expert caches sized last (``Engine.load`` calls :func:`load`).

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
from strata.engine.fast_path import build_gpu_runners, configure_gpu, unavailable_on_all
from strata.engine.gguf_index import GGUFIndex
from strata.engine.models import architecture_module
from strata.engine.models.base import MoEModel
from strata.engine.ops import ModelShape
from strata.engine.options import EngineOptions
from strata.engine.recurrent import message_start_ids
from strata.engine.reference_runner import ReferenceRunner
from strata.engine.sequences import Sequences, new_kvs
from strata.engine.stages import (
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
    from strata.engine.step import StageRunner
    from strata.vmm.pinned import Pinner

# The load's lines keep the name they have always had (what logs are filtered and tests capture by).
log = logging.getLogger("strata.engine.generate")

DEFAULT_MAX_CONTEXT = 16384
MiB = 2**20


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
    sequences: Sequences
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
        gpu = loading.fast_path()
        profile_file = profile_path(state_dir, model_key(loading.index)) if state_dir else None
        loading.fill_caches(profile_file, gpu)
        loading.configure(gpu)
    except BaseException:
        if loading.sequences is not None:
            release(loading.sequences)
        raise
    loading.step(loading.total, "ready")
    loading.log_loaded()
    assert loading.sequences is not None
    return Loaded(loading.index, tokenizer, template, loading.sequences, profile_file)


class _Loading:
    """One load's shared state, its steps in order: ``open``, ``place``, ``build``,
    ``fast_path``, ``fill_caches``, ``configure``."""

    index: GGUFIndex
    module: ModuleType
    devices: list[torch.device]
    split: Split
    why_not: str | None  # why decode steps take the reference path (None: the fused kernels)
    model: MoEModel
    sequences: Sequences | None = None
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
        n_layer = self.module.Model.read_shape(self.index).n_layer
        self.split = _split(n_layer, self.options, self.devices, self.frees)
        self.why_not = unavailable_on_all(self.index, self.devices, self.options)
        if self.why_not is None:
            self.total = 7  # and two more steps: compiling the kernels, capturing the graph
        elif any(d.type == "cuda" for d in self.devices):
            log.warning("decoding on the reference path (slow): %s", self.why_not)

    def build(self) -> None:
        """The model (its weights repacked for the fused kernels where they run), the context
        checked against each stage's memory, and the sequences over each stage's K/V."""
        repack = "repacking the weights for the GPU kernels"
        self.step(2, "mapping the weights" if self.why_not else repack)
        self.model = self.build_model(self.why_not is None)
        options, shape = self.options, self.model.shape
        n_ctx = _context_length(shape.context_length, options.context_length, self.path)
        self.threads = options.threads or default_threads()
        torch.set_num_threads(self.threads)
        self.step(3, "allocating the K/V cache")
        default = options.context_length is None
        kind = options.kv_cache_type
        self.n_ctx = min(
            _check_kv_fits(shape, n_ctx, kind, dev, self.path, default, _kv_slots(shape, span))
            for span, dev in self.split
        )
        self.sequences = self.build_sequences()

    def build_model(self, repack: bool) -> MoEModel:
        index, device = self.index, self.devices[0]
        if self.options.devices is None:  # one stage: exactly as it always was
            return self.module.Model(index, device, repack)
        return self.module.Model(index, device, repack, self.split)

    def build_sequences(self) -> Sequences:
        """Each stage's K/V and its reference runner, experts from the file (the GPU runners,
        the caches and their budgets come later)."""
        options = self.options
        per_stage = [{"arena_factory": f} for f in self.factories]
        kvs = new_kvs(
            self.model, self.n_ctx, options.kv_cache_type, per_stage, **_kv_options(options, None)
        )
        stages = [
            ReferenceRunner(self.model, i, kv, FileExpertProvider(self.index, dev))
            for i, (kv, dev) in enumerate(zip(kvs, self.model.stage_devices, strict=True))
        ]
        seqs = Sequences(stages, self.n_ctx, options.prefill_chunk_tokens)
        if self.model.shape.delta_net is not None:  # checkpoints of the state at messages
            seqs.boundary_tokens = message_start_ids(self.index.metadata["tokenizer.ggml.tokens"])
        return seqs

    def fast_path(self) -> bool:
        """The GPU runners with their kernels built, in place of the reference ones; where they
        fail to build, the model is built again with raw weights for the reference path
        (False)."""
        if self.why_not is not None:
            return False
        assert self.sequences is not None

        def progress(what: str) -> None:
            self.step(4, what)

        old = self.sequences.stages
        gpu = build_gpu_runners(
            self.model, [s.kv for s in old], [s.provider for s in old], progress, self.options
        )
        if gpu is not None:
            self.sequences.replace_stages(gpu)
            return True
        # the kernels failed to build: the reference path, raw weights
        self.sequences.close_kv()
        del self.model, old
        self.sequences = None  # (their memory goes first)
        torch.cuda.empty_cache()
        self.model = self.build_model(False)
        self.sequences = self.build_sequences()
        return False

    def fill_caches(self, profile_file: Path | None, kernel: bool) -> None:
        """Each stage's expert cache, sized last so that an automatic size sees what the model
        holds; the usage profile of earlier runs orders its first fill."""
        options, index, n_layer = self.options, self.index, self.model.shape.n_layer
        profile = UsageProfile.load(profile_file, model_key(index)) if profile_file else None
        host_total = _host_budget_mib(options) * MiB
        free = _stage_free(self.devices, self.frees)
        budgets = [
            _stage_cache_mib(options, free[i], len(span), n_layer)
            for i, (span, _) in enumerate(self.split)
        ]
        hosts = _host_shares(index, options, self.split, budgets, host_total, kernel)
        assert self.sequences is not None
        for st in self.sequences.stages:
            budget, host_bytes = budgets[st.number], hosts[st.number]
            # On the GPU fast path the cache exists even at 0 MiB, for its host tier (the
            # decode graph reads misses there) and to grow into free VRAM later.
            if not (budget > 0 or (kernel and host_bytes > 0)):
                continue
            at = self.total - 2 if kernel else 4
            self.step(at, "filling the expert cache")
            cache = self._create_cache(st, budget, host_bytes, profile, kernel, at)
            st.provider = cache  # (a GPU runner binds it in ``configure``)
            # One budget for the stage's cache and K/V: what they hold now (room beyond it is
            # added by ``configure``, once the decoder's own buffers are allocated). The K/V
            # grows into it (the cache's tail yields), the daemon's policy moves it.
            st.budget = cache.arena.mapped_bytes + st.kv.mapped_bytes

    def _create_cache(
        self, st: StageRunner, budget: int, host: int, profile: UsageProfile | None,
        kernel: bool, at: int,
    ) -> ExpertCache:  # fmt: skip
        options = self.options
        try:
            return ExpertCache.create(
                self.index,
                st.device,
                budget * MiB,
                _stage_tail(options, len(st.layers), self.model.shape.n_layer),
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

    def configure(self, gpu: bool) -> None:
        """The GPU runners' options and graphs, then an automatic budget's free room."""
        assert self.sequences is not None
        if gpu:
            configure_gpu(
                self.sequences.stages, self.model, self.options,
                lambda what: self.step(self.total - 1, what),
            )  # fmt: skip
        if self.options.cache_mib is None:
            free = _stage_free(self.devices, self.frees)
            _budget_free_room(self.sequences, free, self.options.reserve_mib)

    def log_loaded(self) -> None:
        options, shape, devices = self.options, self.model.shape, self.devices
        r = shape.routing
        log.info(
            "loaded %s: %s, %d layers, %d experts (top-%d), context %d, %d threads, K/V %s, on %s",
            self.path.name, self.index.arch, shape.n_layer, r.n_expert, r.n_used,
            self.n_ctx, self.threads, options.kv_cache_type,
            devices[0] if options.devices is None else ", ".join(str(d) for d in devices),
        )  # fmt: skip
        if options.devices is not None:
            split = self.split
            log.info("%s", describe_split([r for r, _ in split], [str(d) for _, d in split]))
        if any(d.type == "cuda" for d in devices):
            assert self.sequences is not None
            log.info("GPU weights dequantised by %s", quant.gpu_dequant_path())
            log.info("GPU decode: %s", self.sequences.decode_path())
            log.info("GPU prefill: %s", self.sequences.prefill_path())


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


def _budget_free_room(runner: Sequences, free: Sequence[int | None], reserve_mib: int) -> None:
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


def _kv_slots(shape: ModelShape, span: range) -> int:
    """The layers of ``span`` a K/V page holds: all of them, or with a sliding window the larger
    of its two groups (the window layers' pages hold a window, not the context)."""
    if not any(shape.windowed):
        return len(span)
    windowed = sum(shape.windowed[i] for i in span)
    return max(windowed, len(span) - windowed)


def _check_kv_fits(
    shape: ModelShape,
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
    a = shape.attention
    n_layer = shape.n_layer if n_layer is None else n_layer  # a stage's layers
    need = KVCache.nbytes_for(n_layer, n_ctx, a.n_head_kv, a.head_dim, kind)
    if device.type == "cuda":
        have, where = torch.cuda.get_device_properties(device).total_memory, f"{device}'s memory"
    else:
        have, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the RAM"
    if need <= have:
        return n_ctx
    if default:
        from strata.engine.kv import PAGE_TOKENS

        page = page_bytes_for(n_layer, a.n_head_kv, a.head_dim, kind, PAGE_TOKENS)
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
        f"trained for {shape.context_length} tokens"
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


def release(runner: Sequences) -> None:
    """A load that failed part way, or an engine closing: every stage's device state, cache
    and K/V go (nothing leaks)."""
    for stage in runner.stages:
        stage.close()
        provider = stage.provider
        provider.close()
        if isinstance(provider, ExpertCache):
            stage.provider = provider.file
        stage.budget = None
    runner.close_kv()
