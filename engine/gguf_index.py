"""What a GGUF file holds, as the engine needs it: metadata, a tensor index and the expert blob map.

The file is memory-mapped (copy-on-write, so a stray write can never touch the file); tensor bytes
are handed out as zero-copy uint8 views and stay quantised until a layer dequantises them.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from strata.engine import gguf_split
from strata.engine.errors import ModelLoadError
from strata.vmm import pagecache
from strata.vmm.pagecache import Run

log = logging.getLogger(__name__)

EXPERT_KINDS = ("gate", "up", "down")
MAX_DIMS = 4  # GGML_MAX_DIMS


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file. ``shape`` is in torch order (GGUF's ``ne`` reversed)."""

    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class ExpertRun:
    """One matrix of one routed expert: a contiguous byte run inside a 3-D ``*_exps`` tensor."""

    tensor: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, int]  # [rows, ne0]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ExpertBlob:
    """Everything one routed expert (layer, expert) owns: its gate, up and down byte runs."""

    layer: int
    expert: int
    gate: ExpertRun
    up: ExpertRun
    down: ExpertRun

    @property
    def runs(self) -> tuple[ExpertRun, ExpertRun, ExpertRun]:
        return (self.gate, self.up, self.down)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.runs)


HEADER_BYTES = 24  # magic, version, tensor count, metadata count
VERSIONS = (2, 3)  # the GGUF versions the gguf package reads


def _check_file(path: Path) -> None:
    """What is wrong with ``path`` before any parser sees it, in words: missing, a directory, not a
    GGUF file (its first bytes), a truncated header, a version not read here."""
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.gguf"))[:3]
        hint = f" (it holds {', '.join(inside)}, …)" if inside else ""
        raise ModelLoadError(f"{path}: is a directory, not a model file: name the .gguf file{hint}")
    if not path.exists():
        raise ModelLoadError(f"{path}: no such model file")
    if not path.is_file():
        raise ModelLoadError(f"{path}: not a regular file, so not a model file")
    try:
        with path.open("rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot be read ({e.strerror or e})") from None
    size = path.stat().st_size
    if size == 0:
        raise ModelLoadError(f"{path}: not a GGUF file: it is empty (0 bytes)")
    if not b"GGUF".startswith(head[:4]) or (len(head) >= 4 and head[:4] != b"GGUF"):
        raise ModelLoadError(
            f"{path}: not a GGUF file: it starts with {head[:4]!r}, a GGUF file with b'GGUF'"
        )
    if size < HEADER_BYTES:
        raise ModelLoadError(
            f"{path}: truncated GGUF file: {size} bytes, shorter than the "
            f"{HEADER_BYTES}-byte header"
        )
    version = int.from_bytes(head[4:8], "little")
    if version not in VERSIONS:
        raise ModelLoadError(
            f"{path}: GGUF version {version}, which Strata cannot read (it reads versions "
            f"{' and '.join(map(str, VERSIONS))}): damaged, or from a newer writer"
        )


def _reader_error(e: Exception, path: Path) -> str:
    """The gguf reader's error in words: its IndexError, numpy's ``cannot reshape`` and short
    reads all mean the header, the metadata or a tensor runs past the end of the file."""
    why = str(e)
    size = path.stat().st_size
    if "cannot reshape array" in why:  # numpy's words for a tensor cut off by the end
        return "truncated GGUF file: a tensor's data runs past the end of the file"
    if isinstance(e, IndexError) or any(words in why for words in _NUMPY_SHORT_READ):
        return (
            f"truncated or damaged GGUF file: its metadata or tensor list runs past the end of "
            f"the file ({size} bytes)"
        )
    return f"not a readable GGUF file ({why})"  # the gguf reader's own words name the damage


# numpy's words for a view that runs past the end of the mapped file
_NUMPY_SHORT_READ = ("out of bounds", "larger dtype", "buffer is smaller", "size must be a divisor")


def _open(path: Path) -> gguf.GGUFReader:
    _check_file(path)
    try:
        return gguf.GGUFReader(path, "c")
    except (ValueError, OSError, KeyError, IndexError) as e:
        raise ModelLoadError(f"{path}: {_reader_error(e, path)}") from None


@dataclass(frozen=True)
class FilePart:
    """One mapped file of a model; its bytes sit at ``base`` … ``base + size`` of the model's
    offset space (a single file is one part at 0)."""

    path: Path
    data: np.memmap
    base: int

    @property
    def size(self) -> int:
        return int(self.data.size)


