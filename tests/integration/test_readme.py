"""The README's two set-up commands work from a fresh clone.

The clone gets its own ``.venv``; to keep this test minutes shorter than a real first run, that
venv sees the installed dependencies of the running one through a ``.pth`` file, so the README's
commands still create the project's install but do not download torch again.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import require_tool

ROOT = Path(__file__).parents[2]


def readme_commands() -> list[str]:
    """The shell commands of the README's fenced ``sh`` blocks, in order."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_readme_has_exactly_two_setup_commands() -> None:
    commands = readme_commands()
    assert len(commands) == 2, commands
    assert commands[0] == "./scripts/strata serve"
    assert commands[1] == "./scripts/test"


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_tool("git")
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing to clone")
    dest = tmp_path_factory.mktemp("fresh") / "strata"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(dest)], check=True, timeout=120)
    base_python = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base_python, "-m", "venv", str(dest / ".venv")], check=True, timeout=120)
    site = subprocess.run(
        [
            str(dest / ".venv/bin/python"),
            "-c",
            "import sysconfig; print(sysconfig.get_path('purelib'))",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # the running venv's packages (torch, llama-cpp-python, ...) are visible, not its strata
    Path(site, "parent-venv.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return dest


def _env(tmp: Path) -> dict[str, str]:
    # the clone's own run, as a user's: none of this run's STRATA_ options or pytest options
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("STRATA_") and k != "PYTEST_ADDOPTS"
    }
    env.update(
        XDG_CACHE_HOME=str(tmp / "cache"),
        XDG_CONFIG_HOME=str(tmp / "config"),
        XDG_STATE_HOME=str(tmp / "state"),
        PYTHONPATH="",
    )
    return env


def test_readme_start_command_serves_in_a_fresh_clone(clone: Path, tmp_path: Path) -> None:
    start = shlex.split(readme_commands()[0])
    log = tmp_path / "serve.log"
    env = _env(tmp_path)
    env["XDG_RUNTIME_DIR"] = str(tmp_path / "runtime")
    (tmp_path / "runtime").mkdir(mode=0o700)
    with log.open("w") as out:
        proc = subprocess.Popen([*start, "--port", "0"], cwd=clone, env=env, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip
        try:
            url = _wait_for_url(log, proc, timeout=600)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            health = httpx.get(url + "/health", timeout=5)
            assert health.status_code == 200, log.read_text()[-3000:]
            assert health.json()["model"].startswith("strata-demo")
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(30)
    assert code == 0, log.read_text()[-3000:]


def _wait_for_url(log: Path, proc: subprocess.Popen[bytes], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(r"listening on (http://\S+)", log.read_text())
        if match:
            return match.group(1)
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.1)
    raise AssertionError(f"no 'listening on' line in {timeout} s: {log.read_text()[-3000:]}")


def test_readme_test_command_runs_tests_in_a_fresh_clone(clone: Path, tmp_path: Path) -> None:
    test = shlex.split(readme_commands()[1])
    # a slice of the suite: the whole of it inside itself would only run everything twice
    proc = subprocess.run(
        [*test, "-q", "-p", "no:cacheprovider", "tests/unit/test_config.py"],
        cwd=clone,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"\d+ passed", proc.stdout), proc.stdout[-2000:]
    # and it fails when asked to run nothing
    empty = subprocess.run(
        [*test, "-q", "-p", "no:cacheprovider", "-k", "no_test_has_this_name"],
        cwd=clone,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert empty.returncode == 5, empty.stdout[-2000:]
