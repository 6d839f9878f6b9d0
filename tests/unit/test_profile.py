"""The expert usage profile: atomic save, load, merge over runs, bad files reported once."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from strata.engine.experts import profile as profile_module
from strata.engine.experts.profile import UsageProfile, profile_path

KEY = "qwen3moe:48x128:17179869184:Qwen3-30B-A3B-Q4_K_M.gguf"
OTHER = "qwen3moe:48x128:17179869184:Other.gguf"


def files_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_save_load_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "p.json"  # parent dirs are created
    prof = UsageProfile(KEY, {(0, 3): 5.0, (1, 0): 2.5, (0, 1): 7})
    prof.save(path)
    doc = json.loads(path.read_text())
    assert doc["version"] == 1 and doc["model_key"] == KEY
    assert doc["counts"] == [[0, 1, 7.0], [0, 3, 5.0], [1, 0, 2.5]]
    loaded = UsageProfile.load(path, KEY)
    assert loaded.model_key == KEY and loaded.counts == {(0, 1): 7.0, (0, 3): 5.0, (1, 0): 2.5}
    assert loaded.ranked() == [(0, 1), (0, 3), (1, 0)]
    assert files_in(path.parent) == ["p.json"]


def test_merge_over_runs(tmp_path: Path) -> None:
    path = profile_path(tmp_path, KEY)
    for run in range(3):
        prof = UsageProfile.load(path, KEY)
        prof.merge({(0, 0): 1.0, (1, run): 2.0})
        prof.save(path)
    assert UsageProfile.load(path, KEY).counts == {
        (0, 0): 3.0,
        (1, 0): 2.0,
        (1, 1): 2.0,
        (1, 2): 2.0,
    }
    same = UsageProfile(KEY, {(1, 1): 1.0})
    same.merge(UsageProfile.load(path, KEY))
    assert same.counts == {(0, 0): 3.0, (1, 0): 2.0, (1, 1): 3.0, (1, 2): 2.0}


def test_merge_refuses_another_model_and_bad_counts() -> None:
    prof = UsageProfile(KEY, {(0, 0): 1.0})
    with pytest.raises(ValueError) as info:
        prof.merge(UsageProfile(OTHER, {(0, 0): 1.0}))
    assert KEY in str(info.value) and OTHER in str(info.value)
    for bad in ({(0, 1): 1.0, (0, 0): -1.0}, {(0, 1): 1.0, (0, 0): float("nan")}, {(0,): 1.0}):
        with pytest.raises(ValueError):
            prof.merge(bad)
    assert prof.counts == {(0, 0): 1.0}  # a rejected merge changes nothing
    with pytest.raises(ValueError, match="model_key"):
        UsageProfile("")


def test_ranked_ties_by_layer_and_expert() -> None:
    prof = UsageProfile(KEY, {(2, 0): 1.0, (0, 5): 3.0, (1, 1): 1.0, (0, 9): 1.0})
    assert prof.ranked() == [(0, 5), (0, 9), (1, 1), (2, 0)]


def test_a_crash_before_the_rename_keeps_the_old_file_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "p.json"
    UsageProfile(KEY, {(0, 0): 1.0}).save(path)
    old = path.read_bytes()

    def crash(*args: object) -> None:
        raise OSError("simulated crash")

    monkeypatch.setattr(profile_module.os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        UsageProfile(KEY, {(0, 0): 99.0}).save(path)
    assert path.read_bytes() == old
    assert files_in(tmp_path) == ["p.json"]


def test_a_crash_while_writing_leaves_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(fd: int) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(profile_module.os, "fsync", crash)
    with pytest.raises(OSError, match="disk gone"):
        UsageProfile(KEY, {(0, 0): 1.0}).save(tmp_path / "p.json")
    assert files_in(tmp_path) == []


def test_a_missing_file_is_an_empty_profile_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        prof = UsageProfile.load(tmp_path / "nope.json", KEY)
    assert prof.counts == {} and prof.model_key == KEY
    assert caplog.records == []


def _doc(**changes: object) -> str:
    doc = {"format": "strata-expert-profile", "version": 1, "model_key": KEY}
    doc["counts"] = [[0, 0, 1.0]]
    doc.update(changes)
    return json.dumps(doc)


BAD_FILES = [
    (b"\x00\xff\xfe garbage", "cannot read"),
    (b"{not json", "not valid JSON"),
    (b"", "not valid JSON"),
    (b"[1, 2]", "expected a JSON object"),
    (_doc(format="something-else").encode(), "format"),
    (_doc(version=2).encode(), "version is 2"),
    (_doc(model_key=OTHER).encode(), OTHER),
    (_doc(counts={"0": 1}).encode(), "'counts'"),
    (_doc(counts=[[0, 0]]).encode(), "entry 0"),
    (_doc(counts=[[0, 0, 1], [0, 1, -2]]).encode(), "entry 1"),
    (_doc(counts=[[0, 0, "3"]]).encode(), "not a number"),
    (_doc(counts=[[0, True, 3]]).encode(), "entry 0"),
    (_doc(counts=[[-1, 0, 3]]).encode(), "entry 0"),
    (_doc(counts=[[0, 1.5, 3]]).encode(), "entry 0"),
    (_doc(counts=[[0, 0, 1], [0, 0, 2]]).encode(), "twice"),
    (_doc().replace("1.0]]", "NaN]]").encode(), "finite"),
    (_doc().replace("1.0]]", "Infinity]]").encode(), "finite"),
    (b"[" * 100_000, "not valid JSON"),
]


@pytest.mark.parametrize(("content", "reason"), BAD_FILES)
def test_a_bad_file_is_reported_once_and_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes, reason: str
) -> None:
    path = tmp_path / "p.json"
    path.write_bytes(content)
    with caplog.at_level(logging.DEBUG):
        prof = UsageProfile.load(path, KEY)
    assert prof.counts == {} and prof.model_key == KEY
    assert len(caplog.records) == 1, caplog.records
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert str(path) in record.getMessage() and reason in record.getMessage()


def test_an_unreadable_path_is_reported_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "p.json"
    path.mkdir()
    with caplog.at_level(logging.DEBUG):
        assert UsageProfile.load(path, KEY).counts == {}
    assert len(caplog.records) == 1 and str(path) in caplog.records[0].getMessage()


def test_profile_path_is_one_readable_file_per_model(tmp_path: Path) -> None:
    a, b = profile_path(tmp_path, KEY), profile_path(tmp_path, OTHER)
    assert a != b and a == profile_path(tmp_path, KEY)
    assert a.parent == b.parent and a.parent.is_relative_to(tmp_path)
    assert a.suffix == ".json" and a.name.startswith("qwen3moe-48x128-")
    # keys that sanitise alike stay apart; odd characters never leave the directory
    c, d = profile_path(tmp_path, "x/../y:1"), profile_path(tmp_path, "x/../y;1")
    assert c != d and c.parent == a.parent and "/" not in c.name and not c.name.startswith(".")
    assert profile_path(tmp_path, "///").name.startswith("model-")
    assert len(profile_path(tmp_path, "k" * 500).name) < 80
