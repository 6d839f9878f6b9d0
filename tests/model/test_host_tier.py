"""The host tier: every expert in exactly one home (a VRAM slot, a host slot, or the file), RAM
holding each expert once, the same numbers from every tier, and page-locking verified in full.

On the CPU the "VRAM" cache is the host arena and the tier is plain memory; the ``gpu`` twins in
``test_host_tier_gpu.py`` run the same checks with CUDA VMM and page-locked memory read by the
decode graph.
"""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import gguf
import pytest
import torch

from strata.engine import synth
from strata.engine.experts.cache import ExpertCache, chunk_groups
from strata.engine.experts.host import HostTier, default_budget_bytes, tier_slots
from strata.engine.experts.slots import SlotTagMismatch, Tag
from strata.engine.generate import Engine
from strata.engine.gguf_index import GGUFIndex
from strata.engine.options import EngineOptions
from strata.engine.quant.expert_layout import packed_bytes
from strata.vmm import pagecache
from strata.vmm.host_arena import HostArena
from strata.vmm.pinned import HostMemory, PinError, PinRefused

Q = gguf.GGMLQuantizationType
MiB = 2**20
GiB = 2**30
CHUNK = 2 * MiB
CPU = torch.device("cpu")


def homes(cache: ExpertCache) -> tuple[set, set, set]:
    """(keys in VRAM slots, keys in host homes, keys on the file)."""
    vram = cache.table.cached_keys()
    host = cache.tier.table.cached_keys() if cache.tier is not None else set()
    rest = set(cache.index.experts) - vram - host
    return vram, host, rest


def check_one_home(cache: ExpertCache, want_file: int = 0) -> None:
    vram, host, rest = homes(cache)
    assert not vram & host, f"experts with two homes: {sorted(vram & host)[:5]}"
    assert len(rest) == want_file == cache.file_experts


def home_bytes_match(cache: ExpertCache, key: tuple[int, int]) -> bool:
    """A home holds the expert's runs in the slot layout (file layout on the CPU)."""
    assert cache.tier is not None
    blob = cache.index.expert(*key)
    slot = cache.tier.slot_of(key)
    assert slot is not None
    got = cache.tier.view(slot, packed_bytes(blob))
    return all(
        torch.equal(got[off : off + r.nbytes], cache.index.raw(r.offset, r.nbytes))
        for off, r in zip((0, *_ups(blob)), blob.runs, strict=True)
    )


def _ups(blob) -> tuple[int, int]:
    from strata.engine.quant.expert_layout import run_offsets

    return run_offsets(blob)[1:]


@pytest.fixture(scope="module")
def q8(tiny_models) -> Path:
    return tiny_models.path("qwen3moe", "Q8_0")


def create(path: Path, share: float, host_bytes: int, **kw) -> ExpertCache:
    index = GGUFIndex(path)
    probe = ExpertCache.create(index, CPU, 1 << 40, None, CHUNK)
    budget = int(probe.max_slots * share) * probe.slot_bytes
    probe.close()
    return ExpertCache.create(index, CPU, budget, kw.pop("tail", 0), CHUNK,
                              host_budget_bytes=host_bytes, **kw)  # fmt: skip


# -- bookkeeping and sizes ---------------------------------------------------------------------


def test_the_tier_holds_exactly_the_experts_no_slot_holds(q8: Path) -> None:
    cache = create(q8, 0.5, GiB)
    try:
        vram, host, rest = homes(cache)
        assert len(vram) == cache.max_slots // 2
        assert host == set(cache.index.experts) - vram and not rest
        assert all(home_bytes_match(cache, k) for k in host)
        t = cache.tier_stats()
        assert t is not None and t.experts == len(host) and t.file_experts == 0
        # room for every expert the core cannot hold: here the core is everything cached
        assert t.slots == cache.max_slots - cache.sizes.core_slots
    finally:
        cache.close()


