"""llama.cpp's side of the bench: ``llama-bench`` on the same file, one process per
``--n-cpu-moe`` value, so that each gets its own peak VRAM (NVML, polled while it runs) and its own
peak RSS (its VmHWM, polled too).

The binary is the user's (llama.cpp's CUDA build, ``-DGGML_CUDA=ON``); Strata neither ships nor
builds it. Flags: ``-ngl 99 -fa 1 -p <prefill sizes> -n <decode tokens> -r <reps> -o json
--n-cpu-moe N``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from strata.bench import stats

if TYPE_CHECKING:
    from strata.bench.probes import VramPeak

log = logging.getLogger(__name__)

Row = dict[str, Any]
POLL_S = 0.01
STDERR_TAIL = 2000
INFO_KEYS = (
    "build_commit", "build_number", "gpu_info", "cpu_info", "model_size", "model_n_params",
    "n_threads", "n_batch", "n_ubatch", "type_k", "type_v",
)  # fmt: skip


def command(
    binary: Path, model: Path, prefill: Sequence[int], decode_tokens: int, reps: int, n_cpu_moe: int
) -> list[str]:
    return [
        str(binary),
        "-m", str(model),
        "-ngl", "99",
        "-fa", "1",
        "-p", ",".join(str(p) for p in prefill),
        "-n", str(decode_tokens),
        "-r", str(reps),
        "-o", "json",
        "--n-cpu-moe", str(n_cpu_moe),
    ]  # fmt: skip


def parse_output(text: str) -> tuple[dict[str, Row], Row]:
    """llama-bench's JSON (one object per test) -> tests by name (``pp512``, ``tg128``), each
    with its raw samples and their summary, and the build/device info of the first object."""
    entries = json.loads(text)
    if not isinstance(entries, list):
        raise ValueError("llama-bench -o json did not print a JSON list")
    tests: dict[str, Row] = {}
    info: Row = {}
    for e in entries:
        n_prompt, n_gen = int(e["n_prompt"]), int(e["n_gen"])
        name = f"pp{n_prompt}" if n_gen == 0 else f"tg{n_gen}"
        samples = [float(x) for x in e.get("samples_ts", [])] or [float(e["avg_ts"])]
        tests[name] = {
            "n_prompt": n_prompt,
            "n_gen": n_gen,
            "avg_ts": float(e["avg_ts"]),
            "stddev_ts": float(e.get("stddev_ts", 0.0)),
            "samples_ts": samples,
            "samples_ns": [int(x) for x in e.get("samples_ns", [])],
            "tok_s": stats.summary(samples),
        }
        if not info:
            info = {k: e[k] for k in INFO_KEYS if k in e}
    return tests, info


def _vm_hwm(pid: int) -> int:
    """The process's peak RSS so far (VmHWM). Read while it runs: the rusage of a child reaped
    with wait4 would report the parent's RSS at fork time when the parent is larger."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def run_one(cmd: list[str], vram: VramPeak | None, timeout_s: float) -> Row:
    """Run one llama-bench process, polling NVML for its peak VRAM (the device's used memory
    above what it was just before the start) and /proc for its peak RSS."""
    base = vram.used() if vram is not None else None
    peak = base
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        status, hwm = 0, 0
        try:
            while True:
                pid, status, _ = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                hwm = max(hwm, _vm_hwm(proc.pid))
                if vram is not None:
                    now = vram.used()
                    peak = max(peak or 0, now or 0)
                if time.monotonic() - t0 > timeout_s:
                    proc.send_signal(signal.SIGKILL)
                    _, status, _ = os.wait4(proc.pid, 0)
                    break
                time.sleep(POLL_S)
        except BaseException:
            proc.kill()
            os.wait4(proc.pid, 0)
            raise
        finally:
            proc.returncode = -1  # reaped here: Popen must not wait for it again
        wall = time.monotonic() - t0
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    code = os.waitstatus_to_exitcode(status)
    row: Row = {
        "command": cmd,
        "returncode": code,
        "wall_s": wall,
        "peak_rss_bytes": hwm or None,
        "peak_vram_bytes": None if base is None or peak is None else peak - base,
        "nvml_base_bytes": base,
        "error": None,
        "tests": {},
    }
    if code != 0:
        why = "killed after the time limit" if code == -signal.SIGKILL else f"exit {code}"
        row["error"] = f"llama-bench failed ({why}): {stderr[-STDERR_TAIL:].strip()}"
        return row
    try:
        row["tests"], row["info"] = parse_output(stdout)
    except (ValueError, KeyError, TypeError) as e:
        row["error"] = f"cannot read llama-bench's JSON: {e}: {stdout[:STDERR_TAIL]!r}"
    return row


def run_all(
    binary: Path,
    model: Path,
    prefill: Sequence[int],
    decode_tokens: int,
    reps: int,
    n_cpu_moe: Sequence[int],
    vram: VramPeak | None,
    vram_reason: str | None,
    timeout_s: float,
    progress: Callable[[str], None],
    rows: list[Row],
) -> None:
    """One llama-bench process per ``n_cpu_moe`` value; each row is appended to ``rows`` as
    soon as it is done (so an interrupted run keeps the finished ones)."""
    for i, n in enumerate(n_cpu_moe):
        cmd = command(binary, model, prefill, decode_tokens, reps, n)
        log.info("running %s", " ".join(cmd))
        row = {"n_cpu_moe": n, **run_one(cmd, vram, timeout_s)}
        if vram is None:
            row["nvml_reason"] = vram_reason
        if row["error"]:
            log.warning("llama-bench --n-cpu-moe %d: %s", n, row["error"])
        rows.append(row)
        following = f"llama.cpp --n-cpu-moe {n_cpu_moe[i + 1]}" if i + 1 < len(n_cpu_moe) else ""
        progress(following or "done")
