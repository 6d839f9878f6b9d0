"""``strata bench``: the CLI edge of ``strata.engine.bench``.

Parses and validates the flags into one ``BenchSettings`` (a bad value is one line naming it, exit
2), runs the bench with a progress bar on stderr, and prints the table, or the JSON with
``--json``, on stdout; ``--plot FILE.png`` draws tok/s against peak VRAM.
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
from typing import TYPE_CHECKING

from strata.daemon import paths
from strata.daemon.config import LoadedConfig, Origin, add_option_flags
from strata.daemon.engine_setup import engine_options
from strata.daemon.generate_cmd import ProgressBar
from strata.engine.bench import settings as bs
from strata.engine.errors import EngineError, ModelLoadError

if TYPE_CHECKING:
    from strata.engine.bench.settings import BenchSettings

log = logging.getLogger(__name__)

EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_option_flags(parser)  # --device, --threads, --context-length, --model, ...
    # The bench sweeps cache budgets: its --cache-mib (a list) replaces the option of that name.
    parser.conflict_handler = "resolve"
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
    g.add_argument("--reps", metavar="N", default="3", help="repetitions per measurement (3)")
    g.add_argument(
        "--decode-tokens", metavar="N", default="128", help="tokens per decode run (128)"
    )
    g.add_argument(
        "--prefill",
        metavar="LIST",
        default=",".join(map(str, bs.DEFAULT_PREFILL)),
        help="prompt sizes whose prefill is timed (512,4096); sizes beyond the context are "
        "skipped with the reason",
    )
    g.add_argument("--json", action="store_true", help="print the results as JSON")
    g.add_argument("--plot", metavar="FILE.png", help="draw tok/s against peak VRAM (matplotlib)")
    g.add_argument(
        "--vs-llama-cpp",
        metavar="LLAMA_BENCH",
        help="path of llama.cpp's llama-bench: run it on the same file and pair the rows",
    )
    g.add_argument(
        "--n-cpu-moe",
        metavar="LIST",
        default=",".join(map(str, bs.DEFAULT_N_CPU_MOE)),
        help="llama-bench --n-cpu-moe values, one process each (0,12,24,36,48)",
    )
    g.add_argument(
        "--time-limit",
        metavar="SECONDS",
        help="start no new Strata measurement after this long; the rest are skipped with the "
        "reason (unset: no limit)",
    )
    parser.set_defaults(run=run)


def build_settings(loaded: LoadedConfig, args: argparse.Namespace) -> BenchSettings:
    """Everything the bench needs, validated; raises ``BenchError`` naming a bad value. The
    flags are checked before anything slow (torch, the device, writing a synthetic model)."""
    given = args.bench_cache_mib
    budgets = bs.parse_budgets(given) if given is not None else None
    reps = bs.parse_int(args.reps, "--reps", 1)
    decode = bs.parse_int(args.decode_tokens, "--decode-tokens", 2)
    prefill = bs.parse_int_list(args.prefill, "--prefill", 1)
    n_cpu_moe = bs.parse_int_list(args.n_cpu_moe, "--n-cpu-moe", 0)
    limit = None if args.time_limit is None else bs.parse_seconds(args.time_limit, "--time-limit")
    llama = None
    if args.vs_llama_cpp is not None:
        llama = Path(args.vs_llama_cpp).expanduser()
        if not llama.is_file() or not os.access(llama, os.X_OK):
            raise bs.BenchError(
                f"--vs-llama-cpp: {str(llama)!r} is not an executable file (llama.cpp's "
                "llama-bench)"
            )
    if args.plot is not None:
        from strata.engine.bench.report import PlotUnavailable, require_matplotlib

        try:
            require_matplotlib()
        except PlotUnavailable as e:
            raise bs.BenchError(str(e)) from None
    preset = None if args.synthetic is None else bs.synthetic_preset(args.synthetic)
    if preset is not None and loaded.sources["model"].origin is Origin.FLAG:
        raise bs.BenchError("--synthetic and --model exclude each other: give one")
    if preset is None and loaded.config.model is None:
        raise bs.BenchError("no model: give --synthetic NAME or --model PATH")
    options = engine_options(loaded.config)
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
    )


def _model(loaded: LoadedConfig, name: str | None, preset: str | None) -> Path:
    """``--synthetic NAME`` (written on first use) or the model file; never the demo model."""
    if name is None or preset is None:
        assert loaded.config.model is not None  # checked with the other flags
        return loaded.config.model
    from strata.engine.synth import ensure_synthetic

    bar = ProgressBar(f"writing {name}")
    return ensure_synthetic(preset, paths.cache_dir(), lambda d, t: bar(d, t, "random weights"))


def run(loaded: LoadedConfig, args: argparse.Namespace) -> int:
    try:
        settings = build_settings(loaded, args)
    except bs.BenchError as e:
        print(f"strata bench: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    from strata.engine.bench import report
    from strata.engine.bench.session import run_bench

    bar = ProgressBar("bench")
    try:
        result = run_bench(settings, progress=bar)
    except ModelLoadError as e:
        print(f"strata bench: error: cannot load the model: {e}", file=sys.stderr)
        return EXIT_USAGE
    except EngineError as e:  # a CUDA device that is not there, a run that failed
        print(f"strata bench: error: {e}", file=sys.stderr)
        return EXIT_FAILURE
    result["command"] = sys.argv
    if args.json:
        sys.stdout.write(json.dumps(_finite(result), indent=1) + "\n")
    else:
        sys.stdout.write(report.text_report(result))
    sys.stdout.flush()
    if args.plot is not None:
        report.plot(result, Path(args.plot))
        log.info("wrote the plot %s", args.plot)
    return EXIT_INTERRUPTED if result.get("interrupted") else 0


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
