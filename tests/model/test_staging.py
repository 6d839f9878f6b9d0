"""Expert misses staged through pinned buffers to the GPU: the right bytes, in the slot layout,
and never a buffer refilled while its copy is still queued."""

from __future__ import annotations

import pytest
import torch

from strata.engine.experts.provider import FileExpertProvider
from strata.engine.experts.staging import PinnedStager
from strata.engine.gguf_index import GGUFIndex
from strata.engine.quant.expert_layout import packed_bytes, run_offsets, slot_bytes_for


@pytest.fixture(scope="module")
def index(tiny_models) -> GGUFIndex:
    return GGUFIndex(tiny_models.path("qwen3moe", "Q8_0"))


@pytest.fixture
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    return torch.device("cuda", torch.cuda.current_device())


def file_bytes(index: GGUFIndex, layer: int, expert: int) -> list[torch.Tensor]:
    blob = index.expert(layer, expert)
    return [index.raw(r.offset, r.nbytes).clone() for r in blob.runs]


def test_staging_is_refused_for_a_cpu_device(index: GGUFIndex) -> None:
    with pytest.raises(ValueError, match="CUDA devices, not cpu"):
        PinnedStager(index, torch.device("cpu"), 1 << 20)


@pytest.mark.gpu
def test_staged_experts_hold_the_files_bytes_in_the_slot_layout(
    index: GGUFIndex, cuda: torch.device
) -> None:
    stager = PinnedStager(index, cuda, slot_bytes_for(index))
    for (layer, expert), blob in index.experts.items():
        runs = stager.upload(blob)
        offsets = run_offsets(blob)
        base = runs[0].data_ptr()
        for run, off, want in zip(runs, offsets, file_bytes(index, layer, expert), strict=True):
            assert run.device == cuda
            assert run.data_ptr() - base == off  # the slot layout: 256-byte aligned runs
            assert torch.equal(run.cpu(), want), (layer, expert)
    stager.close()


@pytest.mark.gpu
def test_a_buffer_is_refilled_only_after_its_copy_has_run(
    index: GGUFIndex, cuda: torch.device
) -> None:
    stager = PinnedStager(index, cuda, slot_bytes_for(index))
    every = list(index.experts)
    keys = [every[i % len(every)] for i in range(3 * stager.depth)]  # the ring wraps twice
    torch.cuda._sleep(200_000_000)  # hold the stream ~0.1 s: every copy below queues behind it
    staged = [stager.upload(index.experts[k]) for k in keys]
    for key, runs in zip(keys, staged, strict=True):
        for run, want in zip(runs, file_bytes(index, *key), strict=True):
            assert torch.equal(run.cpu(), want), key
    stager.close()


@pytest.mark.gpu
def test_an_expert_larger_than_the_buffer_is_refused_naming_both_sizes(
    index: GGUFIndex, cuda: torch.device
) -> None:
    blob = index.expert(0, 0)
    stager = PinnedStager(index, cuda, 1024)
    with pytest.raises(ValueError, match=rf"expert of {packed_bytes(blob)} bytes .* 1024-byte"):
        stager.upload(blob)


@pytest.mark.gpu
def test_provider_misses_on_cuda_are_staged_and_close_frees_the_buffers(
    index: GGUFIndex, cuda: torch.device
) -> None:
    provider = FileExpertProvider(index, cuda)
    w = provider.expert(1, 2)
    assert provider._stager is not None and provider._stager.depth >= 2
    assert torch.equal(w.down.raw.cpu(), file_bytes(index, 1, 2)[2])
    assert provider.stats.misses == 1
    provider.close()
    assert provider._stager is None
    again = provider.expert(1, 2)  # a later miss makes a new ring
    assert torch.equal(again.gate.raw.cpu(), file_bytes(index, 1, 2)[0])
    provider.close()