class GGUFIndex:
    """A mapped GGUF model: ``metadata``, ``tensors`` and ``experts`` ((layer, expert) → blob).

    A split model (``gguf_split``) is opened from any of its parts; its parts are placed one
    after another in one offset space, so every offset here (``TensorInfo.offset``,
    ``ExpertRun.offset``, ``raw``, ``release``) is the model's, whichever file holds the bytes."""

    def __init__(self, path: str | Path) -> None:
        paths = gguf_split.part_paths(Path(path))
        gguf_split.missing_parts(paths)
        readers = [_open(p) for p in paths]
        gguf_split.check_set(paths, readers)
        self.path = paths[0]  # a split model is named by its first part, as llama.cpp does
        self.parts: list[FilePart] = []
        self.metadata: dict[str, Any] = {
            name: field.contents() for name, field in readers[0].fields.items() if field.types
        }
        self.tensors: dict[str, TensorInfo] = {}
        base = 0
        for p, reader in zip(paths, readers, strict=True):
            self.parts.append(FilePart(p, reader.data, base))
            self._read_tensors(self.parts[-1], reader)
            base += self.parts[-1].size
        self._bases = [part.base for part in self.parts]
        self.arch: str = str(self.metadata.get("general.architecture", ""))
        if not self.arch:
            raise ModelLoadError(f"{self.path}: no general.architecture in the metadata")
        self.experts: dict[tuple[int, int], ExpertBlob] = self._expert_map()
        log.debug(
            "%s: %s, %d tensors in %d file(s), %d routed experts",
            self.path.name,
            self.arch,
            len(self.tensors),
            len(self.parts),
            len(self.experts),
        )

    def _read_tensors(self, part: FilePart, reader: gguf.GGUFReader) -> None:
        """The tensors of one file, checked against that file, at their offsets in the model."""
        path = part.path
        alignment = int(reader.alignment)
        end, before = 0, None  # where the tensors so far end in the data section, the last one
        for t in reader.tensors:
            try:
                qtype = gguf.GGMLQuantizationType(int(t.tensor_type))
            except ValueError:
                raise ModelLoadError(
                    f"{path}: tensor {t.name} has unknown type id {int(t.tensor_type)}"
                ) from None
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            info = TensorInfo(t.name, qtype, shape, t.data_offset, int(t.n_bytes))
            self._check_tensor(path, info, reader.data_offset, alignment, part.size)
            self._check_follows(path, info, info.offset - reader.data_offset, end, before)
            end += -(-info.nbytes // alignment) * alignment
            before = info
            self.tensors[t.name] = replace(info, offset=part.base + info.offset)

    def _check_tensor(
        self, path: Path, t: TensorInfo, data_start: int, alignment: int, size: int
    ) -> None:
        """A damaged tensor entry is refused at load, never found by the first request."""
        where = f"{path}: tensor {t.name}"
        if not 1 <= len(t.shape) <= MAX_DIMS:
            raise ModelLoadError(f"{where} has {len(t.shape)} dimensions (GGUF allows 1 to 4)")
        block = gguf.GGML_QUANT_SIZES[t.qtype][0]
        if t.shape[-1] % block:
            raise ModelLoadError(
                f"{where}: its rows of {t.shape[-1]} elements are not whole {t.qtype.name} "
                f"blocks of {block}"
            )
        rel = t.offset - data_start
        if rel < 0 or rel % alignment:
            raise ModelLoadError(
                f"{where}: its data offset {rel} is not a multiple of the file's alignment "
                f"{alignment}"
            )
        if t.offset + t.nbytes > size:
            raise ModelLoadError(
                f"{where}: its {t.nbytes} bytes at offset {t.offset} run past the end of the "
                f"file ({size} bytes): the file is truncated or damaged"
            )

    def _check_follows(
        self, path: Path, t: TensorInfo, at: int, end: int, before: TensorInfo | None
    ) -> None:
        """Each tensor's data begins where the one before it ends (padded to the alignment), as
        llama.cpp requires: a gap or an overlap means a size that does not match its shape and
        type (a changed type id or dimension), whose bytes would be read from the wrong place."""
        if at == end:
            return
        where = f"{path}: tensor {t.name}"
        if before is None:
            raise ModelLoadError(
                f"{where}: its data begins at offset {at} of the data section, not at 0: "
                "a tensor's size does not match its shape and type, or the file is damaged"
            )
        raise ModelLoadError(
            f"{where}: its data begins at offset {at} of the data section, but the tensor "
            f"before it, {before.name} (shape {before.shape}, {before.qtype.name}: "
            f"{before.nbytes} bytes), ends at {end}: a size does not match its shape and type, "
            "or the file is damaged"
        )

    # -- metadata -------------------------------------------------------------------------------

    def key(self, name: str, default: Any = ...) -> Any:
        """``{arch}.name`` from the metadata; raises naming the key when absent and no default."""
        full = f"{self.arch}.{name}"
        if full in self.metadata:
            return self.metadata[full]
        if default is ...:
            raise ModelLoadError(f"{self.path}: metadata key {full} is missing")
        return default

    # -- tensors --------------------------------------------------------------------------------

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelLoadError(f"{self.path}: tensor {name} is missing") from None

    @property
    def name(self) -> str:
        """The model's name: its file's stem, a split model's without the part number."""
        return gguf_split.set_stem(self.path)

    @property
    def file_bytes(self) -> int:
        """The size of the model's files together."""
        return sum(part.size for part in self.parts)

    def _part(self, offset: int) -> FilePart:
        part = self.parts[bisect.bisect_right(self._bases, offset) - 1] if offset >= 0 else None
        if part is None or offset >= part.base + part.size:
            raise ModelLoadError(f"{self.path}: offset {offset} is outside the model's files")
        return part

    def _by_part(self, runs: Iterable[Run]) -> dict[Path, tuple[FilePart, list[Run]]]:
        """``runs`` (model offsets) grouped by the file holding them, at that file's offsets."""
        out: dict[Path, tuple[FilePart, list[Run]]] = {}
        for offset, n in runs:
            part = self._part(int(offset))
            out.setdefault(part.path, (part, []))[1].append((int(offset) - part.base, int(n)))
        return out

    def release(self, runs: Iterable[tuple[int, int]]) -> int:
        """Give the page cache's copies of these byte runs (offset, bytes) back to the system,
        our mapping's included: only whole pages inside the runs. Returns the bytes released;
        raises OSError when the kernel refuses."""
        return sum(
            pagecache.release(part.path, int(part.data.ctypes.data), local)
            for part, local in self._by_part(runs).values()
        )

    def resident_bytes(self, runs: Iterable[tuple[int, int]]) -> int:
        """Bytes of the pages touching ``runs`` that are in the page cache now."""
        return sum(
            pagecache.resident_bytes(part.path, local)
            for part, local in self._by_part(runs).values()
        )

    def raw(self, offset: int, nbytes: int) -> torch.Tensor:
        """Zero-copy uint8 view of ``nbytes`` at ``offset`` of the model (in one of its files)."""
        part = self.parts[0] if len(self.parts) == 1 else self._part(offset)
        local = offset - part.base
        if local + nbytes > part.size:
            raise ModelLoadError(
                f"{part.path}: {nbytes} bytes at offset {local} run past the end of the file"
            )
        # raw: [nbytes] uint8, backed by the file's pages
        return torch.from_numpy(part.data[local : local + nbytes])

    def tensor_raw(self, name: str) -> torch.Tensor:
        t = self.info(name)
        return self.raw(t.offset, t.nbytes)

    # -- experts --------------------------------------------------------------------------------

    def _trunk_layers(self) -> int | None:
        """The layers the forward runs where the file appends next-token-prediction (MTP)
        blocks after them (``nextn_predict_layers``, as llama.cpp's converter writes Qwen3.5
        and Qwen3-Next), else None. Bad values are left to the model's reader, which names
        them."""
        n_mtp, n_layer = self.key("nextn_predict_layers", 0), self.key("block_count", None)
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (n_mtp, n_layer))
        return n_layer - n_mtp if ok and 0 < n_mtp < n_layer else None

    def _expert_map(self) -> dict[tuple[int, int], ExpertBlob]:
        """The routed experts by (layer, expert). A prediction block's experts are not among
        them: the forward never runs that block, so no cache, host tier or count holds them."""
        blobs: dict[tuple[int, int], ExpertBlob] = {}
        layers: dict[int, dict[str, TensorInfo]] = {}
        trunk = self._trunk_layers()
        for t in self.tensors.values():
            parts = t.name.split(".")
            # blk.{l}.ffn_{kind}_exps.weight
            # (gpt-oss's expert biases, blk.{l}.ffn_{kind}_exps.bias, are vectors of the model)
            if (
                len(parts) == 4
                and parts[0] == "blk"
                and parts[2].endswith("_exps")
                and (parts[3] == "weight")
            ):
                kind = parts[2].removeprefix("ffn_").removesuffix("_exps")
                if kind in EXPERT_KINDS and (trunk is None or int(parts[1]) < trunk):
                    layers.setdefault(int(parts[1]), {})[kind] = t
        for layer, kinds in sorted(layers.items()):
            missing = [k for k in EXPERT_KINDS if k not in kinds]
            if missing:
                raise ModelLoadError(
                    f"{self.path}: layer {layer} lacks expert tensors for {', '.join(missing)}"
                )
            n_expert = {len(kinds[k].shape) == 3 and kinds[k].shape[0] for k in EXPERT_KINDS}
            if len(n_expert) != 1 or False in n_expert:
                shapes = {k: kinds[k].shape for k in EXPERT_KINDS}
                raise ModelLoadError(f"{self.path}: layer {layer} has mismatched experts {shapes}")
            for e in range(n_expert.pop()):
                runs = {k: _expert_run(kinds[k], e) for k in EXPERT_KINDS}
                blobs[(layer, e)] = ExpertBlob(layer, e, runs["gate"], runs["up"], runs["down"])
        return blobs

    def expert(self, layer: int, expert: int) -> ExpertBlob:
        try:
            return self.experts[(layer, expert)]
        except KeyError:
            raise ModelLoadError(f"{self.path}: no routed expert ({layer}, {expert})") from None

    def iter_experts(self) -> Iterator[ExpertBlob]:
        return iter(self.experts.values())

    @property
    def expert_bytes(self) -> int:
        return sum(b.nbytes for b in self.experts.values())


def _expert_run(t: TensorInfo, expert: int) -> ExpertRun:
    n_expert, rows, ne0 = t.shape
    per = t.nbytes // n_expert
    if per * n_expert != t.nbytes:
        raise ModelLoadError(f"tensor {t.name}: {t.nbytes} bytes do not split into {n_expert}")
    return ExpertRun(t.name, t.qtype, (rows, ne0), t.offset + expert * per, per)
