"""The bench's plain-Python parts: flag parsers, summaries, the roofline, llama-bench's JSON, the
pairing by nearest peak VRAM, and the plot's missing-package error. No torch."""

from __future__ import annotations

import json
import sys

import pytest

from strata.bench import llama, report, stats
from strata.bench.settings import BenchError, parse_budgets, parse_int_list

MiB = 2**20


def test_budgets_parse_shares_and_mib() -> None:
    budgets = parse_budgets("all, half,quarter,none,8192")
    assert [b.label for b in budgets] == ["all", "half", "quarter", "none", "8192 MiB"]
    assert [b.slots(100, 7) for b in budgets] == [100, 50, 25, 7, 7]
    assert budgets[3].mib == 0 and budgets[4].mib == 8192


@pytest.mark.parametrize("text", ["", "all,,none", "lots", "-1", "1.5", "half,half"])
def test_bad_budget_lists_name_the_value(text: str) -> None:
    with pytest.raises(BenchError, match="--cache-mib: invalid value"):
        parse_budgets(text)


def test_int_lists_reject_values_below_the_minimum_naming_them() -> None:
    assert parse_int_list("0,12,24", "--n-cpu-moe", 0) == (0, 12, 24)
    with pytest.raises(BenchError, match=r"--prefill: invalid value '0' in '512,0'"):
        parse_int_list("512,0", "--prefill", 1)


def test_summary_is_median_min_max_and_relative_spread() -> None:
    assert stats.summary([]) is None
    s = stats.summary([2.0, 4.0, 3.0])
    assert s == {"median": 3.0, "min": 2.0, "max": 4.0, "spread": pytest.approx(2 / 3), "n": 3}


def test_roofline_is_the_time_the_bytes_need_over_the_time_taken() -> None:
    runs = [
        {"steps": 10, "decode_s": 1.0, "hit_bytes": 1000, "miss_bytes": 500},
        {"steps": 10, "decode_s": 3.0, "hit_bytes": 1000, "miss_bytes": 500},
    ]
    r = stats.roofline(runs, dense_bytes=100, device_bytes_per_s=200.0, pcie_bytes_per_s=25.0)
    assert r is not None
    assert r["hit_bytes_per_token"] == 100 and r["miss_bytes_per_token"] == 50
    assert r["bound_s_per_token"] == pytest.approx((100 + 100) / 200 + 50 / 25)
    assert r["measured_s_per_token"] == pytest.approx(0.2)
    assert r["fraction"] == pytest.approx(3.0 / 0.2)
    assert r["link_bound_s_per_token"] == r["bound_s_per_token"] and r["cpu_bytes_per_token"] == 0


def test_the_misses_the_cpu_computed_leave_the_links_bound() -> None:
    """With ``cpu_share`` the CPU reads some misses from RAM beside the link: the bound counts
    only the rest over PCIe; the link-only bound, every miss."""
    runs = [{"steps": 10, "decode_s": 1.0, "hit_bytes": 1000, "miss_bytes": 500, "cpu_bytes": 200}]
    r = stats.roofline(runs, dense_bytes=100, device_bytes_per_s=200.0, pcie_bytes_per_s=25.0)
    assert r is not None and r["cpu_bytes_per_token"] == 20
    assert r["bound_s_per_token"] == pytest.approx((100 + 100) / 200 + 30 / 25)
    assert r["link_bound_s_per_token"] == pytest.approx((100 + 100) / 200 + 50 / 25)


def test_a_prompts_link_bound_is_its_tokens_over_the_time_its_misses_take() -> None:
    """A chunk reads each expert it routes to once: the bytes it read from RAM over the link,
    a token's share of them, and the prompt speed the link alone allows; none crossed, no bound."""
    runs = [
        {"tokens": 512, "miss_bytes": 1000 * MiB, "cpu_bytes": 0},
        {"tokens": 512, "miss_bytes": 1048 * MiB},
    ]
    link = stats.prompt_link(runs, pcie_bytes_per_s=50 * 2**30)
    assert link is not None
    assert link["pcie_bytes_per_token"] == pytest.approx(2 * MiB)
    assert link["link_bound_tok_s"] == pytest.approx(1024 / (2048 * MiB / (50 * 2**30)))
    (cached,) = [{"tokens": 512, "miss_bytes": 0}]
    held = stats.prompt_link([cached], pcie_bytes_per_s=50 * 2**30)
    assert held is not None and held["link_bound_tok_s"] is None
    assert held["pcie_bytes_per_token"] == 0
    assert stats.prompt_link([], pcie_bytes_per_s=1.0) is None