def test_one_home_through_200_random_resizes(q8: Path) -> None:
    cache = create(q8, 0.75, GiB, tail=None)
    rng = random.Random(7)
    lo, hi = cache.sizes.core_slots, cache.max_slots
    try:
        for i in range(200):
            n = rng.randint(lo, hi)
            cache.usage.record([rng.choice(list(cache.index.experts)) for _ in range(5)])
            r = cache.resize(n)
            assert r.to_file == 0
            check_one_home(cache)
            if i % 40 == 0:
                assert all(home_bytes_match(cache, k) for k in cache.tier.table.cached_keys())
        vram, host, _ = homes(cache)
        assert len(vram) == cache.n_slots and len(vram) + len(host) == cache.max_slots
    finally:
        cache.close()


def test_beyond_the_budget_experts_stay_on_the_file_and_a_shrink_says_so(q8: Path) -> None:
    probe = create(q8, 0.5, 0)
    slot, n = probe.slot_bytes, probe.max_slots
    probe.close()
    cache = create(q8, 0.5, 4 * slot, tail=None)  # 4 homes for 16 experts outside the slots
    try:
        vram, host, rest = homes(cache)
        assert len(host) == 4 and len(rest) == n - len(vram) - 4
        check_one_home(cache, want_file=len(rest))
        r = cache.resize(cache.sizes.core_slots)
        assert r.to_host == 0 and r.to_file == r.from_slots - r.to_slots - r.copied
        check_one_home(cache, want_file=n - cache.n_slots - 4)
        # a grow takes the homed experts back first when they rank first
        cache.usage.record(list(cache.tier.table.cached_keys()) * 3)
        r = cache.resize(cache.max_slots)
        assert r.from_host == 4 and len(cache.tier.table) == 0
        check_one_home(cache)
    finally:
        cache.close()


def slot_matches_file(cache: ExpertCache, key: tuple[int, int]) -> bool:
    slot = cache.table.slot_of(key)
    assert slot is not None
    blob = cache.index.expert(*key)
    got = cache.arena.view(slot * cache.slot_bytes, packed_bytes(blob))
    return all(
        torch.equal(got[off : off + r.nbytes], cache.index.raw(r.offset, r.nbytes))
        for off, r in zip((0, *_ups(blob)), blob.runs, strict=True)
    )


def test_an_exchange_keeps_one_home_and_moves_the_bytes(q8: Path) -> None:
    cache = create(q8, 0.5, GiB, tail=None)
    try:
        with pytest.raises(ValueError, match="max_swaps=-1 is negative"):
            cache.exchange(-1)
        homed = sorted(cache.tier.table.cached_keys())[:3]
        tail = [cache.table.tag(s).key for s in cache.table.tail_slots()]
        cache.usage.record_counts({homed[0]: 50, homed[1]: 40, homed[2]: 30})
        cache.usage.record_counts({k: 1 for k in tail})
        before = cache.version
        assert cache.exchange(2) == 2 and cache.swaps == 2 and cache.version > before
        vram, host, _ = homes(cache)
        assert homed[0] in vram and homed[1] in vram and homed[2] in host  # at most 2
        assert len(vram & set(tail)) == len(tail) - 2  # two cold tail experts went down
        check_one_home(cache)
        assert all(slot_matches_file(cache, k) for k in vram)
        assert all(home_bytes_match(cache, k) for k in host)
        # equals never trade places: 30 against a victim of 1 swaps; 1 against 1 does not
        assert cache.exchange(8) == 1
        cache.usage.record_counts({k: 1 for k in cache.tier.table.cached_keys()})
        assert cache.exchange(8) == 0
    finally:
        cache.close()


class Commit:
    """The host arena's commit seam: gives ``left`` more chunks their pages (None: all), then
    fails with no memory."""

    def __init__(self) -> None:
        self.left: int | None = None

    def __call__(self, fd: int, offset: int, length: int) -> None:
        if self.left is not None:
            if self.left == 0:
                raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
            self.left -= 1
        os.posix_fallocate(fd, offset, length)


