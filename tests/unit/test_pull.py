"""``strata pull`` against a stand-in Hugging Face Hub on 127.0.0.1 (port 0) that answers the
listing (``/api/models/…``) and file (``/…/resolve/…``) endpoints for tiny models, single and
split: quant selection, resuming, checksums, gated and missing repositories. Never the network."""

from __future__ import annotations

import hashlib
import io
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import gguf
import pytest

from strata.daemon import hf_pull, library
from strata.daemon.cli import main
from strata.daemon.commands.pull_cmd import ProgressBar, progress_line
from strata.engine import gguf_split, synth
from strata.engine.gguf_index import GGUFIndex

Q = gguf.GGMLQuantizationType
SMALL = synth.ModelSpec("qwen3moe", 2, 64, 4, 2, 16, 4, 2, 64, 256, 1e6, 1e-6)
REPO = "someone/Tiny-MoE-GGUF"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Repo:
    files: dict[str, bytes]
    gated: int | None = None  # the status of its file downloads (401 or 403), when gated
    wrong_sha: set[str] = field(default_factory=set)  # files listed with another checksum


@dataclass
class Hub:
    """The stand-in Hub's repositories, what it was asked, and the breaks it makes."""

    url: str = ""
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[tuple[str, str | None, str | None]] = field(default_factory=list)
    cut: dict[str, int] = field(default_factory=dict)  # file → bytes sent before a break, once


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _reply(self, status: int, body: bytes = b"", **headers: str) -> None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k.replace("_", "-"), v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            hub.requests.append(
                (path, self.headers.get("Range"), self.headers.get("Authorization"))
            )
            m = re.match(r"^/api/models/([^/]+/[^/]+)(/revision/.*)?$", path)
            if m:
                return self._listing(m[1])
            m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
            if m:
                return self._file(m[1], m[2], m[3])
            self._reply(404, b"{}")

        def _listing(self, repo_id: str) -> None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._reply(404, b'{"error": "Repository not found"}',
                                   X_Error_Code="RepoNotFound")  # fmt: skip
            siblings = []
            for name, data in repo.files.items():
                sha = hashlib.sha256(data + (b"x" if name in repo.wrong_sha else b"")).hexdigest()
                lfs = {"size": len(data), "sha256": sha, "pointerSize": 134}
                siblings.append({"rfilename": name, "size": len(data), "blobId": "b" * 40,
                                 "lfs": lfs})  # fmt: skip
            body = {"id": repo_id, "sha": COMMIT, "siblings": siblings, "private": False,
                    "gated": "manual" if repo.gated else False}  # fmt: skip
            self._reply(200, json.dumps(body).encode(), Content_Type="application/json")

        def _file(self, repo_id: str, revision: str, name: str) -> None:
            repo = hub.repos.get(repo_id)
            if repo is None or name not in repo.files or revision != COMMIT:
                return self._reply(404, b"{}", X_Error_Code="EntryNotFound")
            if repo.gated:
                code = {"X_Error_Code": "GatedRepo"} if repo.gated == 403 else {}
                return self._reply(repo.gated, b'{"error": "gated"}', X_Error_Message="gated",
                                   **code)  # fmt: skip
            data, start = repo.files[name], 0
            rng = self.headers.get("Range")
            if rng:
                start = int(re.match(r"bytes=(\d+)-$", rng)[1])
            body = data[start:]
            self.send_response(206 if rng else 200)
            if rng:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            cut = hub.cut.pop(name, None)
            if cut is not None:  # promise the whole body, send part of it, hang up
                self.wfile.write(body[:cut])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(body)

    return Handler


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[Hub]:
    state = Hub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", state.url)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """A tiny model's repository files: a Q4_0 single file, a Q8_0 one in 3 parts in a folder of
    its own (as unsloth lays them out), and a vision projector that is not a model."""
    d = tmp_path_factory.mktemp("repo")
    vocab = synth.vocab_for("qwen3moe")
    q4 = synth.write_model(d / "q4.gguf", SMALL, vocab, synth.TypePlan.uniform(Q.Q4_0), seed=1)
    q8 = synth.write_model(d / "q8.gguf", SMALL, vocab, synth.TypePlan.uniform(Q.Q8_0), seed=1)
    parts = gguf_split.write_parts(q8, d / "Tiny-MoE-Q8_0.gguf", 3)
    files = {"Tiny-MoE-Q4_0.gguf": q4.read_bytes(), "README.md": b"# tiny\n",
             "mmproj-Tiny-F16.gguf": b"GGUF not a model"}  # fmt: skip
    files.update({f"Q8_0/{p.name}": p.read_bytes() for p in parts})
    return files


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path / "models"


def pull(root: Path, spec: str) -> int:
    return main(["pull", spec, "--models-dir", str(root)])


# -- choosing a model ----------------------------------------------------------------------------


def test_specs_and_quant_labels() -> None:
    assert hf_pull.parse_spec("hf.co/unsloth/Qwen3-30B-A3B-GGUF:ud-q4_k_xl") == (
        "unsloth/Qwen3-30B-A3B-GGUF", "ud-q4_k_xl")  # fmt: skip
    assert hf_pull.parse_spec("https://huggingface.co/a/b") == ("a/b", None)
    for bad in ("just-a-name", "a/b/c", "a/b:Q4:K", ""):
        with pytest.raises(hf_pull.UsageError):
            hf_pull.parse_spec(bad)
    labels = {
        "Qwen3-30B-A3B-Q4_K_M.gguf": "Q4_K_M",
        "UD-Q4_K_XL/Qwen3-30B-A3B-UD-Q4_K_XL-00001-of-00002.gguf": "UD-Q4_K_XL",
        "gpt-oss-120b-mxfp4-00001-of-00003.gguf": "MXFP4",
        "mistral-7b.Q8_0.gguf": "Q8_0",
        "Q5_K_M/model-00001-of-00002.gguf": "Q5_K_M",
        "Model-IQ4_XS.gguf": "IQ4_XS",
        "model-bf16.gguf": "BF16",
    }
    for name, label in labels.items():
        assert hf_pull.quant_label(name) == label, name


def _files(*names: str) -> list[hf_pull.RemoteFile]:
    return [hf_pull.RemoteFile(n, 1, None) for n in names]


def test_the_quant_is_chosen_by_name_as_ollama_and_llama_cpp_do() -> None:
    options = hf_pull.choices(_files(
        "M-Q4_K_M.gguf", "M-Q8_0.gguf", "mmproj-M-F16.gguf", "README.md",
        "BF16/M-BF16-00001-of-00002.gguf", "BF16/M-BF16-00002-of-00002.gguf",
    ))  # fmt: skip
    assert sorted(c.label for c in options) == ["BF16", "Q4_K_M", "Q8_0"]
    assert hf_pull.choose("r", options, "q8_0").label == "Q8_0"
    assert len(hf_pull.choose("r", options, "BF16").files) == 2  # every part
    assert hf_pull.choose("r", options, None).label == "Q4_K_M"  # the default
    with pytest.raises(hf_pull.UsageError, match=r"no quantisation Q2_K \(it has: BF16, Q4_K_M"):
        hf_pull.choose("r", options, "Q2_K")
    two = hf_pull.choices(_files("M-Q5_K_M.gguf", "M-Q6_K.gguf"))
    with pytest.raises(hf_pull.UsageError, match="several quantisations"):
        hf_pull.choose("r", two, None)
    with pytest.raises(hf_pull.PullError, match=r"lacks parts .*00002-of-00003"):
        hf_pull.choices(_files("M-00001-of-00003.gguf", "M-00003-of-00003.gguf"))


# -- pulling -------------------------------------------------------------------------------------


def test_a_single_file_and_a_split_model_are_pulled_verified_and_listed(
    hub: Hub, tiny: dict[str, bytes], root: Path, capsys
) -> None:
    hub.repos[REPO] = Repo(dict(tiny))
    assert pull(root, f"{REPO}:Q4_0") == 0
    assert pull(root, f"hf.co/{REPO}:q8_0") == 0
    out = capsys.readouterr()
    assert "serve it with: strata serve --model tiny-moe:q8_0" in out.out
    assert "tiny-moe:q8_0 [" in out.err and "570.1 KiB / 570.1 KiB" in out.err  # all 3 parts
    assert "HTTP Request" not in out.err  # the HTTP client's own log stays quiet
    assert "tiny-moe:q4_0" in out.out
    got = {m.name: m for m in library.models(root)}
    assert sorted(got) == ["tiny-moe:q4_0", "tiny-moe:q8_0"]
    assert got["tiny-moe:q8_0"].repo == REPO and len(got["tiny-moe:q8_0"].files) == 3
    for m in got.values():
        for p in m.files:
            want = tiny[p.name] if p.name in tiny else tiny[f"Q8_0/{p.name}"]
            assert p.read_bytes() == want
    index = GGUFIndex(library.resolve(root, "tiny-moe:q8_0"))
    assert len(index.parts) == 3
    # the token went to the Hub with each request
    assert all(auth == "Bearer hf_test_token" for _, _, auth in hub.requests)
    assert pull(root, f"{REPO}:Q4_0") == 0  # again: nothing to fetch
    assert "up to date" in capsys.readouterr().out


def test_an_interrupted_download_resumes_where_it_stopped(
    hub: Hub, tiny: dict[str, bytes], root: Path, capsys, monkeypatch
) -> None:
    hub.repos[REPO] = Repo(dict(tiny))
    name = "Tiny-MoE-Q4_0.gguf"
    size = len(tiny[name])
    hub.cut[name] = size // 3
    monkeypatch.setattr(hf_pull, "RETRIES", 0)  # give up at the first break
    assert pull(root, f"{REPO}:Q4_0") == 1
    err = capsys.readouterr().err
    assert f"broke off at {size // 3} of {size} bytes" in err and "again to resume" in err
    part = root / "tiny-moe:q4_0" / f"{name}.part"
    assert part.stat().st_size == size // 3 and library.models(root) == []
    hub.requests.clear()
    assert pull(root, f"{REPO}:Q4_0") == 0
    ranges = [rng for path, rng, _ in hub.requests if path.endswith(name)]
    assert ranges == [f"bytes={size // 3}-"]  # only the rest was asked for
    assert (root / "tiny-moe:q4_0" / name).read_bytes() == tiny[name] and not part.exists()


def test_a_break_in_the_same_run_is_resumed_there(
    hub: Hub, tiny: dict[str, bytes], root: Path
) -> None:
    hub.repos[REPO] = Repo(dict(tiny))
    name = "Q8_0/Tiny-MoE-Q8_0-00002-of-00003.gguf"
    hub.cut[name] = 1000
    assert pull(root, f"{REPO}:Q8_0") == 0
    ranges = [rng for path, rng, _ in hub.requests if path.endswith(name)]
    assert ranges == [None, "bytes=1000-"]


def test_a_checksum_mismatch_is_refused_and_the_download_removed(
    hub: Hub, tiny: dict[str, bytes], root: Path, capsys
) -> None:
    hub.repos[REPO] = Repo(dict(tiny), wrong_sha={"Q8_0/Tiny-MoE-Q8_0-00003-of-00003.gguf"})
    assert pull(root, f"{REPO}:Q8_0") == 1
    err = capsys.readouterr().err
    assert "Tiny-MoE-Q8_0-00003-of-00003.gguf: checksum mismatch" in err
    folder = root / "tiny-moe:q8_0"
    assert not (folder / "Tiny-MoE-Q8_0-00003-of-00003.gguf").exists()
    assert not list(folder.glob("*.part")) and library.models(root) == []


@pytest.mark.parametrize("status", [401, 403])
def test_a_gated_repository_is_a_clear_error(
    hub: Hub, tiny: dict[str, bytes], root: Path, capsys, status: int
) -> None:
    hub.repos[REPO] = Repo(dict(tiny), gated=status)
    assert pull(root, f"{REPO}:Q4_0") == 1
    err = capsys.readouterr().err
    assert "HF_TOKEN" in err and f"{hub.url}/{REPO}" in err
    assert ("is gated" in err) if status == 403 else ("refused access (401)" in err)
    assert "Traceback" not in err


def test_a_missing_repository_or_quant_is_a_clear_error(
    hub: Hub, tiny: dict[str, bytes], root: Path, capsys
) -> None:
    assert pull(root, "nobody/Nothing-GGUF") == 1
    assert "nobody/Nothing-GGUF: no such repository on http://127.0.0.1" in capsys.readouterr().err
    hub.repos[REPO] = Repo(dict(tiny))
    assert pull(root, f"{REPO}:Q2_K") == 2
    assert "has no quantisation Q2_K (it has: Q4_0, Q8_0)" in capsys.readouterr().err
    assert pull(root, "not a repo") == 2


def test_free_space_is_checked_before_the_first_byte(
    hub: Hub, tiny: dict[str, bytes], root: Path, capsys, monkeypatch
) -> None:
    hub.repos[REPO] = Repo(dict(tiny))
    monkeypatch.setattr(hf_pull, "free_bytes", lambda folder: 1 << 20)
    assert pull(root, f"{REPO}:Q8_0") == 1
    assert "GiB more on the file system" in capsys.readouterr().err
    assert not any("/resolve/" in path for path, _, _ in hub.requests)


def test_the_progress_line_says_size_rate_and_time_left() -> None:
    line = progress_line("m", 3 << 30, 12 << 30, 100 << 20, width=10)
    assert line == "m [##--------] 3.0 GiB / 12.0 GiB  100.0 MiB/s  1m32s left"
    assert progress_line("m", 0, 10, None, width=4) == "m [----] 0 B / 10 B"
    now = [0.0]
    out = io.StringIO()
    bar = ProgressBar("m", 1000, out=out, clock=lambda: now[0])
    bar(400, False)  # resumed bytes count in the bar, not in the rate
    now[0] = 2.0
    bar(200)
    assert "100 B/s" in out.getvalue().splitlines()[-1] and "4s left" in out.getvalue()
