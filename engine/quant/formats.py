"""Every weight type the engine reads, by GGML type: its one description (``quant/format.py``).

``FORMATS`` gathers the families' descriptions and checks each against gguf's table of block
sizes at import; ``fmt`` finds one or raises naming the type and the supported ones.
"""

from __future__ import annotations

from strata.engine.errors import UnsupportedQuantType
from strata.engine.quant import grids, kquants, legacy
from strata.engine.quant.format import FLOAT, Format, Q

FORMATS: dict[Q, Format] = {f.qtype: f for f in (*legacy.FORMATS, *kquants.FORMATS, *grids.FORMATS)}
for _f in FORMATS.values():
    _f.check()

SUPPORTED_TYPES: frozenset[Q] = frozenset(FORMATS)
FLOAT_TYPES: frozenset[Q] = frozenset(q for q, f in FORMATS.items() if f.kernel == FLOAT)
SUPPORTED_NAMES = ", ".join(t.name for t in sorted(SUPPORTED_TYPES))


def fmt(qtype: Q | int) -> Format:
    """The description of ``qtype``; UnsupportedQuantType naming it when there is none."""
    try:
        return FORMATS[Q(qtype)]
    except (ValueError, KeyError):
        name = Q(qtype).name if qtype in Q._value2member_map_ else repr(qtype)
        raise UnsupportedQuantType(
            f"quant type {name} is not supported (supported: {SUPPORTED_NAMES})"
        ) from None
