"""Quantised weight formats: torch reference dequantisers (and, later, GPU kernels)."""

from strata.engine.quant.reference import SUPPORTED_TYPES, dequantize, tensor_nbytes

__all__ = ["SUPPORTED_TYPES", "dequantize", "tensor_nbytes"]
