"""Session fixtures for the model tests: the tiny test models, built once per session, and llama.cpp
(through llama-cpp-python) as the yardstick.

``tiny_models.path(model, kind)`` gives a GGUF file of ``model`` ("qwen3moe" or "mixtral") in
``kind``: F32, F16, BF16 and Q8_0 are written by ``strata.engine.synth``; Q4_K_M and Q6_K come
from llama.cpp's own quantiser run on the F32 file, and the tensor types they really hold are
checked, so a silent fallback in llama.cpp fails loudly. Files are built on first use; where
llama-cpp-python cannot be installed (a GPU machine without a compiler for it), the environment
variable ``TINY_MODELS_DIR`` names a folder of files this fixture built elsewhere, used as they are
after the same type check.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import gguf
import pytest

from strata.engine import synth

Q = gguf.GGMLQuantizationType

MODELS = {"qwen3moe": "tiny-qwen3moe", "mixtral": "tiny-mixtral"}
SYNTH_KINDS = {"F32": Q.F32, "F16": Q.F16, "BF16": Q.BF16, "Q8_0": Q.Q8_0}
LLAMA_CPP_KINDS = ("Q4_K_M", "Q6_K")
KINDS = (*SYNTH_KINDS, *LLAMA_CPP_KINDS)
SEED = 0


def import_llama_cpp() -> ModuleType:
    """llama_cpp, or a skip (a failure under CI, where it must be installed)."""
    try:
        import llama_cpp
    except ImportError as e:  # pragma: no cover - depends on the machine
        reason = f"llama-cpp-python is not importable: {e}"
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (CI must run the llama.cpp parity tests)")
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    # llama.cpp logs every load and quantisation through this logger; keep errors only.
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    return llama_cpp


def expected_llama_cpp_type(kind: str, name: str, n_layer: int) -> Q:
    """The type llama.cpp's quantiser gives tensor ``name`` of a tiny model (8 experts) in
    ``kind``, from llama-quant.cpp's recipe: 1-D tensors and the router stay F32; with exactly 8
    experts attn_k/attn_v become Q8_0 and (Q4_K_M) attn_output Q5_K; output is Q6_K; Q4_K_M
    gives ffn_down(_exps) Q6_K on the use_more_bits layers."""
    parts = name.split(".")
    role = parts[2] if parts[0] == "blk" else parts[0]
    layer = int(parts[1]) if parts[0] == "blk" else None
    base = Q.Q4_K if kind == "Q4_K_M" else Q.Q6_K
    if role.endswith("norm") or role == "ffn_gate_inp":
        return Q.F32
    if role == "output":
        return Q.Q6_K
    if role in ("attn_k", "attn_v"):
        return Q.Q8_0
    if role == "attn_output" and kind == "Q4_K_M":
        return Q.Q5_K
    if role == "ffn_down_exps" and kind == "Q4_K_M":
        assert layer is not None
        return Q.Q6_K if synth.use_more_bits(layer, n_layer) else Q.Q4_K
    return base


def check_llama_cpp_types(path: Path, kind: str, spec: synth.ModelSpec) -> None:
    assert spec.n_expert == 8, "expected_llama_cpp_type encodes llama.cpp's 8-expert recipe"
    wrong = []
    for t in gguf.GGUFReader(path).tensors:
        want = expected_llama_cpp_type(kind, t.name, spec.n_layer)
        if t.tensor_type != want:
            wrong.append(f"{t.name}: {t.tensor_type.name}, expected {want.name}")
    assert not wrong, f"llama.cpp quantised {path.name} differently:\n" + "\n".join(wrong)


def llama_cpp_quantize(src: Path, dst: Path, kind: str) -> Path:
    llama_cpp = import_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize({src.name} -> {kind}) returned {rc}"
    return dst


class TinyModels:
    """The session's tiny GGUF files, written on first use under one temporary directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._paths: dict[tuple[str, str], Path] = {}

    @staticmethod
    def spec(model: str) -> synth.ModelSpec:
        return synth.PRESETS[MODELS[model]]

    def path(self, model: str, kind: str) -> Path:
        if model not in MODELS or kind not in KINDS:
            raise KeyError(f"no tiny model {model!r} in {kind!r}; have {list(MODELS)} x {KINDS}")
        if (model, kind) not in self._paths:
            self._paths[model, kind] = self._build(model, kind)
        return self._paths[model, kind]

    def _build(self, model: str, kind: str) -> Path:
        spec = self.spec(model)
        dst = self.root / f"{MODELS[model]}-{kind}.gguf"
        prebuilt = Path(os.environ.get("TINY_MODELS_DIR", "/nonexistent")) / dst.name
        if kind in LLAMA_CPP_KINDS and prebuilt.is_file():
            check_llama_cpp_types(prebuilt, kind, spec)
            return prebuilt
        if kind in SYNTH_KINDS:
            plan = synth.TypePlan.uniform(SYNTH_KINDS[kind])
            return synth.write_model(dst, spec, synth.vocab_for(spec.arch), plan, SEED)
        llama_cpp_quantize(self.path(model, "F32"), dst, kind)
        check_llama_cpp_types(dst, kind, spec)
        return dst


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def llama_cpp_module() -> ModuleType:
    return import_llama_cpp()


@pytest.fixture(scope="session")
def llama_cpp_ref(llama_cpp_module: ModuleType) -> Iterator[Callable[[Path], Any]]:
    """``open(path)`` -> a llama_cpp.Llama on ``path`` (one per file for the session) with an F32
    K/V cache, flash attention off, logits for every position, 2 threads. Call ``reset()``
    before ``eval``."""
    cache: dict[Path, Any] = {}
    f32 = llama_cpp_module.GGML_TYPE_F32

    def open_model(path: Path) -> Any:
        path = Path(path)
        if path not in cache:
            cache[path] = llama_cpp_module.Llama(
                model_path=str(path),
                n_ctx=1024,
                n_batch=512,
                n_threads=2,
                n_threads_batch=2,
                logits_all=True,
                type_k=f32,
                type_v=f32,
                flash_attn=False,
                seed=0,
                verbose=False,
            )
        return cache[path]

    yield open_model
    for llm in cache.values():
        llm.close()
