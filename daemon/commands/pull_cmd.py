"""``strata pull REPO[:QUANT]``: a GGUF model from Hugging Face into the model library, with a
progress line (bytes, rate, time left). The work is ``hf_pull``'s; this is the command's edge.

Exit codes: 0 pulled (or already there), 1 a pull that failed (network, checksum, space, access),
2 a ``REPO[:QUANT]`` that names nothing there is.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from typing import TextIO

from strata.daemon.config import LoadedConfig
from strata.daemon.engine_setup import models_dir

log = logging.getLogger("strata.daemon.pull_cmd")  # the name its log lines always had

EXIT_FAILURE = 1
EXIT_USAGE = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "spec",
        metavar="REPO[:QUANT]",
        help="a Hugging Face repository (owner/name) and a quantisation such as Q4_K_M "
        "(unset: the repository's only model, or its Q4_K_M)",
    )
    parser.set_defaults(run=run)


def _amount(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def progress_line(label: str, done: int, total: int, rate: float | None, width: int = 24) -> str:
    """``label [#####-----] 1.2 GiB / 3.4 GiB  45.0 MiB/s  1m02s left``; ``rate``: bytes a
    second (None: not yet known)."""
    filled = width * min(max(done, 0), total) // max(total, 1)
    bar = "#" * filled + "-" * (width - filled)
    text = f"{label} [{bar}] {_amount(done)} / {_amount(total)}"
    if rate is not None and rate > 0:
        text += f"  {_amount(rate)}/s  {_duration(max(total - done, 0) / rate)} left"
    return text


class ProgressBar:
    """One line on ``out`` (redrawn at most ten times a second when it is a terminal; else a line
    every tenth of the way). The rate counts this run's bytes only (not resumed ones)."""

    def __init__(self, label: str, total: int, out: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.label, self.total, self.clock = label, total, clock
        self.out = out if out is not None else sys.stderr
        self.tty = self.out.isatty()
        self.done = 0
        self.fresh = 0  # bytes this run fetched (resumed and verified ones not)
        self.start = clock()
        self.last_draw = -1.0
        self.last_tenth = -1

    def __call__(self, n: int, fresh: bool = True) -> None:
        self.done += n
        if fresh:
            self.fresh += n
        now = self.clock()
        elapsed = now - self.start
        rate = self.fresh / elapsed if elapsed > 0.5 and self.fresh > 0 else None
        if self.tty:
            if now - self.last_draw >= 0.1 or self.done >= self.total:
                self.last_draw = now
                line = progress_line(self.label, self.done, self.total, rate)
                self.out.write(f"\r{line:<100}")
                self.out.flush()
        else:
            tenth = 10 * self.done // max(self.total, 1)
            if tenth != self.last_tenth:
                self.last_tenth = tenth
                self.out.write(progress_line(self.label, self.done, self.total, rate) + "\n")

    def finish(self) -> None:
        if self.tty:
            self.out.write("\n")
            self.out.flush()


def run(loaded: LoadedConfig, args: argparse.Namespace) -> int:
    from strata.daemon import hf_pull

    root = models_dir(loaded.config)
    if loaded.config.log_level != "debug":  # a line per request would bury the progress line
        for name in ("httpx", "httpx2"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        plan = hf_pull.plan(args.spec, root)
        files = len(plan.choice.files)
        what = f"{plan.repo} {plan.choice.label}" + (f" ({files} parts)" if files > 1 else "")
        if hf_pull.up_to_date(plan):
            print(f"{plan.name} is up to date in {plan.folder}")
            return 0
        hf_pull.check_space(plan)
        print(f"pulling {what}: {_amount(plan.total)} into {plan.folder}", file=sys.stderr)
        bar = ProgressBar(plan.name, plan.total)
        try:
            hf_pull.fetch(plan, bar)
        finally:
            bar.finish()
    except hf_pull.UsageError as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except hf_pull.PullError as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"pulled {plan.name} ({_amount(plan.total)}); serve it with: strata serve --model "
          f"{plan.name}")  # fmt: skip
    return 0
