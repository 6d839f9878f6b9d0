"""``strata bench --card-gib N`` without a GPU: the filler on a fake device (fill, the one
correction, release, the errors that name the option), the flag's validation at the CLI edge, and
the card's fields in the JSON and the printed report."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from strata.bench import card, report
from strata.bench.settings import BenchError, BenchSettings, parse_card_gib
from strata.daemon.commands import bench_cmd
from strata.daemon.config import load_config

GiB, MiB = 2**30, 2**20


class FakeDevice:
    """A device with ``total`` bytes, ``used`` of them taken. ``extra`` maps the number of an
    allocation to bytes it takes beyond its size (allocator overhead, a context created late)
    or, when negative, that someone else gives back meanwhile, so that the fill misses its
    target. ``fail_after`` makes every allocation after that many fail."""

    def __init__(
        self,
        total: int,
        used: int,
        extra: dict[int, int] | None = None,
        fail_after: int | None = None,
    ) -> None:
        self.total, self.used, self.fail_after = total, used, fail_after
        self.extra = extra or {}
        self.live: dict[int, int] = {}  # block id -> bytes
        self.allocs = 0

    def mem_get_info(self) -> tuple[int, int]:
        return self.total - self.used, self.total

    def alloc(self, nbytes: int) -> object:
        assert nbytes > 0 and nbytes % card.ALIGN == 0
        if self.fail_after is not None and self.allocs >= self.fail_after:
            raise MemoryError("out of memory (fake)")
        if nbytes > self.total - self.used:
            raise MemoryError("out of memory (fake)")
        self.allocs += 1
        self.used += nbytes + self.extra.get(self.allocs, 0)
        block = self.allocs
        self.live[block] = nbytes
        return block

    def free(self, block: object) -> None:
        assert isinstance(block, int)
        self.used -= self.live.pop(block)


def test_fills_to_n_gib_free_in_chunks_and_gives_everything_back() -> None:
    dev = FakeDevice(total=141 * GiB, used=1 * GiB)
    with card.CardFiller(12, dev) as f:
        assert dev.mem_get_info()[0] == 12 * GiB
        assert f.held_bytes == 128 * GiB and len(dev.live) == 8  # 16 GiB chunks
        r = f.report()
    assert dev.used == 1 * GiB and not dev.live
    assert r == {
        "gib": 12,
        "target_free_bytes": 12 * GiB,
        "filler_bytes": 128 * GiB,
        "free_bytes": 12 * GiB,
        "free_before_bytes": 140 * GiB,
        "total_bytes": 141 * GiB,
        "adjusted": None,
        "tolerance_bytes": card.TOLERANCE,
        "within_tolerance": True,
    }


def test_memory_taken_during_the_fill_is_not_overshot() -> None:
    # 20 GiB (more than a chunk) appear at the first allocation: the next chunks see it
    dev = FakeDevice(total=141 * GiB, used=1 * GiB, extra={1: 20 * GiB})
    with card.CardFiller(16, dev) as f:
        assert f.adjusted is None and dev.mem_get_info()[0] == 16 * GiB
        assert f.held_bytes == sum(dev.live.values()) == (140 - 16 - 20) * GiB


def test_a_fill_short_of_n_shrinks_once_across_chunks() -> None:
    # the last chunk costs 20 GiB more than its size (beyond a chunk): the last chunks give
    # back the difference, the last one of them re-allocated smaller
    dev = FakeDevice(total=141 * GiB, used=1 * GiB, extra={8: 20 * GiB})
    f = card.CardFiller(12, dev)
    f.fill()
    assert f.adjusted == "shrank"
    assert dev.mem_get_info()[0] == 12 * GiB == f.report()["free_bytes"]
    assert f.held_bytes == sum(dev.live.values()) == (140 - 12 - 20) * GiB
    assert sorted(dev.live.values()) == [12 * GiB] + [16 * GiB] * 6
    f.release()
    f.release()  # idempotent
    assert not dev.live and dev.used == 21 * GiB


def test_a_fill_beyond_n_grows_once_by_a_top_up_chunk() -> None:
    dev = FakeDevice(total=141 * GiB, used=5 * GiB, extra={8: -3 * GiB})  # 3 GiB freed
    with card.CardFiller(12, dev) as f:
        assert f.adjusted == "grew" and f.report()["within_tolerance"]
        assert dev.mem_get_info()[0] == 12 * GiB
        assert len(dev.live) == 9
    assert dev.used == 2 * GiB


def test_within_the_tolerance_nothing_is_corrected() -> None:
    dev = FakeDevice(total=24 * GiB, used=1 * GiB, extra={1: 200 * MiB})
    with card.CardFiller(8, dev) as f:
        assert f.adjusted is None
        assert f.report()["free_bytes"] == 8 * GiB - 200 * MiB


def test_recheck_corrects_what_the_engine_left_before_llama_bench() -> None:
    dev = FakeDevice(total=48 * GiB, used=1 * GiB)
    with card.CardFiller(12, dev) as f:
        dev.used += 2 * GiB  # left taken by Strata's run
        again = f.recheck()
        assert again == {
            "error": None,
            "free_bytes": 12 * GiB,
            "adjusted": "shrank",
            "filler_bytes": 33 * GiB,
            "within_tolerance": True,
        }
        assert f.report()["adjusted"] is None  # the fill's own correction is unchanged


def test_more_than_the_free_memory_names_the_option_and_both_numbers() -> None:
    dev = FakeDevice(total=24 * GiB, used=4 * GiB)
    with pytest.raises(BenchError) as e:
        card.CardFiller(32, dev).fill()
    msg = str(e.value)
    assert "--card-gib" in msg and "32" in msg and "20.00 GiB free of 24.00 GiB" in msg
    assert dev.used == 4 * GiB and dev.allocs == 0


def test_a_chunk_refused_is_tried_again_smaller() -> None:
    class Fragmented(FakeDevice):  # no block beyond 5 GiB
        def alloc(self, nbytes: int) -> object:
            if nbytes > 5 * GiB:
                raise MemoryError("fragmented (fake)")
            return super().alloc(nbytes)

    dev = Fragmented(total=24 * GiB, used=1 * GiB)
    with card.CardFiller(12, dev) as f:
        assert dev.mem_get_info()[0] == 12 * GiB and max(dev.live.values()) <= 5 * GiB
        assert f.held_bytes == 11 * GiB


def test_allocations_that_fail_are_an_error_that_leaks_nothing() -> None:
    dev = FakeDevice(total=141 * GiB, used=1 * GiB, fail_after=3)
    with pytest.raises(BenchError) as e:
        card.CardFiller(12, dev).fill()
    msg = str(e.value)
    assert msg.startswith("--card-gib: invalid value 12: cannot leave 12 GiB free: 92.00 GiB")
    assert "256 MiB refused (out of memory (fake))" in msg
    assert not dev.live and dev.used == 1 * GiB


def test_an_interrupted_fill_leaks_nothing() -> None:
    class Interrupted(FakeDevice):
        def alloc(self, nbytes: int) -> object:
            if self.allocs == 2:
                raise KeyboardInterrupt
            return super().alloc(nbytes)

    dev = Interrupted(total=141 * GiB, used=1 * GiB)
    with pytest.raises(KeyboardInterrupt):
        card.CardFiller(12, dev).fill()
    assert not dev.live


@pytest.mark.parametrize("bad", ["0", "-3", "abc", "", "nan", "inf", "1e999"])
def test_card_gib_must_be_a_positive_number(bad: str) -> None:
    with pytest.raises(BenchError, match=f"--card-gib: invalid value {bad!r}"):
        parse_card_gib(bad)


def test_card_gib_accepts_fractions() -> None:
    assert parse_card_gib("15.5") == 15.5 and parse_card_gib("12") == 12.0
    with pytest.raises(BenchError, match="--card-gib"):
        card.CardFiller(0, FakeDevice(GiB, 0))


def test_settings_refuse_a_card_of_no_size(tmp_path: Path) -> None:
    from strata.engine.options import EngineOptions

    with pytest.raises(BenchError, match="--card-gib: invalid value -1"):
        BenchSettings(model=tmp_path, engine=EngineOptions(), budgets=(), card_gib=-1.0,
                      llama_bench=tmp_path)  # fmt: skip


def _bench(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """``strata bench ARGV`` in-process; its exit must be 2 with one line on stderr."""
    parser = argparse.ArgumentParser()
    bench_cmd.add_arguments(parser)
    args = parser.parse_args(argv)
    loaded = load_config(args, environ={"XDG_CONFIG_HOME": str(tmp_path)})
    assert bench_cmd.run(loaded, args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--card-gib", "twelve"], "--card-gib: invalid value 'twelve'"),
        (["--card-gib", "0"], "--card-gib: invalid value '0'"),
        (["--card-gib", "12", "--device", "cpu"], "--card-gib 12: needs a CUDA device"),
    ],
)
def test_bad_card_flags_are_one_line_before_any_model_loads(
    argv: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    line = _bench(["--model", str(model), "--device", "cpu", *argv], tmp_path, capsys)
    assert named in line


def test_merge_refuses_card_gib(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _bench(["--merge", "a.json", "b.json", "--card-gib", "12"], tmp_path, capsys)
    assert "drop --card-gib" in line


def _result(device_card: dict[str, object] | None) -> dict[str, object]:
    return {
        "model": {"name": "tiny", "file_bytes": GiB, "n_experts": 8, "slot_bytes": MiB},
        "settings": {
            "context_length": 64,
            "reps": 1,
            "prefill": [8],
            "decode_tokens": 4,
            "card_gib": 12.0,
        },
        "device": {"name": "H200", "threads": 4, "card": device_card},
        "bandwidth": {"reason": "not measured"},
        "strata": [],
    }


def test_report_prints_the_card_and_its_recheck() -> None:
    dev = FakeDevice(total=141 * GiB, used=1 * GiB)
    with card.CardFiller(12, dev) as f:
        c = f.report()
        dev.used += GiB
        c["before_llama"] = f.recheck()
    text = report.text_report(_result(c))
    assert (
        "emulated card: 12 GiB asked, 12.00 GiB free after filling (the filler holds 128.00 GiB "
        "of 141.00 GiB); capacity only: PCIe and RAM are this machine's" in text
    )
    assert "before llama-bench: 12.00 GiB free (the filler holds 127.00 GiB, shrank once" in text
    assert "emulated card" not in report.text_report(_result(None))


def test_report_says_when_the_card_is_outside_the_tolerance() -> None:
    c = card.CardFiller(12, FakeDevice(141 * GiB, GiB)).report()  # never filled
    c.update(free_bytes=13 * GiB, filler_bytes=0, within_tolerance=False)
    assert "outside the ±256 MiB tolerance" in "\n".join(report.card_lines(c))
