"""GGUF vocabularies as plain data, and deterministic vocabularies for test and demo models.

``Vocab`` holds exactly the ``tokenizer.*`` metadata of a GGUF file as Python values; turning it
into something that encodes text is ``engine.tokenizer``'s job. ``build_bpe_vocab`` (Qwen-like
byte-level BPE) and ``build_spm_vocab`` (Llama/Mixtral-like SentencePiece) train small real
vocabularies on a corpus generated here, so a demo model needs no download and every machine
builds the same bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import gguf
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from strata.engine.errors import TokenizerError

log = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type); the gguf package's enum under short names.
NORMAL = int(gguf.TokenType.NORMAL)  # 1
UNKNOWN = int(gguf.TokenType.UNKNOWN)  # 2
CONTROL = int(gguf.TokenType.CONTROL)  # 3
USER_DEFINED = int(gguf.TokenType.USER_DEFINED)  # 4
UNUSED = int(gguf.TokenType.UNUSED)  # 5
BYTE = int(gguf.TokenType.BYTE)  # 6

_K = gguf.Keys.Tokenizer

# The pre-tokenizers whose llama.cpp loader turns add_bos on when the file does not say.
_LLAMA3_PRES = frozenset(
    {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"}
)

# The split regex of Qwen2/Qwen3 (their tokenizer.json), also used to train the BPE vocabulary.
QWEN2_PRE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class Vocab:
    """The ``tokenizer.*`` metadata of a GGUF file, as Python values.

    Keys a file leaves out take llama.cpp's defaults where a field cannot say "absent": no
    token-type array means every token is NORMAL; no ``add_bos_token`` means True for
    SentencePiece and Llama-3-style BPE, False otherwise.
    """

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str | None  # tokenizer.ggml.pre, the pre-tokenizer (gpt2 only)
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None
    merges: list[str] | None  # "left right", in rank order (gpt2 only)
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    eot_id: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None
    add_space_prefix: bool | None = None  # tokenizer.ggml.add_space_prefix; None = not in file
    # other tokenizer.* keys of the file (eom/fim ids, huggingface.json ...): read, not written
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if len(self.token_types) != n:
            raise TokenizerError(
                f"{_K.TOKEN_TYPE} has {len(self.token_types)} entries for {n} tokens"
            )
        if self.scores is not None and len(self.scores) != n:
            raise TokenizerError(f"{_K.SCORES} has {len(self.scores)} entries for {n} tokens")
        for name in ("bos_id", "eos_id", "unk_id", "pad_id", "eot_id"):
            tid = getattr(self, name)
            if tid is not None and not 0 <= tid < n:
                raise TokenizerError(f"tokenizer {name}={tid} is outside the {n}-token vocabulary")

    @property
    def size(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any]) -> Vocab:
        """Build from a GGUF key -> Python value mapping (strings, ints, lists ...)."""
        model = md.get(_K.MODEL)
        if model is None:
            raise TokenizerError(f"the model file has no {_K.MODEL} key")
        model = _as_str(model)
        raw_tokens = md.get(_K.LIST)
        if raw_tokens is None:
            raise TokenizerError(f"the model file has no {_K.LIST} key")
        tokens = [_as_str(t) for t in raw_tokens]
        raw_types = md.get(_K.TOKEN_TYPE)
        types = [int(t) for t in raw_types] if raw_types is not None else [NORMAL] * len(tokens)
        raw_scores = md.get(_K.SCORES)
        scores = [float(s) for s in raw_scores] if raw_scores is not None else None
        raw_merges = md.get(_K.MERGES)
        merges = [_as_str(m) for m in raw_merges] if raw_merges is not None else None
        pre = md.get(_K.PRE)
        pre = _as_str(pre) if pre is not None else None

        def opt_id(key: str) -> int | None:
            v = md.get(key)
            return None if v is None else int(v)

        default_add_bos = model == "llama" or (model == "gpt2" and pre in _LLAMA3_PRES)
        add_bos = md.get(_K.ADD_BOS)
        add_eos = md.get(_K.ADD_EOS)
        prefix = md.get(_K.ADD_PREFIX)
        template = md.get(_K.CHAT_TEMPLATE)
        known = {
            _K.MODEL, _K.PRE, _K.LIST, _K.TOKEN_TYPE, _K.SCORES, _K.MERGES, _K.BOS_ID,
            _K.EOS_ID, _K.UNK_ID, _K.PAD_ID, _K.EOT_ID, _K.ADD_BOS, _K.ADD_EOS,
            _K.ADD_PREFIX, _K.CHAT_TEMPLATE,
        }  # fmt: skip
        extra = {k: v for k, v in md.items() if k.startswith("tokenizer.") and k not in known}
        return cls(
            model=model,
            pre=pre,
            tokens=tokens,
            token_types=types,
            scores=scores,
            merges=merges,
            bos_id=opt_id(_K.BOS_ID),
            eos_id=opt_id(_K.EOS_ID),
            unk_id=opt_id(_K.UNK_ID),
            pad_id=opt_id(_K.PAD_ID),
            eot_id=opt_id(_K.EOT_ID),
            add_bos=bool(add_bos) if add_bos is not None else default_add_bos,
            add_eos=bool(add_eos) if add_eos is not None else False,
            chat_template=_as_str(template) if template is not None else None,
            add_space_prefix=bool(prefix) if prefix is not None else None,
            extra=extra,
        )

    def write(self, writer: gguf.GGUFWriter) -> None:
        """Write every ``tokenizer.*`` key this vocabulary holds."""
        writer.add_tokenizer_model(self.model)
        if self.pre is not None:
            writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.token_types)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        if self.merges is not None:
            writer.add_token_merges(self.merges)
        for tid, add in (
            (self.bos_id, writer.add_bos_token_id),
            (self.eos_id, writer.add_eos_token_id),
            (self.unk_id, writer.add_unk_token_id),
            (self.pad_id, writer.add_pad_token_id),
            (self.eot_id, writer.add_eot_token_id),
        ):
            if tid is not None:
                add(tid)
        writer.add_add_bos_token(self.add_bos)
        writer.add_add_eos_token(self.add_eos)
        if self.add_space_prefix is not None:
            writer.add_add_space_prefix(self.add_space_prefix)
        if self.chat_template is not None:
            writer.add_chat_template(self.chat_template)


def _as_str(v: Any) -> str:
    if isinstance(v, bytes | bytearray | memoryview):
        return bytes(v).decode("utf-8")
    return str(v)


# ---------------------------------------------------------------------------------------------
# Byte-level BPE alphabet (GPT-2): every byte maps to one printable character.


@functools.cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character table: printable Latin-1 bytes map to themselves, the other 68
    bytes to U+0100.. in byte order, so no token text contains a space or a control character."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


@functools.cache
def unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_unicode().items()}


# ---------------------------------------------------------------------------------------------
# The built-in training corpus: English-like prose, chat turns, numbers, code, accents, CJK,
# emoji. Generated from a fixed-seed LCG (not `random`), so it is the same on every Python.

_WORDS = """
the of and to in is it that for was on are as with his they at be this from have or by one had
not but what all were when we there can an your which their said if do will each about how up
out them then she many some so these would other into has more her two like him see time could
no make than first been its who now people my made over did down only way find use may water
long little very after words called just where most know get through back much go good new
write our me man too any day same right look think also around another came come work three
word must because does part even place well such here take why things help put years different
away again off went old number great tell men say small every found still between name should
home big give air line set own under read last never us left end along while might next sound
below saw something thought both few those always show large often together asked house world
going want school important until form food keep children feet land side without boy once
animals life enough took sometimes four head above kind began almost live page got earth need
far hand high year mother light parts country father let night following picture being study
second eyes soon times story boys since white days ever paper hard near sentence better best
across during today others however sure means knew try told young miles sun ways thing whole
hear example heard several change answer room sea against top turned learn point city play
toward five using himself usually money seen car morning given open river minutes later
model models token tokens memory expert experts cache layer layers server request requests
daemon python function return value values string list print import class self error file
files data system user assistant hello question please thanks machine desktop video game
graphics driver kernel buffer chunk chunks slot slots address weights tensor tensors matrix
router prompt prompts context window stream decode encode vocabulary template message
above across action activity actually add address administration admit adult affect after
again against agency agent agree agreement ahead allow almost alone already although amount
analysis animal another answer anyone anything appear apply approach area argue arm arrive
article artist assume attack attention attorney audience author authority available avoid
baby ball bank beautiful become before begin behavior behind believe benefit beyond billion
blood board body book born break bring brother budget build building business buy camera
campaign cancer candidate capital career carry case catch cause cell center central century
certain certainly chair challenge chance character charge check choice choose church citizen
civil claim clear clearly close coach cold collection college color commercial common
community company compare computer concern condition conference congress consider consumer
contain continue control cost court cover create crime cultural culture current customer
debate decade decide decision deep defense degree democrat describe design despite detail
determine develop development difference difficult dinner direction director discover
discuss discussion disease doctor door dream drive economic economy edge education effect
effort eight either election employee energy environment especially establish evening event
evidence exactly exist expect experience explain factor family fast fear federal feeling
field fight figure final finally financial finger finish floor focus foreign forget former
forward free friend front full future garden general generation girl glass goal government
green ground group grow growth guess happen happy health heart heat heavy history hospital
hotel hour huge human hundred husband idea identify image imagine impact improve include
including increase indeed indicate individual industry information inside instead
institution interest international interview investment involve issue itself job join
""".split()

_CONTRACTIONS = (
    "don't", "can't", "won't", "it's", "I'm", "I'll", "I'LL", "we're", "they've", "she'd",
    "you're", "isn't", "that's", "let's", "DON'T", "He's", "We'll", "you'd", "they're",
)  # fmt: skip

_FOREIGN = (
    "café", "naïve", "résumé", "façade", "jalapeño", "über", "Zürich", "São Paulo", "crème",
    "brûlée", "Ångström", "smörgåsbord", "déjà vu", "piñata", "coöperate", "Ελλάδα", "Москва",
    "привет мир", "señor", "garçon", "Kraków", "İstanbul", "ﬁne",
)  # fmt: skip

_CJK = (
    "你好", "世界", "中文", "模型", "专家", "缓存", "日本語", "こんにちは", "東京", "한국어",
    "안녕하세요", "你好，世界！", "我们的模型很好。", "カタカナ", "ひらがな",
)  # fmt: skip

_EMOJI = ("🙂", "😀", "🚀", "👍", "❤️", "🎉", "🤖", "✨", "🔥", "✅", "👋🏽", "🇫🇷")

_CODE = (
    "def {a}_{b}(self, {c}):\n    if {c} is None:\n        return {d}\n"
    "    return self.{a}[{c}] + {n}\n",
    "for (int i = 0; i < {n}; i++) {{\n\t{a}[i] = {b}(i) * {m};\n}}\n",
    '{{"{a}": {n}, "{b}": "{c}", "{d}": [{m}, {n}, true, null]}}\n',
    "import {a}\nfrom {b} import {c}\n\nclass {A}{B}:\n    {c}_{d} = {n}\n",
    'x = [{n}, {m}]  # {a} {b}\nprint(f"{{x}} {c}")\n',
    "if ({a} && !{b}) return -{n};\nelse {c} += {m};\n",
)


class _Lcg:
    """64-bit linear congruential generator (Knuth's MMIX constants): tiny and portable."""

    def __init__(self, seed: int) -> None:
        self.state = seed & 0xFFFFFFFFFFFFFFFF

    def below(self, n: int) -> int:
        self.state = (self.state * 6364136223846793005 + 1442695040888963407) & (2**64 - 1)
        return (self.state >> 33) % n

    def pick(self, seq: Sequence[str]) -> str:
        return seq[self.below(len(seq))]

    def zipf_word(self) -> str:
        # u^2 skews towards the front of the list, a crude Zipf law
        u = self.below(1 << 20) / float(1 << 20)
        return _WORDS[int(u * u * len(_WORDS))]


def _number(rng: _Lcg) -> str:
    kind = rng.below(6)
    if kind == 0:
        return str(rng.below(10 ** (1 + rng.below(12))))  # up to 12 digits
    if kind == 1:
        return f"{rng.below(1000)}.{rng.below(100):02d}"
    if kind == 2:
        return str(1900 + rng.below(130))
    if kind == 3:
        return f"{rng.below(24):02d}:{rng.below(60):02d}"
    if kind == 4:
        return f"{rng.below(100)}%"
    return f"{rng.below(1000)},{rng.below(1000):03d}"


def _sentence(rng: _Lcg) -> str:
    words: list[str] = []
    for _ in range(4 + rng.below(12)):
        r = rng.below(100)
        if r < 8:
            words.append(rng.pick(_CONTRACTIONS))
        elif r < 14:
            words.append(_number(rng))
        elif r < 17:
            words.append(rng.pick(_FOREIGN))
        elif r < 19:
            words.append(rng.pick(_CJK))
        elif r < 20:
            words.append(rng.pick(_EMOJI))
        else:
            words.append(rng.zipf_word())
        if rng.below(12) == 0:
            words[-1] += rng.pick((",", ";", ":", " -"))
    words[0] = words[0][:1].upper() + words[0][1:]
    if rng.below(10) == 0:
        words[rng.below(len(words))] = f"({rng.zipf_word()})"
    return " ".join(words) + rng.pick((".", ".", ".", "?", "!", "...", "?!"))


def _code(rng: _Lcg) -> str:
    w = [rng.zipf_word() for _ in range(4)]
    return rng.pick(_CODE).format(
        a=w[0], b=w[1], c=w[2], d=w[3], A=w[0].title(), B=w[1].title(),
        n=rng.below(1000), m=rng.below(100),
    )  # fmt: skip


def _pseudo_words(rng: _Lcg, n: int) -> list[str]:
    onsets = ("b", "br", "c", "ch", "d", "f", "g", "gr", "k", "l", "m", "n", "p", "r", "s",
              "st", "t", "tr", "v", "z", "th", "sh", "")  # fmt: skip
    nuclei = ("a", "e", "i", "o", "u", "ai", "ou", "ea")
    codas = ("", "", "n", "r", "s", "l", "th", "nd", "x")
    words = []
    for _ in range(n):
        syl = [
            rng.pick(onsets) + rng.pick(nuclei) + rng.pick(codas) for _ in range(2 + rng.below(2))
        ]
        words.append("".join(syl))
    return words


def demo_corpus(n_paragraphs: int = 300, seed: int = 20240611) -> list[str]:
    """The built-in training text, one string per paragraph (about 77 KB)."""
    rng = _Lcg(seed)
    out = []
    # made-up names, each used a few times: they give the vocabulary its rarer merges
    names = _pseudo_words(rng, 500)
    for i in range(0, len(names), 10):
        group = names[i : i + 10]
        out.append(" ".join(group) + ". " + " ".join(w.title() for w in group) + ".\n")
        out.append(" ".join(reversed(group)) + "!\n")
    for _ in range(n_paragraphs):
        if rng.below(5) == 0:
            out.append(_code(rng))
        else:
            para = " ".join(_sentence(rng) for _ in range(1 + rng.below(5)))
            if rng.below(4) == 0:
                para = "  " + para + "\n"
            out.append(para + "\n")
    # every vocabulary word at least twice, so all of them can become tokens
    for _ in range(2):
        out.append(" ".join(_WORDS) + "\n" + " ".join(w.title() for w in _WORDS) + "\n")
    return out


# ---------------------------------------------------------------------------------------------
# Builders


BPE_MERGES = 2400  # merges learnt for the byte-level vocabulary (>= 2000)
SPM_PIECES = 2000  # merged pieces learnt for the SentencePiece vocabulary

CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

INST_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if messages and messages[0]['role'] == 'system' %}\n"
    "{%- set system = messages[0]['content'] + '\\n\\n' %}\n"
    "{%- set turns = messages[1:] %}\n"
    "{%- else %}\n"
    "{%- set system = '' %}\n"
    "{%- set turns = messages %}\n"
    "{%- endif %}\n"
    "{%- for message in turns %}\n"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "{{- raise_exception('after an optional system message, roles must alternate"
    " user/assistant/user/...') }}\n"
    "{%- endif %}\n"
    "{%- if message['role'] == 'user' %}\n"
    "{{- '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}\n"
    "{%- elif message['role'] == 'assistant' %}\n"
    "{{- message['content'] + eos_token }}\n"
    "{%- else %}\n"
    "{{- raise_exception('unsupported role: ' + message['role']) }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
)


