"""The growing K/V on the host arena: it maps chunks as a conversation needs pages and unmaps
them once they are free; it shares one budget with the expert cache (whose tail yields, down
to its core); kept conversations are reused by a request that extends them. Greedy output is
the same as with a K/V mapped for the whole context at load."""

from __future__ import annotations

from pathlib import Path

import pytest

from strata.engine.errors import ContextOverflow
from strata.engine.generate import Engine
from strata.engine.generation import GenerationResult
from strata.engine.kvbook import pages_for
from strata.engine.options import EngineOptions
from strata.engine.params import SamplingParams
from strata.vmm.arena import ElasticArena, create_arena

MiB = 2**20
CHUNK_MIB = 1  # the tiny model's K/V page is 256 KiB: four pages (256 positions) a chunk
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def path(tiny_models) -> Path:
    return tiny_models.path("qwen3moe", "F16")


def load(path: Path, **options) -> Engine:
    base = dict(kv_cache_type="f32", context_length=1024, arena_chunk_mib=CHUNK_MIB,
                host_budget_mib=0, cache_mib=0)  # fmt: skip
    return Engine.load(path, EngineOptions(**{**base, **options}))


def words(engine: Engine, n: int, seed: int = 0) -> list[int]:
    """``n`` ordinary token ids (never an end token), the same for every engine."""
    eog = engine.tokenizer.eog_ids
    ids = [t for t in range(3, engine.tokenizer.vocab_size) if t not in eog]
    return [ids[(seed * 7919 + i * 131) % len(ids)] for i in range(n)]


def in_budget(engine: Engine) -> None:
    """The cache and the K/V together never hold more than the budget."""
    r = engine.sequences
    cache = engine.cache
    held = (cache.arena.mapped_bytes if cache else 0) + r.kv.mapped_bytes
    assert r.budget is None or held <= r.budget, f"{held} bytes held, budget {r.budget}"
    r.kv.book.check()


def gen(engine: Engine, prompt: list[int], params: SamplingParams = GREEDY) -> GenerationResult:
    return engine.generate(prompt, params, safe_point=lambda: in_budget(engine))


def test_the_kv_grows_for_a_long_prompt_and_trims_after_a_short_one(path: Path) -> None:
    fixed = load(path, kv_fixed=True)
    grow = load(path, kv_keep_conversations=0)
    try:
        kv = grow.sequences.kv
        first = kv.mapped_bytes
        assert first == CHUNK_MIB * MiB and fixed.sequences.kv.mapped_bytes > 4 * first
        long = words(grow, 700)
        a, b = gen(fixed, long), gen(grow, long)
        assert a.tokens == b.tokens and len(a.tokens) == GREEDY.max_tokens
        held = pages_for(700 + GREEDY.max_tokens - 1, kv.page) + 1  # and the sink
        assert kv.mapped_bytes == kv.book.bytes_for(held)  # grown chunk by chunk, no more
        short = words(grow, 20, seed=1)
        a, b = gen(fixed, short), gen(grow, short)
        assert a.tokens == b.tokens
        assert kv.mapped_bytes == first, "the long conversation's pages were unmapped"
        again = words(grow, 900, seed=2)
        assert gen(fixed, again).tokens == gen(grow, again).tokens
        assert kv.mapped_bytes > 3 * first
    finally:
        fixed.close()
        grow.close()


def second_turn(warm: Engine, cold: Engine, n: int) -> list[int]:
    """A first turn of ``n`` tokens, then a second that extends it: only the new tokens (and
    the reply's last, sampled but never fed) are computed, and the output is a cold run's.
    Returns the second turn's prompt."""
    p1 = words(warm, n)
    r1 = gen(warm, p1)
    assert r1.cached_tokens == 0
    new = words(warm, 40, seed=3)
    p2 = p1 + r1.tokens + new
    r2 = gen(warm, p2)
    assert r2.cached_tokens == len(p1) + len(r1.tokens) - 1
    assert r2.prompt_tokens - r2.cached_tokens == len(new) + 1
    c2 = gen(cold, p2)
    assert c2.cached_tokens == 0 and c2.tokens == r2.tokens
    return p2


