"""``strata models``: the model library — list its models, remove one.

``strata models`` (or ``strata models list``) prints each model's name, size, architecture,
weight types and whether the running daemon serves it (asked over its HTTP endpoint; a daemon
that does not answer serves none). ``strata models rm NAME`` deletes a model's files; the one the
daemon serves is refused.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from strata.daemon.config import LoadedConfig, StrataConfig
from strata.daemon.engine_setup import models_dir

if TYPE_CHECKING:
    from strata.daemon.library import LibraryModel

EXIT_USAGE = 2


def add_arguments(
    parser: argparse.ArgumentParser,
    parser_class: type,
    flags: Callable[[argparse.ArgumentParser], None],
) -> None:
    """``flags`` adds the option flags to a parser: each action takes them after its name too."""
    parser.add_argument("--json", action="store_true", help="one JSON object per model")
    flags(parser)
    sub = parser.add_subparsers(dest="models_command", metavar="ACTION", parser_class=parser_class)
    flags(sub.add_parser("list", help="list the models (the default)"))
    rm = sub.add_parser("rm", help="delete a model's files")
    rm.add_argument("name", metavar="NAME", help="the model's name (as `strata models` lists it)")
    flags(rm)
    parser.set_defaults(run=run)


def run(loaded: LoadedConfig, args: argparse.Namespace) -> int:
    config = loaded.config
    root = models_dir(config)
    if getattr(args, "models_command", None) == "rm":
        return _remove(config, root, args.name)
    return _list(config, root, args.json)


def served_path(config: StrataConfig, timeout: float = 1.0) -> Path | None:
    """The model file the daemon at the configured address serves, or None when none answers."""
    host = config.host if config.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    req = urllib.request.Request(f"http://{host}:{config.port}/v1/vram")
    if config.api_key:
        req.add_header("Authorization", f"Bearer {config.api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = json.loads(r.read())
    except (OSError, ValueError, urllib.error.URLError):
        return None
    path = body.get("model_path") if isinstance(body, dict) else None
    return Path(path).resolve() if isinstance(path, str) else None


def _is(m: LibraryModel, served: Path | None) -> bool:
    return served is not None and any(p.resolve() == served for p in m.files)


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n_unit = n / 1024 ** ("KiB", "MiB", "GiB", "TiB").index(unit) / 1024
        if n_unit < 1024 or unit == "TiB":
            return f"{n_unit:.1f} {unit}"
    raise AssertionError(n)


def _list(config: StrataConfig, root: Path, as_json: bool) -> int:
    from strata.daemon import library  # gguf and numpy: not for --help

    found = library.models(root)
    served = served_path(config) if found else None
    rows: list[dict[str, Any]] = []
    for m in found:
        f = library.facts(m) if m.complete else library.Facts("?", (), "incomplete: files missing")
        rows.append({
            "name": m.name, "size": m.size, "arch": f.arch, "types": list(f.types),
            "loaded": _is(m, served), "path": str(m.path), "repo": m.repo,
            "problem": f.problem or None,
        })  # fmt: skip
    if as_json:
        for row in rows:
            print(json.dumps(row))
        return 0
    if not rows:
        print(f"no models in {root} yet: `strata pull REPO[:QUANT]` gets one from Hugging Face")
        return 0
    table = [("NAME", "SIZE", "ARCH", "TYPES", "LOADED")]
    for row in rows:
        types = ",".join(row["types"][:3]) + (",…" if len(row["types"]) > 3 else "")
        table.append((row["name"], _size(row["size"]), row["arch"],
                      row["problem"] or types, "yes" if row["loaded"] else "no"))  # fmt: skip
    widths = [max(len(r[i]) for r in table) for i in range(5)]
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 0


def _remove(config: StrataConfig, root: Path, name: str) -> int:
    from strata.daemon import library

    try:
        m = library.find(root, name)
        if m is None:
            raise library.LibraryError(f"model {name!r}: no model of that name in {root}")
        if _is(m, served_path(config)):
            raise library.LibraryError(
                f"model {m.name} is the one the daemon serves: stop it (or serve another) first"
            )
        size = m.size
        library.remove(root, m.name)
    except (library.LibraryError, OSError) as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"removed {m.name} ({_size(size)} freed)")
    return 0