def test_the_report_prints_the_link_bound_and_the_recurrent_state_per_budget() -> None:
    rows = [
        {
            "budget": "none",
            "prefill": [
                {"tokens": 512, "tok_s": {"median": 900.0},
                 "link": {"pcie_bytes_per_token": 2 * MiB, "link_bound_tok_s": 1200.0}},
                {"tokens": 4096, "skipped": "beyond the context"},
            ],
            "memory": {"recurrent_state_bytes": 63 * MiB, "recurrent_checkpoint_bytes": 126 * MiB,
                       "recurrent_checkpoints": 2},
        },
        {"budget": "all", "prefill": [{"tokens": 512, "link": None}], "memory": {}},
    ]  # fmt: skip
    (link,) = report.link_lines(rows)
    assert link.startswith("none: ") and "pp512 2.00 MiB/token" in link
    assert "bound 1,200 tok/s, measured 75%" in link
    (state,) = report.state_lines(rows)
    assert state == ("none: recurrent state 63.0 MiB a conversation (any length), "
                     "2 checkpoint(s) held: 126 MiB")  # fmt: skip


LLAMA_JSON = json.dumps(
    [
        {"build_commit": "abc", "gpu_info": "H200", "n_prompt": 512, "n_gen": 0,
         "avg_ts": 10340.5, "stddev_ts": 12.0, "samples_ns": [49515000, 49500000],
         "samples_ts": [10340.0, 10341.0]},
        {"build_commit": "abc", "n_prompt": 0, "n_gen": 128, "avg_ts": 308.5, "stddev_ts": 0.5,
         "samples_ns": [414000000], "samples_ts": [308.5]},
    ]
)  # fmt: skip


def test_prefetch_counts_become_per_token_shares_or_none() -> None:
    runs = [
        {"steps": 10, "prefetched": 30, "prefetch_used": 27, "prefetch_unused_bytes": 300},
        {"steps": 30, "prefetched": 10, "prefetch_used": 9, "prefetch_unused_bytes": 100},
    ]
    got = stats.prefetch(runs)
    assert got == {"per_token": 1.0, "chosen_share": 0.9, "unused_bytes_per_token": 10.0}
    assert stats.prefetch([{"steps": 5, "prefetched": 0, "prefetch_used": 0}]) is None
    assert stats.prefetch([{"steps": 5}]) is None  # a run recorded before the counters existed
    assert stats.prefetch([]) is None


def test_llama_bench_json_becomes_tests_by_name_with_raw_samples() -> None:
    tests, info = llama.parse_output(LLAMA_JSON)
    assert set(tests) == {"pp512", "tg128"}
    assert tests["pp512"]["samples_ts"] == [10340.0, 10341.0]
    assert tests["pp512"]["tok_s"]["median"] == 10340.5
    assert tests["tg128"]["samples_ns"] == [414000000]
    assert info["build_commit"] == "abc" and info["gpu_info"] == "H200"
    with pytest.raises(ValueError):
        llama.parse_output("{}")


def _strata(budget: str, peak_mib: int, pp: float, tg: float) -> dict:
    return {
        "budget": budget,
        "memory": {"peak_vram_bytes": peak_mib * MiB},
        "prefill": [{"tokens": 512, "tok_s": {"median": pp}}, {"tokens": 4096, "skipped": "x"}],
        "decode": {"tokens": 128, "tok_s": {"median": tg}},
    }


def _llama(n: int, peak_mib: int | None, pp: float, tg: float) -> dict:
    tests = {
        "pp512": {"tok_s": {"median": pp}},
        "pp4096": {"tok_s": {"median": pp * 1.1}},
        "tg128": {"tok_s": {"median": tg}},
    }
    return {"n_cpu_moe": n, "peak_vram_bytes": None if peak_mib is None else peak_mib * MiB,
            "tests": tests}  # fmt: skip


def test_each_strata_row_pairs_with_the_nearest_peak_and_the_ratios() -> None:
    llama_rows = [_llama(0, 17779, 10000, 300), _llama(24, 10007, 4000, 72),
                  _llama(48, 2199, 2400, 40), _llama(99, None, 1, 1)]  # fmt: skip
    pairs = stats.pair_rows(
        [_strata("all", 17000, 50, 1.0), _strata("none", 2500, 20, 0.5),
         {"budget": "half", "memory": {"peak_vram_bytes": None}}],
        llama_rows,
    )  # fmt: skip
    assert [(p["budget"], p["n_cpu_moe"]) for p in pairs] == [("all", 0), ("none", 48)]
    all_ = pairs[0]["tests"]
    assert all_["pp512"] == {"strata": 50, "llama": 10000, "ratio": 0.005}
    assert all_["tg128"]["ratio"] == pytest.approx(1 / 300)
    assert all_["pp4096"] == {"strata": None, "llama": pytest.approx(11000), "ratio": None}
    assert list(all_) == ["pp512", "pp4096", "tg128"]
    assert pairs[1]["llama_peak_vram_bytes"] == 2199 * MiB


def test_plot_without_matplotlib_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    with pytest.raises(report.PlotUnavailable, match="matplotlib"):
        report.require_matplotlib()


