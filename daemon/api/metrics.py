"""``GET /metrics``: Prometheus text format from a registry of the app's own.

Counters and histograms are fed as requests end and generations finish; the gauges (queue, cache,
hit rate, resizes, free VRAM, engine steps) are read from ``daemon.status()`` at scrape time, so
they never go stale. The unlabelled VRAM gauges describe device 0 (as the status's top-level keys
do); the ``strata_device_*`` families repeat them for every device of a split model with a
``device`` label (its number) and a ``name`` label (its compute device), device 0 included. So are
the counted sizes: each thing that grows with requests (a
:class:`Bounded`) is a gauge ``strata_<name>`` and, where it has one, its bound
``strata_<name>_limit``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from strata.daemon.api.generation import Finished
from strata.daemon.bounded import Sizes

if TYPE_CHECKING:
    from strata.daemon.service import Daemon

CONTENT_TYPE = CONTENT_TYPE_LATEST

# seconds; first tokens include queueing and prefill, so they reach further
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self, daemon: Daemon, sizes: Sizes | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "strata_http_requests", "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "strata_prompt_tokens", "prompt tokens of the generations run", registry=r
        )
        self.completion_tokens = Counter("strata_completion_tokens", "tokens generated", registry=r)
        self.generations = Counter(
            "strata_generations",
            "generations by outcome: stop, length, cancelled (the client left or the daemon "
            "stopped while it ran), abandoned (the client left before it started), dropped, error",
            ["outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "strata_time_to_first_token_seconds",
            "from a request's arrival (queueing included) to its first generated token",
            buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "strata_inter_token_latency_seconds", "time between two generated tokens",
            buckets=ITL_BUCKETS, registry=r,
        )  # fmt: skip
        r.register(_StatusCollector(daemon))
        if sizes is not None:
            r.register(_SizesCollector(sizes))

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def generation(self, f: Finished) -> None:
        self.generations.labels(f.outcome).inc()
        r = f.result
        if r is None:
            return
        self.prompt_tokens.inc(r.prompt_tokens)
        self.completion_tokens.inc(r.completion_tokens)
        if r.token_times:
            self.ttft.observe(max(0.0, r.token_times[0] - f.received))
        for a, b in zip(r.token_times, r.token_times[1:], strict=False):
            self.itl.observe(b - a)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StatusCollector(Collector):
    """Gauges from ``daemon.status()``, read at scrape time; absent values are left out."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def collect(self) -> Iterator[Metric]:
        s = self.daemon.status()
        link = s.get("dbus") or {}
        bus_up = link.get("state") == "up"
        gauges = (
            ("strata_queue_length", "generations waiting for the engine", s.get("queued")),
            ("strata_busy", "1 while a generation runs", int(bool(s.get("busy")))),
            ("strata_ready", "1 once the model is loaded", int(s.get("state") == "ready")),
            ("strata_cache_mib", "expert cache size in MiB", s.get("cache_mib")),
            ("strata_cache_experts", "experts the cache holds", s.get("cache_experts")),
            ("strata_cache_hit_rate", "expert cache hit rate (0-1)", s.get("hit_rate")),
            ("strata_kv_mib", "K/V cache mapped in MiB", s.get("kv_mib")),
            (
                "strata_kv_active_tokens",
                "positions of the active conversation's K/V",
                s.get("kv_active_tokens"),
            ),
            (
                "strata_kv_kept_mib",
                "K/V of kept conversations only (freed first) in MiB",
                s.get("kv_kept_mib"),
            ),
            (
                "strata_kv_kept_conversations",
                "conversations kept for prefix reuse",
                len(s.get("kv_kept") or []),
            ),
            (
                "strata_budget_mib",
                "VRAM budget of the expert cache and the K/V in MiB",
                s.get("budget_mib"),
            ),
            ("strata_free_vram_mib", "free VRAM on the device in MiB", s.get("free_mib")),
            ("strata_ours_vram_mib", "VRAM Strata holds in MiB", s.get("ours_mib")),
            ("strata_reserve_mib", "run-time VRAM reserve in MiB", s.get("reserve_mib")),
            ("strata_borrowed_mib", "VRAM lent out by leases in MiB", s.get("borrowed_mib")),
            ("strata_dbus_up", "1 while on the session bus, owning the name", int(bus_up)),
        )
        for name, doc, value in gauges:
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=value)
        yield from _device_gauges(s.get("devices") or [])
        counters = (
            ("strata_cache_resizes", "expert cache resizes", s.get("resizes")),
            ("strata_dbus_reconnects", "bus connections re-established", link.get("reconnects")),
            # safe points passed (prefill chunks and decode steps): the engine's work
            ("strata_engine_steps", "engine steps", self.daemon.worker.steps),
        )
        for name, doc, value in counters:
            if value is not None:
                yield CounterMetricFamily(name, doc, value=value)


# (status key of a device, metric, help): each a gauge with the labels device and name
DEVICE_GAUGES = (
    ("cache_mib", "strata_device_cache_mib", "a device's expert cache size in MiB"),
    ("kv_mib", "strata_device_kv_mib", "a device's K/V cache mapped in MiB"),
    ("budget_mib", "strata_device_budget_mib", "a device's VRAM budget of cache and K/V in MiB"),
    ("free_mib", "strata_device_free_vram_mib", "free VRAM on a device in MiB"),
    ("ours_mib", "strata_device_ours_vram_mib", "VRAM Strata holds on a device in MiB"),
    ("reserve_mib", "strata_device_reserve_mib", "a device's run-time VRAM reserve in MiB"),
    ("borrowed_mib", "strata_device_borrowed_mib", "VRAM lent out by a device's leases in MiB"),
)


def _device_gauges(devices: list[dict[str, Any]]) -> Iterator[Metric]:
    """One family per gauge, one sample per device (absent values left out)."""
    for key, name, doc in DEVICE_GAUGES:
        family = GaugeMetricFamily(name, doc, labels=["device", "name"])
        for d in devices:
            if d.get(key) is not None:
                family.add_metric([str(d["index"]), str(d["compute_device"])], d[key])
        if family.samples:
            yield family


class _SizesCollector(Collector):
    """The counted sizes, read at scrape time."""

    def __init__(self, sizes: Sizes) -> None:
        self.sizes = sizes

    def collect(self) -> Iterator[Metric]:
        for b in self.sizes():
            unit = f" ({b.unit})" if b.unit else ""
            if b.size is not None:
                yield GaugeMetricFamily(f"strata_{b.name}", f"{b.help}{unit}", value=b.size)
            if b.limit is not None:
                yield GaugeMetricFamily(
                    f"strata_{b.name}_limit", f"the most strata_{b.name} can reach{unit}",
                    value=b.limit,
                )  # fmt: skip
