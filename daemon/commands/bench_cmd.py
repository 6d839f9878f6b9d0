"""``strata bench``: the CLI edge of ``strata.bench``.

Parses and validates the flags into one ``BenchSettings`` (a bad value is one line naming it, exit
2), runs the bench with a progress bar on stderr, and prints the table, or the JSON with
``--json``, on stdout; ``--plot FILE.png`` draws tok/s against peak VRAM. ``--merge`` measures
nothing: it combines the JSON of earlier runs (a bench split to fit a time limit) into one result.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from strata import paths
from strata.bench import settings as bs
from strata.daemon.commands.generate_cmd import ProgressBar
from strata.daemon.config import BENCH_OPTIONS, LoadedConfig, Origin, add_option_flags
from strata.daemon.engine_setup import engine_options
from strata.daemon.json_types import JSONObject
from strata.engine.errors import EngineError, ModelLoadError

if TYPE_CHECKING:
    from strata.bench.settings import BenchSettings
    from strata.engine.options import EngineOptions

log = logging.getLogger("strata.daemon.bench_cmd")  # the name its log lines always had

EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130

# Flags that choose what is measured, by argparse dest; ``--merge`` measures nothing. The defaults
# of the bench's own are applied in ``build_settings``, so that a flag given is told from one not.
MEASURING_FLAGS = {
    "synthetic": "--synthetic",
    "opt_model": "--model",
    "bench_cache_mib": "--cache-mib",
    "reps": "--reps",
    "decode_tokens": "--decode-tokens",
    "prefill": "--prefill",
    "vs_llama_cpp": "--vs-llama-cpp",
    "n_cpu_moe": "--n-cpu-moe",
    "time_limit": "--time-limit",
    "opt_device": "--device",
    "only_llama_cpp": "--only-llama-cpp",
    "grammar": "--grammar",
    "card_gib": "--card-gib",
}
DEFAULT_REPS, DEFAULT_DECODE_TOKENS = "3", "128"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_option_flags(parser, BENCH_OPTIONS)  # --device, --threads, --context-length, --model, ...
    # The bench sweeps cache budgets: its --cache-mib (a list) stands for the option of that name.
    g = parser.add_argument_group("bench")
    g.add_argument(
        "--synthetic",
        metavar="NAME",
        help=f"a random-weight model of a real shape, written once into the cache directory: "
        f"{', '.join(bs.SYNTHETIC_NAMES)} (or --model PATH for a real file)",
    )
    g.add_argument(
        "--cache-mib",
        dest="bench_cache_mib",
        metavar="LIST",
        help="expert cache budgets to measure: MiB or all, half, quarter, none, comma-separated "
        f"(default on a GPU: {bs.DEFAULT_GPU_BUDGETS}; on the CPU: {bs.DEFAULT_CPU_BUDGETS})",
    )
    g.add_argument("--reps", metavar="N", help=f"repetitions per measurement ({DEFAULT_REPS})")
    g.add_argument(
        "--decode-tokens", metavar="N", help=f"tokens per decode run ({DEFAULT_DECODE_TOKENS})"
    )
    g.add_argument(
        "--prefill",
        metavar="LIST",
        help="prompt sizes whose prefill is timed (512,4096); sizes beyond the context are "
        "skipped with the reason",
    )
    g.add_argument("--json", action="store_true", help="print the results as JSON")
    g.add_argument("--plot", metavar="FILE.png", help="draw tok/s against peak VRAM (matplotlib)")
    _add_llama_cpp_arguments(g)
    g.add_argument(
        "--grammar",
        action="store_const",
        const=True,
        help="also time each decode run under a grammar (JSON lines of tool calls): the cost "
        "of the token mask per token",
    )
    g.add_argument(
        "--card-gib",
        metavar="N",
        help="emulate a card of N GiB (a CUDA device): before the model loads, fill the "
        "device's memory until N GiB are free, and keep it filled while llama-bench runs too",
    )
    g.add_argument(
        "--time-limit",
        metavar="SECONDS",
        help="start no new Strata measurement after this long; the rest are skipped with the "
        "reason (unset: no limit)",
    )
    g.add_argument(
        "--merge",
        nargs="+",
        metavar="FILE.json",
        help="measure nothing: combine the --json results of earlier runs of the same model, "
        "settings and device (each with other budgets, one of them with llama.cpp) into one "
        "table, JSON and plot",
    )
    parser.set_defaults(run=run)


def _add_llama_cpp_arguments(g: argparse._ArgumentGroup) -> None:
    """The options of the llama.cpp comparison."""
    g.add_argument(
        "--vs-llama-cpp",
        metavar="LLAMA_BENCH",
        help="path of llama.cpp's llama-bench: run it on the same file and pair the rows",
    )
    g.add_argument(
        "--n-cpu-moe",
        metavar="LIST",
        help="llama-bench --n-cpu-moe values, one process each (0,12,24,36,48)",
    )
    g.add_argument(
        "--only-llama-cpp",
        action="store_const",
        const=True,
        help="run llama-bench alone (needs --vs-llama-cpp), no Strata budget; --merge pairs its "
        "rows with a Strata run's",
    )


def build_settings(loaded: LoadedConfig, args: argparse.Namespace) -> BenchSettings:
    """Everything the bench needs, validated; raises ``BenchError`` naming a bad value. The
    flags are checked before anything slow (torch, the device, writing a synthetic model)."""
    given = args.bench_cache_mib
    budgets = bs.parse_budgets(given) if given is not None else None
    reps = bs.parse_int(_or(args.reps, DEFAULT_REPS), "--reps", 1)
    decode = bs.parse_int(_or(args.decode_tokens, DEFAULT_DECODE_TOKENS), "--decode-tokens", 2)
    prefill = bs.parse_int_list(_or(args.prefill, _csv(bs.DEFAULT_PREFILL)), "--prefill", 1)
    n_cpu_moe = bs.parse_int_list(_or(args.n_cpu_moe, _csv(bs.DEFAULT_N_CPU_MOE)), "--n-cpu-moe", 0)
    limit = None if args.time_limit is None else bs.parse_seconds(args.time_limit, "--time-limit")
    card_gib = None if args.card_gib is None else bs.parse_card_gib(args.card_gib)
    llama = None
    if args.vs_llama_cpp is not None:
        llama = Path(args.vs_llama_cpp).expanduser()
        if not llama.is_file() or not os.access(llama, os.X_OK):
            raise bs.BenchError(
                f"--vs-llama-cpp: {str(llama)!r} is not an executable file (llama.cpp's "
                "llama-bench)"
            )
    if args.only_llama_cpp:
        if llama is None:
            raise bs.BenchError("--only-llama-cpp needs --vs-llama-cpp LLAMA_BENCH")
        if budgets is not None:
            raise bs.BenchError("--only-llama-cpp measures no cache budget: drop --cache-mib")
        budgets = ()
    _check_plot(args)
    preset = None if args.synthetic is None else bs.synthetic_preset(args.synthetic)
    if preset is not None and loaded.sources["model"].origin is Origin.FLAG:
        raise bs.BenchError("--synthetic and --model exclude each other: give one")
    if preset is None and loaded.config.model is None:
        raise bs.BenchError("no model: give --synthetic NAME or --model PATH")
    options = engine_options(loaded.config)
    if card_gib is not None:
        _check_card(card_gib, options)
    if budgets is None:
        gpu = options.device != "cpu"
        budgets = bs.parse_budgets(bs.DEFAULT_GPU_BUDGETS if gpu else bs.DEFAULT_CPU_BUDGETS)
    model = _model(loaded, args.synthetic, preset)
    return bs.BenchSettings(
        model=model,
        engine=options,
        budgets=budgets,
        synthetic=args.synthetic,
        reps=reps,
        decode_tokens=decode,
        prefill=prefill,
        time_limit_s=limit,
        llama_bench=llama,
        n_cpu_moe=n_cpu_moe,
        grammar=bool(args.grammar),
        card_gib=card_gib,
    )


def _check_card(gib: float, options: EngineOptions) -> None:
    """``--card-gib`` fills one CUDA device: not the CPU, not a split over several devices.
    (Whether N fits in the device's free memory is checked when it is filled, before the model
    loads.)"""
    if options.device == "cpu":
        raise bs.BenchError(
            f"--card-gib {gib:g}: needs a CUDA device, but the bench runs on the CPU "
            "(--device cpu, or no CUDA device found)"
        )
    if len(options.devices or ()) > 1:
        raise bs.BenchError(
            f"--card-gib {gib:g}: emulates one card, but devices lists "
            f"{len(options.devices or ())}: leave one device"
        )


def merged_result(args: argparse.Namespace) -> JSONObject:
    """``--merge``: the files read and combined; raises ``BenchError`` naming a measuring flag
    given with it, a file that cannot be read or parsed, or what keeps the results apart."""
    for dest, flag in MEASURING_FLAGS.items():
        if getattr(args, dest, None) is not None:
            raise bs.BenchError(
                f"--merge combines earlier results and measures nothing: drop {flag}"
            )
    _check_plot(args)
    from strata.bench.merge import merge_results

    results = []
    for name in args.merge:
        try:
            text = Path(name).expanduser().read_bytes()
        except OSError as e:
            raise bs.BenchError(f"--merge: cannot read {name}: {e.strerror or e}") from None
        try:
            results.append((name, json.loads(text)))
        except ValueError as e:  # not JSON, or not UTF-8
            raise bs.BenchError(f"--merge: {name} is not valid JSON: {e}") from None
    return merge_results(results)


def _check_plot(args: argparse.Namespace) -> None:
    """Fail before a long run, or before reading anything, when the plot cannot be drawn."""
    if args.plot is None:
        return
    from strata.bench.report import PlotUnavailable, require_matplotlib

    try:
        require_matplotlib()
    except PlotUnavailable as e:
        raise bs.BenchError(str(e)) from None


def _or(given: str | None, default: str) -> str:
    return default if given is None else given


def _csv(values: tuple[int, ...]) -> str:
    return ",".join(map(str, values))


def _model(loaded: LoadedConfig, name: str | None, preset: str | None) -> Path:
    """``--synthetic NAME`` (written on first use) or the model file; never the demo model."""
    if name is None or preset is None:
        assert loaded.config.model is not None  # checked with the other flags
        from strata.daemon.engine_setup import model_path

        return model_path(loaded.config)  # a file, or a library model's name
    from strata.bench.settings import ensure_synthetic

    bar = ProgressBar(f"writing {name}")
    return ensure_synthetic(preset, paths.cache_dir(), lambda d, t: bar(d, t, "random weights"))


def run(loaded: LoadedConfig, args: argparse.Namespace) -> int:
    try:
        if args.merge is not None:
            _output(merged_result(args), args)
            return 0  # an interrupted input is named in the result; this command was not
        settings = build_settings(loaded, args)  # before torch is imported: bad flags fail fast
        from strata.bench.session import run_bench

        result = run_bench(settings, progress=ProgressBar("bench"))
    except bs.BenchError as e:
        return _error(str(e), EXIT_USAGE)
    except ModelLoadError as e:
        return _error(f"cannot load the model: {e}", EXIT_USAGE)
    except EngineError as e:  # a CUDA device that is not there, a run that failed
        return _error(str(e), EXIT_FAILURE)
    _output(result, args)
    return EXIT_INTERRUPTED if result.get("interrupted") else 0


def _error(message: str, code: int) -> int:
    """One line on stderr for the user of the command; the exit code to return."""
    print(f"strata bench: error: {message}", file=sys.stderr)
    return code


def _output(result: dict[str, Any], args: argparse.Namespace) -> None:
    """The table, or the JSON with ``--json``, on stdout; the plot with ``--plot``."""
    from strata.bench import report

    # the arguments as typed after the program name (whose path says only where it was installed)
    result["command"] = ["strata", *sys.argv[1:]]
    if args.json:
        sys.stdout.write(json.dumps(_finite(result), indent=1) + "\n")
    else:
        sys.stdout.write(report.text_report(result))
    sys.stdout.flush()
    if args.plot is not None:
        report.plot(result, Path(args.plot))
        log.info("wrote the plot %s", args.plot)


def _finite(x: object) -> object:
    """JSON has no NaN or infinity: such a number becomes null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _finite(dataclasses.asdict(x))
    return x
