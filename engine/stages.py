"""Layer stages: a model's layers split into contiguous runs, one per device.

With ``devices`` (``EngineOptions``) the decoder layers are cut into stages, stage ``i`` on
``devices[i]``: layers ``0 .. n0-1`` on the first, ``n0 .. n0+n1-1`` on the second, and so on.
The hidden state is handed from one stage to the next; everything a layer touches lives on its
stage: its dense weights, its K/V, its expert cache (arena, slots, host homes, tables) and its
share of the decode graph. A layer reaches a cache only through ``layer -> stage``, so one stage
can never read or write another's slots.

This module is the pure part: how the layers are split (``split_layers``), the checks of the
options (``check_layer_split``, ``check_per_device``) and how one RAM budget is shared
(``share_budget``). Plain Python, no torch; the per-stage state is each stage's runner's
(``engine.step.StageRunner``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from strata.engine.errors import EngineError

T = TypeVar("T")


def check_layer_split(layer_split: Sequence[int], n_layer: int, n_devices: int) -> tuple[int, ...]:
    """``layer_split`` as given: exactly one count per device, each a whole number >= 1, adding
    up to the model's ``n_layer``; otherwise an error naming the option, its value and the
    model's layer count."""
    value = tuple(layer_split)
    what = f"layer_split={list(value)}"
    if len(value) != n_devices:
        raise EngineError(
            f"{what}: needs one count per device ({n_devices} devices), the model has "
            f"{n_layer} layers"
        )
    for n in value:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise EngineError(
                f"{what}: every count must be a whole number of at least 1 (got {n!r}); the "
                f"model has {n_layer} layers"
            )
    if sum(value) != n_layer:
        raise EngineError(
            f"{what}: the counts add up to {sum(value)}, but the model has {n_layer} layers"
        )
    return value


def split_layers(n_layer: int, free: Sequence[int | None]) -> tuple[int, ...]:
    """The automatic split: layers in proportion to each device's free memory in bytes (None
    where unknown: then every device counts the same), at least one layer each, and every
    layer placed. Largest remainders get the layers the proportional floors leave over, the
    earlier device first among equals."""
    n = len(free)
    if n < 1:
        raise EngineError("devices: at least one device is needed")
    if n > n_layer:
        raise EngineError(
            f"devices: {n} devices for a model of {n_layer} layers (at least one layer each)"
        )
    for f in free:
        if f is not None and (isinstance(f, bool) or not isinstance(f, int) or f < 0):
            raise EngineError(f"free memory of {f!r} bytes is not a whole number >= 0")
    if any(f is None for f in free) or sum(f or 0 for f in free) == 0:
        weights = [1] * n
    else:
        weights = [f or 0 for f in free]
    total = sum(weights)
    # one layer each first, the rest in proportion
    rest = n_layer - n
    shares = [rest * w for w in weights]  # exact: share_i = shares[i] / total
    counts = [1 + s // total for s in shares]
    left = n_layer - sum(counts)
    by_remainder = sorted(range(n), key=lambda i: (-(shares[i] % total), i))
    for i in by_remainder[:left]:
        counts[i] += 1
    return tuple(counts)


def layer_ranges(counts: Sequence[int]) -> list[range]:
    """Contiguous ranges of layers, one per count, in order."""
    out, at = [], 0
    for n in counts:
        out.append(range(at, at + n))
        at += n
    return out


def describe_split(ranges: Sequence[range], devices: Sequence[str]) -> str:
    """``layers 0-23 on cuda:0, 24-47 on cuda:1`` (the log line at load)."""
    parts = []
    for r, d in zip(ranges, devices, strict=True):
        span = f"{r.start}" if len(r) == 1 else f"{r.start}-{r.stop - 1}"
        parts.append(f"{span} on {d}")
    return "layers " + ", ".join(parts)


def per_device(name: str, value: T | Sequence[T] | None, n_devices: int) -> list[T | None]:
    """``value`` for each device: one callable (or None) shared by all, or a sequence with
    exactly one element per device; a sequence of another length is an error naming it."""
    if value is None or callable(value):
        return [value] * n_devices  # type: ignore[list-item]
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise EngineError(f"{name}={value!r}: expected a callable or one callable per device")
    if len(value) != n_devices:
        raise EngineError(
            f"{name}: {len(value)} given, but there are {n_devices} devices (one per device)"
        )
    return list(value)


def share_budget(total: int, demands: Sequence[int]) -> list[int]:
    """One budget shared among stages: each gets what it asks for when the budget covers all of
    it, else a share in proportion to its demand (rounded down, so the shares never add up to
    more than ``total``)."""
    if total < 0:
        raise ValueError(f"a budget of {total} bytes is negative")
    if any(d < 0 for d in demands):
        raise ValueError(f"demands {list(demands)}: each must be >= 0")
    want = sum(demands)
    if want <= total:
        return list(demands)
    return [total * d // want for d in demands]
