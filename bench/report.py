"""The bench's human outputs: Markdown tables for the terminal and docs, and the optional plot of
tok/s against peak VRAM (matplotlib is imported only when a plot is asked for)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from strata.bench.stats import llama_speeds, strata_speeds

MiB = 2**20
GiB = 2**30
Row = Mapping[str, Any]


class PlotUnavailable(Exception):
    """``--plot`` was asked for but matplotlib cannot be imported."""


def require_matplotlib() -> None:
    """Fail before a long run, not after it, when the plot cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise PlotUnavailable(
            f"--plot needs the Python package matplotlib, which is not installed ({e}); "
            "install it (pip install matplotlib) or leave --plot out"
        ) from None


def num(x: float | None) -> str:
    if x is None:
        return "—"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def mib(x: int | float | None) -> str:
    return "—" if x is None else f"{x / MiB:,.0f}"


def _spread(s: Mapping[str, float] | None) -> str:
    if not s:
        return "—"
    return f"{num(s['median'])} ±{s['spread']:.0%}"


def _ms(s: Mapping[str, float] | None) -> str:
    return "—" if not s else f"{s['median'] * 1e3:,.0f}"


def _per_mib(x: float | None) -> str:
    return "—" if x is None else num(x / MiB)


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x * 100:.3g}%"


def _cpu(c: Mapping[str, Any] | None) -> str:
    if not c:
        return "—"
    share = c.get("share")
    return _per_mib(c["bytes_per_token"]) + ("" if share is None else f" ({share:g})")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" ---: " for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def strata_table(result: Mapping[str, Any]) -> list[str]:
    prefill = result["settings"]["prefill"]
    decode = result["settings"]["decode_tokens"]
    header = ["cache", "experts", "peak VRAM MiB", "peak RSS MiB"]
    header += [f"pp{p} tok/s" for p in prefill] + [f"tg{decode} tok/s", "TTFT ms", "hit rate"]
    header += ["PCIe MiB/tok", "CPU MiB/tok (share)", "roofline", "link-only bound tok/s"]
    rows = []
    for r in result["strata"]:
        if r.get("skipped"):
            rows.append([r["budget"], *["—"] * (len(header) - 2), r["skipped"]])
            continue
        m, d = r["memory"], r["decode"]
        pp = {p["tokens"]: p for p in r["prefill"]}
        roof = d.get("roofline")
        rows.append(
            [
                f"{r['budget']} ({mib(r['cache_bytes'])} MiB)",
                f"{r['cache_experts']}/{r['total_experts']}",
                mib(m.get("peak_vram_bytes")),
                mib(m.get("peak_rss_bytes")),
                *[_spread(pp[p].get("tok_s")) for p in prefill],
                _spread(d.get("tok_s")),
                _ms(d.get("ttft_s")),
                _pct(d.get("hit_rate")),
                _per_mib(d.get("pcie_bytes_per_token")),
                _cpu(d.get("cpu")),
                _pct(roof["fraction"]) if roof else "—",
                num(1 / roof["link_bound_s_per_token"]) if roof else "—",
            ]
        )
    return _table(header, rows)


def llama_table(rows: Sequence[Row], prefill: Sequence[int], decode: int) -> list[str]:
    names = [f"pp{p}" for p in prefill] + [f"tg{decode}"]
    header = ["--n-cpu-moe", "peak VRAM MiB", "peak RSS MiB", *[f"{n} tok/s" for n in names]]
    out = []
    for r in rows:
        speeds = llama_speeds(r)
        out.append(
            [
                str(r["n_cpu_moe"]),
                mib(r.get("peak_vram_bytes")),
                mib(r.get("peak_rss_bytes")),
                *[num(speeds.get(n)) for n in names],
            ]
        )
    return _table(header, out)


def pairs_table(pairs: Sequence[Row], prefill: Sequence[int], decode: int) -> list[str]:
    names = [f"pp{p}" for p in prefill] + [f"tg{decode}"]
    header = ["Strata cache", "peak MiB", "llama.cpp --n-cpu-moe", "peak MiB"]
    for n in names:
        header += [f"{n} Strata", f"{n} llama.cpp", f"{n} ratio"]
    out = []
    for p in pairs:
        cells = [
            p["budget"],
            mib(p["strata_peak_vram_bytes"]),
            str(p["n_cpu_moe"]),
            mib(p["llama_peak_vram_bytes"]),
        ]
        for n in names:
            t = p["tests"].get(n, {})
            ratio = t.get("ratio")
            shown = "—" if ratio is None else f"{ratio:.3g}"
            cells += [num(t.get("strata")), num(t.get("llama")), shown]
        out.append(cells)
    return _table(header, out)


