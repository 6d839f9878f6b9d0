"""The random-weight GGUF writer and the built-in demo model."""

from __future__ import annotations

import hashlib
import time
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
from reference import RefModel

from strata.engine import demo, synth, synth_recipes
from strata.engine.synth import Kind, ModelSpec, TypePlan
from strata.engine.vocab import pad_vocab

Q = gguf.GGMLQuantizationType

# Small enough to write in a blink; K-quant rows (n_embd, n_head*head_dim, n_ff_exp) are 256.
SMALL = {
    "qwen3moe": ModelSpec("qwen3moe", 2, 256, 4, 2, 64, 4, 2, 256, 4096, 1e6, 1e-6),
    "llama": ModelSpec("llama", 2, 256, 4, 2, 64, 4, 2, 256, 4096, 1e6, 1e-5),
}
# Every synthesizable type somewhere; the *_more_bits fields pick layer 1 of 2 (use_more_bits).
MIXED = TypePlan(
    token_embd=Q.Q8_0,
    attn=Q.Q4_0,
    norm=Q.F32,
    router=Q.F16,
    experts_gate_up=Q.Q4_K,
    experts_down=Q.Q6_K,
    output=Q.IQ4_XS,
    attn_v=Q.Q5_K,
    attn_v_more_bits=Q.BF16,
    experts_down_more_bits=Q.Q5_K,
)
RANDOM_BLOCK_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def mixed_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("synth-mixed")
    return {
        arch: synth.write_model(root / f"{arch}.gguf", spec, synth.vocab_for(arch), MIXED, 3)
        for arch, spec in SMALL.items()
    }


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    spec, vocab = SMALL["qwen3moe"], synth.vocab_for("qwen3moe")
    a = synth.write_model(tmp_path / "a.gguf", spec, vocab, MIXED, 11)
    b = synth.write_model(tmp_path / "b.gguf", spec, vocab, MIXED, 11)
    c = synth.write_model(tmp_path / "c.gguf", spec, vocab, MIXED, 12)
    assert sha256(a) == sha256(b)
    assert sha256(a) != sha256(c)


@pytest.mark.parametrize("arch", list(SMALL))
def test_every_planned_type_lands_in_the_file(arch, mixed_files):
    spec = SMALL[arch]
    reader = gguf.GGUFReader(mixed_files[arch])
    got = {t.name: t for t in reader.tensors}
    descs = synth.tensor_descs(spec, MIXED, len(synth.vocab_for(arch).tokens))
    assert list(got) == [x.name for x in descs]
    for x in descs:
        t = got[x.name]
        assert t.tensor_type == x.qtype, x.name
        assert tuple(int(n) for n in reversed(t.shape)) == x.shape, x.name
    assert {t.tensor_type for t in reader.tensors} == MIXED.types()
    # every type synth writes, but those of the recipes (tests/model/test_synth_recipes.py)
    assert MIXED.types() == synth.SUPPORTED_TYPES - set(synth_recipes.BLOCK_SCALES)
    # the more-bits overrides went to the use_more_bits layer only
    assert got["blk.1.attn_v.weight"].tensor_type == Q.BF16
    assert got["blk.0.attn_v.weight"].tensor_type == Q.Q5_K
    assert got["blk.1.ffn_down_exps.weight"].tensor_type == Q.Q5_K
    assert got["blk.0.ffn_down_exps.weight"].tensor_type == Q.Q6_K
    has_qk_norm = "blk.0.attn_q_norm.weight" in got
    assert has_qk_norm == (arch == "qwen3moe")
    arch_field = reader.fields["general.architecture"].contents()
    assert arch_field == arch
    assert reader.fields[f"{arch}.expert_count"].contents() == spec.n_expert


@pytest.mark.parametrize("arch", list(SMALL))
def test_random_blocks_dequantise_to_finite_values_of_the_planned_scale(arch, mixed_files):
    spec = SMALL[arch]
    reader = gguf.GGUFReader(mixed_files[arch])
    descs = {x.name: x for x in synth.tensor_descs(spec, MIXED, len(synth.vocab_for(arch).tokens))}
    seen = set()
    for t in reader.tensors:
        if t.tensor_type not in RANDOM_BLOCK_TYPES:
            continue
        seen.add(t.tensor_type)
        w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        assert np.isfinite(w).all(), t.name
        want = descs[t.name].std
        if descs[t.name].kind is not Kind.OUTPUT:  # muted rows make the output's std smaller
            assert 0.5 * want < w.std() < 2 * want, (t.name, w.std(), want)
            assert abs(w.mean()) < 0.2 * want, (t.name, w.mean(), want)
    assert seen == set(RANDOM_BLOCK_TYPES)


def test_control_token_rows_are_muted(tmp_path):
    vocab = synth.vocab_for("qwen3moe")
    path = synth.write_model(tmp_path / "m.gguf", SMALL["qwen3moe"], vocab, TypePlan(), 5)
    out = RefModel(path).w("output")  # [V, D]
    norms = np.linalg.norm(out, axis=1)
    muted = synth.muted_token_ids(vocab)
    assert vocab.eos_id in muted and len(muted) >= 2
    assert norms[muted].max() < 0.01 * np.median(norms)


