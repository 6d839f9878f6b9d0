"""``strata bench --merge``'s rules on hand-built results: which runs can be combined, how their
rows, settings, resize test and llama.cpp runs come together, and errors that name the value."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from strata.bench import report, stats
from strata.bench.merge import REQUIRED, SAME_FIELDS, merge_results
from strata.bench.settings import BenchError

MiB = 2**20
N_EXPERTS = 64
SLOT = 3 * MiB
SLOTS = {"all": 64, "half": 32, "quarter": 16, "none": 0}
Result = dict[str, Any]


def tok_s(median: float) -> dict[str, float]:
    return {"median": median, "min": median, "max": median, "spread": 0.0, "n": 2}


def measured(budget: str, vram_mib: int | None = None, tg: float = 100.0) -> Result:
    """A Strata row as ``StrataBench.measure`` writes it, with the fields the report reads."""
    slots = SLOTS[budget]
    return {
        "budget": budget,
        "cache_experts": slots,
        "total_experts": N_EXPERTS,
        "cache_bytes": slots * SLOT,
        "prefill": [{"tokens": 64, "tok_s": tok_s(1000.0)}],
        "decode": {
            "tokens": 8,
            "tok_s": tok_s(tg),
            "ttft_s": tok_s(0.01),
            "hit_rate": slots / N_EXPERTS,
            "pcie_bytes_per_token": None,
            "roofline": None,
        },
        "memory": {
            "peak_vram_bytes": None if vram_mib is None else vram_mib * MiB,
            "peak_rss_bytes": 500 * MiB,
        },
    }


def skipped(budget: str) -> Result:
    return {"budget": budget, "skipped": "time limit of 60 s reached before this budget"}


def bench_result(*rows: Result, **top: Any) -> Result:
    """A minimal valid result of ``run_bench`` (then the CLI's ``command``) holding ``rows``."""
    labels = [r["budget"] for r in rows]
    result: Result = {
        "model": {
            "path": "/models/tiny.gguf",
            "name": "tiny",
            "synthetic": "tiny",
            "arch": "qwen3moe",
            "file_bytes": 40 * MiB,
            "n_experts": N_EXPERTS,
            "slot_bytes": SLOT,
            "expert_bytes": N_EXPERTS * SLOT,
            "dense_bytes_per_token": 1_000_000,
        },
        "settings": {
            "reps": 2,
            "decode_tokens": 8,
            "decode_prompt_tokens": 16,
            "prefill": [64],
            "context_length": 64,
            "budgets": labels,
            "budget_slots": [SLOTS[b] for b in labels],
            "prefill_chunk_tokens": 512,
            "kv_cache_type": "f16",
            "arena_chunk_mib": 32,
            "time_limit_s": None,
            "seed": 0,
        },
        "interrupted": None,
        "nvml": {"reason": None, "base_used_bytes": 3 * MiB, "after_cuda_init_used_bytes": 0},
        "bandwidth": {
            "device_bytes_per_s": 4.1e12,
            "pcie_bytes_per_s": 5.5e10,
            "pcie_pageable_bytes_per_s": 6.6e9,
        },
        "load_s": 1.5,
        "device": {"name": "NVIDIA H200", "type": "cuda", "torch": "2.11.0", "threads": 2},
        "strata": list(rows),
        "resize": {"reason": "the cache (192 MiB) is smaller than 4 GiB"},
        "pairs": [],
        "wall_s": 100.0,
        "command": ["strata", "bench", "--json"],
    }
    result.update(top)
    return result


def llama_cpp(*peaks_mib: int, error: str | None = None) -> Result:
    """llama-bench rows, ``--n-cpu-moe`` 0, 12, ... with the given peak VRAM each."""
    rows = []
    for i, peak in enumerate(peaks_mib):
        tests = {"pp64": {"tok_s": tok_s(5000.0)}, "tg8": {"tok_s": tok_s(300.0 / (1 + i))}}
        rows.append(
            {
                "n_cpu_moe": 12 * i,
                "peak_vram_bytes": peak * MiB,
                "peak_rss_bytes": 400 * MiB,
                "error": error,
                "tests": {} if error else tests,
            }
        )
    return {"binary": "/opt/llama-bench", "rows": rows}


def error_of(*results: Result) -> str:
    names = ["a.json", "b.json", "c.json"]
    with pytest.raises(BenchError) as e:
        merge_results(list(zip(names, results, strict=False)))
    return str(e.value)


def merge(*results: Result) -> Result:
    return merge_results(list(zip(["a.json", "b.json", "c.json"], results, strict=False)))


# -- which results can be combined ----------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1])
def test_fewer_than_two_results_is_an_error(n: int) -> None:
    with pytest.raises(BenchError, match=f"--merge: needs at least 2 results to combine, got {n}"):
        merge_results([("a.json", bench_result(measured("all")))][:n])


@pytest.mark.parametrize("part", REQUIRED)
def test_a_result_without_a_part_is_an_error_naming_the_source_and_the_part(part: str) -> None:
    b = bench_result(measured("none"))
    del b[part]
    message = error_of(bench_result(measured("all")), b)
    assert message == f"--merge: b.json is not a strata bench result: it has no {part}"


def test_json_that_is_not_an_object_is_an_error_naming_the_source() -> None:
    message = error_of(bench_result(measured("all")), [1, 2])  # type: ignore[arg-type]
    assert message == "--merge: b.json is not a strata bench result (a JSON list)"


def test_a_row_without_a_budget_is_an_error_naming_the_source_and_the_row() -> None:
    b = bench_result(measured("none"))
    b["strata"].append({"skipped": "?"})
    assert error_of(bench_result(measured("all")), b) == (
        "--merge: b.json: strata[1] is not a row with a budget"
    )


def test_a_merged_result_is_not_merged_again() -> None:
    merged = merge(bench_result(measured("all")), bench_result(measured("none")))
    message = error_of(merged, bench_result(measured("half")))
    assert message == "--merge: a.json is itself a merged result: merge its inputs instead"


def _other(value: Any) -> Any:
    if isinstance(value, bool) or value is None:
        return "other"
    if isinstance(value, int):
        return value + 1
    if isinstance(value, str):
        return value + "-other"
    assert isinstance(value, list)
    return [*value, 4096]


FIELDS = [(section, field) for section, fields in SAME_FIELDS.items() for field in fields]


@pytest.mark.parametrize(("section", "field"), FIELDS, ids=[f"{s}.{f}" for s, f in FIELDS])
def test_a_differing_field_is_an_error_naming_it_both_sources_and_both_values(
    section: str, field: str
) -> None:
    a, b = bench_result(measured("all")), bench_result(measured("none"))
    ours = a[section][field]
    b[section][field] = theirs = _other(ours)
    assert error_of(a, b) == (
        f"--merge: {section}.{field} differs: a.json has {ours!r}, b.json has {theirs!r}"
    )


def test_different_reps_read_as_the_user_would_write_them() -> None:
    a, b = bench_result(measured("all")), bench_result(measured("none"))
    a["settings"]["reps"], b["settings"]["reps"] = 3, 2
    assert error_of(a, b) == "--merge: settings.reps differs: a.json has 3, b.json has 2"


def test_a_field_missing_from_one_result_is_a_difference_naming_it() -> None:
    a, b, c = (bench_result(measured(x)) for x in ("all", "half", "none"))
    del c["settings"]["seed"]
    assert error_of(a, b, c) == (
        "--merge: settings.seed differs: a.json has 0, c.json has no settings.seed"
    )


def test_the_model_path_and_other_fields_may_differ() -> None:
    a, b = bench_result(measured("all")), bench_result(measured("none"))
    b["model"]["path"] = "/elsewhere/tiny.gguf"
    b["device"]["threads"] = 16
    b["device"]["torch"] = "2.12.0"
    merged = merge(a, b)
    assert merged["model"] == a["model"] and merged["model"]["path"] == "/models/tiny.gguf"


# -- the rows and the settings that describe them -------------------------------------------------


def test_rows_are_concatenated_in_input_order_each_naming_its_source() -> None:
    a = bench_result(measured("all"), measured("half"))
    b = bench_result(measured("quarter"), measured("none"))
    merged = merge(a, b)
    assert [(r["budget"], r["source"]) for r in merged["strata"]] == [
        ("all", "a.json"), ("half", "a.json"), ("quarter", "b.json"), ("none", "b.json"),
    ]  # fmt: skip
    assert merged["strata"][0] == {**a["strata"][0], "source": "a.json"}
    assert merged["settings"]["budgets"] == ["all", "half", "quarter", "none"]
    assert merged["settings"]["budget_slots"] == [64, 32, 16, 0]


def test_a_budget_measured_in_two_results_is_an_error_naming_it_and_both_sources() -> None:
    a = bench_result(measured("all"), measured("half"))
    b = bench_result(measured("quarter"))
    c = bench_result(measured("half"), measured("none"))
    assert error_of(a, b, c) == (
        "--merge: budget 'half' was measured in both a.json and c.json: keep one of the two runs"
    )


def test_skipped_rows_of_a_budget_measured_elsewhere_are_dropped_the_others_kept() -> None:
    # a ran out of time after `all`; b measured `half` and ran out of time before `none`
    a = bench_result(measured("all"), skipped("half"), skipped("quarter"))
    b = bench_result(measured("half"), measured("quarter"), skipped("none"))
    merged = merge(a, b)
    assert [(r["budget"], r["source"], "skipped" in r) for r in merged["strata"]] == [
        ("all", "a.json", False),
        ("half", "b.json", False),
        ("quarter", "b.json", False),
        ("none", "b.json", True),
    ]
    assert merged["settings"]["budgets"] == ["all", "half", "quarter", "none"]
    assert merged["settings"]["budget_slots"] == [64, 32, 16, 0]


def test_a_budget_skipped_in_two_results_and_measured_in_none_is_listed_once() -> None:
    a = bench_result(measured("all"), skipped("none"))
    b = bench_result(measured("half"), skipped("none"))
    merged = merge(a, b)
    assert [(r["budget"], r["source"]) for r in merged["strata"]] == [
        ("all", "a.json"), ("none", "a.json"), ("half", "b.json"),
    ]  # fmt: skip
    assert merged["settings"]["budgets"] == ["all", "none", "half"]


def test_budgets_an_interrupted_run_never_reached_are_left_out() -> None:
    a = bench_result(measured("all"), interrupted="during the Strata measurements (Ctrl-C)")
    a["settings"]["budgets"], a["settings"]["budget_slots"] = ["all", "half"], [64, 32]
    merged = merge(a, bench_result(measured("none")))
    assert merged["settings"]["budgets"] == ["all", "none"]
    assert merged["settings"]["budget_slots"] == [64, 0]


def test_a_row_whose_budget_is_not_in_the_settings_is_an_error_naming_it() -> None:
    b = bench_result(measured("none"))
    b["settings"]["budgets"] = ["quarter"]
    assert error_of(bench_result(measured("all")), b) == (
        "--merge: b.json: budget 'none' has a row but is not in settings.budgets and "
        "settings.budget_slots"
    )


def test_time_limits_become_the_list_of_each_runs() -> None:
    a, b = bench_result(measured("all")), bench_result(measured("none"))
    a["settings"]["time_limit_s"] = 190.0
    assert merge(a, b)["settings"]["time_limit_s"] == [190.0, None]


# -- the resize test and llama.cpp: from one run --------------------------------------------------


RESIZE = {"from_slots": 6144, "to_slots": 4525, "shrink_call_s": 0.04, "refilled": True}


def test_the_measured_resize_is_kept_with_its_source() -> None:
    a = bench_result(measured("all"), resize=RESIZE)
    b = bench_result(measured("none"))  # its resize: the reason it was not measured
    assert merge(b, a)["resize"] == {**RESIZE, "source": "b.json"}


def test_two_measured_resizes_are_an_error_naming_both_sources() -> None:
    a = bench_result(measured("all"), resize=RESIZE)
    b = bench_result(measured("quarter"))
    c = bench_result(measured("half"), resize=RESIZE)
    assert error_of(a, b, c) == (
        "--merge: the resize test was measured in both a.json and c.json: a merged result holds "
        "one (set resize to null in the other)"
    )


def test_without_a_measured_resize_the_first_reason_stays() -> None:
    a = bench_result(measured("all"), resize=None)  # interrupted before its largest budget
    b = bench_result(measured("none"), resize={"reason": "CPU run"})
    assert merge(a, b)["resize"] == {"reason": "CPU run", "source": "b.json"}
    assert merge(a, bench_result(measured("none"), resize=None))["resize"] is None


def test_llama_cpp_is_kept_with_its_source_and_pairs_are_recomputed() -> None:
    a = bench_result(measured("all", vram_mib=400), measured("half", vram_mib=300))
    b = bench_result(
        measured("quarter", vram_mib=250), measured("none", vram_mib=100),
        llama_cpp=llama_cpp(420, 240, 90),
        pairs=[{"budget": "stale"}],
    )  # fmt: skip
    merged = merge(a, b)
    assert merged["llama_cpp"] == {**b["llama_cpp"], "source": "b.json"}
    ok = [r for r in merged["strata"] if not r.get("skipped")]
    assert merged["pairs"] == stats.pair_rows(ok, b["llama_cpp"]["rows"])
    assert [(p["budget"], p["n_cpu_moe"]) for p in merged["pairs"]] == [
        ("all", 0), ("half", 12), ("quarter", 12), ("none", 24),
    ]  # fmt: skip
    assert "pairs_reason" not in merged


def test_llama_cpp_in_two_results_is_an_error_naming_both_sources() -> None:
    a = bench_result(measured("all"), llama_cpp=llama_cpp(400))
    b = bench_result(measured("none"), llama_cpp=llama_cpp(400))
    assert error_of(a, b) == (
        "--merge: llama.cpp was run in both a.json and b.json: a merged result holds one llama_cpp"
    )


def test_pairs_are_empty_with_run_benchs_reason() -> None:
    gpu = bench_result(measured("all", vram_mib=400))
    failed = bench_result(measured("none", vram_mib=100), llama_cpp=llama_cpp(90, error="boom"))
    merged = merge(gpu, failed)
    assert merged["pairs"] == [] and merged["pairs_reason"] == "no llama.cpp run succeeded"
    cpu = bench_result(measured("none"), llama_cpp=llama_cpp(90))
    merged = merge(bench_result(measured("all")), cpu)
    assert merged["pairs"] == []
    assert merged["pairs_reason"] == "no peak VRAM on one side (CPU run or no NVML)"
    merged = merge(bench_result(measured("all")), bench_result(measured("none")))
    assert merged["pairs"] == [] and "pairs_reason" not in merged and "llama_cpp" not in merged


# -- what differs between the runs ---------------------------------------------------------------


def test_the_first_runs_device_bandwidth_and_nvml_stay_each_runs_are_under_merged_from() -> None:
    a = bench_result(measured("all"))
    b = bench_result(measured("none"), wall_s=250.0, command=["strata", "bench", "b"])
    b["device"]["threads"] = 16
    b["bandwidth"] = {"device_bytes_per_s": 3.9e12}
    b["nvml"] = {"reason": None, "base_used_bytes": 0}
    merged = merge(a, b)
    assert merged["device"] == a["device"]
    assert merged["bandwidth"] == a["bandwidth"] and merged["nvml"] == a["nvml"]
    assert merged["merged_from"] == [
        {"source": s, "command": r["command"], "wall_s": r["wall_s"], "load_s": r["load_s"],
         "device": r["device"], "bandwidth": r["bandwidth"], "nvml": r["nvml"],
         "interrupted": None}
        for s, r in (("a.json", a), ("b.json", b))
    ]  # fmt: skip


def test_wall_s_is_null_with_the_reason() -> None:
    merged = merge(*(bench_result(measured(b)) for b in ("all", "half", "none")))
    assert merged["wall_s"] is None
    assert merged["wall_s_reason"] == (
        "merged from 3 runs; each run's own wall_s is under merged_from"
    )


def test_interrupted_names_each_interrupted_source_and_its_reason() -> None:
    a = bench_result(measured("all"))
    b = bench_result(measured("half"), interrupted="during the Strata measurements (Ctrl-C)")
    c = bench_result(measured("none"), interrupted="during the llama.cpp runs (Ctrl-C)")
    assert merge(a, b, c)["interrupted"] == (
        "b.json: during the Strata measurements (Ctrl-C); c.json: during the llama.cpp runs "
        "(Ctrl-C)"
    )
    assert merge(a, bench_result(measured("none")))["interrupted"] is None


def test_the_inputs_are_not_modified() -> None:
    a = bench_result(measured("all", vram_mib=400), resize=RESIZE)
    b = bench_result(skipped("all"), measured("none", vram_mib=90), llama_cpp=llama_cpp(90))
    before = copy.deepcopy((a, b))
    merge(a, b)
    assert (a, b) == before


def test_the_report_and_the_json_work_on_the_merged_result() -> None:
    a = bench_result(measured("all", vram_mib=400), measured("half", vram_mib=300))
    b = bench_result(measured("none", vram_mib=100), llama_cpp=llama_cpp(420, 90))
    merged = merge(a, b)
    text = report.text_report(merged)
    for line in ("| all (192 MiB) |", "| half (96 MiB) |", "| none (0 MiB) |", "llama.cpp"):
        assert line in text
    assert json.loads(json.dumps(merged)) == merged
