"""What a weight format is: the pieces of one description, and the byte helpers its reference
unpack is written with.

A ``Format`` says everything the engine knows of one GGML type, in one place (as gguf-py's
``quants.py`` and ``constants.py`` do for the file): the elements of a block, the block's fields
in byte order (its size is their sum), the planes of the repacked kernel layout
(``quant/repack.py`` describes that layout), the reference unpack (raw blocks to float32, bit for
bit what ``gguf.quants`` computes), the tables a kernel reads (a grid type's grid, the levels of
a non-linear type: fixed planes, once per matrix), and which tile family of the kernels reads it.
The descriptions themselves live by family (``quant/legacy.py``: blocks of 32 and the plain
floats; ``quant/kquants.py``: the 256-element K-quants and IQ4_XS; ``quant/grids.py``: the
grid types) and are gathered in ``quant/formats.py``; nothing else writes a block size.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import gguf
import torch

# Fields wider than a byte are read by viewing the bytes as wider integers, which is only right on
# a little-endian host (GGUF is little-endian; so are x86-64, arm64 and every CUDA device).
assert sys.byteorder == "little", "strata.engine.quant needs a little-endian host"

Q = gguf.GGMLQuantizationType
F16_SIZE = 2  # an IEEE half: the scale of most blocks

# The kernels' tile families (``kernels/dot.py``): units of 32 elements whose 16 bytes ``16u + k``
# hold elements 32u + k and 32u + 16 + k (or that a type's decoder reads as such: Q8_0's two
# halves of a block), and plain floats in runs of 8.
UNIT32, FLOAT = "unit32", "float"


@dataclass(frozen=True)
class Field:
    """Bytes [at, at + nbytes) of every block of a type."""

    name: str
    at: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.at + self.nbytes


@dataclass(frozen=True)
class Plane:
    """One field of every block, gathered. ``src`` is the byte range of a raw block it copies
    (``None``: computed from the block, e.g. unpacked scales). A plane with ``fixed_bytes`` is
    instead that many bytes once per matrix, whatever its shape (``block_bytes`` 0: a row holds
    none of it; its bytes are the format's ``tables[name]``)."""

    name: str
    block_bytes: int
    src: tuple[int, int] | None
    fixed_bytes: int = 0


def copied(f: Field) -> Plane:
    """The plane that gathers field ``f`` unchanged."""
    return Plane(f.name, f.nbytes, (f.at, f.end))


def fields(*spec: tuple[str, int]) -> tuple[Field, ...]:
    """A block's fields from (name, bytes) in byte order."""
    out, at = [], 0
    for name, n in spec:
        out.append(Field(name, at, n))
        at += n
    return tuple(out)


@dataclass(frozen=True)
class Format:
    """One GGML type, described once (module docstring)."""

    qtype: Q
    block: int  # elements per block
    fields: tuple[Field, ...]  # the file's block, in byte order
    planes: tuple[Plane, ...]  # the repacked layout, in plane order
    unpack: Callable[[torch.Tensor], torch.Tensor]  # blocks [N, type_size] -> [N, block] f32
    kernel: str = UNIT32  # the kernels' tile family
    tables: Mapping[str, bytes] = field(default_factory=dict)  # fixed planes' bytes

    @property
    def type_size(self) -> int:
        return sum(f.nbytes for f in self.fields)

    @property
    def units(self) -> int:
        """Units of 32 elements in a block (the kernels' tile), for the UNIT32 family."""
        return self.block // 32

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"{self.qtype.name} has no field {name!r}")

    def plane(self, name: str) -> Plane:
        for p in self.planes:
            if p.name == name:
                return p
        raise KeyError(f"{self.qtype.name} has no plane {name!r}")

    def plane_index(self, name: str) -> int:
        return [p.name for p in self.planes].index(name)

    def check(self) -> None:
        """The description agrees with itself and with gguf's table (run at import)."""
        name = self.qtype.name
        assert gguf.GGML_QUANT_SIZES[self.qtype] == (self.block, self.type_size), name
        assert sum(p.block_bytes for p in self.planes) >= self.type_size, name
        for p in self.planes:
            assert (p.block_bytes == 0) == (p.fixed_bytes > 0), (name, p.name)
            assert not p.fixed_bytes or len(self.tables[p.name]) == p.fixed_bytes, (name, p.name)
            if p.src is not None:
                assert p.src[1] - p.src[0] == p.block_bytes <= self.type_size, (name, p.name)


# ---------------------------------------------------------------------------------------------
# Byte views. A slice of a block ([N, k] out of [N, type_size]) is strided; torch can view it as
# a wider dtype when its offset and strides are multiples of the new item size. Otherwise (an odd
# offset into a shared buffer, say) the slice is copied first: the values are the same either way.


def view(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """b: [..., k * itemsize] uint8 -> [..., k] dtype (little-endian reinterpretation)."""
    size = dtype.itemsize
    aligned = (
        b.stride(-1) == 1
        and b.storage_offset() % size == 0
        and all(s % size == 0 for s in b.stride()[:-1])
    )
    if not aligned:
        b = b.clone(memory_format=torch.contiguous_format)  # new storage, offset 0
    return b.view(dtype)


def f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The half at byte ``at`` of each block, as float32. blocks: [N, S] -> [N, 1]"""
    return view(blocks[:, at : at + F16_SIZE], torch.float16).float()


def part(blocks: torch.Tensor, f: Field) -> torch.Tensor:
    """Field ``f`` of each block: [N, f.nbytes] uint8 (a view)."""
    return blocks[:, f.at : f.end]


def nibbles(b: torch.Tensor, dim: int) -> torch.Tensor:
    """Low then high nibble of each byte, stacked as a new axis at ``dim``. b: uint8"""
    return torch.stack((b & 0x0F, b >> 4), dim=dim)


def shifts(bits: int, count: int, like: torch.Tensor) -> torch.Tensor:
    """[0, bits, 2*bits, ...] (count entries) as a uint8 column on ``like``'s device: [count, 1]"""
    return torch.arange(0, bits * count, bits, dtype=torch.uint8, device=like.device)[:, None]


def bits_of(words: torch.Tensor, n: int) -> torch.Tensor:
    """Bits 0..n-1 of each int32 word, least significant first: [..., n] int32 (0 or 1)."""
    at = torch.arange(n, dtype=torch.int32, device=words.device)
    return (words.to(torch.int32)[..., None] >> at) & 1


def float_table(values: tuple[float, ...]) -> bytes:
    """A table of float32 values as the little-endian bytes a fixed plane holds."""
    return torch.tensor(values, dtype=torch.float32).view(torch.uint8).numpy().tobytes()


def table_tensor(table: bytes, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.frombuffer(bytearray(table), dtype=torch.uint8).to(device)
