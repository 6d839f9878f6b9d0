"""Grammar-constrained decoding: llguidance over the GGUF vocabulary, one token mask per step.

A :class:`GrammarSpec` says what the output must match: a JSON Schema, or a Lark grammar (which
may inline JSON Schemas with ``%json {...}`` and name special tokens as ``<[id]>``), optionally
*lazy*: free text until a trigger string appears, the grammar from there on (a tool call that
the model starts on its own). :meth:`Grammars.compile` checks it against the vocabulary — a
schema feature llguidance does not implement is a :class:`GrammarError` naming it, never a
silent ignore — and returns a :class:`Constraint`, the per-request matcher: before each step it
fills a bitmask of the allowed tokens in host memory (one bit per token), and it is told each
token sampled. :class:`TokenMask` applies the bitmask to the logits where they are (the GPU on
the fast path), before the sampler's filters, so top-k, top-p and min-p only see allowed tokens.

Why llguidance (llama.cpp's choice too), of the three libraries measured (the numbers are in
``docs/structured-output.md``): it refuses the JSON Schema features it cannot enforce
(``Unimplemented keys: ["uniqueItems"]``) where xgrammar ignored six of them and let invalid
output through; it compiles a schema in about a millisecond where outlines-core took seconds on
a 152k-token vocabulary; its masks cost tens of microseconds a token there; and it is one wheel
with no dependencies.

JSON is written on one line with ``", "`` and ``": "`` between items (``JSON_FORMAT``), as
``json.dumps`` and the chat templates' ``tojson`` write it: whitespace is not the model's to
choose, so a random or a weak model cannot wander off into blank space. (No torch at import:
the tool-call formats build their grammars here, in plain Python.)
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from strata.engine.errors import EngineError

if TYPE_CHECKING:
    import llguidance
    import torch

    from strata.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# How constrained JSON is written (llguidance's JSON compile options, given as overrides so that
# a schema's own "x-guidance" cannot loosen them; "lenient" would ignore unknown features).
JSON_FORMAT: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
}
# The same, for schemas that are only checked, never enforced (a non-strict tool in "auto"
# mode): a feature llguidance cannot enforce is no error there.
_CHECK_ONLY = {**JSON_FORMAT, "lenient": True}


class GrammarError(EngineError):
    """A grammar or JSON Schema that cannot be enforced; the message says why (and names the
    schema feature where one is unsupported)."""


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match. ``kind`` ``json_schema``: ``source`` is the schema (a dict);
    ``lark``: a Lark grammar (text). ``trigger``: free text until the output contains it, then
    the grammar must match the text that follows it (llama.cpp's lazy grammars)."""

    kind: Literal["json_schema", "lark"]
    source: Any
    trigger: str | None = None
    start_after: str | None = None  # free text until this, then the trigger is looked for

    @classmethod
    def json(cls, schema: dict[str, Any]) -> GrammarSpec:
        return cls("json_schema", schema)

    def after(self, text: str) -> GrammarSpec:
        """The same grammar, lazy: free output until ``text`` (the end of a thought), then this
        grammar, blank space allowed before it. A grammar already lazy looks for its own trigger
        only after ``text`` (a call marker inside the thought starts nothing). An
        :class:`AnswerFrame` instead of a text wraps the grammar as the frame says."""
        if isinstance(text, AnswerFrame):
            return text.wrap(self)
        if self.trigger is not None:
            return GrammarSpec(self.kind, self.source, self.trigger, text)
        if self.kind == "json_schema":
            body = f"start: {json_schema_lark(self.source)}\n"
        else:
            body = str(self.source)
        # our Lark grammars name their first rule "start": it becomes the rule after the space
        inner = re.sub(r"^start:", "after_thought:", body, flags=re.MULTILINE)
        return GrammarSpec("lark", f"start: BLANK? after_thought\nBLANK: /[ \\t\\n]+/\n{inner}",
                           trigger=text)  # fmt: skip


