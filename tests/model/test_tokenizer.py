"""Tokenizers built from GGUF vocabularies, held to llama.cpp's own tokenizer.

The reference is llama-cpp-python loading a vocabulary-only GGUF file written here from the same
``Vocab``: ``Llama.tokenize`` for encoding, ``llama_detokenize`` for decoding. Both builder
vocabularies are covered (byte-level BPE under three pre-tokenizers, SentencePiece), on fixed
hard cases and on a fixed-seed fuzz set.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import gguf
import pytest

from strata.engine.errors import TokenizerError
from strata.engine.tokenizer import SUPPORTED_PRE, Tokenizer
from strata.engine.vocab import (
    BYTE,
    CONTROL,
    NORMAL,
    USER_DEFINED,
    Vocab,
    build_bpe_vocab,
    build_spm_vocab,
    demo_corpus,
)

# ---------------------------------------------------------------------------------------------
# helpers


def write_vocab_gguf(path: Path, vocab: Vocab, arch: str) -> Path:
    """A GGUF with ``vocab`` and just the hyper-parameters llama.cpp reads before the vocabulary
    (no tensors: enough for ``vocab_only``)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(4096)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_expert_feed_forward_length(32)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    w.add_key_length(16)
    w.add_value_length(16)
    vocab.write(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def read_metadata(path: Path) -> dict[str, object]:
    """Every key -> Python value of a GGUF file, through gguf's reader."""
    reader = gguf.GGUFReader(str(path))
    return {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}


def _llama_cpp():
    if os.environ.get("CI"):
        import llama_cpp  # in CI a missing reference fails the test

        return llama_cpp
    return pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed: no llama.cpp reference"
    )


