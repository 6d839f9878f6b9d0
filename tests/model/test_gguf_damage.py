"""Damaged model files are refused when the index is built, each with one error naming the file
and what is wrong, never found later by a request (a misaligned tensor once loaded, reported
ready and answered every request with a 500).

The files are written byte by byte here (GGUF v3: header, key/values, tensor infos, aligned
data), so each case breaks exactly one thing.
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import pytest

from strata.engine.errors import ModelLoadError
from strata.engine.gguf_index import GGUFIndex

Q = gguf.GGMLQuantizationType
ALIGN = 32
STRING = 8  # GGUF value type ids
UINT32 = 4


def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def gguf_bytes(
    tensors: list[tuple[str, tuple[int, ...], int, int]] | None = None,
    version: int = 3,
    magic: bytes = b"GGUF",
    arch: bytes | None = None,
    data_bytes: int | None = None,
) -> bytes:
    """A GGUF file: tensors as (name, ne, type id, offset in the data section)."""
    if tensors is None:
        tensors = [("a.weight", (32, 2), int(Q.F32), 0), ("b.weight", (32,), int(Q.F32), 256)]
    kv = _str("general.architecture") + struct.pack("<I", STRING) + (arch or _str("qwen3moe"))
    kv += _str("general.alignment") + struct.pack("<I", UINT32) + struct.pack("<I", ALIGN)
    head = magic + struct.pack("<IQQ", version, len(tensors), 2) + kv
    for name, ne, qtype, offset in tensors:
        head += _str(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
        head += struct.pack("<IQ", qtype, offset)
    head += b"\0" * (-len(head) % ALIGN)
    return head + b"\x11" * (512 if data_bytes is None else data_bytes)


def write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(data)
    return path


def test_the_well_formed_file_reads(tmp_path: Path) -> None:
    index = GGUFIndex(write(tmp_path, gguf_bytes()))
    assert index.info("a.weight").shape == (2, 32) and index.arch == "qwen3moe"


CASES = [
    ("zero bytes", b"", "not a readable GGUF file"),
    ("a text file", b"model = 'qwen'\n" * 20, "not a readable GGUF file"),
    ("bad magic", gguf_bytes(magic=b"GGML"), "not a readable GGUF file"),
    ("unknown version", gguf_bytes(version=99), "not a readable GGUF file"),
    ("truncated header", gguf_bytes()[:40], "not a readable GGUF file"),
    ("truncated data", gguf_bytes(data_bytes=300), "past the end of the file"),
    ("offset past the end", gguf_bytes([("a.weight", (32,), int(Q.F32), 4096)]), "past the end"),
    ("misaligned offset", gguf_bytes([("a.weight", (32,), int(Q.F32), 4)]), "alignment 32"),
    ("unknown type", gguf_bytes([("a.weight", (32,), 250, 0)]), "not a readable GGUF file"),
    ("rows not whole blocks", gguf_bytes([("a.weight", (40,), int(Q.Q4_K), 0)]),
     "not a multiple of Q4_K block size"),
    ("five dimensions", gguf_bytes([("a.weight", (32, 1, 1, 1, 1), int(Q.F32), 0)]),
     "5 dimensions"),
    ("duplicate names", gguf_bytes([("a.weight", (32,), int(Q.F32), 0),
                                    ("a.weight", (32,), int(Q.F32), 128)]), "duplicated"),
    ("absurd string length", gguf_bytes(arch=struct.pack("<Q", 2**62) + b"qwen"),
     "not a readable GGUF file"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "data", "reason"), CASES, ids=[c[0] for c in CASES])
def test_a_damaged_file_is_refused_naming_why(tmp_path: Path, case, data, reason) -> None:
    path = write(tmp_path, data)
    with pytest.raises(ModelLoadError) as e:
        GGUFIndex(path)
    message = str(e.value)
    assert str(path) in message and reason in message, message
    assert len(message.splitlines()) == 1 and len(message) < 400


def test_a_file_without_its_architecture_is_named(tmp_path: Path) -> None:
    data = gguf_bytes().replace(b"general.architecture", b"general.architectur_")
    with pytest.raises(ModelLoadError, match=r"no general\.architecture"):
        GGUFIndex(write(tmp_path, data))