def test_a_second_turn_reuses_the_first_and_matches_a_cold_run(path: Path) -> None:
    warm, cold = load(path), load(path)
    try:
        second_turn(warm, cold, 300)
    finally:
        warm.close()
        cold.close()


def test_two_interleaved_conversations_both_reuse_their_prefixes(path: Path) -> None:
    e = load(path, kv_keep_conversations=2)
    try:
        a1, b1 = words(e, 130, seed=4), words(e, 150, seed=5)
        ra, rb = gen(e, a1), gen(e, b1)
        a2 = a1 + ra.tokens + words(e, 10, seed=6)
        b2 = b1 + rb.tokens + words(e, 12, seed=7)
        assert gen(e, a2).cached_tokens == len(a1) + len(ra.tokens) - 1
        assert gen(e, b2).cached_tokens == len(b1) + len(rb.tokens) - 1
        shared = e.sequences.kv.book
        assert len(shared.kept) == 2  # a's second turn and b's first (b's second is active)
    finally:
        e.close()


def test_the_kv_takes_room_from_the_cache_tail_within_one_budget(path: Path) -> None:
    e = load(path, cache_mib=16, elastic_tail_mib=12)
    try:
        cache, r = e.cache, e.sequences
        assert cache is not None and r.budget == cache.arena.mapped_bytes + r.kv.mapped_bytes
        budget, full = r.budget, cache.n_slots
        gen(e, words(e, 900))  # about 3.5 MiB of K/V: the tail yields
        assert cache.n_slots < full and r.kv.mapped_bytes > 3 * MiB
        in_budget(e)
        # a lease: the policy's budget drops by 8 MiB, the cache gives it
        cache.resize(e.set_budget(budget - 8 * MiB))
        in_budget(e)
        assert cache.n_slots >= cache.sizes.core_slots
        # grows again while the lease holds its room: the first conversation, kept, goes first
        gen(e, words(e, 700, seed=8))
        assert not r.kv.book.kept
        in_budget(e)
        # the lease returns: the freed room refills the tail
        before = cache.n_slots
        cache.resize(e.set_budget(budget))
        assert cache.n_slots > before
        in_budget(e)
    finally:
        e.close()


