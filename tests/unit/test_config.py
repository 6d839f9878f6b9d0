"""The configuration: every kind of bad value through every layer is one line and exit code 2;
flag > environment > file > default, as ``strata config show`` reports."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from strata.daemon.cli import main

# option, a bad value, a fragment of the expected explanation
BAD_VALUES = [
    ("port", "abc", "valid integer"),
    ("port", "70000", "less than or equal to 65535"),
    ("port", "-1", "greater than or equal to 0"),
    ("port", "80.5", "valid integer"),
    ("threads", "0", "greater than or equal to 1"),
    ("threads", "many", "valid integer"),
    ("context_length", "-4096", "greater than or equal to 16"),
    ("prefill_chunk_tokens", "0", "greater than or equal to 1"),
    ("log_level", "loud", "debug, info, warning, error or critical"),
    ("kv_cache_type", "q4", "f16 or f32"),
    ("host", "", "not an empty string"),
    ("device", "tpu", "auto, cpu, cuda or cuda:N"),
    ("device", "cuda:x", "auto, cpu, cuda or cuda:N"),
    ("cache_mib", "-1", "greater than or equal to 0"),
    ("host_budget_mib", "-5", "greater than or equal to 0"),
    ("adapt_swaps", "-1", "greater than or equal to 0"),
    ("adapt_swaps", "257", "less than or equal to 256"),
    ("prefetch_experts", "-1", "greater than or equal to 0"),
    ("prefetch_experts", "257", "less than or equal to 256"),
    ("prefetch_experts", "two", "valid integer"),
    ("cpu_share", "-0.1", "greater than or equal to 0"),
    ("cpu_share", "1.5", "less than or equal to 1"),
    ("cpu_share", "half", "valid number"),
    ("host_budget_mib", "lots", "valid integer"),
    ("cache_mib", "4GB", "valid integer"),
    ("elastic_tail_mib", "-5", "greater than or equal to 0"),
    ("elastic_reserve_mib", "lots", "valid integer"),
    ("arena_chunk_mib", "3", "multiple of 2"),
    ("arena_chunk_mib", "1", "greater than or equal to 2"),
    ("api_key", "", "not an empty or blank string"),  # an empty key must not turn auth off
    ("api_key", "   ", "not an empty or blank string"),
    ("max_stop_sequences", "0", "greater than or equal to 1"),
    ("model", "", "not an empty string"),  # "" would be the current directory
    ("simulated_vram_file", " ", "not an empty string"),
    ("devices", "cuda:0,gpu", "'gpu' is not a device: expected cpu, cuda or cuda:N"),
    ("devices", "auto,cpu", "'auto' is not a device"),
    ("devices", "", "expected at least one device"),
    ("devices", "cuda:0,,cuda:1", "'' is not a device"),
    ("layer_split", "20,0", "expected whole numbers of layers >= 1, got 0"),
    ("layer_split", "20,-4", "got '-4'"),
    ("layer_split", "20,x", "got 'x'"),
    ("layer_split", "2.5,2", "got '2.5'"),
    ("layer_split", "", "expected one layer count per device"),
    ("simulated_vram_files", "a.json,,b.json", "expected file paths, got ''"),
]


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A clean environment: no STRATA_* variables, XDG config under a temporary directory."""
    for key in list(os.environ):
        if key.startswith("STRATA_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    (tmp_path / "config" / "strata").mkdir(parents=True)
    return tmp_path / "config" / "strata" / "config.toml"


def _fails_with(capsys: pytest.CaptureFixture[str], argv: list[str], *fragments: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got: {err!r}"
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(("option", "value", "expected"), BAD_VALUES)
def test_bad_flag_value_is_one_line_naming_the_flag(
    env: Path, capsys: pytest.CaptureFixture[str], option: str, value: str, expected: str
) -> None:
    flag = "--" + option.replace("_", "-")
    _fails_with(capsys, ["config", "show", f"{flag}={value}"], flag, repr(value), expected)


@pytest.mark.parametrize(("option", "value", "expected"), BAD_VALUES)
def test_bad_environment_value_is_one_line_naming_the_variable(
    env: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    option: str,
    value: str,
    expected: str,
) -> None:
    var = "STRATA_" + option.upper()
    monkeypatch.setenv(var, value)
    _fails_with(capsys, ["config", "show"], var, repr(value), expected)


TOML_BAD = [
    ("port", '"abc"', "'abc'", "expected an integer, not a string"),
    # TOML has types: a string is never read as a number, nor a number as a boolean
    ("port", '"8000"', "'8000'", "expected an integer, not a string: write port = 8000 without"),
    ("fast_decode", '"yes"', "'yes'", "expected true or false, not a string"),
    ("fast_decode", "1", "1", "expected true or false, not an integer"),
    ("cpu_share", '"0.5"', "'0.5'", "expected a number, not a string: write cpu_share = 0.5"),
    ("port", "70000", "70000", "less than or equal to 65535"),
    ("port", "true", "True", "not a boolean"),
    ("port", "80.5", "80.5", "integer"),
    ("threads", "-2", "-2", "greater than or equal to 1"),
    ("context_length", "[1, 2]", "[1, 2]", "integer"),
    ("log_level", '"loud"', "'loud'", "debug, info, warning, error or critical"),
    ("kv_cache_type", "16", "16", "f16 or f32"),
    ("api_key", '""', "''", "not an empty or blank string"),
    ("port", "8e3", "8000.0", "expected an integer, not a float"),  # would pass as 8000
    ("cache_mib", "1e3", "1000.0", "expected an integer, not a float"),
    ("context_length", "4096.0", "4096.0", "expected an integer, not a float"),
    ("model", '""', "''", "not an empty string"),
    ("layer_split", "[2.0, 2]", "[2.0, 2]", "got 2.0"),  # would pass as 2, silently
    ("layer_split", "[true, 2]", "[True, 2]", "got True"),
    ("layer_split", "[]", "[]", "one layer count per device"),
    ("devices", '["cuda:0", 1]', "['cuda:0', 1]", "expected device names, got 1"),
    ("devices", '"tpu"', "'tpu'", "'tpu' is not a device"),
    ("devices", "3", "3", "list"),
]


@pytest.mark.parametrize(("option", "toml", "shown", "expected"), TOML_BAD)
def test_bad_file_value_is_one_line_naming_the_key_and_file(
    env: Path,
    capsys: pytest.CaptureFixture[str],
    option: str,
    toml: str,
    shown: str,
    expected: str,
) -> None:
    env.write_text(f"{option} = {toml}\n")
    _fails_with(capsys, ["config", "show"], f"{option} (in {env})", shown, expected)


def test_unknown_key_in_file_is_an_error(env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env.write_text("prot = 8000\n")
    _fails_with(capsys, ["config", "show"], "prot", "unknown option", str(env))


def test_unknown_environment_variable_is_an_error(
    env: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRATA_PROT", "8000")
    _fails_with(capsys, ["config", "show"], "STRATA_PROT", "unknown option")


def test_the_decode_cut_knob_is_not_an_option_and_passes(
    env: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``STRATA_DECODE_TUNE`` is read by the engine, not the configuration: the CLI lets it
    through (it once refused it, so ``strata bench`` could not use it)."""
    from strata.daemon.config import ENV_RESERVED
    from strata.engine.gpu.decode import TUNE_ENV

    assert TUNE_ENV in ENV_RESERVED
    monkeypatch.setenv(TUNE_ENV, "router=2:1")
    assert main(["config", "show"]) == 0
    assert "unknown option" not in capsys.readouterr().err


def test_unknown_flag_is_an_error(env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails_with(capsys, ["config", "show", "--prot", "8000"], "--prot")


def test_malformed_toml_is_an_error_naming_the_file(
    env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env.write_text("port = [\n")
    _fails_with(capsys, ["config", "show"], str(env), "not valid TOML")


def test_missing_named_config_file_is_an_error(
    env: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = tmp_path / "nope.toml"
    _fails_with(capsys, ["config", "show", "--config", str(missing)], "--config", str(missing))


def test_absent_default_config_file_is_fine(env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert not env.exists()
    assert main(["config", "show"]) == 0
    assert "no config.toml found" in capsys.readouterr().out


def _show(env_vars: dict[str, str], *argv: str) -> dict[str, tuple[str, str]]:
    """Run the real ``strata config show`` and parse ``name = value  # source`` lines."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    environ.update(env_vars)
    proc = subprocess.run(
        [sys.executable, "-m", "strata", "config", "show", *argv],
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    shown = {}
    for line in proc.stdout.splitlines():
        if line.startswith("#"):
            continue
        name, _, rest = line.partition("=")
        value, _, source = rest.partition("#")
        shown[name.strip()] = (value.strip(), source.strip())
    return shown


def test_precedence_is_flag_then_environment_then_file_then_default(env: Path) -> None:
    env.write_text('port = 9001\nthreads = 3\ncontext_length = 2048\nlog_level = "warning"\n')
    xdg = {"XDG_CONFIG_HOME": str(env.parent.parent)}
    shown = _show(
        {**xdg, "STRATA_PORT": "9002", "STRATA_THREADS": "4"},
        "--port",
        "9003",
    )
    assert shown["port"] == ("9003", "command line --port")
    assert shown["threads"] == ("4", "environment STRATA_THREADS")
    assert shown["context_length"] == ("2048", f"file {env}")
    assert shown["log_level"] == ('"warning"', f"file {env}")
    assert shown["prefill_chunk_tokens"] == ("1024", "default")
    assert shown["host"] == ('"127.0.0.1"', "default")


def test_config_flag_and_strata_config_variable_name_the_file(tmp_path: Path, env: Path) -> None:
    named = tmp_path / "other.toml"
    named.write_text("port = 9100\n")
    env.write_text("port = 9200\n")  # the default file is ignored when another is named
    xdg = {"XDG_CONFIG_HOME": str(env.parent.parent)}
    assert _show(xdg, "--config", str(named))["port"] == ("9100", f"file {named}")
    assert _show({**xdg, "STRATA_CONFIG": str(named)})["port"] == ("9100", f"file {named}")


def test_values_are_normalised_not_clamped(env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "--log-level", "DEBUG", "--kv-cache-type", "F32"]) == 0
    out = capsys.readouterr().out
    assert re.search(r'^log_level += "debug"', out, re.M)
    assert re.search(r'^kv_cache_type += "f32"', out, re.M)


def test_every_option_is_documented() -> None:
    from strata.daemon.config import OPTION_NAMES

    doc = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    missing = [name for name in OPTION_NAMES if f"| `{name}` |" not in doc]
    assert not missing, f"options missing from docs/configuration.md: {missing}"


def test_a_non_loopback_host_needs_a_key_or_an_explicit_exposure(
    env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for host in ("0.0.0.0", "192.168.1.20", "::", "example.lan"):
        _fails_with(capsys, ["config", "show", "--host", host], repr(host), "api_key",
                    "allow_remote_without_key")  # fmt: skip
    for ok in (["--host", "0.0.0.0", "--api-key", "k"],
               ["--host", "0.0.0.0", "--allow-remote-without-key"],
               ["--host", "::1"], ["--host", "localhost"], ["--host", "127.0.0.2"]):  # fmt: skip
        assert main(["config", "show", *ok]) == 0, ok
        capsys.readouterr()


def test_config_show_never_prints_the_key(env: Path) -> None:
    xdg = {"XDG_CONFIG_HOME": str(env.parent.parent)}
    shown = _show({**xdg, "STRATA_API_KEY": "sk-very-secret"})
    assert shown["api_key"] == ('"********"', "environment STRATA_API_KEY")
    assert _show(xdg)["api_key"] == ("unset", "default")


def test_a_config_file_that_is_not_utf8_is_one_line_naming_it(
    env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env.write_bytes(b"port = 9001\n# caf\xe9\n")
    _fails_with(capsys, ["config", "show"], str(env), "not UTF-8")


def test_the_engine_options_are_the_ones_engine_options_reads() -> None:
    """`strata generate` and `strata bench` take the engine's options as flags: every option
    that reaches EngineOptions is one of them (a new one must not go missing from their --help)."""
    import dataclasses

    from strata.daemon.config import BENCH_OPTIONS, ENGINE_OPTIONS, OPTION_NAMES
    from strata.engine.options import EngineOptions

    fields = {f.name for f in dataclasses.fields(EngineOptions)}
    read = (fields & set(OPTION_NAMES)) | {"elastic_reserve_mib", "model", "log_level"}
    assert read == ENGINE_OPTIONS, read ^ ENGINE_OPTIONS
    assert BENCH_OPTIONS < ENGINE_OPTIONS and "cache_mib" not in BENCH_OPTIONS


# -- several devices (issue 21): the rules between devices, layer_split and the simulated files ----

SPLIT_RULES = [
    ({"STRATA_LAYER_SPLIT": "20,28"}, ["layer_split 20,28 needs devices"]),
    (
        {"STRATA_DEVICES": "cuda:0,cuda:1", "STRATA_LAYER_SPLIT": "48"},
        ["layer_split 48", "1 count(s) for the 2 device(s)", "cuda:0,cuda:1", "one per device"],
    ),
    (
        {"STRATA_DEVICES": "cuda:0", "STRATA_LAYER_SPLIT": "20,28"},
        ["layer_split 20,28", "2 count(s) for the 1 device(s)"],
    ),
    (
        {"STRATA_DEVICES": "cuda:0,cuda:1", "STRATA_DEVICE": "cuda:1"},
        ["device 'cuda:1' and devices cuda:0,cuda:1 are both set"],
    ),
    (
        {"STRATA_DEVICES": "cpu,cpu", "STRATA_VRAM_MONITOR": "simulated",
         "STRATA_SIMULATED_VRAM_FILE": "/tmp/a.json"},
        ["vram_monitor = simulated with 2 devices needs simulated_vram_files"],
    ),
    (
        {"STRATA_DEVICES": "cpu,cpu", "STRATA_VRAM_MONITOR": "simulated",
         "STRATA_SIMULATED_VRAM_FILES": "/tmp/a.json"},
        ["simulated_vram_files /tmp/a.json has 1 file(s) for 2 device(s)"],
    ),
    (
        {"STRATA_SIMULATED_VRAM_FILES": "/tmp/a.json", "STRATA_SIMULATED_VRAM_FILE": "/tmp/b"},
        ["simulated_vram_file and simulated_vram_files are both set"],
    ),
]  # fmt: skip


@pytest.mark.parametrize(("environ", "fragments"), SPLIT_RULES)
def test_a_broken_split_is_one_line_naming_the_options_and_values(
    env: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    environ: dict[str, str],
    fragments: list[str],
) -> None:
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    _fails_with(capsys, ["config", "show"], *fragments)


def test_devices_and_layer_split_from_each_layer(env: Path) -> None:
    import argparse

    from strata.daemon.config import load_config

    env.write_text('devices = ["CUDA:0", "cuda:1"]\nlayer_split = [20, 28]\n')
    loaded = load_config(argparse.Namespace(), {"XDG_CONFIG_HOME": str(env.parents[1])})
    assert loaded.config.devices == ["cuda:0", "cuda:1"]
    assert loaded.config.layer_split == [20, 28]
    assert loaded.config.device_count == 2
    environ = {"XDG_CONFIG_HOME": str(env.parents[1]), "STRATA_LAYER_SPLIT": " 24 , 24 "}
    assert load_config(argparse.Namespace(), environ).config.layer_split == [24, 24]
    args = argparse.Namespace(opt_devices="cpu,cpu,cpu", opt_layer_split="1,1,2")
    config = load_config(args, environ).config  # the flags win over the file
    assert config.devices == ["cpu", "cpu", "cpu"] and config.layer_split == [1, 1, 2]
    assert config.simulated_files() == [None, None, None]


def test_one_device_is_as_before(env: Path) -> None:
    import argparse

    from strata.daemon.config import load_config

    config = load_config(argparse.Namespace(), {"XDG_CONFIG_HOME": str(env.parents[1])}).config
    assert config.devices is None and config.layer_split is None and config.device_count == 1
    sim = {"XDG_CONFIG_HOME": str(env.parents[1]), "STRATA_VRAM_MONITOR": "simulated",
           "STRATA_SIMULATED_VRAM_FILE": "/tmp/one.json"}  # fmt: skip
    assert load_config(argparse.Namespace(), sim).config.simulated_files() == [
        Path("/tmp/one.json")
    ]


def test_config_show_prints_lists_as_toml_arrays(
    env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env.write_text('devices = ["cuda:0", "cuda:1"]\n')
    assert main(["config", "show", "--layer-split", "20,28"]) == 0
    out = capsys.readouterr().out
    assert re.search(r'^devices\s+= \["cuda:0", "cuda:1"\]\s+# file ', out, re.M), out
    assert re.search(r"^layer_split\s+= \[20, 28\]\s+# command line --layer-split", out, re.M)
    # what config show prints reads back as the same configuration
    env.write_text('devices = ["cuda:0", "cuda:1"]\nlayer_split = [20, 28]\n')
    assert main(["config", "show"]) == 0
    assert re.search(r"^layer_split\s+= \[20, 28\]\s+# file ", capsys.readouterr().out, re.M)


def test_engine_options_carry_the_split_as_tuples_and_nothing_without_it() -> None:
    from strata.daemon.config import StrataConfig
    from strata.daemon.engine_setup import engine_options
    from strata.engine.options import EngineOptions

    plain = engine_options(StrataConfig(device="cpu"))
    assert plain.devices is None and plain.layer_split is None
    assert (EngineOptions().devices, EngineOptions().layer_split) == (None, None)
    split = engine_options(StrataConfig(devices="cpu,cpu", layer_split="1,3"), "cpu")
    assert split.devices == ("cpu", "cpu") and split.layer_split == (1, 3)
    automatic = engine_options(StrataConfig(devices="cpu,cpu"), "cpu")
    assert automatic.devices == ("cpu", "cpu") and automatic.layer_split is None
    # strata generate names no device: the first stage's, never "auto"'s guess
    assert engine_options(StrataConfig(devices="cuda:1,cuda:0")).device == "cuda:1"
