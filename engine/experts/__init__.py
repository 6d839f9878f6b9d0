"""Where routed experts live and how the MoE layer gets them: the provider seam, the slot table
and the expert cache over the elastic arena, the usage profile."""

from strata.engine.experts.provider import (
    ExpertProvider,
    ExpertWeights,
    FileExpertProvider,
    ProviderStats,
)

__all__ = ["ExpertProvider", "ExpertWeights", "FileExpertProvider", "ProviderStats"]
