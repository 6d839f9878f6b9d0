"""The elastic arena's contract, run on the host backend (and, from tests/gpu, on CUDA VMM).

``ArenaContract`` holds every behaviour both backends must share; a backend's test class inherits
it and supplies the ``make_arena`` fixture. Chunks are 2 MiB and reservations span 16 chunks.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from strata.vmm.arena import ElasticArena, create_arena
from strata.vmm.errors import ArenaRequestError, BackendError, BackendUnavailable
from strata.vmm.host_arena import HostArena

MiB = 1 << 20
CHUNK = 2 * MiB
CHUNKS = 16  # the reservation, in chunks

MakeArena = Callable[..., Any]


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def write(arena: ElasticArena, offset: int, data: torch.Tensor) -> None:
    v = arena.view(offset, data.numel())
    v.copy_(data.to(v.device))


def read(arena: ElasticArena, offset: int, nbytes: int) -> torch.Tensor:
    return arena.view(offset, nbytes).cpu().clone()


def state(arena: ElasticArena) -> tuple[int, int, torch.Tensor]:
    return arena.mapped_bytes, arena.base, read(arena, 0, arena.mapped_bytes)


# (id, request, the words its message must contain) on an arena with 4 of 16 chunks mapped.
REJECTED: list[tuple[str, Callable[[ElasticArena], object], list[str]]] = [
    ("grow-negative", lambda a: a.grow(-CHUNK), ["-2097152", "negative"]),
    ("grow-unaligned", lambda a: a.grow(CHUNK + 1), ["2097153", "chunk_bytes 2097152"]),
    ("grow-beyond", lambda a: a.grow(13 * CHUNK), ["27262976", "reserved_bytes 33554432"]),
    ("grow-not-int", lambda a: a.grow(float(CHUNK)), ["2097152.0", "int"]),
    ("grow-bool", lambda a: a.grow(True), ["True", "int"]),
    ("shrink-negative", lambda a: a.shrink(-CHUNK), ["-2097152", "negative"]),
    ("shrink-unaligned", lambda a: a.shrink(CHUNK // 2), ["1048576", "chunk_bytes 2097152"]),
    ("shrink-too-much", lambda a: a.shrink(5 * CHUNK), ["10485760", "mapped_bytes 8388608"]),
    ("resize-negative", lambda a: a.resize(-CHUNK), ["-2097152", "negative"]),
    ("resize-unaligned", lambda a: a.resize(3 * MiB), ["3145728", "chunk_bytes 2097152"]),
    ("resize-beyond", lambda a: a.resize(17 * CHUNK), ["35651584", "reserved_bytes 33554432"]),
    ("view-past-mapped", lambda a: a.view(4 * CHUNK - 8, 16), ["8388600", "[0, 8388608)"]),
    ("view-unmapped", lambda a: a.view(6 * CHUNK, 16), ["12582912", "[0, 8388608)"]),
    ("view-negative", lambda a: a.view(-4, 8), ["-4", "[0, 8388608)"]),
    ("view-negative-size", lambda a: a.view(0, -8), ["-8", "[0, 8388608)"]),
    ("view-misaligned", lambda a: a.view(2, 8, torch.int32), ["2", "item size 4"]),
    ("address-beyond", lambda a: a.address(CHUNKS * CHUNK + 1), ["33554433", "33554432"]),
    ("address-negative", lambda a: a.address(-1), ["-1", "33554432"]),
]


class ArenaContract:
    """The behaviours every ElasticArena backend shares. Subclasses provide ``make_arena``:
    ``make_arena(chunks=CHUNKS)`` returns a fresh, empty arena of ``chunks`` 2 MiB chunks."""

    def test_is_an_elastic_arena_and_starts_empty(self, make_arena: MakeArena) -> None:
        a = make_arena()
        assert isinstance(a, ElasticArena)
        assert (a.chunk_bytes, a.reserved_bytes, a.mapped_bytes) == (CHUNK, CHUNKS * CHUNK, 0)
        assert a.base != 0

    def test_grow_shrink_regrow(self, make_arena: MakeArena) -> None:
        a = make_arena()
        assert a.grow(3 * CHUNK) == 3 * CHUNK and a.mapped_bytes == 3 * CHUNK
        assert a.shrink(CHUNK) == CHUNK and a.mapped_bytes == 2 * CHUNK
        assert a.grow(6 * CHUNK) == 6 * CHUNK and a.mapped_bytes == 8 * CHUNK
        assert a.resize(CHUNKS * CHUNK) == CHUNKS * CHUNK
        assert a.resize(CHUNK) == CHUNK
        assert a.resize(CHUNK) == CHUNK
        assert a.grow(0) == 0 and a.shrink(0) == 0 and a.mapped_bytes == CHUNK
        assert a.resize(0) == 0
        assert a.grow(CHUNKS * CHUNK) == CHUNKS * CHUNK

    def test_shrink_with_ready_vouches_chunk_by_chunk_from_the_top(
        self, make_arena: MakeArena
    ) -> None:
        a = make_arena()
        a.grow(6 * CHUNK)
        write(a, 0, data := pattern(6 * CHUNK, seed=3))
        seen: list[tuple[int, int]] = []
        # each call comes while its chunk (and every one below it) is still mapped
        ready = lambda off: seen.append((off, a.mapped_bytes))  # noqa: E731
        assert a.shrink(4 * CHUNK, ready=ready) == 4 * CHUNK
        assert seen == [(5 * CHUNK, 6 * CHUNK), (4 * CHUNK, 5 * CHUNK),
                        (3 * CHUNK, 4 * CHUNK), (2 * CHUNK, 3 * CHUNK)]  # fmt: skip
        assert a.mapped_bytes == 2 * CHUNK
        assert torch.equal(read(a, 0, 2 * CHUNK), data[: 2 * CHUNK])

    def test_a_failing_ready_keeps_the_chunk_mapped(self, make_arena: MakeArena) -> None:
        a = make_arena()
        a.grow(4 * CHUNK)

        def ready(offset: int) -> None:
            if offset < 3 * CHUNK:
                raise RuntimeError(f"chunk at {offset} still busy")

        with pytest.raises(RuntimeError, match=str(2 * CHUNK)):
            a.shrink(3 * CHUNK, ready=ready)
        assert a.mapped_bytes == 3 * CHUNK  # the top went; the one still busy stayed
        assert a.view(0, 3 * CHUNK).numel() == 3 * CHUNK

    def test_base_and_addresses_never_move(self, make_arena: MakeArena) -> None:
        a = make_arena()
        base = a.base
        offsets = [0, CHUNK, 5 * CHUNK + 4096, (CHUNKS - 1) * CHUNK, CHUNKS * CHUNK]
        addresses = [a.address(o) for o in offsets]
        assert addresses == [base + o for o in offsets]
        for target in (4, 1, 16, 0, 9, 2, 16):
            a.resize(target * CHUNK)
            assert a.base == base
            assert [a.address(o) for o in offsets] == addresses
            for o in offsets:
                if o < a.mapped_bytes:
                    assert a.view(o, 64).data_ptr() == base + o

    def test_bytes_of_surviving_chunks_are_preserved(self, make_arena: MakeArena) -> None:
        a = make_arena()
        a.grow(6 * CHUNK)
        data = pattern(6 * CHUNK, seed=1)
        write(a, 0, data)
        a.grow(8 * CHUNK)
        assert torch.equal(read(a, 0, 6 * CHUNK), data)
        a.shrink(10 * CHUNK)  # down to 4 chunks: below the written part
        assert torch.equal(read(a, 0, 4 * CHUNK), data[: 4 * CHUNK])
        a.grow(2 * CHUNK)
        assert torch.equal(read(a, 0, 4 * CHUNK), data[: 4 * CHUNK])

    def test_new_chunks_read_zero_even_after_holding_data(self, make_arena: MakeArena) -> None:
        a = make_arena()
        assert a.grow(4 * CHUNK) == 4 * CHUNK
        assert not read(a, 0, 4 * CHUNK).any()
        a.view(0, 4 * CHUNK).fill_(0xAB)
        a.shrink(2 * CHUNK)
        a.grow(3 * CHUNK)
        got = read(a, 0, 5 * CHUNK)
        assert bool((got[: 2 * CHUNK] == 0xAB).all())
        assert not got[2 * CHUNK :].any(), "a chunk mapped again must not show its old bytes"

    def test_views_alias_each_other_without_copies(self, make_arena: MakeArena) -> None:
        a = make_arena()
        a.grow(2 * CHUNK)
        whole = a.view(0, 2 * CHUNK)
        words = a.view(CHUNK - 8, 16, torch.int32)  # straddles the two chunks
        assert words.data_ptr() == a.address(CHUNK - 8) and words.shape == (4,)
        words.copy_(torch.tensor([1, 2, 3, 0x01020304], dtype=torch.int32).to(words.device))
        assert whole[CHUNK - 8 : CHUNK - 4].cpu().tolist() == [1, 0, 0, 0]
        whole[CHUNK + 4 : CHUNK + 8].fill_(0)
        assert words.cpu().tolist() == [1, 2, 3, 0]
        assert a.view(0, 0).numel() == 0

    @pytest.mark.parametrize(
        ("request_", "words"), [c[1:] for c in REJECTED], ids=[c[0] for c in REJECTED]
    )
    def test_rejected_request_names_the_value_and_changes_nothing(
        self,
        make_arena: MakeArena,
        request_: Callable[[ElasticArena], object],
        words: list[str],
    ) -> None:
        a = make_arena()
        a.grow(4 * CHUNK)
        write(a, 0, pattern(4 * CHUNK, seed=2))
        before = state(a)
        with pytest.raises(ArenaRequestError) as err:
            request_(a)
        for word in words:
            assert word in str(err.value)
        after = state(a)
        assert after[:2] == before[:2]
        assert torch.equal(after[2], before[2])

    def test_close_is_idempotent_and_use_after_close_raises(self, make_arena: MakeArena) -> None:
        a = make_arena()
        a.grow(2 * CHUNK)
        a.close()
        a.close()
        assert a.mapped_bytes == 0
        for request in (
            lambda: a.view(0, 8),
            lambda: a.grow(CHUNK),
            lambda: a.shrink(0),
            lambda: a.resize(0),
            lambda: a.address(0),
        ):
            with pytest.raises(ArenaRequestError, match="closed"):
                request()

    def test_context_manager_closes(self, make_arena: MakeArena) -> None:
        with make_arena() as a:
            a.grow(CHUNK)
        with pytest.raises(ArenaRequestError, match="closed"):
            a.view(0, 8)


class FlakyCommit:
    """A commit seam that lets ``ok`` calls through, then fails with ``err`` until healed."""

    def __init__(self, ok: int, err: int) -> None:
        self.ok, self.err, self.calls = ok, err, 0

    def __call__(self, fd: int, offset: int, length: int) -> None:
        self.calls += 1
        if self.ok is not None and self.calls > self.ok:
            raise OSError(self.err, os.strerror(self.err))
        os.posix_fallocate(fd, offset, length)

    def heal(self) -> None:
        self.ok = None


def rss_shmem() -> int:
    """This process's resident shared memory (memfd pages included), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem in /proc/self/status")


