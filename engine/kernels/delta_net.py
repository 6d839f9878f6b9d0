"""Gated DeltaNet kernels (Qwen3.5/3.6, Qwen3-Next): one decode token in two launches, and a
prompt chunk in the chunk-parallel form. Their twin is the reference layer,
``ops.delta_net`` (one recurrent update per position).

Decode, after the fused input projection (``in_`` [P]: q|k|v, z, β and α, found through index
maps so that either file layout works):

- ``conv_step``: each channel of q|k|v through the causal convolution over its last
  ``conv_kernel`` inputs (the K-1 held in the conv state, then this token's), SiLU; the state
  rolls by one, in place (a program owns its channels, so nothing races);
- ``recurrent_step``: per v head (one program), the L2 norms of its q and k, the gates
  (β = σ(b), g = softplus(a + dt_bias)·A), the update of its [S(v), S(k)] state in place (one
  tile: the state's loads in one trip to memory), the output o = S q and the gated RMSNorm
  ``norm(o)·w·silu(z)`` into ``out`` [Hv S].

Nothing is read back to the host and every address is fixed: both are captured in the decode
graph.

Prompt chunks (``chunk_delta_rule``): within a chunk of ``BT`` positions the delta rule is
solved all at once (the WY form of the chunk-parallel algorithm): with G the running sum of the
log-decays and β the write strengths,

    A[i, j] = β_i (k_i · k_j) e^{G_i - G_j}  (j < i)      T = (I + A)^{-1}
    W = T (β e^{G} ⊙ K)      Ũ = T (β ⊙ V)      U = Ũ - W Mᵀ   (M: the state at the chunk's start)
    O = e^{G} ⊙ (Q Mᵀ) + ((Q Kᵀ) ⊙ e^{G_i - G_j})_{j <= i} U
    M ← e^{G_last} M + Uᵀ (e^{G_last - G} ⊙ K)

T by forward substitution within four diagonal blocks and a short series across them, the
products on tensor cores with three-pass TF32 (``tf32x3``: float32 accuracy; plain IEEE
float32 in the interpreter). Two launches: everything the state does not enter (T, W, Ũ, the
masked Q Kᵀ, the decays) for every (v head, chunk) at once, into scratch; then a program per
v head's ``BV`` state rows walks the chunks in order with four products a chunk (U, the two
of O, M's update), where T's dependent steps were on that walk before. The rows past ``n``
(read from the device: a captured chunk's padding) write nothing and change nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.engine.kernels.inputs import INTERPRETED

CHUNK = 64  # positions per chunk of the chunk-parallel form
# the walk over the chunks is not software-pipelined: Triton's default three stages buffer each
# chunk's W, Ũ, masked Q Kᵀ and decayed K three times over, 272 KiB of shared memory a program
# compiled for sm_90 under Triton 3.6 (more than a block may have); one stage, 32 KiB
STAGES = 1


@triton.jit
def _conv_kernel(x_in, src, taps, state, out, C, K: tl.constexpr, BC: tl.constexpr):
    c = tl.program_id(0) * BC + tl.arange(0, BC)
    m = c < C
    cur = tl.load(x_in + tl.load(src + c, mask=m, other=0), mask=m, other=0.0)
    acc = tl.zeros([BC], tl.float32)
    prev = tl.zeros([BC], tl.float32)
    for k in tl.static_range(K - 1):  # the state's rows, oldest first
        prev = tl.load(state + k * C + c, mask=m, other=0.0)
        acc += prev * tl.load(taps + c * K + k, mask=m, other=0.0)
        if k > 0:
            tl.store(state + (k - 1) * C + c, prev, mask=m)
    acc += cur * tl.load(taps + c * K + (K - 1), mask=m, other=0.0)
    if K > 1:
        tl.store(state + (K - 2) * C + c, cur, mask=m)
    tl.store(out + c, acc / (1.0 + tl.exp(-acc)), mask=m)


def conv_step(
    x_in: torch.Tensor, src: torch.Tensor, taps: torch.Tensor, state: torch.Tensor,
    out: torch.Tensor,
) -> None:  # fmt: skip
    """out[c] = SiLU(Σ_k taps[c, k] · window[k]) for the C channels, the window being the
    ``state`` [K-1, C] rows then ``x_in[src[c]]``; ``state`` rolls by one in place.
    x_in: float32 [P]; src: int32 [C]; taps: [C, K]; out: [C]."""
    C, K = taps.shape
    if state.shape != (K - 1, C) or src.numel() != C or out.numel() < C:
        raise ValueError(
            f"conv of {C} channels, {K} taps: state {tuple(state.shape)}, "
            f"{src.numel()} sources, {out.numel()} outputs"
        )
    bc = 1024 if INTERPRETED else 256
    _conv_kernel[(triton.cdiv(C, bc),)](x_in, src, taps, state, out, C, K=K, BC=bc)


@triton.jit
def _softplus(x):
    # torch's softplus (threshold 20)
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _recurrent_kernel(
    mixed, in_, zsrc, bsrc, asrc, dt_bias, a_log, state, onorm, out,
    eps, q_scale, HK, R,
    S: tl.constexpr, BV: tl.constexpr, TILED: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0)  # the v head
    if TILED:
        g = h % HK
    else:
        g = h // R
    d = tl.arange(0, S)
    q = tl.load(mixed + g * S + d)
    k = tl.load(mixed + HK * S + g * S + d)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + eps) * q_scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
    beta = tl.load(in_ + tl.load(bsrc + h))
    beta = 1.0 / (1.0 + tl.exp(-beta))
    alpha = tl.load(in_ + tl.load(asrc + h))
    decay = tl.exp(_softplus(alpha + tl.load(dt_bias + h)) * tl.load(a_log + h))
    vbase = 2 * HK * S + h * S
    st = state + h.to(tl.int64) * S * S
    ss = 0.0
    for v0 in tl.static_range(0, S, BV):
        rows = v0 + tl.arange(0, BV)
        at = st + rows[:, None] * S + d[None, :]
        m = tl.load(at) * decay  # [BV, S]
        kv = tl.sum(m * k[None, :], 1)
        delta = (tl.load(mixed + vbase + rows) - kv) * beta
        m += delta[:, None] * k[None, :]
        tl.store(at, m)
        o = tl.sum(m * q[None, :], 1)
        ss += tl.sum(o * o, 0)
        tl.store(out + h * S + rows, o)
    tl.debug_barrier()  # the whole head's o is written before its norm reads it back
    scale = tl.rsqrt(ss / S + eps)
    for v0 in tl.static_range(0, S, BV):
        rows = v0 + tl.arange(0, BV)
        o = tl.load(out + h * S + rows)
        z = tl.load(in_ + tl.load(zsrc + h * S + rows))
        o = o * scale * tl.load(onorm + rows) * (z / (1.0 + tl.exp(-z)))
        tl.store(out + h * S + rows, o)


def recurrent_step(
    mixed: torch.Tensor, in_: torch.Tensor, zsrc: torch.Tensor, bsrc: torch.Tensor,
    asrc: torch.Tensor, dt_bias: torch.Tensor, a: torch.Tensor, state: torch.Tensor,
    out_norm: torch.Tensor, out: torch.Tensor, n_k_heads: int, eps: float, tiled: bool,
) -> None:  # fmt: skip
    """One token's delta-rule update of every v head. mixed: float32 [2 Hk S + Hv S] (the conv's
    output: q|k|v); in_: the projection's output, where z [Hv S], β [Hv] and α [Hv] are read
    through the int32 maps ``zsrc``, ``bsrc``, ``asrc``; state: [Hv, S, S] updated in place;
    out: [Hv S] the gated RMSNorm of each head's output."""
    Hv, S = state.shape[0], state.shape[1]
    if S & (S - 1) or state.shape != (Hv, S, S) or Hv % n_k_heads:
        raise ValueError(
            f"state {tuple(state.shape)}: want [Hv, S, S] with S a power of two and Hv a "
            f"multiple of the {n_k_heads} k heads"
        )
    if mixed.numel() != (2 * n_k_heads + Hv) * S or out.numel() != Hv * S:
        raise ValueError(f"q|k|v of {mixed.numel()} values or an output of {out.numel()}: "
                         f"want {(2 * n_k_heads + Hv) * S} and {Hv * S}")  # fmt: skip
    # the whole [S, S] state of a head as one tile (S <= 128): its loads issue at once. In
    # blocks of rows, each block's loads wait for the previous block's stores (the compiler
    # cannot tell they do not overlap): four trips to memory in a row where one does. Compiled
    # for sm_90 with S = 128: 71 registers, no spills, 984 instructions a warp (eight warps),
    # against 62 and 1,824 (four) in blocks of 32.
    bv = min(S, 128)
    _recurrent_kernel[(Hv,)](
        mixed, in_, zsrc, bsrc, asrc, dt_bias, a, state, out_norm, out,
        eps, S**-0.5, n_k_heads, Hv // n_k_heads,
        S=S, BV=bv, TILED=tiled, num_warps=8 if bv >= 128 else 4,
    )  # fmt: skip


