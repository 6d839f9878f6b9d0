"""The D-Bus edge: the real daemon as a subprocess on a private bus and the simulated device.

Sizes: the tiny model's 32 experts of 1.5 MiB make a 48 MiB cache (core 24 MiB, tail 24 MiB, in
2 MiB chunks), beside the K/V's first 2 MiB chunk, on a 602 MiB device where another program
holds 64 MiB and no automatic reserve is kept: 488 MiB are free at start. A Borrow of 512 MiB
therefore needs the tail back (the cache shrinks to its 24 MiB core, 512 MiB free); 576 MiB is the
most Strata could ever free; a Borrow of 560 MiB is admitted but can never be satisfied while
the other program keeps its 64 MiB.

The times this file measures (Borrow to its reply, a borrower's death to LeaseReturned) are
printed: run with ``-s`` to see them.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import httpx
import pytest
from dbus_fast import MessageType
from dbus_fast import introspection as intr

from strata.daemon.control import leases
from strata.ipc.dbus import BUS_NAME, CONTRACT, INTERFACE, OBJECT_PATH
from tests.helpers import require_tool
from tests.integration.harness import (
    BusClient,
    ClientProcess,
    PrivateBus,
    StrataDaemon,
    bus_env,
    daemon_env,
    grew_after_the_stable_time,
    simulated_device_args,
    strata_ctl,
    write_simulated,
)

KV = 2  # the K/V's first chunk (the sink page): on the device too
TOTAL_MIB = 600 + KV
TENANT = (4242, 64)
FULL, CORE = 48, 24
MAX_FREEABLE = TOTAL_MIB - CORE - KV  # 576
UNSATISFIABLE = 560  # > 602 - 24 - 2 - 64 = 512 free at the core, <= 576


def start(
    tmp: Path,
    bus: PrivateBus | None,
    model: Path,
    daemons: list[StrataDaemon],
    *extra: str,
    wait: str = "ready",
    env: dict[str, str] | None = None,
) -> StrataDaemon:
    device = tmp / "device.json"
    write_simulated(device, TOTAL_MIB, [TENANT])
    environ = bus_env(bus) if bus is not None else {}
    d = StrataDaemon(
        tmp, [*simulated_device_args(device, model), *extra], env={**environ, **(env or {})},
        wait=wait,
    )  # fmt: skip
    daemons.append(d)
    return d


def error_of(reply: Any) -> tuple[str, str]:
    assert reply.message_type == MessageType.ERROR, f"expected an error, got {reply.body}"
    return reply.error_name, reply.body[0]


# -- the contract -------------------------------------------------------------------------------


def _describe(iface: intr.Interface) -> dict[str, Any]:
    return {
        "methods": {
            m.name: (
                [(a.name, a.signature) for a in m.in_args],
                [(a.name, a.signature) for a in m.out_args],
            )
            for m in iface.methods
        },
        "properties": {p.name: (p.signature, p.access.value) for p in iface.properties},
        "signals": {s.name: [(a.name, a.signature) for a in s.args] for s in iface.signals},
    }


def test_contract_documents_every_member_and_matches_the_exported_interface(
    tmp_path: Path, bus: PrivateBus, tiny_model: Path, daemons: list[StrataDaemon]
) -> None:
    parser = ET.XMLParser(target=ET.TreeBuilder(insert_comments=True))
    root = ET.parse(CONTRACT, parser).getroot()
    (iface,) = root.findall(f"interface[@name='{INTERFACE}']")
    children = list(iface)
    members = [el for el in children if el.tag in ("method", "property", "signal")]
    assert len(members) == 7 + 11 + 3
    for el in members:
        before = children[children.index(el) - 1]
        assert before.tag is ET.Comment and el.get("name") in (before.text or ""), (
            f"{el.tag} {el.get('name')} has no comment of its own"
        )
    text = CONTRACT.read_text()
    for error in (leases.InvalidArgument, leases.NotEnoughVram, leases.Timeout, leases.NotOwner,
                  leases.LeaseNotFound, leases.LeaseError, leases.NoDevice):  # fmt: skip
        assert error.dbus_name in text, f"{error.dbus_name} is not documented in the contract"
    contract = intr.Node.parse(text).interfaces[0]

    d = start(tmp_path, bus, tiny_model, daemons)

    async def scenario() -> None:
        c = await BusClient.connect(bus.address)
        node = await c.bus.introspect(BUS_NAME, OBJECT_PATH)
        (live,) = [i for i in node.interfaces if i.name == INTERFACE]
        assert _describe(live) == _describe(contract)
        # every property reads with its type
        for p in contract.properties:
            value = await c.prop(p.name)
            assert isinstance(value, list if p.signature.startswith("a") else (int, str)), p.name
        assert await c.prop("State") == "ready"
        assert await c.prop("Device") == "simulated"
        assert await c.prop("Model") == tiny_model.stem
        # GetStatus is the status schema of GET /v1/vram; unknown (null) values are absent
        over_dbus = await c.status()
        over_http = await asyncio.to_thread(d.status)
        assert set(over_dbus) == {k for k, v in over_http.items() if v is not None}
        for key in ("state", "model", "device", "cache_mib", "core_mib", "reserve_mib",
                    "total_mib", "leases", "holds"):  # fmt: skip
            assert over_dbus[key] == over_http[key], key
        c.close()

    asyncio.run(scenario())


# -- Borrow and Return ---------------------------------------------------------------------------


def test_borrow_shrinks_the_cache_before_replying_and_return_gives_it_back(
    tmp_path: Path, bus: PrivateBus, tiny_model: Path, daemons: list[StrataDaemon]
) -> None:
    d = start(tmp_path, bus, tiny_model, daemons)

    async def scenario() -> None:
        c = await BusClient.connect(bus.address)
        assert (await c.prop("CacheMiB"), await c.prop("FreeMiB")) == (FULL, 488)
        t0 = time.perf_counter()
        (cookie,) = await c.strata("Borrow", "tss", [512, "org.example.Render", "rendering"])
        shrink_ms = (time.perf_counter() - t0) * 1000
        status = await c.status()
        assert status["free_mib"] >= 512 and status["cache_mib"] == CORE  # free at the reply
        (lease,) = status["leases"]
        assert lease["cookie"] == cookie and lease["mib"] == 512
        assert lease["owner"] == c.bus.unique_name and lease["pid"] == os.getpid()
        assert await c.prop("Leases") == [
            [cookie, "org.example.Render", "rendering", 512, lease["since_us"]]
        ]
        # signals sent before the reply arrived before it: one resize, one batched change
        assert [b for _, m, b in c.signals if m == "CacheResized"] == [[CORE, 512]]
        changes = [b[1] for _, m, b in c.signals if m == "PropertiesChanged"]
        assert len(changes) == 1, changes
        assert changes[0]["CacheMiB"] == CORE and changes[0]["BorrowedMiB"] == 512
        assert changes[0]["FreeMiB"] == 512 and changes[0]["Leases"][0][0] == cookie

        n = len(c.signals)
        await c.strata("Return", "u", [cookie])
        t_returned, body = await c.wait_signal("LeaseReturned", start=n)
        assert body == [cookie, "returned"]
        _, change = await c.wait_signal("PropertiesChanged", start=n)
        assert change[1] == {"BorrowedMiB": 0, "Leases": []}
        t_grown, body = await c.wait_signal("CacheResized", lambda b: b[0] == FULL, start=n)
        assert await c.prop("CacheMiB") == FULL
        # it grew once the room had lasted elastic_stable_ms, by the daemon's own clock
        assert grew_after_the_stable_time(d.log, 0.5), d.log[-3000:]

        # a Borrow that fits in free memory: the reply's own latency, without a resize
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            (small,) = await c.strata("Borrow", "tss", [100, "org.example.Small", "bench"])
            times.append((time.perf_counter() - t0) * 1000)
            await c.strata("Return", "u", [small])
        print(
            f"\nBorrow to reply: {shrink_ms:.1f} ms for 512 MiB with the cache shrinking "
            f"48 -> 24 MiB; {statistics.median(times):.2f} ms median (max {max(times):.2f}) for "
            f"100 MiB already free; grow back {t_grown - t_returned:.2f} s after the Return"
        )
        c.close()

    asyncio.run(scenario())


def test_gdbus_and_busctl_borrow_return_and_revoke(
    tmp_path: Path, bus: PrivateBus, tiny_model: Path, daemons: list[StrataDaemon]
) -> None:
    gdbus, busctl = require_tool("gdbus"), require_tool("busctl")
    start(tmp_path, bus, tiny_model, daemons)
    env = daemon_env(tmp_path, bus_env(bus))

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)

    def gdbus_call(method: str, *args: str) -> subprocess.CompletedProcess[str]:
        return run(gdbus, "call", "--session", "--dest", BUS_NAME, "--object-path", OBJECT_PATH,
                   "--method", f"{INTERFACE}.{method}", *args)  # fmt: skip

    def busctl_call(method: str, signature: str, *args: str) -> subprocess.CompletedProcess[str]:
        # `busctl --user` finds the private bus through DBUS_SESSION_BUS_ADDRESS
        return run(busctl, "--user", "call", BUS_NAME, OBJECT_PATH, INTERFACE, method, signature,
                   *args)  # fmt: skip

    async def scenario() -> None:
        c = await BusClient.connect(bus.address)
        # a tool that exits after the call ends its lease with its connection
        r = await asyncio.to_thread(gdbus_call, "Borrow", "100", "org.gnome.Tool", "gdbus")
        assert r.returncode == 0, r.stderr
        cookie = int(re.fullmatch(r"\(uint32 (\d+),\)", r.stdout.strip()).group(1))
        await c.wait_signal("LeaseReturned", lambda b: b == [cookie, "vanished"], timeout=30)
        r = await asyncio.to_thread(busctl_call, "Borrow", "tss", "100", "busctl.app", "busctl")
        assert r.returncode == 0, r.stderr
        cookie = int(re.fullmatch(r"u (\d+)", r.stdout.strip()).group(1))
        await c.wait_signal("LeaseReturned", lambda b: b == [cookie, "vanished"], timeout=30)

        # Return and Revoke of a lease this test holds
        (held,) = await c.strata("Borrow", "tss", [100, "org.example.Held", "held"])
        r = await asyncio.to_thread(gdbus_call, "Return", str(held))
        assert r.returncode != 0 and "org.strata.Error.NotOwner" in r.stderr, r.stderr
        r = await asyncio.to_thread(busctl_call, "Return", "u", str(held))
        assert r.returncode != 0 and f"lease {held} belongs to" in r.stderr, r.stderr
        assert [lease["cookie"] for lease in (await c.status())["leases"]] == [held]
        r = await asyncio.to_thread(gdbus_call, "Revoke", str(held))
        assert r.returncode == 0, r.stderr
        await c.wait_signal("LeaseReturned", lambda b: b == [held, "revoked"])
        (held,) = await c.strata("Borrow", "tss", [100, "org.example.Held", "held again"])
        r = await asyncio.to_thread(busctl_call, "Revoke", "u", str(held))
        assert r.returncode == 0, r.stderr
        await c.wait_signal("LeaseReturned", lambda b: b == [held, "revoked"])
        # wrong types from a tool get the named error
        r = await asyncio.to_thread(busctl_call, "Borrow", "sss", "100", "a", "b")
        assert r.returncode != 0 and "takes arguments of D-Bus type (tss)" in r.stderr, r.stderr
        r = await asyncio.to_thread(gdbus_call, "GetStatus")
        assert r.returncode == 0 and "'leases': <@aa{sv} []>" in r.stdout, r.stdout
        c.close()

    asyncio.run(scenario())


def test_killed_borrower_returns_its_lease_and_the_cache_grows_back(
    tmp_path: Path, bus: PrivateBus, tiny_model: Path, daemons: list[StrataDaemon]
) -> None:
    d = start(tmp_path, bus, tiny_model, daemons)

    async def kill_and_time(c: BusClient, mib: int) -> tuple[float, float, int]:
        borrower = ClientProcess.program(bus, tmp_path, "borrower", str(mib))
        try:
            assert borrower.line() == "calling"
            words = (await asyncio.to_thread(borrower.line)).split()
            assert words[0] == "cookie", borrower.seen
            cookie = int(words[1])
            (lease,) = (await c.status())["leases"]
            assert lease["pid"] == borrower.proc.pid
            n = len(c.signals)
            killed = time.perf_counter()
            borrower.proc.send_signal(signal.SIGKILL)
            returned, body = await c.wait_signal("LeaseReturned", start=n, timeout=30)
            assert body == [cookie, "vanished"]
            return killed, returned, n
        finally:
            borrower.close()

    async def scenario() -> None:
        c = await BusClient.connect(bus.address)
        killed, returned, n = await kill_and_time(c, 512)
        deaths = [returned - killed]  # how soon: printed, never asserted
        assert (await c.status())["leases"] == []
        grown, _ = await c.wait_signal("CacheResized", lambda b: b[0] == FULL, start=n)
        grow_after = grown - returned
        assert grew_after_the_stable_time(d.log, 0.5), d.log[-3000:]  # elastic_stable_ms
        for _ in range(4):
            killed, returned, _ = await kill_and_time(c, 100)
            deaths.append(returned - killed)
        print(
            "\nborrower SIGKILL to LeaseReturned: "
            + ", ".join(f"{t * 1000:.1f}" for t in deaths)
            + f" ms; cache grown back {grow_after:.2f} s after the return"
        )
        c.close()

    asyncio.run(scenario())


def test_borrower_that_vanishes_while_its_borrow_waits_leaves_nothing(
    tmp_path: Path, bus: PrivateBus, tiny_model: Path, daemons: list[StrataDaemon]
) -> None:
    d = start(tmp_path, bus, tiny_model, daemons)

    async def scenario() -> None:
        c = await BusClient.connect(bus.address)
        borrower = ClientProcess.program(bus, tmp_path, "borrower", str(UNSATISFIABLE))
        try:
            assert await asyncio.to_thread(borrower.line) == "calling"
            waiting = await c.wait_status(
                lambda s: (
                    [lease["mib"] for lease in s["leases"]] == [UNSATISFIABLE]
                    and s["cache_mib"] == CORE
                ),
                5,
                "the Borrow waiting, the cache at its core",
            )
            cookie = waiting["leases"][0]["cookie"]
            n = len(c.signals)
            killed = time.perf_counter()
            borrower.proc.send_signal(signal.SIGKILL)
            _, body = await c.wait_signal("LeaseReturned", start=n, timeout=30)
            assert body == [cookie, "failed"]
            await c.wait_status(
                lambda s: s["leases"] == [] and s["borrowed_mib"] == 0, 30, "no lease left"
            )
            gone = time.perf_counter() - killed
            await c.wait_signal("CacheResized", lambda b: b[0] == FULL, start=n, timeout=30)
            assert (await c.status())["leases"] == []
        finally:
            borrower.close()
        assert f"Borrow({UNSATISFIABLE} MiB) from" not in d.log  # never granted
        print(f"\nwaiting borrower SIGKILL to its pending lease gone: {gone * 1000:.1f} ms")
        c.close()

    asyncio.run(scenario())


def test_borrow_that_times_out_leaves_nothing_and_an_unmeetable_reserve_is_pending(
    tmp_path: Path, bus: PrivateBus, tiny_model: Path, daemons: list[StrataDaemon]
) -> None:
    """A lease that cannot be granted times out and leaves nothing; a reserve that cannot be met
    (the other program's 64 MiB leave 512 MiB at most) is set and pending, and D-Bus, the status,
    ``strata-ctl`` (exit 3, and its words) and HTTP all say so, then ``met`` once the room is
    free (the other program left)."""
    d = start(tmp_path, bus, tiny_model, daemons, "--borrow-timeout-ms", "1000")
    env = daemon_env(tmp_path, bus_env(bus))

    async def scenario() -> None:
        c = await BusClient.connect(bus.address)
        t0 = time.perf_counter()
        name, text = error_of(await c.call("Borrow", "tss", [UNSATISFIABLE, "a", "b"]))
        print(f"\nBorrow timed out after {time.perf_counter() - t0:.2f} s (borrow_timeout_ms 1000)")
        # the daemon's own clock decided when: its message says how long it waited
        assert name == "org.strata.Error.Timeout", (name, text)
        assert f"{UNSATISFIABLE} MiB" in text and "after 1000 ms" in text, text
        status = await c.status()
        assert status["leases"] == [] and status["borrowed_mib"] == 0
        await c.strata("SetReserve", "t", [UNSATISFIABLE])  # no error: it is set
        assert await c.prop("ReserveMiB") == UNSATISFIABLE
        status = await c.status()
        assert status["reserve_state"] == "pending", status
        assert f"{UNSATISFIABLE} MiB needed" in status["reserve_message"]
        assert "other programs hold 64 MiB" in status["reserve_message"]
        c.close()

    asyncio.run(scenario())
    r = strata_ctl("reserve", str(UNSATISFIABLE), env=env)
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.startswith(f"run-time reserve: {UNSATISFIABLE} MiB: set, not met yet: only ")
    assert "stays in force" in r.stdout
    assert "not met yet" in strata_ctl("status", env=env).stdout
    r = strata_ctl("--json", "reserve", str(UNSATISFIABLE), env=env)
    answer = json.loads(r.stdout)
    assert r.returncode == 3 and answer["result"]["how"] == "pending"
    assert answer["reserve_state"] == "pending"
    reply = httpx.post(d.url + "/v1/vram", json={"reserve_mib": UNSATISFIABLE}, timeout=30)
    assert reply.status_code == 200 and reply.json()["result"]["how"] == "pending", reply.text
    assert "is set but not met yet" in reply.json()["result"]["message"]
    assert reply.json()["reserve_state"] == "pending"
    write_simulated(tmp_path / "device.json", TOTAL_MIB, [])  # the other program leaves
    d.wait_for(lambda s: s["reserve_state"] == "met", 30, "the reserve met")
    r = strata_ctl("--json", "reserve", "0", env=env)
    answer = json.loads(r.stdout)
    assert r.returncode == 0 and answer["result"]["how"] == "none", r.stdout
    assert answer["reserve_mib"] == 0 and answer["reserve_state"] == "none"


def test_returning_someone_elses_cookie_fails_and_revoke_ends_any_lease(
    tmp_path: Path, bus: PrivateBus, tiny_model: Path, daemons: list[StrataDaemon]
) -> None:
    start(tmp_path, bus, tiny_model, daemons)

    async def scenario() -> None:
        a = await BusClient.connect(bus.address)
        b = await BusClient.connect(bus.address)
        (cookie,) = await a.strata("Borrow", "tss", [100, "org.example.A", "mine"])
        name, text = error_of(await b.call("Return", "u", [cookie]))
        assert name == "org.strata.Error.NotOwner"
        assert str(cookie) in text and a.bus.unique_name in text and b.bus.unique_name in text
        assert [lease["cookie"] for lease in (await b.status())["leases"]] == [cookie]
        await b.strata("Revoke", "u", [cookie])
        _, body = await a.wait_signal("LeaseReturned")
        assert body == [cookie, "revoked"]
        assert (await a.status())["leases"] == []
        name, text = error_of(await a.call("Return", "u", [cookie]))
        assert name == "org.strata.Error.LeaseNotFound" and str(cookie) in text
        name, _ = error_of(await a.call("Revoke", "u", [cookie]))
        assert name == "org.strata.Error.LeaseNotFound"
        a.close()
        b.close()

    asyncio.run(scenario())


def test_bad_arguments_give_named_errors_and_change_nothing(
    tmp_path: Path, bus: PrivateBus, tiny_model: Path, daemons: list[StrataDaemon]
) -> None:
    start(tmp_path, bus, tiny_model, daemons)
    stable = ("leases", "borrowed_mib", "reserve_mib", "cache_mib", "resizes", "holds")

    async def scenario() -> None:
        c = await BusClient.connect(bus.address)
        before = {k: v for k, v in (await c.status()).items() if k in stable}
        cases = [
            ("Borrow", "tss", [0, "a", "b"], "InvalidArgument", ["0"]),
            ("Borrow", "tss", [MAX_FREEABLE + 1, "a", "b"], "NotEnoughVram",
             [str(MAX_FREEABLE + 1), str(MAX_FREEABLE)]),
            ("Borrow", "tss", [2**64 - 1, "a", "b"], "InvalidArgument",
             [str(2**64 - 1), "limit of 4294967296 MiB"]),
            ("Borrow", "tss", [2**63, "a", "b"], "InvalidArgument", [str(2**63)]),
            ("Borrow", "tss", [1, "x" * 200_000, "b"], "InvalidArgument",
             ["app_id: 200000 characters, at most 256"]),
            ("Borrow", "tss", [1, "a", "y" * 5000], "InvalidArgument", ["reason: 5000"]),
            ("SetReserve", "t", [2**64 - 1], "InvalidArgument", [str(2**64 - 1), "limit"]),
            ("Borrow", "sss", ["512", "a", "b"], "InvalidArgument", ["(tss)", "(sss)", "'512'"]),
            ("Borrow", "iss", [512, "a", "b"], "InvalidArgument", ["(tss)", "(iss)"]),
            ("Borrow", "", [], "InvalidArgument", ["(tss)", "()"]),
            ("Return", "s", ["1"], "InvalidArgument", ["(u)", "(s)"]),
            ("Return", "u", [77], "LeaseNotFound", ["77"]),
            ("Revoke", "t", [1], "InvalidArgument", ["(u)", "(t)"]),
            ("SetReserve", "t", [MAX_FREEABLE + 1], "NotEnoughVram", [str(MAX_FREEABLE + 1)]),
            ("SetReserve", "i", [-5], "InvalidArgument", ["(t)", "(i)", "-5"]),
            ("SetReserve", "s", ["z" * 100_000], "InvalidArgument", ["(t)", "(s)", "characters)"]),
        ]  # fmt: skip
        for member, signature, body, error, named in cases:
            name, text = error_of(await c.call(member, signature, body))
            assert name == f"org.strata.Error.{error}", (member, body[:1], name, text[:200])
            assert len(text) < 300, "an error reply never echoes a large argument"
            for value in named:
                assert value in text, (member, body, text)
        await asyncio.sleep(0.3)  # anything a request started would show by now
        after = {k: v for k, v in (await c.status()).items() if k in stable}
        assert after == before
        assert [m for _, m, _ in c.signals] == []
        c.close()

    asyncio.run(scenario())


def test_set_reserve_replies_once_the_room_exists_and_signals_each_change_once(
    tmp_path: Path, bus: PrivateBus, tiny_model: Path, daemons: list[StrataDaemon]
) -> None:
    start(tmp_path, bus, tiny_model, daemons)

    async def scenario() -> None:
        c = await BusClient.connect(bus.address)
        await c.strata("SetReserve", "t", [512])
        assert await c.prop("FreeMiB") >= 512 and await c.prop("CacheMiB") == CORE
        # Two changes: the reserve at once, then the resize it caused. The protocol lets them
        # come in one PropertiesChanged or two (one per loop iteration of the daemon, so it
        # depends on when the resize ends); what it never does is signal a value twice, or a
        # resize before the reserve that caused it.
        changes = [b[1] for _, m, b in c.signals if m == "PropertiesChanged"]
        assert 1 <= len(changes) <= 2, changes
        assert changes[0]["ReserveMiB"] == 512
        assert changes[-1]["CacheMiB"] == CORE and changes[-1]["FreeMiB"] == 512
        if len(changes) == 2:
            assert "CacheMiB" not in changes[0] and "ReserveMiB" not in changes[1], changes
        assert (await c.status())["reserve_mib"] == 512
        n = len(c.signals)
        await c.strata("SetReserve", "t", [0])
        await c.wait_signal("CacheResized", lambda b: b[0] == FULL, start=n)
        assert await c.prop("ReserveMiB") == 0
        c.close()

    asyncio.run(scenario())


# -- the name ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_name_is_owned_while_loading_and_state_says_so(
    tmp_path: Path, bus: PrivateBus, slow_loading_model: Path, daemons: list[StrataDaemon]
) -> None:
    d = start(tmp_path, bus, slow_loading_model, daemons, wait="listening")

    async def scenario() -> None:
        c = await BusClient.connect(bus.address)
        assert await c.prop("State") == "loading"
        assert await asyncio.to_thread(lambda: httpx.get(d.url + "/health").status_code) == 503
        _, body = await c.wait_signal(
            "PropertiesChanged", lambda b: b[1].get("State") == "ready", timeout=60
        )
        assert body[1]["CacheMiB"] > 0  # the cache filled while loading: one change for both
        assert await c.prop("State") == "ready"
        n = len(c.signals)
        await asyncio.to_thread(d.stop)
        _, body = await c.wait_signal("PropertiesChanged", start=n)
        assert body[1]["State"] == "stopping"
        owner = await c.dbus("NameHasOwner", "s", [BUS_NAME])
        assert owner == [False]
        c.close()

    asyncio.run(scenario())


def test_name_owned_by_another_process_exits_1_naming_it(
    tmp_path: Path, bus: PrivateBus, tiny_model: Path, daemons: list[StrataDaemon]
) -> None:
    squatter = ClientProcess.program(bus, tmp_path, "own", BUS_NAME)
    try:
        assert squatter.line() == "ready"
        d = start(tmp_path, bus, tiny_model, daemons, wait="none")
        assert d.proc.wait(60) == 1, d.log
        assert f"{BUS_NAME} is already owned" in d.log and f"pid {squatter.proc.pid}" in d.log
        assert "Traceback" not in d.log
    finally:
        squatter.close()


@pytest.mark.parametrize("why", ["unset", "unreachable"])
def test_no_session_bus_logs_one_warning_and_http_serves(
    why: str, tmp_path: Path, tiny_model: Path, daemons: list[StrataDaemon]
) -> None:
    env = {"DBUS_SESSION_BUS_ADDRESS": f"unix:path={tmp_path}/nothing"} if why != "unset" else {}
    d = start(tmp_path, None, tiny_model, daemons, env=env)
    assert d.status()["state"] == "ready"
    link = d.status()["dbus"]
    assert link["state"] == "off" and "session bus" in link["problem"], link
    assert httpx.get(d.url + "/health", timeout=5).status_code == 200
    warnings = [line for line in d.log.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "session bus" in warnings[0], warnings
    assert "D-Bus is off, HTTP only" in warnings[0]
