"""``python -m strata.bench.gemm_sweep``, the prompt-chunk GEMM's tile sweep, on tiny shapes.

In Triton's interpreter on the CPU (CI), compiled on a GPU: a sweep's rows (every type x form x
tile) checked against the torch twin and timed, its JSON; a tile whose output is off is
``WRONG`` and never the best, one that fails to launch is reported in its row; the time limit
skips the rows it has not started (a fake clock, no wall-clock assumption); bad arguments exit 2
naming the bad value.
"""

from __future__ import annotations

import json
import math
import os
import time
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed")
from triton.runtime.errors import OutOfResources

from strata.bench import gemm_sweep
from strata.engine import synth_gpt_oss
from strata.engine.kernels import gemm

Q = gguf.GGMLQuantizationType
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TILE = "16,256,8,4,1"  # one program across N, one step along K: cheap in the interpreter
TINY = ["--d", "256", "--f", "256", "--experts", "4", "--top-k", "2", "--tokens", "8",
        "--reps", "1"]  # fmt: skip
# the interpreter computes masked-out lanes too (padding rows, random bytes)
quiet = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@quiet
def test_a_tiny_sweep_checks_and_times_every_row(capsys) -> None:
    assert gemm_sweep.main([*TINY, "--types", "Q8_0,Q4_K", "--tiles", TILE, "--json"]) == 0
    cap = capsys.readouterr()
    result = json.loads(cap.out)  # stdout holds the JSON alone; the table went to stderr
    rows = result["rows"]
    assert [(r["qtype"], r["form"]) for r in rows] == [
        (q, f) for q in ("Q8_0", "Q4_K") for f in gemm_sweep.FORMS
    ]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["tile"] == TILE and r["best"] and not r["engine"]
        assert 0 <= r["max_err"] < gemm_sweep.TOL
        assert r["us"] > 0 and r["tflops"] > 0 and r["gbps"] > 0 and r["compile_s"] > 0
        assert f"{r['qtype']:<7} {r['form']:<7} {TILE}" in cap.err
    assert {(b["qtype"], b["form"], b["best_tile"]) for b in result["best"]} == {
        (q, f, TILE) for q in ("Q8_0", "Q4_K") for f in gemm_sweep.FORMS
    }
    assert all(b["engine_status"] == "not swept" for b in result["best"])
    assert result["shape"] == {"d": 256, "f": 256, "experts": 4, "top_k": 2, "tokens": 8,
                               "dense_n": 256}  # fmt: skip
    assert result["gpu_numbers"] == (DEVICE.type == "cuda")
    assert ("not GPU numbers" in result["timing"]) == (DEVICE.type == "cpu")
    assert result["engine_tiles"]["dense"] == gemm_sweep.tile_text(gemm.DENSE_TILE)
    assert result["engine_tiles"]["down"] == gemm_sweep.tile_text(gemm.MOE_TILE)
    assert result["skipped"] == [] and result["tolerance"] == gemm_sweep.TOL


@quiet
def test_a_wrong_tile_is_flagged_and_never_best_and_a_failed_one_reported(
    monkeypatch, tmp_path
) -> None:
    wrong, broken, fine = (gemm.Tile(16, bn, 8, 4, 1) for bn in (256, 128, 64))
    real = gemm.gemm

    def kernel(y, a, w, lay, add=False, tile=gemm.DENSE_TILE, bias=None):
        if tile == broken:
            raise OutOfResources(300000, 232448, "shared memory")
        real(y, a, w, lay, add=add, tile=tile, bias=bias)
        if tile == wrong:
            y.mul_(1.01)  # 1e-2 of the scale: five times the tolerance

    monkeypatch.setattr(gemm, "gemm", kernel)
    out = tmp_path / "sweep.json"
    tiles = ";".join(gemm_sweep.tile_text(t) for t in (wrong, broken, fine))
    argv = [*TINY, "--types", "Q8_0", "--forms", "dense", "--tiles", tiles, "--json", str(out)]
    assert gemm_sweep.main(argv) == 0
    result = json.loads(out.read_text())
    by_tile = {r["tile"]: r for r in result["rows"]}
    bad = by_tile[gemm_sweep.tile_text(wrong)]
    assert bad["status"] == "WRONG" and not bad["best"]
    assert bad["max_err"] == pytest.approx(0.01, rel=0.2) and "max error" in bad["error"]
    failed = by_tile[gemm_sweep.tile_text(broken)]
    assert failed["status"] == "failed" and failed["us"] is None
    assert failed["error"].startswith("OutOfResources: out of resource: shared memory")
    good = by_tile[gemm_sweep.tile_text(fine)]
    assert good["status"] == "ok" and good["best"]
    assert result["best"][0]["best_tile"] == gemm_sweep.tile_text(fine)


@quiet
def test_a_type_whose_weights_cannot_be_made_fails_its_rows_alone(monkeypatch, capsys) -> None:
    real = gemm_sweep.TypeBench

    def bench(qtype, *args):
        if qtype == Q.Q4_0:
            raise RuntimeError("no room")
        return real(qtype, *args)

    monkeypatch.setattr(gemm_sweep, "TypeBench", bench)
    argv = [*TINY, "--types", "Q4_0,Q8_0", "--forms", "dense,down", "--tiles", TILE, "--json"]
    assert gemm_sweep.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["qtype"], r["status"]) for r in rows] == [
        ("Q4_0", "failed"), ("Q4_0", "failed"), ("Q8_0", "ok"), ("Q8_0", "ok")
    ]  # fmt: skip
    assert rows[0]["error"] == "its weights could not be made: RuntimeError: no room"