class Reference:
    """llama.cpp's tokenizer on a vocabulary-only GGUF."""

    def __init__(self, path: Path) -> None:
        self.lib = _llama_cpp()
        self.llama = self.lib.Llama(model_path=str(path), vocab_only=True, verbose=False)

    def encode(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return self.llama.tokenize(text.encode(), add_bos=add_special, special=parse_special)

    def detokenize(self, ids: list[int], unparse_special: bool) -> str:
        arr = (self.lib.llama_token * max(1, len(ids)))(*ids)
        size = 64 + 32 * len(ids)
        buf = ctypes.create_string_buffer(size)
        n = self.lib.llama_detokenize(
            self.llama._model.vocab, arr, len(ids), buf, size, False, unparse_special
        )
        assert n >= 0, "detokenize buffer too small"
        return buf.raw[:n].decode("utf-8", errors="replace")

    def eog_ids(self, n_vocab: int) -> set[int]:
        vocab = self.llama._model.vocab
        return {i for i in range(n_vocab) if self.lib.llama_vocab_is_eog(vocab, i)}


# ---------------------------------------------------------------------------------------------
# fixtures

BPE_PRES = ("qwen2", "llama-bpe", "default")
RETYPED = "qwen2-retyped-specials"


@pytest.fixture(scope="module")
def bpe_vocab() -> Vocab:
    return build_bpe_vocab()


@pytest.fixture(scope="module")
def spm_vocab() -> Vocab:
    return build_spm_vocab()


@pytest.fixture(scope="module")
def pair(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    bpe_vocab: Vocab,
    spm_vocab: Vocab,
) -> tuple[Tokenizer, Reference]:
    """(ours, llama.cpp's) for the vocabulary named by the parameter: "spm" or a BPE pre."""
    kind = request.param
    if kind == "spm":
        vocab, arch = spm_vocab, "llama"
    elif kind == RETYPED:
        # end-of-turn and FIM tokens a converter left untyped: llama.cpp makes them CONTROL
        types = list(bpe_vocab.token_types)
        for text, ttype in (
            ("<|im_end|>", NORMAL),
            ("<|fim_pad|>", NORMAL),
            ("<|fim_prefix|>", USER_DEFINED),
        ):
            types[bpe_vocab.tokens.index(text)] = ttype
        vocab, arch = dataclasses.replace(bpe_vocab, token_types=types), "qwen3moe"
    else:
        vocab, arch = dataclasses.replace(bpe_vocab, pre=kind), "qwen3moe"
    ref = Reference(
        write_vocab_gguf(tmp_path_factory.mktemp("vocab") / f"{kind}.gguf", vocab, arch)
    )
    return Tokenizer.from_vocab(vocab), ref


ALL_KINDS = [*BPE_PRES, "spm"]
# every pre-tokenizer the tokenizer accepts, each checked against llama.cpp on the fuzz texts
EVERY_KIND = [*sorted(SUPPORTED_PRE), RETYPED, "spm"]

CASES = {
    "ascii": "Hello world, the model answers.",
    "digits": "1 12 123 1234 12345 3.14159 2024-06-11 1,000,000",
    "long_number": "12345678901234567890123456789",
    "contractions": "don't DON'T Don't I'LL i'll we're they've she'd it's 's 'S",
    "accents": "café naïve résumé Zürich Straße ß Ångström",
    "combining": "e\u0301 cafe\u0301 \u0301alone",
    "cjk": "你好，世界！我们的模型很好。龍 日本語のテキスト 한국어",
    "emoji": "emoji 🙂🚀👍🏽 🦙 ❤️ 🇫🇷",
    "newlines": "line one\nline two\n\nafter blank\r\nCRLF\n",
    "only_newlines": "\n\n\n",
    "multiple_spaces": "two  spaces   three    four",
    "tabs": "tabs\tand\t\ttwo\t",
    "leading_space": " leading",
    "leading_spaces": "   three leading",
    "trailing_space": "trailing ",
    "trailing_spaces": "trailing   ",
    "space_only": " ",
    "mixed_ws": "a \t \n  b\n \n",
    "unicode_spaces": "nbsp\u00a0em\u2003ideographic\u3000zwsp\u200bend",
    "code": "def f(x):\n    return x + 1  # add\n\tif (a && !b) { c[i] = -1; }\n",
    "punctuation": '...!?;: $100 + 5 = <10> ^_^ ~|~ (a) [b] {c} "q" `t`',
    "chat_specials": "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "special_mid_word": "x<|endoftext|>y",
    "user_defined": "text <think>inner</think> more<tool_call>",
    "spm_specials": "<s>[INST] hi [/INST] ok</s>",
    "unk_text": "<unk> <s> </s>",
    "single_char": "a",
}


# ---------------------------------------------------------------------------------------------
# encoding equals llama.cpp


@pytest.mark.parametrize("pair", ALL_KINDS, indirect=True)
@pytest.mark.parametrize("case", list(CASES))
def test_encode_equals_llama_cpp(pair: tuple[Tokenizer, Reference], case: str) -> None:
    tok, ref = pair
    text = CASES[case]
    for parse_special in (True, False):
        want = ref.encode(text, add_special=True, parse_special=parse_special)
        if want[:2] == [tok.bos_id, tok.bos_id]:
            want = want[1:]  # llama.cpp doubles a BOS the text starts with (and warns); we don't
        got = tok.encode(text, parse_special=parse_special)
        assert got == want, (parse_special, [tok.vocab.tokens[i] for i in want])
        want = ref.encode(text, add_special=False, parse_special=parse_special)
        assert tok.encode(text, add_bos=False, parse_special=parse_special) == want


def _fuzz_texts(n: int, seed: int) -> list[str]:
    """Random slices of the training text and random strings over a hostile alphabet."""
    rng = random.Random(seed)
    corpus = "".join(demo_corpus())
    alphabet = list("abcAB xyz'\".,!?;:-_()[]{}<>|$+=^~`@#%&*/\\0123456789\n\r\t")
    alphabet += list("éßÆñü¡¿«»—…“”‘’€£©™°½²ʼˆ你好龍한国")
    alphabet += ["🙂", "👍🏽", "🦙", "\u0301", "\u200b", "\u00a0", "\u2003", "\u3000", "\u0085"]
    alphabet += ["<|im_end|>", "<s>", "</s>", "<think>", "<unk>", "<|endoftext|>"]
    out = []
    for _ in range(n):
        if rng.random() < 0.4:
            i = rng.randrange(len(corpus) - 300)
            out.append(corpus[i : i + rng.randrange(1, 300)])
        else:
            out.append("".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40))))
    return out


