"""Chat templates (``tokenizer.chat_template``) rendered the way HF transformers renders them.

A sandboxed, immutable Jinja2 environment with trim_blocks/lstrip_blocks and the loop-controls
extension, the globals templates call (``raise_exception``, ``strftime_now``), a ``tojson`` that
writes plain JSON, and HF's ``{% generation %}`` tag accepted and ignored. Every failure, at
compile or at render time, comes out as ``TemplateError``.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import Any, ClassVar, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from strata.engine.errors import TemplateError
from strata.engine.harmony import is_harmony_template, template_messages

log = logging.getLogger(__name__)


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes <>&' - templates expect the JSON text itself
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks in HF;
    for inference it is just its body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)  # the tag name
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class ChatTemplate:
    """A compiled chat template.

    >>> ChatTemplate("{{ bos_token }}{{ messages[0]['content'] }}", bos_token="<s>").render(
    ...     [{"role": "user", "content": "hi"}])
    '<s>hi'
    """

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source
        self.harmony = is_harmony_template(source)
        self.bos_token = bos_token
        self.eos_token = eos_token
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols, _GenerationTag],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(
                f"chat template does not parse: {e.message} (line {e.lineno})"
            ) from e
        except Exception as e:
            raise TemplateError(f"chat template does not compile: {e}") from e

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for ``messages``; ``extra`` (tools, documents, enable_thinking ...)
        become template variables too. An assistant turn's ``reasoning_content`` goes to a
        harmony template (gpt-oss) as the ``thinking`` it reads."""
        if self.harmony:
            messages = template_messages(messages)
        context: dict[str, Any] = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **extra,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**context)
        except TemplateError:
            raise  # raise_exception(): the template's own message
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template failed: {e.message or e}") from e
        except Exception as e:
            raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
