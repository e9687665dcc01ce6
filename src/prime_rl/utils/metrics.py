"""Per-step metrics as JSON lines in `OUTPUT_DIR/metrics/<service>.jsonl`, flushed every step.

Each step appears once: a writer that starts (or resumes) at step n first drops the records of steps >= n
that an earlier run left, since those steps are done again.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from prime_rl.configs import PrometheusConfig
from prime_rl.protocol.files import atomic_write_text, writing
from prime_rl.protocol.paths import metrics_file
from prime_rl.utils.prometheus import serve_metrics


class MetricsWriter:
    """With `prometheus.port` set, each record is also served as Prometheus gauges (utils/prometheus.py)."""

    def __init__(self, output_dir: Path, service: str, first_step: int = 0, prometheus: PrometheusConfig | None = None):
        self.server = serve_metrics(service, prometheus) if prometheus and prometheus.port else None
        self.path = metrics_file(output_dir, service)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(output_dir, service) if r.get("step", 0) < first_step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(self.path, "a")

    def log(self, step: int, metrics: dict) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        with writing(self.path):
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        if self.server is not None:
            self.server.update(step, metrics)

    def close(self) -> None:
        self._file.close()
        if self.server is not None:
            self.server.close()


def read_metrics(output_dir: Path, service: str) -> list[dict]:
    """The records of a metrics file; a line cut short by a crash is skipped."""
    path = metrics_file(output_dir, service)
    return _parse(path.read_text().splitlines()) if path.is_file() else []


def tail_metrics(output_dir: Path, service: str, nbytes: int = 65536) -> list[dict]:
    """The newest records of a metrics file (those in its last `nbytes`): cheap on a long run's file."""
    try:
        with open(metrics_file(output_dir, service), "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - nbytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return []
    return _parse(lines[1:] if size > nbytes else lines)  # the first line read is cut


def _parse(lines: list[str]) -> list[dict]:
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records