FUZZ = _fuzz_texts(300, seed=1234)


@pytest.mark.parametrize("pair", EVERY_KIND, indirect=True)
def test_encode_equals_llama_cpp_on_fuzz_texts(pair: tuple[Tokenizer, Reference]) -> None:
    tok, ref = pair
    bad = []
    for i, text in enumerate(FUZZ):
        parse_special = i % 3 != 0
        want = ref.encode(text, add_special=False, parse_special=parse_special)
        if tok.encode(text, add_bos=False, parse_special=parse_special) != want:
            bad.append(text)
    assert not bad, f"{len(bad)} of {len(FUZZ)} differ, first: {bad[0]!r}"


# ---------------------------------------------------------------------------------------------
# decoding equals llama.cpp and inverts encoding


@pytest.mark.parametrize("pair", EVERY_KIND, indirect=True)
def test_decode_equals_llama_detokenize(pair: tuple[Tokenizer, Reference]) -> None:
    tok, ref = pair
    for text in [*CASES.values(), *FUZZ[:100]]:
        for add_special in (True, False):
            ids = ref.encode(text, add_special=add_special, parse_special=True)
            for unparse in (True, False):
                want = ref.detokenize(ids, unparse_special=unparse)
                assert tok.decode(ids, skip_special=not unparse) == want, (text, ids, unparse)


@pytest.mark.parametrize("pair", ["qwen2", "spm"], indirect=True)
def test_decode_inverts_encode(pair: tuple[Tokenizer, Reference]) -> None:
    tok, _ = pair
    texts = [*CASES.values(), *FUZZ]
    if tok.is_spm:
        # SentencePiece puts a space after every special token (llama.cpp does too), so only
        # text without special tokens comes back unchanged
        texts = [t for t in texts if not any(s in t for s in ("<s>", "</s>", "<unk>", "<|"))]
    for text in texts:
        assert tok.decode(tok.encode(text, add_bos=False)) == text


def test_decode_keeps_bpe_text_but_cleans_spaces_like_llama_cpp(bpe_vocab: Vocab) -> None:
    # llama.cpp cleans " ," and " 's" when detokenising "default"/llama-bpe vocabularies,
    # never for qwen2
    text = "a , b 's c ' d ?"
    qwen = Tokenizer.from_vocab(bpe_vocab)
    assert qwen.decode(qwen.encode(text)) == text
    default = Tokenizer.from_vocab(dataclasses.replace(bpe_vocab, pre="default"))
    assert default.decode(default.encode(text)) == "a, b's c'd?"


def test_stream_decoder_holds_back_partial_utf8(bpe_vocab: Vocab) -> None:
    tok = Tokenizer.from_vocab(bpe_vocab)
    llama = tok.encode("🦙")  # not in the vocabulary: split over byte tokens
    assert len(llama) >= 2
    stream = tok.stream_decoder()
    assert [stream.push(i) for i in llama] == [""] * (len(llama) - 1) + ["🦙"]
    text = "llama 🦙 and 龍!\n"
    stream = tok.stream_decoder()
    chunks = [stream.push(i) for i in tok.encode(text)]
    assert "".join(chunks) + stream.flush() == text
    assert not any("\ufffd" in c for c in chunks)


@pytest.mark.parametrize("pair", ["qwen2", "spm"], indirect=True)
def test_stream_decoder_joins_to_decode_of_a_continuation(
    pair: tuple[Tokenizer, Reference],
) -> None:
    tok, _ = pair
    for text in FUZZ[:100]:
        ids = tok.encode(text)
        for skip in (True, False):
            stream = tok.stream_decoder(skip_special=skip)
            joined = "".join(stream.push(i) for i in ids) + stream.flush()
            assert joined == tok.decode(ids, skip_special=skip, continuation=True)


