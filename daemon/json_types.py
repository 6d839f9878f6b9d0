"""JSON values as types, for the payloads the daemon and its edges pass around (request bodies,
replies, the status, events): ``JSON`` is any JSON value, ``JSONObject`` an object. A leaf
module: it imports nothing of the project, so every layer above the engine may import it."""

from __future__ import annotations

from typing import TypeAlias

JSON: TypeAlias = dict[str, "JSON"] | list["JSON"] | str | int | float | bool | None
JSONObject: TypeAlias = dict[str, JSON]
