"""Text <-> token ids for GGUF vocabularies, tokenising the way llama.cpp does.

Encoding runs on the HF ``tokenizers`` library, configured so its output equals llama.cpp's
``llama_tokenize`` (the parity tests in tests/model/test_tokenizer.py hold it to that):

- ``gpt2`` vocabularies: llama.cpp's split regexes for ``tokenizer.ggml.pre``, the GPT-2 byte
  map, then BPE by merge rank (whole-word lookup first for Llama-3-style ``ignore_merges``).
- ``llama`` (SentencePiece) vocabularies: a "▁" before each text fragment, spaces as "▁", then
  llama.cpp's SPM loop (join the adjacent pair whose concatenation is the best-scoring token),
  expressed as BPE merges ranked by score, with byte fallback to <0xNN>.
- CONTROL / UNKNOWN tokens written in the text are matched as single tokens when
  ``parse_special``; USER_DEFINED ones always are.

Decoding does not use ``tokenizers``: it concatenates llama.cpp's per-token pieces and applies
``llama_detokenize``'s rules (SPM leading-space removal, BPE space clean-up), which is exact.
"""

from __future__ import annotations

import codecs
import logging
import threading
from collections.abc import Sequence

from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HfTokenizer

from strata.engine.errors import TokenizerError
from strata.engine.vocab import (
    BYTE,
    CONTROL,
    NORMAL,
    UNKNOWN,
    USER_DEFINED,
    Vocab,
    unicode_to_byte,
)

log = logging.getLogger(__name__)

# llama.cpp's split regexes (src/llama-vocab.cpp), applied in order, each one splitting the
# pieces the previous one left ("isolated": matches and the text between them both stay).
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_GPT2 = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",)
_DEFAULT = (
    r"[\p{P}\$\+<=>\^~\|]+",
    _GPT2[0],
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)
_STARCODER = (r"\p{N}", *_GPT2)
# gpt-oss's o200k split: words by case runs with their contraction, digits in threes
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

# tokenizer.ggml.pre -> (regexes, ignore_merges, clean_spaces), as llama.cpp's loader sets them
_PRE: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    "default": (_DEFAULT, False, True),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"), (_QWEN2, False, False)),
    **dict.fromkeys(("stablelm2", "megrez"), (_QWEN2, False, True)),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        (_LLAMA3, True, True),
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), (_LLAMA3, False, True)),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo"), (_GPT2, False, True)),
    **dict.fromkeys(("starcoder", "refact"), (_STARCODER, False, True)),
    "smollm": (_STARCODER, False, False),
    **dict.fromkeys(("gpt-4o", "llama4"), (_GPT4O, False, False)),
}
SUPPORTED_PRE = frozenset(_PRE)

# Token texts llama.cpp treats as end-of-generation whatever the file says: end-of-turn names,
# and the fill-in-the-middle pad / repo / file-separator tokens.
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
        "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>",
        "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
        "<｜end▁of▁sentence｜>",
        "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",
        "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
        "<|file_sep|>",
    }
)  # fmt: skip
# The parts of harmony's message frame (gpt-oss) that llama.cpp always renders as text
# (USER_DEFINED, whatever the file says), so that the reply's channels can be read back.
_RENDERED_TEXTS = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})
# End-of-generation pairs that make <|end|> a message's end, not the turn's (harmony; Solar Open).
_TURN_ENDS = ({"<|return|>", "<|call|>"}, {"<|calls|>", "<|flush|>"})
# Fill-in-the-middle markers llama.cpp also forces to CONTROL (but which do not end generation).
_FIM_TEXTS = frozenset(
    {
        "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
        "<|code_prefix|>", "<|prefix|>",
        "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
        "<|code_suffix|>", "<|suffix|>",
        "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
        "<|code_middle|>", "<|middle|>",
    }
)  # fmt: skip
# The texts llama.cpp picks an EOT token from when the file names none.
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)  # fmt: skip

_SPECIAL_TYPES = (CONTROL, USER_DEFINED, UNKNOWN)

# Words each BPE model caches (the tokenizers library's own default, stated so it is a known
# bound): the cache stops taking words once full, and never takes one of 256 bytes or more.
BPE_CACHE_WORDS = 10_000


