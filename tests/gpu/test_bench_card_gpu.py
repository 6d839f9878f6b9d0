"""``strata bench --card-gib N`` on a real GPU: after filling, the device's free memory is N GiB
within the tolerance (as another process, llama-bench, would see it: the driver's count), and
after the release it is back where it was."""

from __future__ import annotations

import pytest
import torch

from strata.bench import card
from strata.bench.settings import BenchError

pytestmark = pytest.mark.gpu
GiB = 2**30


def test_the_filler_leaves_n_gib_free_and_gives_it_all_back(cuda_device: int) -> None:
    device = torch.device("cuda", cuda_device)
    torch.cuda.init()
    torch.cuda.empty_cache()
    before, _ = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_allocated(device)  # what earlier tests of the run left with torch
    gib = min(4.0, before / GiB / 2)  # a card well inside what is free
    with card.emulated_card(gib, device) as filler:
        free, _ = torch.cuda.mem_get_info(device)
        assert abs(free - gib * GiB) <= card.TOLERANCE, (free, filler.report())
        r = filler.report()
        assert r["free_bytes"] is not None and abs(r["free_bytes"] - free) <= card.TOLERANCE
        assert r["filler_bytes"] > 0 and r["within_tolerance"]
        # what the engine would get: torch allocations stop near N GiB, not at the device's size
        assert torch.cuda.memory_allocated(device) == held, "the filler is not torch's"
    after, _ = torch.cuda.mem_get_info(device)
    assert abs(after - before) <= 64 * 2**20, (before, after)


def test_more_than_the_free_memory_is_refused_holding_nothing(cuda_device: int) -> None:
    device = torch.device("cuda", cuda_device)
    before, total = torch.cuda.mem_get_info(device)
    with pytest.raises(BenchError, match="--card-gib"):
        with card.emulated_card(total / GiB + 1, device):
            pass
    after, _ = torch.cuda.mem_get_info(device)
    assert abs(after - before) <= 64 * 2**20
