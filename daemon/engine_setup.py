"""From the configuration to the engine's options and model: shared by ``strata generate``,
``strata bench`` and ``strata serve`` (the one place that turns config options into engine ones)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from strata import paths
from strata.daemon.config import StrataConfig

if TYPE_CHECKING:
    from strata.engine.options import EngineOptions

log = logging.getLogger(__name__)


def models_dir(config: StrataConfig) -> Path:
    """The model library's folder: the ``models_dir`` option, else the XDG data folder's."""
    from strata.daemon import library

    return config.models_dir if config.models_dir is not None else library.default_dir()


def model_path(config: StrataConfig) -> Path:
    """The configured model (a file, or a library name resolved to its file), or the built-in
    demo model (written on first use)."""
    if config.model is not None:
        from strata.daemon import library

        return library.resolve(models_dir(config), config.model)
    from strata.engine.demo import ensure_demo_model

    path = ensure_demo_model(paths.cache_dir())
    log.info("no model configured: using the built-in demo model %s (random weights)", path)
    return path


def engine_options(config: StrataConfig, device: str | None = None) -> EngineOptions:
    from strata.engine.options import EngineOptions

    split: dict[str, object] = {}
    if config.devices is not None:  # a layer split: one stage per device (unset: as before)
        split["devices"] = tuple(config.devices)
        split["layer_split"] = tuple(config.layer_split) if config.layer_split else None
    return EngineOptions(
        context_length=config.context_length,
        threads=config.threads,
        prefill_chunk_tokens=config.prefill_chunk_tokens,
        kv_cache_type=config.kv_cache_type,
        # with a split, the first stage's (the engine places each stage on its own device)
        device=device
        or resolve_device_name(config.devices[0] if config.devices else config.device),
        cache_mib=config.cache_mib,  # the budget asked for (the status's cache_mib: what is mapped)
        elastic_tail_mib=config.elastic_tail_mib,
        arena_chunk_mib=config.arena_chunk_mib,
        # the automatic reserve at load; the daemon's reserve_mib is the run-time reserve only
        reserve_mib=config.elastic_reserve_mib,
        fast_decode=config.fast_decode,
        enforce_eager=config.enforce_eager,
        fast_prefill=config.fast_prefill,
        host_budget_mib=config.host_budget_mib,
        adapt_swaps=config.adapt_swaps,
        prefetch_experts=config.prefetch_experts,
        cpu_share=config.cpu_share,
        verify_experts=config.verify_experts,
        kv_keep_conversations=config.kv_keep_conversations,
        kv_fixed=config.kv_fixed,
        **split,  # type: ignore[arg-type]
    )


def resolve_device_name(name: str) -> str:
    """``auto`` becomes the first CUDA device when there is one, else the CPU (logged)."""
    if name != "auto":
        return name
    import torch

    if torch.cuda.is_available():
        return "cuda:0"
    log.info("no CUDA device: computing on the CPU with the host arena")
    return "cpu"
