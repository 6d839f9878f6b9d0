"""Split GGUF sets (``model-00001-of-00003.gguf`` …): one model from any of its parts, the same
logits as the single file from every tier, and a missing, foreign or truncated part refused
naming it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import gguf
import pytest
import torch

from strata.engine import gguf_split, synth
from strata.engine.errors import ModelLoadError
from strata.engine.experts.cache import ExpertCache, model_key
from strata.engine.generate import Engine
from strata.engine.gguf_index import GGUFIndex
from strata.engine.options import EngineOptions

Q = gguf.GGMLQuantizationType
CPU = torch.device("cpu")
CHUNK = 2 << 20


@pytest.fixture(scope="module")
def single(tiny_models) -> Path:
    return tiny_models.path("qwen3moe", "Q8_0")


@pytest.fixture(scope="module")
def parts(single: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return gguf_split.write_parts(single, tmp_path_factory.mktemp("split") / "tiny.gguf", 3)


def copy_set(parts: list[Path], into: Path) -> list[Path]:
    into.mkdir()
    return [Path(shutil.copy(p, into / p.name)) for p in parts]


def test_the_writer_names_three_parts_and_experts_lie_in_several(parts: list[Path]) -> None:
    assert [p.name for p in parts] == [f"tiny-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    index = GGUFIndex(parts[0])
    assert len(index.parts) == 3 and index.name == "tiny" and index.path == parts[0]
    holders = {index._part(r.offset).path for b in index.iter_experts() for r in b.runs}
    assert len(holders) >= 2  # the test below crosses files, not just opens them


@pytest.mark.parametrize("which", [0, 1, 2])
def test_any_part_opens_the_same_model_as_the_single_file(
    single: Path, parts: list[Path], which: int
) -> None:
    one, split = GGUFIndex(single), GGUFIndex(parts[which])
    assert split.path == parts[0]
    assert {k: v for k, v in one.metadata.items() if not k.startswith("GGUF.")} == {
        k: v for k, v in split.metadata.items() if not k.startswith(("GGUF.", "split."))
    }
    assert one.tensors.keys() == split.tensors.keys()
    for name, t in one.tensors.items():
        s = split.tensors[name]
        assert (s.qtype, s.shape, s.nbytes) == (t.qtype, t.shape, t.nbytes)
        assert torch.equal(split.raw(s.offset, s.nbytes), one.raw(t.offset, t.nbytes)), name
    assert split.file_bytes == sum(p.stat().st_size for p in parts)
    assert model_key(split) != model_key(one)  # a profile is kept per file set


def test_logits_are_bit_identical_to_the_single_file_from_every_tier(
    single: Path, parts: list[Path]
) -> None:
    from reference import RefModel

    tokens = RefModel(single).test_sequence(16)
    out = []
    for path in (single, parts[0]):
        for cache_mib, host_mib in ((1, 64), (0, 0)):  # slots + RAM homes; the file's pages
            options = EngineOptions(
                device="cpu", cache_mib=cache_mib, host_budget_mib=host_mib,
                arena_chunk_mib=2, kv_cache_type="f32", context_length=64,
            )  # fmt: skip
            e = Engine.load(path, options)
            try:
                assert path == single or e.model_id == "tiny"
                out.append(e.sequences.logits_all(tokens))
                if cache_mib:
                    assert e.cache is not None and e.provider.stats.bytes_from_ram > 0
            finally:
                e.close()
    for other in out[1:]:
        assert torch.equal(out[0], other)


def test_checksums_and_page_release_work_across_parts(single: Path, parts: list[Path]) -> None:
    sums = []
    for path in (single, parts[0]):
        index = GGUFIndex(path)
        cache = ExpertCache.create(index, CPU, 1 << 40, None, CHUNK, verify=True)
        try:
            sums.append(dict(cache.sums))
            assert cache.released_bytes > 0  # copied into slots: the files' pages given back
        finally:
            cache.close()
    assert sums[0] == sums[1] and len(sums[0]) == len(GGUFIndex(single).experts)
    index = GGUFIndex(parts[0])
    runs = [(r.offset, r.nbytes) for b in index.iter_experts() for r in b.runs]
    in_each = {index._part(o).path for o, _ in runs}
    assert len(in_each) >= 2
    assert index.release(runs) > 0  # every part's pages asked to go, at that part's offsets
    assert index.resident_bytes(runs) >= 0
    with pytest.raises(ModelLoadError, match="outside the model's files"):
        index.raw(index.file_bytes, 4)


# -- parts that do not fit -----------------------------------------------------------------------


def test_a_missing_part_is_named(parts: list[Path], tmp_path: Path) -> None:
    mine = copy_set(parts, tmp_path / "set")
    mine[1].unlink()
    for opened in (mine[0], mine[2]):
        with pytest.raises(ModelLoadError, match="part 2 of the 3-part model tiny is missing") as e:
            GGUFIndex(opened)
        assert str(mine[1]) in str(e.value)


@pytest.fixture(scope="module")
def other_parts(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Another model (2 blocks) in 3 parts."""
    spec = synth.ModelSpec("qwen3moe", 2, 64, 4, 2, 16, 4, 2, 64, 256, 1e6, 1e-6)
    d = tmp_path_factory.mktemp("other")
    src = synth.write_model(d / "src.gguf", spec, synth.vocab_for("qwen3moe"),
                            synth.TypePlan.uniform(Q.Q4_0), 3)  # fmt: skip
    return gguf_split.write_parts(src, d / "other.gguf", 3)


def test_a_part_of_another_set_is_named(
    parts: list[Path], other_parts: list[Path], tmp_path: Path
) -> None:
    mine = copy_set(parts, tmp_path / "set")
    shutil.copy(other_parts[1], mine[1])
    with pytest.raises(ModelLoadError, match="a part of another set") as e:
        GGUFIndex(mine[0])
    assert str(e.value).startswith(str(mine[1]))


def test_parts_swapped_under_each_others_names_are_named(parts: list[Path], tmp_path: Path) -> None:
    mine = copy_set(parts, tmp_path / "set")
    os.replace(mine[1], tmp_path / "x")
    os.replace(mine[2], mine[1])
    os.replace(tmp_path / "x", mine[2])
    with pytest.raises(ModelLoadError, match="named as part 2 of 3, but its metadata says part 3"):
        GGUFIndex(mine[0])


def test_a_truncated_part_is_named(parts: list[Path], tmp_path: Path) -> None:
    mine = copy_set(parts, tmp_path / "set")
    os.truncate(mine[2], mine[2].stat().st_size - 4096)
    with pytest.raises(ModelLoadError, match=r"truncated|past the end") as e:
        GGUFIndex(mine[0])
    assert str(e.value).startswith(str(mine[2]))


def test_a_part_renamed_out_of_its_set_says_the_others_cannot_be_found(
    parts: list[Path], tmp_path: Path
) -> None:
    lone = Path(shutil.copy(parts[0], tmp_path / "renamed.gguf"))
    with pytest.raises(ModelLoadError, match="part of a 3-part split model, but its name"):
        GGUFIndex(lone)


def test_a_name_that_no_set_has_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="part 4 of 3"):
        gguf_split.part_paths(tmp_path / "m-00004-of-00003.gguf")
    assert gguf_split.set_stem("a/b/m-00002-of-00003.gguf") == "m"
    assert gguf_split.set_stem("a/b/m.gguf") == "m"
