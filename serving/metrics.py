"""The server's Prometheus metrics, in their own registry (several servers per process):
requests by HTTP status, time-to-first-token and inter-token-latency histograms, tokens sent,
requests in flight, and every value of the engine's `LLM.metrics()` as `kimi_linear_engine_*`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from serving.engine_metrics import COUNTERS

if TYPE_CHECKING:
    from serving.engine_loop import EngineLoop

METRIC_PREFIX = "kimi_linear"
# Latency buckets in seconds: CPU runs of the small model reach seconds, GPU decode is ms.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class _EngineCollector:
    """Exports `LLM.metrics()` (the loop's latest snapshot) at scrape time: counters as
    counters, the rest (running, waiting, pages_*, slots_*, and any spec_* / prefix_cache_*
    keys an engine adds) as gauges."""

    def __init__(self, engine: EngineLoop) -> None:
        self.engine = engine

    def collect(self):
        for key, value in sorted(self.engine.snapshot.items()):
            if not isinstance(value, int | float):
                continue
            name = f"{METRIC_PREFIX}_engine_{key}"
            if key in COUNTERS or key == "step_seconds":
                family = CounterMetricFamily(name, f"engine counter {key}", value=value)
            else:
                family = GaugeMetricFamily(name, f"engine gauge {key}", value=value)
            yield family


class ServerMetrics:
    """The server's Prometheus metrics in their own registry (several servers per process)."""

    def __init__(self, engine: EngineLoop, server) -> None:
        """`server`: the `OpenAIServer` (which imports this module) whose load it gauges."""
        self.registry = CollectorRegistry()
        p, r = METRIC_PREFIX, self.registry
        self.requests = Counter(f"{p}_requests", "requests by HTTP status", ["status"], registry=r)
        self.ttft = Histogram(
            f"{p}_time_to_first_token_seconds",
            "time to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            f"{p}_inter_token_latency_seconds",
            "time between tokens",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(f"{p}_generation_tokens", "tokens sent to clients", registry=r)
        in_flight = Gauge(f"{p}_server_in_flight", "requests admitted, not done", registry=r)
        in_flight.set_function(lambda: server.in_flight)
        r.register(_EngineCollector(engine))
