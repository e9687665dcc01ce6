"""Per-step metrics as JSON lines in `OUTPUT_DIR/metrics/<service>.jsonl`, flushed every step."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from prime_rl.protocol.paths import metrics_file


class MetricsWriter:
    def __init__(self, output_dir: Path, service: str):
        self.path = metrics_file(output_dir, service)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")

    def log(self, step: int, metrics: dict) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def read_metrics(output_dir: Path, service: str) -> list[dict]:
    path = metrics_file(output_dir, service)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
