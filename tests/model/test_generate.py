"""Generation: stop strings, streaming, cancellation at safe points, context limits."""

from __future__ import annotations

import pytest

from strata.engine.errors import ContextOverflow, EngineError, ModelLoadError
from strata.engine.generate import Engine
from strata.engine.generation import _StopMatcher
from strata.engine.options import EngineOptions
from strata.engine.params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def engine(tiny_models) -> Engine:
    path = tiny_models.path("qwen3moe", "F32")
    return Engine.load(path, EngineOptions(kv_cache_type="f32", context_length=256))


@pytest.fixture(scope="module")
def prompt(engine: Engine) -> list[int]:
    return engine.encode_prompt("The lighthouse keeper wrote in his log that")


def test_streamed_text_joins_to_the_result(engine: Engine, prompt: list[int]) -> None:
    pieces: list[str] = []
    result = engine.generate(prompt, GREEDY, on_text=pieces.append)
    assert "".join(pieces) == result.text
    assert result.finish_reason == "length" and result.completion_tokens == 24
    # generation drops invalid UTF-8 (random byte tokens) where decode() writes U+FFFD
    decoded = engine.tokenizer.decode(result.tokens, skip_special=True, continuation=True)
    assert result.text == decoded.replace("\ufffd", "")


def test_stop_string_cuts_the_text_and_finishes_with_stop(
    engine: Engine, prompt: list[int]
) -> None:
    full = engine.generate(prompt, GREEDY).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    pieces: list[str] = []
    params = SamplingParams(max_tokens=24, temperature=0.0, stop=(stop,))
    result = engine.generate(prompt, params, on_text=pieces.append)
    assert result.finish_reason == "stop"
    assert result.text == full[: full.index(stop)]
    assert "".join(pieces) == result.text, "no streamed text past the stop string"


def test_stop_matcher_holds_back_a_possible_prefix() -> None:
    m = _StopMatcher(["</end>"])
    assert m.push("hello </") == ("hello ", False)
    assert m.push("en") == ("", False)
    assert m.push("d> tail") == ("", True)
    m = _StopMatcher(["ab"])
    assert m.push("xa") == ("x", False)
    assert m.push("c") == ("ac", False)
    assert m.flush() == ""


def test_cancellation_stops_at_the_next_safe_point(engine: Engine, prompt: list[int]) -> None:
    steps = []

    def cancelled() -> bool:
        return len(steps) >= 5

    result = engine.generate(
        prompt, SamplingParams(max_tokens=50, temperature=0.0), cancelled=cancelled,
        safe_point=lambda: steps.append(1),
    )  # fmt: skip
    assert result.finish_reason == "cancelled"
    assert result.completion_tokens < 10
    assert len(steps) >= 5