@triton.jit
def _unit_lower_inverse(a, i, eye, BB: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 for A [BT, BT] strictly lower triangular, in four diagonal blocks: each
    block's inverse B by forward substitution (the four side by side: BT/4 - 1 steps), then
    with N = B L (L: A below the blocks, N nilpotent of order 4)
    (I + A)^-1 = (I + N)^-1 B = (I - N + N² - N³) B."""
    blk = i // BB  # BB: a diagonal block's rows, a quarter of the chunk
    same = blk[:, None] == blk[None, :]
    ad = tl.where(same, a, 0.0)
    inv = eye
    for r in range(1, BB):  # rows r of each block: e - Σ_{j < r} A[row, j] B[j]
        rows = tl.dot(ad, inv, input_precision=PREC)
        inv = tl.where((i % BB == r)[:, None], eye - rows, inv)
    n = tl.dot(inv, tl.where(same, 0.0, a), input_precision=PREC)
    n2 = tl.dot(n, n, input_precision=PREC)
    n3 = tl.dot(n2, n, input_precision=PREC)
    return tl.dot(eye - n + n2 - n3, inv, input_precision=PREC)


@triton.jit
def _chunk_prep_kernel(
    q, k, v, g, beta, n_p, w_out, u_out, qk_out, kd_out, eg_out, gl_out,
    HV, HK, R, NC,
    S: tl.constexpr, BT: tl.constexpr, BB: tl.constexpr, TILED: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """One v head's chunk c, everything of it that the state does not enter, for every chunk
    at once: W, Ũ (all S columns), the masked decayed Q Kᵀ, e^{G}, e^{G_last - G} ⊙ K and
    G_last, into the scratch at [h, c]."""
    h = tl.program_id(0)
    c = tl.program_id(1)
    hk = h % HK if TILED else h // R
    n = tl.load(n_p)
    c0 = c * BT
    if c0 < n:
        d = tl.arange(0, S)
        i = tl.arange(0, BT)
        t = c0 + i
        ok = t < n
        qk_row = t.to(tl.int64) * HK * S + hk * S
        kt = tl.load(k + qk_row[:, None] + d[None, :], mask=ok[:, None], other=0.0)  # [BT, S]
        qt = tl.load(q + qk_row[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        v_row = t.to(tl.int64) * HV * S + h * S
        vt = tl.load(v + v_row[:, None] + d[None, :], mask=ok[:, None], other=0.0)  # [BT, S]
        gt = tl.load(g + t * HV + h, mask=ok, other=0.0)
        bt = tl.load(beta + t * HV + h, mask=ok, other=0.0)
        G = tl.cumsum(gt, 0)  # [BT]
        G_last = tl.sum(gt, 0)
        lower = i[:, None] > i[None, :]
        eye = tl.where(i[:, None] == i[None, :], 1.0, 0.0)
        diff = tl.where(lower, G[:, None] - G[None, :], 0.0)
        kk = tl.dot(kt, tl.trans(kt), input_precision=PREC)  # [BT, BT]
        a = tl.where(lower, bt[:, None] * kk * tl.exp(diff), 0.0)
        tinv = _unit_lower_inverse(a, i, eye, BB, PREC)
        eg = tl.exp(G)
        w = tl.dot(tinv, kt * (bt * eg)[:, None], input_precision=PREC)  # [BT, S]
        u = tl.dot(tinv, vt * bt[:, None], input_precision=PREC)  # [BT, S]
        qkm = tl.dot(qt, tl.trans(kt), input_precision=PREC)
        qkm = tl.where(i[:, None] >= i[None, :], qkm * tl.exp(diff), 0.0)
        at = (h.to(tl.int64) * NC + c) * BT  # the chunk's first row in the [Hv, NC * BT] scratch
        rows = (at + i)[:, None]
        tl.store(w_out + rows * S + d[None, :], w)
        tl.store(u_out + rows * S + d[None, :], u)
        tl.store(kd_out + rows * S + d[None, :], kt * tl.exp(G_last - G)[:, None])
        tl.store(qk_out + rows * BT + i[None, :], qkm)
        tl.store(eg_out + at + i, eg)
        tl.store(gl_out + h * NC + c, G_last)


@triton.jit
def _chunk_kernel(
    q, v, state, o, n_p, w_in, u_in, qk_in, kd_in, eg_in, gl_in,
    HV, HK, R, NC,
    S: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, TILED: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """One v head's ``BV`` state rows through the chunks in order: what the state enters
    (U = Ũ - W Mᵀ, the output, the state's update), the rest from ``_chunk_prep_kernel``."""
    h = tl.program_id(0)  # the v head
    v0 = tl.program_id(1) * BV  # its state rows v0 .. v0 + BV - 1
    hk = h % HK if TILED else h // R
    n = tl.load(n_p)
    d = tl.arange(0, S)
    cv = v0 + tl.arange(0, BV)
    i = tl.arange(0, BT)
    st = state + h.to(tl.int64) * S * S + cv[:, None] * S + d[None, :]
    mv = tl.load(st)  # [BV, S(k)]: M's rows
    for c0 in range(0, n, BT):
        c = c0 // BT
        t = c0 + i
        ok = t < n
        at = (h.to(tl.int64) * NC + c) * BT
        rows = (at + i)[:, None]
        qk_row = t.to(tl.int64) * HK * S + hk * S
        qt = tl.load(q + qk_row[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        w = tl.load(w_in + rows * S + d[None, :])  # [BT, S]
        u = tl.load(u_in + rows * S + cv[None, :])  # [BT, BV]
        u -= tl.dot(w, tl.trans(mv), input_precision=PREC)
        eg = tl.load(eg_in + at + i)
        out = eg[:, None] * tl.dot(qt, tl.trans(mv), input_precision=PREC)
        out += tl.dot(tl.load(qk_in + rows * BT + i[None, :]), u, input_precision=PREC)
        v_row = t.to(tl.int64) * HV * S + h * S
        tl.store(o + v_row[:, None] + cv[None, :], out, mask=ok[:, None])
        kd = tl.load(kd_in + rows * S + d[None, :])
        mv = mv * tl.exp(tl.load(gl_in + h * NC + c)) + tl.dot(
            tl.trans(u), kd, input_precision=PREC
        )
    tl.store(st, mv)


def chunk_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, out: torch.Tensor, n: torch.Tensor, tiled: bool,
    chunk: int = CHUNK, bv: int | None = None,
) -> None:  # fmt: skip
    """The gated delta rule over the first ``n`` (int [1] on the device) of T positions.
    q, k: float32 [T, Hk, S] (L2-normalised, q scaled); v: [T, Hv, S]; g (log-decay), beta
    (σ already applied): [T, Hv]; state: [Hv, S(v), S(k)] updated in place; out: [T, Hv, S]
    (rows from ``n`` on untouched). v head h reads k head h % Hk (``tiled``) or h // (Hv/Hk)."""
    T, Hk, S = q.shape
    Hv = v.shape[1]
    if S & (S - 1) or chunk & (chunk - 1) or chunk < 16:
        raise ValueError(f"head size {S} and chunk {chunk}: powers of two, chunk at least 16")
    if k.shape != q.shape or v.shape != (T, Hv, S) or Hv % Hk or state.shape != (Hv, S, S):
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, state "
            f"{tuple(state.shape)}: want [T, Hk, S], [T, Hk, S], [T, Hv, S], [Hv, S, S]"
        )
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("out", out)):
        if not t.is_contiguous() or t.dtype != torch.float32:
            raise ValueError(f"{name}: want a contiguous float32 tensor, got {t.dtype}")
    if g.shape != (T, Hv) or beta.shape != (T, Hv) or out.shape != v.shape:
        raise ValueError(f"g {tuple(g.shape)}, beta {tuple(beta.shape)}, out "
                         f"{tuple(out.shape)}: want [T, Hv], [T, Hv], [T, Hv, S]")  # fmt: skip
    bv = bv or min(S, 32)
    prec = "ieee" if INTERPRETED else "tf32x3"
    nc, dev = triton.cdiv(T, chunk), q.device
    w, u, kd = (torch.empty(Hv, nc * chunk, S, device=dev) for _ in range(3))
    qk = torch.empty(Hv, nc * chunk, chunk, device=dev)
    eg, gl = torch.empty(Hv, nc * chunk, device=dev), torch.empty(Hv, nc, device=dev)
    warps = 8 if S >= 128 else 4
    _chunk_prep_kernel[(Hv, nc)](
        q, k, v, g, beta, n, w, u, qk, kd, eg, gl, Hv, Hk, Hv // Hk, nc,
        S=S, BT=chunk, BB=chunk // 4, TILED=tiled, PREC=prec, num_warps=warps,
    )  # fmt: skip
    _chunk_kernel[(Hv, S // bv)](
        q, v, state, out, n, w, u, qk, kd, eg, gl, Hv, Hk, Hv // Hk, nc,
        S=S, BV=bv, BT=chunk, TILED=tiled, PREC=prec, num_warps=warps, num_stages=STAGES,
    )  # fmt: skip