def resize_lines(resize: Mapping[str, Any] | None) -> list[str]:
    if not resize:
        return []
    if "reason" in resize:
        return [f"resize: not measured ({resize['reason']})"]

    def ms(x: float | None) -> str:
        return "—" if x is None else f"{x * 1e3:,.0f} ms"

    d = resize.get("during_decode") or {}
    line = (
        f"resize by {mib(resize['shrink_bytes'])} MiB: shrink request -> NVML free "
        f"{ms(resize.get('shrink_to_nvml_free_s'))} (call {ms(resize.get('shrink_call_s'))}); "
        f"grow back -> refilled {ms(resize.get('grow_to_refilled_s'))}"
    )
    lines = [line]
    if resize.get("shrink_phases_s"):
        parts = ", ".join(f"{k} {v * 1e3:,.1f}" for k, v in resize["shrink_phases_s"].items())
        lines.append(f"shrink call by phase (ms): {parts}")
    if d:
        lines.append(
            f"shrink during a {d['tokens']}-token decode (after step {d['shrink_after_step']}, "
            f"{ms(d.get('shrink_s'))}): longest gap between tokens {ms(d.get('max_gap_s'))}, "
            f"median gap {ms(d.get('median_gap_s'))}"
        )
    if resize.get("nvml_reason"):
        lines.append(f"(NVML: {resize['nvml_reason']})")
    return lines


def card_lines(card: Mapping[str, Any] | None) -> list[str]:
    """``--card-gib``: the card asked for, what the filler holds, and what was left free."""
    if not card:
        return []

    def gib(x: int | None) -> str:
        return "—" if x is None else f"{x / GiB:,.2f} GiB"

    def off(part: Mapping[str, Any]) -> str:
        if part.get("within_tolerance") is False:
            return f", outside the ±{mib(card.get('tolerance_bytes'))} MiB tolerance"
        return ""

    how = f", {card['adjusted']} once" if card.get("adjusted") else ""
    lines = [
        f"emulated card: {card['gib']:g} GiB asked, {gib(card.get('free_bytes'))} free after "
        f"filling (the filler holds {gib(card.get('filler_bytes'))} of "
        f"{gib(card.get('total_bytes'))}{how}{off(card)}); capacity only: PCIe and RAM are "
        "this machine's"
    ]
    llama = card.get("before_llama")
    if llama:
        how = f", {llama['adjusted']} once more" if llama.get("adjusted") else ""
        error = f"; {llama['error']}" if llama.get("error") else ""
        lines.append(
            f"emulated card before llama-bench: {gib(llama.get('free_bytes'))} free (the filler "
            f"holds {gib(llama.get('filler_bytes'))}{how}{off(llama)}){error}"
        )
    return lines


def sampled_lines(rows: Sequence[Row]) -> list[str]:
    """Each budget's sampled decode beside the greedy one."""
    out = []
    for r in rows:
        g = (r.get("decode") or {}).get("sampled")
        if not g:
            continue
        ratio = g.get("vs_greedy")
        s = g.get("sampler") or {}
        how = ", ".join(f"{k} {v:g}" for k, v in s.items())
        # its own tokens route to other experts: where some are in RAM, say how many it hit
        hit, greedy_hit = g.get("hit_rate"), (r.get("decode") or {}).get("hit_rate")
        hits = (
            f" (hit rate {hit:.1%} against the greedy's {greedy_hit:.1%})"
            if hit is not None and greedy_hit is not None and 0 < greedy_hit < 1
            else ""
        )
        out.append(
            f"{r['budget']}: decode sampled ({how}, seeded) {_spread(g.get('tok_s'))} tok/s, "
            f"{'—' if ratio is None else f'{ratio:.2f}×'} the greedy{hits}"
        )
    return out


def link_lines(rows: Sequence[Row]) -> list[str]:
    """Each budget's prompt reads over PCIe and the speed the link alone would allow (a chunk
    reads every expert it routes to once: with experts in RAM, the link can bound prompts)."""
    out = []
    for r in rows:
        parts = []
        for p in r.get("prefill", []):
            link = p.get("link")
            if not link or link.get("link_bound_tok_s") is None:
                continue
            measured = (p.get("tok_s") or {}).get("median")
            share = "" if not measured else f", measured {measured / link['link_bound_tok_s']:.0%}"
            parts.append(
                f"pp{p['tokens']} {_per_mib(link['pcie_bytes_per_token'])} MiB/token over "
                f"PCIe, bound {num(link['link_bound_tok_s'])} tok/s{share}"
            )
        if parts:
            out.append(f"{r['budget']}: prompts' link bound: " + "; ".join(parts))
    return out


def state_lines(rows: Sequence[Row]) -> list[str]:
    """A hybrid's recurrent state beside each budget: one conversation's, and its checkpoints."""
    out = []
    for r in rows:
        m = r.get("memory") or {}
        if m.get("recurrent_state_bytes") is None:
            continue
        out.append(
            f"{r['budget']}: recurrent state {_per_mib(m['recurrent_state_bytes'])} MiB a "
            f"conversation (any length), {m['recurrent_checkpoints']} checkpoint(s) held: "
            f"{_per_mib(m['recurrent_checkpoint_bytes'])} MiB"
        )
    return out


