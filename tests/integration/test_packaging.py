"""What a fresh machine gets from the project: the GPU path's packages on Linux x86-64 (from the
package index, as pip resolves them), a checkout that runs from PYTHONPATH without an install,
bootstrap variables that never collide with Strata's options, a CLI whose --version and --help
import no torch, and a wheel that carries the page's files.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement

from strata.daemon.config import ENV_RESERVED, OPTION_NAMES, env_of

ROOT = Path(__file__).parents[2]
GPU_PACKAGES = {"cuda-bindings", "nvidia-ml-py"}
LINUX_X86_64 = {"sys_platform": "linux", "platform_machine": "x86_64", "platform_system": "Linux"}


def _pip(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_pip_resolves_the_gpu_packages_with_the_project_for_linux_x86_64(tmp_path: Path) -> None:
    # 1. the project's own report (its metadata, built as pip builds it; no dependency fetched)
    report = tmp_path / "project.json"
    r = _pip("install", "--dry-run", "--no-deps", "--ignore-installed", "--report", str(report),
             str(ROOT))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    (project,) = json.loads(report.read_text())["install"]
    assert project["metadata"]["name"] == "strata"
    wanted = []
    for line in project["metadata"]["requires_dist"]:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({**LINUX_X86_64, "extra": ""}):
            wanted.append(req)
    names = {req.name for req in wanted}
    assert GPU_PACKAGES <= names, sorted(names)
    # not on other machines (macOS, aarch64), and torch's CUDA wheels are never asked for
    for req in wanted:
        if req.name in GPU_PACKAGES:
            assert req.marker is not None
            assert not req.marker.evaluate({"sys_platform": "darwin", "platform_machine": "arm64"})
            assert not req.marker.evaluate({"sys_platform": "linux", "platform_machine": "aarch64"})
    assert not any(name.startswith("nvidia-c") for name in names)

    # 2. what pip resolves for them from the package index, for a Linux x86-64 machine (the
    # wheels must exist there: the GPU path installs with the README's commands)
    gpu = [str(req) for req in wanted if req.name in GPU_PACKAGES]
    report = tmp_path / "gpu.json"
    target = ["--platform", "manylinux_2_28_x86_64", "--python-version", "3.12",
              "--implementation", "cp", "--target", str(tmp_path / "target")]  # fmt: skip
    r = _pip("install", "--dry-run", "--ignore-installed", "--report", str(report),
             "--only-binary=:all:", *target, *gpu)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    resolved = {i["metadata"]["name"].lower(): i for i in json.loads(report.read_text())["install"]}
    for name in GPU_PACKAGES:
        assert name in resolved, sorted(resolved)
        url = resolved[name]["download_info"]["url"]
        assert url.endswith(".whl"), url
    print("\nfor Linux x86-64: " + ", ".join(
        f"{n} {resolved[n]['metadata']['version']}" for n in sorted(GPU_PACKAGES)))  # fmt: skip


def test_the_gpu_markers_hold_on_this_machine_as_pip_sees_it() -> None:
    here = Marker("sys_platform == 'linux' and platform_machine == 'x86_64'").evaluate()
    if not here:
        pytest.skip("not a Linux x86-64 machine")
    from importlib.metadata import distribution

    for name in GPU_PACKAGES:
        assert distribution(name).version  # installed with the project


def test_bootstrap_variables_never_collide_with_options() -> None:
    known = {env_of(name) for name in OPTION_NAMES} | ENV_RESERVED
    for script in ("bootstrap", "strata", "test"):
        text = (ROOT / "scripts" / script).read_text()
        for var in set(re.findall(r"\bSTRATA_[A-Z0-9_]+", text)) - {"STRATA_"}:
            assert var in known, f"scripts/{script} reads {var}, which `strata` would refuse"
    assert "BOOTSTRAP_TORCH_VERSION" in (ROOT / "scripts" / "bootstrap").read_text()


def test_strata_runs_from_a_checkout_on_pythonpath_without_an_install(tmp_path: Path) -> None:
    # -S: no site processing, so no .pth file and no editable install's finder; the checkout on
    # PYTHONPATH and the dependencies' folder are all there is
    site = sysconfig.get_path("purelib")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{site}"}
    r = subprocess.run(
        [sys.executable, "-S", "-c",
         "import strata.cli as c, strata.daemon.service as d, strata.engine, strata.vmm, "
         "strata.ipc; print(c.__file__); print(d.__file__)"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [
        str(ROOT / "strata" / "cli.py"),
        str(ROOT / "daemon" / "service.py"),
    ]
    r = subprocess.run([sys.executable, "-S", "-m", "strata", "--version"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert (r.returncode, r.stdout.strip()) == (0, "strata 0.1.0"), r.stderr
    # the scripts with BOOTSTRAP_VENV=none: this Python as it is, no venv made
    env = {**os.environ, "BOOTSTRAP_VENV": "none", "PYTHON": sys.executable}
    r = subprocess.run([str(ROOT / "scripts" / "strata"), "--version"], env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert (r.returncode, r.stdout.strip()) == (0, "strata 0.1.0"), r.stderr


@pytest.mark.parametrize(
    "argv",
    [["--version"], ["--help"], ["generate", "--help"], ["bench", "--help"], ["serve", "--help"],
     ["config", "show"]],
    ids=lambda a: " ".join(a),
)  # fmt: skip
def test_version_and_help_import_no_torch(argv: list[str], tmp_path: Path) -> None:
    code = (
        "import sys\nfrom strata.cli import main\n"
        f"code = main({argv!r})\n"
        "print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().endswith("no torch"), r.stderr


def _help(*argv: str) -> str:
    r = subprocess.run([sys.executable, "-m", "strata", *argv, "--help"], capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_generate_and_bench_help_list_only_what_applies_to_them() -> None:
    daemon_only = ["--port", "--host", "--api-key", "--vram-monitor", "--borrow-timeout-ms",
                   "--idle-release-s", "--gamemode-reserve-mib", "--max-queued-requests",
                   "--elastic-period-ms", "--cors-allow-origins"]  # fmt: skip
    gen = _help("generate")
    for flag in ("--device", "--cache-mib", "--threads", "--model", "--max-tokens"):
        assert flag in gen
    bench = _help("bench")
    for flag in ("--device", "--threads", "--model", "--synthetic", "--reps"):
        assert flag in bench
    assert "--cache-mib LIST" in bench and "CACHE_MIB" not in bench  # the bench's own list
    assert "--elastic-reserve-mib" not in bench and "--elastic-tail-mib" not in bench
    for flag in daemon_only:
        assert f"{flag} " not in gen and f"{flag} " not in bench, flag
    serve = _help("serve")
    assert all(f"{flag} " in serve for flag in daemon_only)
    r = subprocess.run([sys.executable, "-m", "strata", "generate", "--port", "9000"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "unrecognized arguments: --port 9000" in r.stderr


def closed_pipe_run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``argv`` writing into a pipe whose reader has already gone (``… | head -1``, once head
    has its line): every write fails with EPIPE."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(argv, env=env, stdout=write, stderr=subprocess.PIPE, text=True,
                              timeout=120)  # fmt: skip
    finally:
        os.close(write)


def test_a_reader_that_goes_away_ends_the_output_quietly(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path)
    r = closed_pipe_run([sys.executable, "-m", "strata", "config", "show"], env)
    assert (r.returncode, r.stderr) == (141, ""), r.stderr  # 128 + SIGPIPE, as a shell tool
    cmd = f"{sys.executable} -m strata config show | head -1"
    r = subprocess.run(["sh", "-c", cmd], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("# configuration file"), r.stderr
    assert r.stderr == "", r.stderr


def test_a_wheel_carries_the_page(tmp_path: Path) -> None:
    """An installed wheel serves the page at / too: its static files are package data."""
    from strata.daemon.api import page

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
    r = _pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
             str(tree))  # fmt: skip
    assert r.returncode == 0, r.stderr
    (wheel,) = (tmp_path / "dist").glob("strata-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name, _ in page.FILES.values():
        assert f"strata/daemon/api/static/{name}" in names, sorted(names)
