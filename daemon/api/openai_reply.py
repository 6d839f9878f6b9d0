"""The OpenAI reply: what every body and chunk of one response shares (:class:`Reply`), the
usage, a server-sent event, the ``Retry-After`` of a full queue, and log-probabilities as OpenAI
writes them."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from strata.daemon.api.api_errors import (  # ApiError and error_body: imported from here too
    ApiError,  # noqa: F401
    error_body,  # noqa: F401
)
from strata.daemon.api.openai_models import model_not_found  # noqa: F401 (imported from here too)
from strata.daemon.api.openai_tools import (
    chat_logprobs,
    completion_logprobs,
    tool_calls_json,
)
from strata.daemon.json_types import JSONObject
from strata.engine.tool_calls import ToolCall

if TYPE_CHECKING:
    from strata.daemon.api.openai_api import Parsed
    from strata.engine.generation import TokenLogprob
    from strata.engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class Reply:
    """What every body and chunk of one response shares."""

    kind: Literal["chat", "completion"]
    model: str
    include_usage: bool = False
    id: str = ""
    created: int = 0
    fingerprint: str = ""

    @classmethod
    def new(cls, req: Parsed, model: str, fingerprint: str) -> Reply:
        prefix = "chatcmpl-" if req.kind == "chat" else "cmpl-"
        return cls(req.kind, model, req.include_usage, prefix + uuid.uuid4().hex[:24],
                   int(time.time()), fingerprint)  # fmt: skip

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}  # fmt: skip

    def body(
        self,
        text: str | None,
        finish_reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        calls: list[ToolCall] | None = None,
        logprobs: JSONObject | None = None,
        cached_tokens: int = 0,
        reasoning: str | None = None,
    ) -> JSONObject:
        """The whole reply; chat ``calls`` become ``message.tool_calls`` (``text`` None: no
        content beside them); ``logprobs``: the choice's, in the endpoint's shape;
        ``cached_tokens``: prompt tokens whose K/V an earlier request left; ``reasoning``: the
        thought (``message.reasoning_content``, as llama-server and DeepSeek send it)."""
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = tool_calls_json(calls)
            choice = {"index": 0, "message": message, "logprobs": logprobs,
                      "finish_reason": finish_reason}  # fmt: skip
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs,
                      "finish_reason": finish_reason}  # fmt: skip
        return {**self._head(self.object), "choices": [choice],
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}  # fmt: skip

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        first: bool = False,
        tool_calls: list[JSONObject] | None = None,
        logprobs: JSONObject | None = None,
        reasoning: str | None = None,
    ) -> JSONObject:
        """One streamed chunk: ``text`` None with a ``finish_reason`` is the closing chunk;
        ``tool_calls``: ``delta.tool_calls`` entries (id and name first, then arguments);
        ``reasoning``: a piece of the thought (``delta.reasoning_content``)."""
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if reasoning is not None:
                delta["reasoning_content"] = reasoning
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": 0, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason}  # fmt: skip
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs,
                      "finish_reason": finish_reason}  # fmt: skip
            obj = "text_completion"
        out = {**self._head(obj), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(
        self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> JSONObject:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [],
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}  # fmt: skip


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> JSONObject:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: the prompt tokens whose
    K/V a kept conversation had (not computed again)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}  # fmt: skip


def sse(obj: JSONObject | str) -> bytes:
    data = (
        obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    )
    return f"data: {data}\n\n".encode()


SSE_DONE = sse("[DONE]")


def retry_after_s(mean_generation_s: float | None) -> int:
    """The ``Retry-After`` hint of a 429: about one generation's time, 1 to 60 seconds."""
    if mean_generation_s is None or mean_generation_s != mean_generation_s:
        return 1
    return max(1, min(60, -int(-mean_generation_s // 1)))


def logprobs_json(
    kind: Literal["chat", "completion"],
    entries: Sequence[TokenLogprob] | None,
    tokenizer: Tokenizer,
    offset: int = 0,
) -> JSONObject | None:
    """A choice's ``logprobs`` in the endpoint's shape (None when none were asked for)."""
    if entries is None:
        return None
    if kind == "chat":
        return chat_logprobs(entries, tokenizer)
    return completion_logprobs(entries, tokenizer, offset)
