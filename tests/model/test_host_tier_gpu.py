"""The host tier on a GPU: page-locked homes the decode graph reads over PCIe (zero-copy, no host
round trip, no re-capture), the same tokens and logits from every tier, and resizes that move
experts between VRAM and RAM instead of dropping them. Resize times are printed, never asserted
(``strata bench`` measures them against their targets).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

from strata.engine.generate import Engine
from strata.engine.options import EngineOptions
from strata.engine.params import SamplingParams

pytestmark = pytest.mark.gpu
MiB = 2**20
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def cuda() -> str:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    return "cuda:0"


def load(path: Path, cuda: str, **kw) -> Engine:
    """The GPU reads every RAM expert unless ``cpu_share`` is given (None: chosen at load)."""
    options = dict(device=cuda, kv_cache_type="f32", context_length=256, arena_chunk_mib=2,
                   cache_mib=0)  # fmt: skip
    options["cpu_share"] = 0.0
    options.update(kw)
    return Engine.load(path, EngineOptions(**options))  # type: ignore[arg-type]


def run(e: Engine) -> tuple[list[int], list[torch.Tensor]]:
    text = e.generate([1, 2, 3, 4, 5], GREEDY).tokens
    e.sequences.rewind(0)
    logits = [e.sequences.feed([9, 8, 7]).cpu()]
    for tok in (17, 2230, 40, 5):
        logits.append(e.sequences.feed([tok]).cpu())
    return text, logits


def same(a: tuple[list[int], list[torch.Tensor]], b: tuple[list[int], list[torch.Tensor]]) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


def every_expert_in_vram(path: Path, cuda: str) -> tuple[tuple[list[int], list[torch.Tensor]], int]:
    """``run``'s tokens and logits with every expert in VRAM, and the MiB that cache takes."""
    every = load(path, cuda, cache_mib=1 << 20, host_budget_mib=0)
    want = run(every)
    full = -(-every.cache.n_slots * every.cache.slot_bytes // MiB) + 2
    every.close()
    return want, full


@pytest.mark.parametrize("ahead", [2, 0], ids=["copies-ahead", "no-copies-ahead"])
@pytest.mark.parametrize("kind", ["Q4_K_M", "Q8_0"])
def test_the_decode_graph_reads_misses_from_page_locked_homes(tiny_models, cuda, kind, ahead):
    path = tiny_models.path("qwen3moe", kind)
    want, full = every_expert_in_vram(path, cuda)
    for mib in (full // 2, 0):
        e = load(path, cuda, cache_mib=mib, host_budget_mib=256, prefetch_experts=ahead)
        cache, dec = e.cache, e.sequences.gpu
        assert cache is not None and cache.tier is not None and cache.tier.pinned
        assert dec is not None and dec.tables.plan.complete and dec.graph is not None
        assert e.sequences.can_look_ahead()
        assert cache.file_experts == 0 and len(cache.tier.table) == cache.max_slots - cache.n_slots
        before = e.provider.stats.bytes_from_ram
        got = run(e)
        assert got[0] == want[0], f"cache {mib} MiB: tokens differ"
        for a, b in zip(want[1], got[1], strict=True):
            assert torch.equal(a, b), f"cache {mib} MiB: logits differ"
        e.sequences.flush_usage()
        assert e.provider.stats.bytes_from_ram > before  # read over PCIe from the homes
        assert e.provider.stats.bytes_from_file == 0
        made, chosen = e.provider.stats.prefetched, e.provider.stats.prefetch_used
        print(f"\n{kind} cache {mib} MiB: {made} copies ahead, {chosen} chosen")
        if ahead:  # the graph with the copies ahead: made on side streams, and used
            assert dec.prefetching and 0 < chosen <= made
        else:
            assert not dec.prefetching and made == 0
        e.close()


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q8_0"])
def test_the_cpus_share_inside_the_decode_graph_keeps_the_logits(tiny_models, cuda, kind):
    """The CPU's share of the RAM experts, posted from inside the graph to the CPU pool's server
    and waited for there: the same logits to float rounding, at half a cache and none, and
    counted; no wait gave up."""
    from fastpath import cpu_share_tol

    path = tiny_models.path("qwen3moe", kind)
    want, full = every_expert_in_vram(path, cuda)
    for mib in (full // 2, 0):
        e = load(path, cuda, cache_mib=mib, host_budget_mib=256, cpu_share=0.5, threads=4)
        dec = e.sequences.gpu
        assert dec is not None and dec.cpu.on, dec.cpu.reason if dec else None
        assert dec.mode == "cpu" and dec.graph is dec.graphs["cpu"] and e.sequences.can_look_ahead()
        got = run(e)
        tol = cpu_share_tol(dec, 1e-4)  # Q4_K_M's Q4_K and Q6_K: the CPU reads an int8 input
        for i, (a, b) in enumerate(zip(want[1], got[1], strict=True)):
            err = float((a - b).abs().max() / a.abs().max())
            assert err < tol, f"cache {mib} MiB, step {i}: logits differ by {err:.2e}"
        e.sequences.flush_usage()
        st = e.provider.stats
        swaps = e.cache.swaps if e.cache is not None else 0
        print(f"\n{kind} cache {mib} MiB: {st.cpu_computed} of {st.misses} RAM experts on the CPU"
              f", {swaps} exchanges")  # fmt: skip
        assert 0 < st.cpu_computed < st.misses, f"cache {mib} MiB, {swaps} exchanges"
        pool = dec.cpu.cpu
        mb = pool.mailbox
        assert mb is not None
        told = f"fault {mb.fault}, posted {mb.posted}, answered {mb.answered}, {pool.stats()}"
        assert mb.fault == 0 and mb.answered == mb.posted > 0, told
        e.close()


def test_an_automatic_cpu_share_is_chosen_by_timing_and_keeps_the_logits(
    tiny_models, cuda, caplog
) -> None:
    """``cpu_share`` unset: at load, a few steps at each candidate share are timed in rounds
    and the smallest share within the slack of the fastest median is kept (and said in the
    log); the logits stay those of every expert in VRAM."""
    from strata.engine.gpu.cpu_share import CPU_SHARE_CANDIDATES, CPU_SHARE_SLACK

    path = tiny_models.path("qwen3moe", "Q8_0")
    want, full = every_expert_in_vram(path, cuda)
    with caplog.at_level(logging.INFO, logger="strata.engine.gpu.runner"):
        e = load(path, cuda, cache_mib=full // 2, host_budget_mib=256, threads=2, cpu_share=None)
    dec = e.sequences.gpu
    assert dec is not None and set(dec.cpu.tuned) == set(CPU_SHARE_CANDIDATES)
    assert dec.cpu.share in CPU_SHARE_CANDIDATES and "chosen by timing" in caplog.text
    assert (not dec.cpu.on) == (dec.cpu.share == 0)
    fastest = min(dec.cpu.tuned.values())
    assert dec.cpu.tuned[dec.cpu.share] <= fastest * (1 + CPU_SHARE_SLACK)
    assert all(dec.cpu.tuned[s] > fastest * (1 + CPU_SHARE_SLACK)
               for s in CPU_SHARE_CANDIDATES if s < dec.cpu.share)  # fmt: skip
    print(f"\nautomatic cpu_share {dec.cpu.share}: ms per step {dec.cpu.tuned}")
    from fastpath import cpu_share_tol

    tol = cpu_share_tol(dec, 1e-4) if dec.cpu.on else 1e-4  # (Q8_0 on x86: an int8 input)
    got = run(e)
    for i, (a, b) in enumerate(zip(want[1], got[1], strict=True)):
        err = float((a - b).abs().max() / a.abs().max())
        assert err < tol, f"step {i}: logits differ by {err:.2e}"
    e.close()


def test_a_step_whose_wait_for_the_cpu_gave_up_stops_the_request(tiny_models, cuda) -> None:
    """A wait that gave up (its fault set, as a timed-out wait sets it) makes the step's
    output wrong: the request stops with an error saying why, the CPU share goes off, and the
    next request reads every RAM expert over PCIe, with the right tokens."""
    from strata.engine.gpu.cpu_share import CpuShareFault

    path = tiny_models.path("qwen3moe", "Q8_0")
    want, full = every_expert_in_vram(path, cuda)
    e = load(path, cuda, cache_mib=full // 2, host_budget_mib=256, cpu_share=0.5, threads=2)
    dec = e.sequences.gpu
    assert dec is not None and dec.mode == "cpu"
    mb = dec.cpu.cpu.mailbox
    mb.buf[mb.layout.fault] = 1
    with pytest.raises(CpuShareFault, match="waited more than 2 s"):
        e.generate([1, 2, 3, 4, 5], GREEDY)
    assert not dec.cpu.on and dec.mode == "plain"
    e.sequences.rewind(0)
    assert run(e)[0] == want[0]
    e.close()


def test_resizes_move_experts_between_vram_and_ram_and_change_no_token(tiny_models, cuda):
    path = tiny_models.path("qwen3moe", "Q4_K_M")
    e = load(path, cuda, cache_mib=1 << 20, elastic_tail_mib=1 << 20, host_budget_mib=256)
    cache, dec = e.cache, e.sequences.gpu
    assert cache is not None and cache.tier is not None and dec is not None
    steady = run(e)
    graph = dec.graph
    calls = 0

    def resize() -> None:
        nonlocal calls
        calls += 1
        if calls == 4:
            r = cache.resize(cache.sizes.core_slots)
            assert r.to_host == r.from_slots - r.to_slots and r.to_file == 0
            assert dec.tables.plan.complete  # every evicted expert found a home
        elif calls == 12:
            r = cache.resize(cache.max_slots)
            assert r.from_host == r.to_slots - r.from_slots
            assert len(cache.tier.table) == 0

    text = e.generate([1, 2, 3, 4, 5], GREEDY, safe_point=resize).tokens
    assert text == steady[0] and calls > 12
    assert dec.graph is graph  # never re-captured
    # the timings of a whole shrink and grow, for the log (the bench measures them at size)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    down = cache.resize(0)
    t1 = time.perf_counter()
    up = cache.resize(cache.max_slots)
    t2 = time.perf_counter()
    mib = (down.from_slots - down.to_slots) * cache.slot_bytes / MiB
    print(f"\nshrink of {mib:.0f} MiB ({down.to_host} to RAM) {1e3 * (t1 - t0):.1f} ms, "
          f"grow back ({up.from_host} from RAM) {1e3 * (t2 - t1):.1f} ms")  # fmt: skip
    assert same(run(e), steady)
    e.close()


def test_exchanges_copy_beside_the_steps_and_land_at_the_next_safe_point(tiny_models, cuda):
    path = tiny_models.path("qwen3moe", "Q8_0")  # (Q4_K_M is made by llama-cpp-python)
    want, full = every_expert_in_vram(path, cuda)
    e = load(path, cuda, cache_mib=full // 2, host_budget_mib=256, verify_experts=True)
    cache, dec = e.cache, e.sequences.gpu
    assert cache is not None and cache.tier is not None and dec is not None
    assert dec.tables.plan.complete
    graph, started, landed = dec.graph, [], []

    def safe_point() -> None:
        if started and not landed:  # the step after the exchange began landed them
            assert not cache.exchanging and set(started[-1]) <= cache.table.cached_keys()
            landed.append(len(started))
        elif len(started) < 2:
            hot = sorted(cache.tier.table.cached_keys())[:4]
            cache.usage.record_counts(dict.fromkeys(hot, 1000))
            before, version = cache.table.cached_keys(), cache.version
            assert cache.exchange(4) == 4 and cache.exchanging
            # until the next safe point every table names the old homes
            assert cache.table.cached_keys() == before and cache.version == version
            assert all(cache.tier.slot_of(k) is not None for k in hot)
            started.append(hot)
            landed.clear()

    text = e.generate([1, 2, 3, 4, 5], GREEDY, safe_point=safe_point).tokens
    assert text == want[0] and len(started) == 2 and landed == [2]
    assert cache.swaps == 8 and cache.corrupt == 0  # every landed copy checksummed against load
    assert dec.graph is graph and dec.tables.plan.complete
    got = run(e)
    assert same(got, want)
    vram, host = cache.table.cached_keys(), cache.tier.table.cached_keys()
    assert not vram & host and len(vram) + len(host) == cache.max_slots
    e.close()


def test_without_room_evicted_experts_go_back_to_the_file(tiny_models, cuda) -> None:
    path = tiny_models.path("qwen3moe", "Q4_K_M")
    probe = load(path, cuda, cache_mib=1 << 20, host_budget_mib=0)
    slot = probe.cache.slot_bytes
    want = run(probe)
    probe.close()
    e = load(path, cuda, cache_mib=1 << 20, elastic_tail_mib=1 << 20,
             host_budget_mib=-(-4 * slot // MiB))  # fmt: skip
    cache = e.cache
    assert cache is not None and cache.tier is not None
    r = cache.resize(0)
    assert r.to_host == cache.tier.n_slots and r.to_file == r.from_slots - r.to_host
    assert not e.sequences.gpu.tables.plan.complete  # the misses on the file are staged again
    assert same(run(e), want)
    e.close()


def test_checksums_on_the_gpu_find_a_flipped_byte_in_a_home(tiny_models, cuda) -> None:
    path = tiny_models.path("qwen3moe", "Q4_K_M")
    e = load(path, cuda, cache_mib=0, host_budget_mib=256, verify_experts=True)
    cache = e.cache
    assert cache is not None and cache.tier is not None and cache.verify
    want = run(e)
    key = sorted(cache.tier.table.cached_keys())[0]
    home = cache.tier.view(cache.tier.slot_of(key))
    home[64:65].bitwise_xor_(4)  # summed over PCIe by the GPU: the grow's check finds it
    cache.usage.record_counts({key: 100})
    cache.resize(1)
    assert cache.corrupt == 1 and cache.file_experts == 1
    assert same(run(e), want)  # the expert is read from the file: the same numbers
    e.close()
