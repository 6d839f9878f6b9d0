"""What a machine missing a piece of the GPU path is told: the package by its real name and a
command that installs it from this checkout (never ``strata[gpu]``, an unrelated package on the
index); and ``strata serve`` stops at once, with exit code 2, where the arena could not exist."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from strata import hints
from strata.daemon.service import EXIT_CONFIG, ServiceError, require_gpu_packages

ROOT = Path(__file__).parents[2]


def test_the_hint_installs_this_checkouts_gpu_extra() -> None:
    assert hints.checkout_root() == ROOT
    text = hints.install_hint("cuda-bindings")
    assert text == f"install it with: {sys.executable} -m pip install -e '{ROOT}[gpu]'"
    assert "strata[gpu]" not in text


def test_outside_a_checkout_the_hint_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hints, "checkout_root", lambda: None)
    assert hints.install_hint("nvidia-ml-py").endswith("-m pip install 'nvidia-ml-py>=12.535'")
    assert hints.install_hint("triton").endswith("-m pip install 'triton>=3.0'")


def test_the_gpu_packages_match_the_projects_extra() -> None:
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert sorted(extra["optional-dependencies"]["gpu"]) == sorted(hints.GPU_PACKAGES.values())


def test_serve_on_a_gpu_without_cuda_bindings_stops_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)  # the import fails
    with pytest.raises(ServiceError) as e:
        require_gpu_packages("cuda:0")
    assert e.value.code == EXIT_CONFIG  # a configuration problem: the unit does not restart
    assert "needs the cuda-bindings package" in str(e.value) and "install it with:" in str(e.value)
    require_gpu_packages("cpu")  # the CPU needs none of it


def test_the_cuda_arena_and_the_pinner_say_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    from strata.vmm.cuda_arena import _driver
    from strata.vmm.errors import BackendUnavailable
    from strata.vmm.pinned import CudaPinner

    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    for make in (_driver, CudaPinner):
        with pytest.raises(BackendUnavailable, match=r"cuda-bindings package .*install it with: "):
            make()
