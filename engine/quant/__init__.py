"""Quantised weight formats: one description per type (``formats``), the torch reference
dequantisers, the repacked kernel layout, and the Triton kernels that read it on a GPU.

``dequantize`` is the one entry point. On a CUDA tensor it repacks the bytes into the kernel
layout and dequantises that with the Triton kernels (bit-identical to the reference, a few
launches instead of some thirty); everywhere else, and where Triton cannot be imported or a
kernel cannot be compiled, it runs the reference, after one warning in the log.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from types import ModuleType

import gguf
import torch

from strata.engine.quant import reference, repack
from strata.engine.quant.reference import SUPPORTED_TYPES, check_args, tensor_nbytes
from strata.engine.quant.repack import REPACKED_TYPES, RepackedLayout, repacked_layout

__all__ = [
    "REPACKED_TYPES",
    "SUPPORTED_TYPES",
    "RepackedLayout",
    "dequantize",
    "dequantize_repacked",
    "gpu_dequant_path",
    "repack_into",
    "repacked_layout",
    "tensor_nbytes",
]

log = logging.getLogger(__name__)

# Types whose kernel has run once: a failure after that is a real error, not a missing compiler.
_proven: set[gguf.GGMLQuantizationType] = set()
_disabled: str | None = None  # why the kernels are off, once a first launch failed


@functools.cache
def _repack_kernels() -> ModuleType | None:
    try:
        from strata.engine.quant import repack_kernels
    except Exception as e:  # ImportError, or Triton finding no usable backend at import
        log.warning(
            "Triton is unavailable (%s): GPU weights use the torch reference "
            "dequantisers, which are slower",
            e,
        )
        return None
    return repack_kernels


def gpu_dequant_path() -> str:
    """What dequantises weights on a GPU, for the log and the bench: a line of text."""
    k = _repack_kernels()
    if k is None:
        return "torch reference (Triton unavailable)"
    if _disabled is not None:
        return f"torch reference (Triton kernels failed: {_disabled})"
    import triton

    return f"Triton {triton.__version__} kernels over the repacked layout"


def _on_gpu(k: ModuleType, data: torch.Tensor, qtype, dims: tuple[int, ...]) -> torch.Tensor:
    rows = 1
    for s in dims[:-1]:
        rows *= s
    lay = repacked_layout(qtype, (rows, dims[-1]))
    buf = torch.empty(lay.nbytes, dtype=torch.uint8, device=data.device)
    k.repack_into(buf, data.contiguous(), lay)
    return k.dequantize(buf, lay).reshape(dims)


def dequantize(
    data: torch.Tensor, qtype: gguf.GGMLQuantizationType, shape: Sequence[int]
) -> torch.Tensor:
    """Dequantise the raw bytes of one GGUF tensor (or a byte run of one, e.g. one expert).

    data: [nbytes] uint8. shape: the logical shape in torch order (reversed GGUF ``ne``); quant
    blocks run along the last dim. Returns a new float32 tensor of ``shape`` on ``data``'s device.
    """
    global _disabled
    if data.is_cuda and _disabled is None and (k := _repack_kernels()) is not None:
        qtype, dims = check_args(data, qtype, shape)
        if data.numel() == 0:
            return torch.empty(dims, dtype=torch.float32, device=data.device)
        if qtype in _proven:
            return _on_gpu(k, data, qtype, dims)
        try:
            out = _on_gpu(k, data, qtype, dims)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # a compiler or driver that cannot build the kernel
            _disabled = f"{type(e).__name__}: {e}".splitlines()[0]
            log.warning(
                "the Triton %s kernels failed (%s): GPU weights use the torch "
                "reference dequantisers from now on",
                qtype.name,
                _disabled,
            )
        else:
            _proven.add(qtype)
            return out
    return reference.dequantize(data, qtype, shape)


def repack_into(dst: torch.Tensor, raw: torch.Tensor, lay: RepackedLayout) -> None:
    """Write the kernel layout of ``raw`` (one matrix's GGUF bytes) into ``dst`` [>= lay.nbytes]
    uint8 on the same device: one Triton launch on a GPU, the torch twin elsewhere. Bit-exact
    either way."""
    check_args(raw, lay.qtype, (lay.rows, lay.cols))
    if dst.dtype != torch.uint8 or dst.numel() < lay.nbytes or dst.device != raw.device:
        raise ValueError(
            f"a repacked {lay.qtype.name} {lay.rows}x{lay.cols} needs {lay.nbytes} uint8 bytes "
            f"on {raw.device}, got {dst.dtype} [{dst.numel()}] on {dst.device}"
        )
    if raw.is_cuda and (k := _repack_kernels()) is not None:
        k.repack_into(dst, raw.contiguous(), lay)
        return
    dst[: lay.nbytes].copy_(repack.repack(raw, lay.qtype, (lay.rows, lay.cols)))


def dequantize_repacked(
    data: torch.Tensor,
    lay: RepackedLayout,
    row0: int = 0,
    n_rows: int | None = None,
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ``[row0, row0 + n_rows)`` (or the rows ``ids``) of a repacked matrix as float32
    [n, cols]: bit-identical to the reference dequantisation of the bytes it was made from."""
    if data.is_cuda and (k := _repack_kernels()) is not None:
        return k.dequantize(data, lay, row0, n_rows, ids)
    shape = (lay.rows, lay.cols)
    if ids is not None:
        return repack.dequantize_repacked(data, lay.qtype, shape, rows=ids)
    stop = lay.rows if n_rows is None else row0 + n_rows
    return repack.dequantize_repacked(data, lay.qtype, shape, rows=slice(row0, stop))
