"""What every API's routes share: one engine, one queue, one generation path.

The OpenAI routes, Anthropic's Messages, OpenAI's Responses and Ollama's API each parse their
own request into the OpenAI chat or completion request (:class:`Parsed`), and :meth:`start`
takes it the one way every generation goes: the model name checked, ``prepare`` (prompt,
sampling, grammar, tools, reasoning), the queue. Each API then writes the reply
(``openai_stream`` gives the OpenAI body or chunks; the other APIs translate those).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.requests import Request

from strata.daemon.api.api_errors import ApiError
from strata.daemon.api.generation import Generation, Generations
from strata.daemon.api.openai_api import Parsed, Prepared, Reply, prepare
from strata.daemon.api.openai_models import ModelNames
from strata.daemon.api.openai_reasoning import ReasoningDefaults

if TYPE_CHECKING:
    from strata.daemon.config import StrataConfig
    from strata.daemon.service import Daemon
    from strata.engine.generate import Engine


@dataclass(frozen=True)
class Started:
    """A request admitted to the queue: the engine, what it will run, the generation, and
    what the OpenAI body or chunks of its reply share."""

    engine: Engine
    ready: Prepared
    gen: Generation
    reply: Reply


@dataclass(frozen=True)
class Serving:
    daemon: Daemon
    config: StrataConfig
    engine: Callable[[], Engine]  # the loaded engine, or a 503 while loading or stopping
    names: Callable[[], ModelNames]
    created: Callable[[], int]  # the model file's time (seconds since the epoch)
    reasoning: ReasoningDefaults
    generations: Generations
    fingerprint: str
    error: Callable[[BaseException], ApiError]  # any exception as the error a client sees

    async def start(self, request: Request, req: Parsed, received: float) -> Started:
        eng = self.engine()
        self.names().check(req.model)
        ready = await asyncio.to_thread(prepare, req, eng, self.reasoning)
        gen = await self.generations.submit(
            ready.prompt, ready.params, received, req.stream, request.receive,
            ready.constraint, ready.show_special,
        )  # fmt: skip
        return Started(eng, ready, gen, Reply.new(req, self.daemon.model_id, self.fingerprint))