def test_a_grow_that_cannot_get_its_memory_keeps_one_home_and_is_retried(q8: Path) -> None:
    commit = Commit()
    factory = lambda reserved, chunk: HostArena(reserved, chunk, commit=commit)  # noqa: E731
    cache = create(q8, 1.0, GiB, tail=None, arena_factory=factory)
    try:
        cache.resize(cache.sizes.core_slots)  # the evicted experts go to their RAM homes
        shrunk = cache.n_slots
        check_one_home(cache)
        commit.left = 0  # no memory at all: only the slots the mapped chunks hold fill
        held = cache.arena.mapped_bytes // cache.slot_bytes
        assert held < cache.max_slots
        r = cache.resize(cache.max_slots)
        assert r.to_slots == held and r.from_host == held - shrunk
        shrunk = held
        check_one_home(cache)
        assert all(home_bytes_match(cache, k) for k in cache.tier.table.cached_keys())
        commit.left = 1  # memory for one chunk: the grow stops at the slots that chunk holds
        r = cache.resize(cache.max_slots)
        assert shrunk < r.to_slots < cache.max_slots and r.from_host == r.to_slots - shrunk
        check_one_home(cache)
        assert all(slot_matches_file(cache, k) for k in cache.table.cached_keys())
        commit.left = None  # the memory came back: the same request now completes
        r = cache.resize(cache.max_slots)
        assert r.to_slots == cache.max_slots
        check_one_home(cache)
        assert len(cache.tier.table) == 0
        assert all(slot_matches_file(cache, k) for k in cache.table.cached_keys())
    finally:
        cache.close()


def test_tier_sizes_and_the_automatic_budget() -> None:
    assert tier_slots(10 * MiB, MiB, 100, 20) == 10
    assert tier_slots(GiB, MiB, 100, 20) == 80  # never more than the core leaves out
    assert tier_slots(0, MiB, 100, 20) == 0
    with pytest.raises(ValueError, match="-1 bytes is negative"):
        tier_slots(-1, MiB, 100, 0)
    info = {"MemAvailable": 20 * GiB, "MemTotal": 64 * GiB}
    assert default_budget_bytes(info) == 12 * GiB  # an eighth of 64 GiB kept
    assert default_budget_bytes({"MemAvailable": 6 * GiB, "MemTotal": 16 * GiB}) == 2 * GiB
    assert default_budget_bytes({"MemAvailable": GiB, "MemTotal": 8 * GiB}) == 0
    assert default_budget_bytes({}) == 0


def test_a_corrupt_host_tag_is_an_error_naming_the_expert(q8: Path) -> None:
    cache = create(q8, 0.5, GiB)
    try:
        key = next(iter(sorted(cache.tier.table.cached_keys())))
        slot = cache.tier.slot_of(key)
        cache.tier.table._tags[slot] = Tag(key[0], key[1] + 1, 999)
        with pytest.raises(SlotTagMismatch, match=rf"\(layer {key[0]}, expert {key[1]}\)"):
            cache.expert(*key)
    finally:
        cache.close()


# -- page-locking ------------------------------------------------------------------------------


class FakePinner:
    """Registers ranges in a set; refuses the ``refuse_at``-th call (0-based)."""

    def __init__(self, refuse_at: int | None = None) -> None:
        self.refuse_at = refuse_at
        self.calls = 0
        self.registered: dict[int, int] = {}

    def register(self, address: int, nbytes: int) -> int:
        if self.calls == self.refuse_at:
            raise PinRefused(f"cuMemHostRegister of {nbytes} bytes: CUDA_ERROR_OUT_OF_MEMORY")
        self.calls += 1
        self.registered[address] = nbytes
        return address

    def unregister(self, address: int) -> None:
        del self.registered[address]


