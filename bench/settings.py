"""What one ``strata bench`` run measures: built once at the edge, validated, then read-only.

Plain Python (no torch): the CLI parses its flags into these types, and the parsers raise
:class:`BenchError` with a message that names the flag and the value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from strata.engine.errors import EngineError

if TYPE_CHECKING:
    from strata.engine.options import EngineOptions

MiB = 2**20
GiB = 2**30

# `--synthetic NAME`: the bench's short names for the synth presets (the preset names work too).
SYNTHETIC_ALIASES = {"tiny": "tiny-qwen3moe"}
SYNTHETIC_NAMES = (
    "tiny",
    "qwen3-30b-a3b",
    "qwen3-30b-a3b-q4k",
    "qwen3-30b-a3b-q5k",
    "qwen3-30b-a3b-q2k",
    "qwen3-30b-a3b-q3km",
    "qwen3-30b-a3b-iq3s-iq4nl",
    "qwen3-30b-a3b-mxfp4moe",
    "mixtral-8x7b",
    "gpt-oss-20b",
    "gpt-oss-120b",
    "qwen3.6-35b-a3b",
    "qwen3-next-80b-a3b",
)

# Budgets given as a share of all experts. `none` is 0 MiB: every expert from RAM or the file.
BUDGET_SHARES = {"all": 1.0, "half": 0.5, "quarter": 0.25}
DEFAULT_GPU_BUDGETS = "all,half,quarter,none"
# On a CPU a cache budget only copies experts from the page cache into another host buffer, so
# the four budgets would measure the same memory four times: the default there is one row.
DEFAULT_CPU_BUDGETS = "none"

DEFAULT_PREFILL = (512, 4096)
DEFAULT_N_CPU_MOE = (0, 12, 24, 36, 48)
DECODE_PROMPT_TOKENS = 16  # the prompt before the timed decode; its prefill gives the TTFT
RESIZE_BYTES = 4 * GiB  # the resize test's shrink and grow
RESIZE_DECODE_TOKENS = 32  # the generation during which the cache shrinks


class BenchError(EngineError):
    """A bench setting that cannot be used; the message names the flag and the value."""


@dataclass(frozen=True)
class Budget:
    """One cache budget: a share of all experts (``all``, ``half``, ``quarter``) or MiB."""

    label: str  # as the user wrote it: "all", "half", "quarter", "none" or "8192"
    share: float | None = None
    mib: int | None = None

    def slots(self, n_experts: int, slots_for_bytes: int) -> int:
        """The cache size in slots: ``slots_for_bytes`` is what the arena fits in ``mib``."""
        if self.share is not None:
            return int(n_experts * self.share)
        return slots_for_bytes


def parse_budgets(text: str, flag: str = "--cache-mib") -> tuple[Budget, ...]:
    """``all,half,quarter,none`` or MiB (``8192,0``), in any mix; never empty, no repeats."""
    budgets: list[Budget] = []
    for raw in text.split(","):
        item = raw.strip().lower()
        if item in BUDGET_SHARES:
            budgets.append(Budget(item, share=BUDGET_SHARES[item]))
        elif item == "none":
            budgets.append(Budget("none", mib=0))
        else:
            try:
                mib = int(item)
            except ValueError:
                mib = -1
            if mib < 0:
                raise BenchError(
                    f"{flag}: invalid value {raw.strip()!r} in {text!r} (expected MiB >= 0 or "
                    "all, half, quarter, none, separated by commas)"
                )
            budgets.append(Budget(f"{mib} MiB", mib=mib))
    labels = [b.label for b in budgets]
    if len(set(labels)) != len(labels):
        raise BenchError(f"{flag}: invalid value {text!r} (a budget is listed twice)")
    return tuple(budgets)


def parse_int_list(text: str, flag: str, minimum: int) -> tuple[int, ...]:
    """A comma-separated list of integers >= ``minimum``, without repeats."""
    values = []
    for raw in text.split(","):
        try:
            value = int(raw.strip())
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise BenchError(
                f"{flag}: invalid value {raw.strip()!r} in {text!r} (expected integers "
                f">= {minimum}, separated by commas)"
            )
        values.append(value)
    if len(set(values)) != len(values):
        raise BenchError(f"{flag}: invalid value {text!r} (a value is listed twice)")
    return tuple(values)


def parse_int(text: str, flag: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise BenchError(f"{flag}: invalid value {text!r} (expected an integer >= {minimum})")
    return value


def parse_seconds(text: str, flag: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise BenchError(f"{flag}: invalid value {text!r} (expected seconds > 0)")
    return value


def parse_card_gib(text: str, flag: str = "--card-gib") -> float:
    """GiB > 0, a float (11.5 is fine): the free memory of the card ``--card-gib`` emulates."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise BenchError(f"{flag}: invalid value {text!r} (expected GiB > 0, e.g. 12 or 15.5)")
    return value


