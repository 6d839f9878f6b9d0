"""The tiny GGUF test models, built in one place for two users: the ``tiny_models`` fixture
(tests/model/conftest.py) and ``scripts/tiny-models DIR``.

``TinyModels.path(model, kind)`` gives a GGUF file of ``model`` ("qwen3moe" or "mixtral") in
``kind``: F32, F16, BF16, Q8_0 and IQ3_XXS are written by ``strata.engine.synth`` on any machine
(IQ3_XXS as random valid blocks: llama.cpp quantises it only with an importance matrix); Q4_K_M,
Q6_K and the kinds of ``LLAMA_CPP_BASE`` (Q4_1, Q5_0, Q5_1, Q2_K, Q3_K_M, IQ4_NL, IQ3_S,
MXFP4_MOE) come from llama.cpp's own quantiser (llama-cpp-python) run on the F32 file, and the
tensor types they really hold are checked, so a silent fallback in llama.cpp fails loudly.

A machine without llama-cpp-python (a GPU machine with no compiler or network for it) takes the
llama.cpp-made files from a folder built elsewhere::

    scripts/tiny-models DIR                             # where llama-cpp-python is installed
    TINY_MODELS_DIR=DIR ./scripts/test -m gpu tests/model   # where it is not: DIR copied there

Each file's name carries the content key of its F32 source (``synth.content_key``), so a folder
built by another version of the generator is never used: its files are simply not found.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from itertools import product
from pathlib import Path
from types import ModuleType
from typing import Self

import gguf

from strata.engine import synth

Q = gguf.GGMLQuantizationType
log = logging.getLogger(__name__)

MODELS = {"qwen3moe": "tiny-qwen3moe", "mixtral": "tiny-mixtral"}
SYNTH_KINDS = {"F32": Q.F32, "F16": Q.F16, "BF16": Q.BF16, "Q8_0": Q.Q8_0, "IQ3_XXS": Q.IQ3_XXS}
# IQ3_XXS as Unsloth's files have it: the experts, every other matrix Q8_0
SYNTH_PLANS = {
    "IQ3_XXS": synth.TypePlan(
        token_embd=Q.Q8_0,
        attn=Q.Q8_0,
        experts_gate_up=Q.IQ3_XXS,
        experts_down=Q.IQ3_XXS,
        output=Q.Q8_0,
    )
}
# llama.cpp's file types for the tiny models, and the type each gives most tensors
LLAMA_CPP_BASE = {
    "Q4_K_M": Q.Q4_K,
    "Q6_K": Q.Q6_K,
    "Q4_1": Q.Q4_1,
    "Q5_0": Q.Q5_0,
    "Q5_1": Q.Q5_1,
    "Q2_K": Q.Q2_K,
    "Q3_K_M": Q.Q3_K,
    "IQ4_NL": Q.IQ4_NL,
    "IQ3_S": Q.IQ3_S,
    "MXFP4_MOE": Q.Q8_0,
}
LLAMA_CPP_KINDS = tuple(LLAMA_CPP_BASE)
KINDS = (*SYNTH_KINDS, *LLAMA_CPP_KINDS)
SEED = 0
# What `scripts/tiny-models` builds: every file the fixture needs llama-cpp-python for, the only
# ones it reads from TINY_MODELS_DIR (the others it writes itself on any machine).
# The kinds of the weight-type parity tests, made for the Qwen3-MoE tiny model only (their tests
# cost a llama.cpp quantisation each); the others for every model.
QWEN_ONLY_KINDS = ("Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_M", "IQ4_NL", "IQ3_S", "MXFP4_MOE")
PREBUILT: tuple[tuple[str, str], ...] = tuple(
    (m, k)
    for m, k in product(MODELS, LLAMA_CPP_KINDS)
    if m == "qwen3moe" or k not in QWEN_ONLY_KINDS
)
# every file the fixture hands out
OFFERED: frozenset[tuple[str, str]] = frozenset(PREBUILT) | frozenset(product(MODELS, SYNTH_KINDS))
ENV = "TINY_MODELS_DIR"
COMMAND = "scripts/tiny-models"
INSTALL_HINT = (
    "install it with `./scripts/bootstrap test` (the test extra) or `pip install llama-cpp-python`"
)


class LlamaCppMissing(RuntimeError):
    """A file needs llama.cpp's quantiser and llama-cpp-python is not importable; the message
    names the file and how to get it."""


def spec(model: str) -> synth.ModelSpec:
    return synth.PRESETS[MODELS[model]]


@functools.cache
def _vocab(arch: str) -> synth.Vocab:
    return synth.vocab_for(arch)


def _synth_kind(kind: str) -> str:
    """The kind synth writes for ``kind``: itself, or F32, the source llama.cpp quantises."""
    return kind if kind in SYNTH_KINDS else "F32"


def _plan(kind: str) -> synth.TypePlan:
    return SYNTH_PLANS.get(kind) or synth.TypePlan.uniform(SYNTH_KINDS[kind])


@functools.cache
def file_name(model: str, kind: str) -> str:
    """``tiny-<model>-<kind>-<key>.gguf``; ``key`` digests everything that decides the synth
    file it is (or is quantised from)."""
    if (model, kind) not in OFFERED:
        raise KeyError(f"no tiny model {model!r} in {kind!r}; have {sorted(OFFERED)}")
    s = spec(model)
    plan = _plan(_synth_kind(kind))
    key = synth.content_key(s, _vocab(s.arch), plan, SEED)
    return f"{MODELS[model]}-{kind}-{key}.gguf"


def load_llama_cpp() -> ModuleType:
    """llama_cpp, quiet but for errors; raises ImportError where it is not installed."""
    import llama_cpp

    # llama.cpp logs every load and quantisation through this logger; keep errors only.
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    return llama_cpp


def expected_llama_cpp_type(kind: str, name: str, n_layer: int) -> Q:
    """The type llama.cpp's quantiser gives tensor ``name`` of a tiny model (8 experts, 4
    layers) in ``kind``, from llama-quant.cpp's recipe: 1-D tensors and the router stay F32;
    MXFP4_MOE makes the expert tensors MXFP4 and every other matrix Q8_0; otherwise, with
    exactly 8 experts, attn_k/attn_v become Q8_0 and (the K-quant *_M, Q2_K and IQ kinds)
    attn_output Q5_K; output is Q6_K; ffn_down(_exps) gets Q6_K on the use_more_bits layers
    in Q4_K_M, Q3_K in Q2_K and Q4_K in Q3_K_M (none of the tiny layers is below n_layer / 16)."""
    parts = name.split(".")
    role = parts[2] if parts[0] == "blk" else parts[0]
    layer = int(parts[1]) if parts[0] == "blk" else None
    base = LLAMA_CPP_BASE[kind]
    if role.endswith("norm") or role == "ffn_gate_inp":
        return Q.F32
    if kind == "MXFP4_MOE":
        return Q.MXFP4 if role.endswith("_exps") else Q.Q8_0
    if role == "output":
        return Q.Q6_K
    if role in ("attn_k", "attn_v"):
        return Q.Q8_0
    if role == "attn_output" and kind in ("Q4_K_M", "Q2_K", "Q3_K_M", "IQ4_NL", "IQ3_S"):
        return Q.Q5_K
    if role == "ffn_down_exps" and kind == "Q4_K_M":
        assert layer is not None
        return Q.Q6_K if synth.use_more_bits(layer, n_layer) else Q.Q4_K
    if role == "ffn_down_exps" and kind in ("Q2_K", "Q3_K_M"):
        return Q.Q3_K if kind == "Q2_K" else Q.Q4_K
    return base


def llama_cpp_type_errors(path: Path, kind: str, model_spec: synth.ModelSpec) -> list[str]:
    """What in ``path`` differs from llama.cpp's recipe for ``kind``; empty when nothing does."""
    assert model_spec.n_expert == 8, "expected_llama_cpp_type encodes llama.cpp's 8-expert recipe"
    wrong = []
    for t in gguf.GGUFReader(path).tensors:
        want = expected_llama_cpp_type(kind, t.name, model_spec.n_layer)
        if t.tensor_type != want:
            wrong.append(f"{t.name}: {t.tensor_type.name}, expected {want.name}")
    return wrong


