"""``strata bench`` as a user runs it: the CI smoke test on the tiny model, every rate recomputed
from the raw counts and times in the JSON, several budgets, llama-bench's JSON read (a stand-in
script plays llama-bench), runs split and merged again, and bad arguments as one-line errors."""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_strata

FAKE_LLAMA_BENCH = textwrap.dedent(
    """\
    #!{python}
    import json, sys
    argv = sys.argv[1:]
    with open({log!r}, "a") as f:
        f.write(json.dumps(argv) + "\\n")
    opt = dict(zip(argv[::2], argv[1::2]))
    n = int(opt["--n-cpu-moe"])
    reps = int(opt["-r"])
    tests = [(int(p), 0) for p in opt["-p"].split(",")] + [(0, int(opt["-n"]))]
    out = []
    for n_prompt, n_gen in tests:
        ts = [1000.0 / (1 + n) + i for i in range(reps)]
        out.append({{"build_commit": "stand-in", "n_cpu_moe": n, "n_prompt": n_prompt,
                    "n_gen": n_gen, "avg_ts": sum(ts) / reps, "stddev_ts": 0.0,
                    "samples_ns": [int(1e9 / t) for t in ts], "samples_ts": ts}})
    print(json.dumps(out, indent=2))
    """
)


def strata_bench(*argv: str, tmp: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return run_strata("bench", *argv, tmp=tmp, timeout=timeout)


def check_rates(row: dict[str, Any], reps: int) -> None:
    """Every rate of a Strata row, recomputed from the raw runs it keeps."""
    decode = row["decode"]
    runs = decode["runs"]
    assert len(runs) == reps
    for r in runs:
        assert r["tokens"] == decode["tokens"] and r["steps"] == r["tokens"] - 1
        assert r["decode_s"] > 0 and r["first_token_s"] > 0
    rates = [r["steps"] / r["decode_s"] for r in runs]
    assert decode["tok_s"]["median"] == pytest.approx(statistics.median(rates))
    assert decode["tok_s"]["min"] == pytest.approx(min(rates))
    assert decode["tok_s"]["max"] == pytest.approx(max(rates))
    spread = (max(rates) - min(rates)) / statistics.median(rates)
    assert decode["tok_s"]["spread"] == pytest.approx(spread)
    ttft = statistics.median(r["first_token_s"] for r in runs)
    assert decode["ttft_s"]["median"] == pytest.approx(ttft)
    hits = sum(r["hits"] for r in runs)
    assert decode["hit_rate"] == pytest.approx(hits / (hits + sum(r["misses"] for r in runs)))
    # the sampled row beside the greedy one: its own runs, its ratio to the greedy median
    sampled = decode["sampled"]
    assert len(sampled["runs"]) == reps
    assert all(r["tokens"] == decode["tokens"] for r in sampled["runs"])
    srates = [r["steps"] / r["decode_s"] for r in sampled["runs"]]
    assert sampled["tok_s"]["median"] == pytest.approx(statistics.median(srates))
    assert sampled["vs_greedy"] == pytest.approx(
        statistics.median(srates) / decode["tok_s"]["median"]
    )
    assert sampled["sampler"]["temperature"] == 0.7 and sampled["sampler"]["top_k"] == 40
    shits = sum(r["hits"] for r in sampled["runs"])
    smisses = sum(r["misses"] for r in sampled["runs"])
    assert sampled["hit_rate"] == pytest.approx(shits / (shits + smisses))
    for p in row["prefill"]:
        if p.get("skipped"):
            continue
        assert len(p["runs"]) == reps
        assert all(r["tokens"] == p["tokens"] for r in p["runs"])
        median = statistics.median(r["tokens"] / r["seconds"] for r in p["runs"])
        assert p["tok_s"]["median"] == pytest.approx(median)


def test_smoke_tiny_json_recomputes_every_rate(tmp_path: Path) -> None:
    t0 = time.monotonic()
    proc = strata_bench("--synthetic", "tiny", "--json", tmp=tmp_path, timeout=120)
    took = time.monotonic() - t0
    print(f"strata bench --synthetic tiny --json: {took:.1f} s")  # a number, never asserted
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)  # stdout holds the JSON and nothing else
    assert result["model"]["synthetic"] == "tiny" and result["device"]["type"] == "cpu"
    assert result["device"]["dequant"] == "torch reference (CPU)"
    assert result["command"] == ["strata", "bench", "--synthetic", "tiny", "--json"]
    s = result["settings"]
    assert (s["reps"], s["decode_tokens"], s["prefill"]) == (3, 128, [512, 4096])
    assert s["budgets"] == ["none"], "the CPU default is one budget"
    (row,) = result["strata"]
    check_rates(row, reps=3)
    decode = row["decode"]
    # what does not apply on a CPU is null, with the reason
    assert decode["pcie_bytes_per_token"] is None and "CPU" in decode["pcie_reason"]
    assert decode["roofline"] is None and "CPU" in decode["roofline_reason"]
    assert row["memory"]["peak_vram_bytes"] is None and "CPU" in row["memory"]["vram_reason"]
    assert row["memory"]["peak_rss_bytes"] > 0
    assert "CPU" in result["resize"]["reason"] and "CPU" in result["bandwidth"]["reason"]
    assert result["interrupted"] is None


