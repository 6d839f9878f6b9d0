"""XDG base directories: config, state (the expert profile), cache (the demo model) and data (the
model library)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

APP = "strata"


def _base(environ: Mapping[str, str], var: str, fallback: str) -> Path:
    # The XDG spec says a relative value is invalid and must be ignored.
    value = environ.get(var, "")
    if value and os.path.isabs(value):
        return Path(value)
    return Path(environ.get("HOME") or Path.home()) / fallback


def config_dir(environ: Mapping[str, str] | None = None) -> Path:
    return _base(os.environ if environ is None else environ, "XDG_CONFIG_HOME", ".config") / APP


def state_dir(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    return _base(env, "XDG_STATE_HOME", ".local/state") / APP


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    return _base(os.environ if environ is None else environ, "XDG_CACHE_HOME", ".cache") / APP


def data_dir(environ: Mapping[str, str] | None = None) -> Path:
    return _base(os.environ if environ is None else environ, "XDG_DATA_HOME", ".local/share") / APP