def check_llama_cpp_types(path: Path, kind: str, model_spec: synth.ModelSpec) -> None:
    wrong = llama_cpp_type_errors(path, kind, model_spec)
    assert not wrong, f"llama.cpp quantised {path} differently:\n" + "\n".join(wrong)


def llama_cpp_quantize(llama_cpp: ModuleType, src: Path, dst: Path, kind: str) -> Path:
    """``src`` quantised by llama.cpp into ``dst`` (atomically: temp file + rename)."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.nthread = 2
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        rc = llama_cpp.llama_model_quantize(
            str(src).encode(), str(tmp).encode(), ctypes.byref(params)
        )
        assert rc == 0, f"llama_model_quantize({src.name} -> {kind}) returned {rc}"
        tmp.chmod(0o644)  # mkstemp's 0600 would follow the file through the rename
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dst


def quantize_checked(llama_cpp: ModuleType, src: Path, dst: Path, model: str, kind: str) -> Path:
    """``src`` quantised into ``dst``, which must then hold llama.cpp's types for ``kind``."""
    llama_cpp_quantize(llama_cpp, src, dst, kind)
    check_llama_cpp_types(dst, kind, spec(model))
    return dst


def _missing_reason(model: str, kind: str, prebuilt: Path | None, error: ImportError) -> str:
    name = file_name(model, kind)
    if prebuilt is None:
        return (
            f"{name} is made by llama.cpp's quantiser and llama-cpp-python is not importable"
            f" ({error}): {INSTALL_HINT}; or build the files where it is with `{COMMAND} DIR`"
            f" and set {ENV}=DIR here"
        )
    where = f"{ENV}={prebuilt}" + ("" if prebuilt.is_dir() else " (no such folder)")
    others = sorted(p.name for p in prebuilt.glob(f"{MODELS[model]}-{kind}-*.gguf"))
    stale = (
        f" (it holds {', '.join(others)}: built by another version of strata.engine.synth)"
        if others
        else ""
    )
    return (
        f"{name} is not in {where}{stale}, and llama-cpp-python, which would build it here, is"
        f" not importable ({error}): run `{COMMAND} DIR` where it is and point {ENV} at a copy"
        " of DIR"
    )


