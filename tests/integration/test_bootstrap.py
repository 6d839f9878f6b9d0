"""``./scripts/strata`` and ``scripts/bootstrap`` as a user meets them, on a copy of the scripts
with a stand-in ``.venv``: its ``python`` is this interpreter (``-m pip`` recorded, not run), and
a stand-in ``torch`` package first on the path records being imported.

- installed, ``./scripts/strata --help`` and ``config show`` import no torch (the bootstrap's
  check for torch used to import it: seconds before every command);
- the first run says what it installs and lets pip show its own progress (no ``-q``), on
  stderr, so that the command's own output stays clean;
- two at once (``./scripts/test & ./scripts/test`` on a fresh clone) install once: the second
  waits for the first and finds the project installed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import httpx

from tests.integration.harness import StrataDaemon

ROOT = Path(__file__).parents[2]

PYTHON_STUB = """#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  echo "$*" >> "$PIP_LOG"
  [ -z "$PIP_SECONDS" ] || sleep "$PIP_SECONDS"
  echo "Collecting something (pip's own line)"
  exit 0
fi
if [ -n "$NO_TORCH" ] && [ "$1" = "-c" ] && echo "$2" | grep -q find_spec; then
  exit 1
fi
exec {python} "$@"
"""
# the installed console script, as pip writes it, reporting whether torch came in
STRATA_STUB = """#!{python}
import sys
from strata.cli import main
code = main(sys.argv[1:])
print("torch imported" if "torch" in sys.modules else "no torch", file=sys.stderr)
sys.exit(code)
"""


def _checkout(tmp: Path) -> tuple[Path, dict[str, str]]:
    root = tmp / "checkout"
    (root / "scripts").mkdir(parents=True)
    for name in ("strata", "bootstrap"):
        shutil.copy2(ROOT / "scripts" / name, root / "scripts" / name)
    shutil.copy2(ROOT / "pyproject.toml", root / "pyproject.toml")
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name, text in (("python", PYTHON_STUB), ("strata", STRATA_STUB)):
        (bin_dir / name).write_text(text.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    fake = tmp / "fake-torch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "import os, pathlib\npathlib.Path(os.environ['TORCH_MARK']).write_text('imported')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "BOOTSTRAP_"))}
    env.update(
        PYTHONPATH=f"{tmp / 'fake-torch'}:{ROOT}", TORCH_MARK=str(tmp / "torch-imported"),
        PIP_LOG=str(tmp / "pip.log"), XDG_CONFIG_HOME=str(tmp / "config"),
    )  # fmt: skip
    return root, env


def _run(root: Path, env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(root / "scripts" / "strata"), *argv], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_installed_help_and_config_show_import_no_torch(tmp_path: Path) -> None:
    root, env = _checkout(tmp_path)
    digest = hashlib.sha256((root / "pyproject.toml").read_bytes()).hexdigest()
    (root / ".venv" / ".strata-installed").write_text(digest + "\n")
    for argv in (["--help"], ["config", "show"]):
        r = _run(root, env, *argv)
        assert r.returncode == 0, r.stderr
        assert r.stderr.strip().endswith("no torch"), r.stderr
        assert not (tmp_path / "torch-imported").exists(), f"{argv}: the bootstrap imported torch"
    assert not (tmp_path / "pip.log").exists()  # installed: nothing to install
    assert r.stdout.startswith("# configuration file")


def test_the_first_run_says_what_it_installs_and_shows_pips_progress(tmp_path: Path) -> None:
    root, env = _checkout(tmp_path)
    r = _run(root, {**env, "NO_TORCH": "1"}, "config", "show")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("# configuration file"), r.stdout  # pip's lines are not in it
    assert "Collecting" not in r.stdout
    assert "strata: installing torch==2.13.0" in r.stderr and "pip's progress follows" in r.stderr
    said = next(line for line in r.stderr.splitlines() if "installing Strata" in line)
    for name in ("torch", "gguf", "fastapi", "llguidance"):
        assert name in said, said
    assert r.stderr.count("Collecting something (pip's own line)") == 2  # pip, not silence
    torch_call, project_call = (tmp_path / "pip.log").read_text().splitlines()
    assert "install torch==2.13.0" in torch_call and "-e" in project_call.split()
    for call in (torch_call, project_call):
        assert "-q" not in call.split() and "--quiet" not in call, call
    assert (root / ".venv" / ".strata-installed").exists()


def test_two_bootstraps_at_once_install_the_project_once(tmp_path: Path) -> None:
    root, env = _checkout(tmp_path)
    env = {**env, "PIP_SECONDS": "1"}  # an install that takes a while, as pip's does
    runs = [subprocess.Popen([str(root / "scripts" / "bootstrap"), "test"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]  # fmt: skip
    errs = [p.communicate(timeout=120)[1] for p in runs]
    for p, err in zip(runs, errs, strict=True):
        assert p.returncode == 0, err
    calls = (tmp_path / "pip.log").read_text().splitlines()
    assert len(calls) == 1 and "-e" in calls[0].split(), calls  # one install, not one each
    said = sorted(err.count("strata: installed into") for err in errs)
    assert said == [0, 1], errs
    for err in errs:  # one that waited said so, and found the project installed
        if "waiting for it" in err:
            assert "installed into" not in err, err


def test_pip_install_of_the_checkout_gives_working_strata_and_strata_ctl(tmp_path: Path) -> None:
    """``pip install .`` (and ``pipx install .``, the same in a venv of its own): a wheel of the
    checkout in a fresh venv, run from elsewhere. The venv sees the running one's dependencies
    through a ``.pth`` file (no download), never this checkout."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    tree = tmp_path / "tree"
    for name in files:
        source, target = ROOT / name, tree / name
        if not source.is_symlink() and not source.is_file():
            continue  # deleted in the work tree
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            target.write_bytes(source.read_bytes())
    dist = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "-w", str(dist), str(tree)],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    Path(site, "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    (wheel,) = dist.glob("strata-*.whl")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "-q",
                        "--no-deps", str(wheel)],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    env.pop("PYTHONPATH", None)
    env.update(XDG_CONFIG_HOME=str(tmp_path / "config"), XDG_DATA_HOME=str(tmp_path / "data"),
               XDG_CACHE_HOME=str(tmp_path / "cache"), XDG_STATE_HOME=str(tmp_path / "state"),
               XDG_RUNTIME_DIR=str(tmp_path))  # fmt: skip

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)  # fmt: skip

    strata, ctl = str(venv / "bin" / "strata"), str(venv / "bin" / "strata-ctl")
    where = run(py, "-c", "import strata.cli as c; print(c.__file__)").stdout
    assert where.startswith(site), where  # the installed copy, not the checkout
    assert run(strata, "--version").stdout.strip() == "strata 0.1.0"
    assert run(ctl, "--version").stdout.strip() == "strata-ctl 0.1.0"
    assert "reserve" in run(ctl, "--help").stdout
    assert run(strata, "config", "show").stdout.startswith("# configuration file")
    r = run(strata, "service", "install")
    assert r.returncode == 0 and "strata.service" in r.stdout, r.stderr
    d = StrataDaemon(tmp_path, ["--device", "cpu", "--vram-monitor", "none"], env=env,
                     command=[strata, "serve", "--port", "0"])  # fmt: skip
    try:
        model = httpx.get(d.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 4}
        reply = httpx.post(d.url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
    finally:
        assert d.stop() == 0, d.log
