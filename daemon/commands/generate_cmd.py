"""``strata generate``: one generation without the daemon.

Only generated text goes to stdout; the load progress, the hit rate and the tok/s line go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, Any

from strata import paths
from strata.daemon.config import LoadedConfig
from strata.daemon.engine_setup import engine_options, model_path
from strata.engine.errors import ContextOverflow, EngineError, ModelLoadError
from strata.engine.params import SamplingParams

if TYPE_CHECKING:
    from strata.engine.generate import Engine
    from strata.engine.generation import GenerationResult

log = logging.getLogger("strata.daemon.generate_cmd")  # the name its log lines always had

# flag -> (SamplingParams field, parser, what is expected)
_SAMPLING_FLAGS: dict[str, tuple[str, type, str]] = {
    "--max-tokens": ("max_tokens", int, "an integer >= 1"),
    "--temperature": ("temperature", float, "a number >= 0 (0: greedy)"),
    "--top-k": ("top_k", int, "an integer >= 0 (0: off)"),
    "--top-p": ("top_p", float, "a number in (0, 1]"),
    "--min-p": ("min_p", float, "a number in [0, 1)"),
    "--repeat-penalty": ("repeat_penalty", float, "a number > 0 (1: off)"),
    "--repeat-last-n": ("repeat_last_n", int, "an integer >= 0"),
    "--seed": ("seed", int, "an integer >= 0"),
}


class UsageError(Exception):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", help="the prompt text (default: read standard input)")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="treat the prompt as a user message and apply the model's chat template",
    )
    parser.add_argument("--system", help="a system message (with --chat)")
    defaults = SamplingParams()
    for flag, (name, _, expected) in _SAMPLING_FLAGS.items():
        default = 128 if name == "max_tokens" else getattr(defaults, name)
        parser.add_argument(
            flag,
            dest=f"sp_{name}",
            metavar="N",
            default=None,
            help=f"{expected} (default: {'random' if default is None else default})",
        )
    parser.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop at this text (repeatable)"
    )


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    values: dict[str, Any] = {"max_tokens": 128}
    for flag, (name, parse, expected) in _SAMPLING_FLAGS.items():
        raw = getattr(args, f"sp_{name}")
        if raw is None:
            continue
        try:
            values[name] = parse(raw)
        except ValueError:
            raise UsageError(f"{flag}: invalid value {raw!r} (expected {expected})") from None
    values["stop"] = tuple(args.stop)
    try:
        return SamplingParams(**values)
    except ValueError as e:
        # "name: invalid value X (expected ...)" -> the flag and the value as the user typed them
        name, _, rest = str(e).partition(":")
        flag = next((f for f, (n, _, _) in _SAMPLING_FLAGS.items() if n == name), f"--{name}")
        raw = getattr(args, f"sp_{name}", None)
        given = rest.split(" (")[0].removeprefix(" invalid value ")
        shown = repr(raw) if raw is not None else given
        why = rest[rest.find(" (") :] if " (" in rest else ""
        raise UsageError(f"{flag}: invalid value {shown}{why}") from None


class ProgressBar:
    """A one-line progress bar on stderr (only when stderr is a terminal)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.tty = sys.stderr.isatty()

    def __call__(self, done: int, total: int, what: str) -> None:
        if not self.tty:
            return
        width = 30
        filled = width * done // max(total, 1)
        bar = "#" * filled + "-" * (width - filled)
        sys.stderr.write(f"\r{self.label} [{bar}] {what:<32}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def run(loaded: LoadedConfig, args: argparse.Namespace) -> int:
    config = loaded.config
    try:
        params = sampling_params(args)
        prompt = args.prompt if args.prompt is not None else _stdin_prompt()
    except UsageError as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return 2
    from strata.engine.generate import Engine

    try:
        path = model_path(config)
        engine = Engine.load(
            path,
            engine_options(config),
            state_dir=paths.state_dir(),
            progress=ProgressBar("loading"),
        )
    except ModelLoadError as e:
        print(f"strata: error: cannot load the model: {e}", file=sys.stderr)
        return 2
    except EngineError as e:  # e.g. a CUDA device that is not there
        print(f"strata: error: {e}", file=sys.stderr)
        return 2
    try:
        if args.chat:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            messages.append({"role": "user", "content": prompt})
            ids = engine.encode_chat(messages)
        else:
            ids = engine.encode_prompt(prompt)
        result = engine.generate(ids, params, on_text=_write)
        sys.stdout.write("\n")
        sys.stdout.flush()
        _report(engine, result)
    except ContextOverflow as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return 2
    except EngineError as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return 1
    finally:
        engine.save_profile()
        engine.close()
    return 0


def _stdin_prompt() -> str:
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError("--prompt: missing (give --prompt TEXT or pipe the prompt on stdin)")
    return sys.stdin.read()


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _report(engine: Engine, r: GenerationResult) -> None:
    """The cache and the hit rate of every stage together (one stage without a split), read from
    the engine's status."""
    stages = engine.status().stages
    caches = [s.cache for s in stages if s.cache is not None]
    if caches:
        slots = sum(c.size_bytes // (c.max_bytes // c.max_experts) for c in caches if c.max_experts)
        size = sum(c.size_bytes for c in caches)
        print(
            f"[expert cache: {slots} of {sum(c.max_experts for c in caches)} experts, "
            f"{size / 2**20:.0f} MiB]",
            file=sys.stderr,
        )
    hits, misses = sum(s.fetches.hits for s in stages), sum(s.fetches.misses for s in stages)
    if not any(s.fetches.cached for s in stages):
        hit = "n/a (no expert cache: every expert read from RAM or the file)"
    elif hits + misses == 0:
        hit = "n/a (no expert used)"
    else:
        hit = f"{hits / (hits + misses):.1%}"
    tok_s = f"{r.decode_tok_s:.2f} tok/s" if r.decode_tok_s else "n/a tok/s"
    prefill = r.prompt_tokens / r.prefill_s if r.prefill_s > 0 else 0.0
    print(
        f"[{r.completion_tokens} tokens, finish {r.finish_reason}; prompt {r.prompt_tokens} tokens "
        f"at {prefill:.1f} tok/s; decode {tok_s}; expert cache hit rate {hit}; seed {r.seed}]",
        file=sys.stderr,
    )