def test_the_profiles_launch_roles_split_a_kernel_by_its_place_in_the_layer() -> None:
    """Two steps of a 2-layer model: a matvec three times a layer and once after the layers
    (the head), attention once a layer; a kernel that runs once a step is left out."""
    from strata.bench.profile import launch_roles

    step = [1.0, 2.0, 3.0, 1.5, 2.5, 3.5, 10.0]  # (q/k/v, o, router) x 2 layers, the head
    times = {"_matvec_kernel": step + step, "_attn_kernel": [4.0, 5.0] * 2, "_advance": [1.0] * 2}
    got = {(r["name"], r["role"]): r["us_per_step"] for r in launch_roles(times, 2, 2)}
    assert got == {
        ("_matvec_kernel", "0 of 3 a layer"): 2.5,
        ("_matvec_kernel", "1 of 3 a layer"): 4.5,
        ("_matvec_kernel", "2 of 3 a layer"): 6.5,
        ("_matvec_kernel", "after 0"): 10.0,
        ("_attn_kernel", "0 of 1 a layer"): 9.0,
    }
    # not the same count every step: no roles
    assert launch_roles({"_matvec_kernel": step + step[:-1]}, 2, 2) == []


def test_the_profiles_sweep_names_its_kernels_and_refuses_others(capsys) -> None:
    """``--sweep`` alone times every kernel; ``--sweep router,head`` those; a name that is not
    a decode kernel is refused before any model is loaded, naming it and the choices."""
    from strata.bench import profile

    with pytest.raises(SystemExit) as e:
        profile.main(["--synthetic", "tiny", "--sweep", "router,bogus"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--sweep: no kernel bogus (one of qkv, o, router, head, gate_up, down)" in err
    assert set(profile.SWEPT) == {"qkv", "o", "router", "head", "gate_up", "down"}


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen3next"])
def test_the_profiles_dense_bytes_count_every_matrix_a_step_reads(tmp_path, arch) -> None:
    """A hybrid's DeltaNet projections and shared experts count as the matvec kernel's bytes,
    not only the attention layers' (the GB/s column was too low for a hybrid)."""
    from gguf import GGMLQuantizationType as Q

    from strata.bench.profile import _dense_bytes
    from strata.engine.gguf_index import GGUFIndex
    from strata.engine.models import architecture_module
    from strata.engine.quant.repack import repacked_layout
    from strata.engine.synth_hybrid import HybridSpec, write_hybrid

    index = GGUFIndex(write_hybrid(tmp_path / f"{arch}.gguf", HybridSpec(arch), Q.Q8_0))
    model = architecture_module(index.arch).Model(index, "cpu", repack=True)
    # every 2-D tensor but the experts, the embeddings (one row a step) and the conv taps
    want = sum(
        repacked_layout(t.qtype, tuple(t.shape)).nbytes
        for name, t in index.tensors.items()
        if len(t.shape) == 2 and "_exps" not in name and "conv1d" not in name
        and not name.startswith("token_embd")
    )  # fmt: skip
    assert any(".ssm_out." in n for n in index.tensors) and want > 0
    assert _dense_bytes(model) == want


def test_the_profiles_sweep_sets_each_table_cut_beside_the_fastest() -> None:
    pytest.importorskip("triton", reason="Triton is not installed")
    from strata.bench.profile import against_table
    from strata.engine.gpu.decode import Tune

    table = {"router": Tune(2), "head": Tune(4, 8), "down": Tune(4)}
    rows = [
        {"kernel": "router", "bn": 2, "warps": None, "regs": None, "ept": None, "us": 8.0},
        {"kernel": "router", "bn": 4, "warps": 1, "regs": None, "ept": None, "us": 5.0},
        {"kernel": "head", "bn": 4, "warps": 8, "regs": None, "ept": None, "us": 200.0},
        {"kernel": "head", "bn": 8, "warps": 4, "regs": None, "ept": None, "us": 150.0},
        {"kernel": "down", "bn": 8, "warps": None, "regs": None, "ept": None, "us": 9.0},
        {"kernel": "o", "bn": 8, "warps": None, "regs": None, "ept": None, "us": 5.0},  # untabled
        {"kernel": "router+norm", "bn": 2, "warps": None, "regs": None, "ept": None, "us": 9.0},
        {"kernel": "router", "bn": 1, "warps": None, "regs": None, "ept": None, "error": "x"},
    ]
    lines = against_table(rows, 48, table)
    assert lines == [
        "sweep: router: the table's cut 2 8.00 us, fastest 4:1 5.00 us (0.62x, 144 us a step)",
        "sweep: head: the table's cut 4:8 200.00 us, fastest 8:4 150.00 us (0.75x, 50 us a step)",
        "sweep: down: the table's cut 4 was not timed; fastest 8 9.00 us",
        "sweep: router+norm: the table's cut 2 9.00 us, fastest 2 9.00 us (1.00x, 0 us a step)",
    ]
