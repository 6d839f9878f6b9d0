"""Ollama's model routes: ``/api/tags`` (the model served, its aliases and the library's
others), ``/api/show`` (one model's details, template and capabilities), ``/api/ps`` (the loaded
model and the VRAM its expert cache holds) and ``/api/version``."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from strata.daemon import library
from strata.daemon.api.api_errors import invalid, wrong_type
from strata.daemon.api.openai_api import json_object
from strata.daemon.api.serving import Serving
from strata.daemon.engine_setup import models_dir
from strata.daemon.json_types import JSONObject
from strata.engine.reasoning import family_for

if TYPE_CHECKING:
    from strata.engine.generate import Engine

OLLAMA_API_VERSION = "0.9.0"


def _details(engine: Any) -> dict[str, Any]:
    index = engine.index
    arch = str(index.metadata.get("general.architecture", ""))
    params = sum(_elements(t.shape) for t in index.tensors.values())
    ftype = index.metadata.get("general.file_type")
    return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
            "parameter_size": _size_words(params),
            "quantization_level": str(ftype) if ftype is not None else ""}  # fmt: skip


def _elements(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _size_words(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _entry(serving: Serving, engine: Any, name: str) -> dict[str, Any]:
    index = engine.index
    modified = dt.datetime.fromtimestamp(serving.created(), dt.UTC).isoformat()
    # an identity of the file as served (name, size, time), not a hash of its bytes
    ident = f"{index.name}\0{index.file_bytes}\0{serving.created()}".encode()
    return {"name": name, "model": name, "modified_at": modified.replace("+00:00", "Z"),
            "size": index.file_bytes, "digest": hashlib.sha256(ident).hexdigest(),
            "details": _details(engine)}  # fmt: skip


def show(serving: Serving, engine: Engine, name: str) -> JSONObject:
    index = engine.index
    template = engine.template.source if engine.template is not None else ""
    caps = ["completion"]
    if engine.template is not None and engine.template_renders_tools:
        caps.append("tools")
    if family_for(template or None) is not None:
        caps.append("thinking")
    info = {k: v for k, v in index.metadata.items()
            if isinstance(v, int | float | str) and not k.startswith("tokenizer.")}  # fmt: skip
    entry = _entry(serving, engine, name)
    return {"modelfile": "", "parameters": "", "template": template, "details": entry["details"],
            "model_info": info, "capabilities": caps,
            "modified_at": entry["modified_at"]}  # fmt: skip


def add_model_routes(app: FastAPI, serving: Serving) -> None:
    """The models served and on the shelf, one model's details, the loaded one, the version."""

    @app.get("/api/tags")
    async def api_tags() -> dict[str, Any]:
        eng = serving.engine()
        names = serving.names()
        served = [_entry(serving, eng, n) for n in (names.id, *names.aliases)]
        shelf = await asyncio.to_thread(
            _shelf, models_dir(serving.config), {e["name"] for e in served}
        )
        return {"models": served + shelf}

    @app.post("/api/show")
    async def api_show(request: Request) -> dict[str, Any]:
        raw = json_object(await request.body())
        name = raw.get("model", raw.get("name"))
        if name is None:
            raise invalid("model: missing required field", "model")
        if not isinstance(name, str):
            raise wrong_type("model", "a string", name)
        eng = serving.engine()
        serving.names().check(name)
        return show(serving, eng, name)

    @app.get("/api/ps")
    async def api_ps() -> dict[str, Any]:
        eng = serving.engine()
        names = serving.names()
        idle = serving.config.idle_release_s
        expires = (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=idle)) if idle else None
        vram = serving.daemon.read_status().cache_mib * 1024 * 1024
        until = expires.isoformat().replace("+00:00", "Z") if expires else None
        entry = {**_entry(serving, eng, names.id), "size_vram": vram, "expires_at": until}
        return {"models": [entry]}

    @app.get("/api/version")
    async def api_version() -> dict[str, str]:
        return {"version": OLLAMA_API_VERSION}


def _shelf(root: Any, served: set[str]) -> list[dict[str, Any]]:
    """The library's other models (``strata pull``'s), as ``/api/tags`` lists them; a library
    that cannot be read lists nothing (logged by ``library``)."""
    out = []
    for name, created in library.listed(root):
        m = library.find(root, name)
        if name in served or m is None:
            continue
        modified = dt.datetime.fromtimestamp(created, dt.UTC).isoformat().replace("+00:00", "Z")
        ident = f"{name}\0{m.size}\0{created}".encode()
        details = {"parent_model": "", "format": "gguf", "family": "", "families": [],
                   "parameter_size": "", "quantization_level": m.quant or ""}  # fmt: skip
        out.append({"name": name, "model": name, "modified_at": modified, "size": m.size,
                    "digest": hashlib.sha256(ident).hexdigest(), "details": details})  # fmt: skip
    return out
