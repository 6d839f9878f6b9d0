"""Which names select the loaded model over HTTP, and ``/v1/models``.

The model's id (its GGUF file's stem), its file name, and the aliases of the ``model_alias``
option select it. With ``serve_any_model_name`` (on by default, as llama-server serves any
name) a request naming another model — ``gpt-4o`` from a client with OpenAI's defaults, or
``""`` — is served by the loaded one too; off, such a request is a 404 naming the models
served. ``/v1/models`` lists the id, then each alias, as models of their own, then the other
models of the model library (``status`` says which is loaded: llama-server's router lists its
models so; this daemon serves one model, so the others load only with ``--model NAME``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from strata.daemon.api.api_errors import ApiError
from strata.daemon.json_types import JSONObject

MAX_NAME_CHARS = 256  # a longer model name, or one with control characters, is a 400


def model_not_found(asked: str, served: str | Sequence[str]) -> ApiError:
    """The 404 of a name no model served answers to; ``served``: the names it answers to."""
    # the name is the client's: cut, so that a reply never echoes a large input back
    shown = repr(asked) if len(asked) <= 120 else f"{asked[:120]!r}… ({len(asked)} characters)"
    names = [served] if isinstance(served, str) else list(served)
    text = repr(names[0]) if len(names) == 1 else "one model named " + ", ".join(map(repr, names))
    return ApiError(
        404,
        f"the model {shown} does not exist; this server serves {text}",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


@dataclass(frozen=True)
class ModelNames:
    """The names of the one model served."""

    id: str
    file_name: str = ""
    aliases: tuple[str, ...] = ()
    serve_any: bool = True
    # whether the model library has a model of that name (asked only for a name not served)
    in_library: Callable[[str], bool] | None = None

    @classmethod
    def of(cls, model_id: str, file_name: str, aliases: Sequence[str] | None,
           serve_any: bool, in_library: Callable[[str], bool] | None = None,
           ) -> ModelNames:  # fmt: skip
        # the id first, each alias once (an alias equal to the id adds nothing)
        listed = tuple(dict.fromkeys(a for a in (aliases or ()) if a != model_id))
        return cls(model_id, file_name, listed, serve_any, in_library)

    def selects(self, name: str) -> bool:
        """Whether ``name`` is one of the model's own names (id, alias, file name)."""
        return name == self.id or name in self.aliases or (bool(name) and name == self.file_name)

    def check(self, name: str) -> None:
        """Raises the 404 when ``name`` is not served, the 400 when it cannot be a model's name
        (control characters, or longer than ``MAX_NAME_CHARS``: never served, any name or not)."""
        if len(name) > MAX_NAME_CHARS or any(ord(c) < 32 or ord(c) == 127 for c in name):
            shown = repr(name[:40]) + ("…" if len(name) > 40 else "")
            raise ApiError(
                400,
                f"model: {shown} ({len(name)} characters) is not a model name: names have at "
                f"most {MAX_NAME_CHARS} characters and no control characters",
                "invalid_request_error",
                "model",
            )
        if not self.serve_any and not self.selects(name):
            served = [self.id, *self.aliases]
            if self.in_library is not None and name and self.in_library(name):
                shown = ", ".join(map(repr, served))
                raise ApiError(
                    404,
                    f"the model {name!r} is in the model library but not loaded: this daemon "
                    f"serves {shown} (one model at a time; `strata serve --model {name}` "
                    "serves that one)",
                    "invalid_request_error",
                    "model",
                    "model_not_found",
                )
            raise model_not_found(name, served)

    def listing(self, created: int, library: Sequence[tuple[str, int]] = ()) -> JSONObject:
        """The served names, then the library's other models (``library``: name, created)."""
        names = (self.id, *self.aliases)
        data = [model_entry(n, created) for n in names]
        data += [model_entry(n, t, loaded=False) for n, t in library if n not in names]
        return {"object": "list", "data": data}

    def entry(self, name: str, created: int) -> JSONObject:
        """``GET /v1/models/{name}``: a name the model answers to (any, with serve_any: a
        client checks its configured model before using it)."""
        self.check(name)
        return model_entry(name if self.selects(name) else self.id, created)


def model_entry(model_id: str, created: int, loaded: bool = True) -> JSONObject:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "strata",
            "status": {"value": "loaded" if loaded else "unloaded"}}  # fmt: skip