def test_stream_decoder_skips_special_tokens_and_flushes_a_cut_sequence(
    bpe_vocab: Vocab,
) -> None:
    tok = Tokenizer.from_vocab(bpe_vocab)
    stream = tok.stream_decoder()
    im_end = tok.vocab.tokens.index("<|im_end|>")
    assert stream.push(tok.encode("ok")[0]) == "ok"
    assert stream.push(im_end) == ""
    cut = tok.encode("🦙")[:2]
    assert [stream.push(i) for i in cut] == ["", ""]
    assert stream.flush() == "\ufffd"


def test_spm_decode_strips_prefix_space_only_at_the_start(spm_vocab: Vocab) -> None:
    tok = Tokenizer.from_vocab(spm_vocab)
    ids = tok.encode("Hello world", add_bos=False)
    assert tok.decode(ids) == "Hello world"
    assert tok.decode(ids, continuation=True) == " Hello world"
    assert "".join(tok.stream_decoder().push(i) for i in ids) == " Hello world"


# ---------------------------------------------------------------------------------------------
# BOS, specials, end-of-generation


def test_bos_is_added_once_even_when_the_text_starts_with_it(spm_vocab: Vocab) -> None:
    tok = Tokenizer.from_vocab(spm_vocab)
    assert tok.encode("hi")[0] == tok.bos_id
    twice = tok.encode("<s>[INST] hi [/INST]")
    assert twice[0] == tok.bos_id and twice[1] != tok.bos_id
    assert tok.encode("hi", add_bos=False)[0] != tok.bos_id
    # parse_special=False: "<s>" is text, so a BOS is still added in front of it
    plain = tok.encode("<s>hi", parse_special=False)
    assert plain[0] == tok.bos_id and tok.bos_id not in plain[1:]


def test_bpe_vocab_adds_no_bos_unless_asked(bpe_vocab: Vocab) -> None:
    tok = Tokenizer.from_vocab(bpe_vocab)
    assert tok.bos_id is not None and tok.bos_id not in tok.encode("hello")
    assert tok.encode("hello", add_bos=True)[0] == tok.bos_id


def test_control_tokens_parse_only_with_parse_special_user_defined_always(
    bpe_vocab: Vocab,
) -> None:
    tok = Tokenizer.from_vocab(bpe_vocab)
    ids = {t: tok.vocab.tokens.index(t) for t in ("<|im_start|>", "<think>")}
    assert tok.vocab.token_types[ids["<|im_start|>"]] == CONTROL
    assert tok.vocab.token_types[ids["<think>"]] == USER_DEFINED
    text = "<|im_start|>user <think>"
    assert ids["<|im_start|>"] in tok.encode(text)
    plain = tok.encode(text, parse_special=False)
    assert ids["<|im_start|>"] not in plain and ids["<think>"] in plain
    assert tok.decode(plain) == text


@pytest.mark.parametrize("pair", ["qwen2", RETYPED, "spm"], indirect=True)
def test_eog_ids_equal_llama_cpp(pair: tuple[Tokenizer, Reference]) -> None:
    tok, ref = pair
    assert tok.eog_ids == ref.eog_ids(tok.vocab_size)
    names = {tok.vocab.tokens[i] for i in tok.eog_ids}
    if tok.is_spm:
        assert names == {"</s>"}
    else:
        assert {"<|im_end|>", "<|endoftext|>", "<|fim_pad|>"} <= names
        assert tok.eos_id in tok.eog_ids


def test_missing_pre_warns_and_tokenises_as_default(
    bpe_vocab: Vocab, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="strata.engine.tokenizer"):
        tok = Tokenizer.from_vocab(dataclasses.replace(bpe_vocab, pre=None))
    assert "tokenizer.ggml.pre" in caplog.text
    default = Tokenizer.from_vocab(dataclasses.replace(bpe_vocab, pre="default"))
    assert tok.encode(CASES["punctuation"]) == default.encode(CASES["punctuation"])


