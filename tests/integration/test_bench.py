"""``strata bench`` as a user runs it: the CI smoke test on the tiny model, every rate recomputed
from the raw counts and times in the JSON, several budgets, llama-bench's JSON read (a stand-in
script plays llama-bench), and bad arguments as one-line errors."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

SMOKE_SECONDS = 30  # the bound for the tiny bench on 2 CPU cores

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
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    env.update(
        XDG_CACHE_HOME=str(tmp / "cache"),
        XDG_CONFIG_HOME=str(tmp / "config"),
        XDG_STATE_HOME=str(tmp / "state"),
    )
    return subprocess.run(
        [sys.executable, "-m", "strata", "bench", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


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
    print(f"strata bench --synthetic tiny --json: {took:.1f} s")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)  # stdout holds the JSON and nothing else
    assert took < SMOKE_SECONDS, f"the tiny bench took {took:.1f} s"
    assert result["model"]["synthetic"] == "tiny" and result["device"]["type"] == "cpu"
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
