"""Long contexts on a GPU: the growing K/V beside a fixed one, on a card of a chosen size.

    python -m strata.bench.long_context --synthetic qwen3-30b-a3b-q4k --card-gib 24

The card is emulated on a larger GPU: the cache and the K/V are sized from ``card - used``
(``torch.cuda.mem_get_info``: everything allocated on the device, the VMM arenas included)
instead of the device's free memory, and their budget stays there. Reports, as one JSON object:

* ``ttft``: time to the first token of a ``--prompt`` token prompt, cold, and of its second turn
  (the first turn's reply and ``--turn`` new tokens after it: the prefix is reused), with the
  prompt tokens each computed (``cached_tokens``);
* ``decode``: greedy decode tokens per second after a prompt of each ``--decode-at`` length,
  once the cache has settled (``tok_s``: the prompt's second run) and right after the previous
  measurement (``first_tok_s``: the cache may still be refilling);
* ``experts``: experts the cache holds with a ``--long`` token context, at load and after a
  ``--decode-at``'s first prompt, for the growing K/V and for a fixed one (``kv_fixed``).

A developer's tool beside ``strata bench``: its numbers go into the closing notes as measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

GiB = 2**30


def _engine(path: Path, card: int, n_ctx: int, fixed: bool = False) -> Any:
    from strata.engine.generate import Engine
    from strata.engine.options import EngineOptions

    def free() -> int:
        have, total = torch.cuda.mem_get_info()
        return max(0, card - (total - have))

    options = EngineOptions(
        device="cuda:0", cache_mib=None, context_length=n_ctx, kv_fixed=fixed, reserve_mib=1024
    )
    return Engine.load(path, options, free_vram=free)


def _prompt(engine: Any, n: int, seed: int) -> list[int]:
    eog = engine.tokenizer.eog_ids
    ids = [t for t in range(3, engine.tokenizer.vocab_size) if t not in eog]
    return [ids[(seed * 7919 + i * 131) % len(ids)] for i in range(n)]


def _sizes(engine: Any) -> dict[str, Any]:
    cache, kv = engine.cache, engine.sequences.kv
    return {
        "cache_mib": cache.arena.mapped_bytes // 2**20 if cache else 0,
        "cache_experts": cache.cached_experts if cache else 0,
        "kv_mib": kv.mapped_bytes // 2**20,
        "budget_mib": (engine.sequences.budget or 0) // 2**20,
    }


def ttft(engine: Any, n: int, turn: int) -> dict[str, Any]:
    from strata.engine.params import SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0)
    first = _prompt(engine, n, 1)
    r1 = engine.generate(first, params)
    second = first + r1.tokens + _prompt(engine, turn, 2)
    r2 = engine.generate(second, params)
    return {
        "prompt_tokens": n,
        "cold_s": r1.first_token_s,
        "cold_computed": r1.prompt_tokens - r1.cached_tokens,
        "second_turn_tokens": len(second),
        "second_turn_s": r2.first_token_s,
        "second_turn_computed": r2.prompt_tokens - r2.cached_tokens,
        "second_turn_cached": r2.cached_tokens,
        **_sizes(engine),
    }


def decode(engine: Any, at: int, steps: int) -> dict[str, Any]:
    """Greedy decode after an ``at``-token prompt, twice: ``first_tok_s`` just after the
    previous measurement (the cache may still be refilling what a longer K/V took from it, a
    piece per step), ``tok_s`` the same prompt again (its prefix reused), with the cache as it
    settled: the speed of that context. ``cache_experts_before`` is the second run's start."""
    from strata.engine.params import SamplingParams

    params = SamplingParams(max_tokens=steps, temperature=0.0)
    prompt = _prompt(engine, at, 3 + at)
    first = engine.generate(prompt, params)
    before = _sizes(engine)["cache_experts"]
    again = engine.generate(prompt, params)
    return {
        "context": at, "tokens": len(again.tokens), "tok_s": again.decode_tok_s,
        "first_tok_s": first.decode_tok_s, "cache_experts_before": before, **_sizes(engine),
    }  # fmt: skip


def experts(path: Path, card: int, long: int, at: int) -> dict[str, Any]:
    from strata.engine.params import SamplingParams

    out: dict[str, Any] = {"context": long}
    for name, fixed in (("growing", False), ("fixed", True)):
        e = _engine(path, card, long, fixed)
        try:
            row: dict[str, Any] = {"at_load": _sizes(e)}
            e.generate(_prompt(e, at, 9), SamplingParams(max_tokens=4, temperature=0.0))
            row[f"after_{at}"] = _sizes(e)
        finally:
            e.close()
            torch.cuda.empty_cache()
        out[name] = row
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--synthetic", default="qwen3-30b-a3b-q4k", help="a synthetic preset")
    p.add_argument("--model", help="a GGUF file instead of a synthetic preset")
    p.add_argument("--card-gib", type=float, default=24.0, help="the card to emulate")
    p.add_argument("--prompt", type=int, default=32768, help="tokens of the TTFT prompt")
    p.add_argument("--turn", type=int, default=64, help="new tokens of its second turn")
    p.add_argument("--decode-at", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--steps", type=int, default=128, help="decode steps per measurement")
    p.add_argument("--long", type=int, default=131072, help="the context of the experts test")
    p.add_argument("--json", metavar="OUT", help="also write the results here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("long_context: needs a CUDA device", file=sys.stderr)
        return 2
    if args.model:
        path = Path(args.model)
    else:
        from strata import paths
        from strata.bench.settings import ensure_synthetic

        path = ensure_synthetic(args.synthetic, paths.cache_dir())
    card = int(args.card_gib * GiB)
    need = max(args.prompt + args.turn + 64, *args.decode_at) + args.steps + 64
    t0 = time.monotonic()
    result: dict[str, Any] = {"model": path.name, "card_gib": args.card_gib}
    e = _engine(path, card, need)
    result["load_s"] = time.monotonic() - t0
    try:
        result["ttft"] = ttft(e, args.prompt, args.turn)
        result["decode"] = [decode(e, at, args.steps) for at in args.decode_at]
    finally:
        e.close()
        torch.cuda.empty_cache()
    result["experts"] = experts(path, card, args.long, min(args.decode_at))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