def test_safe_point_runs_between_prefill_chunks_and_decode_steps(tiny_models) -> None:
    path = tiny_models.path("qwen3moe", "F32")
    e = Engine.load(path, EngineOptions(kv_cache_type="f32", prefill_chunk_tokens=4))
    prompt = e.encode_prompt("one two three four five six seven eight nine ten eleven")
    points: list[int] = []
    e.generate(
        prompt, SamplingParams(max_tokens=6, temperature=0), safe_point=lambda: points.append(1)
    )
    prefill_chunks = -(-len(prompt) // 4)
    assert len(points) == prefill_chunks + 5  # the 6th token needs no further step


def test_a_long_prompt_is_cancelled_between_its_chunks_and_keeps_them(tiny_models) -> None:
    path = tiny_models.path("qwen3moe", "F32")
    e = Engine.load(path, EngineOptions(kv_cache_type="f32", prefill_chunk_tokens=4))
    prompt = e.encode_prompt("one two three four five six seven eight nine ten eleven twelve")
    assert len(prompt) > 12
    points: list[int] = []
    result = e.generate(
        prompt, GREEDY, cancelled=lambda: len(points) >= 2, safe_point=lambda: points.append(1)
    )
    assert result.finish_reason == "cancelled" and result.tokens == []
    assert len(points) == 2, "cancelled at the second chunk's boundary, not after the prompt"
    assert e.sequences.tokens == prompt[:8]  # the two chunks fed stay in the K/V
    assert e.sequences.start(prompt) == prompt[8:]  # and a retry feeds only the rest
    again = e.generate(prompt, GREEDY)
    e.sequences.rewind(0)
    assert again.tokens == e.generate(prompt, GREEDY).tokens


def test_prompt_plus_max_tokens_beyond_the_context_names_both(engine: Engine) -> None:
    prompt = engine.encode_prompt("word " * 200)
    with pytest.raises(ContextOverflow, match=rf"prompt of {len(prompt)} tokens \+ max_tokens 100"):
        engine.generate(prompt, SamplingParams(max_tokens=100))


def test_empty_prompt_is_an_error(engine: Engine) -> None:
    with pytest.raises(EngineError, match="empty"):
        engine.generate([], GREEDY)


def test_a_second_prompt_sharing_a_prefix_gives_the_same_answer(
    engine: Engine, prompt: list[int]
) -> None:
    first = engine.generate(prompt, GREEDY).tokens
    engine.generate(prompt[:3], SamplingParams(max_tokens=3, temperature=0.0))
    again = engine.generate(prompt, GREEDY).tokens  # reuses the cached prefix
    assert again == first


def test_demo_model_answers_at_least_32_tokens_before_any_end_token(tmp_path) -> None:
    from strata.engine.demo import ensure_demo_model

    e = Engine.load(ensure_demo_model(tmp_path), EngineOptions())
    prompt = e.encode_chat([{"role": "user", "content": "Hello! Who are you?"}])
    result = e.generate(prompt, SamplingParams(max_tokens=48, temperature=0.0))
    assert result.finish_reason == "length" and result.completion_tokens == 48


def test_demo_model_ends_its_answers_within_a_few_hundred_tokens(tmp_path) -> None:
    """Greedy, without max_tokens: an end token, neither too soon (a prompt ending in ASCII runs
    the whole trunk) nor after thousands of tokens (it ran 8,180 before). The plan's bound for
    every token is tests/model/test_synth.py's."""
    from strata.engine.demo import MAX_ANSWER, TRUNK, ensure_demo_model

    e = Engine.load(ensure_demo_model(tmp_path), EngineOptions())
    prompt = e.encode_chat([{"role": "user", "content": "Write a poem about the sea."}])
    greedy = e.generate(prompt, SamplingParams(max_tokens=4 * MAX_ANSWER, temperature=0.0))
    assert greedy.finish_reason == "stop", greedy.completion_tokens
    assert TRUNK <= greedy.completion_tokens <= MAX_ANSWER


def test_a_context_whose_kv_cannot_fit_the_memory_names_the_option(tiny_models) -> None:
    path = tiny_models.path("qwen3moe", "F32")
    with pytest.raises(ModelLoadError, match=r"context_length 100000000000 needs a K/V cache of"):
        Engine.load(path, EngineOptions(kv_cache_type="f32", context_length=100_000_000_000))


def test_the_kv_size_checked_at_load_is_what_a_whole_context_maps() -> None:
    from strata.engine.kv import KVCache

    for n_ctx, kind in ((1, "f32"), (100, "f16"), (4096, "f32")):
        kv = KVCache(3, n_ctx, 2, 8, kind, chunk_bytes=4096, fixed=True)
        try:
            whole = KVCache.nbytes_for(3, n_ctx, 2, 8, kind)
            assert whole == kv.context_bytes(n_ctx)
            # a fixed K/V maps a whole context and the sink page, in whole chunks
            assert kv.nbytes == kv.book.bytes_for(1 + whole // kv.page_bytes)
        finally:
            kv.close()
