"""The status type and its documentation: docs/status.md's tables are what the type's fields say
(``python -m strata.daemon.status_schema docs/status.md`` writes them), every field of ``Status``
and ``DeviceStatus`` has a meaning and a row (and every row a field), every field of a nested
object is named in its row, and ``to_json`` keeps the documented keys in field order."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from strata.daemon.status import (
    BusStatus,
    DeviceStatus,
    KeptConversation,
    LeaseStatus,
    MonitorStatus,
    Status,
)
from strata.daemon.status_schema import DOC as MEANING
from strata.daemon.status_schema import TABLES, json_type, markdown_table, regenerate

DOC = Path(__file__).resolve().parents[2] / "docs" / "status.md"


def _tables() -> list[dict[str, str]]:
    """Each table of docs/status.md: the keys of its first column (several per row where a row
    names several) mapped to the row's meaning."""
    tables: list[dict[str, str]] = []
    rows: dict[str, str] | None = None
    for line in DOC.read_text().splitlines():
        if not line.startswith("|"):
            rows = None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == "key":
            rows = {}
            tables.append(rows)
            continue
        if rows is None or set(cells[0]) <= {"-", " "}:
            continue
        for key in re.findall(r"`([a-z_]+)`", cells[0]):
            rows[key] = " | ".join(cells[1:])
    return tables


def _names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def test_every_status_field_has_a_row_and_every_row_a_field() -> None:
    top, per_device = _tables()
    assert set(_names(Status)) - set(top) == set(), "fields docs/status.md does not document"
    assert set(top) - set(_names(Status)) == set(), "rows docs/status.md has with no field"
    assert set(_names(DeviceStatus)) - set(per_device) == set(), "device fields not documented"
    assert set(per_device) - set(_names(DeviceStatus)) == set(), "device rows with no field"


def test_every_field_of_a_nested_object_is_named_in_its_row() -> None:
    top, _ = _tables()
    nested = {
        "monitor": MonitorStatus,
        "dbus": BusStatus,
        "leases": LeaseStatus,
        "kv_kept": KeptConversation,
    }
    for key, cls in nested.items():
        for name in _names(cls):
            assert f"`{name}`" in top[key], f"{key}.{name} is not named in its row"


def test_json_keys_follow_the_field_order() -> None:
    monitor = MonitorStatus("simulated", True, None)
    lease = LeaseStatus(1, "org.example.App", "why", 16, 0, ":1.2", 42, 0)
    device = DeviceStatus(
        0, "cpu", "simulated", monitor, "room", 0, 4, 48, 24, 24, 48, 32, 2, 50, 602, 488, 50,
        64, 8, "met", "fine", {"gamemode": 4}, 24, 16, [lease], 0,
    )  # fmt: skip
    values = {f.name: getattr(device, f.name) for f in dataclasses.fields(DeviceStatus)}
    values.pop("index")
    values.pop("first_layer")
    values.pop("layers")
    top = Status(
        state="ready", model="m", model_path=None, listen="http://127.0.0.1:1",
        dbus=BusStatus("up", None, 0), total_experts=32, host_tier_mib=0, host_experts=0,
        host_room_experts=0, file_experts=0, swaps=0, corrupt_copies=0, drive_read_mib=None,
        kv_active_tokens=0, kv_active_mib=0, kv_kept_mib=0, kv_kept=[KeptConversation(7)],
        kv_fits_tokens=100, elastic_reserve_mib=1024, hit_rate=None, busy=False, queued=0,
        generated_tokens=0, devices=[device],
        **{k: v for k, v in values.items() if k not in ("kv_mib", "budget_mib")},
        kv_mib=2, budget_mib=50,
    )  # fmt: skip
    out = top.to_json()
    assert list(out) == _names(Status)
    assert list(out["devices"][0]) == _names(DeviceStatus)  # type: ignore[index,call-overload]
    assert out["leases"] == [dataclasses.asdict(lease)]
    assert out["kv_kept"] == [{"tokens": 7}]
    assert out["monitor"] == {"kind": "simulated", "healthy": True, "problem": None}


def test_the_doc_is_what_the_type_writes() -> None:
    text = DOC.read_text()
    assert regenerate(text) == text, (
        "docs/status.md differs from the status type: run "
        "`python -m strata.daemon.status_schema docs/status.md`"
    )


@pytest.mark.parametrize("name", sorted(TABLES))
def test_every_field_has_a_meaning(name: str) -> None:
    undocumented = [f.name for f in dataclasses.fields(TABLES[name]) if not f.metadata.get(MEANING)]
    assert undocumented == []


def test_a_field_without_a_meaning_is_an_error_naming_it() -> None:
    @dataclass
    class Thing:
        told: int = field(metadata={MEANING: "a number"})
        untold: str | None = None

    with pytest.raises(ValueError, match=r"Thing\.untold has no meaning"):
        markdown_table(Thing)


def test_a_table_without_its_markers_is_an_error() -> None:
    text = DOC.read_text()
    cut = text.replace("<!-- generated from DeviceStatus", "<!-- a table from DeviceStatus")
    with pytest.raises(ValueError, match="0 tables marked"):
        regenerate(cut)


def test_a_changed_meaning_changes_the_table() -> None:
    """What the test above compares is the type's meaning, not a copy of the file."""
    stale = DOC.read_text().replace("the run-time reserve (", "the reserve (", 1)
    assert stale != DOC.read_text()
    assert regenerate(stale) == DOC.read_text()


def test_the_type_column_follows_the_annotation() -> None:
    assert json_type("int | None") == "int or null"
    assert json_type("str") == "string"
    assert json_type("dict[str, int]") == "object"
    assert json_type("list[LeaseStatus]") == "list"
    assert json_type("MonitorStatus") == "object"
    assert json_type("float | None") == "float or null"