def test_budgets_skipped_sizes_and_llama_bench_side_by_side(tmp_path: Path) -> None:
    log = tmp_path / "llama-argv.jsonl"
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable, log=str(log)))
    fake.chmod(0o755)
    proc = strata_bench(
        "--synthetic", "tiny", "--json", "--cache-mib", "all,half,0", "--prefill", "64,8192",
        "--decode-tokens", "8", "--reps", "2", "--vs-llama-cpp", str(fake),
        "--n-cpu-moe", "0,4", tmp=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    rows = {r["budget"]: r for r in result["strata"]}
    assert list(rows) == ["all", "half", "0 MiB"]
    for row in rows.values():
        check_rates(row, reps=2)
        (skipped,) = [p for p in row["prefill"] if p.get("skipped")]
        assert skipped["tokens"] == 8192 and "context of 4096" in skipped["skipped"]
    n = rows["all"]["total_experts"]
    assert rows["all"]["cache_experts"] == n and rows["all"]["decode"]["hit_rate"] == 1.0
    assert rows["half"]["cache_experts"] == n // 2
    assert rows["0 MiB"]["cache_experts"] == 0 and rows["0 MiB"]["decode"]["hit_rate"] == 0.0

    argv = [json.loads(line) for line in log.read_text().splitlines()]
    assert [a[a.index("--n-cpu-moe") + 1] for a in argv] == ["0", "4"]
    for a in argv:
        for flag, value in (("-ngl", "99"), ("-fa", "1"), ("-p", "64,8192"), ("-n", "8"),
                            ("-r", "2"), ("-o", "json")):  # fmt: skip
            assert a[a.index(flag) + 1] == value
    llama = result["llama_cpp"]["rows"]
    assert [r["n_cpu_moe"] for r in llama] == [0, 4] and not any(r["error"] for r in llama)
    tg = llama[1]["tests"]["tg8"]
    assert tg["samples_ts"] == [200.0, 201.0]
    assert tg["tok_s"]["median"] == pytest.approx(200.5)
    assert set(llama[0]["tests"]) == {"pp64", "pp8192", "tg8"}
    # no VRAM on a CPU: nothing to pair by, and the reason says so
    assert result["pairs"] == [] and "VRAM" in result["pairs_reason"]


def test_a_hybrids_rows_carry_its_recurrent_state(tmp_path: Path) -> None:
    """A Gated DeltaNet hybrid: each budget's memory gives one conversation's recurrent state
    (every DeltaNet layer's convolution inputs and [S, S] matrix per v head: fixed, whatever
    the length) and the checkpoints beside it, and the report prints it under the table; on a
    CPU the prompts' link bound is null with the reason."""
    from gguf import GGMLQuantizationType as Q

    from strata.engine.synth_hybrid import HybridSpec, write_hybrid

    spec = HybridSpec("qwen35moe", n_embd=128, n_ff_exp=64, n_ff_shexp=64)
    path = write_hybrid(tmp_path / "hybrid.gguf", spec, Q.Q8_0)
    argv = ("--model", str(path), "--prefill", "32", "--decode-tokens", "4", "--reps", "1")
    proc = strata_bench(*argv, "--json", tmp=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(proc.stdout)["strata"]
    n_dn = sum(spec.is_recurrent(i) for i in range(spec.n_layer))
    conv_dim = 2 * spec.key_dim + spec.value_dim
    S = spec.ssm_d_state
    per_layer = 4 * ((spec.ssm_d_conv - 1) * conv_dim + spec.ssm_dt_rank * S * S)
    m = row["memory"]
    assert m["recurrent_state_bytes"] == n_dn * per_layer
    assert m["recurrent_checkpoint_bytes"] == m["recurrent_checkpoints"] * n_dn * per_layer
    (pp,) = row["prefill"]
    assert pp["link"] is None and "CPU" in pp["link_reason"]
    text = strata_bench(*argv, tmp=tmp_path)
    assert text.returncode == 0, text.stderr
    assert f"{row['budget']}: recurrent state " in text.stdout


def test_grammar_row_reports_the_mask_cost(tmp_path: Path) -> None:
    """``--grammar``: each decode run again under the bench grammar; its rate and the mask's
    host time per token, recomputed from the raw runs, and the line under the table."""
    from strata.bench.report import text_report

    proc = strata_bench("--synthetic", "tiny", "--json", "--grammar", "--reps", "2",
                        "--decode-tokens", "16", "--prefill", "16", tmp=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    (row,) = result["strata"]
    check_rates(row, reps=2)
    g = row["decode"]["grammar"]
    runs = g["runs"]
    assert len(runs) == 2 and all(r["tokens"] == 16 and r["masks"] == 16 for r in runs)
    rates = [r["steps"] / r["decode_s"] for r in runs]
    assert g["tok_s"]["median"] == pytest.approx(statistics.median(rates))
    mask = sum(r["mask_s"] for r in runs) / sum(r["masks"] for r in runs)
    assert g["mask_us_per_token"] == pytest.approx(mask * 1e6) and mask > 0
    plain = row["decode"]["tok_s"]["median"]
    assert g["overhead"] == pytest.approx(plain / g["tok_s"]["median"] - 1)
    assert g["mask_share"] == pytest.approx(mask * plain)
    assert "none: decode under a grammar" in text_report(result)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--synthetic", "gpt-5"], "'gpt-5'"),
        (["--synthetic", "tiny", "--cache-mib", "all,lots"], "'lots'"),
        (["--synthetic", "tiny", "--cache-mib", "-5"], "'-5'"),
        (["--synthetic", "tiny", "--reps", "0"], "--reps: invalid value '0'"),
        (["--synthetic", "tiny", "--prefill", "512,x"], "--prefill: invalid value 'x'"),
        (["--synthetic", "tiny", "--vs-llama-cpp", "/nonexistent/llama-bench"], "/nonexistent"),
        ([], "--synthetic NAME or --model PATH"),
        (["--synthetic", "tiny", "--only-llama-cpp"], "--only-llama-cpp needs --vs-llama-cpp"),
        (
            [
                "--synthetic",
                "tiny",
                "--only-llama-cpp",
                "--cache-mib",
                "all",
                "--vs-llama-cpp",
                sys.executable,
            ],
            "--only-llama-cpp measures no cache budget: drop --cache-mib",
        ),
    ],
)
def test_bad_arguments_are_one_line_naming_the_value(
    argv: list[str], named: str, tmp_path: Path
) -> None:
    proc = strata_bench(*argv, tmp=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert named in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "cache").exists(), "nothing is written for a bad command line"


def test_merge_combines_split_runs_into_one_result_table_and_plot(tmp_path: Path) -> None:
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable, log=str(tmp_path / "argv")))
    fake.chmod(0o755)
    quick = ("--synthetic", "tiny", "--json", "--prefill", "64", "--decode-tokens", "8")
    a, b, c = (str(tmp_path / f"{n}.json") for n in "abc")
    split = {  # as on a machine that limits one command's time: budgets apart, llama.cpp alone
        a: ["--cache-mib", "all,half"],
        b: ["--cache-mib", "none"],
        c: ["--only-llama-cpp", "--vs-llama-cpp", str(fake), "--n-cpu-moe", "0"],
    }
    for path, argv in split.items():
        proc = strata_bench(*quick, "--reps", "1", *argv, tmp=tmp_path, timeout=120)
        assert proc.returncode == 0, proc.stderr
        Path(path).write_text(proc.stdout)
    alone = json.loads(Path(c).read_text())
    assert alone["strata"] == [] and alone["settings"]["budgets"] == []
    assert [r["n_cpu_moe"] for r in alone["llama_cpp"]["rows"]] == [0]

    proc = strata_bench("--merge", a, b, c, "--json", tmp=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    merged = json.loads(proc.stdout)
    assert [(r["budget"], r["source"]) for r in merged["strata"]] == [
        ("all", a), ("half", a), ("none", b),
    ]  # fmt: skip
    for row in merged["strata"]:
        check_rates(row, reps=1)
    n = merged["model"]["n_experts"]
    assert merged["settings"]["budgets"] == ["all", "half", "none"]
    assert merged["settings"]["budget_slots"] == [n, n // 2, 0]
    assert [m["source"] for m in merged["merged_from"]] == [a, b, c]
    assert all(m["wall_s"] > 0 and m["command"] for m in merged["merged_from"])
    assert merged["wall_s"] is None and "merged from 3 runs" in merged["wall_s_reason"]
    assert merged["llama_cpp"]["source"] == c
    assert [r["n_cpu_moe"] for r in merged["llama_cpp"]["rows"]] == [0]
    assert merged["pairs"] == [] and "VRAM" in merged["pairs_reason"]  # a CPU run
    assert "--merge" in merged["command"] and merged["interrupted"] is None

    png = tmp_path / "merged.png"
    proc = strata_bench("--merge", a, b, c, "--plot", str(png), tmp=tmp_path, timeout=60)
    if importlib.util.find_spec("matplotlib") is None:  # the plot's own error, before any work
        assert proc.returncode == 2 and "matplotlib" in proc.stderr and not png.exists()
        proc = strata_bench("--merge", a, b, c, tmp=tmp_path, timeout=60)
    else:
        assert png.stat().st_size > 0
    assert proc.returncode == 0, proc.stderr
    for budget in ("| all (", "| half (", "| none ("):
        assert budget in proc.stdout
    assert "llama.cpp" in proc.stdout


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--reps", "2"], "--merge combines earlier results and measures nothing: drop --reps"),
        (["--device", "cpu"], "measures nothing: drop --device"),
        (["{tmp}/missing.json"], "--merge: cannot read {tmp}/missing.json: No such file"),
        (["{tmp}/bad.json"], "--merge: {tmp}/bad.json is not valid JSON: Expecting"),
        (["{tmp}/list.json"], "--merge: {tmp}/list.json is not a strata bench result"),
    ],
)
def test_merge_bad_arguments_are_one_line_naming_the_option_or_file(
    argv: list[str], named: str, tmp_path: Path
) -> None:
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "list.json").write_text("[]")
    argv = [a.format(tmp=tmp_path) for a in argv]
    proc = strata_bench("--merge", str(tmp_path / "list.json"), *argv, tmp=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and named.format(tmp=tmp_path) in lines[0], proc.stderr
