"""Where the configuration comes from and how it is told: the settings of each source (flags,
``STRATA_*`` variables, ``config.toml``), merged over the defaults into one
:class:`~strata.daemon.config.StrataConfig` (``load_config``) with errors that name the option,
the value and its source, and ``strata config show``'s lines (``describe_sources``)."""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from strata import paths
from strata.daemon.config import (
    ENV_PREFIX,
    ENV_RESERVED,
    OPTION_NAMES,
    ConfigError,
    Origin,
    Setting,
    StrataConfig,
    env_of,
)

SECRET_OPTIONS = frozenset({"api_key"})  # shown as set or unset, never in clear


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_bool(name: str) -> bool:
    return StrataConfig.model_fields[name].annotation is bool


# The options that steer the engine alone: what `strata generate` takes as flags (the daemon's
# HTTP, D-Bus and VRAM-control options do not apply to one generation without a daemon).
ENGINE_OPTIONS: frozenset[str] = frozenset({
    "model", "log_level", "threads", "context_length", "prefill_chunk_tokens", "kv_cache_type",
    "device", "cache_mib", "elastic_tail_mib", "elastic_reserve_mib", "host_budget_mib",
    "adapt_swaps", "prefetch_experts", "cpu_share", "verify_experts", "arena_chunk_mib",
    "fast_decode",
    "enforce_eager", "fast_prefill", "kv_keep_conversations", "kv_fixed", "devices",
    "layer_split",
})  # fmt: skip
# `strata models` and `strata pull`: the library's folder, and the daemon's address (which model
# it serves).
LIBRARY_OPTIONS: frozenset[str] = frozenset({"models_dir", "log_level", "host", "port"})
# `strata bench` sizes the cache itself (its --cache-mib is a list of budgets, all elastic).
BENCH_OPTIONS = ENGINE_OPTIONS - {"cache_mib", "elastic_tail_mib", "elastic_reserve_mib"}


def add_option_flags(parser: argparse.ArgumentParser, names: frozenset[str] | None = None) -> None:
    """Add one flag per option (only those in ``names`` when given). Values stay strings: the
    model validates them, not argparse."""
    group = parser.add_argument_group("options (also STRATA_* variables and config.toml keys)")
    group.add_argument(
        "--config",
        metavar="PATH",
        default=argparse.SUPPRESS,
        help="configuration file (default: $XDG_CONFIG_HOME/strata/config.toml; "
        "also STRATA_CONFIG)",
    )
    for name, field in StrataConfig.model_fields.items():
        if names is not None and name not in names:
            continue
        default = field.default if field.default is not None else "unset"
        kwargs: dict[str, Any] = {
            "dest": f"opt_{name}",
            "default": argparse.SUPPRESS,
            "help": f"{field.description} (default: {default})",
        }
        if _is_bool(name):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["metavar"] = name.upper()
        group.add_argument(flag_of(name), **kwargs)


def flag_settings(args: argparse.Namespace) -> dict[str, Setting]:
    """The options given as flags, from a namespace built with :func:`add_option_flags`."""
    given = vars(args)
    return {
        name: Setting(given[f"opt_{name}"], Origin.FLAG, flag_of(name))
        for name in OPTION_NAMES
        if f"opt_{name}" in given
    }


def env_settings(environ: Mapping[str, str]) -> dict[str, Setting]:
    out: dict[str, Setting] = {}
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX) or key in ENV_RESERVED:
            continue
        name = key[len(ENV_PREFIX) :].lower()
        if name not in StrataConfig.model_fields:
            raise ConfigError(f"{key}: unknown option (known: {_known(env_of)})")
        out[name] = Setting(value, Origin.ENV, key)
    return out


def file_settings(path: Path) -> dict[str, Setting]:
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}): not a TOML file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the configuration file: {e.strerror}") from None
    out: dict[str, Setting] = {}
    for key, value in data.items():
        if key not in StrataConfig.model_fields:
            raise ConfigError(f"{key} (in {path}): unknown option (known: {_known(str)})")
        where = f"{key} (in {path})"
        wrong = _toml_type_error(key, value)
        if wrong is not None:  # "8000" would pass as 8000, "yes" as true, 1e3 as 1000: silently
            raise ConfigError(f"{where}: invalid value {value!r} ({wrong})")
        out[key] = Setting(value, Origin.FILE, where)
    return out


