"""What every decode kernel's tiles share: the GGML type ids they dispatch on, the input
transform (``xin``: x, RMSNorm'd, gated or SwiGLU'd on the way in), the scalar reductions folded
into a launch (``rms_scale``, ``sigmoid_dot``), the packing of a float and an index into one
int64 that a max orders (``ordered_bits``). ``kernels.dot`` (the row tiles), ``kernels.columns``
(the grid types' tile) and the kernels built on them import it.
"""

from __future__ import annotations

import os

import gguf
import triton
import triton.language as tl

Q = gguf.GGMLQuantizationType
# GGML type ids the kernels dispatch on (constexpr), from gguf's table.
F32: tl.constexpr = tl.constexpr(int(Q.F32))
F16: tl.constexpr = tl.constexpr(int(Q.F16))
BF16: tl.constexpr = tl.constexpr(int(Q.BF16))
Q8_0: tl.constexpr = tl.constexpr(int(Q.Q8_0))
Q4_0: tl.constexpr = tl.constexpr(int(Q.Q4_0))
Q4_K: tl.constexpr = tl.constexpr(int(Q.Q4_K))
Q5_K: tl.constexpr = tl.constexpr(int(Q.Q5_K))
Q6_K: tl.constexpr = tl.constexpr(int(Q.Q6_K))
IQ4_XS: tl.constexpr = tl.constexpr(int(Q.IQ4_XS))
# (the gathered types' ids, Q4_1 .. IQ3_S, are ``unit_kernels``')

# Triton's interpreter (CI, on the CPU) runs a program at a time in Python: there, fewer and wider
# programs test the same code in a fraction of the time. On a GPU the tuned sizes apply.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


# What the kernels' input is (``XIN``, a constexpr; ``nw`` the second vector it reads): x as it
# is; RMSNorm'd, x * rms * nw; gated, x * σ(nw) (gated attention's output); SwiGLU'd,
# SiLU(x) * nw (an FFN's activation, x its gate half and nw its up half). False and True are
# XIN_PLAIN and XIN_NORM. The gate and the SwiGLU are written as the element-wise launches they
# replaced wrote them, so they round alike.
XIN_PLAIN: tl.constexpr = tl.constexpr(0)
XIN_NORM: tl.constexpr = tl.constexpr(1)
XIN_GATE: tl.constexpr = tl.constexpr(2)
XIN_SWIGLU: tl.constexpr = tl.constexpr(3)


@triton.jit
def xin(x, nw, rms, offs, mask, XIN: tl.constexpr):
    """The input at ``offs``: x, x * rms * nw (the reference's RMSNorm, in its order),
    x * σ(nw) or SiLU(x) * nw, by ``XIN``."""
    v = tl.load(x + offs, mask=mask, other=0.0)
    if XIN == XIN_NORM:
        v = v * rms * tl.load(nw + offs, mask=mask, other=0.0)
    elif XIN == XIN_GATE:
        v = v / (1.0 + tl.exp(-tl.load(nw + offs, mask=mask, other=0.0)))
    elif XIN == XIN_SWIGLU:
        v = v / (1.0 + tl.exp(-v)) * tl.load(nw + offs, mask=mask, other=0.0)
    return v


KEY_MIN: tl.constexpr = tl.constexpr(-(1 << 63))  # below every ``ordered_bits`` key


@triton.jit
def ordered_bits(v):
    """float32 v's bits as int32 that order as the floats do (a negative float's other 31 bits
    flipped; -0.0 made +0.0 first, so equal floats give equal keys): a value and an index
    packed in one int64 (the bits high) take one max where a max and a min of indices took
    two reductions."""
    bits = (v + 0.0).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def unordered_bits(bits):
    """The float32 whose ``ordered_bits`` are ``bits``."""
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def rms_scale(x, K: tl.constexpr, eps, BLOCK: tl.constexpr):
    """1 / sqrt(mean(x[:K]^2) + eps), as a scalar."""
    k = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for k0 in tl.static_range(0, K, BLOCK):
        v = tl.load(x + k0 + k, mask=k0 + k < K, other=0.0)
        acc += v * v
    return tl.rsqrt(tl.sum(acc, 0) / K + eps)


@triton.jit
def sigmoid_dot(h, v, D, BLOCK: tl.constexpr):
    """σ(h[:D] · v[:D]), as a scalar (a shared expert's gate); D need not be a constant."""
    k = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for d0 in range(0, D, BLOCK):
        m = d0 + k < D
        acc += tl.load(h + d0 + k, mask=m, other=0.0) * tl.load(v + d0 + k, mask=m, other=0.0)
    return 1.0 / (1.0 + tl.exp(-tl.sum(acc, 0)))


@triton.jit
def _f16_plane(w, off):
    return (w + off).to(tl.pointer_type(tl.float16))
