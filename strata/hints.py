"""How to install what a code path needs, said in the error or warning that finds it missing.

The command names the package by its real name on the index (``cuda-bindings``, never
``strata[gpu]``: the index has an unrelated ``strata``), for the Python that runs Strata; when
Strata runs from a checkout, it installs the checkout's own ``gpu`` extra instead.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

# What the GPU path needs beyond the core dependencies (pyproject.toml's `gpu` extra).
GPU_PACKAGES = {
    "cuda-bindings": "cuda-bindings>=12.6",
    "nvidia-ml-py": "nvidia-ml-py>=12.535",
    "triton": "triton>=3.0",
}


def checkout_root() -> Path | None:
    """The checkout this package runs from (editable install or ``PYTHONPATH``), else None."""
    root = Path(__file__).resolve().parent.parent
    pyproject = root / "pyproject.toml"
    try:
        text = pyproject.read_text()
    except OSError:
        return None
    return root if 'name = "strata"' in text else None


def install_hint(package: str) -> str:
    """``install it with: <command>`` for ``package`` (a key of :data:`GPU_PACKAGES`)."""
    python = shlex.quote(sys.executable)
    root = checkout_root()
    if root is not None:
        target = shlex.quote(f"{root}[gpu]")
        return f"install it with: {python} -m pip install -e {target}"
    return f"install it with: {python} -m pip install {shlex.quote(GPU_PACKAGES[package])}"
