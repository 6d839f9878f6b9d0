"""Triton kernels of the GPU decode path, one module each beside its torch twin: ``dot`` (the
shared inner loop over repacked rows), ``matvec``, ``rope``, ``attention``, ``moe`` and ``step``.

The modules import Triton at the top; import them only after ``unavailable()`` returned None.
With ``TRITON_INTERPRET=1`` in the environment before the first import they run on CPU tensors
(how CI checks them).
"""

from __future__ import annotations

import functools

# A table entry with no home the kernels may read: a step that routes to it stages the expert
# first. Offsets are multiples of 256 (slots and homes are 256-byte aligned, and so is the
# anchor), so a home below the anchor (a negative offset) never reads as MISSING.
MISSING = -1


@functools.cache
def unavailable() -> str | None:
    """Why the decode kernels cannot be used here (Triton missing or broken), or None."""
    try:
        import triton  # noqa: F401

        from strata.engine.kernels import attention, matvec, moe, rope, step  # noqa: F401
        from strata.engine.quant import repack_kernels  # noqa: F401
    except Exception as e:  # ImportError, or Triton finding no usable backend at import
        reason = f"Triton is unavailable ({type(e).__name__}: {e})".splitlines()[0]
        if isinstance(e, ImportError) and e.name == "triton":
            from strata.hints import install_hint

            reason += f"; {install_hint('triton')}"
        return reason
    return None
