"""``strata pull``'s work: a GGUF model from a Hugging Face repository into the model library.

``REPO[:QUANT]`` names the repository (``owner/name``, also as ``hf.co/owner/name`` or its web
address) and the quantisation, matched without case against the label in each GGUF file's name
(or its folder's: ``UD-Q4_K_M/…-00001-of-00002.gguf``), as Ollama's ``hf.co/…:Q4_K_M`` and
llama.cpp's ``-hf`` do; without one, the repository's only model, else the first of
``DEFAULT_QUANTS`` it has. A split model's parts come together.

The listing (sizes and SHA-256 of each file) comes from ``HfApi.model_info``; each file is
fetched from its ``resolve`` address at the listing's commit through ``huggingface_hub``'s
session, with its token (``HF_TOKEN``, or the one ``hf auth login`` stored) and endpoint
(``HF_ENDPOINT``). The download is our own loop rather than ``hf_hub_download`` so that one
progress line covers every part, the free space is checked for all of them before the first
byte, and each file's SHA-256 is computed while it streams. A file downloads into
``<name>.part`` beside its final name; an interrupted download resumes from there (an HTTP range
request, the bytes already there hashed first), in the same run a few times and in a later
``strata pull`` of the same model. A size or checksum that does not match removes the part and
stops. The manifest (``library.write_manifest``) is written last: a model without one is not
listed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from strata.daemon import library
from strata.engine import gguf_split

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "https://huggingface.co"
# without a quantisation: the first of these the repository has (llama.cpp's -hf picks Q4_K_M)
DEFAULT_QUANTS = ("Q4_K_M", "UD-Q4_K_M", "UD-Q4_K_XL", "Q4_K_S", "MXFP4", "Q4_0", "Q8_0")
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
QUANT = re.compile(
    r"(?:^|(?<=[-_./]))((?:UD-)?(?:I?Q\d+(?:_[A-Z0-9]+)*|TQ\d_\d|BF16|F16|F32|MXFP4(?:_MOE)?))"
    r"(?=$|[-_./])",
    re.IGNORECASE,
)
CHUNK = 1 << 20
MARGIN = 64 << 20  # free space kept beyond the download
RETRIES = 3  # resumed attempts in one run after a transfer that broke off
TIMEOUT = 60.0  # seconds a connection may stall before it counts as broken (then resumed)


class Progress(Protocol):
    """Told of bytes as they land; ``fresh``: fetched now (not resumed or re-read from disk)."""

    def __call__(self, n: int, fresh: bool = True) -> None: ...


class PullError(Exception):
    """A pull that cannot go on; ``str()`` is the one line shown to the user."""


class UsageError(PullError):
    """A ``REPO[:QUANT]`` that names no repository or quantisation there is."""


@dataclass(frozen=True)
class RemoteFile:
    path: str  # in the repository
    size: int
    sha256: str | None


@dataclass(frozen=True)
class Choice:
    """One model of a repository: its label and its files (a split set's parts in order)."""

    label: str
    files: tuple[RemoteFile, ...]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class Plan:
    repo: str
    revision: str
    choice: Choice
    name: str
    folder: Path

    @property
    def total(self) -> int:
        return self.choice.size


def parse_spec(spec: str) -> tuple[str, str | None]:
    """``owner/name[:QUANT]`` (also ``hf.co/…`` or ``https://huggingface.co/…``) → repo, quant."""
    text = spec.strip()
    text = re.sub(r"^(https?://)?(www\.)?(hf\.co|huggingface\.co)/", "", text)
    repo, _, quant = text.partition(":")
    repo = repo.strip("/")
    if not REPO_ID.match(repo):
        raise UsageError(
            f"{spec!r} is not a Hugging Face repository: expected OWNER/NAME[:QUANT], for "
            "example unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M"
        )
    if ":" in quant or (quant and not re.match(r"^[A-Za-z0-9._-]+$", quant)):
        raise UsageError(f"{spec!r}: {quant!r} is not a quantisation name (such as Q4_K_M)")
    return repo, quant or None


def quant_label(path: str) -> str:
    """The quantisation a GGUF file's name (else its folder's) says, upper-case; else its name."""
    p = Path(path)
    for text in (gguf_split.set_stem(p.name), p.parent.name):
        found = QUANT.findall(text)
        if found:
            return found[-1].upper()
    return gguf_split.set_stem(p.name)


def choices(files: list[RemoteFile]) -> list[Choice]:
    """The repository's models: each single GGUF file and each complete split set. Vision
    projectors (``mmproj``) are not models. A split set missing parts is an error naming it."""
    sets: dict[tuple[str, str], list[RemoteFile]] = {}
    for f in files:
        p = Path(f.path)
        if p.suffix.lower() != ".gguf" or p.name.lower().startswith("mmproj"):
            continue
        sets.setdefault((str(p.parent), gguf_split.set_stem(p.name)), []).append(f)
    out = []
    for (_, _), members in sorted(sets.items()):
        members.sort(key=lambda f: f.path)
        first = gguf_split.PART_NAME.match(Path(members[0].path).name)
        if first is not None:
            count = int(first["count"])
            want = [str(p) for p in gguf_split.part_paths(Path(members[0].path))]
            have = {f.path for f in members}
            missing = [w for w in want if w not in have]
            if missing or len(members) != count:
                raise PullError(
                    f"the repository's split model {members[0].path} lacks parts "
                    f"{', '.join(missing) or '?'} of {count}: an incomplete upload"
                )
        out.append(Choice(quant_label(members[0].path), tuple(members)))
    return out


def choose(repo: str, options: list[Choice], quant: str | None) -> Choice:
    """The model ``quant`` names (see the module's docstring); raises listing what there is."""
    have = ", ".join(sorted({c.label for c in options}))
    if not options:
        raise PullError(f"{repo} has no GGUF model files (is it the GGUF repository?)")
    if quant is None:
        if len(options) == 1:
            return options[0]
        for want in DEFAULT_QUANTS:
            found = [c for c in options if c.label == want]
            if len(found) == 1:
                return found[0]
        raise UsageError(f"{repo} has several quantisations ({have}): name one, {repo}:QUANT")
    q = quant.lower()
    found = [c for c in options if c.label.lower() == q]
    if not found:  # a part of a name: "q4_k" in "…-Q4_K_M.gguf" when only one has it
        found = [c for c in options if q in c.files[0].path.lower()]
    if len(found) == 1:
        return found[0]
    if found:
        paths = ", ".join(c.files[0].path for c in found)
        raise UsageError(f"{repo}:{quant} matches several models ({paths}): name one exactly")
    raise UsageError(f"{repo} has no quantisation {quant} (it has: {have})")


# -- the Hub ------------------------------------------------------------------------------------


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def token() -> str | None:
    from huggingface_hub import get_token

    return os.environ.get("HF_TOKEN") or get_token()


def _hub_error(e: Exception, repo: str) -> PullError:
    """The Hub's errors in words: gated, missing or private, refused, unreachable."""
    from huggingface_hub import errors

    page = f"{endpoint()}/{repo}"
    if isinstance(e, errors.GatedRepoError):
        return PullError(
            f"{repo} is gated: accept its terms at {page} with your account, then give a token "
            "of that account in HF_TOKEN (or run `hf auth login`)"
        )
    if isinstance(e, errors.RepositoryNotFoundError):
        return PullError(
            f"{repo}: no such repository on {endpoint()} (a private one needs a token with "
            "access in HF_TOKEN)"
        )
    if isinstance(e, errors.RevisionNotFoundError | errors.RemoteEntryNotFoundError):
        return PullError(f"{repo}: {e}".splitlines()[0])
    status = getattr(getattr(e, "response", None), "status_code", None)
    if status in (401, 403):
        return PullError(
            f"{repo}: the Hub refused access ({status}): a gated or private repository needs "
            f"a token with access in HF_TOKEN (accept its terms at {page})"
        )
    if status is not None:
        return PullError(f"{repo}: the Hub answered {status}: {str(e).splitlines()[0]}")
    return PullError(f"{repo}: cannot reach {endpoint()}: {e}")


def listing(repo: str) -> tuple[str, list[RemoteFile]]:
    """The repository's commit and its files with sizes and SHA-256 (LFS files)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        info = HfApi(endpoint=endpoint(), token=token()).model_info(repo, files_metadata=True)
    except (HfHubHTTPError, OSError) as e:
        raise _hub_error(e, repo) from None
    except Exception as e:  # the HTTP client's transport errors
        if type(e).__module__.split(".")[0] in ("httpx", "httpx2"):
            raise _hub_error(e, repo) from None
        raise
    files = []
    for s in info.siblings or []:
        lfs = s.lfs or {}  # a dict with attributes (BlobLfsInfo)
        sha, size = lfs.get("sha256"), s.size if s.size is not None else lfs.get("size")
        if size is None:
            if s.rfilename.endswith(".gguf"):
                raise PullError(f"{repo}: the Hub listed {s.rfilename} without its size")
            continue
        files.append(RemoteFile(s.rfilename, int(size), sha))
    return info.sha or "main", files


def plan(spec: str, root: Path) -> Plan:
    repo, quant = parse_spec(spec)
    revision, files = listing(repo)
    choice = choose(repo, choices(files), quant)
    name = library.short_name(repo, choice.label)
    return Plan(repo, revision, choice, name, root / name)


# -- the download -------------------------------------------------------------------------------


def free_bytes(folder: Path) -> int:
    p = folder
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def local_name(f: RemoteFile) -> str:
    return Path(f.path).name


def up_to_date(p: Plan) -> bool:
    """The folder's manifest lists exactly the files of the plan, all there at their sizes."""
    if not (p.folder / library.MANIFEST).is_file():
        return False
    try:
        listed = library.manifest_files(p.folder)
    except (OSError, ValueError, KeyError, TypeError):
        return False
    want = [library.FileEntry(local_name(f), f.size, f.sha256) for f in p.choice.files]
    return listed == want and all(
        (p.folder / e.name).is_file() and (p.folder / e.name).stat().st_size == e.size for e in want
    )


def still_needed(p: Plan) -> int:
    """Bytes still to fetch: the files not yet there, less what their ``.part`` files hold."""
    need = 0
    for f in p.choice.files:
        done = p.folder / local_name(f)
        part = done.with_name(done.name + ".part")
        if done.is_file() and done.stat().st_size == f.size:
            continue
        need += f.size - (min(part.stat().st_size, f.size) if part.is_file() else 0)
    return need


def check_space(p: Plan) -> None:
    """Raises, before the first byte, when the folder's file system cannot hold what is left."""
    need, have = still_needed(p), free_bytes(p.folder)
    if need + MARGIN > have:
        raise PullError(
            f"{p.name} needs {need / 2**30:.2f} GiB more on the file system of {p.folder.parent} "
            f"and it has {have / 2**30:.2f} GiB free: free some space, or pull into another "
            "folder with --models-dir"
        )


def fetch(p: Plan, progress: Progress, retries: int | None = None) -> None:
    """Download every file of the plan into its folder (resuming ``.part`` files), check each
    one's size and SHA-256, then write the manifest."""
    p.folder.mkdir(parents=True, exist_ok=True)
    retries = RETRIES if retries is None else retries
    entries = []
    for f in p.choice.files:
        dst = p.folder / local_name(f)
        if not (dst.is_file() and dst.stat().st_size == f.size and _known_good(dst, f, progress)):
            _fetch_file(p, f, dst, progress, retries)
        entries.append(library.FileEntry(dst.name, f.size, f.sha256))
    library.write_manifest(p.folder, p.name, p.repo, p.choice.label, p.revision, entries)


def _known_good(dst: Path, f: RemoteFile, progress: Progress) -> bool:
    """A file already there at its size (a pull stopped before its manifest): its checksum."""
    if f.sha256 is None:
        progress(f.size, False)
        return True
    h = hashlib.sha256()
    with dst.open("rb") as src:
        while chunk := src.read(CHUNK * 8):
            h.update(chunk)
            progress(len(chunk), False)
    if h.hexdigest() == f.sha256:
        return True
    log.warning("%s: its checksum does not match the repository's; downloading it again", dst)
    dst.unlink()
    return False


def _fetch_file(p: Plan, f: RemoteFile, dst: Path, progress: Progress, retries: int) -> None:
    part = dst.with_name(dst.name + ".part")
    for attempt in range(retries + 1):
        counted = _Counted(progress)
        try:
            h = _download(p, f, part, counted)
            break
        except _transport_errors() as e:
            progress(-counted.n, False)  # the next attempt counts the bytes kept again
            have = part.stat().st_size if part.is_file() else 0
            if attempt == retries:
                raise PullError(
                    f"{f.path}: the download broke off at {have} of {f.size} bytes ({e}); run "
                    "the same `strata pull` again to resume it"
                ) from None
            log.warning("%s: the download broke off at %d bytes (%s); resuming", f.path, have, e)
    size = part.stat().st_size
    if size != f.size:
        part.unlink()
        raise PullError(f"{f.path}: {size} bytes arrived, the repository lists {f.size}")
    if f.sha256 is not None and h != f.sha256:
        part.unlink()
        raise PullError(
            f"{f.path}: checksum mismatch: SHA-256 {h}, the repository lists {f.sha256}; the "
            "download was removed: run `strata pull` again"
        )
    part.replace(dst)
    log.info("%s: %d bytes, SHA-256 verified", dst.name, size)


class _Counted:
    """A progress that remembers how much it was told (taken back when an attempt fails)."""

    def __init__(self, progress: Progress) -> None:
        self.progress, self.n = progress, 0

    def __call__(self, n: int, fresh: bool = True) -> None:
        self.n += n
        self.progress(n, fresh)


def _transport_errors() -> tuple[type[BaseException], ...]:
    out: list[type[BaseException]] = [OSError]
    for name in ("httpx2", "httpx"):
        try:
            module = __import__(name)
        except ImportError:
            continue
        out.append(module.TransportError)
    return tuple(out)


def _download(p: Plan, f: RemoteFile, part: Path, progress: Progress) -> str:
    """Stream the file's missing bytes into ``part``; returns the whole file's SHA-256."""
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    have = part.stat().st_size if part.is_file() else 0
    if have > f.size:
        part.unlink()
        have = 0
    h = hashlib.sha256()
    if have:
        with part.open("rb") as src:  # the bytes already there count in the checksum
            while chunk := src.read(CHUNK * 8):
                h.update(chunk)
        progress(have, False)
    if have == f.size:
        return h.hexdigest()
    url = f"{endpoint()}/{p.repo}/resolve/{p.revision}/{f.path}"
    headers = build_hf_headers(token=token() or False, library_name="strata")
    if have:
        headers["Range"] = f"bytes={have}-"
    with get_session().stream("GET", url, headers=headers, timeout=TIMEOUT) as r:
        if r.status_code >= 400:
            r.read()
            try:
                hf_raise_for_status(r)
            except Exception as e:
                raise _hub_error(e, p.repo) from None
        if have and r.status_code == 200:  # the server sent the whole file: start over
            log.info("%s: the server does not resume; downloading it from the start", f.path)
            progress(-have, False)
            have, h = 0, hashlib.sha256()
        elif have and r.status_code != 206:
            raise PullError(f"{f.path}: the server answered {r.status_code} to a resumed download")
        with part.open("ab" if have else "wb") as out:
            for chunk in r.iter_bytes():  # as they arrive: a break keeps every byte received
                out.write(chunk)
                h.update(chunk)
                progress(len(chunk))
    return h.hexdigest()
