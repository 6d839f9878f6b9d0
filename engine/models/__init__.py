"""One module per GGUF ``general.architecture``, each exporting ``ModelArgs`` and ``Model``."""

from __future__ import annotations

import importlib
from types import ModuleType

from strata.engine.errors import UnsupportedArchitecture

SUPPORTED = ("qwen3moe", "llama")


def architecture_module(arch: str) -> ModuleType:
    """The module for ``arch``; an architecture without one is an error that names it."""
    if arch not in SUPPORTED:
        raise UnsupportedArchitecture(
            f"architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED)})"
        )
    return importlib.import_module(f"{__name__}.{arch}")
