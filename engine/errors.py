"""The engine's exception hierarchy, mapped once at each edge (CLI, HTTP, D-Bus)."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class ModelLoadError(EngineError):
    """A model file that cannot be used; the message names the file and the reason."""


class UnsupportedArchitecture(ModelLoadError):
    """``general.architecture`` names an architecture with no module under ``engine/models``."""


class UnsupportedQuantType(ModelLoadError):
    """A tensor is stored in a quantisation type the engine cannot read."""


class KnobError(EngineError):
    """A developer's environment knob (``STRATA_DECODE_TUNE``, ``STRATA_PDL``) with a value
    the engine cannot use; the message names the variable and the value."""


class TokenizerError(EngineError):
    """A vocabulary that cannot be turned into a tokenizer, or text that cannot be encoded."""


class TemplateError(EngineError):
    """A chat template that does not parse or raises while rendering."""


class ContextOverflow(EngineError):
    """The prompt plus the tokens asked for do not fit the context window."""


class GenerationCancelled(EngineError):
    """A generation was cancelled between two steps."""