class Tokenizer:
    """Encode and decode with one GGUF vocabulary. Thread-safe; build with ``from_vocab``."""

    def __init__(self, vocab: Vocab) -> None:
        self.vocab = vocab
        self.vocab_size = vocab.size
        self.is_spm = vocab.model == "llama"
        if vocab.model not in ("gpt2", "llama"):
            raise TokenizerError(
                f"unsupported tokenizer.ggml.model {vocab.model!r} (supported: 'gpt2', 'llama')"
            )
        texts = vocab.tokens
        types = list(vocab.token_types)
        for i, t in enumerate(texts):
            if (t in _EOG_TEXTS or t in _FIM_TEXTS) and types[i] not in (CONTROL, UNKNOWN):
                types[i] = CONTROL  # as llama.cpp does, so they parse and decode as specials
            if t in _RENDERED_TEXTS:
                types[i] = USER_DEFINED  # harmony's frame: always in the text, as llama.cpp
        self._types = types

        # llama.cpp's default ids where the file names none: SPM <unk>=0, <s>=1, </s>=2
        def default(tid: int | None, spm_default: int) -> int | None:
            if tid is not None:
                return tid
            return spm_default if self.is_spm and spm_default < self.vocab_size else None

        self.bos_id: int | None = default(vocab.bos_id, 1)
        self.eos_id: int | None = default(vocab.eos_id, 2)
        self.unk_id: int | None = default(vocab.unk_id, 0)
        self.pad_id: int | None = vocab.pad_id
        self.eot_id: int | None = vocab.eot_id
        token_to_id = {t: i for i, t in enumerate(texts)}  # a repeated text: the last id wins
        self._token_to_id = token_to_id
        if self.eot_id is None:
            self.eot_id = next((token_to_id[t] for t in _EOT_TEXTS if t in token_to_id), None)
        eog = {token_to_id[t] for t in _EOG_TEXTS if t in token_to_id}
        eog |= {i for i in (self.eos_id, self.eot_id) if i is not None}
        end = token_to_id.get("<|end|>")
        ends = {texts[i] for i in eog}
        if end in eog and any(pair <= ends for pair in _TURN_ENDS):
            # harmony (gpt-oss): <|end|> closes a message (a thought, a preamble), the turn goes
            # on; <|return|> and <|call|> end it. llama.cpp drops it from its EOG set the same way.
            eog.discard(end)
            types[end] = USER_DEFINED
        self.eog_ids: frozenset[int] = frozenset(eog)
        self.add_bos = vocab.add_bos
        self.add_eos = vocab.add_eos

        if self.is_spm:
            self.add_space_prefix = (
                vocab.add_space_prefix if vocab.add_space_prefix is not None else True
            )
            self.clean_spaces = False
            self._hf = _build_spm(vocab, token_to_id, types, self.add_space_prefix)
        else:
            pre = vocab.pre
            if pre is None:
                log.warning("GGUF vocabulary has no tokenizer.ggml.pre; using 'default'")
                pre = "default"
            if pre not in _PRE:
                raise TokenizerError(
                    f"unknown tokenizer.ggml.pre {pre!r} (supported: {', '.join(sorted(_PRE))})"
                )
            regexes, ignore_merges, self.clean_spaces = _PRE[pre]
            self.add_space_prefix = bool(vocab.add_space_prefix)
            self._hf = _build_bpe(vocab, token_to_id, types, regexes, ignore_merges)
        # the same tokenizer with CONTROL texts read as plain text, built on first use
        self._hf_plain: HfTokenizer | None = None
        self._lock = threading.Lock()
        self._pieces = [self._piece(i) for i in range(self.vocab_size)]

    @classmethod
    def from_vocab(cls, vocab: Vocab) -> Tokenizer:
        return cls(vocab)

    @property
    def cache_words_limit(self) -> int:
        """The most words the BPE caches can hold: one per model built (the plain-text copy
        is made on first use, from the same model, with the library's default capacity)."""
        return BPE_CACHE_WORDS * (1 if self._hf_plain is None else 2)

    # -- encoding -------------------------------------------------------------------------------

    def encode(
        self,
        text: str,
        add_bos: bool | None = None,
        parse_special: bool = True,
        add_eos: bool | None = None,
    ) -> list[int]:
        """Token ids of ``text``.

        ``add_bos``/``add_eos`` None follow the vocabulary's add_bos/add_eos. A BOS is never
        doubled: when the text already starts with the BOS token, none is added.
        ``parse_special`` False reads CONTROL token texts (``<|im_start|>``) as plain text;
        USER_DEFINED tokens are matched either way, as in llama.cpp.
        """
        hf = self._hf if parse_special else self._plain()
        ids = hf.encode(text, add_special_tokens=False).ids if text else []
        if add_bos if add_bos is not None else self.add_bos:
            if self.bos_id is None:
                raise TokenizerError("a BOS token was asked for but the vocabulary has none")
            if not ids or ids[0] != self.bos_id:
                ids.insert(0, self.bos_id)
        if add_eos if add_eos is not None else self.add_eos:
            if self.eos_id is None:
                raise TokenizerError("an EOS token was asked for but the vocabulary has none")
            ids.append(self.eos_id)
        return ids

    def _plain(self) -> HfTokenizer:
        with self._lock:
            if self._hf_plain is None:
                plain = HfTokenizer.from_str(self._hf.to_str())
                plain.encode_special_tokens = True  # only special=True added tokens: CONTROL
                self._hf_plain = plain
            return self._hf_plain

    # -- decoding -------------------------------------------------------------------------------

    def _piece(self, tid: int) -> bytes:
        """llama.cpp's token_to_piece(special=True) for one token."""
        text, ttype = self.vocab.tokens[tid], self._types[tid]
        if ttype in _SPECIAL_TYPES:
            return text.encode()
        if ttype == NORMAL:
            if self.is_spm:
                return text.replace("▁", " ").encode()
            table = unicode_to_byte()
            try:
                return bytes(table[c] for c in text)
            except KeyError:
                # not a byte-level token text; llama.cpp prints an [UNK_BYTE_..] marker here
                return text.encode()
        if ttype == BYTE:
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError as e:
                raise TokenizerError(f"byte token {tid} has malformed text {text!r}") from e
        return b""  # UNUSED and undefined types render as nothing, as in llama.cpp

    def token_bytes(self, tid: int, special: bool = True) -> bytes:
        """The bytes token ``tid`` stands for; CONTROL/UNKNOWN tokens are b"" unless special."""
        if not 0 <= tid < self.vocab_size:
            raise TokenizerError(
                f"token id {tid} is outside the {self.vocab_size}-token vocabulary"
            )
        if not special and self._types[tid] in (CONTROL, UNKNOWN):
            return b""
        return self._pieces[tid]

    def token_id(self, text: str) -> int | None:
        """The id of the token whose text is exactly ``text`` (e.g. "<|im_end|>"), if any."""
        return self._token_to_id.get(text)

    def is_special(self, tid: int) -> bool:
        """CONTROL or UNKNOWN: rendered only when special tokens are asked for."""
        return self._types[tid] in (CONTROL, UNKNOWN)

    def decode(
        self, ids: Sequence[int], skip_special: bool = False, *, continuation: bool = False
    ) -> str:
        """Text of ``ids``, equal to llama.cpp's ``llama_detokenize(remove_special=False,
        unparse_special=not skip_special)``.

        For SentencePiece vocabularies the first token loses one leading space (the one the
        encoder added); "default"/Llama-3-style BPE vocabularies get llama.cpp's space clean-up
        (" ," -> ","). Pass ``continuation=True`` for ids that continue earlier text (generated
        tokens): then the pieces are joined as they are, as llama.cpp's server emits them and as
        ``stream_decoder`` does.
        """
        out = bytearray()
        for n, tid in enumerate(ids):
            piece = self.token_bytes(int(tid), special=not skip_special)
            if n == 0 and self.add_space_prefix and not continuation and piece[:1] == b" ":
                piece = piece[1:]
            out += piece
        if self.clean_spaces and not continuation:
            out = _clean_spaces(out)
        return out.decode("utf-8", errors="replace")

    def stream_decoder(
        self,
        skip_special: bool = True,
        errors: str = "replace",
        keep: frozenset[int] = frozenset(),
    ) -> StreamDecoder:
        """An incremental decoder for generated tokens; special tokens render as nothing unless
        ``skip_special`` is False or they are in ``keep`` (a tool-call marker). Its output joined
        equals ``decode(ids, skip_special, continuation=True)``. ``errors="ignore"`` drops invalid
        UTF-8 instead of writing U+FFFD, as llama-cpp-python's completions do."""
        return StreamDecoder(self, skip_special, errors, keep)


