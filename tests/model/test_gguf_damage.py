"""Damaged model files are refused at load, each with one error naming the file and what is
wrong, never found later by a request (a misaligned tensor once loaded, reported ready and
answered every request with a 500).

The index cases are files written byte by byte here (GGUF v3: header, key/values, tensor infos,
aligned data), so each case breaks exactly one thing. The model cases start from a small
well-formed synthetic model and change one key's value, or hide a key, in its bytes (same
length, so the rest of the file stays valid); ``Engine.load`` must refuse each before it builds
anything.
"""

from __future__ import annotations

import struct
import tempfile
from pathlib import Path

import gguf
import pytest

from strata.engine import synth
from strata.engine.errors import ModelLoadError
from strata.engine.generate import Engine
from strata.engine.gguf_index import GGUFIndex
from strata.engine.options import EngineOptions

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
    ("zero bytes", b"", "not a GGUF file: it is empty (0 bytes)"),
    ("a text file", b"model = 'qwen'\n" * 20, "not a GGUF file: it starts with b'mode'"),
    ("bad magic", gguf_bytes(magic=b"GGML"), "not a GGUF file: it starts with b'GGML'"),
    ("unknown version", gguf_bytes(version=99), "GGUF version 99, which Strata cannot read"),
    ("four bytes", b"GGUF", "truncated GGUF file: 4 bytes, shorter than the 24-byte header"),
    ("truncated header", gguf_bytes()[:40], "truncated or damaged GGUF file: its metadata"),
    ("a hundred bytes", gguf_bytes()[:100], "runs past the end of the file (100 bytes)"),
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
     "runs past the end of the file"),
    # a.weight says F16 (128 bytes) over the 256 bytes of F32 it has: b.weight's data then
    # starts where a.weight's would not end
    ("size not matching the type", gguf_bytes([("a.weight", (32, 2), int(Q.F16), 0),
                                               ("b.weight", (32,), int(Q.F32), 256)]),
     "does not match its shape and type"),
    ("size not matching the shape", gguf_bytes([("a.weight", (32, 4), int(Q.F32), 0),
                                                ("b.weight", (32,), int(Q.F32), 256)]),
     "a.weight (shape (4, 32), F32: 512 bytes), ends at 512"),
    ("a gap between tensors", gguf_bytes([("a.weight", (32, 2), int(Q.F32), 0),
                                          ("b.weight", (32,), int(Q.F32), 288)]),
     "begins at offset 288 of the data section"),
    ("the first tensor not at the start", gguf_bytes([("a.weight", (32,), int(Q.F32), 128)]),
     "not at 0"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "data", "reason"), CASES, ids=[c[0] for c in CASES])
def test_a_damaged_file_is_refused_naming_why(tmp_path: Path, case, data, reason) -> None:
    path = write(tmp_path, data)
    with pytest.raises(ModelLoadError) as e:
        GGUFIndex(path)
    message = str(e.value)
    assert str(path) in message and reason in message, message
    assert len(message.splitlines()) == 1 and len(message) < 400
    assert "index 0" not in message and "reshape" not in message  # never numpy's words


def test_a_directory_is_named_as_one(tmp_path: Path) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "qwen.gguf").write_bytes(gguf_bytes())
    with pytest.raises(ModelLoadError, match=r"models: is a directory, not a model file.*qwen"):
        GGUFIndex(folder)
    with pytest.raises(ModelLoadError, match="no such model file"):
        GGUFIndex(tmp_path / "missing.gguf")


def test_a_file_without_its_architecture_is_named(tmp_path: Path) -> None:
    data = gguf_bytes().replace(b"general.architecture", b"general.architectur_")
    with pytest.raises(ModelLoadError, match=r"no general\.architecture"):
        GGUFIndex(write(tmp_path, data))


# -- the model's metadata and tensors ------------------------------------------------------------

