"""The Gated DeltaNet kernels against the reference layer (``ops.delta_net``): a decode token's
conv step and recurrent update, and the chunk-parallel form over a prompt against one update
per position (within 1e-5 of the largest output, float32 state; the state itself too).

In Triton's interpreter on one tiny shape (CI); the ``gpu`` tests take Qwen3.6-35B-A3B's shapes
(16 k / 32 v heads of 128, conv 4) on the device. Outputs start as NaN, so an element a kernel
forgets to write fails.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from strata.engine.ops.delta_net import causal_conv, delta_rule, l2_norm, repeat_heads

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed")
from strata.engine.kernels import delta_net as dk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-6
TOL = 1e-5


def _inputs(T: int, Hk: int, Hv: int, S: int, K: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE)

    C = (2 * Hk + Hv) * S
    return {
        "qkv": r(T, C), "z": r(T, Hv * S), "b": r(T, Hv), "a": r(T, Hv),
        "taps": r(C, K, scale=0.5), "conv": r(K - 1, C), "ssm": r(Hv, S, S, scale=0.1),
        "dt_bias": r(Hv), "A": -r(Hv).abs() - 0.1, "norm": r(S),
    }  # fmt: skip


def _reference(x: dict[str, torch.Tensor], Hk: int, tiled: bool) -> tuple[torch.Tensor, ...]:
    """The reference layer's pieces after the projections: (out [T, Hv S], conv, ssm)."""
    conv, ssm = x["conv"].clone(), x["ssm"].clone()
    T, Hv, S = x["qkv"].shape[0], x["ssm"].shape[0], x["ssm"].shape[1]
    mixed = causal_conv(x["qkv"], x["taps"], conv)
    q, k, v = mixed.split((Hk * S, Hk * S, Hv * S), dim=-1)
    q = repeat_heads(l2_norm(q.reshape(T, Hk, S), EPS), Hv, tiled) / math.sqrt(S)
    k = repeat_heads(l2_norm(k.reshape(T, Hk, S), EPS), Hv, tiled)
    beta = torch.sigmoid(x["b"])
    gl = F.softplus(x["a"] + x["dt_bias"]) * x["A"]
    o = delta_rule(q, k, v.reshape(T, Hv, S), gl, beta, ssm)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + EPS) * x["norm"]
    o = o * F.silu(x["z"].view(T, Hv, S))
    return o.reshape(T, Hv * S), conv, ssm


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _decode(x: dict[str, torch.Tensor], Hk: int, tiled: bool) -> tuple[torch.Tensor, ...]:
    """The decode kernels token by token over x's positions, the projection's output laid out as
    z | qkv | α | β (not the reference's order: the maps find each piece)."""
    T, C = x["qkv"].shape
    Hv, S = x["ssm"].shape[0], x["ssm"].shape[1]
    conv, ssm = x["conv"].clone(), x["ssm"].clone()
    Z = Hv * S
    i32 = dict(dtype=torch.int32, device=DEVICE)
    zsrc = torch.arange(Z, **i32)
    csrc = torch.arange(Z, Z + C, **i32)
    asrc = torch.arange(Z + C, Z + C + Hv, **i32)
    bsrc = asrc + Hv
    mixed = torch.full((C,), float("nan"), device=DEVICE)
    outs = []
    for t in range(T):
        in_ = torch.cat((x["z"][t], x["qkv"][t], x["a"][t], x["b"][t]))
        out = torch.full((Z,), float("nan"), device=DEVICE)
        dk.conv_step(in_, csrc, x["taps"], conv, mixed)
        dk.recurrent_step(mixed, in_, zsrc, bsrc, asrc, x["dt_bias"], x["A"], ssm, x["norm"],
                          out, Hk, EPS, tiled)  # fmt: skip
        outs.append(out)
    return torch.stack(outs), conv, ssm