def test_a_partial_page_lock_is_an_error_naming_both_sizes_and_leaves_nothing_locked() -> None:
    pinner = FakePinner(refuse_at=2)
    with pytest.raises(PinError, match=r"page-locking 5 MiB .* obtained 2 MiB .*OUT_OF_MEMORY"):
        HostMemory(5 * MiB, pinner, piece_bytes=MiB)
    assert pinner.registered == {}
    whole = FakePinner()
    mem = HostMemory(5 * MiB, whole, piece_bytes=MiB)
    assert mem.pinned and sum(whole.registered.values()) == 5 * MiB
    assert mem.device_address(3 * MiB + 7) == mem.address + 3 * MiB + 7
    mem.close()
    assert whole.registered == {}


class ShiftingPinner(FakePinner):
    """Maps each registered piece at its host address plus ``shift(i)`` for the i-th piece."""

    def __init__(self, shift) -> None:
        super().__init__()
        self.shift = shift

    def register(self, address: int, nbytes: int) -> int:
        return super().register(address, nbytes) + self.shift(self.calls - 1)


def test_the_one_offset_from_device_to_host_addresses_or_none() -> None:
    """What the CPU's share needs to read a home the GPU names by its device address."""
    same = HostMemory(3 * MiB, FakePinner(), piece_bytes=MiB)
    assert same.host_minus_device() == 0
    moved = HostMemory(3 * MiB, ShiftingPinner(lambda i: 1 << 40), piece_bytes=MiB)
    assert moved.host_minus_device() == -(1 << 40)
    assert moved.device_address(MiB + 5) + moved.host_minus_device() == moved.address + MiB + 5
    apart = HostMemory(3 * MiB, ShiftingPinner(lambda i: i << 40), piece_bytes=MiB)
    assert apart.host_minus_device() is None
    assert HostMemory(MiB, None).host_minus_device() is None  # not page-locked
    for mem in (same, moved, apart):
        mem.close()


def test_host_memory_dropped_without_close_is_unregistered_before_it_is_unmapped() -> None:
    import gc

    pinner = FakePinner()
    mem = HostMemory(3 * MiB, pinner, piece_bytes=MiB)
    view = mem.view(0, 16)
    del mem
    gc.collect()
    assert len(pinner.registered) == 3  # a view keeps the memory (and its registration)
    view.fill_(1)
    del view
    gc.collect()
    assert pinner.registered == {}


def test_a_partial_page_lock_stops_the_load_and_frees_the_arena(q8: Path, monkeypatch) -> None:
    from strata.engine import loader

    pinner = FakePinner(refuse_at=0)
    monkeypatch.setattr(loader, "_pinner", lambda device: pinner)
    options = EngineOptions(device="cpu", cache_mib=1, host_budget_mib=64, arena_chunk_mib=2)
    with pytest.raises(Exception, match=r"page-locking .* obtained 0 MiB") as err:
        Engine.load(q8, options)
    assert type(err.value).__name__ == "ModelLoadError" and str(q8) in str(err.value)
    assert pinner.registered == {}


def test_a_host_slot_tier_gives_plain_memory_back() -> None:
    tier = HostTier(4, 3 * 4096)
    tier.view(1).fill_(7)
    tier.assign(1, (0, 0))
    tier.drop((0, 0))
    assert int(tier.view(1).sum()) == 0  # released: the pages read as zeros again
    with pytest.raises(KeyError, match=r"\(layer 0, expert 0\) has no home"):
        tier.drop((0, 0))
    tier.close()


# -- the numbers -------------------------------------------------------------------------------


