"""A split GGUF set on the GPU: the fast decode graph and the prompt path read experts of every
part from VRAM slots, RAM homes and the files' pages, and give the single file's tokens and
logits bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from strata.engine import gguf_split
from strata.engine.generate import Engine
from strata.engine.options import EngineOptions
from strata.engine.params import SamplingParams

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


@pytest.fixture(scope="module")
def cuda() -> str:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    return "cuda:0"


def run(path: Path, cuda: str, cache_mib: int, host_mib: int) -> tuple[list[int], torch.Tensor]:
    options = EngineOptions(device=cuda, kv_cache_type="f32", context_length=256,
                            arena_chunk_mib=2, cache_mib=cache_mib, host_budget_mib=host_mib,
                            cpu_share=0.0)  # fmt: skip
    e = Engine.load(path, options)
    try:
        tokens = e.generate([1, 2, 3, 4, 5], GREEDY).tokens
        e.sequences.rewind(0)
        return tokens, e.sequences.feed([9, 8, 7, 17, 2230]).cpu()
    finally:
        e.close()


@pytest.mark.parametrize("cache_mib, host_mib", [(1 << 20, 0), (4, 64), (4, 0)])
def test_a_split_set_decodes_as_the_single_file_on_the_gpu(
    tiny_models, tmp_path: Path, cuda: str, cache_mib: int, host_mib: int
) -> None:
    single = tiny_models.path("qwen3moe", "Q8_0")
    parts = gguf_split.write_parts(single, tmp_path / "tiny.gguf", 3)
    want = run(single, cuda, cache_mib, host_mib)
    got = run(parts[1], cuda, cache_mib, host_mib)  # opened from its second part
    assert got[0] == want[0] and torch.equal(got[1], want[1])
