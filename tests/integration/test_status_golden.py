"""The status as users read it, byte for byte: ``GET /v1/vram``, D-Bus ``GetStatus`` and the
interface's properties, ``strata-ctl status`` (table and ``--json``) and ``strata-ctl leases``,
compared with the answers kept in ``golden/``. The daemon's inside may be rearranged; what
these print may not change unless the golden files change with it (and docs/status.md says so).

Two scenarios, each on the tiny model and simulated devices with a run-time reserve and a D-Bus
lease in force: one device, and the model split over two. Values that differ from run to run (the
port, the lease's time and pid, the borrower's bus name, the model's temporary path, the
drive's reads) are replaced by their kind before comparing. ``STRATA_WRITE_GOLDEN=1`` rewrites
the files from a run (review the diff before committing it).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.harness import (
    BusClient,
    PrivateBus,
    StrataDaemon,
    bus_env,
    daemon_env,
    simulated_device_args,
    strata_ctl,
    write_simulated,
)

GOLDEN = Path(__file__).with_name("golden")
VOLATILE = {"since_us", "pid", "owner", "listen", "model_path", "drive_read_mib"}


def normalised(value: Any) -> Any:
    """``value`` with every volatile key's value replaced by ``<key>``."""
    if isinstance(value, dict):
        return {k: f"<{k}>" if k in VOLATILE else normalised(v) for k, v in value.items()}
    if isinstance(value, list):
        return [normalised(v) for v in value]
    return value


def normalised_text(text: str, model_path: str) -> str:
    text = text.replace(model_path, "<model_path>")
    text = re.sub(r"http://127\.0\.0\.1:\d+", "<listen>", text)
    return re.sub(r":1\.\d+", "<owner>", text)


def _leases_text(text: str) -> list[str]:
    """``strata-ctl leases``, one list of cells per row, its PID, SINCE and OWNER cells (which
    vary) replaced by their column's name."""
    rows = [re.split(r"\s{2,}", line.strip()) for line in text.splitlines()]
    varying = [i for i, name in enumerate(rows[0]) if name in ("PID", "SINCE", "OWNER")]
    return [" | ".join(f"<{rows[0][i]}>" if i in varying and r is not rows[0] else cell
                       for i, cell in enumerate(r)) for r in rows]  # fmt: skip


def settled(s: dict[str, Any]) -> bool:
    """The reserve met, the leases in, the K/V trimmed back after the generation."""
    return s["state"] == "ready" and all(
        d["reserve_state"] == "met" and len(d["leases"]) == 1 and d["room_kept_mib"] is not None
        and d["kv_mib"] == 2
        for d in s["devices"]
    )  # fmt: skip


def capture(strata: StrataDaemon, bus: PrivateBus, tmp: Path, model: Path) -> dict[str, Any]:
    """Every reading of the status, with a reserve of 8 MiB and a lease of 16 MiB on each
    device (the lease held by a bus client while the readings are taken)."""
    env = daemon_env(tmp, bus_env(bus))
    n = len(strata.status()["devices"])

    async def scenario() -> dict[str, Any]:
        # one short generation first: the K/V, the hit rate and the token count have values
        r = httpx.post(strata.url + "/v1/completions", timeout=60, json={
            "model": strata.status()["model"], "prompt": "The status", "max_tokens": 4,
            "temperature": 0})  # fmt: skip
        assert r.status_code == 200, r.text
        client = await BusClient.connect(bus.address)
        try:
            for device in range(n):
                await client.strata("SetReserveOn", "ut", [device, 8])
                await client.strata(
                    "BorrowOn", "utss", [device, 16, "org.example.Golden", "a test"]
                )
            status = strata.wait_for(settled, 60, "the reserve met and the leases in")
            while True:  # until two readings 2 s apart agree: nothing is moving (the budget
                time.sleep(2)  # grows once its room has lasted elastic_stable_ms)
                again = strata.wait_for(settled, 60, "the reserve met and the leases in")
                if normalised(again) == normalised(status):
                    break
                status = again
            # Ollama's /api/ps reads the same status: the loaded model's VRAM is the cache's
            ps = httpx.get(strata.url + "/api/ps", timeout=5).json()
            assert ps["models"][0]["size_vram"] == status["cache_mib"] * 2**20, ps
            dbus_status = await client.status()
            props = await client.strata_props()
            ctl = {
                "status": strata_ctl("status", env=env),
                "status_json": strata_ctl("status", "--json", env=env),
                "leases": strata_ctl("leases", env=env),
                "leases_json": strata_ctl("leases", "--json", env=env),
            }
            for name, r in ctl.items():
                assert r.returncode == 0, f"strata-ctl {name}: {r.stderr}"
            for p in props["Leases"]:
                p[4] = "<since_us>"
            table, _, leases = ctl["status"].stdout.partition("\n\n")  # the leases follow
            text = normalised_text(table, str(model)).splitlines() + _leases_text(leases)
            return {
                "http": normalised(status),
                "http_after": normalised(httpx.get(strata.url + "/v1/vram", timeout=5).json()),
                "dbus_status": normalised(dbus_status),
                "dbus_properties": props,
                "ctl_status": text,
                "ctl_status_json": normalised(json.loads(ctl["status_json"].stdout)),
                "ctl_leases": _leases_text(ctl["leases"].stdout),
                "ctl_leases_json": normalised(json.loads(ctl["leases_json"].stdout)),
            }
        finally:
            client.close()

    return asyncio.run(scenario())


def one_device(tmp: Path, model: Path) -> list[str]:
    write_simulated(tmp / "device.json", 602, [(4242, 64)])
    return simulated_device_args(tmp / "device.json", model)


def two_devices(tmp: Path, model: Path) -> list[str]:
    files = [tmp / "gpu0.json", tmp / "gpu1.json"]
    for f in files:
        write_simulated(f, 300)
    return [
        "--model", str(model), "--devices", "cpu,cpu", "--layer-split", "2,2",
        "--vram-monitor", "simulated", "--simulated-vram-files", ",".join(map(str, files)),
        "--cache-mib", "48", "--elastic-tail-mib", "24", "--elastic-reserve-mib", "0",
        "--arena-chunk-mib", "2", "--elastic-stable-ms", "500", "--elastic-period-ms", "100",
    ]  # fmt: skip


@pytest.mark.parametrize("scenario", [one_device, two_devices], ids=lambda f: f.__name__)
def test_status_readings_match_the_golden_files(
    scenario: Any,
    tiny_model: Path,
    tmp_path: Path,
    logs_on_failure: list[StrataDaemon],
) -> None:
    bus = PrivateBus(tmp_path / "bus")
    try:
        strata = StrataDaemon(tmp_path, scenario(tmp_path, tiny_model), env=bus_env(bus))
        logs_on_failure.append(strata)
        try:
            got = capture(strata, bus, tmp_path, tiny_model)
        finally:
            strata.stop()
    finally:
        bus.close()
    path = GOLDEN / f"status-{scenario.__name__}.json"
    if os.environ.get("STRATA_WRITE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(got, indent=1, sort_keys=False) + "\n")
    expected = json.loads(path.read_text())
    for key in expected:  # the order of keys too: JSON readers may show it
        assert json.dumps(got[key]) == json.dumps(expected[key]), f"{key} differs from {path.name}"
    assert list(got) == list(expected)