@pytest.mark.parametrize("tiled", [True, False])
def test_decode_steps_match_the_reference(tiled: bool) -> None:
    Hk, Hv, S, K = 2, 4, 16, 4
    x = _inputs(5, Hk, Hv, S, K, seed=1 + tiled)
    want, conv_want, ssm_want = _reference(x, Hk, tiled)
    got, conv_got, ssm_got = _decode(x, Hk, tiled)
    assert torch.equal(conv_got, conv_want), "the conv state rolls to the last K-1 inputs"
    assert _rel(ssm_got, ssm_want) < TOL
    assert _rel(got, want) < TOL


def _chunk_inputs(x: dict[str, torch.Tensor], Hk: int) -> tuple[torch.Tensor, ...]:
    T = x["qkv"].shape[0]
    Hv, S = x["ssm"].shape[0], x["ssm"].shape[1]
    mixed = causal_conv(x["qkv"], x["taps"], x["conv"].clone())
    q, k, v = mixed.split((Hk * S, Hk * S, Hv * S), dim=-1)
    q = (l2_norm(q.reshape(T, Hk, S), EPS) / math.sqrt(S)).contiguous()
    k = l2_norm(k.reshape(T, Hk, S), EPS).contiguous()
    gl = (F.softplus(x["a"] + x["dt_bias"]) * x["A"]).contiguous()
    return q, k, v.reshape(T, Hv, S).contiguous(), gl, torch.sigmoid(x["b"]).contiguous()


@pytest.mark.parametrize("tiled", [True, False])
def test_the_chunked_rule_matches_one_update_per_position(tiled: bool) -> None:
    # 3 chunks of 16 and a ragged fourth; the rows past n (a graph's padding) change nothing
    Hk, Hv, S, K, T, n = 2, 4, 16, 4, 56, 53
    x = _inputs(T, Hk, Hv, S, K, seed=3 + tiled)
    q, k, v, gl, beta = _chunk_inputs(x, Hk)
    ssm_want = x["ssm"].clone()
    want = delta_rule(
        repeat_heads(q[:n], Hv, tiled), repeat_heads(k[:n], Hv, tiled), v[:n], gl[:n],
        beta[:n], ssm_want,
    )  # fmt: skip
    ssm = x["ssm"].clone()
    out = torch.full_like(v, float("nan"))
    count = torch.tensor([n], dtype=torch.int32, device=DEVICE)
    dk.chunk_delta_rule(q, k, v, gl, beta, ssm, out, count, tiled, chunk=16)
    assert _rel(out[:n], want) < TOL
    assert out[n:].isnan().all(), "rows past n are never written"
    assert _rel(ssm, ssm_want) < TOL


def test_bad_shapes_are_refused() -> None:
    q = torch.zeros(4, 2, 12, device=DEVICE)
    with pytest.raises(ValueError, match="powers of two"):
        dk.chunk_delta_rule(q, q, q, q[..., 0], q[..., 0], torch.zeros(2, 12, 12), q,
                            torch.ones(1, dtype=torch.int32), True)  # fmt: skip
    with pytest.raises(ValueError, match="state"):
        dk.recurrent_step(*(torch.zeros(1),) * 7, torch.zeros(3, 8, 8), torch.zeros(8),
                          torch.zeros(24), 2, EPS, True)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tiled", [True, False])
def test_the_real_shapes_on_the_device(tiled: bool) -> None:
    # Qwen3.6-35B-A3B: 16 k / 32 v heads of 128, conv 4; a 300-token prompt, then 4 steps
    Hk, Hv, S, K, T = 16, 32, 128, 4, 300
    x = _inputs(T, Hk, Hv, S, K, seed=7)
    q, k, v, gl, beta = _chunk_inputs(x, Hk)
    ssm_want = x["ssm"].clone()
    want = delta_rule(repeat_heads(q, Hv, tiled), repeat_heads(k, Hv, tiled), v, gl, beta,
                      ssm_want)  # fmt: skip
    ssm, out = x["ssm"].clone(), torch.full_like(v, float("nan"))
    dk.chunk_delta_rule(q, k, v, gl, beta, ssm, out,
                        torch.tensor([T], dtype=torch.int32, device=DEVICE), tiled)  # fmt: skip
    assert _rel(out, want) < TOL and _rel(ssm, ssm_want) < TOL
    y = _inputs(4, Hk, Hv, S, K, seed=8)
    want, conv_want, ssm_want = _reference(y, Hk, tiled)
    got, conv_got, ssm_got = _decode(y, Hk, tiled)
    assert torch.equal(conv_got, conv_want)
    assert _rel(got, want) < TOL and _rel(ssm_got, ssm_want) < TOL