def test_vocab_is_padded_to_the_spec_size(tmp_path):
    spec = replace(SMALL["llama"], vocab_size=3000)
    path = synth.write_model(tmp_path / "p.gguf", spec, synth.vocab_for("llama"), TypePlan(), 1)
    ref = RefModel(path)
    assert len(ref.token_types) == 3000
    assert ref.w("output").shape == (3000, spec.n_embd)
    n = len(synth.vocab_for("llama").tokens)
    assert (ref.token_types[n:] == int(gguf.TokenType.UNUSED)).all()
    with pytest.raises(ValueError, match="vocab_size=10"):
        too_small = replace(spec, vocab_size=10)
        synth.write_model(tmp_path / "q.gguf", too_small, synth.vocab_for("llama"), TypePlan(), 1)


@pytest.mark.parametrize(
    ("change", "dim"),
    [
        ({"n_ff_exp": 320}, "n_ff_exp=320"),
        ({"n_embd": 384, "head_dim": 96}, "n_embd=384"),
        ({"head_dim": 80}, "n_head\\*head_dim=320"),
    ],
)
def test_k_quant_rows_must_be_whole_blocks(change, dim, tmp_path):
    spec = replace(SMALL["qwen3moe"], **change)
    plan = TypePlan.uniform(Q.Q4_K)
    with pytest.raises(ValueError, match=f"{dim} is not a multiple of 256"):
        synth.write_model(tmp_path / "x.gguf", spec, synth.vocab_for("qwen3moe"), plan, 0)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"arch": "gpt2"}, "arch='gpt2'"),
        ({"n_head_kv": 3}, "n_head=4 is not a multiple of n_head_kv=3"),
        ({"n_expert_used": 5}, "n_expert_used=5"),
        ({"head_dim": 63}, "head_dim=63"),
    ],
)
def test_model_spec_rejects_impossible_shapes(change, message):
    with pytest.raises(ValueError, match=message):
        replace(SMALL["qwen3moe"], **change)


def test_norms_must_be_float(tmp_path):
    with pytest.raises(ValueError, match="norm must be F32, F16 or BF16"):
        synth.tensor_descs(SMALL["llama"], replace(TypePlan(), norm=Q.Q8_0), 100)


def test_progress_reaches_the_total_and_a_failed_write_leaves_nothing(tmp_path):
    calls: list[tuple[int, int]] = []
    spec, vocab = SMALL["llama"], synth.vocab_for("llama")
    path = synth.write_model(
        tmp_path / "ok.gguf", spec, vocab, MIXED, 0, lambda d, t: calls.append((d, t))
    )
    done = [d for d, _ in calls]
    assert done == sorted(done) and done[-1] == calls[-1][1]
    assert calls[-1][1] < path.stat().st_size

    def boom(done: int, total: int) -> None:
        if done > total // 2:
            raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        synth.write_model(tmp_path / "bad.gguf", spec, vocab, MIXED, 0, boom)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.gguf"]


def test_ensure_synthetic_writes_once_and_reuses(tmp_path, monkeypatch):
    first = synth.ensure_synthetic("tiny-mixtral", tmp_path)
    assert first.parent == tmp_path and f"-g{synth.GENERATOR_VERSION}-" in first.name
    stat = first.stat()

    def no_write(*args, **kwargs):
        raise AssertionError("ensure_synthetic rewrote a cached file")

    monkeypatch.setattr(synth, "write_model", no_write)
    again = synth.ensure_synthetic("tiny-mixtral", tmp_path)
    assert again == first and again.stat().st_ino == stat.st_ino
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temp file left behind
    with pytest.raises(ValueError, match="unknown synthetic model 'nope'"):
        synth.ensure_synthetic("nope", tmp_path)


def test_full_size_q4k_preset_plan():
    spec = synth.PRESETS["qwen3-30b-a3b-q4k"]
    vocab = pad_vocab(synth.vocab_for("qwen3moe"), spec.vocab_size)
    descs = synth.tensor_descs(spec, synth.PRESET_TYPES["qwen3-30b-a3b-q4k"], len(vocab.tokens))
    by_kind: dict[Kind, set[Q]] = {}
    for x in descs:
        by_kind.setdefault(x.kind, set()).add(x.qtype)
    assert by_kind[Kind.EXPERTS_GATE_UP] == by_kind[Kind.EXPERTS_DOWN] == {Q.Q4_K}
    assert by_kind[Kind.ATTN_V] == {Q.Q4_K, Q.Q6_K}
    assert by_kind[Kind.OUTPUT] == {Q.Q6_K} and by_kind[Kind.TOKEN_EMBD] == {Q.Q4_K}
    assert by_kind[Kind.NORM] == by_kind[Kind.ROUTER] == {Q.F32}
    total = sum(x.nbytes for x in descs)
    assert 15.5 * 2**30 < total < 17 * 2**30
    experts = [x for x in descs if x.kind in (Kind.EXPERTS_GATE_UP, Kind.EXPERTS_DOWN)]
    assert len(experts) == 3 * 48 and experts[0].shape == (128, 768, 2048)