class TinyModels:
    """The tiny GGUF files, written on first use under ``root``; the llama.cpp-made ones are taken
    from ``prebuilt`` (after the type check) where that folder has them."""

    def __init__(self, root: Path, prebuilt: Path | None = None) -> None:
        self.root = root
        self.prebuilt = prebuilt
        self._paths: dict[tuple[str, str], Path] = {}

    @classmethod
    def from_env(cls, root: Path) -> Self:
        """``prebuilt`` from the environment variable TINY_MODELS_DIR, where it is set."""
        env = os.environ.get(ENV)
        return cls(root, Path(env) if env else None)

    @staticmethod
    def spec(model: str) -> synth.ModelSpec:
        return spec(model)

    def path(self, model: str, kind: str) -> Path:
        """The file; LlamaCppMissing where it needs llama-cpp-python and that is absent."""
        if (model, kind) not in self._paths:
            self._paths[model, kind] = self._build(model, kind)
        return self._paths[model, kind]

    def _build(self, model: str, kind: str) -> Path:
        name = file_name(model, kind)  # KeyError for an unknown model or kind
        s = spec(model)
        if kind in SYNTH_KINDS:
            plan = _plan(kind)
            return synth.write_model(self.root / name, s, _vocab(s.arch), plan, SEED)
        if self.prebuilt is not None and (self.prebuilt / name).is_file():
            check_llama_cpp_types(self.prebuilt / name, kind, s)
            return self.prebuilt / name
        try:
            llama_cpp = load_llama_cpp()
        except ImportError as e:
            raise LlamaCppMissing(_missing_reason(model, kind, self.prebuilt, e)) from e
        return quantize_checked(llama_cpp, self.path(model, "F32"), self.root / name, model, kind)


def is_valid(path: Path, model: str, kind: str) -> bool:
    """Whether ``path`` is a readable GGUF holding llama.cpp's types for ``kind``."""
    try:
        return path.is_file() and not llama_cpp_type_errors(path, kind, spec(model))
    except (ValueError, OSError, IndexError) as e:  # a truncated or foreign file
        log.warning("%s is not a usable GGUF: %s", path, e)
        return False


def build(
    dst_dir: Path, files: tuple[tuple[str, str], ...] = PREBUILT
) -> Iterator[tuple[Path, bool]]:
    """Write ``files`` (llama.cpp-made kinds) into ``dst_dir`` under the names the fixture looks
    for; yields (path, whether it was built now); a file already there and valid is kept.
    Raises LlamaCppMissing, before writing anything, where one must be built and cannot."""
    todo = [(m, k) for m, k in files if not is_valid(dst_dir / file_name(m, k), m, k)]
    llama_cpp = None
    if todo:
        try:
            llama_cpp = load_llama_cpp()
        except ImportError as e:
            names = ", ".join(file_name(m, k) for m, k in todo)
            raise LlamaCppMissing(
                f"llama-cpp-python is needed to build {names} (llama.cpp's quantiser) and is"
                f" not importable ({e}); {INSTALL_HINT}"
            ) from e
    dst_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tiny-models-") as work:
        sources = TinyModels(Path(work))  # the F32 files llama.cpp quantises, not kept
        for model, kind in files:
            dst = dst_dir / file_name(model, kind)
            fresh = (model, kind) in todo
            if fresh:
                assert llama_cpp is not None
                quantize_checked(llama_cpp, sources.path(model, "F32"), dst, model, kind)
            yield dst, fresh


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=COMMAND,
        description="Build the llama.cpp-quantised tiny test models into DIR, for a machine "
        f"without llama-cpp-python to use through {ENV}=DIR.",
    )
    parser.add_argument(
        "dir", type=Path, metavar="DIR", help="the folder to write (made if absent)"
    )
    args = parser.parse_args(argv)
    dst_dir: Path = args.dir.resolve()
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    total = 0
    try:
        for path, fresh in build(dst_dir):
            size = path.stat().st_size
            total += size
            print(f"{'built' if fresh else 'kept '} {path} {size / 2**20:.1f} MiB")
    except LlamaCppMissing as e:
        print(f"{COMMAND}: {e}", file=sys.stderr)
        return 1
    print(f"{len(PREBUILT)} files, {total / 2**20:.1f} MiB in {dst_dir}")
    # the folder can be copied to a machine without llama-cpp-python: point ENV at the copy
    print(f"use them: {ENV}={dst_dir} ./scripts/test -m gpu tests/model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
