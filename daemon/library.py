"""The model library: the models in one folder (``models_dir``), each known by a short name.

A pulled model lives in a folder of its own, ``<models_dir>/<name>/``, with its GGUF file (or
every part of a split one) and ``strata-model.json``, the manifest ``strata pull`` writes last:
the name, the Hugging Face repository and quantisation it came from, and each file's size and
SHA-256. A GGUF file put straight into ``models_dir`` (a split one by its parts) is a model too,
named after its file. Names are short and lower-case, derived from the repository and the
quantisation as Ollama's are: ``unsloth/Qwen3.6-35B-A3B-GGUF`` in ``UD-Q4_K_M`` is
``qwen3.6-35b-a3b:ud-q4_k_m``.

Wherever a model file is asked for (``model = …`` in the configuration, ``--model``), a library
name works as well as a path.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf

from strata import paths
from strata.engine import gguf_split
from strata.engine.errors import ModelLoadError

log = logging.getLogger(__name__)

MANIFEST = "strata-model.json"
MANIFEST_VERSION = 1
NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*(:[a-z0-9][a-z0-9._-]*)?$")


class LibraryError(ModelLoadError):
    """A library name that names no model, several, or a manifest that cannot be read."""


def default_dir() -> Path:
    """``$XDG_DATA_HOME/strata/models``: where models are pulled when ``models_dir`` is unset."""
    return paths.data_dir() / "models"


def short_name(repo: str, quant: str) -> str:
    """``unsloth/Qwen3.6-35B-A3B-GGUF`` and ``UD-Q4_K_M`` → ``qwen3.6-35b-a3b:ud-q4_k_m``."""
    base = repo.rstrip("/").rsplit("/", 1)[-1].lower()
    base = re.sub(r"[-_.]gguf$", "", base)
    base = re.sub(r"[^a-z0-9._-]+", "-", base).strip("-.")
    tag = re.sub(r"[^a-z0-9._-]+", "-", quant.lower()).strip("-.")
    if not base or not tag:
        raise ValueError(f"no model name can be made of {repo!r} and {quant!r}")
    return f"{base}:{tag}"


@dataclass(frozen=True)
class FileEntry:
    """One file of a pulled model, as its manifest lists it."""

    name: str
    size: int
    sha256: str | None = None


@dataclass(frozen=True)
class LibraryModel:
    """A model of the library: its name, its files (the first part first) and where it came
    from (``repo``/``quant``: None for a file put into the folder by hand)."""

    name: str
    files: tuple[Path, ...]
    folder: Path | None = None  # its own folder (a pulled model), None for a loose file
    repo: str | None = None
    quant: str | None = None
    revision: str | None = None

    @property
    def path(self) -> Path:
        """The file to open: the model's first part."""
        return self.files[0]

    @property
    def size(self) -> int:
        return sum(p.stat().st_size for p in self.files if p.is_file())

    @property
    def complete(self) -> bool:
        return all(p.is_file() for p in self.files)


def write_manifest(folder: Path, name: str, repo: str, quant: str, revision: str | None,
                   files: list[FileEntry]) -> Path:  # fmt: skip
    """Write ``folder/strata-model.json`` (atomically: it marks a finished pull)."""
    body = {
        "version": MANIFEST_VERSION,
        "name": name,
        "repo": repo,
        "quant": quant,
        "revision": revision,
        "files": [{"name": f.name, "size": f.size, "sha256": f.sha256} for f in files],
    }
    tmp = folder / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(body, indent=2) + "\n")
    tmp.replace(folder / MANIFEST)
    return folder / MANIFEST


def read_manifest(folder: Path) -> LibraryModel:
    """The model a folder's manifest describes; raises naming the manifest when it is damaged."""
    where = folder / MANIFEST
    try:
        body = json.loads(where.read_text())
        name = body["name"]
        files = [folder / Path(f["name"]).name for f in body["files"]]
        if not isinstance(name, str) or not files:
            raise ValueError("no name or no files")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise LibraryError(f"{where}: not a readable model manifest ({e})") from None
    return LibraryModel(name, tuple(files), folder, body.get("repo"), body.get("quant"),
                        body.get("revision"))  # fmt: skip


def manifest_files(folder: Path) -> list[FileEntry]:
    """The files a folder's manifest lists, with their sizes and checksums."""
    body = json.loads((folder / MANIFEST).read_text())
    return [FileEntry(f["name"], int(f["size"]), f.get("sha256")) for f in body["files"]]


def models(root: Path) -> list[LibraryModel]:
    """Every model in ``root``, by name. A folder whose manifest is damaged is logged and
    skipped (``strata models`` still lists the rest)."""
    found: dict[str, LibraryModel] = {}
    for m in _scan(root):
        if m.name in found:
            log.warning("%s: a second model named %s (the first: %s); skipped",
                        m.path, m.name, found[m.name].path)  # fmt: skip
            continue
        found[m.name] = m
    return sorted(found.values(), key=lambda m: m.name)


def _scan(root: Path) -> Iterator[LibraryModel]:
    if not root.is_dir():
        return
    for entry in sorted(root.iterdir()):
        if entry.is_dir() and (entry / MANIFEST).is_file():
            try:
                yield read_manifest(entry)
            except LibraryError as e:
                log.warning("%s", e)
        elif entry.is_file() and entry.suffix == ".gguf":
            m = gguf_split.PART_NAME.match(entry.name)
            if m is not None and int(m["no"]) != 1:
                continue  # a later part: its set is listed by its first part
            name = gguf_split.set_stem(entry).lower()
            yield LibraryModel(name, tuple(gguf_split.part_paths(entry)))


