"""``strata bench --merge``: the results of several runs of one measurement, combined into one.

Where one command may hold a GPU only for so long (a shared or rented machine), a full bench is
split into runs (``all,half`` in one, ``quarter,none`` in another, possibly on two GPUs at once,
llama.cpp alone in a third with ``--only-llama-cpp``). The merged result has the layout
``run_bench`` returns, so the report, the plot and the JSON work on it unchanged; each row says
which run measured it (``source``) and ``merged_from`` keeps what differs between the runs.

Plain Python on the parsed JSON: no torch, nothing measured, the inputs are not modified.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from strata.bench import stats
from strata.bench.settings import BenchError

Result = dict[str, Any]
Named = tuple[str, Mapping[str, Any]]  # (source name, parsed result)

REQUIRED = ("model", "settings", "device", "strata")
# What makes two runs parts of one measurement: these fields are equal in every input.
SAME_FIELDS = {
    "model": ("name", "arch", "file_bytes", "n_experts", "slot_bytes"),
    "settings": (
        "reps", "decode_tokens", "decode_prompt_tokens", "prefill", "context_length",
        "prefill_chunk_tokens", "kv_cache_type", "arena_chunk_mib", "seed",
    ),
    "device": ("name", "type"),
}  # fmt: skip
_ABSENT = object()


def merge_results(results: Sequence[Named]) -> Result:
    """One result from the results of runs of the same model, settings and device. Raises
    ``BenchError`` naming the source and the value when they cannot be combined."""
    if len(results) < 2:
        raise BenchError(f"--merge: needs at least 2 results to combine, got {len(results)}")
    for source, result in results:
        _check_shape(source, result)
    _check_same(results)
    first = results[0][1]
    rows, budgets, slots = _rows(results)
    merged: Result = {
        "model": dict(first["model"]),
        "settings": {
            **first["settings"],
            "budgets": budgets,
            "budget_slots": slots,
            "time_limit_s": [r["settings"].get("time_limit_s") for _, r in results],
        },
        "interrupted": _interrupted(results),
        "nvml": first.get("nvml"),
        "bandwidth": first.get("bandwidth", {"reason": "not in the first merged result"}),
        "device": dict(first["device"]),
        "strata": rows,
        "resize": _resize(results),
    }
    llama = _at_most_one(results, "llama_cpp", "llama.cpp was run")
    if llama is not None:
        merged["llama_cpp"] = llama
    stats.add_pairs(merged)
    merged["wall_s"] = None
    merged["wall_s_reason"] = (
        f"merged from {len(results)} runs; each run's own wall_s is under merged_from"
    )
    merged["merged_from"] = [
        {
            "source": source,
            "command": r.get("command"),
            "wall_s": r.get("wall_s"),
            "load_s": r.get("load_s"),
            "device": r["device"],
            "bandwidth": r.get("bandwidth"),
            "nvml": r.get("nvml"),
            "interrupted": r.get("interrupted"),
        }
        for source, r in results
    ]
    return merged


def _check_shape(source: str, result: object) -> None:
    if not isinstance(result, Mapping):
        kind = type(result).__name__
        raise BenchError(f"--merge: {source} is not a strata bench result (a JSON {kind})")
    missing = [k for k in REQUIRED if k not in result]
    if missing:
        raise BenchError(
            f"--merge: {source} is not a strata bench result: it has no {', '.join(missing)}"
        )
    if "merged_from" in result:
        # its rows already name their runs; merge those runs' own results instead
        raise BenchError(f"--merge: {source} is itself a merged result: merge its inputs instead")
    for key in ("model", "settings", "device"):
        if not isinstance(result[key], Mapping):
            raise BenchError(f"--merge: {source}: {key} is not an object")
    rows = result["strata"]
    if not isinstance(rows, list):
        raise BenchError(f"--merge: {source}: strata is not a list")
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping) or "budget" not in row:
            raise BenchError(f"--merge: {source}: strata[{i}] is not a row with a budget")


def _check_same(results: Sequence[Named]) -> None:
    s0, r0 = results[0]
    for section, fields in SAME_FIELDS.items():
        for field in fields:
            v0 = r0[section].get(field, _ABSENT)
            for s, r in results[1:]:
                v = r[section].get(field, _ABSENT)
                if v != v0:
                    name = f"{section}.{field}"
                    raise BenchError(
                        f"--merge: {name} differs: {_has(s0, name, v0)}, {_has(s, name, v)}"
                    )


def _has(source: str, name: str, value: object) -> str:
    return f"{source} has no {name}" if value is _ABSENT else f"{source} has {value!r}"


def _rows(results: Sequence[Named]) -> tuple[list[Result], list[str], list[int]]:
    """The rows in input order, each with its ``source``; a budget is measured by one input
    only; a skipped row goes when another input measured its budget (or already skipped it)."""
    measured_in: dict[str, str] = {}
    for source, result in results:
        for row in result["strata"]:
            if row.get("skipped"):
                continue
            budget = row["budget"]
            if budget in measured_in:
                raise BenchError(
                    f"--merge: budget {budget!r} was measured in both {measured_in[budget]} and "
                    f"{source}: keep one of the two runs"
                )
            measured_in[budget] = source
    rows: list[Result] = []
    budgets: list[str] = []
    slots: list[int] = []
    for source, result in results:
        s = result["settings"]
        slot_of = dict(zip(s.get("budgets", []), s.get("budget_slots", []), strict=False))
        for row in result["strata"]:
            budget = row["budget"]
            if row.get("skipped") and (budget in measured_in or budget in budgets):
                continue
            if budget not in slot_of:
                raise BenchError(
                    f"--merge: {source}: budget {budget!r} has a row but is not in "
                    "settings.budgets and settings.budget_slots"
                )
            rows.append({**row, "source": source})
            budgets.append(budget)
            slots.append(slot_of[budget])
    return rows, budgets, slots


def _resize(results: Sequence[Named]) -> Result | None:
    """The resize test one input measured. Every run that reached its largest budget has a
    ``resize``, most with only the ``reason`` it was not measured: without a measured one, the
    first reason stays, so the report still says why."""
    measured = [(s, r) for s, r in results if r.get("resize") and "reason" not in r["resize"]]
    if len(measured) > 1:
        raise BenchError(
            f"--merge: the resize test was measured in both {measured[0][0]} and "
            f"{measured[1][0]}: a merged result holds one (set resize to null in the other)"
        )
    for source, result in measured or results:
        if result.get("resize"):
            return {**result["resize"], "source": source}
    return None


def _at_most_one(results: Sequence[Named], key: str, what: str) -> Result | None:
    carried = [(s, r[key]) for s, r in results if r.get(key) is not None]
    if len(carried) > 1:
        raise BenchError(
            f"--merge: {what} in both {carried[0][0]} and {carried[1][0]}: a merged result "
            f"holds one {key}"
        )
    if not carried:
        return None
    source, value = carried[0]
    return {**value, "source": source}


def _interrupted(results: Sequence[Named]) -> str | None:
    parts = [f"{s}: {r['interrupted']}" for s, r in results if r.get("interrupted")]
    return "; ".join(parts) or None