@pytest.mark.parametrize("neox", [True, False])
def test_gated_attentions_partial_sectioned_rope_matches_the_reference(neox: bool) -> None:
    # Qwen3.5's layout on a small head: each query head's query then its gate, a quarter of
    # each head rotated, the fourth rope section unrotated; K/V written to a page at pos 5
    from strata.engine.gpu.delta import rope_tables_for
    from strata.engine.kernels.rope import rope_store_gated
    from strata.engine.ops import RopeSpec
    from strata.engine.ops.reference import Rope, rms_norm

    H, Hkv, d, page, pos = 4, 2, 64, 4, 5
    spec = RopeSpec(1e7, neox, 16, (3, 3, 1, 1))
    cos, sin = rope_tables_for(d, spec, 8, DEVICE)
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(2 * H * d + 2 * Hkv * d, generator=g).to(DEVICE)
    qn, kn = (1 + 0.1 * torch.randn(d, generator=g)).to(DEVICE), torch.ones(d, device=DEVICE)
    pages = torch.full((2, page, Hkv, d), float("nan"), device=DEVICE)
    kc, vc = pages.clone(), pages.clone()
    q_out, gate = (torch.full((H * d,), float("nan"), device=DEVICE) for _ in range(2))
    bt = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    at = torch.tensor([pos], dtype=torch.int32, device=DEVICE)
    rope_store_gated(qkv, cos, sin, qn, kn, q_out, gate, kc, vc, bt, at, EPS, H, Hkv, d, page,
                     neox, page * Hkv * d)  # fmt: skip
    qg = qkv[: 2 * H * d].view(H, 2 * d)
    k = qkv[2 * H * d : 2 * H * d + Hkv * d].view(Hkv, d)
    v = qkv[2 * H * d + Hkv * d :].view(Hkv, d)
    rope, where = Rope(d, spec), torch.tensor([pos], device=DEVICE)
    want_q = rope(rms_norm(qg[:, :d], qn, EPS)[None], where)[0]
    want_k = rope(rms_norm(k, kn, EPS)[None], where)[0]
    assert float((q_out.view(H, d) - want_q).abs().max()) < 1e-5
    assert torch.equal(gate.view(H, d), qg[:, d:])
    assert float((kc[0, pos % page] - want_k).abs().max()) < 1e-5  # block table: page 1 -> 0
    assert torch.equal(vc[0, pos % page], v)


def test_the_chunked_rule_holds_for_near_parallel_keys() -> None:
    # keys that barely differ and strong writes: (I + A) far from I, its inverse's entries large
    g = torch.Generator().manual_seed(4)
    T, H, S = 130, 2, 16
    base = torch.randn(1, H, S, generator=g)
    k = l2_norm(base + 0.05 * torch.randn(T, H, S, generator=g), EPS).to(DEVICE)
    q = (l2_norm(torch.randn(T, H, S, generator=g), EPS) / math.sqrt(S)).to(DEVICE)
    v = torch.randn(T, H, S, generator=g).to(DEVICE)
    gl = (-0.001 * torch.rand(T, H, generator=g)).to(DEVICE)
    beta = torch.sigmoid(3 + torch.randn(T, H, generator=g)).to(DEVICE)
    ssm_want = (0.1 * torch.randn(H, S, S, generator=g)).to(DEVICE)
    ssm = ssm_want.clone()
    want = delta_rule(q, k, v, gl, beta, ssm_want)
    out = torch.full_like(v, float("nan"))
    count = torch.tensor([T], dtype=torch.int32, device=DEVICE)
    dk.chunk_delta_rule(q, k, v, gl, beta, ssm, out, count, True, chunk=64)
    assert _rel(out, want) < TOL and _rel(ssm, ssm_want) < TOL