def find(root: Path, name: str) -> LibraryModel | None:
    """The model ``name`` names: exactly, or (without ``:quant``) the one model of that base.
    Case does not matter. Raises when a name without its quantisation names several."""
    want = name.strip().lower()
    all_models = models(root)
    for m in all_models:
        if m.name == want:
            return m
    if ":" not in want:
        same = [m for m in all_models if m.name.split(":", 1)[0] == want]
        if len(same) == 1:
            return same[0]
        if same:
            raise LibraryError(
                f"model {name!r}: the library has it in {len(same)} quantisations "
                f"({', '.join(m.name for m in same)}): name one"
            )
    return None


def looks_like_path(spec: str) -> bool:
    return "/" in spec or spec.endswith(".gguf") or spec.startswith((".", "~"))


# what `strata pull` takes: owner/name[:QUANT], also as hf.co/owner/name or its web address
PULL_SPEC = re.compile(
    r"^(?:https?://)?(?:www\.)?(?:(?:hf\.co|huggingface\.co)/)?"
    r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<quant>[\w.-]+))?$"
)


def _pulled(root: Path, text: str) -> LibraryModel | None:
    """The model pulled as ``text`` (``owner/name:QUANT``, as ``strata pull`` was given it)."""
    m = PULL_SPEC.match(text)
    if m is None or (m["quant"] is None and not text.startswith(("hf.co/", "huggingface.co/"))):
        return None
    repo, quant = m["repo"].lower(), (m["quant"] or "").lower()
    same = [x for x in models(root) if (x.repo or "").lower() == repo]
    found = [x for x in same if (x.quant or "").lower() == quant] if quant else same
    if len(found) == 1:
        return found[0]
    raise LibraryError(
        f"model {text!r}: no such file; "
        + (f"the library has {m['repo']} as {', '.join(x.name for x in same)}" if same else
           f"`strata pull {text}` gets it into the library {root}")
    )  # fmt: skip


def resolve(root: Path, spec: str | Path) -> Path:
    """The file to open for ``spec``: a path to a GGUF file (or any part of a split set), or a
    library name. Raises naming both places looked in when neither has it."""
    text = str(spec)
    path = Path(text).expanduser()
    if path.exists():
        return path
    if looks_like_path(text):
        pulled = _pulled(root, text)
        # else the engine's own errors say what is wrong with a path
        return pulled.path if pulled is not None and pulled.complete else path
    m = find(root, text)
    if m is None:
        have = ", ".join(x.name for x in models(root)) or "none yet"
        raise LibraryError(
            f"model {text!r}: no such file, and no model of that name in the library {root} "
            f"(it has: {have}); `strata pull REPO:QUANT` gets one, `strata models` lists them"
        )
    if not m.complete:
        missing = [p.name for p in m.files if not p.is_file()]
        raise LibraryError(
            f"model {m.name}: its files {', '.join(missing)} are missing from {m.folder or root}; "
            f"`strata pull {m.repo}:{m.quant}` gets them again"
            if m.repo
            else f"model {m.name}: {', '.join(missing)} missing from {root}"
        )
    return m.path


def name_of(path: Path | None, root: Path) -> str:
    """What a loaded model is called: its library name when ``path`` is a library model's file,
    else its file's name without ``.gguf`` and part number."""
    if path is None:
        return ""
    resolved = path.resolve()
    for m in models(root):
        if any(p.resolve() == resolved for p in m.files):
            return m.name
    return gguf_split.set_stem(path)


def listed(root: Path) -> list[tuple[str, int]]:
    """Each complete model's name and its first file's time (``/v1/models``); a folder that
    cannot be read lists nothing (logged), never an error for the client."""
    out = []
    try:
        for m in models(root):
            if m.complete:
                out.append((m.name, int(m.path.stat().st_mtime)))
    except OSError as e:
        log.warning("the model library %s cannot be read: %s", root, e)
    return out


def remove(root: Path, name: str) -> LibraryModel:
    """Delete the model ``name`` (its folder, or its loose files). Raises when none matches."""
    m = find(root, name)
    if m is None:
        raise LibraryError(f"model {name!r}: no model of that name in the library {root}")
    if m.folder is not None:
        shutil.rmtree(m.folder)
    else:
        for p in m.files:
            p.unlink(missing_ok=True)
    log.info("removed %s (%s)", m.name, m.folder or m.path)
    return m


@dataclass(frozen=True)
class Facts:
    """What ``strata models`` shows of a model's files: its architecture and weight types
    (most bytes first), or why they cannot be read."""

    arch: str
    types: tuple[str, ...]
    problem: str = ""


def facts(m: LibraryModel) -> Facts:
    """Read the model's headers (no tensor data)."""
    by_type: Counter[str] = Counter()
    arch = ""
    try:
        for i, p in enumerate(m.files):
            reader = gguf.GGUFReader(p, "r")
            if i == 0:
                field = reader.fields.get("general.architecture")
                arch = str(field.contents()) if field is not None else "?"
            for t in reader.tensors:
                by_type[gguf.GGMLQuantizationType(int(t.tensor_type)).name] += int(t.n_bytes)
    except (OSError, ValueError, KeyError, IndexError) as e:
        return Facts(arch or "?", (), f"unreadable: {e}")
    return Facts(arch, tuple(name for name, _ in by_type.most_common()))