def test_unknown_pre_is_an_error_naming_it(bpe_vocab: Vocab) -> None:
    with pytest.raises(TokenizerError, match="'no-such-pre'"):
        Tokenizer.from_vocab(dataclasses.replace(bpe_vocab, pre="no-such-pre"))


def test_unknown_model_and_bad_ids_are_errors(bpe_vocab: Vocab) -> None:
    with pytest.raises(TokenizerError, match="'t5'"):
        Tokenizer.from_vocab(dataclasses.replace(bpe_vocab, model="t5"))
    with pytest.raises(TokenizerError, match="bos_id"):
        dataclasses.replace(bpe_vocab, bos_id=len(bpe_vocab.tokens))
    with pytest.raises(TokenizerError, match="outside"):
        Tokenizer.from_vocab(bpe_vocab).decode([len(bpe_vocab.tokens)])


# ---------------------------------------------------------------------------------------------
# the vocabulary data and its builders


def test_vocab_round_trips_through_gguf_metadata(
    tmp_path: Path, bpe_vocab: Vocab, spm_vocab: Vocab
) -> None:
    for vocab, arch in ((bpe_vocab, "qwen3moe"), (spm_vocab, "llama")):
        path = write_vocab_gguf(tmp_path / f"{arch}.gguf", vocab, arch)
        assert Vocab.from_metadata(read_metadata(path)) == vocab


def test_from_metadata_fills_llama_cpp_defaults() -> None:
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "a"]}
    vocab = Vocab.from_metadata(md)
    assert vocab.token_types == [1, 1, 1, 1] and vocab.add_bos and vocab.bos_id is None
    tok = Tokenizer.from_vocab(vocab)
    assert (tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    with pytest.raises(TokenizerError, match=r"tokenizer\.ggml\.tokens"):
        Vocab.from_metadata({"tokenizer.ggml.model": "gpt2"})


def test_builders_make_qwen_and_mixtral_shaped_vocabularies(
    bpe_vocab: Vocab, spm_vocab: Vocab
) -> None:
    assert bpe_vocab.model == "gpt2" and bpe_vocab.pre == "qwen2" and not bpe_vocab.add_bos
    assert len(bpe_vocab.merges or []) >= 2000
    assert {"<|endoftext|>", "<|im_start|>", "<|im_end|>"} <= set(bpe_vocab.tokens)
    assert "<|im_start|>" in (bpe_vocab.chat_template or "")
    assert spm_vocab.model == "llama" and spm_vocab.add_bos
    assert spm_vocab.tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert spm_vocab.tokens[3 + 0x41] == "<0x41>" and spm_vocab.token_types.count(BYTE) == 256
    assert any(t.startswith("▁") and len(t) > 2 for t in spm_vocab.tokens)
    assert "[INST]" in (spm_vocab.chat_template or "")


FINGERPRINT = """
import dataclasses, hashlib, json

def fingerprint(v):
    fields = {f.name: getattr(v, f.name) for f in dataclasses.fields(v) if f.name != "extra"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
"""


def test_builders_are_deterministic_across_processes(bpe_vocab: Vocab, spm_vocab: Vocab) -> None:
    t0 = time.perf_counter()
    again = (build_bpe_vocab(), build_spm_vocab())
    print(f"\nthe two builders took {time.perf_counter() - t0:.2f} s")  # a number, not a test
    assert again == (bpe_vocab, spm_vocab)
    # another process, another hash seed and thread count: the same bytes
    code = FINGERPRINT + (
        "from strata.engine.vocab import build_bpe_vocab, build_spm_vocab\n"
        "print(fingerprint(build_bpe_vocab()), fingerprint(build_spm_vocab()))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "RAYON_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
        timeout=120,
    ).stdout.split()  # fmt: skip
    scope: dict[str, object] = {}
    exec(FINGERPRINT, scope)
    fingerprint = scope["fingerprint"]
    assert out == [fingerprint(bpe_vocab), fingerprint(spm_vocab)]  # type: ignore[operator]