def test_logits_are_identical_from_every_tier(q8: Path) -> None:
    from reference import RefModel

    tokens = RefModel(q8).test_sequence(24)
    out = []
    for cache_mib, host_mib in ((None, 0), (1, 64), (0, 64), (0, 0)):
        budget = 1 << 20 if cache_mib is None else cache_mib
        options = EngineOptions(
            device="cpu", cache_mib=budget, host_budget_mib=host_mib, arena_chunk_mib=2,
            kv_cache_type="f32", context_length=64,
        )  # fmt: skip
        e = Engine.load(q8, options)
        try:
            if cache_mib == 0:  # on the CPU no cache at 0 MiB, tier or not: the file's pages
                assert e.cache is None
            elif cache_mib is not None:
                assert e.cache is not None and e.cache.tier is not None
            out.append(e.sequences.logits_all(tokens))
            if e.cache is not None and e.cache.tier is not None and cache_mib == 1:
                assert e.provider.stats.bytes_from_ram > 0
        finally:
            e.close()
    for other in out[1:]:
        assert torch.equal(out[0], other)


# -- RAM holds each expert once ----------------------------------------------------------------


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    """128 F32 experts of 1.5 MiB (192 MiB): large against the allocator's own noise."""
    spec = synth.ModelSpec("qwen3moe", 4, 256, 8, 2, 64, 32, 2, 512, 256, 1e6, 1e-6)
    path = tmp_path_factory.mktemp("wide") / "wide.gguf"
    return synth.write_model(path, spec, synth.vocab_for("qwen3moe"),
                             synth.TypePlan.uniform(Q.F32), 0)  # fmt: skip