# TOML has types, so the file's values are taken as typed: no string read as a number or a
# boolean, no float as an integer, no number as a boolean (flags and variables are text, parsed).
_SCALARS: dict[Any, tuple[str, tuple[type, ...]]] = {
    int: ("an integer", (int,)),
    int | None: ("an integer", (int,)),
    bool: ("true or false", (bool,)),
    bool | None: ("true or false", (bool,)),
    float: ("a number", (int, float)),
    float | None: ("a number", (int, float)),
}


def _toml_type_error(name: str, value: Any) -> str | None:
    """Why ``value`` (as TOML typed it) does not fit option ``name``'s scalar type, or None."""
    annotation = StrataConfig.model_fields[name].annotation
    kind = _SCALARS.get(annotation)
    if kind is None:
        return None  # strings, paths, choices and lists: their validators name what is wrong
    expected, types = kind
    if isinstance(value, types) and (bool in types or not isinstance(value, bool)):
        return None
    got = _toml_kind(value)
    hint = ""
    if isinstance(value, str) and bool not in types:
        hint = f": write {name} = {value.strip()} without quotes" if _number(value) else ""
    elif isinstance(value, str):
        hint = f": write {name} = true or {name} = false, without quotes"
    return f"expected {expected}, not {got}{hint}"


def _toml_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "a table" if isinstance(value, dict) else f"a {type(value).__name__}"


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _known(spell: Any) -> str:
    return ", ".join(spell(n) for n in OPTION_NAMES)


@dataclass(frozen=True)
class LoadedConfig:
    """The validated configuration and, per option, the setting it came from."""

    config: StrataConfig
    sources: dict[str, Setting]
    config_file: Path | None


def load_config(
    args: argparse.Namespace | None = None,
    environ: Mapping[str, str] | None = None,
) -> LoadedConfig:
    """Merge defaults < file < environment < flags and validate. Raises :class:`ConfigError`."""
    environ = os.environ if environ is None else environ
    args = args if args is not None else argparse.Namespace()
    config_file = _config_path(args, environ)
    layers: list[dict[str, Setting]] = []
    if config_file is not None:
        layers.append(file_settings(config_file))
    layers.append(env_settings(environ))
    layers.append(flag_settings(args))

    merged: dict[str, Setting] = {}
    for layer in layers:
        merged.update(layer)
    try:
        config = StrataConfig.model_validate({k: s.value for k, s in merged.items()})
    except ValidationError as e:
        raise ConfigError(_describe(e, merged)) from None

    sources = {
        name: merged.get(name)
        or Setting(StrataConfig.model_fields[name].default, Origin.DEFAULT, name)
        for name in OPTION_NAMES
    }
    return LoadedConfig(config, sources, config_file)


def _config_path(args: argparse.Namespace, environ: Mapping[str, str]) -> Path | None:
    named = getattr(args, "config", None) or environ.get("STRATA_CONFIG")
    if named:
        path = Path(named).expanduser()
        how = "--config" if getattr(args, "config", None) else "STRATA_CONFIG"
        if not path.is_file():
            raise ConfigError(f"{how}: configuration file {str(path)!r} does not exist")
        return path
    default = paths.config_dir(environ) / "config.toml"
    return default if default.is_file() else None


def _describe(error: ValidationError, merged: Mapping[str, Setting]) -> str:
    """One line for the first problem: the option as the user spelled it, the value, the need."""
    first = error.errors()[0]
    if not first["loc"]:  # a rule between options: its message names them
        return first["msg"].removeprefix("Value error, ")
    name = str(first["loc"][0])
    setting = merged.get(name)
    spelling = setting.spelling if setting else name
    value = setting.value if setting else first.get("input")
    expected = first["msg"].removeprefix("Value error, ")
    expected = expected.replace("Input should be", "expected").replace(
        "input should be", "expected"
    )
    if first["type"] == "literal_error":
        expected = expected.replace("'", "")
    return f"{spelling}: invalid value {value!r} ({expected})"


def describe_sources(loaded: LoadedConfig) -> list[str]:
    """Lines for ``strata config show``: ``name = value  # from where``."""
    width = max(len(n) for n in OPTION_NAMES)
    lines = []
    for name in OPTION_NAMES:
        value = getattr(loaded.config, name)
        setting = loaded.sources[name]
        shown = "unset" if value is None else _toml_value(value)
        if name in SECRET_OPTIONS and value is not None:
            shown = '"********"'  # set, but never shown
        where = {
            Origin.DEFAULT: "default",
            Origin.FILE: f"file {loaded.config_file}",
            Origin.ENV: f"environment {setting.spelling}",
            Origin.FLAG: f"command line {setting.spelling}",
        }[setting.origin]
        lines.append(f"{name:<{width}} = {shown:<24} # {where}")
    return lines


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