class AnswerFrame(str, ABC):
    """Where the answer begins in a reply whose format frames it (harmony's ``final`` channel,
    ``engine.harmony``), given where a closing text would be: it says itself how a grammar of
    the answer applies to the whole reply. Its text is the frame's opening (for logs)."""

    @abstractmethod
    def wrap(self, spec: GrammarSpec) -> GrammarSpec:
        """``spec``, a grammar of the answer, as a grammar of the whole reply."""


def closed(schema: Any) -> Any:
    """``schema`` as llama.cpp reads it: an object schema that lists ``properties`` and says
    nothing of ``additionalProperties`` admits no other keys (JSON Schema itself would admit any;
    clients such as LangChain and the ``openai`` helpers send such schemas and expect only the
    listed keys back). Applied to every object schema inside (properties, items, definitions,
    alternatives), except the members of an ``allOf`` and an object that has one: closing those
    one by one would forbid each other's keys. Returns a copy; ``schema`` is left as it is."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: closed(v) for k, v in value.items()}
        elif key in _SCHEMA_VALUES:
            out[key] = closed(value)
        else:
            out[key] = value  # const, enum, examples, allOf: data or parts left as they are
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and "unevaluatedProperties" not in schema
        and "allOf" not in schema
        and schema.get("type", "object") in ("object", ["object"])
    ):
        out["additionalProperties"] = False
    return out


# the keywords whose value is a schema or a list of schemas, and those whose value maps names to
# schemas (JSON Schema 2020-12 and draft 7)
_SCHEMA_VALUES = frozenset({"items", "prefixItems", "additionalItems", "anyOf", "oneOf", "not",
                            "additionalProperties", "if", "then", "else", "contains"})  # fmt: skip
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties",
                          "dependentSchemas"})  # fmt: skip


def json_schema_lark(schema: dict[str, Any]) -> str:
    """``schema`` as a Lark expression (``%json {...}``) written with ``JSON_FORMAT``, read as
    llama.cpp reads it (:func:`closed`)."""
    return "%json " + json.dumps({**closed(schema), "x-guidance": JSON_FORMAT},
                                 ensure_ascii=False)  # fmt: skip


def lark_string(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


class Grammars:
    """Compiles grammars for one tokenizer. The llguidance tokenizer (every token's bytes, the
    special ones marked) is built on first use — about 0.4 s for a 152k-token vocabulary — and
    shared by every request after that. Thread-safe."""

    def __init__(self, tokenizer: Tokenizer, n_vocab: int) -> None:
        self.tokenizer = tokenizer
        self.n_vocab = max(n_vocab, tokenizer.vocab_size)  # the logits' length
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def ll(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                t0 = time.perf_counter()
                self._ll = _ll_tokenizer(self.tokenizer, self.n_vocab)
                log.debug(
                    "built the grammar tokenizer in %.0f ms", (time.perf_counter() - t0) * 1e3
                )
            return self._ll

    def special_token(self, text: str) -> str | None:
        """``<[id]>`` when ``text`` is one special (control) token of the vocabulary: a grammar
        must name such a token, as its text is not what the token stands for."""
        tid = self.tokenizer.token_id(text)
        if tid is not None and self.tokenizer.is_special(tid):
            return f"<[{tid}]>"
        return None

    def check_schema(self, schema: Any, enforced: bool = True) -> None:
        """Raise :class:`GrammarError` when ``schema`` is not a JSON Schema llguidance can read;
        ``enforced``: also when it has a feature that cannot be enforced."""
        self._validate(_json_grammar(schema, JSON_FORMAT if enforced else _CHECK_ONLY))

    def compile(self, spec: GrammarSpec) -> Constraint:
        """The matcher for one request; raises :class:`GrammarError`."""
        import llguidance as llg

        if spec.kind == "json_schema":
            grammar = _json_grammar(spec.source, JSON_FORMAT)
        elif spec.kind == "lark":
            grammar = llg.LLMatcher.grammar_from_lark(spec.source)
        else:
            raise GrammarError(f"unknown grammar kind {spec.kind!r}")
        self._validate(grammar)
        return Constraint(self, grammar, spec.trigger, spec.start_after)

    def _validate(self, grammar: str) -> None:
        import llguidance as llg

        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.ll)
        if failed:
            raise GrammarError(_short(messages[0]))

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        import llguidance as llg

        m = llg.LLMatcher(self.ll, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(_short(m.get_error()))
        return m


def _json_grammar(schema: Any, options: dict[str, Any]) -> str:
    import llguidance as llg

    if not isinstance(schema, dict | bool):
        raise GrammarError(f"a JSON Schema is an object, not {type(schema).__name__}")
    try:
        return llg.LLMatcher.grammar_from_json_schema(closed(schema), overrides=options)
    except ValueError as e:
        raise GrammarError(_short(str(e))) from None


def _short(message: str) -> str:
    """llguidance's first line, without its dump of the parser state."""
    first = message.strip().splitlines()[0] if message.strip() else "invalid grammar"
    return first.removeprefix("Parser Error: ")


