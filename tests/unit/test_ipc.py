"""The D-Bus edge's pure pieces: the status as a{sv} and back, the properties, strata-ctl's
command line and tables."""

from __future__ import annotations

import io
import socket
from pathlib import Path

import pytest
from dbus_fast import Message, MessageType
from dbus_fast._private.unmarshaller import Unmarshaller

from strata.ipc.ctl import format_leases, format_status, parse_args
from strata.ipc.dbus import from_variant, property_values, session_bus_address, to_vardict

STATUS = {
    "state": "ready",
    "model": "tiny",
    "model_path": None,
    "device": "simulated",
    "monitor": {"kind": "simulated", "healthy": True, "problem": None},
    "vram_requests": "room",
    "cache_mib": 48,
    "core_mib": 24,
    "tail_mib": 24,
    "max_cache_mib": 48,
    "cache_experts": 32,
    "total_experts": 32,
    "total_mib": 600,
    "free_mib": 488,
    "ours_mib": 48,
    "tenants_mib": 64,
    "reserve_mib": 0,
    "elastic_reserve_mib": 0,
    "holds": {"gamemode": 512},
    "room_kept_mib": None,
    "borrowed_mib": 512,
    "leases": [
        {
            "cookie": 3,
            "app_id": "org.example.A",
            "reason": "render",
            "mib": 512,
            "since_us": 1_796_000_000_000_000,
            "owner": ":1.5",
            "pid": None,
        },
    ],
    "hit_rate": 0.75,
    "busy": False,
}


def _over_the_wire(body: dict) -> dict:
    """Marshal as a{sv} in a real message and read it back."""
    msg = Message(
        message_type=MessageType.METHOD_RETURN, reply_serial=1, signature="a{sv}", body=[body]
    )
    unmarshaller = Unmarshaller(io.BytesIO(msg._marshall(False)))
    return from_variant(unmarshaller.unmarshall().body[0])


def test_status_as_a_dict_of_variants_leaves_unknown_values_out_and_reads_back() -> None:
    back = _over_the_wire(to_vardict(STATUS))
    expected = {k: v for k, v in STATUS.items() if v is not None}
    expected["monitor"] = {"kind": "simulated", "healthy": True}
    expected["leases"] = [{k: v for k, v in STATUS["leases"][0].items() if v is not None}]
    assert back == expected


def test_properties_come_from_the_status_schema() -> None:
    values = property_values({**STATUS, "free_mib": None, "device": None})
    assert values["FreeMiB"] == 0 and values["Device"] == ""  # unknown: 0 and ""
    assert values["Leases"] == [[3, "org.example.A", "render", 512, 1_796_000_000_000_000]]
    assert (values["CacheMiB"], values["BorrowedMiB"], values["State"]) == (48, 512, "ready")
    assert values["VramRequests"] == "room"


def test_session_bus_address_falls_back_to_the_user_bus(tmp_path: Path) -> None:
    assert session_bus_address({"DBUS_SESSION_BUS_ADDRESS": "unix:path=/x"}) == "unix:path=/x"
    assert session_bus_address({"XDG_RUNTIME_DIR": str(tmp_path)}) is None
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "bus"))
        assert session_bus_address({"XDG_RUNTIME_DIR": str(tmp_path)}) == (
            f"unix:path={tmp_path}/bus"
        )


def test_borrow_takes_the_command_after_the_first_double_dash_verbatim() -> None:
    args = parse_args(["borrow", "512", "--app-id", "x", "--", "sh", "-c", "echo --", "--", "1"])
    assert (args.mib, args.app_id) == (512, "x")
    assert args.command == ["sh", "-c", "echo --", "--", "1"]


@pytest.mark.parametrize("argv", [["borrow", "512"], ["status", "--", "x"], ["reserve", "1e3"]])
def test_bad_command_lines_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2


def test_status_table_and_reserve_line_say_how_requests_are_carried_out() -> None:
    from strata.ipc.ctl import carried_out

    assert "refused: Strata watches no GPU" in format_status({**STATUS, "vram_requests": "refused"})
    room = carried_out(STATUS, 64, 100)
    assert room == "488 MiB free on simulated (cache 64 -> 48 MiB)"
    failed = {**STATUS, "vram_requests": "shrink",
              "monitor": {"kind": "nvml", "healthy": False, "problem": "GPU is lost"}}  # fmt: skip
    text = carried_out(failed, 64, 16)
    assert "the VRAM monitor failed: GPU is lost" in text and "cache 64 -> 48 MiB" in text
    assert "not checked" in text
    assert carried_out(STATUS, 48, 0).startswith("cleared (cache 48 MiB")


def test_status_table_says_unknown_for_absent_values() -> None:
    text = format_status({"state": "loading", "leases": []})
    assert "state" in text and "loading" in text and "unknown" in text
    table = format_leases(STATUS["leases"]).splitlines()
    assert table[0].split() == ["COOKIE", "MIB", "APP", "ID", "REASON", "PID", "SINCE", "OWNER"]
    assert table[1].split()[:5] == ["3", "512", "org.example.A", "render", "-"]


# -- several devices -----------------------------------------------------------------------------