def drop_file_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_ram_holds_each_expert_once_after_load_and_after_resizes(wide: Path) -> None:
    index = GGUFIndex(wide)
    runs = [(r.offset, r.nbytes) for b in index.iter_experts() for r in b.runs]
    drop_file_cache(wide)
    if pagecache.resident_bytes(wide, runs) > 8 * MiB:
        pytest.skip("this file system keeps the file's pages cached (fadvise ignored)")
    probe = ExpertCache.create(index, CPU, 1 << 40, None, CHUNK)
    slot, n = probe.slot_bytes, probe.max_slots
    probe.close()
    base = rss_anon() + pagecache.resident_bytes(wide, runs)
    cache = ExpertCache.create(index, CPU, n // 2 * slot, None, CHUNK, host_budget_bytes=GiB)
    rng = random.Random(3)
    try:
        for check in range(5):
            _, host, _ = homes(cache)
            outside = sum(packed_bytes(index.expert(*k)) for k in host)
            growth = rss_anon() + pagecache.resident_bytes(wide, runs) - base
            assert growth <= outside * 1.1, (
                f"check {check}: RSS + page cache grew by {growth / MiB:.1f} MiB for "
                f"{outside / MiB:.1f} MiB of experts outside the slots"
            )
            for _ in range(40):
                cache.usage.record([rng.choice(list(index.experts)) for _ in range(9)])
                cache.resize(rng.randint(cache.sizes.core_slots, n))
            check_one_home(cache)
    finally:
        cache.close()


def test_a_copy_never_crosses_from_one_page_locked_piece_into_the_next(q8: Path) -> None:
    cache = create(q8, 0.5, GiB)
    seen: list[tuple[int, int]] = []

    def src(slot: int, n: int) -> torch.Tensor:
        seen.append((slot, n // cache.slot_bytes))
        return torch.zeros(n, dtype=torch.uint8)

    def dst(slot: int, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.uint8)

    try:
        cache.copies.copy_slots([(s, s + 100) for s in range(10)], src, dst, src_piece=4)
        assert seen == [(0, 4), (4, 4), (8, 2)]
        seen.clear()
        cache.copies.copy_slots([(s, s + 1) for s in range(6)], src, dst, dst_piece=3)
        assert seen == [(0, 2), (2, 3), (5, 1)]  # dst 3 starts a piece
    finally:
        cache.close()


def test_each_chunk_waits_for_the_last_copy_that_reads_it() -> None:
    # slots of 3 bytes in chunks of 4: slot 1 covers bytes 3-5 (chunks 0 and 1), slot 2 bytes
    # 6-8 (chunks 1 and 2), slot 5 bytes 15-17 (chunks 3 and 4)
    pairs = [(1, 10), (2, 11), (5, 12), (6, 13)]
    groups, last = chunk_groups(pairs, slot_bytes=3, chunk_bytes=4)
    assert groups == {0: [(1, 10)], 1: [(2, 11)], 3: [(5, 12)], 4: [(6, 13)]}
    # chunk 1 is read by slot 1 (group 0, queued after group 1) and slot 2: it waits for 0
    assert last == {0: 0, 1: 0, 2: 1, 3: 3, 4: 3, 5: 4}
    # slots larger than a chunk: slot 1 of 10 bytes covers chunks 2-4 of 4 bytes
    assert chunk_groups([(1, 0)], 10, 4)[1] == {2: 2, 3: 2, 4: 2}


def test_a_shrink_reports_its_phases(q8: Path) -> None:
    cache = create(q8, 1.0, GiB, tail=None)
    try:
        down = cache.resize(cache.sizes.core_slots)
        assert down.to_host > 0
        assert set(down.phases) == {"plan", "copy_out", "tables", "unmap", "wait"}
        assert all(v >= 0 for v in down.phases.values())
        assert cache.resize(cache.max_slots).phases == {}  # a grow has none
        check_one_home(cache)
    finally:
        cache.close()


# -- verify_experts ----------------------------------------------------------------------------


def flip(view: torch.Tensor, at: int = 100) -> None:
    view[at : at + 1].bitwise_xor_(1)


def test_a_flipped_byte_in_a_home_is_found_at_the_fill_and_never_used(q8: Path, caplog) -> None:
    cache = create(q8, 0.5, GiB, tail=None, verify=True)
    try:
        assert len(cache.sums) == cache.max_slots  # every expert summed at load
        key = sorted(cache.tier.table.cached_keys())[0]
        flip(cache.tier.view(cache.tier.slot_of(key)))
        cache.usage.record_counts({key: 100})  # it ranks first: the grow fills it from RAM
        with caplog.at_level("ERROR"):
            cache.resize(cache.sizes.core_slots + cache.sizes.tail_slots + 1)
        assert cache.corrupt == 1 and key not in cache.table.cached_keys()
        assert f"(layer {key[0]}, expert {key[1]})" in caplog.text
        check_one_home(cache, want_file=1)  # its home is the file again
        assert all(slot_matches_file(cache, k) for k in cache.table.cached_keys())
    finally:
        cache.close()


def test_a_flipped_byte_in_a_slot_is_found_when_it_moves_down(q8: Path) -> None:
    cache = create(q8, 0.5, GiB, tail=None, verify=True)
    try:
        top = cache.n_slots - 1
        key = cache.table.tag(top).key
        flip(cache.arena.view(top * cache.slot_bytes, cache.slot_bytes))
        r = cache.resize(top)  # evicts it into a home: the home's copy disagrees
        assert r.to_host == 1 and cache.corrupt == 1
        assert cache.tier.slot_of(key) is None and key not in cache.table.cached_keys()
        check_one_home(cache, want_file=1)
    finally:
        cache.close()


def test_a_flipped_byte_found_at_use_stops_with_the_expert_named(q8: Path) -> None:
    from strata.engine.experts.checksum import ExpertCorrupt

    cache = create(q8, 0.5, GiB, verify=True)
    try:
        slot, tag = next(iter(cache.table))
        flip(cache.arena.view(slot * cache.slot_bytes, cache.slot_bytes), at=7)
        healthy = sorted(cache.tier.table.cached_keys())[:3]
        cache.check_sample(healthy)  # untouched copies pass
        with pytest.raises(ExpertCorrupt, match=rf"\(layer {tag.layer}, expert {tag.expert}\)"):
            cache.check_sample([*healthy, tag.key])
        assert tag.key not in cache.table.cached_keys()  # dropped: never read again
    finally:
        cache.close()
