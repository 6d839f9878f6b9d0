"""Where routed experts live and how the MoE layer gets them: the provider seam, the slot table
and the expert cache over the elastic arena, the usage profile.

The bookkeeping modules (``slots``, ``profile``) import no torch; the provider names below are
loaded on first use so that importing them stays cheap.
"""

from __future__ import annotations

from typing import Any

_PROVIDER_NAMES = ("ExpertProvider", "ExpertWeights", "FileExpertProvider", "ProviderStats")
__all__ = list(_PROVIDER_NAMES)


def __getattr__(name: str) -> Any:
    if name in _PROVIDER_NAMES:
        from strata.engine.experts import provider

        return getattr(provider, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
