"""Quantised weight formats: torch reference dequantisers and the Triton kernels that replace
them on a GPU.

``dequantize`` is the one entry point. On a CUDA tensor of a type that has a kernel it launches
the Triton kernel (bit-identical to the reference, one launch instead of some thirty); everywhere
else, and where Triton cannot be imported or a kernel cannot be compiled, it runs the reference,
after one warning in the log.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from types import ModuleType

import gguf
import torch

from strata.engine.quant import reference
from strata.engine.quant.reference import SUPPORTED_TYPES, check_args, tensor_nbytes

__all__ = ["SUPPORTED_TYPES", "dequantize", "gpu_dequant_path", "tensor_nbytes"]

log = logging.getLogger(__name__)

# Types whose kernel has run once: a failure after that is a real error, not a missing compiler.
_proven: set[gguf.GGMLQuantizationType] = set()
_disabled: str | None = None  # why the kernels are off, once a first launch failed


@functools.cache
def _kernels() -> ModuleType | None:
    try:
        from strata.engine.quant import triton_kernels
    except Exception as e:  # ImportError, or Triton finding no usable backend at import
        log.warning(
            "Triton is unavailable (%s): GPU weights use the torch reference "
            "dequantisers, which are slower",
            e,
        )
        return None
    return triton_kernels


def gpu_dequant_path() -> str:
    """What dequantises weights on a GPU, for the log and the bench: a line of text."""
    k = _kernels()
    if k is None:
        return "torch reference (Triton unavailable)"
    if _disabled is not None:
        return f"torch reference (Triton kernels failed: {_disabled})"
    import triton

    types = ", ".join(sorted(t.name for t in k.KERNEL_TYPES))
    return f"Triton {triton.__version__} kernels ({types})"


def dequantize(
    data: torch.Tensor, qtype: gguf.GGMLQuantizationType, shape: Sequence[int]
) -> torch.Tensor:
    """Dequantise the raw bytes of one GGUF tensor (or a byte run of one, e.g. one expert).

    data: [nbytes] uint8. shape: the logical shape in torch order (reversed GGUF ``ne``); quant
    blocks run along the last dim. Returns a new float32 tensor of ``shape`` on ``data``'s device.
    """
    global _disabled
    if data.is_cuda and _disabled is None and (k := _kernels()) is not None:
        qtype, dims = check_args(data, qtype, shape)
        if qtype in k.KERNEL_TYPES:
            if qtype in _proven:
                return k.dequantize_blocks(data, qtype).reshape(dims)
            try:
                out = k.dequantize_blocks(data, qtype).reshape(dims)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # a compiler or driver that cannot build the kernel
                _disabled = f"{type(e).__name__}: {e}".splitlines()[0]
                log.warning(
                    "the Triton %s kernel failed (%s): GPU weights use the torch "
                    "reference dequantisers from now on",
                    qtype.name,
                    _disabled,
                )
            else:
                _proven.add(qtype)
                return out
    return reference.dequantize(data, qtype, shape)