def grammar_lines(rows: Sequence[Row]) -> list[str]:
    """``--grammar``: each budget's decode under the grammar beside the plain one."""
    out = []
    for r in rows:
        g = (r.get("decode") or {}).get("grammar")
        if not g:
            continue
        mask, share = g.get("mask_us_per_token"), g.get("mask_share")
        overhead = g.get("overhead")
        out.append(
            f"{r['budget']}: decode under a grammar {_spread(g.get('tok_s'))} tok/s, "
            f"{'—' if overhead is None else f'{overhead:+.1%}'} time per token; the mask "
            f"{'—' if mask is None else f'{mask:,.0f}'} µs/token on the host "
            f"({'—' if share is None else f'{share:.1%}'} of a plain step)"
        )
    return out


def _skipped_lines(rows: Sequence[Row]) -> list[str]:
    """Why a cell of the table is empty: sizes beyond the context, reps cut by the time limit."""
    out = []
    for r in rows:
        for p in r.get("prefill", []):
            if p.get("skipped"):
                out.append(f"{r['budget']}: pp{p['tokens']} not measured ({p['skipped']})")
        if (r.get("decode") or {}).get("skipped"):
            out.append(f"{r['budget']}: decode not measured ({r['decode']['skipped']})")
        if r.get("reps_reason"):
            out.append(f"{r['budget']}: {r['reps_run']} rep(s) only ({r['reps_reason']})")
    return out


def text_report(result: Mapping[str, Any]) -> str:
    s, m = result["settings"], result["model"]
    dev = result["device"]
    dequant = f"dequantised by {dev['dequant']}, " if dev.get("dequant") else ""
    if dev.get("decode"):
        dequant += f"decode: {dev['decode']}, "
    if dev.get("prefill"):
        dequant += f"prefill: {dev['prefill']}, "
    lines = [
        f"strata bench: {m['name']} ({m['file_bytes'] / GiB:.2f} GiB, {m['n_experts']} experts "
        f"of {m['slot_bytes'] / MiB:.2f} MiB), {dev['name']}, threads {dev['threads']}, "
        f"{dequant}context {s['context_length']}, median of {s['reps']} reps "
        "(± is (max - min) / median)",
    ]
    bw = result["bandwidth"]
    if "device_bytes_per_s" in bw:
        lines.append(
            f"bandwidth: device memory {bw['device_bytes_per_s'] / 1e9:,.0f} GB/s, PCIe "
            f"{bw['pcie_bytes_per_s'] / 1e9:.1f} GB/s pinned, "
            f"{bw['pcie_pageable_bytes_per_s'] / 1e9:.1f} GB/s pageable"
        )
    else:
        lines.append(f"bandwidth: not measured ({bw.get('reason')})")
    lines += card_lines(dev.get("card"))
    if result["strata"]:
        lines += ["", *strata_table(result), ""]
    else:
        lines += ["", "Strata: not measured (--only-llama-cpp)"]
    lines += sampled_lines(result["strata"])
    lines += grammar_lines(result["strata"])
    lines += link_lines(result["strata"])
    lines += state_lines(result["strata"])
    lines += _skipped_lines(result["strata"])
    lines += resize_lines(result.get("resize"))
    llama = result.get("llama_cpp")
    if llama:
        lines += ["", f"llama.cpp ({llama['binary']}):"]
        lines += llama_table(llama["rows"], s["prefill"], s["decode_tokens"])
        for r in llama["rows"]:
            if r.get("error"):
                lines.append(f"--n-cpu-moe {r['n_cpu_moe']}: {r['error'][:300]}")
        lines += ["", "Strata vs llama.cpp at the nearest peak VRAM (ratio = Strata / llama.cpp):"]
        if result.get("pairs"):
            lines += pairs_table(result["pairs"], s["prefill"], s["decode_tokens"])
        else:
            lines.append(f"no pairs: {result.get('pairs_reason')}")
    if result.get("interrupted"):
        lines.append(f"\ninterrupted: {result['interrupted']}")
    return "\n".join(lines) + "\n"


def plot(result: Mapping[str, Any], path: Path) -> None:
    """tok/s against peak VRAM: decode and the first prefill size, Strata and llama.cpp."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["settings"]
    tests = [f"tg{s['decode_tokens']}", f"pp{s['prefill'][0]}"]
    fig, axes = plt.subplots(1, len(tests), figsize=(11, 4.2))
    series = [
        ("Strata", "o-", [
            ((r.get("memory") or {}).get("peak_vram_bytes"), strata_speeds(r), r["budget"])
            for r in result["strata"] if not r.get("skipped")
        ]),
        ("llama.cpp", "s--", [
            (r.get("peak_vram_bytes"), llama_speeds(r), f"ncmoe {r['n_cpu_moe']}")
            for r in (result.get("llama_cpp") or {}).get("rows", [])
        ]),
    ]  # fmt: skip
    for ax, test in zip(axes, tests, strict=True):
        for label, style, points in series:
            pts = sorted((p / GiB, sp[test], name) for p, sp, name in points if p and test in sp)
            if not pts:
                continue
            ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], style, label=label)
            for x, y, name in pts:
                ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_yscale("log")
        ax.set_xlabel("peak VRAM (GiB)")
        ax.set_ylabel(f"{test} tok/s")
        ax.set_title(test)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"{result['model']['name']} on {result['device']['name']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