# Qwen3's prompt format with tools (its own template's wording of the tool instructions, the
# <tools> list, <tool_call> blocks and <tool_response> turns), without its reasoning handling:
# the demo model's template, so that ``strata serve`` shows tool calls the Qwen way.
QWEN3_TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not loop.first %}{{- '<|im_start|>system\n' + message.content + '<|im_end|>\n' }}{%- endif %}
{%- elif message.role == 'user' %}
{{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' + message.content }}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{%- if message.content or not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}
{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- else %}
{{- raise_exception('unsupported role: ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

# Mistral's v3 prompt format with tools: [AVAILABLE_TOOLS] before the last user turn, calls as
# [TOOL_CALLS] [{"name", "arguments", "id"}], results as [TOOL_RESULTS] {...}[/TOOL_RESULTS];
# call ids of 9 letters and digits, as Mistral's templates insist.
MISTRAL_TOOL_TOKENS = (
    "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
)  # fmt: skip
MISTRAL_TOOLS_TEMPLATE = r"""{{- bos_token }}
{%- if messages and messages[0].role == 'system' %}
{%- set system = messages[0].content %}{%- set turns = messages[1:] %}
{%- else %}
{%- set system = none %}{%- set turns = messages %}
{%- endif %}
{%- set last = namespace(user=-1) %}
{%- for m in turns %}
{%- if m.role == 'user' %}{%- set last.user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for m in turns %}
{%- if m.role == 'user' %}
{%- if tools and loop.index0 == last.user %}
{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}
{%- endif %}
{%- set head = system + '\n\n' if system is not none and loop.index0 == last.user else '' %}
{{- '[INST] ' + head + m.content + ' [/INST]' }}
{%- elif m.role == 'assistant' %}
{%- if m.tool_calls %}
{{- '[TOOL_CALLS] [' }}
{%- for c in m.tool_calls %}
{%- if c.id is not defined or c.id | length != 9 %}
{{- raise_exception('tool call ids must be 9 letters or digits') }}
{%- endif %}
{{- {'name': c.function.name, 'arguments': c.function.arguments, 'id': c.id} | tojson }}
{%- if not loop.last %}{{- ', ' }}{%- endif %}
{%- endfor %}
{{- ']' + eos_token }}
{%- else %}
{{- m.content + eos_token }}
{%- endif %}
{%- elif m.role == 'tool' %}
{{- '[TOOL_RESULTS] ' + ({'content': m.content, 'call_id': m.tool_call_id} | tojson) }}
{{- '[/TOOL_RESULTS]' }}
{%- else %}
{{- raise_exception('unsupported role: ' + m.role) }}
{%- endif %}
{%- endfor %}
"""


def _trained(tok: Tokenizer) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of a trained ``tokenizers`` BPE model, merges in rank order."""
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges  # type: ignore[return-value]


QWEN3_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>",
    "</think>",
)  # fmt: skip


def build_bpe_vocab() -> Vocab:
    """A Qwen-like byte-level BPE vocabulary: pre "qwen2", ChatML template, no BOS added.

    Layout (ids): the 256 byte characters, one token per learnt merge in rank order, then
    Qwen3's added tokens in Qwen3's order (``QWEN3_SPECIALS``).
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=256 + BPE_MERGES,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(demo_corpus(), trainer=trainer)
    _, merges = _trained(tok)
    if len(merges) < 2000:
        raise AssertionError(f"the built-in corpus only supports {len(merges)} merges")

    tokens = sorted(byte_to_unicode().values(), key=ord)  # GPT-2 order of the byte characters
    seen = set(tokens)
    for a, b in merges:
        if a + b not in seen:
            seen.add(a + b)
            tokens.append(a + b)
    types = [NORMAL] * len(tokens)
    first_special = len(tokens)
    for text in QWEN3_SPECIALS:
        tokens.append(text)
        # as Qwen3's converter types them: <|...|> CONTROL, the tag-like ones USER_DEFINED
        types.append(CONTROL if text.startswith("<|") else USER_DEFINED)
    return Vocab(
        model="gpt2",
        pre="qwen2",
        tokens=tokens,
        token_types=types,
        scores=None,
        merges=[f"{a} {b}" for a, b in merges],
        bos_id=first_special,  # <|endoftext|>, as Qwen's GGUFs set it (never added: add_bos False)
        eos_id=first_special + 2,  # <|im_end|>
        unk_id=None,
        pad_id=first_special,
        eot_id=None,
        add_bos=False,
        add_eos=False,
        chat_template=CHATML_TEMPLATE,
    )


def _spm_lines() -> Iterator[str]:
    # SentencePiece sees one sentence per line, without newlines or tabs (those become bytes)
    for para in demo_corpus():
        for line in para.replace("\t", " ").split("\n"):
            if line.strip():
                yield "▁" + line.replace(" ", "▁")


def build_spm_vocab() -> Vocab:
    """A Llama/Mixtral-like SentencePiece vocabulary: <unk> <s> </s>, 256 byte tokens, pieces
    with "▁" for spaces, Mixtral's [INST] template, BOS added.

    Pieces come from a BPE trained on "▁"-joined text; a merged piece scores -rank of the merge
    that made it, single characters score below every merge. With those scores llama.cpp's SPM
    algorithm (repeatedly join the adjacent pair whose concatenation is the best-scoring token)
    reproduces the training merges.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            # a word is a run of "▁" and what follows; digits stay single, like Llama's split_digits
            pre_tokenizers.Split(Regex("▁*[^▁]+|▁+"), behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=True),
        ]
    )
    trainer = trainers.BpeTrainer(vocab_size=10_000, min_frequency=2, show_progress=False)
    tok.train_from_iterator(_spm_lines(), trainer=trainer)
    vocab, merges = _trained(tok)
    merges = merges[:SPM_PIECES]
    if len(merges) < SPM_PIECES:
        raise AssertionError(f"the built-in corpus only supports {len(merges)} SPM merges")

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    scores = [0.0] * len(tokens)
    seen = set(tokens)
    for rank, (a, b) in enumerate(merges):
        if a + b not in seen:
            seen.add(a + b)
            tokens.append(a + b)
            types.append(NORMAL)
            scores.append(-float(rank))
    chars = sorted((t for t in vocab if len(t) == 1 and t not in seen), key=ord)
    for i, ch in enumerate(chars):
        tokens.append(ch)
        types.append(NORMAL)
        scores.append(-float(len(merges) + i))
    return Vocab(
        model="llama",
        pre=None,
        tokens=tokens,
        token_types=types,
        scores=scores,
        merges=None,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=None,
        eot_id=None,
        add_bos=True,
        add_eos=False,
        chat_template=INST_TEMPLATE,
    )


def build_mistral_tools_vocab() -> Vocab:
    """``build_spm_vocab`` with Mistral's tool tokens (control tokens, as in Mistral's v3
    tokenizer) and the template that uses them (``MISTRAL_TOOLS_TEMPLATE``)."""
    v = build_spm_vocab()
    n = len(MISTRAL_TOOL_TOKENS)
    assert v.scores is not None
    return dataclasses.replace(
        v,
        tokens=[*v.tokens, *MISTRAL_TOOL_TOKENS],
        token_types=[*v.token_types, *[CONTROL] * n],
        scores=[*v.scores, *[0.0] * n],
        chat_template=MISTRAL_TOOLS_TEMPLATE,
    )


def pad_vocab(vocab: Vocab, size: int) -> Vocab:
    """``vocab`` with UNUSED ``[PAD<id>]`` tokens appended up to ``size`` (real-shape models)."""
    n = len(vocab.tokens)
    if size < n:
        raise ValueError(f"vocab_size={size} is smaller than the {n}-token vocabulary")
    extra = size - n
    return dataclasses.replace(
        vocab,
        tokens=[*vocab.tokens, *(f"[PAD{i}]" for i in range(n, size))],
        token_types=[*vocab.token_types, *[int(gguf.TokenType.UNUSED)] * extra],
        scores=None if vocab.scores is None else [*vocab.scores, *[0.0] * extra],
    )