class TestHostArena(ArenaContract):
    @pytest.fixture
    def make_arena(self) -> Iterator[MakeArena]:
        made: list[HostArena] = []

        def make(chunks: int = CHUNKS, **kw: Any) -> HostArena:
            made.append(HostArena(chunks * CHUNK, CHUNK, **kw))
            return made[-1]

        yield make
        for a in made:
            a.close()

    def test_device_is_cpu(self, make_arena: MakeArena) -> None:
        a = make_arena()
        a.grow(CHUNK)
        assert a.device == "cpu" and a.view(0, 8).device.type == "cpu"

    def test_grow_commits_memory_and_shrink_returns_it(self, make_arena: MakeArena) -> None:
        a = make_arena()
        assert a.committed_bytes == 0
        a.grow(8 * CHUNK)
        # Committed at grow time (allocated blocks), not at first touch.
        assert a.committed_bytes == 8 * CHUNK
        a.view(0, 8 * CHUNK).fill_(1)
        resident = rss_shmem()
        a.shrink(3 * CHUNK)
        assert a.committed_bytes == 5 * CHUNK, "the file must no longer hold the shrunk chunks"
        assert resident - rss_shmem() >= 3 * CHUNK - 64 * 1024
        a.grow(3 * CHUNK)
        assert a.committed_bytes == 8 * CHUNK
        a.resize(0)
        assert a.committed_bytes == 0

    def test_grow_that_runs_out_of_memory_stops_at_whole_chunks(
        self, make_arena: MakeArena, caplog: pytest.LogCaptureFixture
    ) -> None:
        commit = FlakyCommit(ok=3, err=errno.ENOMEM)
        a = make_arena(commit=commit)
        a.grow(CHUNK)
        data = pattern(CHUNK, seed=3)
        write(a, 0, data)
        with caplog.at_level(logging.WARNING, logger="strata.vmm.arena"):
            got = a.grow(6 * CHUNK)
        assert got == 2 * CHUNK
        assert a.mapped_bytes == 3 * CHUNK and a.committed_bytes == 3 * CHUNK
        assert "grow got 4194304 of 12582912 bytes" in caplog.text
        assert torch.equal(read(a, 0, CHUNK), data)
        assert not read(a, CHUNK, 2 * CHUNK).any()
        write(a, 2 * CHUNK, pattern(CHUNK, seed=4))  # the new chunks are usable
        assert a.grow(CHUNK) == 0 and a.mapped_bytes == 3 * CHUNK
        commit.heal()
        assert a.resize(CHUNKS * CHUNK) == CHUNKS * CHUNK
        assert a.committed_bytes == CHUNKS * CHUNK

    def test_other_failures_raise_and_leave_a_consistent_arena(self, make_arena: MakeArena) -> None:
        a = make_arena(commit=FlakyCommit(ok=2, err=errno.EIO))
        with pytest.raises(BackendError, match=r"offset 4194304.*Input/output error"):
            a.grow(5 * CHUNK)
        assert a.mapped_bytes == 2 * CHUNK and a.committed_bytes == 2 * CHUNK
        assert not read(a, 0, 2 * CHUNK).any()
        assert a.shrink(2 * CHUNK) == 2 * CHUNK and a.committed_bytes == 0

    @pytest.mark.parametrize(
        ("reserved", "chunk", "words"),
        [
            (CHUNKS * CHUNK, CHUNK + 1, ["chunk_bytes 2097153", "granularity 4096"]),
            (CHUNKS * CHUNK, 0, ["chunk_bytes 0", "positive"]),
            (CHUNKS * CHUNK + 4096, CHUNK, ["reserved_bytes 33558528", "chunk_bytes 2097152"]),
            (0, CHUNK, ["reserved_bytes 0", "positive"]),
            (-CHUNK, CHUNK, ["reserved_bytes -2097152", "positive"]),
        ],
    )
    def test_creation_rejects_bad_sizes(self, reserved: int, chunk: int, words: list[str]) -> None:
        with pytest.raises(ArenaRequestError) as err:
            HostArena(reserved, chunk)
        for word in words:
            assert word in str(err.value)


def test_create_arena_picks_the_backend_by_name() -> None:
    with create_arena("host", CHUNKS * CHUNK, CHUNK) as a:
        assert isinstance(a, HostArena)
    with pytest.raises(ArenaRequestError, match="'gpu'"):
        create_arena("gpu", CHUNKS * CHUNK, CHUNK)


def test_cuda_arena_without_cuda_bindings_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from strata.vmm.cuda_arena import CudaArena

    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # makes the import fail
    with pytest.raises(BackendUnavailable, match="cuda-bindings"):
        CudaArena(CHUNKS * CHUNK, CHUNK)
