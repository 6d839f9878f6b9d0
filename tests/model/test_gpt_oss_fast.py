"""gpt-oss through the GPU runner assembled by hand (``fastpath``: on the GPU where there is one,
else in Triton's interpreter on the CPU, as CI runs it), on the tiny MXFP4_MOE file: decode
steps past the window with half the experts in RAM and the CPU computing half of those, and a
prompt in chunks on the prefill path, against the reference path. The GPU's own tests
(``test_gpt_oss_gpu``) add graphs, every cache size and a shrink.

Tolerances: ``test_fast_decode``'s 1e-5 for decode steps (measured 2-3e-6 here; with the CPU's
share ``fastpath.cpu_share_tol``'s where its kernels read an int8 input), and
``test_fast_prefill``'s 1e-2 for prompt logits (float16 products; measured 4e-3 here, where the
SwiGLU's clamp is hit), with the reference's choice imposed on the few prompt rows whose
routing is a near-tie (``NearTies``: a float16 product may choose the other expert there)."""

from __future__ import annotations

import pytest
import torch
from fastpath import cpu_share_tol, fast_runner, reference_runner, worst
from gpt_oss_files import SPEC, GptOssFiles, NearTies

pytest.importorskip("triton", reason="Triton is not installed")

DECODE_TOL = 1e-5
PROMPT_TOL = 1e-2
PROMPT = [(i * 37 + 11) % 900 + 3 for i in range(40)]  # two and a half windows


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory: pytest.TempPathFactory):
    return GptOssFiles(tmp_path_factory.mktemp("gpt-oss-fast")).path("MXFP4_MOE")


def steps(runner, n: int) -> list[torch.Tensor]:
    runner.rewind(0)
    out = [runner.feed(PROMPT).cpu()]
    tok = 5
    for _ in range(n):
        out.append(runner.feed([tok]).cpu())
        tok = (tok * 31 + 7) % 500
    return out


def test_decode_steps_with_the_cpus_share_agree_with_the_reference_path(mxfp4) -> None:
    ref = steps(reference_runner(mxfp4), 3)
    fast = fast_runner(mxfp4, cache_share=0.5, host=True, cpu_share=0.5)
    gpu = fast.stages[0]
    if gpu.cpu.reason is not None:
        pytest.skip(f"the CPU expert kernels cannot run here: {gpu.cpu.reason}")
    got = steps(fast, 3)
    assert torch.equal(ref[0], got[0]), "the prompt takes the reference path"
    tol = cpu_share_tol(gpu, DECODE_TOL)  # MXFP4 on x86: the CPU reads an int8 input
    assert worst(torch.stack(ref[1:]), torch.stack(got[1:]), tol) < tol
    gpu.flush_usage()
    assert gpu.provider.stats.cpu_computed > 0  # the CPU took its share, biases and all


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # σ of -big
def test_prompt_chunks_agree_with_the_reference_path(mxfp4) -> None:
    chunks = [24, 16]
    # the reference's near-tie routings imposed on the fast path (NearTies says why)
    with pytest.MonkeyPatch.context() as mp:
        ties = NearTies(mp, chunks, 2e-2)
        want = reference_runner(mxfp4).logits_all(PROMPT, chunks)
    with pytest.MonkeyPatch.context() as mp:
        ties.pin(mp)
        got = fast_runner(mxfp4, prefill=True).logits_all(PROMPT, chunks)
    ties.check_pinned()
    tied = sorted(ties.rows(SPEC.n_layer))
    assert len(tied) <= len(PROMPT) // 8, f"rows {tied} route on near-ties"
    assert worst(want, got, PROMPT_TOL) < PROMPT_TOL