def test_full_size_q5k_preset_is_llama_cpps_q5_k_m_recipe():
    spec = synth.PRESETS["qwen3-30b-a3b-q5k"]
    plan = synth.PRESET_TYPES["qwen3-30b-a3b-q5k"]
    vocab = pad_vocab(synth.vocab_for("qwen3moe"), spec.vocab_size)
    descs = synth.tensor_descs(spec, plan, len(vocab.tokens))
    by_kind: dict[Kind, set[Q]] = {}
    for x in descs:
        by_kind.setdefault(x.kind, set()).add(x.qtype)
    assert by_kind[Kind.EXPERTS_GATE_UP] == by_kind[Kind.ATTN] == {Q.Q5_K}
    assert by_kind[Kind.EXPERTS_DOWN] == by_kind[Kind.ATTN_V] == {Q.Q5_K, Q.Q6_K}
    assert by_kind[Kind.OUTPUT] == {Q.Q6_K} and by_kind[Kind.TOKEN_EMBD] == {Q.Q5_K}
    assert by_kind[Kind.NORM] == by_kind[Kind.ROUTER] == {Q.F32}
    more = [i for i in range(spec.n_layer) if synth.use_more_bits(i, spec.n_layer)]
    downs = {x.layer for x in descs if x.kind is Kind.EXPERTS_DOWN and x.qtype == Q.Q6_K}
    assert downs == set(more)
    assert plan.guessed_file_type() == gguf.LlamaFileType.MOSTLY_Q5_K_M
    assert 19.5 * 2**30 < sum(x.nbytes for x in descs) < 21 * 2**30


def test_demo_model_is_written_once_and_deterministically(tmp_path):
    t0 = time.monotonic()
    path = demo.ensure_demo_model(tmp_path / "a")
    elapsed = time.monotonic() - t0
    print(f"demo model: {path.stat().st_size / 2**20:.1f} MiB written in {elapsed:.2f} s")
    mtime = path.stat().st_mtime_ns
    assert demo.ensure_demo_model(tmp_path / "a") == path
    assert path.stat().st_mtime_ns == mtime  # reused, not written again
    other = demo.ensure_demo_model(tmp_path / "b")
    assert other.name == path.name and sha256(other) == sha256(path)
    ref = RefModel(path)
    assert ref.config.arch == "qwen3moe" and ref.config.n_expert >= 8
    assert ref.meta("tokenizer.chat_template")


def test_demo_answer_plan_leads_every_token_to_the_end_token() -> None:
    vocab = synth.vocab_for("qwen3moe")
    muted = synth.muted_token_ids(vocab)
    pred = demo.answer_plan(vocab, muted, demo.DEMO_SEED)
    follows = {int(t): row for row, ts in enumerate(pred) for t in ts if t >= 0}
    speakable = set(range(len(vocab.tokens))) - set(muted.tolist())
    assert set(follows) == speakable - {vocab.eos_id}  # each token follows exactly one
    assert sum(int((ts >= 0).sum()) for ts in pred) == len(follows)
    for token in speakable - {vocab.eos_id}:
        steps, at = 0, token
        while at != vocab.eos_id:
            at, steps = follows[at], steps + 1
            assert steps <= demo.MAX_ANSWER, f"token {token} never reaches the end"
        data = synth.token_bytes(vocab, token)
        if all(b < 0x80 for b in data):
            assert steps > demo.TRUNK, (token, steps)
        if demo._kind(data) == "piece":  # a piece of a character: a leaf, never generated
            assert (pred[token] < 0).all(), token
    # the plan decides the file: its name changes with it
    spec, types = synth.PRESETS["demo"], synth.PRESET_TYPES["demo"]
    assert synth.content_key(spec, vocab, types, 7, demo.PLAN) != synth.content_key(
        spec, vocab, types, 7
    )


def test_demo_greedy_answer_runs_long(tmp_path, llama_cpp_ref):
    llm = llama_cpp_ref(demo.ensure_demo_model(tmp_path))
    llm.reset()
    out = llm.create_chat_completion(
        messages=[{"role": "user", "content": "Hello! Who are you?"}], max_tokens=40, temperature=0
    )
    choice = out["choices"][0]
    print(f"demo greedy answer: {choice['message']['content']!r}")
    assert choice["finish_reason"] == "length"
    assert not set(choice["message"]["content"]) & {chr(c) for c in synth._CONTROL_BYTES}
    assert out["usage"]["completion_tokens"] == 40


def test_llama_cpp_runs_random_block_files(mixed_files, llama_cpp_ref):
    for arch, path in mixed_files.items():
        llm = llama_cpp_ref(path)
        llm.reset()
        llm.eval([5, 6, 7, 8])
        logits = np.array(llm.scores[:4])
        assert np.isfinite(logits).all() and logits.std() > 0, arch
