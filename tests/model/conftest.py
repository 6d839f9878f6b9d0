"""Session fixtures for the model tests: the tiny test models, built once per session, and llama.cpp
(through llama-cpp-python) as the yardstick.

``tiny_models.path(model, kind)`` gives a GGUF file of ``model`` ("qwen3moe" or "mixtral") in
``kind`` (F32, F16, BF16, Q8_0 from ``strata.engine.synth``; Q4_K_M, Q6_K from llama.cpp's
quantiser), built on first use by ``tiny_models.TinyModels``, the builder ``scripts/tiny-models``
shares. Where llama-cpp-python cannot be installed (a GPU machine without a compiler for it), the
environment variable ``TINY_MODELS_DIR`` names a folder that ``scripts/tiny-models DIR`` built
elsewhere; a file that neither that folder has nor this machine can build skips its test with the
file's name and that command (fails, under CI).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import interpreter_patch
import pytest
from tiny_models import LlamaCppMissing, TinyModels, load_llama_cpp


def pytest_collection_finish(session: pytest.Session) -> None:
    """Triton's interpreter, where the collected tests imported it, without its repeated
    patching of the language inside a launch (``interpreter_patch``)."""
    interpreter_patch.install()


def skip_without_llama_cpp(reason: str) -> NoReturn:
    """A skip, or a failure under CI, where llama-cpp-python must be installed."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must run the llama.cpp parity tests)")
    print(f"SKIP: {reason}")
    pytest.skip(reason)


def import_llama_cpp() -> ModuleType:
    """llama_cpp, or a skip (a failure under CI, where it must be installed)."""
    try:
        return load_llama_cpp()
    except ImportError as e:  # pragma: no cover - depends on the machine
        skip_without_llama_cpp(f"llama-cpp-python is not importable: {e}")


class SkippingTinyModels(TinyModels):
    """TinyModels whose files that cannot be had here skip the test asking for them."""

    def path(self, model: str, kind: str) -> Path:
        try:
            return super().path(model, kind)
        except LlamaCppMissing as e:
            skip_without_llama_cpp(str(e))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return SkippingTinyModels.from_env(tmp_path_factory.mktemp("tiny-models"))


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
