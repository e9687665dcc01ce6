"""The built-in engine's `/metrics`: its counters and the HTTP status counts in Prometheus text format."""

from __future__ import annotations

import collections

from prime_rl.inference.engine import Engine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineCollector:
    """A Prometheus collector reading the engine's counters (and the control plane's status counts) when
    scraped."""

    def __init__(self, engine: Engine, http_counts: collections.Counter):
        self.engine, self.http_counts = engine, http_counts

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        engine = self.engine
        http = CounterMetricFamily(
            "prime_rl_inference_http_requests", "HTTP requests answered", labels=["route", "status"]
        )
        for (route, status), count in sorted(self.http_counts.items()):
            http.add_metric([route, str(status)], count)
        yield http
        yield CounterMetricFamily(
            "prime_rl_inference_requests", "generation requests admitted to the batch", value=engine.requests
        )
        yield CounterMetricFamily(
            "prime_rl_inference_generated_tokens", "tokens generated", value=engine.generated_tokens
        )
        yield GaugeMetricFamily("prime_rl_inference_running", "sequences being decoded", value=engine.running)
        yield GaugeMetricFamily("prime_rl_inference_waiting", "requests waiting for a slot", value=engine.waiting)
        yield GaugeMetricFamily(  # beside running: how full the batch is (the orchestrator's adaptive concurrency)
            "prime_rl_inference_max_batch_size", "most sequences decoded together", value=engine.max_batch_size
        )
        yield GaugeMetricFamily(
            "prime_rl_inference_tokens_per_second",
            "generated tokens per second over the last 10 s",
            value=engine.tokens_per_second(),
        )
        yield GaugeMetricFamily("prime_rl_inference_weight_step", "weight step being served", value=engine.step)


def prometheus_text(engine: Engine, http_counts: collections.Counter) -> bytes:
    """The engine's state in Prometheus text format (one fresh registry per scrape, so no global state)."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, http_counts))
    return generate_latest(registry)