def _ll_tokenizer(tokenizer: Tokenizer, n_vocab: int) -> llguidance.LLTokenizer:
    """Every token as the bytes it stands for; control, unknown and unused tokens (and ids past
    the vocabulary, where the output matrix has padding rows) as special: ``\\xff`` + name, which
    no text matches, as llguidance's Hugging Face adaptor marks them."""
    import llguidance as llg

    from strata.engine.vocab import BYTE, UNUSED

    types = tokenizer.vocab.token_types
    texts = tokenizer.vocab.tokens
    tokens: list[bytes] = []
    special: list[int] = []
    for tid in range(n_vocab):
        if tid >= tokenizer.vocab_size:
            tokens.append(f"\xff[UNUSED{tid}]".encode("latin-1", "replace"))
            special.append(tid)
        elif tokenizer.is_special(tid) or types[tid] == UNUSED:
            tokens.append(b"\xff" + texts[tid].encode())
            special.append(tid)
        else:
            tokens.append(tokenizer.token_bytes(tid))
    eog = sorted(tokenizer.eog_ids) or [n_vocab - 1]
    by_bytes: dict[bytes, int] = {}  # a piece over a byte token where both spell the bytes
    skip = set(special)
    for tid, raw in enumerate(tokens):
        if tid not in skip and (raw not in by_bytes or types[by_bytes[raw]] == BYTE):
            by_bytes[raw] = tid
    longest = max(map(len, by_bytes), default=1)

    def greedy(raw: bytes) -> list[int]:
        out, at = [], 0
        while at < len(raw):
            for n in range(min(longest, len(raw) - at), 0, -1):
                tid = by_bytes.get(raw[at : at + n])
                if tid is not None:
                    out.append(tid)
                    at += n
                    break
            else:  # a byte no token stands for (a vocabulary without byte tokens)
                at += 1
        return out

    def spelled(ids: list[int]) -> bytes:
        return b"".join(tokens[i] for i in ids)

    def tokenize(text: str | bytes) -> list[int]:
        # llguidance forces the tokenization of the bytes a grammar fixes, so it must spell
        # exactly them. The tokenizer's own does, but for SentencePiece's added leading space:
        # there, the text after a newline (which no piece crosses) is tokenized as mid-text.
        raw = text if isinstance(text, bytes) else text.encode()
        s = raw.decode("utf-8", "replace")
        ids = tokenizer.encode(s, add_bos=False, parse_special=False, add_eos=False)
        if spelled(ids) == raw:
            return ids
        ids = tokenizer.encode("\n" + s, add_bos=False, parse_special=False, add_eos=False)
        for k in (1, 2):
            if spelled(ids[:k]) in (b"\n", b" \n") and spelled(ids[k:]) == raw:
                return ids[k:]
        return greedy(raw)

    end = tokenizer.eot_id if tokenizer.eot_id is not None else tokenizer.eos_id
    end = eog[0] if end is None or end not in eog else end  # the end of a turn, first

    class _Wrapper:  # what llguidance.TokenizerWrapper reads
        eos_token_id = end
        bos_token_id = tokenizer.bos_id
        special_token_ids = special

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, text: str | bytes) -> list[int]:
            return tokenize(text)

    wrapper = llg.TokenizerWrapper(_Wrapper())
    try:
        return llg.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=eog)
    except TypeError:  # older llguidance (1.6) takes one end token: the turn's end
        return llg.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=end)


