"""The engine's options: one table of defaults and bounds that the daemon's configuration reads,
checked once when ``EngineOptions`` is built, every bad value an error naming the option."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from strata.daemon.config import ENGINE_NAMES, KvCacheType, StrataConfig
from strata.engine.errors import EngineError
from strata.engine.options import BOUNDS, DEFAULTS, KV_CACHE_TYPES, EngineOptions

# what the configuration resolves at the edge before the engine sees it (engine_setup)
RESOLVED_AT_THE_EDGE = {"device": ("auto", "cpu")}


def _config_name(option: str) -> str:
    return {v: k for k, v in ENGINE_NAMES.items()}.get(option, option)


def test_every_engine_option_the_config_has_gets_the_engines_default() -> None:
    config, options = StrataConfig(), EngineOptions()
    shared = 0
    for f in dataclasses.fields(EngineOptions):
        name = _config_name(f.name)
        if name not in StrataConfig.model_fields:
            continue
        shared += 1
        mine, theirs = getattr(config, name), getattr(options, f.name)
        if f.name in RESOLVED_AT_THE_EDGE:
            assert (mine, theirs) == RESOLVED_AT_THE_EDGE[f.name]
            continue
        assert mine == theirs, f"{name}: config {mine!r}, EngineOptions {theirs!r}"
    assert shared == len(dataclasses.fields(EngineOptions))  # every engine option is configurable


def test_the_config_takes_its_bounds_from_the_engines_table() -> None:
    for option, bound in BOUNDS.items():
        field = StrataConfig.model_fields[_config_name(option)]
        ge = [m.ge for m in field.metadata if getattr(m, "ge", None) is not None]
        le = [m.le for m in field.metadata if getattr(m, "le", None) is not None]
        if option == "arena_chunk_mib":  # the configuration asks for a GPU granule at least
            assert ge[0] >= bound.low  # type: ignore[operator]
        else:
            assert ge == [bound.low], option
        assert le == ([] if bound.high is None else [bound.high]), option
    assert typing.get_args(KvCacheType) == KV_CACHE_TYPES


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("threads", 0, "threads=0: must be a whole number between 1 and 1024"),
        ("context_length", 8, "context_length=8: must be a whole number >= 16"),
        ("cache_mib", -1, "cache_mib=-1: must be a whole number >= 0"),
        ("host_budget_mib", -1, "host_budget_mib=-1: must be a whole number >= 0"),
        ("adapt_swaps", -1, "adapt_swaps=-1: must be a whole number between 0 and 256"),
        ("prefetch_experts", 257, "prefetch_experts=257: must be a whole number between 0"),
        ("kv_keep_conversations", 65, "kv_keep_conversations=65: must be a whole number"),
        ("cpu_share", 1.5, "cpu_share=1.5: must be a number between 0 and 1"),
        ("cpu_share", True, "cpu_share=True: must be a number"),
        ("prefill_chunk_tokens", "8", "prefill_chunk_tokens='8': must be a whole number"),
        ("arena_chunk_mib", 2.0, "arena_chunk_mib=2.0: must be a whole number"),
        ("kv_cache_type", "q8", "kv_cache_type='q8': expected one of f16, f32"),
        ("layer_split", (2, 2), r"layer_split=\[2, 2\]: needs devices"),
        ("devices", (), r"devices=\(\): expected a list of at least one device"),
    ],
)
def test_a_bad_option_is_an_error_naming_it_and_its_value(
    option: str, value: object, message: str
) -> None:
    with pytest.raises(EngineError, match=message):
        EngineOptions(**{option: value})  # type: ignore[arg-type]


def test_unset_options_and_the_table_agree() -> None:
    assert DEFAULTS == {f.name: f.default for f in dataclasses.fields(EngineOptions)}
    assert EngineOptions(cpu_share=None, threads=None).cpu_share is None
    assert dataclasses.replace(EngineOptions(), cpu_share=0.25).cpu_share == 0.25
