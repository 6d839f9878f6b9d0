"""``strata``: the command line (the composition root, above ``daemon`` and ``ipc``). Parses,
builds the one config, hands it down, maps errors to exits.

Exit codes: 0 success, 1 a run-time failure, 2 a usage or configuration error (bad option, a model
file that cannot be loaded) — the systemd unit treats 2 as "do not restart".
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from strata import __version__
from strata.daemon.config import (
    ENGINE_OPTIONS,
    LIBRARY_OPTIONS,
    ConfigError,
    LoadedConfig,
    add_option_flags,
    describe_sources,
)
from strata.daemon.config import load_config as _load_config
from strata.daemon.logsetup import setup_logging

log = logging.getLogger(__name__)

EXIT_FAILURE = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that exits 2 with one line (no usage dump) on a bad command line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="strata", description="Run a Mixture-of-Experts model beside the desktop."
    )
    parser.add_argument("--version", action="version", version=f"strata {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    from strata.daemon.commands import generate_cmd

    gen = sub.add_parser("generate", help="generate text from a prompt (no daemon)")
    generate_cmd.add_arguments(gen)
    add_option_flags(gen, ENGINE_OPTIONS)
    gen.set_defaults(run=generate_cmd.run)

    from strata.daemon.commands import bench_cmd

    bench = sub.add_parser("bench", help="measure speed and memory, optionally against llama.cpp")
    bench_cmd.add_arguments(bench)

    srv = sub.add_parser("serve", help="run the daemon (HTTP endpoint, VRAM control plane)")
    add_option_flags(srv)
    srv.set_defaults(run=_serve)

    from strata.daemon.commands import models_cmd

    models = sub.add_parser("models", help="list the model library's models, or remove one")
    models_cmd.add_arguments(models, _Parser, lambda p: add_option_flags(p, LIBRARY_OPTIONS))

    from strata.daemon.commands import pull_cmd

    pull = sub.add_parser("pull", help="download a GGUF model from Hugging Face into the library")
    pull_cmd.add_arguments(pull)
    add_option_flags(pull, frozenset({"models_dir", "log_level"}))

    from strata.daemon.commands import install_cmd

    svc = sub.add_parser("service", help="install the systemd user unit and D-Bus activation")
    install_cmd.add_arguments(svc, _Parser)

    cfg = sub.add_parser("config", help="inspect the configuration")
    cfg_sub = cfg.add_subparsers(dest="config_command", metavar="ACTION", parser_class=_Parser)
    cfg_sub.required = True
    show = cfg_sub.add_parser("show", help="print the effective configuration and its sources")
    add_option_flags(show)
    show.set_defaults(run=_config_show)
    return parser


def _serve(loaded: LoadedConfig, args: argparse.Namespace) -> int:
    from strata import serve  # torch and the engine: not for --help or --version

    return serve.run(loaded)


def _config_show(loaded: LoadedConfig, args: argparse.Namespace) -> int:
    where = loaded.config_file or "none (no config.toml found)"
    print(f"# configuration file: {where}")
    for line in describe_sources(loaded):
        print(line)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error already printed
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    loaded: LoadedConfig | None = None
    if not getattr(args, "without_config", False):  # `strata service`: whatever config says
        try:
            loaded = _load_config(args)
        except ConfigError as e:
            print(f"strata: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        setup_logging(loaded.config.log_level)
    try:
        code = args.run(loaded, args)
        sys.stdout.flush()  # here, not at exit: a reader that left is seen below
        return code
    except KeyboardInterrupt:
        print("strata: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `strata config show | head -1`: the reader is gone
        from strata.ipc.ctl import quiet_broken_pipe

        return quiet_broken_pipe()
