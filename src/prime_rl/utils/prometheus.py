"""A service's own Prometheus endpoint (the trainer's rank 0, the orchestrator, SFT), for operators who scrape
every process of a run: `GET /metrics` and `GET /health` on `prometheus.port`, served by a daemon thread so a
scrape never waits on the step.

/metrics: each number of the last step's metrics record (`MetricsWriter.log`) as a gauge named after its key,
`prime_rl_<service>_<key>` with every character outside [a-zA-Z0-9_] an underscore (`loss` →
prime_rl_trainer_loss, `time/train` → prime_rl_trainer_time_train, `reward/math` →
prime_rl_orchestrator_reward_math), the step (`prime_rl_<service>_step`) and when it was logged
(`..._last_step_timestamp_seconds`), plus the process's memory and CPU (prometheus_client's process collector).
/health: 200 and JSON `{"service", "step", "doing", "silent_s", "pid"}`: what the work is doing and how long ago
it last advanced (protocol/liveness.py; the launcher judges a hang on the same clock).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily

from prime_rl.configs import PrometheusConfig
from prime_rl.protocol.liveness import progress

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
logger = logging.getLogger("prime_rl")


def metric_name(service: str, key: str) -> str:
    return f"prime_rl_{service}_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


class StepCollector:
    """The last step's numbers as gauges, read when scraped."""

    def __init__(self, service: str):
        self.service, self.lock = service, threading.Lock()
        self.step: int | None = None
        self.logged, self.values = 0.0, {}

    def update(self, step: int, metrics: dict) -> None:
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)}
        with self.lock:
            self.step, self.logged, self.values = step, time.time(), numbers

    def collect(self):
        with self.lock:
            step, logged, values = self.step, self.logged, dict(self.values)
        if step is None:
            return
        name = metric_name(self.service, "step")
        yield GaugeMetricFamily(name, f"the last step {self.service} logged", value=step)
        stamped = metric_name(self.service, "last_step_timestamp_seconds")
        yield GaugeMetricFamily(stamped, "when the last step was logged (unix time)", value=logged)
        seen = {name, stamped}
        for key, value in sorted(values.items()):
            gauge = metric_name(self.service, key)
            if gauge not in seen:  # two keys that differ only in punctuation: the first one
                seen.add(gauge)
                yield GaugeMetricFamily(gauge, f"{key} of the last step", value=value)


def serve_metrics(service: str, config: PrometheusConfig) -> MetricsServer | None:
    """The service's endpoint; None, with a warning, where its port cannot be had: the run trains without it."""
    try:
        return MetricsServer(service, config)
    except OSError as e:
        where = f"{config.host}:{config.port}"
        logger.warning(f"prometheus.port {config.port}: cannot listen on {where} ({e.strerror or e}); {service} "
                       "serves no /metrics or /health")  # fmt: skip
        return None


class MetricsServer:
    """`/metrics` and `/health` of one service on `config.port` (module docstring); `close()` stops it."""

    def __init__(self, service: str, config: PrometheusConfig):
        self.service, self.collector = service, StepCollector(service)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.collector)
        ProcessCollector(registry=registry)
        self.server = ThreadingHTTPServer((config.host, config.port), self._handler(registry))
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, name="prometheus", daemon=True).start()

    def update(self, step: int, metrics: dict) -> None:
        self.collector.update(step, metrics)

    def health(self) -> dict:
        now = progress()
        return {"service": self.service, "step": self.collector.step, "doing": now["doing"],
                "silent_s": round(time.time() - now["time"], 3), "pid": os.getpid()}  # fmt: skip

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self, registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
        served = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/metrics":
                    self._send(200, CONTENT_TYPE, generate_latest(registry))
                elif self.path == "/health":
                    self._send(200, "application/json", json.dumps(served.health()).encode())
                else:
                    self._send(404, "application/json", b'{"error": "not found: /metrics and /health are served"}')

            def _send(self, status: int, content_type: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format, *args) -> None:  # a scrape every few seconds: not a log line each
                pass

        return Handler
