"""``GET /v1/vram/events`` against the real daemon on the simulated device: the history first,
then one event per status change (coalesced when a reader lags, never reordered), and a clean
end when the daemon stops."""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.harness import (
    StatusEvents,
    StrataDaemon,
    simulated_device_args,
    write_simulated,
)

CHANGES = 100


def start(tmp: Path, model: Path) -> StrataDaemon:
    write_simulated(tmp / "device.json", 600, [(4242, 64)])
    return StrataDaemon(tmp, simulated_device_args(tmp / "device.json", model))


@pytest.fixture
def strata(tiny_model: Path, tmp_path: Path, daemons: list[StrataDaemon]) -> Iterator[StrataDaemon]:
    d = start(tmp_path, tiny_model)
    daemons.append(d)
    yield d


@pytest.fixture
def events(strata: StrataDaemon) -> Iterator[StatusEvents]:
    reader = StatusEvents(strata.url)
    yield reader
    reader.close()


def test_the_stream_starts_with_the_history_and_the_current_status(
    strata: StrataDaemon, events: StatusEvents
) -> None:
    name, ident, history = events.next()
    assert events.status_code == 200
    assert name == "history" and ident is None
    assert history["interval_s"] == 1 and history["samples"], history
    sample = history["samples"][-1]
    assert sample["at_us"] <= history["now_us"]
    assert set(sample["status"]) == set(strata.status())  # the one status schema
    name, ident, current = events.next()
    assert name == "status" and isinstance(ident, int) and ident >= 1
    assert set(current) == set(strata.status())
    # what the stream holds is counted, with its bound
    metrics = httpx.get(strata.url + "/metrics", timeout=30).text
    assert re.search(r"^strata_status_streams 1\.0$", metrics, re.M), metrics
    assert re.search(r"^strata_status_history_samples_limit 600\.0$", metrics, re.M)


def test_after_many_quick_changes_the_last_event_carries_the_final_state(
    strata: StrataDaemon, events: StatusEvents
) -> None:
    assert events.next()[0] == "history"
    with httpx.Client(base_url=strata.url, timeout=60) as client:
        for mib in range(1, CHANGES + 1):
            r = client.post("/v1/vram", json={"reserve_mib": mib})
            assert r.status_code == 200, r.text
    final = events.wait_status(lambda s: s["reserve_mib"] == CHANGES, 60, "the final reserve")
    assert final == {**final, "reserve_mib": CHANGES}
    statuses = [(ident, data) for name, ident, data in events.seen if name == "status"]
    ids = [ident for ident, _ in statuses]
    assert ids == sorted(ids) and len(set(ids)) == len(ids), ids  # never reordered
    reserves = [data["reserve_mib"] for _, data in statuses]
    assert reserves == sorted(reserves), reserves  # each change after the one before it
    assert len(set(reserves) - {0}) >= 1  # coalesced perhaps, but there
    # nothing later says otherwise: the newest status event is the final reserve
    assert strata.status()["reserve_mib"] == CHANGES
    while not events.events.empty():
        name, _, data = events.next()
        if name == "status":
            assert data["reserve_mib"] == CHANGES


def test_the_stream_ends_cleanly_when_the_daemon_stops(
    strata: StrataDaemon, events: StatusEvents
) -> None:
    assert events.next()[0] == "history"
    assert events.next()[0] == "status"
    assert strata.stop(signal.SIGTERM) == 0  # its normal exit code: no stream held it up
    last = events.wait_status(lambda s: s["state"] == "stopping", 30, "the stopping status")
    assert last["state"] == "stopping"
    assert events.ended.wait(60), "the stream did not end"
    assert events.error is None, f"the stream broke instead of ending: {events.error!r}"