class Constraint:
    """One request's grammar state. Per step: ``fill(words)`` (False: nothing constrains this
    step, the lazy grammar has not started), then ``accept(token)``. ``done``: only an
    end-of-generation token may follow (the generation can end here). ``mask_s``/``masks``:
    time spent computing masks, for the bench and the log."""

    def __init__(
        self, grammars: Grammars, grammar: str, trigger: str | None = None, after: str | None = None
    ) -> None:
        self._grammars = grammars
        self._grammar = grammar
        self._trigger = trigger.encode() if trigger else None
        self._after = after.encode() if after else None  # waited for first, then the trigger
        self._text = bytearray()  # generated bytes, while a lazy grammar waits for its trigger
        lazy = trigger is not None or after is not None
        self._matcher = grammars.matcher(grammar) if not lazy else None
        self.mask_s = 0.0
        self.masks = 0
        self.error: str | None = None

    @property
    def active(self) -> bool:
        return self._matcher is not None

    @property
    def done(self) -> bool:
        m = self._matcher
        return m is not None and (m.is_stopped() or m.is_error())

    def fill(self, words: torch.Tensor) -> bool:
        """Write the allowed tokens of the next step into ``words`` (int32 on the host, one bit per
        token, at least ``ceil(n_vocab / 32)`` of them); False when this step is free."""
        m = self._matcher
        if m is None:
            return False
        t0 = time.perf_counter()
        m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())
        self.mask_s += time.perf_counter() - t0
        self.masks += 1
        if m.is_error():
            self._fail(m.get_error())
        return True

    def accept(self, token: int) -> None:
        m = self._matcher
        if m is not None:
            if not m.consume_token(token):
                self._fail(m.get_error())
            return
        self._text += self._grammars.tokenizer.token_bytes(token)
        if self._after is not None:
            if not self._passed(self._after):
                return
            self._after = None
        if self._trigger is None:
            self._start(bytes(self._text))
        elif self._passed(self._trigger):
            self._start(bytes(self._text))

    def _passed(self, mark: bytes) -> bool:
        """Whether the text waited on holds ``mark``: then only what follows it is kept; else
        only a tail that may still begin it."""
        at = self._text.find(mark)
        if at >= 0:
            del self._text[: at + len(mark)]
            return True
        del self._text[: max(0, len(self._text) - (len(mark) - 1))]
        return False

    def _start(self, rest: bytes) -> None:
        """The trigger appeared: the grammar takes over, first for the bytes after it."""
        self._text.clear()
        m = self._grammars.matcher(self._grammar)
        self._matcher = m
        if rest and not m.consume_tokens(self._grammars.ll.tokenize_bytes(rest)):
            self._fail(m.get_error())

    def _fail(self, message: str) -> None:
        if self.error is None:
            self.error = _short(message)
            log.warning("the grammar stopped matching (%s): the generation ends here", self.error)


class TokenMask:
    """Applies a host bitmask to logits on their device: the words go over in one copy from
    page-locked memory (queued behind the step that computes the logits), then one masked fill
    sets every disallowed logit to -inf. Owned by the runner, sized for the vocabulary once."""

    def __init__(self, n_vocab: int, device: torch.device) -> None:
        import torch

        n_words = (n_vocab + 31) // 32
        cuda = device.type == "cuda"
        self.host = torch.zeros(n_words, dtype=torch.int32, pin_memory=cuda)
        self.words = (
            self.host if not cuda else torch.zeros(n_words, dtype=torch.int32, device=device)
        )
        ids = torch.arange(n_vocab, device=device)
        self.word = ids // 32  # [V] which word holds each token's bit
        self.bit = (ids % 32).to(torch.int32)  # [V] and where in it

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [V] with every token whose bit is clear at -inf (in place)."""
        if self.words is not self.host:
            self.words.copy_(self.host, non_blocking=True)
        allowed = (self.words[self.word] >> self.bit) & 1
        return logits.masked_fill_(allowed == 0, float("-inf"))