@quiet
def test_the_time_limit_skips_the_rows_not_started(monkeypatch, capsys) -> None:
    clock = iter(range(0, 10**6, 100))  # each reading 100 s after the last
    fake = SimpleNamespace(monotonic=lambda: float(next(clock)), perf_counter=time.perf_counter)
    monkeypatch.setattr(gemm_sweep, "time", fake)
    argv = [*TINY, "--types", "Q8_0", "--tiles", f"{TILE};16,128,8,4,1", "--time-limit", "150"]
    assert gemm_sweep.main([*argv, "--json"]) == 0
    cap = capsys.readouterr()
    result = json.loads(cap.out)
    # start at 0; the first row starts at 100, the next check reads 200 > 150
    assert [r["status"] for r in result["rows"]] == ["ok"] + ["skipped"] * 5
    assert result["skipped"][0] == "Q8_0 gate_up 16,256,8,4,1" and len(result["skipped"]) == 5
    assert "time limit 150 s: 5 rows skipped: Q8_0 gate_up 16,256,8,4,1;" in cap.err


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--types", "Q9_9"], "'Q9_9'"),
        (["--types", "Q4_K", "--d", "96"], "Q4_K: --d 96 not a multiple of its block of 256"),
        (["--tiles", "64,128"], "'64,128'"),
        (["--tiles", "48,128,4,4,3"], "BM 48 is not a power of two"),
        (["--tiles", "64,128,4,4,0"], "STAGES 0"),
        (["--tokens", "0"], "--tokens: invalid value '0'"),
        (["--tokens", "-3"], "--tokens: invalid value '-3'"),
        (["--top-k", "5"], "--top-k: invalid value 5"),
        (["--forms", "dense,up"], "'up'"),
        (["--reps", "0"], "--reps: invalid value '0'"),
        (["--time-limit", "soon"], "--time-limit: invalid value 'soon'"),
        (["--d", "100"], "--d: invalid value 100"),
        (["--preset", "gpt-9"], "'gpt-9'"),
    ],
)
def test_bad_arguments_exit_2_naming_the_value(args, named, capsys) -> None:
    base = dict(zip(TINY[::2], TINY[1::2], strict=True))
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    with pytest.raises(SystemExit) as e:
        gemm_sweep.main([v for kv in base.items() for v in kv])
    assert e.value.code == 2
    assert named in capsys.readouterr().err


def test_without_cuda_or_the_interpreter_it_says_what_to_do(monkeypatch, capsys) -> None:
    monkeypatch.setattr(gemm_sweep, "INTERPRETED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        gemm_sweep.main(TINY)
    assert e.value.code == 2
    assert "no CUDA device: set TRITON_INTERPRET=1" in capsys.readouterr().err


def test_a_preset_fills_the_shape_and_the_default_types_it_can_hold(capsys) -> None:
    spec = synth_gpt_oss.PRESETS["gpt-oss-20b"]
    want = (spec.n_embd, spec.n_ff_exp, spec.n_expert, spec.n_expert_used)
    assert gemm_sweep.preset_shape("gpt-oss-20b") == want
    shape = gemm_sweep.Shape(*want, tokens=512, dense_n=spec.n_embd)
    types, notes = gemm_sweep.parse_types(None, shape)  # 2880: no room for Q4_K's 256 blocks
    assert types == (Q.MXFP4,) and notes == [
        f"left out Q4_K: --d {spec.n_embd} and --f {spec.n_ff_exp} not a multiple of its block "
        "of 256"
    ]
    with pytest.raises(SystemExit) as e:  # asked for by name: an error
        gemm_sweep.main(["--preset", "gpt-oss-20b", "--types", "Q4_K"])
    assert e.value.code == 2 and "--types: Q4_K: --d 2880" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gemm_sweep.main(["--tokens", "8"])  # neither a preset nor the shape
    assert "give --preset or --d, --f, --experts, --top-k" in capsys.readouterr().err


def test_the_default_tiles_start_with_the_engines_and_parse_back() -> None:
    for form, engine in (("dense", gemm.DENSE_TILE), ("down", gemm.MOE_TILE)):
        tiles = gemm_sweep.default_tiles(form)
        assert tiles[0] == engine and 8 <= len(tiles) <= 12 and len(set(tiles)) == len(tiles)
        text = ";".join(gemm_sweep.tile_text(t) for t in tiles)
        assert gemm_sweep.parse_tiles(text) == tiles


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.MXFP4], ids=lambda t: t.name)
def test_the_experts_are_distinct_finite_and_of_the_intended_spread(qtype) -> None:
    # six experts from two of random values: the others are rotations, still distinct, so a
    # tile that reads another expert's slot fails the check
    s = gemm_sweep.Shape(d=256, f=256, experts=6, top_k=2, tokens=4, dense_n=256)
    pool = gemm_sweep.Pool(qtype, s, np.random.default_rng(3), DEVICE)
    assert len(set(pool.table.tolist())) == 6 and all(o % 256 == 0 for o in pool.table.tolist())
    for which in range(3):
        mats = [pool.matrix(e, which) for e in range(6)]
        for i, m in enumerate(mats):
            assert torch.isfinite(m).all()
            assert 0.5 < float(m.std()) / gemm_sweep.WEIGHT_STD < 2.0
            assert all(not torch.equal(m, o) for o in mats[i + 1 :])
    assert not math.isinf(gemm_sweep.max_err(mats[0], mats[0]))
