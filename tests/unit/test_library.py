"""The model library: short names, the folder's models, names resolved where a model file is
asked for, ``strata models`` (list, rm) and ``/v1/models``."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import gguf
import pytest

from strata.daemon import library
from strata.daemon.api.openai_models import ModelNames
from strata.daemon.cli import main
from strata.daemon.config import StrataConfig
from strata.daemon.engine_setup import model_path
from strata.engine import gguf_split, synth

Q = gguf.GGMLQuantizationType
SMALL = synth.ModelSpec("qwen3moe", 2, 64, 4, 2, 16, 4, 2, 64, 256, 1e6, 1e-6)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("small") / "small.gguf"
    return synth.write_model(path, SMALL, synth.vocab_for("qwen3moe"),
                             synth.TypePlan.uniform(Q.Q4_0), seed=5)  # fmt: skip


@pytest.fixture
def shelf(tmp_path: Path, small: Path) -> Path:
    """A library of three: a pulled model (its folder and manifest), a loose file and a loose
    split set."""
    root = tmp_path / "models"
    pulled = root / "qwen3.6-35b-a3b:ud-q4_k_m"
    pulled.mkdir(parents=True)
    shutil.copy(small, pulled / "Qwen3.6-35B-A3B-UD-Q4_K_M.gguf")
    entry = library.FileEntry("Qwen3.6-35B-A3B-UD-Q4_K_M.gguf", small.stat().st_size)
    library.write_manifest(pulled, "qwen3.6-35b-a3b:ud-q4_k_m", "unsloth/Qwen3.6-35B-A3B-GGUF",
                           "UD-Q4_K_M", "abc", [entry])  # fmt: skip
    shutil.copy(small, root / "Loose.gguf")
    gguf_split.write_parts(small, root / "parted.gguf", 2)
    return root


def test_short_names_come_from_the_repository_and_the_quantisation() -> None:
    assert library.short_name("unsloth/Qwen3.6-35B-A3B-GGUF", "UD-Q4_K_M") == (
        "qwen3.6-35b-a3b:ud-q4_k_m"
    )
    assert library.short_name("ggml-org/gpt-oss-120b-GGUF", "MXFP4") == "gpt-oss-120b:mxfp4"
    assert library.short_name("someone/Model_gguf", "Q8_0") == "model:q8_0"
    with pytest.raises(ValueError, match="no model name"):
        library.short_name("someone/-GGUF", "Q8_0")


def test_the_folder_lists_pulled_loose_and_split_models(shelf: Path) -> None:
    found = {m.name: m for m in library.models(shelf)}
    assert sorted(found) == ["loose", "parted", "qwen3.6-35b-a3b:ud-q4_k_m"]
    assert found["qwen3.6-35b-a3b:ud-q4_k_m"].repo == "unsloth/Qwen3.6-35B-A3B-GGUF"
    assert [p.name for p in found["parted"].files] == [
        "parted-00001-of-00002.gguf", "parted-00002-of-00002.gguf"]  # fmt: skip
    facts = library.facts(found["parted"])
    assert facts.arch == "qwen3moe" and facts.types[0] == "Q4_0" and not facts.problem
    assert library.listed(shelf)[0][0] == "loose"


def test_a_damaged_manifest_is_skipped_and_logged(shelf: Path, caplog) -> None:
    (shelf / "qwen3.6-35b-a3b:ud-q4_k_m" / library.MANIFEST).write_text("{not json")
    with caplog.at_level("WARNING"):
        names = [m.name for m in library.models(shelf)]
    assert names == ["loose", "parted"] and "not a readable model manifest" in caplog.text


def test_names_resolve_to_the_first_file_and_paths_stay_paths(shelf: Path) -> None:
    first = shelf / "qwen3.6-35b-a3b:ud-q4_k_m" / "Qwen3.6-35B-A3B-UD-Q4_K_M.gguf"
    assert library.resolve(shelf, "qwen3.6-35b-a3b:ud-q4_k_m") == first
    assert library.resolve(shelf, "Qwen3.6-35B-A3B:UD-Q4_K_M") == first  # case does not matter
    assert library.resolve(shelf, "qwen3.6-35b-a3b") == first  # the one quantisation it has
    assert library.resolve(shelf, "parted") == shelf / "parted-00001-of-00002.gguf"
    assert library.resolve(shelf, "elsewhere/x.gguf") == Path("elsewhere/x.gguf")
    with pytest.raises(library.LibraryError, match="no such file, and no model of that name") as e:
        library.resolve(shelf, "llama3:8b")
    assert str(shelf) in str(e.value) and "loose, parted" in str(e.value)


def test_the_repository_and_quant_it_was_pulled_as_name_it_too(shelf: Path) -> None:
    first = shelf / "qwen3.6-35b-a3b:ud-q4_k_m" / "Qwen3.6-35B-A3B-UD-Q4_K_M.gguf"
    for spec in ("unsloth/Qwen3.6-35B-A3B-GGUF:UD-Q4_K_M", "hf.co/unsloth/qwen3.6-35b-a3b-gguf"):
        assert library.resolve(shelf, spec) == first
    with pytest.raises(library.LibraryError, match=r"library has unsloth/Qwen3\.6-35B"):
        library.resolve(shelf, "unsloth/Qwen3.6-35B-A3B-GGUF:Q8_0")
    with pytest.raises(library.LibraryError, match=r"`strata pull other/Model-GGUF:Q4_K_M` gets"):
        library.resolve(shelf, "other/Model-GGUF:Q4_K_M")


def test_a_name_without_its_quantisation_that_names_two_is_refused(shelf: Path) -> None:
    twin = shelf / "qwen3.6-35b-a3b:q8_0"
    shutil.copytree(shelf / "qwen3.6-35b-a3b:ud-q4_k_m", twin)
    body = json.loads((twin / library.MANIFEST).read_text())
    (twin / library.MANIFEST).write_text(json.dumps({**body, "name": "qwen3.6-35b-a3b:q8_0"}))
    with pytest.raises(library.LibraryError, match="in 2 quantisations"):
        library.resolve(shelf, "qwen3.6-35b-a3b")


def test_a_pulled_model_missing_a_file_says_how_to_get_it_again(shelf: Path) -> None:
    (shelf / "qwen3.6-35b-a3b:ud-q4_k_m" / "Qwen3.6-35B-A3B-UD-Q4_K_M.gguf").unlink()
    with pytest.raises(library.LibraryError, match=r"strata pull unsloth/Qwen3\.6-35B-A3B-GGUF"):
        library.resolve(shelf, "qwen3.6-35b-a3b:ud-q4_k_m")


def test_the_model_option_takes_a_library_name(shelf: Path) -> None:
    config = StrataConfig(model="parted", models_dir=str(shelf))
    assert model_path(config) == shelf / "parted-00001-of-00002.gguf"
    assert library.name_of(model_path(config), shelf) == "parted"
    assert library.name_of(Path("/x/other-00001-of-00002.gguf"), shelf) == "other"


def test_v1_models_lists_the_library_after_the_served_names(shelf: Path) -> None:
    names = ModelNames.of("parted", "parted-00001-of-00002.gguf", ["gpt-4o"], True)
    data = names.listing(7, library.listed(shelf))["data"]
    assert [(m["id"], m["status"]["value"]) for m in data] == [
        ("parted", "loaded"), ("gpt-4o", "loaded"), ("loose", "unloaded"),
        ("qwen3.6-35b-a3b:ud-q4_k_m", "unloaded"),
    ]  # fmt: skip


def test_the_endpoint_lists_the_library(shelf: Path) -> None:
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from strata.daemon.api.http import create_app

    daemon = SimpleNamespace(
        config=StrataConfig(models_dir=str(shelf)), state="ready", model_id="loose",
        model_path=shelf / "Loose.gguf", device="cpu", started=0.0, status=lambda: {},
        sizes=lambda: [], worker=SimpleNamespace(engine=object(), steps=0), controller=None,
        controls=None,
    )  # fmt: skip
    client = TestClient(create_app(daemon), base_url="http://localhost")
    r = client.get("/v1/models")
    assert r.status_code == 200, r.text
    assert [(m["id"], m["status"]["value"]) for m in r.json()["data"]] == [
        ("loose", "loaded"), ("parted", "unloaded"),
        ("qwen3.6-35b-a3b:ud-q4_k_m", "unloaded"),
    ]  # fmt: skip


# -- the command ---------------------------------------------------------------------------------


@pytest.fixture
def daemon_serving() -> Iterator[tuple[int, list[str]]]:
    """A stand-in daemon on 127.0.0.1, port 0, answering /v1/vram with the path set in the
    list it yields (empty: no model_path)."""
    served: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"model_path": served[0] if served else None}).encode()
            self.send_response(200 if self.path == "/v1/vram" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server.server_address[1], served
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _models(shelf: Path, port: int, *args: str) -> list[str]:
    return ["models", *args, "--models-dir", str(shelf), "--port", str(port)]


def test_strata_models_lists_size_arch_types_and_which_is_loaded(
    shelf: Path, daemon_serving, capsys, monkeypatch
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(shelf.parent / "config"))
    port, served = daemon_serving
    served.append(str(shelf / "parted-00001-of-00002.gguf"))
    assert main(_models(shelf, port)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "ARCH", "TYPES", "LOADED"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["parted"][-1] == "yes" and rows["loose"][-1] == "no"
    assert rows["loose"][3] == "qwen3moe" and rows["loose"][4].startswith("Q4_0")
    assert main(_models(shelf, port, "--json")) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["name"]: r["loaded"] for r in rows} == {
        "loose": False, "parted": True, "qwen3.6-35b-a3b:ud-q4_k_m": False}  # fmt: skip


def test_strata_models_rm_deletes_but_not_the_served_model(
    shelf: Path, daemon_serving, capsys, monkeypatch
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(shelf.parent / "config"))
    port, served = daemon_serving
    served.append(str(shelf / "Loose.gguf"))
    assert main(_models(shelf, port, "rm", "loose")) == 2
    assert "the one the daemon serves" in capsys.readouterr().err
    assert main(_models(shelf, port, "rm", "qwen3.6-35b-a3b:ud-q4_k_m")) == 0
    assert main(_models(shelf, port, "rm", "parted")) == 0
    assert not (shelf / "qwen3.6-35b-a3b:ud-q4_k_m").exists()
    assert sorted(p.name for p in shelf.iterdir()) == ["Loose.gguf"]
    assert main(_models(shelf, port, "rm", "parted")) == 2
    assert "no model of that name" in capsys.readouterr().err


def test_an_empty_library_says_how_to_fill_it(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    assert main(["models", "--models-dir", str(tmp_path / "none")]) == 0
    assert "strata pull" in capsys.readouterr().out
