"""The bench's arithmetic: summaries of repetitions, rates from raw counts, the memory roofline and
the pairing of Strata rows with llama.cpp rows. Plain Python on plain numbers and dicts (the JSON
the bench prints), so every number a report shows can be recomputed from the raw samples."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Row = dict[str, Any]


def summary(values: Sequence[float]) -> dict[str, float] | None:
    """Median, min, max and spread ((max - min) / median) of the repetitions; None if empty."""
    if not values:
        return None
    median = statistics.median(values)
    lo, hi = min(values), max(values)
    return {
        "median": median,
        "min": lo,
        "max": hi,
        "spread": (hi - lo) / median if median else 0.0,
        "n": len(values),
    }


def decode_rates(runs: Iterable[Mapping[str, Any]]) -> list[float]:
    """tok/s of each decode run: the steps after the first token over the time they took."""
    return [r["steps"] / r["decode_s"] for r in runs if r["steps"] > 0 and r["decode_s"] > 0]


def prefill_rates(runs: Iterable[Mapping[str, Any]]) -> list[float]:
    return [r["tokens"] / r["seconds"] for r in runs if r["seconds"] > 0]


def hit_rate(runs: Sequence[Mapping[str, Any]]) -> float | None:
    hits = sum(r["hits"] for r in runs)
    total = hits + sum(r["misses"] for r in runs)
    return hits / total if total else None


def prefetch(runs: Sequence[Mapping[str, Any]]) -> dict[str, float] | None:
    """The GPU decode's copies ahead (``kernels.prefetch``): made per step, the share of them
    the routing then chose, and the bytes per step of the others (PCIe traffic beyond the
    misses' own); None where none were made (no RAM homes, the option off, a CPU run)."""
    steps = sum(r["steps"] for r in runs)
    made = sum(r.get("prefetched", 0) for r in runs)
    if not steps or not made:
        return None
    return {
        "per_token": made / steps,
        "chosen_share": sum(r["prefetch_used"] for r in runs) / made,
        "unused_bytes_per_token": sum(r["prefetch_unused_bytes"] for r in runs) / steps,
    }


def cpu_share(runs: Sequence[Mapping[str, Any]]) -> dict[str, float] | None:
    """The GPU decode's experts computed by the CPU (``cpu_share``): per step, and their bytes
    per step (read from RAM by the CPU instead of over PCIe); None where it computed none."""
    steps = sum(r["steps"] for r in runs)
    done = sum(r.get("cpu_computed", 0) for r in runs)
    if not steps or not done:
        return None
    return {
        "per_token": done / steps,
        "bytes_per_token": sum(r.get("cpu_bytes", 0) for r in runs) / steps,
    }


def per_step(runs: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """``key`` (bytes) per decode step, over all runs."""
    steps = sum(r["steps"] for r in runs)
    return sum(r[key] for r in runs) / steps if steps else None


def roofline(
    runs: Sequence[Mapping[str, Any]],
    dense_bytes: int,
    device_bytes_per_s: float,
    pcie_bytes_per_s: float,
) -> dict[str, float] | None:
    """How close decode came to the memory roofline: each step must read the dense weights and
    its cache hits from device memory and its misses over PCIe, less those the CPU computed
    from RAM itself (``cpu_share``, read beside the link: counted as free); the bound is the
    time those reads take at the measured bandwidths, the fraction is bound / measured time per
    step. ``link_bound_s_per_token``: the same with every miss over PCIe (no CPU share)."""
    steps = sum(r["steps"] for r in runs)
    seconds = sum(r["decode_s"] for r in runs)
    if not steps or seconds <= 0:
        return None
    hit = sum(r["hit_bytes"] for r in runs) / steps
    miss = sum(r["miss_bytes"] for r in runs) / steps
    cpu = sum(r.get("cpu_bytes", 0) for r in runs) / steps
    vram_s = (dense_bytes + hit) / device_bytes_per_s
    bound = vram_s + (miss - cpu) / pcie_bytes_per_s
    measured = seconds / steps
    return {
        "dense_bytes_per_token": float(dense_bytes),
        "hit_bytes_per_token": hit,
        "miss_bytes_per_token": miss,
        "cpu_bytes_per_token": cpu,
        "link_bound_s_per_token": vram_s + miss / pcie_bytes_per_s,
        "device_bytes_per_s": device_bytes_per_s,
        "pcie_bytes_per_s": pcie_bytes_per_s,
        "bound_s_per_token": bound,
        "measured_s_per_token": measured,
        "fraction": bound / measured,
    }


def prompt_link(
    runs: Sequence[Mapping[str, Any]], pcie_bytes_per_s: float
) -> dict[str, float] | None:
    """What a prompt's reads over PCIe allow: a chunk reads each expert it routes to once, and
    a long chunk routes to nearly every expert, so with experts outside VRAM the link can bound
    prompt reading however fast the products are. Bytes a token over the link (its misses, less
    any the CPU computed) and the prompt speed the link alone would allow (None where nothing
    crossed it); None without runs."""
    tokens = sum(r["tokens"] for r in runs)
    if not tokens or pcie_bytes_per_s <= 0:
        return None
    link = sum(r["miss_bytes"] - r.get("cpu_bytes", 0) for r in runs)
    return {
        "pcie_bytes_per_token": link / tokens,
        "link_bound_tok_s": tokens * pcie_bytes_per_s / link if link > 0 else None,
        "pcie_bytes_per_s": pcie_bytes_per_s,
    }


# -- the two engines side by side -----------------------------------------------------------------


def strata_speeds(row: Mapping[str, Any]) -> dict[str, float]:
    """Median tok/s of a Strata row by llama-bench test name: ``pp512``, ``tg128``."""
    out: dict[str, float] = {}
    for p in row.get("prefill", []):
        if p.get("tok_s"):
            out[f"pp{p['tokens']}"] = p["tok_s"]["median"]
    decode = row.get("decode") or {}
    if decode.get("tok_s"):
        out[f"tg{decode['tokens']}"] = decode["tok_s"]["median"]
    return out


def llama_speeds(row: Mapping[str, Any]) -> dict[str, float]:
    return {name: t["tok_s"]["median"] for name, t in row.get("tests", {}).items() if t["tok_s"]}


def pair_rows(strata_rows: Sequence[Row], llama_rows: Sequence[Row]) -> list[Row]:
    """Each Strata row with the llama.cpp row whose peak VRAM is nearest, and the speed ratios
    (Strata / llama.cpp) of the tests both ran. Rows without a peak are left out."""
    candidates = [r for r in llama_rows if r.get("peak_vram_bytes") is not None]
    pairs = []
    for s in strata_rows:
        peak = (s.get("memory") or {}).get("peak_vram_bytes")
        if peak is None or not candidates:
            continue
        near = min(candidates, key=lambda r: (abs(r["peak_vram_bytes"] - peak), r["n_cpu_moe"]))
        ours, theirs = strata_speeds(s), llama_speeds(near)
        tests = {}
        for name in sorted(ours.keys() | theirs.keys(), key=_test_order):
            a, b = ours.get(name), theirs.get(name)
            tests[name] = {"strata": a, "llama": b, "ratio": a / b if a and b else None}
        pairs.append(
            {
                "budget": s["budget"],
                "strata_peak_vram_bytes": peak,
                "n_cpu_moe": near["n_cpu_moe"],
                "llama_peak_vram_bytes": near["peak_vram_bytes"],
                "tests": tests,
            }
        )
    return pairs


def _test_order(name: str) -> tuple[int, int]:
    # pp before tg, then by size
    return (0 if name.startswith("pp") else 1, int(name[2:]))


def add_pairs(result: dict[str, Any]) -> None:
    """Set ``result["pairs"]`` from its measured Strata rows and the llama.cpp rows that ran,
    with ``pairs_reason`` when llama.cpp was run but nothing could be paired."""
    llama = result.get("llama_cpp")
    ok = [r for r in result.get("strata", []) if not r.get("skipped")]
    ran = [r for r in (llama or {}).get("rows", []) if not r.get("error")]
    result["pairs"] = pair_rows(ok, ran) if llama is not None else []
    if llama is not None and not result["pairs"]:
        result["pairs_reason"] = (
            "no llama.cpp run succeeded" if not ran
            else "no peak VRAM on one side (CPU run or no NVML)"
        )  # fmt: skip
