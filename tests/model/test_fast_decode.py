"""The fast decode path end to end, on the CPU in Triton's interpreter (CI) and compiled on a GPU:
its logits against the reference path's, the same bits whatever the cache holds (and across a
shrink and a grow mid-generation), the expert uses it counts on the device, a corrupt slot table
refused, and the choice of path at load.

On the CPU the GPU runner is assembled by hand (``Engine.load`` takes the fast path on a GPU only);
the ``gpu`` tests in ``tests/gpu/test_fast_decode_gpu.py`` go through ``Engine.load``.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest
import torch

from strata.engine import fast_path, synth
from strata.engine.errors import EngineError
from strata.engine.experts.cache import ExpertCache
from strata.engine.experts.slots import SlotTagMismatch, Tag
from strata.engine.fast_path import fast_path_unavailable
from strata.engine.gguf_index import GGUFIndex
from strata.engine.options import EngineOptions
from strata.engine.params import SamplingParams
from strata.engine.quant import REPACKED_TYPES
from strata.engine.sampling import Sampler
from strata.engine.sequences import Sequences

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed")
from fastpath import PROMPT, cpu_share_tol, decode, fast_runner, reference_runner

Q = gguf.GGMLQuantizationType
MiB = 2**20
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = 1e-5  # max |fast - reference| / max |reference| of one step's logits


@pytest.fixture(scope="module")
def q8(tiny_models) -> Path:
    return tiny_models.path("qwen3moe", "Q8_0")


@pytest.mark.parametrize(("model", "kind"), [("qwen3moe", "Q8_0"), ("mixtral", "F16")])
def test_fast_steps_agree_with_the_reference_path(tiny_models, model: str, kind: str) -> None:
    path = tiny_models.path(model, kind)
    ref, fast = decode(reference_runner(path), 3, 11), decode(fast_runner(path), 3, 11)
    assert torch.equal(ref[0].cpu(), fast[0].cpu()), "the prompt takes the reference path"
    for a, b in zip(ref[1:], fast[1:], strict=True):
        err = float((a - b).abs().max() / a.abs().max())
        assert err < TOL, f"step logits differ by {err:.2e} (relative to the largest)"
        top2 = torch.topk(a, 2).values
        if float(top2[0] - top2[1]) > 2 * TOL * float(a.abs().max()):
            assert int(a.argmax()) == int(b.argmax())


def test_residency_never_changes_the_numbers(q8: Path) -> None:
    # every expert staged as a miss, half cached, all cached (the same kernels read them all)
    none, half, every = (decode(fast_runner(q8, s), 3, 23) for s in (None, 0.5, 1.0))
    for a, b, c in zip(none[1:], half[1:], every[1:], strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_a_shrink_and_a_grow_mid_generation_keep_the_numbers(q8: Path) -> None:
    steady = decode(fast_runner(q8, 1.0), 4, 5)
    runner = fast_runner(q8, 1.0)
    cache = runner.gpu.provider
    assert isinstance(cache, ExpertCache) and runner.decodes_on_gpu
    runner.rewind(0)
    got = [runner.feed(PROMPT)]
    tok = 5
    for i in range(4):
        got.append(runner.feed([tok]).cpu())
        tok = (tok * 31 + 7) % 500
        if i == 0:
            cache.resize(cache.sizes.core_slots)  # down to the core: most experts now miss
            assert not runner.gpu.tables.plan.complete
        if i == 2:
            cache.resize(cache.max_slots)
            assert runner.gpu.tables.plan.complete
    for a, b in zip(steady[1:], got[1:], strict=True):
        assert torch.equal(a, b)


def test_exchanges_with_ram_homes_mid_generation_keep_the_numbers(q8: Path) -> None:
    steady = decode(fast_runner(q8, 1.0), 4, 5)
    runner = fast_runner(q8, 0.5, host=True)
    cache, dec = runner.gpu.provider, runner.gpu
    assert isinstance(cache, ExpertCache) and dec is not None and dec.tables.plan.complete
    dec.adapt_swaps = 4
    runner.rewind(0)
    got = [runner.feed(PROMPT)]
    tok = 5
    for i in range(4):
        got.append(runner.feed([tok]).cpu())
        tok = (tok * 31 + 7) % 500
        if i == 0:  # three RAM-homed experts turn hot: they take cold tail slots
            hot = sorted(cache.tier.table.cached_keys())[:3]
            cache.usage.record_counts(dict.fromkeys(hot, 1000))
            assert 3 <= dec.adapt() <= 4  # and used ones beat never-used tail experts
        if i == 1:  # landed by the step after (on a GPU their copies ran beside it)
            assert not cache.exchanging and set(hot) <= cache.table.cached_keys()
            assert dec.tables.plan.complete
    for a, b in zip(steady[1:], got[1:], strict=True):
        assert torch.equal(a, b)


def test_copies_ahead_from_ram_homes_keep_the_numbers_and_are_counted(q8: Path) -> None:
    plain = fast_runner(q8, 0.5, host=True)
    ahead = fast_runner(q8, 0.5, host=True, prefetch=4)
    dec = ahead.gpu
    assert dec is not None and dec.prefetching and dec.tables.host_count > 0
    a, b = decode(plain, 4, 9), decode(ahead, 4, 9)
    for x, y in zip(a[1:], b[1:], strict=True):
        assert torch.equal(x, y)
    ahead.flush_usage()
    stats, L = ahead.gpu.provider.stats, dec.model.shape.n_layer
    # each layer copies at most 4 ahead a step; the routing chose some of them (the residual
    # stream before a layer's attention predicts its experts)
    assert 0 < stats.prefetch_used <= stats.prefetched <= 4 * L * 4
    unused = stats.prefetched - stats.prefetch_used
    assert stats.bytes_prefetched_unused == unused * dec.geometry.expert_bytes[0]
    assert plain.gpu.provider.stats.prefetched == 0


def test_copies_ahead_stop_when_no_expert_is_in_ram(q8: Path) -> None:
    runner = fast_runner(q8, 1.0, host=True, prefetch=2)
    dec = runner.gpu
    assert dec is not None and dec.tables.host_count == 0 and not dec.prefetching
    decode(runner, 2, 9)
    runner.flush_usage()
    assert runner.gpu.provider.stats.prefetched == 0
    cache = runner.gpu.provider
    cache.resize(cache.sizes.core_slots)  # the evicted experts go to RAM homes: copies start
    assert dec.prefetching
    decode(runner, 2, 9)
    runner.flush_usage()
    assert cache.stats.prefetched > 0


def _cpu_or_skip(runner: Sequences) -> None:
    dec = runner.gpu
    assert dec is not None
    if not dec.cpu.on:
        pytest.skip(f"the CPU expert kernels cannot run here: {dec.cpu.reason}")


@pytest.mark.parametrize(("kind", "share"), [("F16", 0.5), ("Q4_K_M", 1.0)])
def test_the_cpus_share_of_the_ram_experts_keeps_the_numbers_and_is_counted(
    tiny_models, kind: str, share: float
) -> None:
    """The same logits to float rounding (F16's float kernels); where the CPU's kernels read
    their input as int8 (Q4_K_M's Q4_K and Q6_K on x86), to that rounding's
    (``fastpath.cpu_share_tol``)."""
    path = tiny_models.path("qwen3moe", kind)
    plain = fast_runner(path, 0.5, host=True)
    cpu = fast_runner(path, 0.5, host=True, cpu_share=share)
    _cpu_or_skip(cpu)
    tol = cpu_share_tol(cpu.gpu, 1e-5)
    # the decode path says so (Q4_K_M on x86: "Q4_K, Q6_K with an int8 input")
    assert ("with an int8 input" in cpu.gpu.decode_path()) == (tol > 1e-5)
    dec = cpu.gpu
    assert dec.mode == "cpu" and dec.tables.host_count > 0
    steps = {}
    for name, runner in (("plain", plain), ("cpu", cpu)):
        runner.rewind(0)
        first = runner.feed(PROMPT).cpu()  # the reference path (it counts its own reads)
        runner.flush_usage()
        st = runner.gpu.provider.stats
        before = (st.hits, st.misses, st.bytes_from_ram, st.cpu_computed)
        out, tok = [first], 9
        for _ in range(4):
            out.append(runner.feed([tok]).cpu())
            tok = (tok * 31 + 7) % 500
        runner.flush_usage()
        after = (st.hits, st.misses, st.bytes_from_ram, st.cpu_computed)
        steps[name] = (out, [b - a for a, b in zip(before, after, strict=True)])
    (a, ref), (b, got) = steps["plain"], steps["cpu"]
    assert torch.equal(a[0], b[0])
    for x, y in zip(a[1:], b[1:], strict=True):  # the same sums, in another order
        err = float((x - y).abs().max() / x.abs().max())
        assert err < tol, f"step logits differ by {err:.2e}"
    # the same experts were chosen and read from RAM; the CPU computed its share of them
    assert got[:3] == ref[:3] and ref[3] == 0
    misses, computed = got[1], got[3]
    if share == 1.0:  # every chosen expert in RAM
        assert computed == misses > 0
    else:
        assert 0 < computed < misses
    st = cpu.gpu.provider.stats
    sizes = dec.geometry.expert_bytes  # per layer (Q4_K_M's layers differ: Q6_K downs in some)
    assert min(sizes) * st.cpu_computed <= st.bytes_cpu <= max(sizes) * st.cpu_computed


def test_the_cpus_share_starts_and_stops_with_the_experts_in_ram(q8: Path) -> None:
    runner = fast_runner(q8, 1.0, host=True, cpu_share=0.5)
    _cpu_or_skip(runner)
    dec = runner.gpu
    assert dec.tables.host_count == 0 and dec.mode == "plain"
    share = "; the CPU computes 50% of the chosen experts in RAM"
    assert share in dec.decode_path()
    assert dec.decode_path().endswith("(none is in RAM now: every expert has a VRAM slot)")
    decode(runner, 2, 9)
    runner.flush_usage()
    assert runner.gpu.provider.stats.cpu_computed == 0
    cache = runner.gpu.provider
    cache.resize(cache.sizes.core_slots)  # the evicted experts go to RAM homes: the CPU helps
    assert dec.mode == "cpu"
    assert share in dec.decode_path() and "none is in RAM now" not in dec.decode_path()
    steady = decode(fast_runner(q8, 1.0), 2, 9)
    tol = cpu_share_tol(dec, 1e-5)  # (Q8_0 on x86: the CPU reads an int8 input)
    for x, y in zip(steady[1:], decode(runner, 2, 9)[1:], strict=True):
        assert float((x - y).abs().max() / x.abs().max()) < tol
    runner.flush_usage()
    assert runner.gpu.provider.stats.cpu_computed > 0
    cache.resize(cache.max_slots)
    assert dec.mode == "plain"


def test_a_bad_cpu_share_is_refused_naming_it(q8: Path) -> None:
    runner = fast_runner(q8, 0.5, host=True)
    for bad in (-0.1, 1.5, "half", True):
        with pytest.raises(ValueError, match=f"cpu_share={bad!r}"):
            runner.gpu.set_cpu_share(bad, 2)  # type: ignore[arg-type]
    assert runner.gpu.cpu.cpu is None and runner.gpu.mode == "plain"


def test_the_cpus_share_and_the_copies_ahead_are_one_or_the_other(q8: Path) -> None:
    runner = fast_runner(q8, 0.5, host=True)
    both = EngineOptions(cpu_share=0.5, prefetch_experts=2, enforce_eager=True)
    with pytest.raises(EngineError, match=r"cpu_share=0\.5 and prefetch_experts=2"):
        fast_path.configure_gpu([runner.gpu], runner.model, both, lambda what: None)
    with pytest.raises(EngineError, match="cpu_share=2: must be a number between"):
        fast_path.configure_gpu(
            [runner.gpu], runner.model, EngineOptions(cpu_share=2), lambda what: None
        )


# what the CPU device does (tests/model/test_fast_decode_gpu.py times the share on a GPU)
OFF_A_GPU = pytest.mark.skipif(DEVICE.type == "cuda", reason="checks the CPU device's behaviour")


@OFF_A_GPU
def test_an_automatic_cpu_share_is_none_off_a_gpu_or_beside_the_copies_ahead(q8: Path) -> None:
    """``cpu_share`` unset is chosen by timing GPU steps; on the CPU device, and where copies
    ahead take the RAM experts, it is 0 (no pool, no thread), and no error."""
    runner = fast_runner(q8, 0.5, host=True)
    assert EngineOptions().cpu_share is None
    for options in (
        EngineOptions(enforce_eager=True),
        EngineOptions(enforce_eager=True, prefetch_experts=2),
    ):
        fast_path.configure_gpu([runner.gpu], runner.model, options, lambda what: None)
        assert runner.gpu.cpu.cpu is None and runner.gpu.cpu.share == 0
        assert runner.gpu.mode in ("plain", "ahead")


@OFF_A_GPU
def test_choosing_the_cpu_share_by_timing_needs_a_gpu(q8: Path) -> None:
    """Off a GPU (nothing to time against the link) the share stays as it was set."""
    runner = fast_runner(q8, 0.5, host=True, cpu_share=0.5)
    _cpu_or_skip(runner)
    assert runner.gpu.tune_cpu_share() == 0.5 and runner.gpu.cpu.tuned == {}
    assert runner.gpu.mode == "cpu"


def test_more_copies_ahead_than_experts_is_refused(q8: Path) -> None:
    runner = fast_runner(q8, 0.5, host=True)
    E = runner.model.shape.routing.n_expert
    with pytest.raises(ValueError, match=f"prefetch_experts={E + 1}: must be between 0 and"):
        runner.gpu.set_prefetch(E + 1)


def argmax_steps(runner: Sequences, first: int, n: int) -> list[int]:
    """n greedy successors of ``first``, one ``feed`` and argmax at a time."""
    out, tok = [], first
    for _ in range(n):
        tok = int(torch.argmax(runner.feed([tok])))
        out.append(tok)
    return out


def test_greedy_look_ahead_gives_the_tokens_of_step_by_step_decoding(q8: Path) -> None:
    runner = fast_runner(q8, 1.0)
    runner.rewind(0)
    first = int(torch.argmax(runner.feed(PROMPT)))
    want = argmax_steps(runner, first, 6)
    runner.rewind(len(PROMPT))
    assert runner.can_look_ahead()
    got = list(runner.greedy(first, 6))
    assert got == want
    # the last token yielded (the limit) was never fed: the cache holds the prompt and 6 tokens
    assert runner.tokens == [*PROMPT, first, *want[:5]]
    assert runner.kv.length == len(runner.tokens)
    # a caller that stops early leaves the step it ran ahead unfed too
    runner.rewind(len(PROMPT))
    steps = runner.greedy(first, 6)
    assert [next(steps), next(steps)] == want[:2]
    steps.close()
    assert runner.tokens == [*PROMPT, first, want[0]]


def test_sampled_look_ahead_gives_the_tokens_of_the_host_sampler(q8: Path) -> None:
    # the request's sampler runs after each step run ahead (on the device, the step's logits)
    # and on the host's steps alike: the same tokens and log-probabilities, bit for bit
    params = SamplingParams(max_tokens=6, temperature=0.7, top_k=40, top_p=0.95, min_p=0.05,
                            repeat_penalty=1.1, seed=11, logprobs=2)  # fmt: skip
    runner = fast_runner(q8, 1.0)
    runner.rewind(0)
    host = Sampler(params, PROMPT)
    first, _ = host.choose(runner.feed(PROMPT))
    want = [host.choose(runner.feed([tok]))[0] for tok in [first]]
    for _ in range(4):
        want.append(host.choose(runner.feed([want[-1]]))[0])
    runner.rewind(len(PROMPT))
    ahead = Sampler(params, PROMPT)
    assert ahead.choose(runner.feed(PROMPT))[0] == first
    got = list(runner.ahead(first, 5, sampler=ahead))
    assert [t for t, _ in got] == want
    assert all(e is not None and e.token == t and len(e.top) == 2 for t, e in got)
    assert ahead.state is not None and host.state is not None
    assert torch.equal(ahead.state.recent, host.state.recent)
    assert int(ahead.state.draws) == int(host.state.draws) == 6
    assert not runner.gpu.sampled.bound  # the run let the request's state go


def test_a_conversation_in_other_pages_and_one_resumed_give_the_same_bits(q8: Path) -> None:
    # the decode kernels read the K/V through the block table: a sequence whose page is not
    # the first free one (another conversation is kept below it), and one resumed from a kept
    # prefix, compute the same bits as a cold run
    cold = fast_runner(q8, 1.0)
    want = decode(cold, 4, 13)
    runner = fast_runner(q8, 1.0)
    runner.start([7, 7, 7])
    runner.feed([7, 7, 7])
    assert runner.start(PROMPT) == PROMPT
    logits = [runner.feed(PROMPT)]
    assert runner.kv.book.active.pages != cold.kv.book.active.pages
    tok = 13
    for _ in range(4):
        logits.append(runner.feed([tok]).cpu())
        tok = (tok * 31 + 7) % 500
    for a, b in zip(want, logits, strict=True):
        assert torch.equal(a.cpu(), b.cpu())
    # resumed after another conversation (the pages run short: the oldest kept one goes)
    seq = list(runner.tokens)
    runner.start([9, 9])
    runner.feed([9, 9])
    todo = runner.start([*seq, tok])
    assert todo == [tok] and runner.kv.book.kept
    assert torch.equal(runner.feed(todo).cpu(), cold.feed([tok]).cpu())
    runner.kv.book.check()


def test_look_ahead_hands_back_when_a_shrink_leaves_a_miss(q8: Path) -> None:
    runner = fast_runner(q8, 1.0)
    cache = runner.gpu.provider
    assert isinstance(cache, ExpertCache)
    runner.rewind(0)
    first = int(torch.argmax(runner.feed(PROMPT)))
    want = argmax_steps(runner, first, 6)
    runner.rewind(len(PROMPT))
    calls = 0

    def shrink() -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            cache.resize(cache.sizes.core_slots)

    got = list(runner.greedy(first, 6, shrink))
    assert len(got) == 3  # steps 1 and 2 were running when the shrink came; then it stopped
    assert not runner.can_look_ahead()
    got += argmax_steps(runner, got[-1], 3)  # on by feed, staging the misses
    assert got == want


def test_expert_uses_counted_on_the_device_reach_the_provider(q8: Path) -> None:
    runner = fast_runner(q8, 1.0)
    decoder = runner.gpu
    assert decoder is not None
    totals = runner.gpu.provider.totals
    runner.rewind(0)
    runner.feed(PROMPT)  # the reference path records what it fetches itself
    before = sum(totals.values())
    for tok in (3, 9, 27):
        runner.feed([tok])
    assert sum(totals.values()) == before  # counted on the device so far
    runner.flush_usage()
    shape = runner.model.shape
    assert sum(totals.values()) - before == 3 * shape.n_layer * shape.routing.n_used
    assert int(decoder.counters.steps.sum()) == 0
    s = runner.gpu.provider.stats
    assert s.misses == 0 and s.hit_rate == 1.0


def test_a_tag_mismatch_behind_the_tables_is_an_error_naming_the_expert(q8: Path) -> None:
    runner = fast_runner(q8, 1.0)
    cache = runner.gpu.provider
    decoder = runner.gpu
    assert isinstance(cache, ExpertCache) and decoder is not None
    slot = cache.table.slot_of((2, 3))
    cache.table._tags[slot] = Tag(2, 4, 999)
    with pytest.raises(SlotTagMismatch, match=r"\(layer 2, expert 3\)"):
        decoder.rebuild_table()


def test_a_position_beyond_the_context_is_refused(q8: Path) -> None:
    runner = fast_runner(q8)
    assert runner.gpu is not None
    with pytest.raises(ValueError, match="position 64 is outside the context of 64"):
        runner.gpu.step(3, 64)


# -- the choice of path ------------------------------------------------------------------------


def write(tmp_path: Path, name: str, spec: synth.ModelSpec, plan: synth.TypePlan) -> GGUFIndex:
    path = synth.write_model(tmp_path / f"{name}.gguf", spec, synth.vocab_for(spec.arch), plan, 0)
    return GGUFIndex(path)


def test_the_fast_path_is_chosen_only_where_it_can_serve(q8: Path, tmp_path: Path, monkeypatch):
    index = GGUFIndex(q8)
    cuda = torch.device("cuda", 0)
    assert fast_path_unavailable(index, torch.device("cpu"), EngineOptions()) == (
        "the compute device is the CPU"
    )
    off = EngineOptions(fast_decode=False)
    assert fast_path_unavailable(index, cuda, off) == "fast_decode is off"
    spec = synth.PRESETS["tiny-qwen3moe"]
    q5 = write(tmp_path, "q5", spec, replace(synth.TypePlan.uniform(Q.F32), experts_down=Q.Q5_K))
    assert fast_path_unavailable(q5, cuda, EngineOptions()) is None
    # every type the engine reads has a decode kernel now: pretend one had none
    monkeypatch.setattr(fast_path, "REPACKED_TYPES", REPACKED_TYPES - {Q.Q5_K})
    assert fast_path_unavailable(q5, cuda, EngineOptions()) == (
        "expert tensors of type Q5_K have no decode kernel yet"
    )
    monkeypatch.undo()
    odd = write(tmp_path, "odd", replace(spec, n_layer=1, head_dim=48), synth.TypePlan())
    assert fast_path_unavailable(odd, cuda, EngineOptions()) == (
        "the head dimension 48 is not a power of two"
    )
    import strata.engine.kernels as kernels

    monkeypatch.setattr(kernels, "unavailable", lambda: "Triton is unavailable (no backend)")
    reason = fast_path_unavailable(index, cuda, EngineOptions())
    assert reason == "Triton is unavailable (no backend)"
    monkeypatch.undo()
    assert fast_path_unavailable(index, cuda, EngineOptions()) is None


def test_the_next_request_of_a_sampler_shape_reuses_its_state_and_draws_its_own(q8: Path) -> None:
    # the GPU runner keeps a sampler's graph and state by shape: a second request of the same
    # shape loads its own seed and window into that state and draws what it would alone
    params = SamplingParams(max_tokens=3, temperature=0.9, top_k=20, seed=21, logprobs=1)
    other = replace(params, seed=22)
    runner = fast_runner(q8, 1.0)

    def run(p: SamplingParams) -> tuple[list[int], Sampler]:
        runner.rewind(0)
        s = Sampler(p, PROMPT)
        first, _ = s.choose(runner.feed(PROMPT))
        return [first, *(t for t, _ in runner.ahead(first, 2, sampler=s))], s

    alone, _ = run(other)
    _, s2 = run(params)
    again, s3 = run(other)
    assert again == alone
    if runner.gpu.sampled.kept:  # (a GPU with graphs: the interpreter runs them eagerly)
        assert s3.state is s2.state


class _Runner:
    """What ``time_cpu_share`` asks of a GPU runner, recording what it was told. ``tuned``: an
    earlier timing's results (a pool off with them was timed to 0; off without, refused)."""

    def __init__(self, in_ram: int, pool: bool, tuned: bool = False) -> None:
        self.device = torch.device("cuda")  # (a device object: nothing runs on it)
        self.tables = SimpleNamespace(host_count=in_ram)
        self.cpu = SimpleNamespace(on=pool, tuned={0.0: 1.0} if tuned else {})
        self.calls: list[tuple] = []

    def on(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def set_cpu_share(self, share: float, threads: int) -> None:
        self.calls.append(("set", share, threads))
        self.cpu.on = True

    def capture(self) -> None:
        self.calls.append(("capture",))

    def tune_cpu_share(self) -> None:
        self.calls.append(("tune",))


def test_the_automatic_cpu_share_is_timed_again_for_the_experts_in_ram_now() -> None:
    """After a resize (the bench's budgets) an automatic share is timed for what is in RAM now:
    a pool turned off by an earlier timing starts again, with the CPU mode's graph, before the
    timing; a share the options fix, copies ahead, nothing in RAM, a CPU runner or a pool the
    machine refused: nothing (and no word of a timing)."""
    auto = EngineOptions(threads=3)
    said: list[str] = []
    r = _Runner(in_ram=10, pool=True)
    fast_path.time_cpu_share([r], auto, said.append)
    assert r.calls == [("tune",)] and said == ["timing the CPU's share of the experts in RAM"]
    r = _Runner(in_ram=10, pool=False, tuned=True)
    fast_path.time_cpu_share([r], auto)
    assert r.calls == [("set", fast_path.AUTO_CPU_SHARE_START, 3), ("capture",), ("tune",)]
    r = _Runner(in_ram=10, pool=False, tuned=True)
    fast_path.time_cpu_share([r], replace(auto, enforce_eager=True))
    assert r.calls == [("set", fast_path.AUTO_CPU_SHARE_START, 3), ("tune",)]
    said.clear()
    for options, runner in [
        (replace(auto, cpu_share=0.25), _Runner(10, True)),
        (replace(auto, cpu_share=None, prefetch_experts=2), _Runner(10, True)),
        (auto, _Runner(0, True)),
        (auto, _Runner(10, False)),  # refused here (no C compiler): not asked again
    ]:
        fast_path.time_cpu_share([runner], options, said.append)
        assert runner.calls == []
    cpu_runner = _Runner(10, True)
    cpu_runner.device = torch.device("cpu")
    fast_path.time_cpu_share([cpu_runner], auto, said.append)
    assert cpu_runner.calls == [] and said == []
