"""The status schema as types, each field with its meaning: :class:`Status` (the daemon, the
model, the requests, and device 0's numbers at the top level, as tools written for one GPU read
them) with one :class:`DeviceStatus` per device. ``to_json()`` is the schema, keys in field order.

The types are the one source of docs/status.md's tables: each field of ``Status`` and
``DeviceStatus`` carries its meaning (its metadata's ``DOC``), its type column follows from its
annotation, and ``python -m strata.daemon.status_schema docs/status.md`` writes the tables
between the file's markers (tests/unit/test_daemon_status.py fails when the file differs from
what it writes, or when a field has no meaning). ``daemon/status.py`` builds the values.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeAlias

from strata.daemon.json_types import JSON, JSONObject

JsonValue: TypeAlias = JSON
StatusJson: TypeAlias = JSONObject  # the status as JSON values
DOC = "doc"  # the key of a field's meaning in its metadata


@dataclass(frozen=True)
class MonitorStatus:
    kind: str  # nvml, simulated, none
    healthy: bool
    problem: str | None


@dataclass(frozen=True)
class BusStatus:
    state: str  # off, up, down
    problem: str | None
    reconnects: int


@dataclass(frozen=True)
class LeaseStatus:
    cookie: int
    app_id: str
    reason: str
    mib: int
    since_us: int
    owner: str
    pid: int | None
    device: int


@dataclass(frozen=True)
class KeptConversation:
    tokens: int


@dataclass(frozen=True)
class DeviceStatus:
    """One device's part: its stage, its monitor's reading, its reserve and lease book."""

    index: int = field(
        metadata={
            DOC: "the device number (what `strata-ctl … --device N`, D-Bus "
            "`BorrowOn`/`SetReserveOn` and `POST /v1/vram`'s `device` take)"
        }
    )
    compute_device: str = field(metadata={DOC: "`cpu` or `cuda:N`"})
    device: str = field(metadata={DOC: "its watched device (as the top-level `device`)"})
    monitor: MonitorStatus = field(
        metadata={
            DOC: "its VRAM monitor: `kind`, `healthy`, `problem` (as the top-level `monitor`)"
        }
    )
    vram_requests: str = field(
        metadata={DOC: "how its requests are carried out (as the top-level `vram_requests`)"}
    )
    first_layer: int | None = field(
        metadata={DOC: "the stage's first layer (null until the model is loaded)"}
    )
    layers: int | None = field(
        metadata={DOC: "the stage's number of layers (null until the model is loaded)"}
    )
    cache_mib: int = field(
        metadata={DOC: "VRAM its expert cache holds now (the arena's mapped memory)"}
    )
    core_mib: int = field(metadata={DOC: "its cache's fixed core"})
    tail_mib: int = field(metadata={DOC: "its cache's elastic part in use now"})
    max_cache_mib: int = field(metadata={DOC: "its cache with every expert of its layers in it"})
    cache_experts: int = field(metadata={DOC: "experts whose bytes are in its cache now"})
    kv_mib: int = field(metadata={DOC: "memory its K/V maps now (rounded up)"})
    budget_mib: int | None = field(
        metadata={DOC: "the VRAM budget its cache and K/V share; null without an expert cache"}
    )
    total_mib: int | None = field(metadata={DOC: "its memory (null with `vram_monitor = none`)"})
    free_mib: int | None = field(metadata={DOC: "its free memory at the last check"})
    ours_mib: int | None = field(metadata={DOC: "what Strata holds on it"})
    tenants_mib: int | None = field(metadata={DOC: "what other programs hold on it (used − ours)"})
    reserve_mib: int = field(metadata={DOC: "its run-time reserve; 0 when none"})
    reserve_state: str = field(
        metadata={DOC: "whether its run-time reserve is met: `none`, `met` or `pending`"}
    )
    reserve_message: str | None = field(
        metadata={DOC: "its reserve's state in words with the numbers; null with no reserve"}
    )
    holds: dict[str, int] = field(metadata={DOC: "other sources' holds on it"})
    room_kept_mib: int | None = field(metadata={DOC: "room the policy keeps free on it now"})
    borrowed_mib: int = field(metadata={DOC: "the sum of its leases"})
    leases: list[LeaseStatus] = field(metadata={DOC: "its leases (each with its `device`)"})
    resizes: int = field(metadata={DOC: "its cache's resizes since start"})


@dataclass(frozen=True)
class Status:
    """The status schema (docs/status.md). Sizes in MiB; unknown values are None."""

    state: str = field(
        metadata={
            DOC: "`loading` (the model is being read; `/health` answers 503), `ready`, `stopping`"
        }
    )
    model: str = field(metadata={DOC: "the model id: the GGUF file's stem (empty while unknown)"})
    model_path: str | None = field(metadata={DOC: "the GGUF file"})
    listen: str = field(
        metadata={
            DOC: "the HTTP endpoint, e.g. `http://127.0.0.1:8427` (the real port when `port = 0`)"
        }
    )
    compute_device: str = field(metadata={DOC: "`cpu` or `cuda:N`"})
    device: str = field(
        metadata={
            DOC: "the watched device: its name from NVML (`NVIDIA GeForce RTX 4090`), `simulated` "
            "or `none`"
        }
    )
    monitor: MonitorStatus = field(
        metadata={
            DOC: "`kind` (`nvml`, `simulated`, `none`), `healthy` (false once NVML failed: the "
            "cache then keeps its size, and requests shrink it), `problem` (the warning, or "
            "null)"
        }
    )
    vram_requests: str = field(
        metadata={
            DOC: "how a reserve or a lease is carried out now: `room` (a monitor sees the device: "
            "the request returns once the room is free on it), `shrink` (no monitor sees it —"
            " `vram_monitor = none` on a GPU, or the monitor failed — so the request returns "
            "once the cache has shrunk by its amount, whether or not that memory is then "
            "free), `refused` (no GPU watched and no VRAM held: a request for more than 0 MiB"
            " fails with `NoDevice`, HTTP 409)"
        }
    )
    dbus: BusStatus = field(
        metadata={
            DOC: "the session bus: `state` — `up` (on the bus, owning `org.strata.Strata1`), "
            "`down` (the connection was lost: reconnecting, 0.5 s after the loss and then "
            "twice as long after each failed attempt, at most 30 s apart; HTTP serves "
            "throughout), `off` (no session bus when the daemon started: HTTP only); "
            "`problem` (why it is down or off, or what the last attempt met; null when up); "
            "`reconnects` (connections re-established since start). Over D-Bus it always "
            "reads `up`"
        }
    )
    cache_mib: int = field(
        metadata={DOC: "VRAM the expert cache holds now (the arena's mapped memory)"}
    )
    core_mib: int = field(metadata={DOC: "the fixed core: never shrunk"})
    tail_mib: int = field(metadata={DOC: "the elastic part in use now (`cache − core`)"})
    max_cache_mib: int = field(metadata={DOC: "the cache with every expert in it"})
    cache_experts: int = field(
        metadata={
            DOC: "experts whose bytes are in the cache now (during a grow the new slots fill one "
            "by one)"
        }
    )
    total_experts: int | None = field(
        metadata={DOC: "routed experts of the model (null without a cache)"}
    )
    host_tier_mib: int = field(
        metadata={
            DOC: "RAM the host tier holds (page-locked on a GPU): the homes of the experts no VRAM"
            " slot holds, plus the room kept for what a shrink evicts; 0 without a tier"
        }
    )
    host_experts: int = field(metadata={DOC: "experts whose home is the host tier now"})
    host_room_experts: int = field(
        metadata={
            DOC: "free host slots: experts a shrink can still move into RAM (beyond them, evicted "
            "experts are read from the file)"
        }
    )
    file_experts: int | None = field(
        metadata={
            DOC: "experts with no home in VRAM or RAM, read from the mapped GGUF when routed to "
            "(beyond `host_budget_mib`); null without a cache"
        }
    )
    swaps: int = field(
        metadata={
            DOC: "exchanges since start of a hot expert in RAM with a cold one in the elastic tail"
            " (`adapt_swaps`), counted when they land"
        }
    )
    corrupt_copies: int = field(
        metadata={
            DOC: "copies of experts dropped since start because their bytes did not match their "
            "checksum from load (`verify_experts`); each is logged as an error naming the "
            "expert"
        }
    )
    drive_read_mib: int | None = field(
        metadata={
            DOC: "bytes this process has had read from storage since start (`/proc/self/io`): what"
            " the page cache did not have (null where the kernel does not say)"
        }
    )
    kv_mib: int = field(
        metadata={
            DOC: "memory the K/V cache maps now (rounded up): it grows in `arena_chunk_mib` chunks"
            " as conversations need pages and gives free chunks back after each request"
        }
    )
    kv_active_tokens: int = field(
        metadata={
            DOC: "positions of the active conversation (the last request's) in the K/V; 0 once a "
            "budget cut between requests has taken its pages"
        }
    )
    kv_active_mib: int = field(
        metadata={DOC: "the pages the active conversation holds (rounded up)"}
    )
    kv_kept_mib: int = field(
        metadata={
            DOC: "the pages only kept conversations hold: what evicting them all would free "
            "(rounded up)"
        }
    )
    kv_kept: list[KeptConversation] = field(
        metadata={
            DOC: "one object per kept conversation, least recently used first: `tokens` (its "
            "length). A request whose prompt extends one starts from it "
            "(`kv_keep_conversations`)"
        }
    )
    budget_mib: int | None = field(
        metadata={
            DOC: "the VRAM budget the expert cache and the K/V share (the policy's target; "
            "`cache_mib + kv_mib` stays within it); null without an expert cache (the K/V "
            "then grows as memory allows)"
        }
    )
    kv_fits_tokens: int | None = field(
        metadata={
            DOC: "the longest prompt (plus one) whose K/V fits the budget with the cache at its "
            "core; a longer one is refused (HTTP 400 `context_length_exceeded`)"
        }
    )
    total_mib: int | None = field(
        metadata={DOC: "the device's memory (null with `vram_monitor = none`)"}
    )
    free_mib: int | None = field(metadata={DOC: "free device memory at the last check"})
    ours_mib: int | None = field(
        metadata={
            DOC: "what Strata holds on the device: the cache, the K/V and the engine's own memory"
        }
    )
    tenants_mib: int | None = field(metadata={DOC: "what other programs hold (used − ours)"})
    reserve_mib: int = field(
        metadata={
            DOC: "the run-time reserve (`strata-ctl reserve`, `SetReserve`, `POST /v1/vram`); 0 "
            "when none"
        }
    )
    reserve_state: str = field(
        metadata={
            DOC: "`none` (no run-time reserve), `met` (its room is free; without a monitor: the "
            "cache shrank by it) or `pending` (set and in force, the room not free yet: "
            "[policy](policy.md#the-run-time-reserves-answer))"
        }
    )
    reserve_message: str | None = field(
        metadata={
            DOC: "the state in words with the numbers (free, needed, what other programs hold); "
            "null with no reserve"
        }
    )
    elastic_reserve_mib: int = field(metadata={DOC: "the automatic reserve from the configuration"})
    holds: dict[str, int] = field(
        metadata={DOC: 'other sources\' holds, e.g. `{"gamemode": 4000}` while a game runs'}
    )
    room_kept_mib: int | None = field(
        metadata={
            DOC: "room the policy keeps free now: the largest reserve or hold, plus each lease's "
            "part not yet allocated by its borrower"
        }
    )
    borrowed_mib: int = field(metadata={DOC: "the sum of the leases"})
    leases: list[LeaseStatus] = field(
        metadata={
            DOC: "one object per lease: `cookie`, `app_id`, `reason`, `mib`, `since_us` (Unix µs),"
            " `owner` (the borrower's unique bus name, or `http`), `pid`, `device` (the "
            "device it is on: always 0 here, the top-level list being device 0's)"
        }
    )
    resizes: int = field(metadata={DOC: "cache resizes since start"})
    hit_rate: float | None = field(
        metadata={
            DOC: "expert cache hits / fetches since start (null without a cache, or before any "
            "fetch; over D-Bus the key is then absent, never 0)"
        }
    )
    busy: bool = field(metadata={DOC: "a generation is running"})
    queued: int = field(metadata={DOC: "generations waiting"})
    generated_tokens: int = field(
        metadata={
            DOC: "tokens generated since start, counted as each one is: a counter, so tokens per "
            "second is its rate between two readings (the page at `/` draws it)"
        }
    )
    devices: list[DeviceStatus] = field(
        metadata={
            DOC: "one object per device, by device number: one entry without a split, several with"
            " `devices` (below)"
        }
    )

    def to_json(self) -> StatusJson:
        """The schema as JSON values, keys in field order (nested types as objects)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class DaemonFacts:
    """What the status says of the daemon itself, besides the devices and the engine."""

    state: str
    model: str
    model_path: str | None
    listen: str
    dbus: BusStatus
    elastic_reserve_mib: int


