"""Soak: passes of the same varied requests through the daemon, run in this process (its real
loop, HTTP server and engine thread) so that ``tracemalloc`` sees its Python heap.

Every pass sends chats and completions, streamed or not, short and long prompts, prompts past
the context (a 30,000-word one, refused after tokenising) and past the body limit (a
200,000-word one, 413), stop strings, bad JSON, clients that leave mid-stream, and a burst of
concurrent streams. After each request every counted size in ``/metrics`` (``strata_X``) is
within its bound (``strata_X_limit``); after each pass, at rest, the sizes of what belongs to
requests are back to zero. The Python heap (``tracemalloc``'s current size, after a
``gc.collect()``) after the fourth pass may exceed the one after the second by at most
``HEAP_MARGIN_BYTES`` (2 MiB; what the passes leave on the heap is about 0.4 MiB in all): a leak
of more than about 30 KB per request fails at the CI size, of more than 3 KB at 300 requests
per pass. RSS is not asserted (the allocator's high-water mark makes it noisy): it is printed
after each pass (run with ``-s``).

The size in CI is ``TEST_SOAK_REQUESTS`` = 30 requests per pass; set it higher to soak longer:

    TEST_SOAK_REQUESTS=300 ./scripts/test tests/integration/test_soak.py -s
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import re
import threading
import time
import tracemalloc
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from strata.daemon.config import StrataConfig
from strata.daemon.service import Daemon
from strata.engine import synth
from strata.serve import serve_async

REQUESTS = int(os.environ.get("TEST_SOAK_REQUESTS", "30"))
PASSES = 4
HEAP_MARGIN_BYTES = 2 * 2**20  # pass 4 over pass 2
CONTEXT = 1024
MAX_REQUEST_KIB = 1024
AT_REST = ("http_requests_in_progress", "http_body_bytes", "stream_pieces", "engine_jobs")
WORDS = ("river mill stone keeper lighthouse valley winter harvest lantern orchard bridge "
         "meadow ferry willow granary thistle").split()  # fmt: skip


class InProcessDaemon:
    def __init__(self, config: StrataConfig) -> None:
        self._ready: Future[tuple[Daemon, asyncio.Event, asyncio.AbstractEventLoop]] = Future()
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, args=(config,), daemon=True)
        self.thread.start()
        self.daemon, self.stop_event, self.loop = self._ready.result(120)
        self.daemon.worker.ready.result(120)
        self.url = self.daemon.listen_url

    def _run(self, config: StrataConfig) -> None:
        def started(daemon: Daemon, stop: asyncio.Event) -> None:
            self._ready.set_result((daemon, stop, asyncio.get_running_loop()))

        self.code = asyncio.run(serve_async(config, started))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(30)


@pytest.fixture
def daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[InProcessDaemon]:
    for var in ("XDG_RUNTIME_DIR", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
        (tmp_path / var).mkdir(mode=0o700)
        monkeypatch.setenv(var, str(tmp_path / var))
    model = synth.ensure_synthetic("tiny-qwen3moe", tmp_path / "models")
    config = StrataConfig(model=model, port=0, device="cpu", context_length=CONTEXT,
                          max_request_kib=MAX_REQUEST_KIB, max_requests_in_progress=8)  # fmt: skip
    d = InProcessDaemon(config)
    yield d
    d.close()
    assert d.code == 0


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def corpus(n: int, model: str) -> list[tuple[str, str, Any]]:
    """``n`` requests as (kind, path, body): the same for every pass (a fixed seed)."""
    rng = random.Random(16)
    out: list[tuple[str, str, Any]] = []
    for i in range(n):
        pick = i % 10
        if pick == 0:
            out.append(
                (
                    "too long for the context",
                    "/v1/completions",
                    {"model": model, "prompt": words(rng, 30_000), "max_tokens": 4},
                )
            )
        elif pick == 1:
            out.append(
                (
                    "larger than the body limit",
                    "/v1/completions",
                    {"model": model, "prompt": words(rng, 200_000), "max_tokens": 4},
                )
            )
        elif pick == 2:
            out.append(("not JSON", "/v1/chat/completions", b'{"model": "' + b"x" * 5000))
        elif pick == 3:
            out.append(
                (
                    "leaves mid-stream",
                    "/v1/chat/completions",
                    {
                        "model": model,
                        "stream": True,
                        "max_tokens": 64,
                        "messages": [{"role": "user", "content": words(rng, 40)}],
                    },
                )
            )
        elif pick in (4, 5):
            out.append(
                (
                    "streamed",
                    "/v1/completions",
                    {
                        "model": model,
                        "prompt": words(rng, rng.randint(1, 250)),
                        "max_tokens": rng.randint(1, 48),
                        "stream": True,
                        "stream_options": {"include_usage": True},
                        "stop": [rng.choice(WORDS), "é日🙂"],
                    },
                )
            )
        else:
            out.append(
                (
                    "chat",
                    "/v1/chat/completions",
                    {
                        "model": model,
                        "max_tokens": rng.randint(1, 32),
                        "temperature": rng.choice((0.0, 0.8)),
                        "seed": i,
                        "messages": [{"role": "user", "content": words(rng, rng.randint(1, 250))}],
                    },
                )
            )
    return out  # fmt: skip


def sizes(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics", timeout=30).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^strata_(\w+) ([0-9.e+-]+)$", text, re.M)}


def check_bounds(client: httpx.Client, where: str) -> dict[str, float]:
    s = sizes(client)
    counted = [name for name in s if f"{name}_limit" in s]
    assert {"kv_tokens", "engine_jobs", "http_body_bytes", "stream_pieces"} <= set(counted), s
    # the caches that grow with long prompts report their bytes (or count) against their bounds
    assert {"kv_bytes", "kv_kept_bytes", "kv_kept_conversations"} <= set(counted), s
    for name in counted:
        assert s[name] <= s[f"{name}_limit"], f"{where}: strata_{name} {s[name]} over its bound {s}"
    return s


def send(client: httpx.Client, kind: str, path: str, body: Any) -> int:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if kind == "leaves mid-stream":
        with client.stream("POST", path, content=content, headers=headers, timeout=120) as r:
            for _ in r.iter_bytes():
                break  # the first chunk, then the client is gone
            return r.status_code
    r = client.post(path, content=content, headers=headers, timeout=120)
    return r.status_code


EXPECTED = {"too long for the context": 400, "larger than the body limit": 413, "not JSON": 400,
            "leaves mid-stream": 200, "streamed": 200, "chat": 200}  # fmt: skip


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def at_rest(client: httpx.Client, d: InProcessDaemon) -> dict[str, float]:
    """Wait until the engine is idle and what belongs to requests has gone."""
    deadline = time.monotonic() + 300
    while True:
        gc.collect()
        s = check_bounds(client, "at rest")
        if not d.daemon.status()["busy"] and all(s.get(k, 0) == 0 for k in AT_REST):
            return s
        assert time.monotonic() < deadline, f"not at rest after 300 s: {s}"
        time.sleep(0.1)


@pytest.mark.slow
def test_counted_sizes_stay_bounded_and_the_heap_flat_over_passes(daemon: InProcessDaemon) -> None:
    model = daemon.daemon.model_id
    requests = corpus(REQUESTS, model)
    heap: list[int] = []
    with httpx.Client(base_url=daemon.url) as client, ThreadPoolExecutor(4) as pool:
        tracemalloc.start()
        try:
            for n in range(1, PASSES + 1):
                for kind, path, body in requests:
                    assert send(client, kind, path, body) == EXPECTED[kind], kind
                    check_bounds(client, f"pass {n}, after a request that was {kind}")
                # a burst: streams running and waiting at once, each with its own connection
                burst = [b for k, _, b in requests if k == "streamed"][:4]

                def stream(body: dict[str, Any]) -> int:
                    with httpx.Client(base_url=daemon.url) as c:
                        return send(c, "streamed", "/v1/completions", body)

                futures = [pool.submit(stream, b) for b in burst]
                while not all(f.done() for f in futures):
                    check_bounds(client, f"pass {n}, during a burst")
                    time.sleep(0.01)
                assert [f.result() for f in futures] == [200] * len(burst)
                rest = at_rest(client, daemon)
                heap.append(tracemalloc.get_traced_memory()[0])
                print(
                    f"\npass {n}: {len(requests) + len(burst)} requests; Python heap "
                    f"{heap[-1] / 2**10:,.0f} KiB; RSS {rss_mib():.0f} MiB; C allocator "
                    f"{rest.get('malloc_held_bytes', float('nan')) / 2**20:.0f} MiB; K/V holds "
                    f"{rest['kv_tokens']:.0f} of {rest['kv_tokens_limit']:.0f} tokens, "
                    f"{rest['kv_bytes'] / 2**20:.0f} of {rest['kv_bytes_limit'] / 2**20:.0f} MiB"
                )
        finally:
            tracemalloc.stop()
    grown = heap[3] - heap[1]
    assert grown <= HEAP_MARGIN_BYTES, (
        f"the Python heap grew by {grown} bytes from pass 2 to pass 4 (margin "
        f"{HEAP_MARGIN_BYTES}); after each pass: {heap}"
    )
