"""A 64K-token prompt on the synthetic Qwen3-30B-A3B (Q4_K) on a 24 GiB card emulated on a
larger GPU (the cache and the K/V sized from ``24 GiB - used``, as ``strata.bench.
long_context`` does): its greedy output is the same when a lease of 8 GiB is taken and returned
during its prefill and again during its decode (the engine applying the budgets the policy would
give, at its safe points, as the daemon's worker does), and the cache and the K/V never hold
more than the budget.

On that card the 64K conversation's K/V (6 GiB) and the cache's core leave less than 8 GiB to
lend while the request runs: the policy never goes below that floor (docs/policy.md), so the
lease gets what is above it at once and the rest waits, and gets it as soon as the request
ends (its pages are no longer the floor). The model is written once into the cache directory
(minutes)."""

from __future__ import annotations

import time

import pytest

from strata import paths
from strata.bench.long_context import _engine, _prompt
from strata.engine.params import SamplingParams

pytestmark = pytest.mark.gpu
GiB = 2**30
CARD = 24 * GiB
PROMPT = 65536
LEASE = 8 * GiB


def test_a_64k_prompt_decodes_the_same_while_a_lease_comes_and_goes(cuda_device: int) -> None:
    from strata.engine.synth import ensure_synthetic

    model = ensure_synthetic("qwen3-30b-a3b-q4k", paths.cache_dir())
    e = _engine(model, CARD, PROMPT + 128)
    try:
        cache, runner = e.cache, e.sequences
        assert cache is not None and runner.budget is not None
        budget = runner.budget
        worst = [0]

        def held() -> None:
            now = cache.arena.mapped_bytes + runner.kv.mapped_bytes
            worst[0] = max(worst[0], now - (runner.budget or 0))
            assert now <= (runner.budget or 0), f"{now} bytes held, budget {runner.budget}"

        prompt = _prompt(e, PROMPT, 1)
        params = SamplingParams(max_tokens=32, temperature=0.0)
        t0 = time.monotonic()
        calm = e.generate(prompt, params, safe_point=held)
        print(f"\ncalm: {len(calm.tokens)} tokens, first after {calm.first_token_s:.1f} s "
              f"({time.monotonic() - t0:.0f} s in all); K/V {runner.kv.mapped_bytes / GiB:.2f} "
              f"GiB, cache {cache.arena.mapped_bytes / GiB:.2f} GiB of a "
              f"{budget / GiB:.2f} GiB budget")  # fmt: skip
        runner.rewind(0)  # the same prompt again, from nothing
        chunks = -(-PROMPT // runner.prefill_chunk)
        steps = [0]
        lease_at = {chunks // 4: -LEASE, chunks // 2: 0, chunks + 8: -LEASE, chunks + 20: 0}
        lent: list[int] = []

        def policy(want: int) -> int:
            """The budget the policy gives: never below the cache's core and the K/V's pages
            in use (the rest of the lease waits)."""
            core = cache.mapped_bytes_for(cache.sizes.core_slots)
            return max(want, core + runner.kv.floor_bytes())

        def apply(want: int, at: str) -> None:
            given = policy(want)
            cache.resize(e.set_budget(given))
            lent.append(budget - given)
            print(f"{at}: budget {given / GiB:.2f} GiB (asked {want / GiB:.2f}), cache "
                  f"{cache.arena.mapped_bytes / GiB:.2f} GiB, K/V "
                  f"{runner.kv.mapped_bytes / GiB:.2f} GiB")  # fmt: skip
            held()

        def safe_point() -> None:
            steps[0] += 1
            change = lease_at.get(steps[0])
            if change is not None:  # what the worker does with the policy's new budget
                apply(budget + change, f"step {steps[0]}")
            held()

        leased = e.generate(prompt, params, safe_point=safe_point)
        assert steps[0] > chunks + 20, "the lease came and went during the decode too"
        assert leased.tokens == calm.tokens
        assert runner.budget == budget and worst[0] <= 0
        assert lent[0] > 0 and lent[2] > 0, f"nothing was lent while the request ran: {lent}"
        # the request is over: what the lease still waited for is free now, all 8 GiB of it
        apply(budget - LEASE, "after the request")
        assert lent[-1] == LEASE
        apply(budget, "lease returned")
    finally:
        e.close()
