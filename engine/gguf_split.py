"""Split GGUF sets: one model stored as ``<stem>-00001-of-0000N.gguf`` … ``-0000N-of-0000N.gguf``.

Hugging Face refuses files over 50 GB, so large releases come in parts, written by llama.cpp's
``gguf-split`` or gguf-py's ``GGUFWriter(split_max_tensors=…)``. Each part is a GGUF file of its
own holding some of the tensors; every part carries ``split.no`` (0-based), ``split.count`` and
``split.tensors.count`` (the tensors of the whole set), and only the first part carries the
model's metadata. This module finds a set's parts from any one of them and checks that they
belong together; ``GGUFIndex`` maps each part and places them one after another in one offset
space, so nothing above it knows a model has parts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from strata.engine.errors import ModelLoadError

KEY_NO = gguf.Keys.Split.LLM_KV_SPLIT_NO
KEY_COUNT = gguf.Keys.Split.LLM_KV_SPLIT_COUNT
KEY_TENSORS = gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT
# the name llama.cpp and gguf-py give part i (1-based) of n
PART_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def part_name(stem: str, no: int, count: int) -> str:
    """The file name of part ``no`` (1-based) of a set of ``count``."""
    return f"{stem}-{no:05d}-of-{count:05d}.gguf"


def set_stem(path: str | Path) -> str:
    """The name of the model a file holds: ``model`` for ``model-00002-of-00003.gguf`` and for
    ``model.gguf``."""
    p = Path(path)
    m = PART_NAME.match(p.name)
    return m["stem"] if m else p.stem


def part_paths(path: str | Path) -> list[Path]:
    """Every part of the set ``path`` belongs to, by its name (the path alone for a file whose
    name is not a part's). Raises naming the file when its name says part 0 or part k of fewer."""
    p = Path(path)
    m = PART_NAME.match(p.name)
    if m is None:
        return [p]
    no, count = int(m["no"]), int(m["count"])
    if not 1 <= no <= count:
        raise ModelLoadError(f"{p}: the name says part {no} of {count}, which no set has")
    return [p.with_name(part_name(m["stem"], i, count)) for i in range(1, count + 1)]


def missing_parts(paths: Sequence[Path]) -> None:
    """Raises naming the first part of a split set's ``paths`` that is not a file (a single
    file's own checks say what is wrong with it)."""
    if len(paths) == 1:
        return
    for i, p in enumerate(paths):
        if not p.is_file():
            raise ModelLoadError(
                f"{p}: part {i + 1} of the {len(paths)}-part model {set_stem(p)} is missing "
                "(download every part into the same folder)"
            )


def _int_field(reader: gguf.GGUFReader, key: str) -> int | None:
    field = reader.fields.get(key)
    if field is None or not field.types:
        return None
    value = field.contents()
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ModelLoadError(f"metadata key {key} is {value!r}, expected an integer")
    return int(value)


def check_set(paths: Sequence[Path], readers: Sequence[gguf.GGUFReader]) -> None:
    """Each part says it is that part of a set of this size with the same tensor count, the
    tensors of all parts add up to that count, and no tensor is in two parts. Raises naming the
    part that does not fit."""
    n = len(paths)
    if n == 1:
        count = _int_field(readers[0], KEY_COUNT)
        if count is not None and count > 1:
            raise ModelLoadError(
                f"{paths[0]}: the file is part of a {count}-part split model, but its name is "
                f"not a part's (<name>-00001-of-{count:05d}.gguf), so the other parts cannot be "
                "found: keep the names the parts were published under"
            )
        return
    total: int | None = None
    seen: dict[str, Path] = {}
    for i, (p, r) in enumerate(zip(paths, readers, strict=True)):
        try:
            no, count, tensors = (_int_field(r, k) for k in (KEY_NO, KEY_COUNT, KEY_TENSORS))
        except ModelLoadError as e:
            raise ModelLoadError(f"{p}: {e}") from None
        if no is None or count is None or tensors is None:
            raise ModelLoadError(
                f"{p}: named as part {i + 1} of {n}, but it has no split metadata "
                f"({KEY_NO}, {KEY_COUNT}, {KEY_TENSORS}): not a part of a split model"
            )
        if (no, count) != (i, n):
            raise ModelLoadError(
                f"{p}: named as part {i + 1} of {n}, but its metadata says part {no + 1} of "
                f"{count}: a part of another set"
            )
        if total is None:
            total = tensors
        elif tensors != total:
            raise ModelLoadError(
                f"{p}: its set has {tensors} tensors, the first part's has {total}: a part of "
                "another set"
            )
        for t in r.tensors:
            if t.name in seen:
                raise ModelLoadError(
                    f"{p}: tensor {t.name} is also in {seen[t.name].name}: a part of another set"
                )
            seen[t.name] = p
    if len(seen) != total:
        raise ModelLoadError(
            f"{paths[0]}: the parts hold {len(seen)} tensors, but the set should have {total}: "
            "a part of another set, or a damaged part"
        )


# -- writing a set ------------------------------------------------------------------------------


def write_parts(src: str | Path, dst: str | Path, n_parts: int) -> list[Path]:
    """Write the single-file model ``src`` as a set of ``n_parts`` parts named after ``dst``
    (``dst=x/model.gguf`` gives ``x/model-00001-of-0000N.gguf`` …), with gguf-py's writer: the
    same metadata, tensors, types and bytes. Returns the parts' paths."""
    reader = gguf.GGUFReader(Path(src), "r")
    n = len(reader.tensors)
    if not 2 <= n_parts <= n:
        raise ValueError(f"n_parts is {n_parts}: a file of {n} tensors splits into 2 to {n}")
    arch = str(reader.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(Path(dst), arch, split_max_tensors=math.ceil(n / n_parts))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or not field.types:
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        if len(field.types) > 2:
            raise ValueError(f"{src}: metadata key {name} is a nested array; not copied")
        w.add_key_value(name, _value(field), field.types[0], sub)
    for t in reader.tensors:
        qtype = gguf.GGMLQuantizationType(int(t.tensor_type))
        data = np.asarray(t.data).view(np.uint8)
        rows = tuple(int(d) for d in reversed(t.shape.tolist()))[:-1]
        w.add_tensor(t.name, data.reshape(*rows, -1), raw_dtype=qtype)
    paths = w.format_shard_names(Path(dst))
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    if len(paths) != n_parts:
        raise AssertionError(f"the writer made {len(paths)} parts, not {n_parts}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return paths


def _value(field: Any) -> Any:
    if field.types[0] == gguf.GGUFValueType.ARRAY and field.types[-1] == gguf.GGUFValueType.STRING:
        # string arrays as bytes: a vocabulary's byte tokens are not all valid UTF-8
        return [bytes(field.parts[i]) for i in field.data]
    return field.contents()