def synthetic_preset(name: str) -> str:
    """The synth preset a ``--synthetic`` name stands for; an unknown name is an error."""
    from strata.engine.synth import PRESETS
    from strata.engine.synth_gpt_oss import PRESETS as GPT_OSS
    from strata.engine.synth_hybrid import PRESETS as HYBRID

    preset = SYNTHETIC_ALIASES.get(name, name)
    if preset not in PRESETS and preset not in GPT_OSS and preset not in HYBRID:
        choices = ", ".join(SYNTHETIC_NAMES)
        raise BenchError(f"--synthetic: unknown model {name!r} (expected one of {choices})")
    return preset


def ensure_synthetic(
    preset: str, cache_dir: str | Path, progress: Callable[[int, int], None] | None = None
) -> Path:
    """The synthetic ``preset``'s file under ``cache_dir``, written on first use: the hybrids'
    by their streamed writer (``synth_hybrid``, which ``synth`` cannot import: it imports
    ``synth``), the others by ``synth.ensure_synthetic``."""
    from strata.engine import synth, synth_hybrid

    if preset in synth_hybrid.PRESETS:
        return synth_hybrid.ensure(preset, cache_dir, progress)
    return synth.ensure_synthetic(preset, cache_dir, progress)


@dataclass(frozen=True)
class BenchSettings:
    """One bench run. ``engine`` carries device, threads, context and chunk sizes; its cache
    size is the bench's to set (it sweeps ``budgets``)."""

    model: Path
    engine: EngineOptions
    budgets: tuple[Budget, ...]  # empty: llama.cpp only (--only-llama-cpp)
    synthetic: str | None = None
    reps: int = 3
    decode_tokens: int = 128
    prefill: tuple[int, ...] = DEFAULT_PREFILL
    time_limit_s: float | None = None  # stop starting Strata measurements after this long
    llama_bench: Path | None = None
    n_cpu_moe: tuple[int, ...] = DEFAULT_N_CPU_MOE
    seed: int = 0
    grammar: bool = False  # also decode under a grammar: the token mask's cost per token
    card_gib: float | None = None  # emulate a card with this much free (bench.card)
    # per llama-bench process: it loads the model once and runs every test
    llama_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.reps < 1:
            raise BenchError(f"--reps: invalid value {self.reps} (expected an integer >= 1)")
        if self.decode_tokens < 2:
            raise BenchError(
                f"--decode-tokens: invalid value {self.decode_tokens} (expected an integer >= 2)"
            )
        if not self.budgets and self.llama_bench is None:
            raise BenchError("--cache-mib: no budget given")
        if self.card_gib is not None and not 0 < self.card_gib < float("inf"):
            raise BenchError(f"--card-gib: invalid value {self.card_gib} (expected GiB > 0)")
        if not self.prefill or min(self.prefill) < 1:
            raise BenchError(f"--prefill: invalid value {self.prefill} (expected sizes >= 1)")
