"""The expert cache's copy helpers on their own: runs of slot copies, chunk groups, the scratch
ring's reuse, and the checksum book of ``verify_experts``. Plain CPU tensors, no model."""

from __future__ import annotations

import torch

from strata.engine.experts.checksum import Checksummer, checksum
from strata.engine.experts.copies import ScratchRing, chunk_groups, copy_runs
from strata.engine.experts.verify import Verifier

CPU = torch.device("cpu")


def test_consecutive_pairs_coalesce_into_one_run() -> None:
    assert copy_runs([(2, 7), (0, 5), (1, 6)]) == [(0, 5, 3)]  # sorted first
    assert copy_runs([(0, 5), (1, 7), (2, 8)]) == [(0, 5, 1), (1, 7, 2)]  # dst gap
    assert copy_runs([]) == []


def test_a_run_stops_at_a_piece_boundary_on_either_side() -> None:
    assert copy_runs([(s, s + 100) for s in range(10)], src_piece=4) == [
        (0, 100, 4), (4, 104, 4), (8, 108, 2)
    ]  # fmt: skip
    assert copy_runs([(s, s + 1) for s in range(6)], dst_piece=3) == [
        (0, 1, 2), (2, 3, 3), (5, 6, 1)
    ]  # fmt: skip


def test_chunk_groups_name_the_lowest_group_reading_each_chunk() -> None:
    # slots of 4 bytes in chunks of 8: two slots a chunk, none crossing
    groups, last = chunk_groups([(0, 9), (1, 8), (3, 7)], slot_bytes=4, chunk_bytes=8)
    assert groups == {0: [(0, 9), (1, 8)], 1: [(3, 7)]}
    assert last == {0: 0, 1: 1}


class FakeEvent:
    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1


def test_the_scratch_ring_hands_out_its_slots_in_turn_and_waits_for_each() -> None:
    ring = ScratchRing(CPU, 16, n=3, event=FakeEvent)
    got = [ring.take() for _ in range(4)]
    ptrs = [t.data_ptr() for t, _ in got]
    assert len(set(ptrs[:3])) == 3 and ptrs[3] == ptrs[0]  # the fourth reuses the first
    assert got[3][1] is got[0][1] and got[0][1].waits == 2  # waited on at each take
    assert all(t.numel() == 16 and t.dtype == torch.uint8 for t, _ in got)
    ring.close()
    assert ring.take()[0].numel() == 16  # allocated again after close


def test_a_scratch_ring_without_events_needs_no_device() -> None:
    ring = ScratchRing(CPU, 8, n=2)
    (a, ea), (b, eb), (c, _) = ring.take(), ring.take(), ring.take()
    assert ea is None and eb is None and c.data_ptr() == a.data_ptr() != b.data_ptr()


def test_the_checksummer_agrees_with_one_checksum_and_reuses_its_weights() -> None:
    data = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (7, 64, 33)]
    summer = Checksummer()
    assert summer.checksums(data) == [int(checksum(d)) for d in data]
    w = summer.weights(4, CPU)
    assert w.tolist() == [1, 3, 5, 7]
    flipped = data[1].clone()
    flipped[5] ^= 1
    assert summer.checksums([flipped]) != summer.checksums([data[1]])


def test_the_verifier_records_the_first_sum_and_flags_a_later_mismatch() -> None:
    v = Verifier(enabled=True)
    good = torch.arange(32, dtype=torch.uint8)
    bad = good.clone()
    bad[3] ^= 0x10
    assert v.check([((0, 1), "slot", 4)], [good]) == []
    assert v.check([((0, 1), "home", 2)], [good]) == []
    assert v.check([((0, 1), "home", 2)], [bad]) == [((0, 1), "home", 2)]
    assert v.corrupt == 1 and set(v.sums) == {(0, 1)}
    assert v.known([((0, 1), "slot", 4), ((5, 5), "slot", 0)]) == [((0, 1), "slot", 4)]


def test_a_verifier_that_is_off_sums_nothing() -> None:
    v = Verifier()
    assert not v.wants([((0, 0), "slot", 0)])
    assert v.check([((0, 0), "slot", 0)], [torch.zeros(4, dtype=torch.uint8)]) == []
    assert v.sums == {} and v.corrupt == 0
