"""The run-time reserve tells the truth (docs/policy.md, "The run-time reserve"): a reserve that
cannot be met is set and *pending*, said at once when the daemon already knows (the other
programs hold more than the cache could give back), never an error that leaves it in force; a
refused reserve is not left in force; the status says ``met`` / ``pending`` as the room comes and
goes. The controllers run against the simulated device and the stand-in worker of
test_device_control; the clock never moves, so a request that waited for a deadline would never
answer (the hang guard turns that into a failure)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from strata.daemon.control.control import (
    BadVramRequest,
    ControlConfig,
    VramController,
    parse_vram_request,
)
from strata.daemon.control.leases import NotEnoughVram
from strata.daemon.control.policy import PolicyConfig
from strata.vmm.simulated import SimulatedMonitor
from tests.unit.test_device_control import _Cache, _device_file, _Worker

HANG_GUARD_S = 60  # not a timing: a request that waits for a deadline that never comes


def _controller(tmp_path: Path, cache: _Cache | None, tenants_mib: int) -> VramController:
    """A 64 MiB device; the cache's core is 4 MiB; a clock that never moves."""
    worker = _Worker([cache])  # type: ignore[list-item]
    device = _device_file(tmp_path / "device.json", 64, tenants_mib)
    box: list[VramController] = []
    monitor = SimulatedMonitor(device, lambda: box[0].ours_bytes())
    c = VramController(
        worker, monitor, PolicyConfig(elastic_reserve_mib=0), ControlConfig(borrow_timeout_ms=10),
        clock=lambda: 0.0,
    )  # type: ignore[arg-type]  # fmt: skip
    box.append(c)
    return c


def _run(c: VramController, scenario: Any) -> Any:
    async def main() -> Any:
        c.bind(asyncio.get_running_loop())
        return await asyncio.wait_for(scenario(), HANG_GUARD_S)

    return asyncio.run(main())


def test_a_reserve_the_other_programs_make_impossible_is_pending_at_once(tmp_path: Path) -> None:
    c = _controller(tmp_path, _Cache(20), tenants_mib=30)  # 14 MiB free; 30 at the core

    async def scenario() -> None:
        outcome = await c.set_reserve(40)
        assert outcome.how == "pending"
        assert "40 MiB needed" in outcome.message
        assert "other programs hold 30 MiB" in outcome.message
        assert "once they free 10 MiB" in outcome.message and "stays in force" in outcome.message
        assert c.book.reserve_mib == 40  # set and in force, and said so
        assert c.reserve_state()[0] == "pending"
        assert c._cache().n_slots == 4  # the cache gave back what it could: down to its core
        _device_file(tmp_path / "device.json", 64, 0)  # the other program leaves
        await c.check("period")
        state, words = c.reserve_state()
        assert state == "met" and "40 MiB asked" in (words or "")

    _run(c, scenario)


def test_a_reserve_that_fits_is_met_and_reported_as_room(tmp_path: Path) -> None:
    c = _controller(tmp_path, _Cache(40), tenants_mib=10)  # 14 MiB free

    async def scenario() -> None:
        outcome = await c.set_reserve(30)
        assert outcome.how == "room" and c.reserve_state()[0] == "met"
        assert (await c.set_reserve(0)).how == "none" and c.reserve_state() == ("none", None)

    _run(c, scenario)


def test_a_refused_reserve_is_not_left_in_force(tmp_path: Path) -> None:
    c = _controller(tmp_path, None, tenants_mib=30)  # loaded, no cache to give back: 34 free

    async def scenario() -> None:
        await c.set_reserve(20)
        with pytest.raises(NotEnoughVram, match="no expert cache"):
            await c.set_reserve(40)
        assert c.book.reserve_mib == 20  # the one before, not the refused one

    _run(c, scenario)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (b'{"reserve_mib": -5}', "reserve_mib", "0 or more (0 clears the reserve), got -5"),
        (b'{"reserve_mib": "4000"}', "reserve_mib", "whole number of MiB, 0 or more"),
        (b'{"reserve_mib": true}', "reserve_mib", "got true"),
        (b'{"reserve_mib": 1.5}', "reserve_mib", "got 1.5"),
        (b"{}", "reserve_mib", "reserve_mib is missing"),
        (b'{"reserve_mib": 1, "gpu": 1}', "gpu", "unknown field 'gpu'"),
        (b'{"reserve_mib": 1, "device": "1"}', "device", "device: expected a device number"),
        (b"[1]", "reserve_mib", "expected a JSON object"),
        (b"nope", "reserve_mib", "the body is not JSON"),
    ],
)
def test_a_bad_reserve_body_is_named_in_words(body: bytes, param: str, words: str) -> None:
    with pytest.raises(BadVramRequest) as e:
        parse_vram_request(body)
    assert words in str(e.value) and e.value.param == param
    assert "Input should" not in str(e.value)  # never the parser's own text


def test_a_good_reserve_body() -> None:
    assert parse_vram_request(json.dumps({"reserve_mib": 0}).encode()) == (0, None)
    assert parse_vram_request(b'{"reserve_mib": 4000, "device": 1}') == (4000, 1)


def test_a_body_nested_too_deeply_is_a_clear_refusal_not_an_error() -> None:
    from strata.daemon.control.control import BadVramRequest, parse_vram_request

    with pytest.raises(BadVramRequest, match="nested too deeply"):
        parse_vram_request(b"[" * 100_000)