SMALL = synth.ModelSpec("qwen3moe", 2, 64, 4, 2, 16, 4, 2, 64, 256, 1e6, 1e-6)
ARCH = "qwen3moe"


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A small well-formed qwen3moe file (2 blocks, 4 experts, Q4_0 matrices), as bytes."""
    path = tmp_path_factory.mktemp("small") / "small.gguf"
    types = synth.TypePlan.uniform(Q.Q4_0)
    synth.write_model(path, SMALL, synth.vocab_for(ARCH), types, seed=5)
    return path.read_bytes()


def _key(name: str) -> bytes:
    return _str(f"{ARCH}.{name}")


def hide(data: bytes, name: str) -> bytes:
    """The file with key ``name`` renamed (the same length: the file stays readable)."""
    key = _key(name)
    assert data.count(key) == 1, name
    return data.replace(key, key[:-1] + b"_")


def set_u32(data: bytes, name: str, value: int) -> bytes:
    old = _key(name) + struct.pack("<I", UINT32)
    at = data.index(old) + len(old)
    return data[:at] + struct.pack("<I", value) + data[at + 4 :]


def set_f32(data: bytes, name: str, value: float) -> bytes:
    old = _key(name) + struct.pack("<I", 6)  # FLOAT32
    at = data.index(old) + len(old)
    return data[:at] + struct.pack("<f", value) + data[at + 4 :]


def set_tensor_type(data: bytes, name: str, qtype: int) -> bytes:
    info = _str(name)
    at = data.index(info) + len(info)
    (n_dims,) = struct.unpack_from("<I", data, at)
    at += 4 + 8 * n_dims
    return data[:at] + struct.pack("<I", qtype) + data[at + 4 :]


def retype_last(data: bytes, qtype: int) -> bytes:
    """The file with its last tensor (by offset) of type ``qtype``, zero bytes appended where the
    new type takes more (nothing after that tensor moves)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.gguf"
        path.write_bytes(data)
        last = max(gguf.GGUFReader(path).tensors, key=lambda t: t.data_offset)
        name, n, old = last.name, int(last.n_elements), int(last.n_bytes)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    return set_tensor_type(data, name, qtype) + bytes(max(0, n // block * size - old))


MODEL_CASES = [
    ("no block count", lambda d: hide(d, "block_count"), "qwen3moe.block_count is missing"),
    ("no head count", lambda d: hide(d, "attention.head_count"),
     "qwen3moe.attention.head_count is missing"),
    ("no expert count", lambda d: hide(d, "expert_count"), "qwen3moe.expert_count is missing"),
    ("no experts used", lambda d: hide(d, "expert_used_count"),
     "qwen3moe.expert_used_count is missing"),
    ("no norm epsilon", lambda d: hide(d, "attention.layer_norm_rms_epsilon"),
     "layer_norm_rms_epsilon is missing"),
    ("zero blocks", lambda d: set_u32(d, "block_count", 0),
     "block_count is 0, expected at least 1"),
    ("more blocks than the file has", lambda d: set_u32(d, "block_count", 3),
     "block_count is 3, but the file lacks blocks 2"),
    ("fewer blocks than the file has", lambda d: set_u32(d, "block_count", 1),
     "block_count is 1, but the file has tensors of blocks 1 beyond it"),
    ("zero heads", lambda d: set_u32(d, "attention.head_count", 0),
     "head_count is 0, expected at least 1"),
    ("kv heads not dividing the heads", lambda d: set_u32(d, "attention.head_count", 5),
     "head_count_kv is 2, expected a divisor of head_count 5"),
    ("heads not matching attn_q", lambda d: set_u32(d, "attention.head_count", 2),
     "tensor blk.0.attn_q.weight has shape (64, 64), but the metadata implies (32, 64)"),
    ("expert count not matching the tensors", lambda d: set_u32(d, "expert_count", 6),
     "blk.0.ffn_gate_inp.weight has shape (4, 64), but the metadata implies (6, 64)"),
    ("more experts used than there are", lambda d: set_u32(d, "expert_used_count", 9),
     "expert_used_count is 9, expected at most expert_count 4"),
    ("embedding length not matching", lambda d: set_u32(d, "embedding_length", 32),
     "tensor token_embd.weight has shape"),
    ("a NaN epsilon", lambda d: set_f32(d, "attention.layer_norm_rms_epsilon", float("nan")),
     "layer_norm_rms_epsilon is nan, expected a finite number above 0"),
    # Q8_1 (blocks of 32 weights in 40 bytes) is llama.cpp's type for activations, not weights
    ("a type Strata cannot read", lambda d: retype_last(d, int(Q.Q8_1)),
     "is of type Q8_1, which Strata cannot read"),
]  # fmt: skip


def test_the_small_model_loads(tmp_path: Path, small_model: bytes) -> None:
    engine = Engine.load(write(tmp_path, small_model), EngineOptions(threads=1))
    assert engine.sequences.model.shape.n_layer == 2
    engine.close()


@pytest.mark.parametrize(("case", "damage", "reason"), MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_damaged_metadata_is_refused_at_load_naming_it(
    tmp_path: Path, small_model: bytes, case, damage, reason
) -> None:
    path = write(tmp_path, damage(small_model))
    with pytest.raises(ModelLoadError) as e:
        Engine.load(path, EngineOptions(threads=1))
    message = str(e.value)
    assert str(path) in message and reason in message, message
    assert len(message.splitlines()) == 1 and len(message) < 400
    assert "index 0" not in message and "reshape" not in message  # never numpy's words
