"""A 64K-token prompt on the synthetic Qwen3-30B-A3B (Q4_K) on a 24 GiB card emulated on a
larger GPU (the cache and the K/V sized from ``24 GiB - used``, as ``strata.engine.bench.
long_context`` does): its greedy output is the same when a lease of 8 GiB is taken and returned
during its prefill and again during its decode (the engine applying the budgets the policy would
give, at its safe points, as the daemon's worker does), and the cache and the K/V never hold
more than the budget. The model is written once into the cache directory (minutes)."""

from __future__ import annotations

import time

import pytest

from strata.daemon import paths
from strata.engine.bench.long_context import _engine, _prompt
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
        cache, runner = e.cache, e.runner
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

        def safe_point() -> None:
            steps[0] += 1
            change = lease_at.get(steps[0])
            if change is not None:  # what the worker does with the policy's new budget
                cache.resize(e.set_budget(budget + change))
                print(f"step {steps[0]}: budget {(budget + change) / GiB:.2f} GiB, cache "
                      f"{cache.arena.mapped_bytes / GiB:.2f} GiB, K/V "
                      f"{runner.kv.mapped_bytes / GiB:.2f} GiB")  # fmt: skip
            held()

        leased = e.generate(prompt, params, safe_point=safe_point)
        assert steps[0] > chunks + 20, "the lease came and went during the decode too"
        assert leased.tokens == calm.tokens
        assert runner.budget == budget and worst[0] <= 0
    finally:
        e.close()
