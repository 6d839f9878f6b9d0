"""``strata-ctl borrow -- CMD`` runs CMD and forwards SIGINT and SIGTERM to it, also a signal
that comes while CMD is still being started (its forwarding is in place before the spawn)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from strata.ipc import ctl


def test_a_signal_that_comes_while_the_command_starts_reaches_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = asyncio.create_subprocess_exec
    missed: list[int] = []

    async def spawn_after_a_signal(*args: str, **kw: object) -> asyncio.subprocess.Process:
        os.kill(os.getpid(), signal.SIGTERM)  # before the command exists
        for _ in range(100):  # the loop reads its wakeup pipe, written before kill returned
            await asyncio.sleep(0)
        return await real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(asyncio, "create_subprocess_exec", spawn_after_a_signal)
    # were the forwarding missing, this handler (not the default, which ends pytest) gets it
    old = signal.signal(signal.SIGTERM, lambda sig, frame: missed.append(sig))
    try:
        code = asyncio.run(ctl.run_command(["sleep", "60"]))
    finally:
        signal.signal(signal.SIGTERM, old)
    assert not missed
    assert code == 128 + signal.SIGTERM  # the command ended by the signal passed on


def test_a_command_that_is_missing_is_named_and_the_handlers_go(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async def run() -> tuple[int, bool]:
        code = await ctl.run_command(["strata-no-such-command"])
        loop = asyncio.get_running_loop()
        return code, loop.remove_signal_handler(signal.SIGTERM)  # False: none was left

    code, left = asyncio.run(run())
    assert code == ctl.EXIT_NOT_FOUND and not left
    assert "command not found: strata-no-such-command" in capsys.readouterr().err
