"""``strata service install | uninstall | status`` rules, on a temporary HOME: where the files go,
what ExecStart= holds, idempotence, and the --force rule for edited or foreign files."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from strata.daemon.commands import install_cmd
from strata.daemon.commands.install_cmd import FileState, Target

COMMAND = ["/opt/strata env/bin/strata"]


def files(home: Path, command: list[str] = COMMAND, **xdg: str) -> list[Target]:
    return install_cmd.targets({"HOME": str(home), **xdg}, command)


def test_files_go_to_the_xdg_defaults_under_home(tmp_path: Path) -> None:
    unit, activation = files(tmp_path)
    assert unit.path == tmp_path / ".config/systemd/user/strata.service"
    assert activation.path == tmp_path / ".local/share/dbus-1/services/org.strata.Strata1.service"


def test_xdg_config_and_data_home_are_honoured(tmp_path: Path) -> None:
    unit, activation = files(
        tmp_path, XDG_CONFIG_HOME=str(tmp_path / "c"), XDG_DATA_HOME=str(tmp_path / "d")
    )
    assert unit.path == tmp_path / "c/systemd/user/strata.service"
    assert activation.path == tmp_path / "d/dbus-1/services/org.strata.Strata1.service"
    relative = files(tmp_path, XDG_DATA_HOME="not/absolute")[1]  # the spec says: ignore it
    assert relative.path.is_relative_to(tmp_path / ".local/share")


def test_the_command_is_filled_in_quoted_for_each_format(tmp_path: Path) -> None:
    unit, activation = files(tmp_path, ["/opt/50% off/bin/python", "-m", "strata"])
    assert 'ExecStart="/opt/50%% off/bin/python" -m strata serve\n' in unit.text
    exec_line = next(x for x in activation.text.splitlines() if x.startswith("Exec="))
    assert shlex.split(exec_line[5:]) == ["/opt/50% off/bin/python", "-m", "strata", "serve"]
    assert "@STRATA@" not in unit.text + activation.text
    assert "SystemdService=strata.service" in activation.text
    assert "Type=notify" in unit.text and "RestartPreventExitStatus=2" in unit.text


def test_strata_command_prefers_the_script_that_ran(tmp_path: Path) -> None:
    script = tmp_path / "bin" / "strata"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    assert install_cmd.strata_command(str(script), "/usr/bin/python3") == [str(script)]
    main = "/site-packages/strata/__main__.py"  # python -m strata
    venv_python = str(tmp_path / "venv/bin/python")
    assert install_cmd.strata_command(main, venv_python) == [venv_python, "-m", "strata"]


def test_install_is_idempotent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    targets = files(tmp_path)
    assert install_cmd.install(targets, force=False) == 0
    assert all(t.state() == FileState.CURRENT for t in targets)
    mtimes = [t.path.stat().st_mtime_ns for t in targets]
    capsys.readouterr()
    assert install_cmd.install(targets, force=False) == 0
    out = capsys.readouterr().out
    assert out.count("unchanged") == 2
    assert "systemctl --user daemon-reload" in out
    assert "systemctl --user enable --now strata.service" in out
    assert [t.path.stat().st_mtime_ns for t in targets] == mtimes
    assert install_cmd.status(targets) == 0


def test_a_stale_generated_file_is_updated_without_force(tmp_path: Path) -> None:
    install_cmd.install(files(tmp_path, ["/old/strata"]), force=False)
    targets = files(tmp_path, ["/new/strata"])
    assert [t.state() for t in targets] == [FileState.STALE] * 2
    assert install_cmd.status(targets) == 1
    assert install_cmd.install(targets, force=False) == 0
    assert "ExecStart=/new/strata serve" in targets[0].path.read_text()


@pytest.mark.parametrize("how", ["edited", "foreign"])
def test_an_edited_or_foreign_file_needs_force(
    tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    unit, activation = targets = files(tmp_path)
    if how == "edited":
        install_cmd.install(targets, force=False)
        activation.path.unlink()
        unit.path.write_text(unit.text.replace("WatchdogSec=30s", "WatchdogSec=60s"))
    else:
        unit.path.parent.mkdir(parents=True)
        unit.path.write_text("[Service]\nExecStart=/usr/bin/true\n")
    mine = unit.path.read_text()
    assert unit.state() == (FileState.EDITED if how == "edited" else FileState.FOREIGN)

    assert install_cmd.install(targets, force=False) == 1
    assert "--force" in capsys.readouterr().err
    assert unit.path.read_text() == mine
    assert not activation.path.exists(), "a refused install writes nothing"
    assert install_cmd.uninstall(targets, force=False) == 1
    assert unit.path.read_text() == mine

    assert install_cmd.install(targets, force=True) == 0
    assert [t.state() for t in targets] == [FileState.CURRENT] * 2


def test_uninstall_removes_only_what_it_wrote(tmp_path: Path) -> None:
    unit, activation = targets = files(tmp_path)
    install_cmd.install(targets, force=False)
    neighbour = unit.path.with_name("pipewire.service")
    neighbour.write_text("[Service]\n")
    wants = unit.path.parent / "default.target.wants"
    wants.mkdir()
    (wants / "strata.service").symlink_to(unit.path)  # what `systemctl --user enable` makes
    (wants / "pipewire.service").symlink_to(neighbour)

    assert install_cmd.uninstall(targets, force=False) == 0
    assert not unit.path.exists() and not activation.path.exists()
    assert not os.path.lexists(wants / "strata.service")
    assert neighbour.exists() and (wants / "pipewire.service").is_symlink()
    assert install_cmd.uninstall(targets, force=False) == 0  # nothing left: still fine
    assert install_cmd.status(targets) == 1


def test_force_uninstall_removes_an_edited_unit(tmp_path: Path) -> None:
    unit, _ = targets = files(tmp_path)
    install_cmd.install(targets, force=False)
    unit.path.write_text(unit.path.read_text() + "\n# mine\n")
    assert install_cmd.uninstall(targets, force=True) == 0
    assert not unit.path.exists()