# -- docs/status.md's tables ----------------------------------------------------------------------

TABLES: dict[str, type] = {"Status": Status, "DeviceStatus": DeviceStatus}
_BEGIN = "<!-- generated from {name} (python -m strata.daemon.status_schema docs/status.md) -->"
_END = "<!-- end of the generated table -->"
_JSON_TYPES = {"str": "string", "int": "int", "float": "float", "bool": "bool"}


def json_type(annotation: str) -> str:
    """A field's annotation as the docs' type column: ``int | None`` is "int or null"."""
    parts = [p.strip() for p in annotation.split("|")]
    null = "None" in parts
    (kind,) = [p for p in parts if p != "None"]
    if kind in _JSON_TYPES:
        text = _JSON_TYPES[kind]
    elif kind.startswith(("list[", "tuple[")):
        text = "list"
    else:  # dict[...] or a nested dataclass
        text = "object"
    return f"{text} or null" if null else text


def markdown_table(cls: type) -> str:
    """``cls``'s fields as a table of key, type and meaning; a field with no meaning is an
    error naming it."""
    rows = ["| key | type | meaning |", "| --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        meaning = f.metadata.get(DOC)
        if not meaning:
            raise ValueError(f"{cls.__name__}.{f.name} has no meaning: give it one in its metadata")
        if "|" in meaning or "\n" in meaning:
            raise ValueError(f"{cls.__name__}.{f.name}: a meaning is one line without '|'")
        rows.append(f"| `{f.name}` | {json_type(str(f.type))} | {meaning} |")
    return "\n".join(rows)


def regenerate(text: str) -> str:
    """``text`` (docs/status.md) with each generated table written anew from the types; each
    table's markers must be there, once."""
    for name, cls in TABLES.items():
        begin = _BEGIN.format(name=name)
        pattern = re.compile(re.escape(begin) + r"\n.*?" + re.escape(_END), re.DOTALL)
        found = len(pattern.findall(text))
        if found != 1:
            raise ValueError(f"docs/status.md: {found} tables marked {begin!r}, expected 1")
        table = f"{begin}\n{markdown_table(cls)}\n{_END}"
        text = pattern.sub(lambda _, table=table: table, text)
    return text


def main(argv: list[str]) -> int:
    """``python -m strata.daemon.status_schema PATH``: rewrite PATH's generated tables."""
    if len(argv) != 1:
        sys.stderr.write("usage: python -m strata.daemon.status_schema docs/status.md\n")
        return 2
    path = Path(argv[0])
    path.write_text(regenerate(path.read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