class StreamDecoder:
    """Turns generated token ids into text as they come, holding back an incomplete UTF-8
    sequence until the token that completes it arrives."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special: bool = True,
        errors: str = "replace",
        keep: frozenset[int] = frozenset(),
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special
        self._keep = keep
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors=errors)

    def push(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly "")."""
        special = not self._skip or token_id in self._keep
        return self._utf8.decode(self._tok.token_bytes(token_id, special=special))

    def flush(self) -> str:
        """The end of the stream: bytes still held back come out as U+FFFD (or are dropped)."""
        return self._utf8.decode(b"", final=True)


def _clean_spaces(text: bytearray) -> bytearray:
    """llama_detokenize's clean_up_tokenization_spaces for BPE vocabularies: drop the space
    before ?!., , around a lone apostrophe, and before 's 'm 're 've."""
    if not text:
        return text
    # 1: " ?" " !" " ." " ," -> the punctuation alone
    out = bytearray(text[:1])
    for i in range(1, len(text)):
        if text[i - 1] == 0x20 and text[i] in b"?!.,":
            out.pop()
        out.append(text[i])
    # 2: " ' " -> "'"
    src, out = out, bytearray(out[:1])
    i = 1
    while i < len(src):
        x = src[i]
        if x == 0x27 and i + 1 < len(src) and src[i - 1] == 0x20 and src[i + 1] == 0x20:
            out.pop()
            i += 1  # the space after is dropped too
        out.append(x)
        i += 1
    # 3: " 's" " 'm" " 're" " 've" -> without the space
    src, out = out, bytearray(out[:1])
    n = len(src)
    for i in range(1, n):
        x = src[i]
        if src[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = src[i + 1]
            if x1 in b"sm" or (i + 2 < n and src[i + 1 : i + 3] in (b"re", b"ve")):
                out.pop()
        out.append(x)
    return out


# ---------------------------------------------------------------------------------------------
# HF tokenizers construction


def _add_specials(hf: HfTokenizer, vocab: Vocab, types: list[int]) -> None:
    """Register CONTROL/UNKNOWN tokens as special (matched only when parse_special, through
    encode_special_tokens) and USER_DEFINED ones as plain added tokens (always matched)."""
    special, user = [], []
    for text, ttype in zip(vocab.tokens, types, strict=True):
        if ttype in _SPECIAL_TYPES and text:
            is_special = ttype != USER_DEFINED
            tok = AddedToken(text, special=is_special, normalized=False)
            (special if is_special else user).append(tok)
    hf.add_special_tokens(special)
    hf.add_tokens(user)


def _build_bpe(
    vocab: Vocab,
    token_to_id: dict[str, int],
    types: list[int],
    regexes: tuple[str, ...],
    ignore_merges: bool,
) -> HfTokenizer:
    if vocab.merges is None:
        raise TokenizerError("a gpt2 vocabulary needs tokenizer.ggml.merges")
    merges: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    dropped = 0
    for m in vocab.merges:
        # llama.cpp splits at the first space after the first character
        cut = m.find(" ", 1)
        if cut < 0:
            dropped += 1
            continue
        pair = (m[:cut], m[cut + 1 :])
        if pair in seen:
            continue  # llama.cpp keeps the first rank of a repeated merge
        if (
            pair[0] not in token_to_id
            or pair[1] not in token_to_id
            or (pair[0] + pair[1] not in token_to_id)
        ):
            dropped += 1
            continue
        seen.add(pair)
        merges.append(pair)
    if dropped:
        log.warning("ignored %d merges whose parts or result are not tokens", dropped)
    model = models.BPE(
        vocab=token_to_id,
        merges=merges,
        ignore_merges=ignore_merges,
        cache_capacity=BPE_CACHE_WORDS,
    )
    hf = HfTokenizer(model)
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
    )
    _add_specials(hf, vocab, types)
    return hf


