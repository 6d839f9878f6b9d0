"""The Responses API's output items: ``reasoning``, ``message`` and ``function_call`` items made
from the chat reply (and read back as the chat turns a later request's ``previous_response_id``
continues), and the response object around them (:class:`Shape`, ``response_json``)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from strata.daemon.api.serving import Started
from strata.daemon.json_types import JSONObject

Messages = list[JSONObject]


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> JSONObject:
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}  # fmt: skip


def message_item(item_id: str, text: str, status: str = "completed") -> JSONObject:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [part]}  # fmt: skip


def call_item(item_id: str, call_id: str, name: str, arguments: str,
              status: str = "completed") -> JSONObject:  # fmt: skip
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


def output_as_messages(items: list[JSONObject]) -> Messages:
    """The output as the assistant turn a later response's conversation holds."""
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in items:
        if item["type"] == "reasoning":
            msg["reasoning_content"] = item["content"][0]["text"]
        elif item["type"] == "message":
            msg["content"] += item["content"][0]["text"]
        else:
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            msg.setdefault("tool_calls", []).append(call)
    return [msg]


class Shape:
    """What every body and event of one response shares: the request's settings echoed."""

    def __init__(self, s: Started, raw: JSONObject, response_id: str) -> None:
        self.s = s
        self.id = response_id
        self.created = time.time()
        text = raw.get("text") or {"format": {"type": "text"}}
        self.echo = {"instructions": raw.get("instructions"), "metadata": raw.get("metadata"),
                     "previous_response_id": raw.get("previous_response_id"),
                     "tools": raw.get("tools") or [], "tool_choice": raw.get("tool_choice", "auto"),
                     "parallel_tool_calls": raw.get("parallel_tool_calls", True),
                     "temperature": raw.get("temperature"), "top_p": raw.get("top_p"),
                     "max_output_tokens": raw.get("max_output_tokens"), "text": text,
                     "reasoning": raw.get("reasoning"), "store": raw.get("store", True),
                     "truncation": "disabled"}  # fmt: skip

    def body(self, items: list[JSONObject], status: str,
             usage: JSONObject | None = None) -> JSONObject:  # fmt: skip
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "error": None, "incomplete_details": incomplete,
                "model": self.s.reply.model, "output": items, "usage": usage,
                **self.echo}  # fmt: skip

    def usage(self, prompt: int, completion: int, cached: int, thought: str | None) -> dict:
        reasoning = 0
        if thought:  # the thought's tokens as the tokenizer writes them, within the output's
            ids = self.s.engine.tokenizer.encode(thought, add_bos=False, add_eos=False)
            reasoning = min(len(ids), completion)
        return {"input_tokens": prompt, "output_tokens": completion,
                "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": prompt + completion}  # fmt: skip


def response_json(shape: Shape, body: JSONObject) -> tuple[JSONObject, list[dict]]:
    """The Responses body from the chat one, and its output items."""
    choice = body["choices"][0]
    msg = choice["message"]
    items: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        items.append(reasoning_item(_new_id("rs"), msg["reasoning_content"]))
    if msg.get("content"):
        items.append(message_item(_new_id("msg"), msg["content"]))
    for c in msg.get("tool_calls") or ():
        items.append(call_item(_new_id("fc"), c["id"], c["function"]["name"],
                               c["function"]["arguments"]))  # fmt: skip
    u = body["usage"]
    cached = u["prompt_tokens_details"]["cached_tokens"]
    thought = msg.get("reasoning_content")
    usage = shape.usage(u["prompt_tokens"], u["completion_tokens"], cached, thought)
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    return shape.body(items, status, usage), items
