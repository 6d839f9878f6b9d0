"""llama-server's extras: ``/tokenize``, ``/detokenize``, ``/apply-template``, ``/props``.

The request and response shapes are llama-server's (its README), so its tools and scripts work
against Strata: ``/tokenize`` takes ``content`` with ``add_special``, ``parse_special`` and
``with_pieces`` and answers ``{"tokens": [...]}``; ``/detokenize`` takes ``tokens`` and answers
``{"content": ...}``; ``/apply-template`` takes a chat request's ``messages`` (and its tools and
reasoning fields) and answers ``{"prompt": ...}``, the text a chat request would start from;
``GET /props`` describes the model and the defaults. Errors are OpenAI-shaped, as llama-server's.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from strata.daemon.api.api_errors import invalid, wrong_type
from strata.daemon.api.openai_api import chat_from, chat_prompt_text, json_object
from strata.daemon.api.openai_messages import check_text
from strata.daemon.api.serving import Serving
from strata.daemon.json_types import JSONObject
from strata.engine.errors import TokenizerError
from strata.engine.params import SamplingParams

if TYPE_CHECKING:
    from strata.engine.generate import Engine
    from strata.engine.tokenizer import Tokenizer

PATHS = ("/tokenize", "/detokenize", "/apply-template", "/props")
MAX_DETOKENIZE = 1_000_000  # ids in one /detokenize: far above any context window


def _flag(raw: dict[str, Any], name: str, default: bool) -> bool:
    value = raw.get(name, default)
    if not isinstance(value, bool):
        raise wrong_type(name, "a boolean", value)
    return value


def tokenize(raw: JSONObject, tokenizer: Tokenizer) -> JSONObject:
    content = raw.get("content")
    if content is None:
        raise invalid("content: missing required field", "content")
    if not isinstance(content, str):
        raise wrong_type("content", "a string", content)
    check_text(content, "content")
    add_special = _flag(raw, "add_special", False)
    parse_special = _flag(raw, "parse_special", True)
    with_pieces = _flag(raw, "with_pieces", False)
    try:  # add_special: BOS (and EOS) as the vocabulary asks for them; without: none
        ids = tokenizer.encode(content, add_bos=None if add_special else False,
                               parse_special=parse_special,
                               add_eos=None if add_special else False)  # fmt: skip
    except TokenizerError as e:
        raise invalid(f"content: {e}", "content") from None
    if not with_pieces:
        return {"tokens": ids}
    return {"tokens": [{"id": t, "piece": _piece(tokenizer.token_bytes(t))} for t in ids]}


def _piece(data: bytes) -> str | list[int]:
    """A token's text, or its bytes where they are not whole UTF-8 (as llama-server sends)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


def detokenize(raw: JSONObject, tokenizer: Tokenizer) -> JSONObject:
    tokens = raw.get("tokens")
    if tokens is None:
        raise invalid("tokens: missing required field", "tokens")
    if not isinstance(tokens, list):
        raise wrong_type("tokens", "a list of token ids", tokens)
    if len(tokens) > MAX_DETOKENIZE:
        raise invalid(f"tokens: more than {MAX_DETOKENIZE} ids", "tokens")
    size = tokenizer.vocab_size
    for i, t in enumerate(tokens):
        if type(t) is not int:
            raise wrong_type(f"tokens[{i}]", "a token id (an integer)", t)
        if not 0 <= t < size:
            raise invalid(f"tokens[{i}]: token id {t} is outside the {size}-token vocabulary",
                          f"tokens[{i}]", "invalid_value")  # fmt: skip
    return {"content": tokenizer.decode(tokens)}


def props(serving: Serving, engine: Engine) -> JSONObject:
    d = SamplingParams()
    template = engine.template
    path = serving.daemon.model_path
    params = {"n_predict": -1, "seed": -1, "temperature": d.temperature, "top_k": d.top_k,
              "top_p": d.top_p, "min_p": d.min_p, "repeat_penalty": d.repeat_penalty,
              "repeat_last_n": d.repeat_last_n, "presence_penalty": 0.0,
              "frequency_penalty": 0.0, "stop": [], "ignore_eos": d.ignore_eos,
              "n_probs": 0}  # fmt: skip
    return {
        "default_generation_settings": {"n_ctx": engine.n_ctx, "params": params},
        "total_slots": 1,  # one generation at a time; others wait in the queue
        "model_alias": serving.daemon.model_id,
        "model_path": str(path) if path else "",
        "chat_template": template.source if template is not None else "",
        "modalities": {"vision": False, "audio": False},
        "build_info": serving.fingerprint,
        "is_sleeping": False,
    }


def add_routes(app: FastAPI, serving: Serving) -> None:
    @app.post("/tokenize")
    async def post_tokenize(request: Request) -> dict[str, Any]:
        raw = json_object(await request.body())
        return await asyncio.to_thread(tokenize, raw, serving.engine().tokenizer)

    @app.post("/detokenize")
    async def post_detokenize(request: Request) -> dict[str, Any]:
        raw = json_object(await request.body())
        return await asyncio.to_thread(detokenize, raw, serving.engine().tokenizer)

    @app.post("/apply-template")
    async def post_apply_template(request: Request) -> dict[str, Any]:
        raw = json_object(await request.body())
        raw.setdefault("model", "")  # llama-server's request names no model
        req = chat_from(raw, serving.config.max_stop_sequences)
        eng = serving.engine()
        text = await asyncio.to_thread(chat_prompt_text, req, eng, serving.reasoning)
        return {"prompt": text}

    @app.get("/props")
    async def get_props() -> dict[str, Any]:
        return props(serving, serving.engine())