SECOND = {
    "index": 1, "compute_device": "cuda:1", "device": "simulated",
    "monitor": {"kind": "simulated", "healthy": True, "problem": None}, "vram_requests": "room",
    "first_layer": 20, "layers": 28, "cache_mib": 30, "core_mib": 8, "tail_mib": 22,
    "max_cache_mib": 48, "cache_experts": 20, "kv_mib": 2, "budget_mib": 40, "total_mib": 800,
    "free_mib": 700, "ours_mib": 32, "tenants_mib": 68, "reserve_mib": 100, "holds": {},
    "room_kept_mib": 612, "borrowed_mib": 512, "resizes": 3,
    "leases": [{"cookie": 4, "app_id": "org.example.B", "reason": "game", "mib": 512,
                "since_us": 1_796_000_000_000_000, "owner": ":1.6", "pid": 77, "device": 1}],
}  # fmt: skip
FIRST = {**SECOND, "index": 0, "compute_device": "cuda:0", "first_layer": 0, "layers": 20,
         "leases": [{**STATUS["leases"][0], "device": 0}]}  # fmt: skip
SPLIT = {**STATUS, "devices": [FIRST, SECOND]}


def test_device_options_of_reserve_and_borrow() -> None:
    assert parse_args(["reserve", "4000"]).device is None  # SetReserve, as with one device
    assert parse_args(["reserve", "4000", "--device", "1"]).device == 1
    borrow = parse_args(["borrow", "--device", "1", "4000", "--", "sleep", "1"])
    assert (borrow.device, borrow.mib, borrow.command) == (1, 4000, ["sleep", "1"])
    assert parse_args(["borrow", "4000", "--", "x"]).device is None


@pytest.mark.parametrize("value", ["-1", "one", "1.5", "", str(2**32)])
def test_a_bad_device_number_is_a_usage_error_naming_it(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(["reserve", "10", "--device", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"expected a device number (0, 1, …), got {value!r}" in err


def test_the_status_table_lists_each_device_and_every_lease() -> None:
    text = format_status(SPLIT)
    assert "borrowed   512 MiB in 1 lease(s)" in text, "the rows of one device are device 0's"
    assert "device 0   cuda:0 (simulated, monitor simulated), layers 0-19" in text
    line = next(row for row in text.splitlines() if row.startswith("device 1 "))
    assert "cuda:1" in line and "layers 20-47" in line and "cache 30 MiB" in line
    assert "reserve 100 MiB" in line and "borrowed 512 MiB in 1 lease(s)" in line
    header, *rows = text.split("\n\n")[1].splitlines()
    assert header.split()[:3] == ["COOKIE", "DEVICE", "MIB"]
    assert [row.split()[:2] for row in rows] == [["3", "0"], ["4", "1"]]
    # one device: the table as it always was
    assert "DEVICE" not in format_status({**STATUS, "devices": [FIRST]})
    assert "device 1" not in format_status({**STATUS, "devices": [FIRST]})


def test_a_reserve_line_speaks_of_its_device() -> None:
    from strata.ipc.ctl import _device_status, carried_out

    # no device named: the first in the list, as device 0 named; one it lacks: nothing
    assert _device_status(SPLIT, None) is FIRST and _device_status(SPLIT, 0) is FIRST
    assert _device_status(SPLIT, 2) == {} and _device_status(SPLIT, -1) == {}
    assert carried_out(_device_status(SPLIT, 1), 48, 100) == (
        "700 MiB free on simulated (cache 48 -> 30 MiB)"
    )


def test_the_devices_property_and_the_split_status_over_the_wire() -> None:
    assert property_values(SPLIT)["Devices"] == ["cuda:0", "cuda:1"]
    assert property_values(SPLIT)["CacheMiB"] == 48, "the size properties are device 0's"
    back = from_variant(_over_the_wire(to_vardict(SPLIT)))
    assert [d["index"] for d in back["devices"]] == [0, 1]
    assert back["devices"][1]["leases"][0]["device"] == 1


def test_metrics_label_each_device_and_keep_the_old_series_for_device_0() -> None:
    from types import SimpleNamespace

    from strata.daemon.api.metrics import Metrics

    daemon = SimpleNamespace(status=lambda: SPLIT, worker=SimpleNamespace(steps=0))
    text = Metrics(daemon).render().decode()
    assert "\nstrata_cache_mib 48.0\n" in text and "\nstrata_free_vram_mib 488.0\n" in text
    assert 'strata_device_cache_mib{device="0",name="cuda:0"} 30.0' in text
    assert 'strata_device_cache_mib{device="1",name="cuda:1"} 30.0' in text
    assert 'strata_device_reserve_mib{device="1",name="cuda:1"} 100.0' in text
    assert 'strata_device_borrowed_mib{device="1",name="cuda:1"} 512.0' in text
    unwatched = {**SPLIT, "devices": [{**FIRST, "free_mib": None}, SECOND]}
    text = (
        Metrics(SimpleNamespace(status=lambda: unwatched, worker=SimpleNamespace(steps=3)))
        .render()
        .decode()
    )
    assert 'strata_device_free_vram_mib{device="0"' not in text, "an unknown value is left out"
    assert 'strata_device_free_vram_mib{device="1",name="cuda:1"} 700.0' in text