def test_an_automatic_budget_keeps_the_free_room_for_the_kv_before_the_cache_yields(
    path: Path,
) -> None:
    """With every expert cached and VRAM left over, the K/V grows into that room: no expert
    leaves. The budget stops at what every expert and the whole context need; a cache the
    memory limits gets no extra room."""
    probe = load(path, cache_mib=1024)
    try:
        experts = probe.cache.mapped_bytes_for(probe.cache.max_slots)
        kv_max = probe.sequences.kv.arena.reserved_bytes
    finally:
        probe.close()

    def auto(free: int) -> Engine:
        """An engine on a simulated card with ``free`` bytes free before its K/V and cache:
        the free reading drops as their arenas map."""
        arenas: list[ElasticArena] = []

        def arena(reserved: int, chunk: int) -> ElasticArena:
            arenas.append(create_arena("host", reserved, chunk))
            return arenas[-1]

        options = EngineOptions(kv_cache_type="f32", context_length=1024, arena_chunk_mib=CHUNK_MIB,
                                host_budget_mib=0, cache_mib=None, reserve_mib=2)  # fmt: skip
        return Engine.load(
            path,
            options,
            arena_factory=arena,
            free_vram=lambda: free - sum(a.mapped_bytes for a in arenas),
        )

    kv_at_load = CHUNK_MIB * MiB
    roomy = auto(kv_at_load + experts + 8 * MiB + 2 * MiB)
    huge = auto(kv_at_load + experts + kv_max + 64 * MiB)
    tight = auto(kv_at_load + experts // 2 + 2 * MiB)
    try:
        cache, r = roomy.cache, roomy.sequences
        assert cache.n_slots == cache.max_slots
        assert r.budget == experts + kv_at_load + 8 * MiB, "the free room, less the reserve"
        gen(roomy, words(roomy, 900))  # about 3.5 MiB of K/V
        assert r.kv.mapped_bytes > 3 * MiB and cache.n_slots == cache.max_slots
        in_budget(roomy)
        assert huge.sequences.budget == experts + kv_max, "never more than the model can use"
        c = tight.cache
        assert c.n_slots < c.max_slots
        assert tight.sequences.budget == c.arena.mapped_bytes + tight.sequences.kv.mapped_bytes
    finally:
        roomy.close()
        huge.close()
        tight.close()


def test_between_requests_a_budget_cut_takes_the_last_conversations_pages_too(
    path: Path,
) -> None:
    """A lease that comes after a long request must not wait for the next one: the finished
    conversation's pages are no longer the active sequence's floor, and go after the kept ones."""
    e, cold = load(path, cache_mib=16, elastic_tail_mib=12), load(path)
    try:
        cache, r = e.cache, e.sequences
        assert cache is not None and r.budget is not None
        budget, kv = r.budget, r.kv
        p1 = words(e, 900)
        r1 = gen(e, p1)
        assert kv.mapped_bytes > 3 * MiB and len(r.tokens) == len(p1) + len(r1.tokens) - 1
        assert kv.floor_bytes() == kv.chunk_bytes, "between requests only the sink stays for good"
        core = cache.mapped_bytes_for(cache.sizes.core_slots)
        cache.resize(e.set_budget(core + kv.chunk_bytes))  # a lease wants all but the core
        in_budget(e)
        assert kv.mapped_bytes == kv.chunk_bytes and cache.n_slots == cache.sizes.core_slots
        assert r.tokens == [] and not kv.book.kept
        cache.resize(e.set_budget(budget))  # the lease returns
        in_budget(e)
        p2 = p1 + r1.tokens + words(e, 10, seed=3)
        floors: list[int] = []
        r2 = e.generate(p2, GREEDY, safe_point=lambda: floors.append(kv.floor_bytes()))
        assert r2.cached_tokens == 0, "its pages went with the lease: the second turn recomputes"
        assert r2.tokens == gen(cold, p2).tokens
        # while a request runs its pages are the floor (a cut then waits for its end)
        assert min(floors) >= kv.book.bytes_for(pages_for(len(p2), kv.page) + 1)
        assert kv.floor_bytes() == kv.chunk_bytes
    finally:
        e.close()
        cold.close()


def test_a_prompt_beyond_the_budget_at_the_cache_core_is_refused_with_the_numbers(
    path: Path,
) -> None:
    e = load(path, cache_mib=16, elastic_tail_mib=12)
    try:
        cache, r = e.cache, e.sequences
        core = cache.mapped_bytes_for(cache.sizes.core_slots)
        cache.resize(e.set_budget(core + 2 * MiB))  # the K/V may hold two chunks at most
        fit = r.tokens_that_fit()
        assert fit == (2 * MiB // r.kv.page_bytes - 1) * r.kv.page
        with pytest.raises(ContextOverflow, match=rf"at most {fit - 1} prompt tokens fit"):
            e.check_fits(fit, 1)
        e.check_fits(fit - 1, 1)
        with pytest.raises(ContextOverflow, match="MiB of K/V"):
            e.generate(words(e, fit + 10), GREEDY)
        # a generation that reaches the budget's end stops there, as at a context's end
        out = gen(e, words(e, fit - 8), SamplingParams(max_tokens=64, temperature=0.0))
        assert out.finish_reason == "length" and len(out.tokens) < 64
        in_budget(e)
    finally:
        e.close()


def test_bad_kv_options_name_the_option(path: Path) -> None:
    from strata.engine.errors import EngineError

    with pytest.raises(EngineError, match="kv_keep_conversations=-1"):
        load(path, kv_keep_conversations=-1)
