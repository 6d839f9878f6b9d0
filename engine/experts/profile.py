"""The expert usage profile: per-expert counts kept across runs to fill the cache at the next start.

One JSON file per model under the state directory, written atomically (temporary file in the same
directory, fsync, rename). Loading never fails the start: a missing file is an empty profile, and a
file that cannot be used (corrupt, another format version, another model) is reported once and
ignored.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path

from strata.engine.experts.slots import ExpertKey

log = logging.getLogger(__name__)

FORMAT = "strata-expert-profile"
VERSION = 1


class _Invalid(Exception):
    """Why a profile file cannot be used (internal to ``load``)."""


def _valid_key(key: object) -> ExpertKey:
    if (
        not isinstance(key, tuple)
        or len(key) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in key)
    ):
        raise ValueError(f"expert key {key!r} is not a (layer, expert) pair of non-negative ints")
    return key


def _valid_count(key: ExpertKey, count: object) -> float:
    if isinstance(count, bool) or not isinstance(count, int | float):
        raise ValueError(f"count {count!r} for {key} is not a number")
    value = float(count)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"count {count!r} for {key} is not a finite non-negative number")
    return value


class UsageProfile:
    """Counts per (layer, expert) for the model named by ``model_key``."""

    def __init__(self, model_key: str, counts: Mapping[ExpertKey, float] | None = None) -> None:
        if not isinstance(model_key, str) or not model_key:
            raise ValueError(f"model_key={model_key!r} must be a non-empty string")
        self.model_key = model_key
        self.counts: dict[ExpertKey, float] = {}
        if counts:
            self.merge(counts)

    def merge(self, other: UsageProfile | Mapping[ExpertKey, float]) -> None:
        """Add ``other``'s counts to these. A profile of another model raises ValueError."""
        if isinstance(other, UsageProfile):
            if other.model_key != self.model_key:
                raise ValueError(
                    f"cannot merge the profile of model {other.model_key!r} into the profile "
                    f"of model {self.model_key!r}"
                )
            other = other.counts
        checked = [(_valid_key(k), _valid_count(k, c)) for k, c in other.items()]
        for key, count in checked:  # validated first, so a bad entry changes nothing
            self.counts[key] = self.counts.get(key, 0.0) + count

    def ranked(self) -> list[ExpertKey]:
        """Keys by descending count, ties by (layer, expert)."""
        return sorted(self.counts, key=lambda k: (-self.counts[k], k))

    def __len__(self) -> int:
        return len(self.counts)

    def to_json(self) -> str:
        rows = [[k[0], k[1], c] for k, c in sorted(self.counts.items())]
        doc = {"format": FORMAT, "version": VERSION, "model_key": self.model_key, "counts": rows}
        return json.dumps(doc, separators=(",", ":"), allow_nan=False)

    def save(self, path: Path) -> None:
        """Write atomically: a crash leaves the old file or the new one, never a torn file and no
        temporary file. Creates parent directories. OSError propagates (the caller decides)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self.to_json().encode()
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _fsync_dir(path.parent)

    @classmethod
    def load(cls, path: Path, model_key: str) -> UsageProfile:
        """The profile saved at ``path`` for ``model_key``. Missing file: an empty profile, quietly.
        Any other problem: one warning naming the file and the reason, and an empty profile."""
        path = Path(path)
        try:
            text = path.read_bytes().decode("utf-8")
        except FileNotFoundError:
            return cls(model_key)
        except (OSError, UnicodeDecodeError) as e:
            log.warning("ignoring expert profile %s: cannot read it (%s)", path, e)
            return cls(model_key)
        try:
            return cls(model_key, _parse(text, model_key))
        except _Invalid as e:
            log.warning("ignoring expert profile %s: %s", path, e)
            return cls(model_key)


def _parse(text: str, model_key: str) -> dict[ExpertKey, float]:
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise _Invalid(f"not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise _Invalid(f"expected a JSON object, found {type(doc).__name__}")
    if doc.get("format") != FORMAT:
        raise _Invalid(f"format is {doc.get('format')!r}, expected {FORMAT!r}")
    if doc.get("version") != VERSION:
        raise _Invalid(f"format version is {doc.get('version')!r}, this build reads {VERSION}")
    if doc.get("model_key") != model_key:
        raise _Invalid(
            f"it belongs to model {doc.get('model_key')!r}, not to the loaded model {model_key!r}"
        )
    rows = doc.get("counts")
    if not isinstance(rows, list):
        raise _Invalid(f"'counts' is {type(rows).__name__}, expected a list")
    counts: dict[ExpertKey, float] = {}
    for i, row in enumerate(rows):
        try:
            if not isinstance(row, list) or len(row) != 3:
                raise ValueError(f"{row!r} is not a [layer, expert, count] triple")
            key = _valid_key((row[0], row[1]))
            count = _valid_count(key, row[2])
        except ValueError as e:
            raise _Invalid(f"entry {i}: {e}") from None
        if key in counts:
            raise _Invalid(f"entry {i}: {key} appears twice")
        counts[key] = count
    return counts


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not every filesystem allows opening a directory.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def profile_path(state_dir: Path, model_key: str) -> Path:
    """``state_dir/profiles/<readable stem>-<12 hex of sha256(model_key)>.json``: one file per
    model; the hash keeps keys that read alike apart, the stem lets a person tell files apart."""
    digest = hashlib.sha256(model_key.encode()).hexdigest()[:12]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", model_key).strip(".-_")[:48].rstrip(".-_")
    return Path(state_dir) / "profiles" / f"{stem or 'model'}-{digest}.json"
