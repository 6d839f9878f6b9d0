"""``strata generate`` as a user runs it: text on stdout, the rest on stderr, clear errors."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import gguf
import pytest

from strata.engine.synth import ensure_synthetic
from tests.helpers import run_strata


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_synthetic("tiny-qwen3moe", tmp_path_factory.mktemp("models"))


def strata(*argv: str, tmp: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return run_strata("generate", *argv, tmp=tmp, stdin=stdin)


def test_only_generated_text_goes_to_stdout(tiny: Path, tmp_path: Path) -> None:
    proc = strata("--model", str(tiny), "--prompt", "Hello", "--max-tokens", "16",
                  "--temperature", "0", tmp=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "tok/s" in proc.stderr and "16 tokens" in proc.stderr
    assert "tok/s" not in proc.stdout and "loaded" not in proc.stdout


def test_prompt_from_stdin_and_greedy_is_repeatable(tiny: Path, tmp_path: Path) -> None:
    args = ("--model", str(tiny), "--max-tokens", "12", "--temperature", "0")
    a = strata(*args, tmp=tmp_path, stdin="Once upon a time")
    b = strata(*args, "--prompt", "Once upon a time", tmp=tmp_path)
    assert a.returncode == b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout


def test_same_seed_gives_the_same_sampled_text(tiny: Path, tmp_path: Path) -> None:
    args = ("--model", str(tiny), "--prompt", "Hi", "--max-tokens", "16", "--temperature", "1.0")
    a = strata(*args, "--seed", "7", tmp=tmp_path)
    b = strata(*args, "--seed", "7", tmp=tmp_path)
    c = strata(*args, "--seed", "8", tmp=tmp_path)
    assert a.stdout == b.stdout
    assert a.stdout != c.stdout


def test_chat_applies_the_template(tiny: Path, tmp_path: Path) -> None:
    proc = strata("--model", str(tiny), "--chat", "--prompt", "Hello", "--max-tokens", "8",
                  "--temperature", "0", tmp=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


def test_missing_model_file_exits_2_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    proc = strata("--model", str(missing), "--prompt", "x", tmp=tmp_path)
    assert proc.returncode == 2
    assert str(missing) in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "cache" / "strata").exists(), "must not fall back to the demo model"


def test_file_that_is_not_gguf_exits_2_naming_it(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"this is not a GGUF file at all" * 10)
    proc = strata("--model", str(bogus), "--prompt", "x", tmp=tmp_path)
    assert proc.returncode == 2
    assert str(bogus) in proc.stderr and "Traceback" not in proc.stderr


def test_unsupported_architecture_exits_2_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    proc = strata("--model", str(path), "--prompt", "x", tmp=tmp_path)
    assert proc.returncode == 2
    assert "'gpt2'" in proc.stderr and "not supported" in proc.stderr


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--max-tokens", "0"), ("--max-tokens", "ten"), ("--temperature", "-1"), ("--top-p", "2")],
)
def test_bad_sampling_flag_exits_2_naming_it(
    tiny: Path, tmp_path: Path, flag: str, value: str
) -> None:
    proc = strata("--model", str(tiny), "--prompt", "x", flag, value, tmp=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"strata: error: {flag}: invalid value {value!r}")


def test_prompt_beyond_the_context_exits_2_naming_both_numbers(tiny: Path, tmp_path: Path) -> None:
    proc = strata("--model", str(tiny), "--context-length", "64", "--prompt", "Hello",
                  "--max-tokens", "100", tmp=tmp_path)  # fmt: skip
    assert proc.returncode == 2
    assert "max_tokens 100" in proc.stderr and "context length of 64" in proc.stderr


def test_cache_mib_reports_the_effective_size_and_hit_rate(tiny: Path, tmp_path: Path) -> None:
    proc = strata("--model", str(tiny), "--prompt", "Hello", "--max-tokens", "8",
                  "--temperature", "0", "--cache-mib", "13", "--arena-chunk-mib", "2",
                  tmp=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # 1.5 MiB slots: 13 MiB holds 8 whole slots (12 MiB)
    assert "[expert cache: 8 of 32 experts, 12 MiB]" in proc.stderr
    assert re.search(r"expert cache hit rate \d+\.\d%", proc.stderr), proc.stderr
    profiles = list((tmp_path / "state" / "strata" / "profiles").glob("*.json"))
    assert len(profiles) == 1, "the run's expert usage is saved for the next start"


def test_without_a_cache_the_hit_rate_says_so(tiny: Path, tmp_path: Path) -> None:
    proc = strata("--model", str(tiny), "--prompt", "Hello", "--max-tokens", "4",
                  "--cache-mib", "0", tmp=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "hit rate n/a (no expert cache" in proc.stderr