def _spm_merges(vocab: Vocab, token_to_id: dict[str, int]) -> list[tuple[str, str]]:
    """llama.cpp's SPM loop as BPE merges: every (left, right) whose concatenation is a token,
    ranked by that token's score, best first. Where two candidate pairs tie on score the SPM
    loop takes the leftmost and BPE the lower rank; with distinct scores per token they agree."""
    scores = vocab.scores or [0.0] * vocab.size
    cands: list[tuple[float, int, int, str, str]] = []
    for text, tid in token_to_id.items():
        for k in range(1, len(text)):
            left, right = text[:k], text[k:]
            if left in token_to_id and right in token_to_id:
                cands.append((-scores[tid], tid, k, left, right))
    cands.sort()
    return [(left, right) for _, _, _, left, right in cands]


def _build_spm(
    vocab: Vocab, token_to_id: dict[str, int], types: list[int], add_space_prefix: bool
) -> HfTokenizer:
    unk = None
    if vocab.unk_id is not None:
        unk = vocab.tokens[vocab.unk_id]
    elif "<unk>" in token_to_id:
        unk = "<unk>"
    model = models.BPE(
        vocab=token_to_id,
        merges=_spm_merges(vocab, token_to_id),
        unk_token=unk,
        byte_fallback=True,
        cache_capacity=BPE_CACHE_WORDS,
    )
    hf = HfTokenizer(model)
    # normalizers run on each text fragment between special tokens, like llama.cpp's
    # "space prefix after every special token"
    steps = [normalizers.Replace(" ", "▁")]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend("▁"))
    hf.normalizer = normalizers.Sequence(steps)
    _add_specials(hf, vocab, types)
    return hf
