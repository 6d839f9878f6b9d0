"""The tiny hybrid test files (``strata.engine.synth_hybrid``), shared by the hybrid tests: each
(arch, type) written once per session; Q4_K_M from llama.cpp's own quantiser on the F32 file."""

from __future__ import annotations

from pathlib import Path

from gguf import GGMLQuantizationType as Q
from tiny_models import LlamaCppMissing, llama_cpp_quantize, load_llama_cpp

from strata.engine.synth_hybrid import HybridSpec, write_hybrid

ARCHS = ("qwen35moe", "qwen3next")
SYNTH = {"F32": Q.F32, "Q8_0": Q.Q8_0}


class HybridFiles:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._paths: dict[tuple[str, str], Path] = {}

    def path(self, arch: str, kind: str = "F32", **spec: object) -> Path:
        key = (arch, kind + repr(sorted(spec.items())))
        if key not in self._paths:
            self._paths[key] = self._build(arch, kind, len(self._paths), **spec)
        return self._paths[key]

    def _build(self, arch: str, kind: str, n: int, **spec: object) -> Path:
        dst = self.root / f"tiny-{arch}-{kind}-{n}.gguf"
        if kind in SYNTH:
            return write_hybrid(dst, HybridSpec(arch, **spec), SYNTH[kind])  # type: ignore[arg-type]
        try:
            llama_cpp = load_llama_cpp()
        except ImportError as e:
            raise LlamaCppMissing(f"{dst.name} needs llama.cpp's quantiser: {e}") from e
        return llama_cpp_quantize(llama_cpp, self.path(arch, "F32", **spec), dst, kind)


def dequantised_copy(src: Path, dst: Path) -> Path:
    """``src`` with every tensor dequantised to F32 (``gguf.quants``), its metadata as it is:
    the same weights for llama.cpp to compute in float, the yardstick of a quantised file."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(dst, arch)
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.kv_data[0][name] = gguf.GGUFValue(f.contents(), vtype, sub)
    writer.kv_data[0]["general.file_type"] = gguf.GGUFValue(0, gguf.GGUFValueType.UINT32)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        x = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, x.reshape(shape), raw_dtype=Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
